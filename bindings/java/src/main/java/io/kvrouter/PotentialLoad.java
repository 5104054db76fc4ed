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

  static PotentialLoad decode(long[] a, int i) {
    return new PotentialLoad(
        a[i], (int) a[i + 1], a[i + 2], a[i + 3], a[i + 4], a[i + 5], a[i + 6]);
  }
}
