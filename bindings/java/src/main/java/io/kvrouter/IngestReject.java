package io.kvrouter;

/** Why ingest rejected a message or event (KVR_INGEST_REJECT_*). The ordinal is the C value. */
public enum IngestReject {
  FRAME_TOO_LARGE,
  BAD_FLATBUFFERS,
  BAD_MSGPACK,
  BAD_MESSAGE,
  BLOCK_SIZE,
  INDEX,
  STALE_SEQUENCE;

  private static final IngestReject[] VALUES = values();

  /** The C value. */
  public int code() {
    return ordinal();
  }

  /** The constant for a C value. */
  public static IngestReject of(int code) {
    if (code < 0 || code >= VALUES.length) {
      throw new IllegalArgumentException("no IngestReject with code " + code);
    }
    return VALUES[code];
  }
}
