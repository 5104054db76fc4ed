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
        a[Abi.RouteSignals.WORKER_ID],
        (int) a[Abi.RouteSignals.DP_RANK],
        (int) a[Abi.RouteSignals.OVERLAP_BLOCKS],
        (int) a[Abi.RouteSignals.PROMPT_BLOCKS],
        a[Abi.RouteSignals.CACHED_TOKENS],
        a[Abi.RouteSignals.POTENTIAL_DECODE_BLOCKS],
        a[Abi.RouteSignals.TOTAL_KV_BLOCKS],
        Native.dbl(a[Abi.RouteSignals.COST]),
        a[Abi.RouteSignals.PROMPT_TOKENS],
        a[Abi.RouteSignals.BOOKED] != 0,
        a[Abi.RouteSignals.MOVED] != 0,
        a[Abi.RouteSignals.QUEUED] != 0);
  }

  /** These signals in the slots of Abi.RouteSignals, for kvr_plan_route's {@code previewed}. */
  long[] encode() {
    long[] a = new long[Abi.RouteSignals.LEN];
    a[Abi.RouteSignals.WORKER_ID] = workerId;
    a[Abi.RouteSignals.DP_RANK] = Integer.toUnsignedLong(dpRank);
    a[Abi.RouteSignals.OVERLAP_BLOCKS] = Integer.toUnsignedLong(overlapBlocks);
    a[Abi.RouteSignals.PROMPT_BLOCKS] = Integer.toUnsignedLong(promptBlocks);
    a[Abi.RouteSignals.CACHED_TOKENS] = cachedTokens;
    a[Abi.RouteSignals.POTENTIAL_DECODE_BLOCKS] = potentialDecodeBlocks;
    a[Abi.RouteSignals.TOTAL_KV_BLOCKS] = totalKvBlocks;
    a[Abi.RouteSignals.COST] = Native.bits(cost);
    a[Abi.RouteSignals.PROMPT_TOKENS] = promptTokens;
    a[Abi.RouteSignals.BOOKED] = booked ? 1 : 0;
    a[Abi.RouteSignals.MOVED] = moved ? 1 : 0;
    a[Abi.RouteSignals.QUEUED] = queued ? 1 : 0;
    return a;
  }
}
