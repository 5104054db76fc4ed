package io.kvrouter;

/**
 * What one rank holds of a prompt's prefix, per tier ({@code kvr_overlap}).
 *
 * @param treeSize blocks the rank holds in the index
 */
public record Overlap(
    long workerId,
    int dpRank,
    int deviceBlocks,
    int hostBlocks,
    int diskBlocks,
    int externalBlocks,
    double effectiveOverlapBlocks,
    long cachedTokens,
    long treeSize) {

  static Overlap decode(long[] a, int i) {
    return new Overlap(
        a[i],
        (int) a[i + 1],
        (int) a[i + 2],
        (int) a[i + 3],
        (int) a[i + 4],
        (int) a[i + 5],
        Native.dbl(a[i + 6]),
        a[i + 7],
        a[i + 8]);
  }
}
