package io.kvrouter;

/**
 * One candidate rank of a routing decision with every term of its cost ({@code kvr_candidate}):
 * {@code cost = prefillLoadScale · max(0, rawPrefillBlocks − credit) + decodeBlocks +
 * requestCost}, where {@code credit = overlapScoreCredit · creditDecay · deviceBlocks +
 * hostCacheHitWeight · hostBlocks + diskCacheHitWeight · (diskBlocks + externalBlocks)}.
 *
 * @param chosen whether this rank was picked
 * @param probability the chance this rank had of being picked
 * @param creditDecay the factor the device credit was multiplied by: 1 without {@code
 *     overlapScoreCreditDecay}, below 1 for a rank with more prefill queued than the least loaded
 *     candidate
 * @param activeRequests the requests in flight on this rank
 * @param requestCost {@code decodeActiveRequestWeight × activeRequests} (part of {@code cost})
 */
public record Candidate(
    long workerId,
    int dpRank,
    int deviceBlocks,
    int hostBlocks,
    int diskBlocks,
    int externalBlocks,
    boolean chosen,
    double effectiveOverlapBlocks,
    long cachedTokens,
    long activePrefillTokens,
    long activeBlocks,
    long newBlocks,
    double rawPrefillBlocks,
    double credit,
    double prefillCost,
    long decodeBlocks,
    double cost,
    double probability,
    double creditDecay,
    long activeRequests,
    double requestCost) {

  /** The candidate whose slots (Abi.Candidate) start at {@code a[i]}. */
  static Candidate decode(long[] a, int i) {
    return new Candidate(
        a[i + Abi.Candidate.WORKER_ID],
        (int) a[i + Abi.Candidate.DP_RANK],
        (int) a[i + Abi.Candidate.DEVICE_BLOCKS],
        (int) a[i + Abi.Candidate.HOST_BLOCKS],
        (int) a[i + Abi.Candidate.DISK_BLOCKS],
        (int) a[i + Abi.Candidate.EXTERNAL_BLOCKS],
        a[i + Abi.Candidate.CHOSEN] != 0,
        Native.dbl(a[i + Abi.Candidate.EFFECTIVE_OVERLAP_BLOCKS]),
        a[i + Abi.Candidate.CACHED_TOKENS],
        a[i + Abi.Candidate.ACTIVE_PREFILL_TOKENS],
        a[i + Abi.Candidate.ACTIVE_BLOCKS],
        a[i + Abi.Candidate.NEW_BLOCKS],
        Native.dbl(a[i + Abi.Candidate.RAW_PREFILL_BLOCKS]),
        Native.dbl(a[i + Abi.Candidate.CREDIT]),
        Native.dbl(a[i + Abi.Candidate.PREFILL_COST]),
        a[i + Abi.Candidate.DECODE_BLOCKS],
        Native.dbl(a[i + Abi.Candidate.COST]),
        Native.dbl(a[i + Abi.Candidate.PROBABILITY]),
        Native.dbl(a[i + Abi.Candidate.CREDIT_DECAY]),
        a[i + Abi.Candidate.ACTIVE_REQUESTS],
        Native.dbl(a[i + Abi.Candidate.REQUEST_COST]));
  }
}
