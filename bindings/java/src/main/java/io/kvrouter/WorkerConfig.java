package io.kvrouter;

/**
 * A worker's registration ({@code kvr_worker_config}): its id, data-parallel ranks and capacity.
 * Immutable; {@link #builder(long)} starts from the library's defaults.
 */
public final class WorkerConfig {
  private final long[] encoded; // block_size, worker_id, dp_start, dp_size, total, max batched

  private WorkerConfig(long[] encoded) {
    this.encoded = encoded;
  }

  /** Worker {@code workerId} with the defaults: rank 0 only, the router's block size. */
  public static WorkerConfig of(long workerId) {
    return builder(workerId).build();
  }

  public static Builder builder(long workerId) {
    return new Builder(Native.defaults(Native.DEFAULTS_WORKER_CONFIG, Native.WORKER_CONFIG_LEN))
        .workerId(workerId);
  }

  long[] encoded() {
    return encoded;
  }

  public long workerId() {
    return encoded[1];
  }

  public int blockSize() {
    return (int) encoded[0];
  }

  public int dpStart() {
    return (int) encoded[2];
  }

  public int dpSize() {
    return (int) encoded[3];
  }

  public long totalKvBlocks() {
    return encoded[4];
  }

  public long maxNumBatchedTokens() {
    return encoded[5];
  }

  @Override
  public String toString() {
    return "WorkerConfig{workerId="
        + Long.toUnsignedString(workerId())
        + ", dpStart="
        + dpStart()
        + ", dpSize="
        + dpSize()
        + "}";
  }

  /** Builds {@link WorkerConfig}. */
  public static final class Builder {
    private final long[] e;

    private Builder(long[] encoded) {
      this.e = encoded;
    }

    public Builder workerId(long workerId) {
      e[1] = workerId;
      return this;
    }

    /** 0 (default) = the router's; anything else must equal it. */
    public Builder blockSize(int blockSize) {
      e[0] = Integer.toUnsignedLong(blockSize);
      return this;
    }

    /** First data-parallel rank; default 0. */
    public Builder dpStart(int dpStart) {
      e[2] = Integer.toUnsignedLong(dpStart);
      return this;
    }

    /** Number of ranks; default 1. */
    public Builder dpSize(int dpSize) {
      e[3] = Integer.toUnsignedLong(dpSize);
      return this;
    }

    /** KV capacity in blocks; 0 (default) = not reported. */
    public Builder totalKvBlocks(long blocks) {
      e[4] = blocks;
      return this;
    }

    /** 0 (default) = not reported (the queue then uses 10,000,000). */
    public Builder maxNumBatchedTokens(long tokens) {
      e[5] = tokens;
      return this;
    }

    public WorkerConfig build() {
      return new WorkerConfig(e.clone());
    }
  }
}
