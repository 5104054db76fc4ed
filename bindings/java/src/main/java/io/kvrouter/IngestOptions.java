package io.kvrouter;

/** Settings of an {@link Ingest} ({@code kvr_ingest_options}); from the library's defaults. */
public final class IngestOptions {
  private final long[] encoded; // max_frame_bytes, replay_timeout_ms

  private IngestOptions(long[] encoded) {
    this.encoded = encoded;
  }

  public static IngestOptions defaults() {
    return builder().build();
  }

  public static Builder builder() {
    return new Builder(Native.defaults(Native.DEFAULTS_INGEST_OPTIONS, Native.INGEST_OPTIONS_LEN));
  }

  long[] encoded() {
    return encoded;
  }

  /** Largest stream frame accepted; default (and maximum) 64 MiB. */
  public int maxFrameBytes() {
    return (int) encoded[0];
  }

  /** A replay taking longer falls back to clearing the worker; default 2000. */
  public int replayTimeoutMs() {
    return (int) encoded[1];
  }

  /** Builds {@link IngestOptions}. */
  public static final class Builder {
    private final long[] e;

    private Builder(long[] encoded) {
      this.e = encoded;
    }

    public Builder maxFrameBytes(int bytes) {
      e[0] = Integer.toUnsignedLong(bytes);
      return this;
    }

    public Builder replayTimeoutMs(int ms) {
      e[1] = Integer.toUnsignedLong(ms);
      return this;
    }

    public IngestOptions build() {
      return new IngestOptions(e.clone());
    }
  }
}
