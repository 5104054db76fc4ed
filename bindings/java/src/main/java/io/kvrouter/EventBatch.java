package io.kvrouter;

import java.time.Instant;
import java.util.Objects;

/**
 * Collects KV events and encodes them as one FlatBuffers EventBatch ({@code kvr_event_batch}): the
 * format {@link Router#applyEventBatch(byte[])}, ingest listeners and NATS subscriptions take. For
 * publishers in any engine.
 *
 * <p>The C object is not thread-safe; this class serialises its methods (and {@link
 * Publisher#send(EventBatch)}) on the batch, so sharing one between threads is safe, if rarely
 * useful.
 */
public final class EventBatch extends NativeObject {
  public EventBatch() {
    super(new NativeResource(Native.eventBatchNew(), Native::eventBatchFree, null));
  }

  /**
   * Appends a copy of the event, validated as {@link Router#applyStored} validates its arguments.
   */
  public synchronized EventBatch addStored(StoredEvent event) {
    Objects.requireNonNull(event, "event");
    long h = acquire();
    try {
      Native.eventBatchAddStored(h, event);
    } finally {
      release();
    }
    return this;
  }

  public synchronized EventBatch addRemoved(RemovedEvent event) {
    Objects.requireNonNull(event, "event");
    long h = acquire();
    try {
      Native.eventBatchAddRemoved(h, event);
    } finally {
      release();
    }
    return this;
  }

  public synchronized EventBatch addCleared(long workerId, int dpRank, long eventId) {
    long h = acquire();
    try {
      Native.eventBatchAddCleared(h, workerId, dpRank, eventId);
    } finally {
      release();
    }
    return this;
  }

  /**
   * The batch's publication time, in nanoseconds since the Unix epoch: ingest measures its lag from
   * it. Until set, a batch is stamped with the wall clock when encoded or sent; 0 leaves it
   * unstamped (no lag measured). Cleared by {@link #clear()}.
   */
  public synchronized EventBatch setPublishTime(long unixNanos) {
    long h = acquire();
    try {
      Native.eventBatchSetPublishTime(h, unixNanos);
    } finally {
      release();
    }
    return this;
  }

  /** {@link #setPublishTime(long)} from an instant. */
  public EventBatch setPublishTime(Instant time) {
    return setPublishTime(
        Math.addExact(Math.multiplyExact(time.getEpochSecond(), 1_000_000_000L), time.getNano()));
  }

  /** Events added so far. */
  public synchronized int size() {
    long h = acquire();
    try {
      return Math.toIntExact(Native.eventBatchSize(h));
    } finally {
      release();
    }
  }

  /** Encodes the events added so far; the batch keeps them. */
  public synchronized byte[] encode() {
    long h = acquire();
    try {
      return Native.eventBatchEncode(h);
    } finally {
      release();
    }
  }

  /** Drops the events (and any publish time set). */
  public synchronized EventBatch clear() {
    long h = acquire();
    try {
      Native.eventBatchClear(h);
    } finally {
      release();
    }
    return this;
  }
}
