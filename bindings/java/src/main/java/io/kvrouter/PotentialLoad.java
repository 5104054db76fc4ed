package io.kvrouter;

/** The load one registered rank would carry with a prompt ({@code kvr_potential_load}). */
public record PotentialLoad(
    long workerId,
    int dpRank,
    long potentialPrefillTokens,
    long potentialDecodeBlocks,
    long activePrefillTokens,
    long activeBlocks,
    long activeRequests) {

  /** The load whose slots (Abi.PotentialLoad) start at {@code a[i]}. */
  static PotentialLoad decode(long[] a, int i) {
    return new PotentialLoad(
        a[i + Abi.PotentialLoad.WORKER_ID],
        (int) a[i + Abi.PotentialLoad.DP_RANK],
        a[i + Abi.PotentialLoad.POTENTIAL_PREFILL_TOKENS],
        a[i + Abi.PotentialLoad.POTENTIAL_DECODE_BLOCKS],
        a[i + Abi.PotentialLoad.ACTIVE_PREFILL_TOKENS],
        a[i + Abi.PotentialLoad.ACTIVE_BLOCKS],
        a[i + Abi.PotentialLoad.ACTIVE_REQUESTS]);
  }
}
