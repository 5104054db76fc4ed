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

  static Candidate decode(long[] a, int i) {
    return new Candidate(
        a[i],
        (int) a[i + 1],
        (int) a[i + 2],
        (int) a[i + 3],
        (int) a[i + 4],
        (int) a[i + 5],
        a[i + 6] != 0,
        Native.dbl(a[i + 7]),
        a[i + 8],
        a[i + 9],
        a[i + 10],
        a[i + 11],
        Native.dbl(a[i + 12]),
        Native.dbl(a[i + 13]),
        Native.dbl(a[i + 14]),
        a[i + 15],
        Native.dbl(a[i + 16]),
        Native.dbl(a[i + 17]),
        Native.dbl(a[i + 18]),
        a[i + 19],
        Native.dbl(a[i + 20]));
  }
}
