package io.kvrouter;

/** Settings of an {@link Ingest} ({@code kvr_ingest_options}); from the library's defaults. */
public final class IngestOptions {
  private final long[] encoded; // kvr_ingest_options in the slots of Abi.IngestOptions

  private IngestOptions(long[] encoded) {
    this.encoded = encoded;
  }

  public static IngestOptions defaults() {
    return builder().build();
  }

  public static Builder builder() {
    return new Builder(Native.ingestOptionsDefaults());
  }

  long[] encoded() {
    return encoded;
  }

  /** Largest stream frame accepted; default (and maximum) 64 MiB. */
  public int maxFrameBytes() {
    return (int) encoded[Abi.IngestOptions.MAX_FRAME_BYTES];
  }

  /** A replay taking longer falls back to clearing the worker; default 2000. */
  public int replayTimeoutMs() {
    return (int) encoded[Abi.IngestOptions.REPLAY_TIMEOUT_MS];
  }

  /** Builds {@link IngestOptions}. */
  public static final class Builder {
    private final long[] e;

    private Builder(long[] encoded) {
      this.e = encoded;
    }

    public Builder maxFrameBytes(int bytes) {
      e[Abi.IngestOptions.MAX_FRAME_BYTES] = Integer.toUnsignedLong(bytes);
      return this;
    }

    public Builder replayTimeoutMs(int ms) {
      e[Abi.IngestOptions.REPLAY_TIMEOUT_MS] = Integer.toUnsignedLong(ms);
      return this;
    }

    public IngestOptions build() {
      return new IngestOptions(e.clone());
    }
  }
}
