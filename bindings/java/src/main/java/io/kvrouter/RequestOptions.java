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
  static final int FLAG_ADMIT = 0x1;

  // Read by the JNI glue: keep the names and types. scalars: flags, overlap_score_credit,
  // prefill_load_scale, host_cache_hit_weight, disk_cache_hit_weight, temperature (doubles as
  // raw bits), assume_kv_reuse, track_prefill_tokens, priority_jump (bits),
  // expected_output_tokens, queue_timeout_ms, overlap_score_credit_decay,
  // decode_active_request_weight (bits).
  final long[] scalars;
  final String requestId;
  final String loraName;
  final String cacheNamespace;
  final long[] mmHashes;
  final int[] mmCounts;
  final long[] allowedWorkerIds;

  private RequestOptions(Builder b) {
    this.scalars = b.scalars.clone();
    this.requestId = b.requestId;
    this.loraName = b.loraName;
    this.cacheNamespace = b.cacheNamespace;
    this.mmHashes = b.mmHashes;
    this.mmCounts = b.mmCounts;
    this.allowedWorkerIds = b.allowedWorkerIds;
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
    return (scalars[0] & FLAG_ADMIT) != 0;
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
    return Native.dbl(scalars[1]);
  }

  public double prefillLoadScale() {
    return Native.dbl(scalars[2]);
  }

  public double hostCacheHitWeight() {
    return Native.dbl(scalars[3]);
  }

  public double diskCacheHitWeight() {
    return Native.dbl(scalars[4]);
  }

  public double temperature() {
    return Native.dbl(scalars[5]);
  }

  /** null = the router's setting. */
  public Boolean assumeKvReuse() {
    return triState(scalars[6]);
  }

  public Boolean trackPrefillTokens() {
    return triState(scalars[7]);
  }

  public double priorityJump() {
    return Native.dbl(scalars[8]);
  }

  public int expectedOutputTokens() {
    return (int) scalars[9];
  }

  /** -1 = wait in the queue as long as it takes. */
  public long queueTimeoutMs() {
    return scalars[10];
  }

  /** NaN = the router's setting. */
  public double overlapScoreCreditDecay() {
    return Native.dbl(scalars[11]);
  }

  /** NaN = the router's setting. */
  public double decodeActiveRequestWeight() {
    return Native.dbl(scalars[12]);
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
      scalars[0] = admit ? (scalars[0] | FLAG_ADMIT) : (scalars[0] & ~FLAG_ADMIT);
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

    /** Restrict the candidates to these workers (and bypass the queue); null = all. Copied. */
    public Builder allowedWorkerIds(long... workerIds) {
      this.allowedWorkerIds = workerIds == null ? null : workerIds.clone();
      return this;
    }

    /** NaN = the router's setting (as every double override). */
    public Builder overlapScoreCredit(double v) {
      scalars[1] = Native.bits(v);
      return this;
    }

    public Builder prefillLoadScale(double v) {
      scalars[2] = Native.bits(v);
      return this;
    }

    public Builder hostCacheHitWeight(double v) {
      scalars[3] = Native.bits(v);
      return this;
    }

    public Builder diskCacheHitWeight(double v) {
      scalars[4] = Native.bits(v);
      return this;
    }

    public Builder temperature(double v) {
      scalars[5] = Native.bits(v);
      return this;
    }

    /** null = the router's setting. */
    public Builder assumeKvReuse(Boolean v) {
      scalars[6] = v == null ? -1 : (v ? 1 : 0);
      return this;
    }

    /** null = the router's setting. */
    public Builder trackPrefillTokens(Boolean v) {
      scalars[7] = v == null ? -1 : (v ? 1 : 0);
      return this;
    }

    /** Queue priority boost; default 0. */
    public Builder priorityJump(double v) {
      scalars[8] = Native.bits(v);
      return this;
    }

    public Builder expectedOutputTokens(int tokens) {
      scalars[9] = Integer.toUnsignedLong(tokens);
      return this;
    }

    /** Give up waiting in the queue after this long (KVR_DEADLINE_EXCEEDED); -1 = never. */
    public Builder queueTimeoutMs(long ms) {
      scalars[10] = ms;
      return this;
    }

    /** This request's {@link RouterOptions.Builder#overlapScoreCreditDecay}; NaN = the router's. */
    public Builder overlapScoreCreditDecay(double v) {
      scalars[11] = Native.bits(v);
      return this;
    }

    /**
     * This request's {@link RouterOptions.Builder#decodeActiveRequestWeight}; NaN = the router's.
     */
    public Builder decodeActiveRequestWeight(double v) {
      scalars[12] = Native.bits(v);
      return this;
    }

    public RequestOptions build() {
      return new RequestOptions(this);
    }
  }
}
