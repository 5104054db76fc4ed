package io.kvrouter;

/** When a disaggregated router prefills locally (KVR_DISAGG_*). The ordinal is the C value. */
public enum DisaggPolicy {
  ALWAYS,
  ISL_BOUNDING,
  PREFILL_LOAD,
  ISL_OR_LOAD;

  private static final DisaggPolicy[] VALUES = values();

  /** The C value. */
  public int code() {
    return ordinal();
  }

  /** The constant for a C value. */
  public static DisaggPolicy of(int code) {
    if (code < 0 || code >= VALUES.length) {
      throw new IllegalArgumentException("no DisaggPolicy with code " + code);
    }
    return VALUES[code];
  }
}
