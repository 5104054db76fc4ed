package io.kvrouter;

/**
 * Order of the admission queue (KVR_QUEUE_*): first come, last come, weighted shortest processing
 * time first. The ordinal is the C value.
 */
public enum QueuePolicy {
  FCFS,
  LCFS,
  WSPT;

  private static final QueuePolicy[] VALUES = values();

  /** The C value. */
  public int code() {
    return ordinal();
  }

  /** The constant for a C value. */
  public static QueuePolicy of(int code) {
    if (code < 0 || code >= VALUES.length) {
      throw new IllegalArgumentException("no QueuePolicy with code " + code);
    }
    return VALUES[code];
  }
}
