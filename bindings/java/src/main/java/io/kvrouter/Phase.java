package io.kvrouter;

/** Which pins of RoutingHints apply (KVR_PHASE_*). The ordinal is the C value. */
public enum Phase {
  AGGREGATED,
  PREFILL,
  DECODE;

  private static final Phase[] VALUES = values();

  /** The C value. */
  public int code() {
    return ordinal();
  }

  /** The constant for a C value. */
  public static Phase of(int code) {
    if (code < 0 || code >= VALUES.length) {
      throw new IllegalArgumentException("no Phase with code " + code);
    }
    return VALUES[code];
  }
}
