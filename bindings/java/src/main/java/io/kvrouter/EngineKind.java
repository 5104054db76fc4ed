package io.kvrouter;

/**
 * The engine behind an EngineWorker (KVR_ENGINE_*); informational, both share the wire format. The
 * ordinal is the C value.
 */
public enum EngineKind {
  VLLM,
  SGLANG;

  private static final EngineKind[] VALUES = values();

  /** The C value. */
  public int code() {
    return ordinal();
  }

  /** The constant for a C value. */
  public static EngineKind of(int code) {
    if (code < 0 || code >= VALUES.length) {
      throw new IllegalArgumentException("no EngineKind with code " + code);
    }
    return VALUES[code];
  }
}
