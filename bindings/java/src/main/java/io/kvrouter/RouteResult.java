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

  static RouteResult decode(long[] a, long[] candidates) {
    List<Candidate> list;
    if (candidates == null || candidates.length == 0) {
      list = Collections.emptyList();
    } else {
      ArrayList<Candidate> c = new ArrayList<>(candidates.length / Native.CANDIDATE_LEN);
      for (int i = 0; i < candidates.length; i += Native.CANDIDATE_LEN) {
        c.add(Candidate.decode(candidates, i));
      }
      list = Collections.unmodifiableList(c);
    }
    return new RouteResult(
        a[0],
        (int) a[1],
        (int) a[2],
        (int) a[3],
        Native.dbl(a[4]),
        a[5],
        a[6],
        Native.dbl(a[7]),
        a[8] != 0,
        a[9] != 0,
        list,
        a[10]);
  }
}
