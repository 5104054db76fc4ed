package io.kvrouter;

/**
 * The signals of a preview or a plan ({@code kvr_route_signals}).
 *
 * @param overlapBlocks leading prompt blocks cached on the rank's device
 * @param cachedTokens round(effective overlap × block size)
 * @param potentialDecodeBlocks the rank's active blocks plus the prompt's new ones
 * @param totalKvBlocks the worker's KV capacity; 0 = not reported
 * @param cost the rank's cost
 * @param booked true for a plan
 * @param moved plan: the previewed (or soft-session) rank was no longer eligible
 * @param queued plan: it waited in the admission queue
 */
public record RouteSignals(
    long workerId,
    int dpRank,
    int overlapBlocks,
    int promptBlocks,
    long cachedTokens,
    long potentialDecodeBlocks,
    long totalKvBlocks,
    double cost,
    long promptTokens,
    boolean booked,
    boolean moved,
    boolean queued) {

  static RouteSignals decode(long[] a) {
    return new RouteSignals(
        a[0],
        (int) a[1],
        (int) a[2],
        (int) a[3],
        a[4],
        a[5],
        a[6],
        Native.dbl(a[7]),
        a[8],
        a[9] != 0,
        a[10] != 0,
        a[11] != 0);
  }

  long[] encode() {
    return new long[] {
      workerId,
      Integer.toUnsignedLong(dpRank),
      Integer.toUnsignedLong(overlapBlocks),
      Integer.toUnsignedLong(promptBlocks),
      cachedTokens,
      potentialDecodeBlocks,
      totalKvBlocks,
      Native.bits(cost),
      promptTokens,
      booked ? 1 : 0,
      moved ? 1 : 0,
      queued ? 1 : 0
    };
  }
}
