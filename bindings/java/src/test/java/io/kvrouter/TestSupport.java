package io.kvrouter;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.time.Duration;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.function.BooleanSupplier;
import java.util.function.Supplier;

/** Helpers shared by the tests. */
final class TestSupport {
  private TestSupport() {}

  static final int BLOCK = 16;

  /** n tokens base, base + 1, ... */
  static int[] tokens(int n, int base) {
    int[] t = new int[n];
    for (int i = 0; i < n; ++i) t[i] = base + i;
    return t;
  }

  /** Engine hashes for n blocks, distinct per base. */
  static long[] engineHashes(int n, long base) {
    long[] h = new long[n];
    for (int i = 0; i < n; ++i) h[i] = base + i;
    return h;
  }

  /** A stored event: worker holds the first {@code blocks} blocks of {@code prompt}. */
  static StoredEvent stored(long worker, int[] prompt, int blocks, long hashBase) {
    int[] t = new int[blocks * BLOCK];
    System.arraycopy(prompt, 0, t, 0, t.length);
    return StoredEvent.builder(worker)
        .eventId(hashBase)
        .blockHashes(engineHashes(blocks, hashBase))
        .tokenIds(t)
        .build();
  }

  static Router routerWithWorkers(int workers) {
    Router router = new Router(RouterOptions.builder().blockSize(BLOCK).randomSeed(7).build());
    for (int w = 1; w <= workers; ++w) router.addWorker(w);
    return router;
  }

  /**
   * Runs {@code call} on a daemon thread of its own (not the common pool, which has one thread on
   * a two-core machine and which a call that never returns would keep).
   */
  static <T> CompletableFuture<T> onThread(String name, Supplier<T> call) {
    CompletableFuture<T> future = new CompletableFuture<>();
    Thread thread =
        new Thread(
            () -> {
              try {
                future.complete(call.get());
              } catch (Throwable e) {
                future.completeExceptionally(e);
              }
            },
            name);
    thread.setDaemon(true);
    thread.start();
    return future;
  }

  /** {@code call} ends within 10 s by throwing KvRouterException with CANCELLED; returns it. */
  static KvRouterException cancelledWithin10s(CompletableFuture<?> call) {
    ExecutionException e =
        assertThrows(ExecutionException.class, () -> call.get(10, TimeUnit.SECONDS));
    assertTrue(e.getCause() instanceof KvRouterException, e.getCause().toString());
    KvRouterException cause = (KvRouterException) e.getCause();
    assertEquals(Status.CANCELLED, cause.status());
    return cause;
  }

  /** Polls until true or throws AssertionError after the timeout. */
  static void await(String what, Duration timeout, BooleanSupplier condition) {
    long deadline = System.nanoTime() + timeout.toNanos();
    while (!condition.getAsBoolean()) {
      if (System.nanoTime() > deadline) throw new AssertionError("timed out waiting for " + what);
      try {
        Thread.sleep(2);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
        throw new AssertionError("interrupted waiting for " + what);
      }
    }
  }
}
