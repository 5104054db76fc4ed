package io.kvrouter;

import java.util.Arrays;

/**
 * Per-request options ({@code kvr_request_options}): whether to book the request and under which
 * id, what salts its hashes, which workers may serve it, and per-request overrides of the router's
 * cost settings. Immutable and shareable between threads; the arrays are copied.
 *
 * <p>Overrides left unset keep the router's setting. Without {@link Builder#admit(boolean)} a
 * routing call is a preview and changes nothing.
 */
public final class RequestOptions {
  // Read by the JNI glue: keep the names and types. scalars: kvr_request_options in the slots of
  // Abi.RequestOptions (doubles as raw bits; the glue takes mm_num_blocks and
  // num_allowed_worker_ids from the arrays).
  final long[] scalars;
  final String requestId;
  final String loraName;
  final String cacheNamespace;
  final long[] mmHashes;
  final int[] mmCounts;
  final long[] allowedWorkerIds;
  // Not read by the glue: the flags when nothing but they and the strings differ from the
  // defaults (the options then cross as arguments, not as fields the glue reads one by one), else -1.
  private final int simpleFlags;

  private RequestOptions(Builder b) {
    this.scalars = b.scalars.clone();
    this.requestId = b.requestId;
    this.loraName = b.loraName;
    this.cacheNamespace = b.cacheNamespace;
    this.mmHashes = b.mmHashes;
    this.mmCounts = b.mmCounts;
    this.allowedWorkerIds = b.allowedWorkerIds;
    this.simpleFlags = simpleFlags(scalars, mmHashes, allowedWorkerIds);
  }

  private static int simpleFlags(long[] scalars, long[] mmHashes, long[] allowedWorkerIds) {
    if (mmHashes != null || allowedWorkerIds != null) return -1;
    long[] defaults = Defaults.REQUEST_OPTIONS;
    for (int i = 0; i < scalars.length; ++i) {
      if (i != Abi.RequestOptions.FLAGS && scalars[i] != defaults[i]) return -1;
    }
    long flags = scalars[Abi.RequestOptions.FLAGS];
    return flags >= 0 && flags <= Integer.MAX_VALUE ? (int) flags : -1;
  }

  /** See the field. */
  int simpleFlags() {
    return simpleFlags;
  }

  /** Options that book the request under {@code requestId} (KVR_REQUEST_ADMIT). */
  public static RequestOptions admit(String requestId) {
    return builder().requestId(requestId).admit(true).build();
  }

  /** Options that only name the request (for staged routing and {@code addRequest}). */
  public static RequestOptions withId(String requestId) {
    return builder().requestId(requestId).build();
  }

  /** Starts from the library's defaults: no admission, no overrides, no timeout. */
  public static Builder builder() {
    return new Builder(Defaults.REQUEST_OPTIONS.clone());
  }

  public Builder toBuilder() {
    Builder b = new Builder(scalars.clone());
    b.requestId = requestId;
    b.loraName = loraName;
    b.cacheNamespace = cacheNamespace;
    b.mmHashes = mmHashes;
    b.mmCounts = mmCounts;
    b.allowedWorkerIds = allowedWorkerIds;
    return b;
  }

  public boolean admit() {
    return (scalars[Abi.RequestOptions.FLAGS] & Abi.REQUEST_ADMIT) != 0;
  }

  public String requestId() {
    return requestId;
  }

  public String loraName() {
    return loraName;
  }

  public String cacheNamespace() {
    return cacheNamespace;
  }

  /** A copy of the allowed worker ids, or null (every worker). */
  public long[] allowedWorkerIds() {
    return allowedWorkerIds == null ? null : allowedWorkerIds.clone();
  }

  /** NaN = the router's setting. */
  public double overlapScoreCredit() {
    return Native.dbl(scalars[Abi.RequestOptions.OVERLAP_SCORE_CREDIT]);
  }

  public double prefillLoadScale() {
    return Native.dbl(scalars[Abi.RequestOptions.PREFILL_LOAD_SCALE]);
  }

  public double hostCacheHitWeight() {
    return Native.dbl(scalars[Abi.RequestOptions.HOST_CACHE_HIT_WEIGHT]);
  }

  public double diskCacheHitWeight() {
    return Native.dbl(scalars[Abi.RequestOptions.DISK_CACHE_HIT_WEIGHT]);
  }

  public double temperature() {
    return Native.dbl(scalars[Abi.RequestOptions.TEMPERATURE]);
  }

  /** null = the router's setting. */
  public Boolean assumeKvReuse() {
    return triState(scalars[Abi.RequestOptions.ASSUME_KV_REUSE]);
  }

  public Boolean trackPrefillTokens() {
    return triState(scalars[Abi.RequestOptions.TRACK_PREFILL_TOKENS]);
  }

  public double priorityJump() {
    return Native.dbl(scalars[Abi.RequestOptions.PRIORITY_JUMP]);
  }

  public int expectedOutputTokens() {
    return (int) scalars[Abi.RequestOptions.EXPECTED_OUTPUT_TOKENS];
  }

  /** -1 = wait in the queue as long as it takes. */
  public long queueTimeoutMs() {
    return scalars[Abi.RequestOptions.QUEUE_TIMEOUT_MS];
  }

  /** NaN = the router's setting. */
  public double overlapScoreCreditDecay() {
    return Native.dbl(scalars[Abi.RequestOptions.OVERLAP_SCORE_CREDIT_DECAY]);
  }

  /** NaN = the router's setting. */
  public double decodeActiveRequestWeight() {
    return Native.dbl(scalars[Abi.RequestOptions.DECODE_ACTIVE_REQUEST_WEIGHT]);
  }

  /** null = the router's setting. */
  public CostFunction costFunction() {
    long v = scalars[Abi.RequestOptions.COST_FUNCTION];
    return v < 0 ? null : CostFunction.of((int) v);
  }

  /** NaN = the router's setting. */
  public double ttftMissWeight() {
    return Native.dbl(scalars[Abi.RequestOptions.TTFT_MISS_WEIGHT]);
  }

  private static Boolean triState(long v) {
    return v < 0 ? null : v != 0;
  }

  @Override
  public String toString() {
    return "RequestOptions{requestId="
        + requestId
        + ", admit="
        + admit()
        + ", allowed="
        + Arrays.toString(allowedWorkerIds)
        + "}";
  }

  /** Builds {@link RequestOptions}. */
  public static final class Builder {
    private final long[] scalars;
    private String requestId;
    private String loraName;
    private String cacheNamespace;
    private long[] mmHashes;
    private int[] mmCounts;
    private long[] allowedWorkerIds;

    private Builder(long[] scalars) {
      this.scalars = scalars;
    }

    /** Book the request under its id (KVR_REQUEST_ADMIT); may wait in the admission queue. */
    public Builder admit(boolean admit) {
      int f = Abi.RequestOptions.FLAGS;
      scalars[f] = admit ? (scalars[f] | Abi.REQUEST_ADMIT) : (scalars[f] & ~Abi.REQUEST_ADMIT);
      return this;
    }

    /** Required with admission, for addRequest and for staged routing. */
    public Builder requestId(String requestId) {
      this.requestId = requestId;
      return this;
    }

    public Builder loraName(String loraName) {
      this.loraName = loraName;
      return this;
    }

    public Builder cacheNamespace(String cacheNamespace) {
      this.cacheNamespace = cacheNamespace;
      return this;
    }

    /** Per-block multimodal hashes (block i owns the next counts[i] values); copied. */
    public Builder multimodal(long[] hashes, int[] counts) {
      if ((hashes == null) != (counts == null)) {
        throw new IllegalArgumentException("multimodal hashes and counts go together");
      }
      this.mmHashes = hashes == null ? null : hashes.clone();
      this.mmCounts = counts == null ? null : counts.clone();
      return this;
    }

    /**
     * Restrict the candidates to these workers (and bypass the queue); copied. null allows every
     * worker, an empty array none (routing then fails with KVR_UNAVAILABLE:
     * KVR_REQUEST_ALLOW_LIST).
     */
    public Builder allowedWorkerIds(long... workerIds) {
      this.allowedWorkerIds = workerIds == null ? null : workerIds.clone();
      // Only an empty list needs the flag (without it, count 0 is every worker); a non-empty
      // one then works with a 0.2 library from before the flag too.
      int f = Abi.RequestOptions.FLAGS;
      scalars[f] =
          workerIds != null && workerIds.length == 0
              ? (scalars[f] | Abi.REQUEST_ALLOW_LIST)
              : (scalars[f] & ~Abi.REQUEST_ALLOW_LIST);
      return this;
    }

    /** NaN = the router's setting (as every double override). */
    public Builder overlapScoreCredit(double v) {
      scalars[Abi.RequestOptions.OVERLAP_SCORE_CREDIT] = Native.bits(v);
      return this;
    }

    public Builder prefillLoadScale(double v) {
      scalars[Abi.RequestOptions.PREFILL_LOAD_SCALE] = Native.bits(v);
      return this;
    }

    public Builder hostCacheHitWeight(double v) {
      scalars[Abi.RequestOptions.HOST_CACHE_HIT_WEIGHT] = Native.bits(v);
      return this;
    }

    public Builder diskCacheHitWeight(double v) {
      scalars[Abi.RequestOptions.DISK_CACHE_HIT_WEIGHT] = Native.bits(v);
      return this;
    }

    public Builder temperature(double v) {
      scalars[Abi.RequestOptions.TEMPERATURE] = Native.bits(v);
      return this;
    }

    /** null = the router's setting. */
    public Builder assumeKvReuse(Boolean v) {
      scalars[Abi.RequestOptions.ASSUME_KV_REUSE] = v == null ? -1 : (v ? 1 : 0);
      return this;
    }

    /** null = the router's setting. */
    public Builder trackPrefillTokens(Boolean v) {
      scalars[Abi.RequestOptions.TRACK_PREFILL_TOKENS] = v == null ? -1 : (v ? 1 : 0);
      return this;
    }

    /** Queue priority boost; default 0. */
    public Builder priorityJump(double v) {
      scalars[Abi.RequestOptions.PRIORITY_JUMP] = Native.bits(v);
      return this;
    }

    public Builder expectedOutputTokens(int tokens) {
      scalars[Abi.RequestOptions.EXPECTED_OUTPUT_TOKENS] = Integer.toUnsignedLong(tokens);
      return this;
    }

    /** Give up waiting in the queue after this long (KVR_DEADLINE_EXCEEDED); -1 = never. */
    public Builder queueTimeoutMs(long ms) {
      scalars[Abi.RequestOptions.QUEUE_TIMEOUT_MS] = ms;
      return this;
    }

    /** This request's {@link RouterOptions.Builder#overlapScoreCreditDecay}; NaN = the router's. */
    public Builder overlapScoreCreditDecay(double v) {
      scalars[Abi.RequestOptions.OVERLAP_SCORE_CREDIT_DECAY] = Native.bits(v);
      return this;
    }

    /**
     * This request's {@link RouterOptions.Builder#decodeActiveRequestWeight}; NaN = the router's.
     */
    public Builder decodeActiveRequestWeight(double v) {
      scalars[Abi.RequestOptions.DECODE_ACTIVE_REQUEST_WEIGHT] = Native.bits(v);
      return this;
    }

    /** This request's {@link RouterOptions.Builder#costFunction}; null = the router's. */
    public Builder costFunction(CostFunction cost) {
      scalars[Abi.RequestOptions.COST_FUNCTION] = cost == null ? -1 : cost.code();
      return this;
    }

    /** This request's {@link RouterOptions.Builder#ttftMissWeight}; NaN = the router's. */
    public Builder ttftMissWeight(double v) {
      scalars[Abi.RequestOptions.TTFT_MISS_WEIGHT] = Native.bits(v);
      return this;
    }

    public RequestOptions build() {
      return new RequestOptions(this);
    }
  }
}
