package io.kvrouter;

/**
 * Where a disaggregated request is prefilled ({@code kvr_prefill_result}).
 *
 * @param remote true: prefill on {@code workerId}/{@code dpRank} of the prefill pool (booked there
 *     under the request id: free it on the prefill router when the prefill ends); false: prefill on
 *     the decode worker, for {@code reason}
 * @param bootstrapRoom uniform in [0, 2^63 − 1]; -1 when not remote
 */
public record PrefillResult(
    boolean remote,
    PrefillReason reason,
    int dpRank,
    long workerId,
    long bootstrapRoom,
    long cachedTokens) {

  static PrefillResult decode(long[] a) {
    return new PrefillResult(
        a[Abi.PrefillResult.REMOTE] != 0,
        PrefillReason.of((int) a[Abi.PrefillResult.REASON]),
        (int) a[Abi.PrefillResult.DP_RANK],
        a[Abi.PrefillResult.WORKER_ID],
        a[Abi.PrefillResult.BOOTSTRAP_ROOM],
        a[Abi.PrefillResult.CACHED_TOKENS]);
  }
}
