package io.kvrouter;

import java.util.concurrent.atomic.AtomicInteger;
import java.util.function.LongConsumer;

/**
 * One native object and the references that keep it alive: its Java owner's, and those of native
 * objects that depend on it (an ingest object needs its router; a pool router of a disaggregated
 * router needs the {@code kvr_disagg}). The native free function runs once, when the last reference
 * goes, and then releases the parent this object depended on.
 *
 * <p>Holds no reference to any Java wrapper, so it can serve as a {@link java.lang.ref.Cleaner}
 * action.
 */
final class NativeResource {
  final long handle;
  private final LongConsumer free; // null: nothing to free (a view owned by the parent)
  private final NativeResource parent;
  private final AtomicInteger references = new AtomicInteger(1);

  NativeResource(long handle, LongConsumer free, NativeResource parent) {
    this.handle = handle;
    this.free = free;
    this.parent = parent;
  }

  /** Only while a reference is held (the holder's wrapper is acquired). */
  void retain() {
    if (references.getAndIncrement() <= 0) {
      throw new IllegalStateException("native object already freed");
    }
  }

  void release() {
    int left = references.decrementAndGet();
    if (left > 0) return;
    if (left < 0) throw new IllegalStateException("native object released twice");
    try {
      if (free != null) free.accept(handle);
    } finally {
      if (parent != null) parent.release();
    }
  }
}
