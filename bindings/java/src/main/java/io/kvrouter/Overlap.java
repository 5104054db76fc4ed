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

  /** The overlap whose slots (Abi.Overlap) start at {@code a[i]}. */
  static Overlap decode(long[] a, int i) {
    return new Overlap(
        a[i + Abi.Overlap.WORKER_ID],
        (int) a[i + Abi.Overlap.DP_RANK],
        (int) a[i + Abi.Overlap.DEVICE_BLOCKS],
        (int) a[i + Abi.Overlap.HOST_BLOCKS],
        (int) a[i + Abi.Overlap.DISK_BLOCKS],
        (int) a[i + Abi.Overlap.EXTERNAL_BLOCKS],
        Native.dbl(a[i + Abi.Overlap.EFFECTIVE_OVERLAP_BLOCKS]),
        a[i + Abi.Overlap.CACHED_TOKENS],
        a[i + Abi.Overlap.TREE_SIZE]);
  }
}
