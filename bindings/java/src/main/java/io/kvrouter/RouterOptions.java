package io.kvrouter;

/**
 * Every router-wide setting ({@code kvr_router_options}, Dynamo's KvRouterConfig). Immutable;
 * {@link #builder()} starts from the library's own defaults ({@code kvr_router_options_init}).
 */
public final class RouterOptions {
  private final long[] encoded; // kvr_router_options in the slots of Abi.RouterOptions

  private RouterOptions(long[] encoded) {
    this.encoded = encoded;
  }

  /** The library's defaults. */
  public static RouterOptions defaults() {
    return builder().build();
  }

  public static Builder builder() {
    return new Builder(Native.routerOptionsDefaults());
  }

  /** A builder holding these settings. */
  public Builder toBuilder() {
    return new Builder(encoded.clone());
  }

  long[] encoded() {
    return encoded;
  }

  public int blockSize() {
    return (int) encoded[Abi.RouterOptions.BLOCK_SIZE];
  }

  private boolean flag(int flag) {
    return (encoded[Abi.RouterOptions.FLAGS] & flag) != 0;
  }

  public boolean approximate() {
    return flag(Abi.ROUTER_APPROXIMATE);
  }

  public boolean assumeKvReuse() {
    return !flag(Abi.ROUTER_NO_KV_REUSE);
  }

  public boolean trackPrefillTokens() {
    return !flag(Abi.ROUTER_NO_PREFILL_TRACKING);
  }

  public boolean eagle() {
    return flag(Abi.ROUTER_EAGLE);
  }

  public boolean entropySeed() {
    return flag(Abi.ROUTER_ENTROPY_SEED);
  }

  /** Whether {@link Router#recordOutput(String, long)} grows requests' blocks. */
  public boolean trackOutputBlocks() {
    return flag(Abi.ROUTER_TRACK_OUTPUT_BLOCKS);
  }

  public QueuePolicy queuePolicy() {
    return QueuePolicy.of((int) encoded[Abi.RouterOptions.QUEUE_POLICY]);
  }

  public double overlapScoreCredit() {
    return Native.dbl(encoded[Abi.RouterOptions.OVERLAP_SCORE_CREDIT]);
  }

  public double prefillLoadScale() {
    return Native.dbl(encoded[Abi.RouterOptions.PREFILL_LOAD_SCALE]);
  }

  public double hostCacheHitWeight() {
    return Native.dbl(encoded[Abi.RouterOptions.HOST_CACHE_HIT_WEIGHT]);
  }

  public double diskCacheHitWeight() {
    return Native.dbl(encoded[Abi.RouterOptions.DISK_CACHE_HIT_WEIGHT]);
  }

  public double temperature() {
    return Native.dbl(encoded[Abi.RouterOptions.TEMPERATURE]);
  }

  public double queueThreshold() {
    return Native.dbl(encoded[Abi.RouterOptions.QUEUE_THRESHOLD]);
  }

  public double approxTtlSeconds() {
    return Native.dbl(encoded[Abi.RouterOptions.APPROX_TTL_SECONDS]);
  }

  public long approxMaxBlocks() {
    return encoded[Abi.RouterOptions.APPROX_MAX_BLOCKS];
  }

  public double approxPruneTargetRatio() {
    return Native.dbl(encoded[Abi.RouterOptions.APPROX_PRUNE_TARGET_RATIO]);
  }

  public double requestExpirySeconds() {
    return Native.dbl(encoded[Abi.RouterOptions.REQUEST_EXPIRY_SECONDS]);
  }

  public long randomSeed() {
    return encoded[Abi.RouterOptions.RANDOM_SEED];
  }

  /** 0 (default) = a device hit keeps its full credit however long the rank's prefill queue. */
  public double overlapScoreCreditDecay() {
    return Native.dbl(encoded[Abi.RouterOptions.OVERLAP_SCORE_CREDIT_DECAY]);
  }

  /** 0 (default) = requests in flight cost nothing beyond their blocks. */
  public double decodeActiveRequestWeight() {
    return Native.dbl(encoded[Abi.RouterOptions.DECODE_ACTIVE_REQUEST_WEIGHT]);
  }

  /** Trees the KV index splits the workers over; 1 (default) = one tree. */
  public int indexShards() {
    return (int) encoded[Abi.RouterOptions.INDEX_SHARDS];
  }

  /** {@link CostFunction#CREDIT} (default) or {@link CostFunction#PREDICTED_TTFT}. */
  public CostFunction costFunction() {
    return CostFunction.of((int) encoded[Abi.RouterOptions.COST_FUNCTION]);
  }

  /** {@link CostFunction#PREDICTED_TTFT}'s rate before a completion; 0 (default) = unknown. */
  public double prefillTokensPerSecond() {
    return Native.dbl(encoded[Abi.RouterOptions.PREFILL_TOKENS_PER_SECOND]);
  }

  /** {@link CostFunction#PREDICTED_TTFT}'s weight of a miss's own prefill time; default 3. */
  public double ttftMissWeight() {
    return Native.dbl(encoded[Abi.RouterOptions.TTFT_MISS_WEIGHT]);
  }

  @Override
  public String toString() {
    return "RouterOptions{blockSize="
        + blockSize()
        + ", approximate="
        + approximate()
        + ", queuePolicy="
        + queuePolicy()
        + ", temperature="
        + temperature()
        + ", queueThreshold="
        + queueThreshold()
        + "}";
  }

  /** Builds {@link RouterOptions}; every setting starts at the library's default. */
  public static final class Builder {
    private final long[] e;

    private Builder(long[] encoded) {
      this.e = encoded;
    }

    private Builder flag(int flag, boolean on) {
      int f = Abi.RouterOptions.FLAGS;
      e[f] = on ? (e[f] | flag) : (e[f] & ~flag);
      return this;
    }

    /** Tokens per KV block; default 16; every worker must match. */
    public Builder blockSize(int blockSize) {
      e[Abi.RouterOptions.BLOCK_SIZE] = Integer.toUnsignedLong(blockSize);
      return this;
    }

    /** No KV events: routing decisions are recorded as cached blocks with a TTL. */
    public Builder approximate(boolean approximate) {
      return flag(Abi.ROUTER_APPROXIMATE, approximate);
    }

    /** Default true; false = KVR_ROUTER_NO_KV_REUSE. */
    public Builder assumeKvReuse(boolean assume) {
      return flag(Abi.ROUTER_NO_KV_REUSE, !assume);
    }

    /** Default true; false = KVR_ROUTER_NO_PREFILL_TRACKING. */
    public Builder trackPrefillTokens(boolean track) {
      return flag(Abi.ROUTER_NO_PREFILL_TRACKING, !track);
    }

    /** The model uses eagle block windows. */
    public Builder eagle(boolean eagle) {
      return flag(Abi.ROUTER_EAGLE, eagle);
    }

    /** Seed the random source from the OS instead of {@link #randomSeed(long)}. */
    public Builder entropySeed(boolean entropy) {
      return flag(Abi.ROUTER_ENTROPY_SEED, entropy);
    }

    /**
     * Grow a request's blocks as it generates, from {@link Router#recordOutput(String, long)}
     * (KVR_ROUTER_TRACK_OUTPUT_BLOCKS, Dynamo's router_track_output_blocks); default false.
     */
    public Builder trackOutputBlocks(boolean track) {
      return flag(Abi.ROUTER_TRACK_OUTPUT_BLOCKS, track);
    }

    public Builder queuePolicy(QueuePolicy policy) {
      e[Abi.RouterOptions.QUEUE_POLICY] = policy.code();
      return this;
    }

    public Builder overlapScoreCredit(double v) {
      e[Abi.RouterOptions.OVERLAP_SCORE_CREDIT] = Native.bits(v);
      return this;
    }

    public Builder prefillLoadScale(double v) {
      e[Abi.RouterOptions.PREFILL_LOAD_SCALE] = Native.bits(v);
      return this;
    }

    public Builder hostCacheHitWeight(double v) {
      e[Abi.RouterOptions.HOST_CACHE_HIT_WEIGHT] = Native.bits(v);
      return this;
    }

    /** Weight of disk and external tier hits. */
    public Builder diskCacheHitWeight(double v) {
      e[Abi.RouterOptions.DISK_CACHE_HIT_WEIGHT] = Native.bits(v);
      return this;
    }

    /** 0 (default): argmin with a random tie-break; above 0: softmax over normalised costs. */
    public Builder temperature(double v) {
      e[Abi.RouterOptions.TEMPERATURE] = Native.bits(v);
      return this;
    }

    /**
     * Queue when every rank's prefill tokens exceed threshold × max_num_batched_tokens; negative
     * (default) = never queue.
     */
    public Builder queueThreshold(double v) {
      e[Abi.RouterOptions.QUEUE_THRESHOLD] = Native.bits(v);
      return this;
    }

    public Builder approxTtlSeconds(double v) {
      e[Abi.RouterOptions.APPROX_TTL_SECONDS] = Native.bits(v);
      return this;
    }

    public Builder approxMaxBlocks(long v) {
      e[Abi.RouterOptions.APPROX_MAX_BLOCKS] = v;
      return this;
    }

    public Builder approxPruneTargetRatio(double v) {
      e[Abi.RouterOptions.APPROX_PRUNE_TARGET_RATIO] = Native.bits(v);
      return this;
    }

    /** A booked request older than this is dropped; default 300. */
    public Builder requestExpirySeconds(double v) {
      e[Abi.RouterOptions.REQUEST_EXPIRY_SECONDS] = Native.bits(v);
      return this;
    }

    public Builder randomSeed(long seed) {
      e[Abi.RouterOptions.RANDOM_SEED] = seed;
      return this;
    }

    /**
     * Discounts a device hit on a rank with a longer prefill queue than the least loaded
     * candidate's: its device credit is multiplied by {@code 1 / (1 + decay × excess prefill
     * blocks / prompt blocks)} ({@link Candidate#creditDecay()}). Default 0 (off); must not be
     * negative.
     */
    public Builder overlapScoreCreditDecay(double v) {
      e[Abi.RouterOptions.OVERLAP_SCORE_CREDIT_DECAY] = Native.bits(v);
      return this;
    }

    /**
     * Adds {@code weight × active requests} to each rank's cost ({@link
     * Candidate#requestCost()}). Default 0 (off); must not be negative.
     */
    public Builder decodeActiveRequestWeight(double v) {
      e[Abi.RouterOptions.DECODE_ACTIVE_REQUEST_WEIGHT] = Native.bits(v);
      return this;
    }

    /**
     * Trees the KV index splits the workers over, 1..64; default 1. Events of workers in
     * different trees apply in parallel (one writer lock per tree), so several threads applying
     * events scale; every lookup walks every tree (on the Mooncake trace 2 trees cost 1.4x a
     * lookup, 4 cost 2.3x). The answers are the same whatever the count. Passed on as given:
     * the library refuses 0 and values above 64 ({@link Status#INVALID_ARGUMENT}).
     */
    public Builder indexShards(int shards) {
      e[Abi.RouterOptions.INDEX_SHARDS] = Integer.toUnsignedLong(shards);
      return this;
    }

    /**
     * How a candidate rank is priced; default {@link CostFunction#CREDIT} (Dynamo's). {@link
     * CostFunction#PREDICTED_TTFT} prices each rank as the seconds until this prompt's first
     * token: (its prefill tokens in flight + the prompt's uncached tokens) / the prefill rate,
     * learnt from the time between booking and {@link Router#markPrefillCompleted(String)} of
     * every request (one rate for the fleet), plus {@link
     * #ttftMissWeight} × the uncached tokens' own time. The credit-form weights do not apply; it
     * needs prefill tracking (the library refuses it with {@code trackPrefillTokens(false)}).
     */
    public Builder costFunction(CostFunction cost) {
      e[Abi.RouterOptions.COST_FUNCTION] = cost.code();
      return this;
    }

    /**
     * {@link CostFunction#PREDICTED_TTFT}: the prefill rate (prompt tokens per second) assumed
     * before the first completion; default 0 = unknown (every rank equally fast until one
     * completes). Finite, >= 0.
     */
    public Builder prefillTokensPerSecond(double v) {
      e[Abi.RouterOptions.PREFILL_TOKENS_PER_SECOND] = Native.bits(v);
      return this;
    }

    /**
     * {@link CostFunction#PREDICTED_TTFT}: the weight of the uncached tokens' own time, the delay
     * a miss adds for the requests that will queue behind it. Default 2; finite, >= 0.
     */
    public Builder ttftMissWeight(double v) {
      e[Abi.RouterOptions.TTFT_MISS_WEIGHT] = Native.bits(v);
      return this;
    }

    /** Settings are checked by the library when the router is created. */
    public RouterOptions build() {
      return new RouterOptions(e.clone());
    }
  }
}
