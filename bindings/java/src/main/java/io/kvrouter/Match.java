package io.kvrouter;

/**
 * What one rank holds of a hashed prompt's prefix, per tier, each tier continuing where the
 * previous one stops ({@code kvr_match}, from {@link Router#findMatches}): the index walk alone,
 * without the cost model's figures of an {@link Overlap}.
 *
 * @param deviceBlocks leading blocks on the device (Dynamo's {@code find_matches} depth)
 * @param treeSize blocks the rank holds in the index
 */
public record Match(
    long workerId,
    int dpRank,
    int deviceBlocks,
    int hostBlocks,
    int diskBlocks,
    int externalBlocks,
    long treeSize) {

  /** The match whose slots (Abi.Match) start at {@code a[i]}. */
  static Match decode(long[] a, int i) {
    return new Match(
        a[i + Abi.Match.WORKER_ID],
        (int) a[i + Abi.Match.DP_RANK],
        (int) a[i + Abi.Match.DEVICE_BLOCKS],
        (int) a[i + Abi.Match.HOST_BLOCKS],
        (int) a[i + Abi.Match.DISK_BLOCKS],
        (int) a[i + Abi.Match.EXTERNAL_BLOCKS],
        a[i + Abi.Match.TREE_SIZE]);
  }
}
