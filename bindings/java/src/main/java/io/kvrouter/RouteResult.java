package io.kvrouter;

import java.util.ArrayList;
import java.util.Collections;
import java.util.List;

/**
 * The decision for one request ({@code kvr_route_result}), with the candidates' cost breakdowns
 * when asked for.
 *
 * @param workerId the chosen worker (unsigned)
 * @param promptBlocks complete blocks in the prompt
 * @param deviceOverlapBlocks leading blocks cached on the chosen rank's device
 * @param effectiveOverlapBlocks device plus tier-weighted lower-tier hits
 * @param cachedTokens round(effectiveOverlapBlocks × block size)
 * @param cost the chosen rank's cost
 * @param booked the request is now active on the chosen rank
 * @param queued it waited in the admission queue first
 * @param candidates up to the number asked for, or empty
 * @param totalCandidates how many candidates there were (may exceed {@code candidates.size()})
 */
public record RouteResult(
    long workerId,
    int dpRank,
    int promptBlocks,
    int deviceOverlapBlocks,
    double effectiveOverlapBlocks,
    long cachedTokens,
    long promptTokens,
    double cost,
    boolean booked,
    boolean queued,
    List<Candidate> candidates,
    long totalCandidates) {

  /** The encoded result: the slots of Abi.RouteResult, then the total number of candidates. */
  static final int TOTAL_CANDIDATES = Abi.RouteResult.LEN;

  static final int ENCODED_LEN = TOTAL_CANDIDATES + 1;

  static RouteResult decode(long[] a, long[] candidates) {
    List<Candidate> list;
    if (candidates == null || candidates.length == 0) {
      list = Collections.emptyList();
    } else {
      ArrayList<Candidate> c = new ArrayList<>(candidates.length / Abi.Candidate.LEN);
      for (int i = 0; i < candidates.length; i += Abi.Candidate.LEN) {
        c.add(Candidate.decode(candidates, i));
      }
      list = Collections.unmodifiableList(c);
    }
    return new RouteResult(
        a[Abi.RouteResult.WORKER_ID],
        (int) a[Abi.RouteResult.DP_RANK],
        (int) a[Abi.RouteResult.PROMPT_BLOCKS],
        (int) a[Abi.RouteResult.DEVICE_OVERLAP_BLOCKS],
        Native.dbl(a[Abi.RouteResult.EFFECTIVE_OVERLAP_BLOCKS]),
        a[Abi.RouteResult.CACHED_TOKENS],
        a[Abi.RouteResult.PROMPT_TOKENS],
        Native.dbl(a[Abi.RouteResult.COST]),
        a[Abi.RouteResult.BOOKED] != 0,
        a[Abi.RouteResult.QUEUED] != 0,
        list,
        a[TOTAL_CANDIDATES]);
  }
}
