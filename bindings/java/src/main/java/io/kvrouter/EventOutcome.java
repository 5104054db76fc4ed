package io.kvrouter;

/**
 * What the index did with an event (KVR_EVENT_OK and the rejection reasons). The ordinal is the C
 * value.
 */
public enum EventOutcome {
  OK,
  PARENT_BLOCK_NOT_FOUND,
  BLOCK_NOT_FOUND,
  INVALID_BLOCK_SEQUENCE,
  INVALID_BLOCK;

  private static final EventOutcome[] VALUES = values();

  /** The C value. */
  public int code() {
    return ordinal();
  }

  /** The constant for a C value. */
  public static EventOutcome of(int code) {
    if (code < 0 || code >= VALUES.length) {
      throw new IllegalArgumentException("no EventOutcome with code " + code);
    }
    return VALUES[code];
  }
}
