package io.kvrouter;

/** Why a prefill runs where it runs (KVR_PREFILL_*). The ordinal is the C value. */
public enum PrefillReason {
  REMOTE,
  NO_PREFILL_WORKERS,
  SHORT_ISL,
  WORKER_BUSY;

  private static final PrefillReason[] VALUES = values();

  /** The C value. */
  public int code() {
    return ordinal();
  }

  /** The constant for a C value. */
  public static PrefillReason of(int code) {
    if (code < 0 || code >= VALUES.length) {
      throw new IllegalArgumentException("no PrefillReason with code " + code);
    }
    return VALUES[code];
  }
}
