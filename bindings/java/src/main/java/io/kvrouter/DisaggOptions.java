package io.kvrouter;

/**
 * Settings of a {@link DisaggRouter} ({@code kvr_disagg_options}): when to prefill locally instead
 * of on the prefill pool. Immutable; {@link #builder()} starts from the library's defaults (always
 * remote, not enforced, 512 tokens, ratio 1.0, busy threshold 1.0, no decode-busy signal).
 */
public final class DisaggOptions {
  private final long[] encoded; // kvr_disagg_options in the slots of Abi.DisaggOptions

  private DisaggOptions(long[] encoded) {
    this.encoded = encoded;
  }

  public static DisaggOptions defaults() {
    return builder().build();
  }

  public static Builder builder() {
    return new Builder(Native.disaggOptionsDefaults());
  }

  long[] encoded() {
    return encoded;
  }

  public DisaggPolicy policy() {
    return DisaggPolicy.of((int) encoded[Abi.DisaggOptions.POLICY]);
  }

  public boolean enforce() {
    return encoded[Abi.DisaggOptions.ENFORCE] != 0;
  }

  public long maxLocalPrefillTokens() {
    return encoded[Abi.DisaggOptions.MAX_LOCAL_PREFILL_TOKENS];
  }

  public double maxLocalPrefillRatio() {
    return Native.dbl(encoded[Abi.DisaggOptions.MAX_LOCAL_PREFILL_RATIO]);
  }

  public double prefillBusyThreshold() {
    return Native.dbl(encoded[Abi.DisaggOptions.PREFILL_BUSY_THRESHOLD]);
  }

  public double decodeBusyThreshold() {
    return Native.dbl(encoded[Abi.DisaggOptions.DECODE_BUSY_THRESHOLD]);
  }

  /** Builds {@link DisaggOptions}. */
  public static final class Builder {
    private final long[] e;

    private Builder(long[] encoded) {
      this.e = encoded;
    }

    public Builder policy(DisaggPolicy policy) {
      e[Abi.DisaggOptions.POLICY] = policy.code();
      return this;
    }

    /** true: an empty prefill pool is {@link Status#FAILED_PRECONDITION}, not aggregated. */
    public Builder enforce(boolean enforce) {
      e[Abi.DisaggOptions.ENFORCE] = enforce ? 1 : 0;
      return this;
    }

    /** isl_bounding: local when the uncached prompt is at most this many tokens ... */
    public Builder maxLocalPrefillTokens(long tokens) {
      e[Abi.DisaggOptions.MAX_LOCAL_PREFILL_TOKENS] = tokens;
      return this;
    }

    /** ... and at most this fraction of the prompt. */
    public Builder maxLocalPrefillRatio(double ratio) {
      e[Abi.DisaggOptions.MAX_LOCAL_PREFILL_RATIO] = Native.bits(ratio);
      return this;
    }

    /** prefill_load: busy above this × max_num_batched_tokens prefill tokens. */
    public Builder prefillBusyThreshold(double threshold) {
      e[Abi.DisaggOptions.PREFILL_BUSY_THRESHOLD] = Native.bits(threshold);
      return this;
    }

    /**
     * Never prefill locally on a decode rank whose decode blocks exceed this fraction of its
     * total_kv_blocks; negative (default) = the signal is unavailable (never local).
     */
    public Builder decodeBusyThreshold(double threshold) {
      e[Abi.DisaggOptions.DECODE_BUSY_THRESHOLD] = Native.bits(threshold);
      return this;
    }

    public DisaggOptions build() {
      return new DisaggOptions(e.clone());
    }
  }
}
