package io.kvrouter;

/** Storage tiers of cached blocks (KVR_TIER_*). The ordinal is the C value. */
public enum Tier {
  DEVICE,
  HOST_PINNED,
  DISK,
  EXTERNAL;

  private static final Tier[] VALUES = values();

  /** The C value. */
  public int code() {
    return ordinal();
  }

  /** The constant for a C value. */
  public static Tier of(int code) {
    if (code < 0 || code >= VALUES.length) {
      throw new IllegalArgumentException("no Tier with code " + code);
    }
    return VALUES[code];
  }
}
