package io.kvrouter;

import java.lang.invoke.MethodHandles;
import java.lang.invoke.VarHandle;
import java.lang.ref.Cleaner;
import java.util.concurrent.locks.LockSupport;

/**
 * The base of every class that owns a native object: {@link AutoCloseable}, with a {@link Cleaner}
 * as a safety net for objects never closed, and a guard that keeps {@link #close()} from freeing
 * the native object while a call is using it.
 *
 * <p>The guard is one counter of calls in progress plus a closed bit, changed with atomic adds:
 * calls never wait for each other (the C functions they make are concurrent where kvrouter.h says
 * so), and a call made after {@code close()} throws {@link IllegalStateException} instead of
 * touching freed memory. {@code close()} sets the bit, wakes the calls in progress that could wait
 * for good ({@link #closing()}: a router closes its admission queue), waits for the calls in
 * progress to return, then drops the owner's reference to the native object. {@link
 * #closeOnAnotherThread} sets the bit and leaves the rest to a new thread (an {@link Ingest}
 * closed from a replica publisher).
 */
abstract class NativeObject implements AutoCloseable {
  private static final Cleaner CLEANER = Cleaner.create();
  private static final long CLOSED = 1L << 62;
  private static final long CALLS = CLOSED - 1;
  private static final VarHandle STATE;

  static {
    try {
      STATE = MethodHandles.lookup().findVarHandle(NativeObject.class, "state", long.class);
    } catch (ReflectiveOperationException e) {
      throw new ExceptionInInitializerError(e);
    }
  }

  @SuppressWarnings("unused") // through STATE
  private volatile long state;

  final NativeResource resource;
  private final Cleaner.Cleanable cleanable;

  NativeObject(NativeResource resource) {
    this.resource = resource;
    this.cleanable = CLEANER.register(this, resource::release);
  }

  /**
   * Starts a call: returns the native handle, or throws {@link IllegalStateException} once closed.
   * Every acquire is paired with {@link #release()} in a finally block.
   */
  final long acquire() {
    long previous = (long) STATE.getAndAdd(this, 1L);
    if ((previous & CLOSED) != 0) {
      STATE.getAndAdd(this, -1L);
      throw new IllegalStateException(getClass().getSimpleName() + " is closed");
    }
    return resource.handle;
  }

  /** Ends a call started by {@link #acquire()}. */
  final void release() {
    STATE.getAndAdd(this, -1L);
  }

  /** True once {@link #close()} has been called. */
  public final boolean isClosed() {
    return ((long) STATE.getVolatile(this) & CLOSED) != 0;
  }

  /**
   * Frees the native object, once every call in progress on this object has returned (this may wait
   * for them; {@link #closing()} first ends those that would otherwise wait for good). Idempotent;
   * later calls on the object throw {@link IllegalStateException}.
   */
  @Override
  public void close() {
    long previous = (long) STATE.getAndBitwiseOr(this, CLOSED);
    if ((previous & CLOSED) != 0) return;
    finishClose();
  }

  /**
   * As {@link #close()}, but once later calls are refused, the rest (the wait for the calls in
   * progress and the free) runs on a new daemon thread named {@code threadName}: for a close
   * from a replica publisher ({@link ReplicaSink#inPublisher()}), whose thread must not wait for
   * those calls nor free the object. Returns at once.
   *
   * @throws OutOfMemoryError (or another error of {@link Thread#start()}) if no thread could be
   *     started: the object is then open as before
   */
  final void closeOnAnotherThread(String threadName) {
    long previous = (long) STATE.getAndBitwiseOr(this, CLOSED);
    if ((previous & CLOSED) != 0) return;
    try {
      Thread thread = new Thread(this::finishClose, threadName);
      thread.setDaemon(true);
      thread.start();
    } catch (RuntimeException | Error e) {
      STATE.getAndBitwiseAnd(this, ~CLOSED); // nothing was done: still open
      throw e;
    }
  }

  /** The rest of {@link #close()}, once this object is marked closed. */
  private void finishClose() {
    Throwable failed = null;
    try {
      closing();
    } catch (RuntimeException | Error e) {
      failed = e; // still freed below; thrown after
    }
    awaitNoCalls();
    try {
      beforeFree();
    } finally {
      cleanable.clean();
    }
    if (failed instanceof RuntimeException e) throw e;
    if (failed instanceof Error e) throw e;
  }

  /**
   * Runs in {@link #close()} once later calls are refused, before it waits for the calls in
   * progress: wakes those that could otherwise wait for good (a routing call blocked in an
   * admission queue). The native object is still live ({@code resource.handle}).
   */
  void closing() {}

  /** Runs in {@link #close()} after the calls in progress returned, before the free. */
  void beforeFree() {}

  private void awaitNoCalls() {
    boolean interrupted = false;
    for (int round = 0; ((long) STATE.getVolatile(this) & CALLS) != 0; ++round) {
      if (round < 64) {
        Thread.onSpinWait();
      } else {
        LockSupport.parkNanos(Math.min(1_000_000L, 1_000L << Math.min(round - 64, 10)));
        if (Thread.interrupted()) interrupted = true;
      }
    }
    if (interrupted) Thread.currentThread().interrupt();
  }
}
