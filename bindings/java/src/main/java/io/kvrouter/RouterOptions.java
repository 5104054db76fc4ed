package io.kvrouter;

/**
 * Every router-wide setting ({@code kvr_router_options}, Dynamo's KvRouterConfig). Immutable;
 * {@link #builder()} starts from the library's own defaults ({@code kvr_router_options_init}).
 */
public final class RouterOptions {
  static final int FLAG_APPROXIMATE = 0x1;
  static final int FLAG_NO_KV_REUSE = 0x2;
  static final int FLAG_NO_PREFILL_TRACKING = 0x4;
  static final int FLAG_EAGLE = 0x8;
  static final int FLAG_ENTROPY_SEED = 0x10;
  static final int FLAG_TRACK_OUTPUT_BLOCKS = 0x20;

  private final long[] encoded; // Native.ROUTER_OPTIONS_LEN, see Builder.encode

  private RouterOptions(long[] encoded) {
    this.encoded = encoded;
  }

  /** The library's defaults. */
  public static RouterOptions defaults() {
    return builder().build();
  }

  public static Builder builder() {
    return new Builder(Native.defaults(Native.DEFAULTS_ROUTER_OPTIONS, Native.ROUTER_OPTIONS_LEN));
  }

  /** A builder holding these settings. */
  public Builder toBuilder() {
    return new Builder(encoded.clone());
  }

  long[] encoded() {
    return encoded;
  }

  public int blockSize() {
    return (int) encoded[0];
  }

  private boolean flag(int flag) {
    return (encoded[1] & flag) != 0;
  }

  public boolean approximate() {
    return flag(FLAG_APPROXIMATE);
  }

  public boolean assumeKvReuse() {
    return !flag(FLAG_NO_KV_REUSE);
  }

  public boolean trackPrefillTokens() {
    return !flag(FLAG_NO_PREFILL_TRACKING);
  }

  public boolean eagle() {
    return flag(FLAG_EAGLE);
  }

  public boolean entropySeed() {
    return flag(FLAG_ENTROPY_SEED);
  }

  /** Whether {@link Router#recordOutput(String, long)} grows requests' blocks. */
  public boolean trackOutputBlocks() {
    return flag(FLAG_TRACK_OUTPUT_BLOCKS);
  }

  public QueuePolicy queuePolicy() {
    return QueuePolicy.of((int) encoded[2]);
  }

  public double overlapScoreCredit() {
    return Native.dbl(encoded[3]);
  }

  public double prefillLoadScale() {
    return Native.dbl(encoded[4]);
  }

  public double hostCacheHitWeight() {
    return Native.dbl(encoded[5]);
  }

  public double diskCacheHitWeight() {
    return Native.dbl(encoded[6]);
  }

  public double temperature() {
    return Native.dbl(encoded[7]);
  }

  public double queueThreshold() {
    return Native.dbl(encoded[8]);
  }

  public double approxTtlSeconds() {
    return Native.dbl(encoded[9]);
  }

  public long approxMaxBlocks() {
    return encoded[10];
  }

  public double approxPruneTargetRatio() {
    return Native.dbl(encoded[11]);
  }

  public double requestExpirySeconds() {
    return Native.dbl(encoded[12]);
  }

  public long randomSeed() {
    return encoded[13];
  }

  /** 0 (default) = a device hit keeps its full credit however long the rank's prefill queue. */
  public double overlapScoreCreditDecay() {
    return Native.dbl(encoded[14]);
  }

  /** 0 (default) = requests in flight cost nothing beyond their blocks. */
  public double decodeActiveRequestWeight() {
    return Native.dbl(encoded[15]);
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
      e[1] = on ? (e[1] | flag) : (e[1] & ~flag);
      return this;
    }

    /** Tokens per KV block; default 16; every worker must match. */
    public Builder blockSize(int blockSize) {
      e[0] = Integer.toUnsignedLong(blockSize);
      return this;
    }

    /** No KV events: routing decisions are recorded as cached blocks with a TTL. */
    public Builder approximate(boolean approximate) {
      return flag(FLAG_APPROXIMATE, approximate);
    }

    /** Default true; false = KVR_ROUTER_NO_KV_REUSE. */
    public Builder assumeKvReuse(boolean assume) {
      return flag(FLAG_NO_KV_REUSE, !assume);
    }

    /** Default true; false = KVR_ROUTER_NO_PREFILL_TRACKING. */
    public Builder trackPrefillTokens(boolean track) {
      return flag(FLAG_NO_PREFILL_TRACKING, !track);
    }

    /** The model uses eagle block windows. */
    public Builder eagle(boolean eagle) {
      return flag(FLAG_EAGLE, eagle);
    }

    /** Seed the random source from the OS instead of {@link #randomSeed(long)}. */
    public Builder entropySeed(boolean entropy) {
      return flag(FLAG_ENTROPY_SEED, entropy);
    }

    /**
     * Grow a request's blocks as it generates, from {@link Router#recordOutput(String, long)}
     * (KVR_ROUTER_TRACK_OUTPUT_BLOCKS, Dynamo's router_track_output_blocks); default false.
     */
    public Builder trackOutputBlocks(boolean track) {
      return flag(FLAG_TRACK_OUTPUT_BLOCKS, track);
    }

    public Builder queuePolicy(QueuePolicy policy) {
      e[2] = policy.code();
      return this;
    }

    public Builder overlapScoreCredit(double v) {
      e[3] = Native.bits(v);
      return this;
    }

    public Builder prefillLoadScale(double v) {
      e[4] = Native.bits(v);
      return this;
    }

    public Builder hostCacheHitWeight(double v) {
      e[5] = Native.bits(v);
      return this;
    }

    /** Weight of disk and external tier hits. */
    public Builder diskCacheHitWeight(double v) {
      e[6] = Native.bits(v);
      return this;
    }

    /** 0 (default): argmin with a random tie-break; above 0: softmax over normalised costs. */
    public Builder temperature(double v) {
      e[7] = Native.bits(v);
      return this;
    }

    /**
     * Queue when every rank's prefill tokens exceed threshold × max_num_batched_tokens; negative
     * (default) = never queue.
     */
    public Builder queueThreshold(double v) {
      e[8] = Native.bits(v);
      return this;
    }

    public Builder approxTtlSeconds(double v) {
      e[9] = Native.bits(v);
      return this;
    }

    public Builder approxMaxBlocks(long v) {
      e[10] = v;
      return this;
    }

    public Builder approxPruneTargetRatio(double v) {
      e[11] = Native.bits(v);
      return this;
    }

    /** A booked request older than this is dropped; default 300. */
    public Builder requestExpirySeconds(double v) {
      e[12] = Native.bits(v);
      return this;
    }

    public Builder randomSeed(long seed) {
      e[13] = seed;
      return this;
    }

    /**
     * Discounts a device hit on a rank with a longer prefill queue than the least loaded
     * candidate's: its device credit is multiplied by {@code 1 / (1 + decay × excess prefill
     * blocks / prompt blocks)} ({@link Candidate#creditDecay()}). Default 0 (off); must not be
     * negative.
     */
    public Builder overlapScoreCreditDecay(double v) {
      e[14] = Native.bits(v);
      return this;
    }

    /**
     * Adds {@code weight × active requests} to each rank's cost ({@link
     * Candidate#requestCost()}). Default 0 (off); must not be negative.
     */
    public Builder decodeActiveRequestWeight(double v) {
      e[15] = Native.bits(v);
      return this;
    }

    /** Settings are checked by the library when the router is created. */
    public RouterOptions build() {
      return new RouterOptions(e.clone());
    }
  }
}
