package io.kvrouter;

/** Kinds of KV events in the metrics (KVR_EVENT_STORED...). The ordinal is the C value. */
public enum EventKind {
  STORED,
  REMOVED,
  CLEARED;

  private static final EventKind[] VALUES = values();

  /** The C value. */
  public int code() {
    return ordinal();
  }

  /** The constant for a C value. */
  public static EventKind of(int code) {
    if (code < 0 || code >= VALUES.length) {
      throw new IllegalArgumentException("no EventKind with code " + code);
    }
    return VALUES[code];
  }
}
