package io.kvrouter;

import static io.kvrouter.TestSupport.BLOCK;
import static io.kvrouter.TestSupport.routerWithWorkers;
import static io.kvrouter.TestSupport.stored;
import static io.kvrouter.TestSupport.tokens;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.util.ArrayList;
import java.util.Comparator;
import java.util.List;
import java.util.function.Function;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.function.Executable;

/**
 * Prompts given hashed (the {@code ...Hashed} calls, KVR_REQUEST_PREHASHED): every decision,
 * booking and price is that of the prompt's tokens, and a hash count that is not the prompt's
 * complete blocks is refused. Each comparison runs on twin routers built alike and given the same
 * calls in the same order, one with the tokens and one with the hashes, so that the routers'
 * seeded tie-breaks draw alike.
 */
class PrehashedPromptTest {
  // Three complete blocks and 5 tokens of a fourth: the partial block counts in the prompt's
  // length (and so in the prefill it costs) but has no hash.
  private static final int[] PROMPT = tokens(3 * BLOCK + 5, 1000);
  private static final long[] HASHES = Hashing.blockHashes(PROMPT, BLOCK);
  private static final HashOptions ADAPTER = HashOptions.builder().loraName("adapter").build();

  /** Four workers; worker 2 caches the prompt's first two blocks, worker 3 them under a LoRA. */
  private static Router router() {
    Router r = routerWithWorkers(4);
    r.applyStored(stored(2, PROMPT, 2, 0xA1));
    r.applyStored(
        StoredEvent.builder(3)
            .eventId(0xB1)
            .blockHashes(0xB1, 0xB2)
            .tokenIds(java.util.Arrays.copyOf(PROMPT, 2 * BLOCK))
            .loraName("adapter")
            .build());
    return r;
  }

  /** Two routers built alike: one is given tokens, the other hashes. */
  private static final class Twins implements AutoCloseable {
    final Router tokens = router();
    final Router hashes = router();

    @Override
    public void close() {
      tokens.close();
      hashes.close();
    }
  }

  private static List<Overlap> sorted(List<Overlap> rows) {
    List<Overlap> s = new ArrayList<>(rows);
    s.sort(Comparator.comparingLong(Overlap::workerId).thenComparingInt(Overlap::dpRank));
    return s;
  }

  @Test
  void aHashedPromptGetsTheDecisionOfItsTokens() {
    try (Twins t = new Twins()) {
      assertEquals(3, HASHES.length);
      RouteResult byTokens = t.tokens.findBestMatch(PROMPT, null, 8);
      RouteResult byHashes = t.hashes.findBestMatchHashed(HASHES, PROMPT.length, null, 8);
      assertEquals(byTokens, byHashes); // worker, overlap, cached tokens, cost, candidates
      assertEquals(2, byHashes.workerId());
      assertEquals(2, byHashes.deviceOverlapBlocks());
      assertEquals(2 * BLOCK, byHashes.cachedTokens());
      assertEquals(PROMPT.length, byHashes.promptTokens());
      assertEquals(3, byHashes.promptBlocks());
      assertEquals(4, byHashes.candidates().size());
      assertFalse(byHashes.booked());
      // The lean call (no candidates: the FFM path on JDK 22+) and the LoRA-salted prompt, whose
      // hashes carry the adapter: worker 3 holds those.
      assertEquals(
          t.tokens.findBestMatch(PROMPT),
          t.hashes.findBestMatchHashed(HASHES, PROMPT.length, null));
      RequestOptions lora = RequestOptions.builder().loraName("adapter").build();
      long[] loraHashes = Hashing.blockHashes(PROMPT, BLOCK, ADAPTER);
      RouteResult loraByHashes = t.hashes.findBestMatchHashed(loraHashes, PROMPT.length, lora);
      assertEquals(t.tokens.findBestMatch(PROMPT, lora), loraByHashes);
      assertEquals(3, loraByHashes.workerId());
      assertEquals(
          t.tokens.findBestMatch(PROMPT, lora, 4),
          t.hashes.findBestMatchHashed(loraHashes, PROMPT.length, lora, 4));

      // Previews, overlap scores and potential loads agree too.
      RouteSignals preview = t.hashes.previewRouteHashed(HASHES, PROMPT.length, null, null);
      assertEquals(t.tokens.previewRoute(PROMPT, null, null), preview);
      assertEquals(2, preview.workerId());
      assertEquals(2, preview.overlapBlocks());
      assertEquals(PROMPT.length, preview.promptTokens());
      RoutingHints pin = RoutingHints.builder().workerId(4).build(); // hints: the JNI path
      assertEquals(
          t.tokens.previewRoute(PROMPT, RequestOptions.withId("p"), pin),
          t.hashes.previewRouteHashed(HASHES, PROMPT.length, RequestOptions.withId("p"), pin));
      assertEquals(
          sorted(t.tokens.overlapScores(PROMPT, lora)),
          sorted(t.hashes.overlapScoresHashed(loraHashes, PROMPT.length, lora)));
      assertEquals(
          t.tokens.potentialLoads(PROMPT),
          t.hashes.potentialLoadsHashed(HASHES, PROMPT.length, null));
      // A prompt shorter than a block has no hash.
      int[] shortPrompt = tokens(BLOCK - 1, 7);
      RouteResult none = t.hashes.findBestMatchHashed(new long[0], shortPrompt.length, null);
      assertEquals(t.tokens.findBestMatch(shortPrompt), none);
      assertEquals(0, none.promptBlocks());
      assertEquals(BLOCK - 1, none.promptTokens());
      assertEquals(0, t.hashes.metrics().requestsActive());
    }
  }

  @Test
  void aBookingMadeFromHashesWeighsAsOneFromTokensAndIsFreed() {
    try (Twins t = new Twins()) {
      // A request booked on a rank chosen elsewhere: worker 4, which caches nothing of it.
      t.tokens.addRequest(PROMPT, 4, 0, RequestOptions.withId("d"));
      t.hashes.addRequestHashed(HASHES, PROMPT.length, 4, 0, RequestOptions.withId("d"));
      PotentialLoad four =
          t.hashes.potentialLoads(PROMPT).stream().filter(l -> l.workerId() == 4).findFirst().get();
      assertEquals(1, four.activeRequests());
      assertEquals(PROMPT.length, four.activePrefillTokens()); // the partial block included
      assertEquals(3, four.activeBlocks()); // the complete blocks
      // Admitted routing (the simple options: the FFM path on JDK 22+), then with candidates.
      RouteResult a =
          t.hashes.findBestMatchHashed(HASHES, PROMPT.length, RequestOptions.admit("a"));
      assertEquals(t.tokens.findBestMatch(PROMPT, RequestOptions.admit("a")), a);
      assertTrue(a.booked());
      assertEquals(2, a.workerId());
      RequestOptions bOptions =
          RequestOptions.builder().requestId("b").admit(true).expectedOutputTokens(64).build();
      assertEquals(
          t.tokens.findBestMatch(PROMPT, bOptions, 4),
          t.hashes.findBestMatchHashed(HASHES, PROMPT.length, bOptions, 4));
      // A plan, committed.
      RouteSignals preview = t.hashes.previewRouteHashed(HASHES, PROMPT.length, null, null);
      RouteSignals plan =
          t.hashes.planRouteHashed(
              HASHES, PROMPT.length, RequestOptions.withId("c"), null, preview);
      assertEquals(
          t.tokens.planRoute(
              PROMPT, RequestOptions.withId("c"), null, t.tokens.previewRoute(PROMPT, null, null)),
          plan);
      assertTrue(plan.booked());
      t.tokens.commitRoute("c");
      t.hashes.commitRoute("c");

      // Each rank carries what it would carry for the same requests booked from tokens.
      List<PotentialLoad> loads = t.hashes.potentialLoads(PROMPT);
      assertEquals(t.tokens.potentialLoads(PROMPT), loads);
      assertEquals(4, t.hashes.metrics().requestsActive());
      long booked = loads.stream().mapToLong(PotentialLoad::activeRequests).sum();
      assertEquals(4, booked);

      // Freed, nothing is left.
      for (String id : new String[] {"a", "b", "c", "d"}) {
        t.tokens.freeRequest(id);
        t.hashes.freeRequest(id);
      }
      assertEquals(0, t.hashes.metrics().requestsActive());
      for (PotentialLoad l : t.hashes.potentialLoadsHashed(HASHES, PROMPT.length, null)) {
        assertEquals(0, l.activeRequests(), l.toString());
        assertEquals(0, l.activeBlocks(), l.toString());
        assertEquals(0, l.activePrefillTokens(), l.toString());
      }
      assertEquals(t.tokens.potentialLoads(PROMPT), t.hashes.potentialLoads(PROMPT));
    }
  }

  @Test
  void aHashCountThatIsNotThePromptsBlocksIsRefused() {
    try (Router r = router();
        DisaggRouter d = disagg(DisaggOptions.builder().build())) {
      long[] twoHashes = java.util.Arrays.copyOf(HASHES, 2);
      // One block too many tokens, one hash too few, hashes for a prompt shorter than a block.
      long[][] hashes = {HASHES, twoHashes, HASHES};
      long[] lengths = {PROMPT.length + BLOCK, PROMPT.length, BLOCK - 1};
      for (int i = 0; i < hashes.length; ++i) {
        long[] h = hashes[i];
        long n = lengths[i];
        RequestOptions id = RequestOptions.withId("x");
        List<Executable> calls =
            List.of(
                () -> r.findBestMatchHashed(h, n, null),
                () -> r.findBestMatchHashed(h, n, RequestOptions.admit("x")),
                () -> r.findBestMatchHashed(h, n, null, 4),
                () -> r.previewRouteHashed(h, n, null, null),
                () -> r.previewRouteHashed(h, n, id, RoutingHints.builder().workerId(2).build()),
                () -> r.planRouteHashed(h, n, id, null, null),
                () -> r.addRequestHashed(h, n, 2, 0, id),
                () -> r.overlapScoresHashed(h, n, null),
                () -> r.potentialLoadsHashed(h, n, null),
                () -> d.routePrefillHashed(h, n, id, null),
                () -> d.routeDecodeHashed(h, n, id, null, false),
                () -> d.prefillWorkerBusyHashed(h, n, null, 1.0));
        for (Executable call : calls) {
          KvRouterException e = assertThrows(KvRouterException.class, call);
          assertEquals(Status.INVALID_ARGUMENT, e.status());
          assertTrue(e.getMessage().contains("local hashes were given"), e.getMessage());
        }
      }
      assertEquals(0, r.metrics().requestsActive());
      assertEquals(0, d.prefillRouter().metrics().requestsActive());
      assertEquals(0, d.decodeRouter().metrics().requestsActive());
      // Java-side misuse.
      assertThrows(NullPointerException.class, () -> r.findBestMatchHashed(null, 0, null));
      assertThrows(
          IllegalArgumentException.class, () -> r.findBestMatchHashed(new long[0], -1, null));
      assertThrows(
          IllegalArgumentException.class,
          () -> r.previewRouteHashed(new long[0], -1, null, null));
      assertThrows(
          IllegalArgumentException.class,
          () -> d.prefillWorkerBusyHashed(new long[0], -1, null, 1.0));
    }
  }

  private static DisaggRouter disagg(DisaggOptions options) {
    RouterOptions pool = RouterOptions.builder().blockSize(BLOCK).randomSeed(7).build();
    DisaggRouter d = new DisaggRouter(pool, pool, options);
    d.prefillRouter().addWorker(WorkerConfig.builder(10).maxNumBatchedTokens(8192).build());
    d.prefillRouter().addWorker(WorkerConfig.builder(11).maxNumBatchedTokens(8192).build());
    d.decodeRouter().addWorker(WorkerConfig.builder(20).totalKvBlocks(1000).build());
    d.prefillRouter().applyStored(stored(11, PROMPT, 2, 0xC1));
    return d;
  }

  @Test
  void theDisaggregatedRouterTakesAHashedPromptAsItsTokens() {
    // ISL bounding reads the prompt's length: a hashed prompt of 512 tokens is prefilled remotely
    // as its tokens are (read as no tokens, it would be prefilled locally), one of 32 locally.
    DisaggOptions isl =
        DisaggOptions.builder()
            .policy(DisaggPolicy.ISL_BOUNDING)
            .maxLocalPrefillTokens(64)
            .decodeBusyThreshold(0.9)
            .build();
    for (DisaggOptions options : List.of(DisaggOptions.builder().build(), isl)) {
      for (int[] prompt : new int[][] {PROMPT, tokens(512, 1000), tokens(32, 1000)}) {
        long[] hashes = Hashing.blockHashes(prompt, BLOCK);
        try (DisaggRouter byTokens = disagg(options);
            DisaggRouter byHashes = disagg(options)) {
          RequestOptions id = RequestOptions.withId("r");
          PrefillResult pt = byTokens.routePrefill(prompt, id, null);
          PrefillResult ph = byHashes.routePrefillHashed(hashes, prompt.length, id, null);
          // Everything but the bootstrap room, a random draw of each call.
          Function<PrefillResult, PrefillResult> noRoom =
              p ->
                  new PrefillResult(
                      p.remote(),
                      p.reason(),
                      p.dpRank(),
                      p.workerId(),
                      p.remote() ? 0 : p.bootstrapRoom(),
                      p.cachedTokens());
          assertEquals(noRoom.apply(pt), noRoom.apply(ph));
          assertEquals(prompt.length > 64 || options != isl, ph.remote(), ph.toString());
          if (ph.remote()) assertEquals(11, ph.workerId()); // it caches the prompt's start
          assertEquals(
              byTokens.routeDecode(prompt, id, null, pt.remote()),
              byHashes.routeDecodeHashed(hashes, prompt.length, id, null, ph.remote()));
          assertEquals(
              byTokens.prefillWorkerBusy(prompt, null, 0.0),
              byHashes.prefillWorkerBusyHashed(hashes, prompt.length, null, 0.0));
          assertEquals(
              byTokens.prefillRouter().potentialLoads(prompt),
              byHashes.prefillRouter().potentialLoads(prompt));
          assertEquals(
              byTokens.decodeRouter().potentialLoads(prompt),
              byHashes.decodeRouter().potentialLoads(prompt));
          byHashes.prefillRouter().freeRequest("r");
          byHashes.decodeRouter().freeRequest("r");
          assertEquals(0, byHashes.prefillRouter().metrics().requestsActive());
          assertEquals(0, byHashes.decodeRouter().metrics().requestsActive());
        }
      }
    }
  }
}
