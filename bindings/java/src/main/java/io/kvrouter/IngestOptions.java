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

  /**
   * How often {@link Ingest#syncReplicas} publishes a heartbeat ({@link
   * Router#replicaHeartbeat}); default 1000, 0 = none, at most 3,600,000.
   */
  public int replicaHeartbeatMs() {
    return (int) encoded[Abi.IngestOptions.REPLICA_HEARTBEAT_MS];
  }

  /**
   * How long a replica that sent heartbeats may stay silent before its bookings are dropped
   * ({@link Router#expireReplicas}); default 10000, 0 = never, at most 3,600,000.
   */
  public int replicaTimeoutMs() {
    return (int) encoded[Abi.IngestOptions.REPLICA_TIMEOUT_MS];
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

    public Builder replicaHeartbeatMs(int ms) {
      e[Abi.IngestOptions.REPLICA_HEARTBEAT_MS] = Integer.toUnsignedLong(ms);
      return this;
    }

    public Builder replicaTimeoutMs(int ms) {
      e[Abi.IngestOptions.REPLICA_TIMEOUT_MS] = Integer.toUnsignedLong(ms);
      return this;
    }

    public IngestOptions build() {
      return new IngestOptions(e.clone());
    }
  }
}
