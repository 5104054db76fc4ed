package io.kvrouter;

/**
 * A worker's registration ({@code kvr_worker_config}): its id, data-parallel ranks and capacity.
 * Immutable; {@link #builder(long)} starts from the library's defaults.
 */
public final class WorkerConfig {
  private final long[] encoded; // kvr_worker_config in the slots of Abi.WorkerConfig

  private WorkerConfig(long[] encoded) {
    this.encoded = encoded;
  }

  /** Worker {@code workerId} with the defaults: rank 0 only, the router's block size. */
  public static WorkerConfig of(long workerId) {
    return builder(workerId).build();
  }

  public static Builder builder(long workerId) {
    return new Builder(Native.workerConfigDefaults()).workerId(workerId);
  }

  long[] encoded() {
    return encoded;
  }

  public long workerId() {
    return encoded[Abi.WorkerConfig.WORKER_ID];
  }

  public int blockSize() {
    return (int) encoded[Abi.WorkerConfig.BLOCK_SIZE];
  }

  public int dpStart() {
    return (int) encoded[Abi.WorkerConfig.DP_START];
  }

  public int dpSize() {
    return (int) encoded[Abi.WorkerConfig.DP_SIZE];
  }

  public long totalKvBlocks() {
    return encoded[Abi.WorkerConfig.TOTAL_KV_BLOCKS];
  }

  public long maxNumBatchedTokens() {
    return encoded[Abi.WorkerConfig.MAX_NUM_BATCHED_TOKENS];
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
      e[Abi.WorkerConfig.WORKER_ID] = workerId;
      return this;
    }

    /** 0 (default) = the router's; anything else must equal it. */
    public Builder blockSize(int blockSize) {
      e[Abi.WorkerConfig.BLOCK_SIZE] = Integer.toUnsignedLong(blockSize);
      return this;
    }

    /** First data-parallel rank; default 0. */
    public Builder dpStart(int dpStart) {
      e[Abi.WorkerConfig.DP_START] = Integer.toUnsignedLong(dpStart);
      return this;
    }

    /** Number of ranks; default 1. */
    public Builder dpSize(int dpSize) {
      e[Abi.WorkerConfig.DP_SIZE] = Integer.toUnsignedLong(dpSize);
      return this;
    }

    /** KV capacity in blocks; 0 (default) = not reported. */
    public Builder totalKvBlocks(long blocks) {
      e[Abi.WorkerConfig.TOTAL_KV_BLOCKS] = blocks;
      return this;
    }

    /** 0 (default) = not reported (the queue then uses 10,000,000). */
    public Builder maxNumBatchedTokens(long tokens) {
      e[Abi.WorkerConfig.MAX_NUM_BATCHED_TOKENS] = tokens;
      return this;
    }

    public WorkerConfig build() {
      return new WorkerConfig(e.clone());
    }
  }
}
