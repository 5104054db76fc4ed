package io.kvrouter;

/**
 * Session affinity (KVR_SESSION_*): HARD makes the bound rank the exact target, SOFT a preference.
 * The ordinal is the C value.
 */
public enum SessionMode {
  HARD,
  SOFT;

  private static final SessionMode[] VALUES = values();

  /** The C value. */
  public int code() {
    return ordinal();
  }

  /** The constant for a C value. */
  public static SessionMode of(int code) {
    if (code < 0 || code >= VALUES.length) {
      throw new IllegalArgumentException("no SessionMode with code " + code);
    }
    return VALUES[code];
  }
}
