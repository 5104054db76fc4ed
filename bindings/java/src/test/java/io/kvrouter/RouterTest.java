package io.kvrouter;

import static io.kvrouter.TestSupport.BLOCK;
import static io.kvrouter.TestSupport.routerWithWorkers;
import static io.kvrouter.TestSupport.stored;
import static io.kvrouter.TestSupport.tokens;
import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertDoesNotThrow;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.Comparator;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;
import org.junit.jupiter.api.Test;

/** Routing decisions, events, the request lifecycle, errors, buffers, snapshots, metrics. */
class RouterTest {
  private static final int[] PROMPT = tokens(48, 1000); // 3 blocks

  @Test
  void routesToTheWorkerHoldingThePrefix() {
    try (Router router = routerWithWorkers(4)) {
      router.applyStored(stored(2, PROMPT, 2, 0xA1));
      for (int i = 0; i < 20; ++i) { // the random tie-break never beats a cache hit
        RouteResult r = router.findBestMatch(PROMPT);
        assertEquals(2, r.workerId());
        assertEquals(2, r.deviceOverlapBlocks());
        assertEquals(32, r.cachedTokens());
        assertEquals(3, r.promptBlocks());
        assertEquals(48, r.promptTokens());
        assertFalse(r.booked());
      }
      // a preview books nothing
      assertEquals(0, router.metrics().requestsActive());
      List<Overlap> overlaps = router.overlapScores(PROMPT);
      assertEquals(1, overlaps.size());
      assertEquals(2, overlaps.get(0).workerId());
      assertEquals(2, overlaps.get(0).deviceBlocks());
      assertEquals(2, overlaps.get(0).treeSize());
    }
  }

  // The lean call (simple options, no candidates asked for) says how many there were, as the
  // general one does (it said 0).
  @Test
  void everyCallCountsTheCandidates() {
    try (Router router = routerWithWorkers(4)) {
      assertEquals(4, router.findBestMatch(PROMPT).totalCandidates());
      assertEquals(4, router.findBestMatch(PROMPT, RequestOptions.admit("lean")).totalCandidates());
    }
  }

  @Test
  void loadChangesTheChoice() {
    try (Router router = routerWithWorkers(4)) {
      router.applyStored(stored(2, PROMPT, 2, 0xA1));
      RouteResult first = router.findBestMatch(PROMPT, RequestOptions.admit("r0"), 8);
      assertEquals(2, first.workerId());
      assertTrue(first.booked());
      assertEquals(4, first.totalCandidates());
      assertEquals(4, first.candidates().size());
      Candidate chosen = first.candidates().stream().filter(Candidate::chosen).findFirst().get();
      assertEquals(2, chosen.workerId());
      assertEquals(first.cost(), chosen.cost());
      for (Candidate c : first.candidates()) {
        if (c.workerId() != 2) assertTrue(c.cost() > chosen.cost(), c.toString());
      }
      // Keep booking requests for the same prompt without finishing their prefill: worker 2's
      // load grows until another worker is cheaper despite the cache hit.
      Set<Long> workers = new HashSet<>();
      for (int i = 1; i < 8; ++i) {
        workers.add(router.findBestMatch(PROMPT, RequestOptions.admit("r" + i)).workerId());
      }
      assertTrue(workers.size() > 1, "every request went to " + workers);
      assertEquals(8, router.metrics().requestsActive());
      long onTwo =
          router.potentialLoads(PROMPT).stream()
              .filter(p -> p.workerId() == 2)
              .findFirst()
              .get()
              .activeRequests();
      assertTrue(onTwo >= 1);
      // Freeing everything brings the prefix holder back.
      for (int i = 0; i < 8; ++i) {
        router.markPrefillCompleted("r" + i);
        router.freeRequest("r" + i);
      }
      assertEquals(0, router.metrics().requestsActive());
      assertEquals(2, router.findBestMatch(PROMPT).workerId());
    }
  }

  @Test
  void candidateListIsTruncatedNotRefused() {
    try (Router router = routerWithWorkers(5)) {
      RouteResult r = router.findBestMatch(PROMPT, null, 2);
      assertEquals(5, r.totalCandidates());
      assertEquals(2, r.candidates().size());
      RouteResult none = router.findBestMatch(PROMPT, null, 0);
      assertEquals(0, none.candidates().size());
      assertEquals(5, none.totalCandidates());
    }
  }

  @Test
  void errorsCarryTheirStatus() {
    try (Router router = routerWithWorkers(2)) {
      KvRouterException e = assertThrows(KvRouterException.class, () -> router.removeWorker(99));
      assertEquals(Status.NOT_FOUND, e.status());
      assertEquals(Status.NOT_FOUND.code(), e.code());
      assertFalse(e.getMessage().isEmpty());

      e = assertThrows(KvRouterException.class, () -> router.addWorker(1));
      assertEquals(Status.ALREADY_EXISTS, e.status());

      e =
          assertThrows(
              KvRouterException.class,
              () -> router.updateWorker(WorkerConfig.builder(42).dpSize(2).build()));
      assertEquals(Status.NOT_FOUND, e.status());

      e =
          assertThrows(
              KvRouterException.class,
              () -> router.addWorker(WorkerConfig.builder(3).blockSize(32).build()));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      assertTrue(e.getMessage().contains("32"), e.getMessage());

      router.findBestMatch(PROMPT, RequestOptions.admit("dup"));
      e =
          assertThrows(
              KvRouterException.class,
              () -> router.findBestMatch(PROMPT, RequestOptions.admit("dup")));
      assertEquals(Status.ALREADY_EXISTS, e.status());
      e =
          assertThrows(
              KvRouterException.class,
              () -> router.addRequest(PROMPT, 1, 0, RequestOptions.withId("dup")));
      assertEquals(Status.ALREADY_EXISTS, e.status());
      e =
          assertThrows(
              KvRouterException.class,
              () -> router.addRequest(PROMPT, 77, 0, RequestOptions.withId("other")));
      assertEquals(Status.NOT_FOUND, e.status());

      // admission without a request id
      e =
          assertThrows(
              KvRouterException.class,
              () -> router.findBestMatch(PROMPT, RequestOptions.builder().admit(true).build()));
      assertEquals(Status.INVALID_ARGUMENT, e.status());

      byte[] garbage = "certainly not a FlatBuffers EventBatch".getBytes();
      e = assertThrows(KvRouterException.class, () -> router.applyEventBatch(garbage));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      assertEquals(1, router.metrics().eventBatchesRejected());

      e = assertThrows(KvRouterException.class, () -> router.restore(garbage));
      assertEquals(Status.INVALID_ARGUMENT, e.status());

      // an unknown parent is reported as NOT_FOUND and counted
      StoredEvent orphan =
          StoredEvent.builder(1)
              .parentHash(0xDEAD)
              .blockHashes(0xB1)
              .tokenIds(tokens(16, 5))
              .build();
      e = assertThrows(KvRouterException.class, () -> router.applyStored(orphan));
      assertEquals(Status.NOT_FOUND, e.status());
      assertEquals(
          1, router.metrics().events(EventKind.STORED, EventOutcome.PARENT_BLOCK_NOT_FOUND));

      // an incomplete block
      StoredEvent shortEvent =
          StoredEvent.builder(1).blockHashes(0xC1).tokenIds(tokens(5, 5)).build();
      e = assertThrows(KvRouterException.class, () -> router.applyStored(shortEvent));
      assertEquals(Status.INVALID_ARGUMENT, e.status());

      // no eligible worker
      try (Router empty = new Router()) {
        e = assertThrows(KvRouterException.class, () -> empty.findBestMatch(PROMPT));
        assertEquals(Status.UNAVAILABLE, e.status());
      }

      // Java-side argument checks happen before any native call
      assertThrows(IndexOutOfBoundsException.class, () -> router.applyEventBatch(garbage, 5, 100));
      assertThrows(NullPointerException.class, () -> router.findBestMatch(null));
      assertThrows(
          IllegalArgumentException.class,
          () -> router.findBestMatch(PROMPT, RequestOptions.admit("nul\0inside")));
    }
  }

  /**
   * A hybrid model's sliding-window group (tests/capi/events_test.c,
   * sliding_window_stores_and_removals): worker 1 holds a prompt's four blocks in full attention,
   * its window (32 tokens: the two blocks before a hit point) blocks 2 and 3. The prompt plus a
   * token is cached whole; its first three blocks and another are not (block 1 is missing before
   * block 3), as the engine counts them.
   */
  @Test
  void slidingWindowStoresAndRemovals() {
    int[] prompt = tokens(4 * BLOCK, 1000);
    int[] longer = Arrays.copyOf(prompt, 4 * BLOCK + 1);
    longer[4 * BLOCK] = 7;
    int[] shorter = prompt.clone();
    Arrays.fill(shorter, 3 * BLOCK, 4 * BLOCK, 999);
    try (Router router = routerWithWorkers(2);
        EventBatch batch = new EventBatch()) {
      router.applyStored(stored(1, prompt, 4, 100)); // engine hashes 100..103
      StoredEvent window =
          StoredEvent.builder(1).blockHashes(102, 103).slidingWindow(0, 2 * BLOCK).build();
      assertTrue(window.isSlidingWindow());
      assertEquals(0, window.slidingGroup());
      assertEquals(2 * BLOCK, window.slidingWindowTokens());
      router.applyStored(window);
      assertEquals(4, deviceBlocksOf(router.overlapScores(longer), 1));
      assertEquals(-1, deviceBlocksOf(router.overlapScores(shorter), 1));
      RouteResult r = router.findBestMatch(longer);
      assertEquals(1, r.workerId());
      assertEquals(4, r.deviceOverlapBlocks());
      RouteSignals preview = router.previewRoute(longer, null, null);
      assertEquals(1, preview.workerId());
      assertEquals(4, preview.overlapBlocks());

      // A block full attention does not hold cannot be placed.
      KvRouterException e =
          assertThrows(
              KvRouterException.class,
              () ->
                  router.applyStored(
                      StoredEvent.builder(1)
                          .blockHashes(999)
                          .slidingWindow(0, 2 * BLOCK)
                          .build()));
      assertEquals(Status.NOT_FOUND, e.status());
      // A sliding store names blocks only.
      e =
          assertThrows(
              KvRouterException.class,
              () ->
                  router.applyStored(
                      StoredEvent.builder(1)
                          .blockHashes(102, 103)
                          .tokenIds(Arrays.copyOfRange(prompt, 2 * BLOCK, 4 * BLOCK))
                          .slidingWindow(0, 2 * BLOCK)
                          .build()));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      assertThrows(
          IllegalArgumentException.class, () -> StoredEvent.builder(1).slidingWindow(0, 0));
      StoredEvent undone =
          StoredEvent.builder(1).slidingWindow(2, 2 * BLOCK).fullAttention().blockHashes(1).build();
      assertFalse(undone.isSlidingWindow());
      assertEquals(0, undone.slidingGroup());

      // The window lets block 3 go: no hit left on worker 1; its full-attention blocks stay.
      RemovedEvent removed = RemovedEvent.builder(1).blockHashes(103).sliding(0).build();
      assertTrue(removed.isSliding());
      assertEquals(0, removed.slidingGroup());
      assertFalse(RemovedEvent.of(1, 103).isSliding());
      RemovedEvent undoneRemoval =
          RemovedEvent.builder(1).blockHashes(103).sliding(4).fullAttention().build();
      assertFalse(undoneRemoval.isSliding());
      assertEquals(0, undoneRemoval.slidingGroup());
      router.applyRemoved(removed);
      assertEquals(-1, deviceBlocksOf(router.overlapScores(longer), 1));
      Metrics m = router.metrics();
      assertEquals(4, m.indexBlocks());
      assertEquals(1, m.indexSlidingBlocks());
      assertEquals(2, m.slidingEventsApplied());
      assertEquals(1, m.slidingEventsRejected());

      // The same store through an event batch (FlatBuffers) brings the hit back.
      batch.addStored(
          StoredEvent.builder(1).eventId(5).blockHashes(103).slidingWindow(0, 2 * BLOCK).build());
      router.applyEventBatch(batch.encode());
      assertEquals(4, deviceBlocksOf(router.overlapScores(longer), 1));
      assertEquals(2, router.metrics().indexSlidingBlocks());
    }
  }

  /** The device blocks {@code worker} (rank 0) holds of a prompt; -1: it is not listed. */
  private static int deviceBlocksOf(List<Overlap> overlaps, long worker) {
    for (Overlap o : overlaps) {
      if (o.workerId() == worker && o.dpRank() == 0) return o.deviceBlocks();
    }
    return -1;
  }

  @Test
  void eventsStoredRemovedClearedAndInBatches() {
    try (Router router = routerWithWorkers(3);
        EventBatch batch = new EventBatch()) {
      router.applyStored(stored(1, PROMPT, 3, 0x100));
      assertEquals(3, router.overlapScores(PROMPT).get(0).deviceBlocks());
      router.applyRemoved(RemovedEvent.of(1, 0x102));
      assertEquals(2, router.overlapScores(PROMPT).get(0).deviceBlocks());
      router.applyCleared(1, 0, 5);
      assertEquals(0, router.overlapScores(PROMPT).size());

      // The same through a FlatBuffers batch built by the encoder.
      batch
          .addStored(stored(3, PROMPT, 3, 0x200))
          .addStored(
              StoredEvent.builder(2)
                  .eventId(9)
                  .tier(Tier.HOST_PINNED)
                  .blockHashes(0x300)
                  .localHashes(Hashing.blockHashes(PROMPT, BLOCK)[0])
                  .build())
          .addRemoved(RemovedEvent.builder(3).eventId(10).blockHashes(0x202).build())
          .addCleared(9, 0, 11);
      assertEquals(4, batch.size());
      byte[] encoded = batch.encode();
      assertEquals(4, batch.size()); // encoding keeps the events
      router.applyEventBatch(encoded);
      List<Overlap> o = router.overlapScores(PROMPT);
      assertEquals(2, o.size());
      for (Overlap x : o) {
        if (x.workerId() == 3) assertEquals(2, x.deviceBlocks());
        else {
          assertEquals(2, x.workerId());
          assertEquals(0, x.deviceBlocks());
          assertEquals(1, x.hostBlocks());
          assertEquals(0.75, x.effectiveOverlapBlocks(), 1e-9);
        }
      }
      // applying the same bytes with an offset
      byte[] padded = new byte[encoded.length + 10];
      System.arraycopy(encoded, 0, padded, 7, encoded.length);
      try (Router other = routerWithWorkers(3)) {
        other.applyEventBatch(padded, 7, encoded.length);
        assertEquals(2, other.overlapScores(PROMPT).size());
      }
      assertEquals(0, batch.clear().size());
      assertTrue(batch.encode().length > 0); // an empty batch is still a valid buffer
    }
  }

  /**
   * A router whose index splits the workers over 4 trees answers as the default single tree
   * after the same events: 9 workers holding a shared 4-block stem and 2 blocks of their own,
   * worker 2 evicting its last block, worker 4 leaving. The same overlaps, choices and index
   * size. (AbiTest checks that 0 and 65 are refused naming index_shards.)
   */
  @Test
  void indexShardsChangeNoAnswer() {
    int workers = 9;
    int[][] prompts = new int[workers + 1][];
    for (int w = 1; w <= workers; ++w) {
      prompts[w] = Arrays.copyOf(tokens(4 * BLOCK, 7), 6 * BLOCK);
      System.arraycopy(tokens(2 * BLOCK, 1000 * w), 0, prompts[w], 4 * BLOCK, 2 * BLOCK);
    }
    RouterOptions defaults = RouterOptions.builder().blockSize(BLOCK).randomSeed(7).build();
    assertEquals(1, defaults.indexShards());
    try (Router single = new Router(defaults);
        Router sharded = new Router(defaults.toBuilder().indexShards(4).build())) {
      for (Router r : List.of(single, sharded)) {
        for (int w = 1; w <= workers; ++w) {
          r.addWorker(w);
          r.applyStored(stored(w, prompts[w], 6, 1000L * w));
        }
        r.applyRemoved(RemovedEvent.of(2, 2005)); // worker 2's last block
        r.removeWorker(4);
      }
      for (int w = 1; w <= workers; ++w) {
        List<Overlap> want = sortedOverlaps(single, prompts[w]);
        assertEquals(want, sortedOverlaps(sharded, prompts[w]), "prompt of worker " + w);
        Map<Long, Integer> held = new TreeMap<>();
        for (Overlap o : want) held.put(o.workerId(), o.deviceBlocks());
        Map<Long, Integer> expected = new TreeMap<>();
        for (long v = 1; v <= workers; ++v) {
          if (v != 4) expected.put(v, v != w ? 4 : v == 2 ? 5 : 6);
        }
        assertEquals(expected, held, "prompt of worker " + w);
        if (w == 4) continue; // the stem only, everywhere: a random tie-break
        RouteResult one = single.findBestMatch(prompts[w]);
        assertEquals(w, one.workerId());
        assertEquals(one, sharded.findBestMatch(prompts[w]), "prompt of worker " + w);
      }
      assertEquals(8 * 6 - 1, single.metrics().indexBlocks());
      assertEquals(single.metrics().indexBlocks(), sharded.metrics().indexBlocks());
    }
  }

  private static List<Overlap> sortedOverlaps(Router router, int[] prompt) {
    List<Overlap> overlaps = new ArrayList<>(router.overlapScores(prompt));
    overlaps.sort(Comparator.comparingLong(Overlap::workerId));
    return overlaps;
  }

  @Test
  void requestLifecycleAndAddRequest() {
    try (Router router = routerWithWorkers(2)) {
      router.addRequest(PROMPT, 2, 0, RequestOptions.withId("pinned"));
      List<PotentialLoad> loads = router.potentialLoads(PROMPT);
      assertEquals(2, loads.size());
      PotentialLoad two = loads.stream().filter(l -> l.workerId() == 2).findFirst().get();
      assertEquals(1, two.activeRequests());
      assertEquals(48, two.activePrefillTokens());
      router.markPrefillCompleted("pinned");
      two = router.potentialLoads(PROMPT).stream().filter(l -> l.workerId() == 2).findFirst().get();
      assertEquals(0, two.activePrefillTokens());
      router.freeRequest("pinned");
      router.freeRequest("pinned"); // idempotent
      router.markPrefillCompleted("never-seen"); // idempotent
      assertEquals(0, router.metrics().requestsActive());
    }
  }

  /**
   * findMatches is the index walk of overlapScoresHashed: the same ranks, tiers and tree sizes;
   * no rows for no hashes or hashes nobody holds; a null array and a closed router refused.
   */
  @Test
  void findMatchesIsTheWalkOfOverlapScores() {
    Router router = routerWithWorkers(4);
    try (router) {
      // Worker 1: two blocks on the device; worker 2: three on host memory; worker 3: two on the
      // device continued by one on disk; worker 4 holds nothing.
      router.applyStored(stored(1, PROMPT, 2, 0x100));
      router.applyStored(
          StoredEvent.builder(2)
              .tier(Tier.HOST_PINNED)
              .blockHashes(TestSupport.engineHashes(3, 0x200))
              .tokenIds(PROMPT)
              .build());
      router.applyStored(stored(3, PROMPT, 2, 0x300));
      router.applyStored(
          StoredEvent.builder(3)
              .tier(Tier.DISK)
              .parentHash(0x301)
              .blockHashes(0x302)
              .tokenIds(Arrays.copyOfRange(PROMPT, 2 * BLOCK, 3 * BLOCK))
              .build());
      long[] hashes = Hashing.blockHashes(PROMPT, BLOCK);
      Map<Long, Overlap> overlaps = new TreeMap<>();
      for (Overlap o : router.overlapScoresHashed(hashes, null)) overlaps.put(o.workerId(), o);
      Map<Long, Match> matches = new TreeMap<>();
      for (Match m : router.findMatches(hashes)) assertEquals(null, matches.put(m.workerId(), m));
      assertEquals(List.of(1L, 2L, 3L), new ArrayList<>(matches.keySet()));
      assertEquals(overlaps.keySet(), matches.keySet());
      for (Match m : matches.values()) {
        Overlap o = overlaps.get(m.workerId());
        assertEquals(
            new Match(
                o.workerId(),
                o.dpRank(),
                o.deviceBlocks(),
                o.hostBlocks(),
                o.diskBlocks(),
                o.externalBlocks(),
                o.treeSize()),
            m);
      }
      assertEquals(new Match(1, 0, 2, 0, 0, 0, 2), matches.get(1L));
      assertEquals(new Match(2, 0, 0, 3, 0, 0, 3), matches.get(2L));
      assertEquals(new Match(3, 0, 2, 0, 1, 0, 3), matches.get(3L));
      // Nothing matches nothing.
      assertEquals(List.of(), router.findMatches(new long[0]));
      assertEquals(List.of(), router.findMatches(new long[] {0xDEADL, 0xBEEFL}));
      assertEquals(List.of(), router.findMatches(Arrays.copyOfRange(hashes, 1, hashes.length)));
      assertThrows(NullPointerException.class, () -> router.findMatches(null));
    }
    assertThrows(IllegalStateException.class, () -> router.findMatches(new long[] {1}));
  }

  @Test
  void resultBuffersGrowBeyondTheirFirstSize() {
    // 40 workers × 2 ranks: more than the glue's first buffers of overlaps, loads and text.
    try (Router router = new Router(RouterOptions.builder().blockSize(BLOCK).build())) {
      for (int w = 1; w <= 40; ++w) router.addWorker(WorkerConfig.builder(w).dpSize(2).build());
      for (int w = 1; w <= 40; ++w) {
        router.applyStored(
            StoredEvent.builder(w)
                .dpRank(w % 2)
                .blockHashes(w * 100L)
                .tokenIds(tokens(16, 1000))
                .build());
      }
      // The walk alone, on a thread of its own: its first buffer (8 rows) is short.
      long[] hashes = Hashing.blockHashes(PROMPT, BLOCK);
      List<List<Match>> fromFreshThread = new ArrayList<>();
      Thread t = new Thread(() -> fromFreshThread.add(router.findMatches(hashes)));
      t.start();
      assertDoesNotThrow(() -> t.join());
      assertEquals(1, fromFreshThread.size(), "findMatches on its own thread failed");
      List<Match> matches = fromFreshThread.get(0);
      assertEquals(40, matches.size());
      Set<Long> workers = new HashSet<>();
      for (Match m : matches) {
        assertTrue(workers.add(m.workerId()), m.toString());
        assertEquals(new Match(m.workerId(), (int) (m.workerId() % 2), 1, 0, 0, 0, 1), m);
      }
      assertEquals(40, router.findMatches(hashes).size());
      assertEquals(40, router.overlapScores(PROMPT).size());
      assertEquals(80, router.potentialLoads(PROMPT).size());
      RouteResult r = router.findBestMatch(PROMPT, null, 1000);
      assertEquals(80, r.totalCandidates());
      assertEquals(80, r.candidates().size());
      String text = router.metricsPrometheus();
      assertTrue(text.length() > 4096, "prometheus text of " + text.length() + " bytes");
      assertTrue(text.contains("kvr"), text.substring(0, 200));
      Metrics m = router.metrics();
      assertEquals(40, m.workers());
      assertEquals(40, m.events(EventKind.STORED, EventOutcome.OK));
      assertEquals(40, m.indexBlocks());
    }
  }

  @Test
  void snapshotRestoresTheIndex() {
    byte[] snapshot;
    try (Router a = routerWithWorkers(3)) {
      a.applyStored(stored(3, PROMPT, 3, 0x500));
      snapshot = a.snapshot();
      assertTrue(snapshot.length > 0);
      KvRouterException e = assertThrows(KvRouterException.class, () -> a.restore(snapshot));
      assertEquals(Status.FAILED_PRECONDITION, e.status()); // not empty
    }
    try (Router b = routerWithWorkers(3)) {
      b.restore(snapshot);
      assertEquals(3, b.findBestMatch(PROMPT).workerId());
      assertEquals(3, b.overlapScores(PROMPT).get(0).deviceBlocks());
    }
    try (Router other = new Router(RouterOptions.builder().blockSize(32).build())) {
      KvRouterException e = assertThrows(KvRouterException.class, () -> other.restore(snapshot));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
    }
  }

  @Test
  void approximateModeRecordsDecisions() {
    try (Router router =
        new Router(RouterOptions.builder().blockSize(BLOCK).approximate(true).build())) {
      for (int w = 1; w <= 4; ++w) router.addWorker(w);
      KvRouterException e =
          assertThrows(KvRouterException.class, () -> router.applyStored(stored(1, PROMPT, 1, 1)));
      assertEquals(Status.FAILED_PRECONDITION, e.status());
      long w = router.findBestMatch(PROMPT, RequestOptions.admit("a")).workerId();
      router.freeRequest("a");
      assertEquals(w, router.findBestMatch(PROMPT).workerId());
      assertEquals(3, router.overlapScores(PROMPT).get(0).deviceBlocks());
    }
  }

  @Test
  void requestOptionsReachTheRouter() {
    try (Router router = routerWithWorkers(4)) {
      router.applyStored(stored(2, PROMPT, 2, 0xA1));
      // allowed set excludes the holder
      RouteResult r =
          router.findBestMatch(PROMPT, RequestOptions.builder().allowedWorkerIds(3, 4).build());
      assertTrue(r.workerId() == 3 || r.workerId() == 4);
      // an empty allow-list allows no worker (null: every worker), and books nothing
      KvRouterException none =
          assertThrows(
              KvRouterException.class,
              () ->
                  router.findBestMatch(
                      PROMPT,
                      RequestOptions.builder()
                          .requestId("nobody")
                          .admit(true)
                          .allowedWorkerIds()
                          .build()));
      assertEquals(Status.UNAVAILABLE, none.status());
      assertEquals(0, router.metrics().requestsActive());
      RequestOptions unrestrictedAgain =
          RequestOptions.builder().allowedWorkerIds().allowedWorkerIds((long[]) null).build();
      assertTrue(router.findBestMatch(PROMPT, unrestrictedAgain).workerId() > 0);
      // a LoRA salt changes the hashes: the cached prefix no longer matches
      assertEquals(
          0,
          router
              .overlapScores(PROMPT, RequestOptions.builder().loraName("adapter").build())
              .size());
      // overlap credit 0: a cache hit is worth nothing, so workers tie on cost
      RouteResult noCredit =
          router.findBestMatch(PROMPT, RequestOptions.builder().overlapScoreCredit(0).build(), 4);
      double cost = noCredit.candidates().get(0).cost();
      for (Candidate c : noCredit.candidates()) assertEquals(cost, c.cost(), 1e-9);
      // Unicode request ids round-trip through the router (the longest a booking may have,
      // 1,024 bytes, with strings past the glue's stack scratch beside it)
      String id = "requête-😀-" + "x".repeat(1024 - 14);
      RequestOptions admitted =
          RequestOptions.builder()
              .admit(true)
              .requestId(id)
              .cacheNamespace("namespace-" + "n".repeat(9000))
              .build();
      router.findBestMatch(PROMPT, admitted);
      KvRouterException e =
          assertThrows(KvRouterException.class, () -> router.findBestMatch(PROMPT, admitted));
      assertEquals(Status.ALREADY_EXISTS, e.status());
      router.freeRequest(id);
      router.findBestMatch(PROMPT, admitted);
      router.freeRequest(id);
      KvRouterException tooLong =
          assertThrows(
              KvRouterException.class,
              () -> router.findBestMatch(PROMPT, RequestOptions.admit(id + "x")));
      assertEquals(Status.INVALID_ARGUMENT, tooLong.status());
      // options are immutable and reusable
      RequestOptions o = RequestOptions.builder().requestId("x").temperature(0.5).build();
      assertEquals(0.5, o.temperature());
      assertTrue(Double.isNaN(o.toBuilder().temperature(Double.NaN).build().temperature()));
      assertArrayEquals(
          new long[] {3, 4},
          RequestOptions.builder().allowedWorkerIds(3, 4).build().allowedWorkerIds());
    }
  }

  private static Candidate candidateOf(RouteResult r, long workerId) {
    return r.candidates().stream().filter(c -> c.workerId() == workerId).findFirst().get();
  }

  private static PotentialLoad loadOf(Router router, long workerId) {
    return router.potentialLoads(PROMPT).stream()
        .filter(l -> l.workerId() == workerId)
        .findFirst()
        .get();
  }

  /**
   * decode_active_request_weight: each request in flight on a rank adds the weight to its cost,
   * enough here to send the prompt away from the rank holding all of it.
   */
  @Test
  void activeRequestWeightChargesRequestsInFlight() {
    RouterOptions weighted =
        RouterOptions.builder().blockSize(BLOCK).randomSeed(7).decodeActiveRequestWeight(2).build();
    assertEquals(2.0, weighted.decodeActiveRequestWeight());
    assertEquals(0.0, weighted.overlapScoreCreditDecay());
    try (Router router = new Router(weighted)) {
      router.addWorker(1);
      router.addWorker(2);
      router.applyStored(stored(1, PROMPT, 3, 0xB1)); // worker 1 holds the whole prompt
      for (int i = 0; i < 3; ++i) { // three requests in flight there, prefill done
        router.addRequest(PROMPT, 1, 0, RequestOptions.withId("w" + i));
        router.markPrefillCompleted("w" + i);
      }
      // Weight 0 for this request: worker 1 costs its 3 shared blocks (no prefill left after the
      // credit), worker 2 the 3 blocks of prefill and 3 new blocks.
      RouteResult off =
          router.findBestMatch(
              PROMPT, RequestOptions.builder().decodeActiveRequestWeight(0).build(), 4);
      assertEquals(1, off.workerId());
      Candidate one = candidateOf(off, 1);
      assertEquals(3, one.activeRequests());
      assertEquals(0.0, one.requestCost());
      assertEquals(3.0, one.cost(), 1e-9);
      assertEquals(6.0, candidateOf(off, 2).cost(), 1e-9);
      // The router's weight 2 (an unset override keeps it, whatever else the options set):
      // worker 1 pays 2 × 3 requests more and the choice flips.
      for (RequestOptions keep :
          new RequestOptions[] {
            null,
            RequestOptions.builder().build(),
            RequestOptions.builder().temperature(0).overlapScoreCredit(1).build()
          }) {
        assertTrue(Double.isNaN(keep == null ? Double.NaN : keep.decodeActiveRequestWeight()));
        RouteResult on = router.findBestMatch(PROMPT, keep, 4);
        assertEquals(2, on.workerId(), on.toString());
        Candidate weightedOne = candidateOf(on, 1);
        assertEquals(3, weightedOne.activeRequests());
        assertEquals(2.0 * 3, weightedOne.requestCost());
        assertEquals(one.cost() + 2.0 * 3, weightedOne.cost(), 1e-9);
        assertEquals(
            weightedOne.prefillCost() + weightedOne.decodeBlocks() + weightedOne.requestCost(),
            weightedOne.cost(),
            1e-9);
        Candidate two = candidateOf(on, 2);
        assertEquals(0, two.activeRequests());
        assertEquals(0.0, two.requestCost());
        assertEquals(6.0, two.cost(), 1e-9);
      }
      KvRouterException bad =
          assertThrows(
              KvRouterException.class,
              () ->
                  router.findBestMatch(
                      PROMPT, RequestOptions.builder().decodeActiveRequestWeight(-1).build()));
      assertEquals(Status.INVALID_ARGUMENT, bad.status());
    }
    // A per-request weight on a router without one flips the choice the same way.
    try (Router plain = routerWithWorkers(2)) {
      plain.applyStored(stored(1, PROMPT, 3, 0xB1));
      for (int i = 0; i < 3; ++i) {
        plain.addRequest(PROMPT, 1, 0, RequestOptions.withId("p" + i));
        plain.markPrefillCompleted("p" + i);
      }
      RouteResult unweighted = plain.findBestMatch(PROMPT, null, 4);
      assertEquals(1, unweighted.workerId());
      assertEquals(0.0, candidateOf(unweighted, 1).requestCost());
      RouteResult weightedHere =
          plain.findBestMatch(
              PROMPT, RequestOptions.builder().decodeActiveRequestWeight(2).build(), 4);
      assertEquals(2, weightedHere.workerId());
      assertEquals(6.0, candidateOf(weightedHere, 1).requestCost());
    }
    KvRouterException e =
        assertThrows(
            KvRouterException.class,
            () -> new Router(RouterOptions.builder().decodeActiveRequestWeight(-1).build()));
    assertEquals(Status.INVALID_ARGUMENT, e.status());
    assertTrue(e.getMessage().contains("decode_active_request_weight"), e.getMessage());
  }

  /**
   * overlap_score_credit_decay: a device hit on a rank with more prefill queued than the least
   * loaded one earns less credit.
   */
  @Test
  void creditDecayDiscountsAHitBehindAPrefillBacklog() {
    RouterOptions decaying =
        RouterOptions.builder().blockSize(BLOCK).randomSeed(7).overlapScoreCreditDecay(3).build();
    assertEquals(3.0, decaying.overlapScoreCreditDecay());
    try (Router router = new Router(decaying)) {
      router.addWorker(1);
      router.addWorker(2);
      router.applyStored(stored(1, PROMPT, 3, 0xC1)); // worker 1 holds the whole prompt
      // One block of another prompt still in prefill on worker 1: 16 tokens more queued than
      // worker 2's none.
      router.addRequest(tokens(BLOCK, 50_000), 1, 0, RequestOptions.withId("backlog"));
      RouteResult r = router.findBestMatch(PROMPT, null, 4);
      Candidate one = candidateOf(r, 1);
      Candidate two = candidateOf(r, 2);
      assertEquals(16, one.activePrefillTokens());
      assertEquals(0, two.activePrefillTokens());
      // 1 / (1 + decay × excess blocks / prompt blocks) = 1 / (1 + 3 × 1 / 3)
      assertEquals(0.5, one.creditDecay(), 1e-12);
      assertTrue(one.creditDecay() < 1);
      assertEquals(1.0 * 0.5 * 3, one.credit(), 1e-9); // overlap credit × decay × device blocks
      assertEquals(1.0, two.creditDecay()); // the least loaded rank keeps its (zero) credit
      assertEquals(0.0, two.credit());

      // An unset override keeps the router's decay; 0 for this request turns it off.
      RouteResult kept = router.findBestMatch(PROMPT, RequestOptions.builder().build(), 4);
      assertEquals(0.5, candidateOf(kept, 1).creditDecay(), 1e-12);
      RouteResult off =
          router.findBestMatch(
              PROMPT, RequestOptions.builder().overlapScoreCreditDecay(0).build(), 4);
      assertEquals(1.0, candidateOf(off, 1).creditDecay());
      assertEquals(3.0, candidateOf(off, 1).credit(), 1e-9);
      assertTrue(candidateOf(off, 1).cost() < one.cost());

      // The backlog gone, the hit keeps its full credit.
      router.markPrefillCompleted("backlog");
      assertEquals(1.0, candidateOf(router.findBestMatch(PROMPT, null, 4), 1).creditDecay());
    }
    try (Router plain = routerWithWorkers(2)) { // no decay by default
      plain.applyStored(stored(1, PROMPT, 3, 0xC1));
      plain.addRequest(tokens(BLOCK, 50_000), 1, 0, RequestOptions.withId("backlog"));
      assertEquals(1.0, candidateOf(plain.findBestMatch(PROMPT, null, 4), 1).creditDecay());
      Candidate perRequest =
          candidateOf(
              plain.findBestMatch(
                  PROMPT, RequestOptions.builder().overlapScoreCreditDecay(3).build(), 4),
              1);
      assertEquals(0.5, perRequest.creditDecay(), 1e-12);
      assertEquals(
          Status.INVALID_ARGUMENT,
          assertThrows(
                  KvRouterException.class,
                  () ->
                      plain.findBestMatch(
                          PROMPT, RequestOptions.builder().overlapScoreCreditDecay(-1).build()))
              .status());
    }
  }

  /** recordOutput: generated tokens become blocks on the request's rank until it is freed. */
  @Test
  void recordOutputGrowsTheRanksBlocks() {
    RouterOptions tracking =
        RouterOptions.builder().blockSize(BLOCK).trackOutputBlocks(true).build();
    assertTrue(tracking.trackOutputBlocks());
    assertFalse(RouterOptions.defaults().trackOutputBlocks());
    Router router = new Router(tracking);
    try {
      router.addWorker(1);
      router.addWorker(2);
      router.addRequest(PROMPT, 1, 0, RequestOptions.withId("gen")); // 48 tokens: 3 blocks
      assertEquals(3, loadOf(router, 1).activeBlocks());
      router.recordOutput("gen", 1); // 49 tokens: a 4th block
      assertEquals(4, loadOf(router, 1).activeBlocks());
      router.recordOutput("gen", 3 * BLOCK + 1); // 97 tokens: 7 blocks
      PotentialLoad one = loadOf(router, 1);
      assertEquals(7, one.activeBlocks());
      assertEquals(1, one.activeRequests());
      assertEquals(0, loadOf(router, 2).activeBlocks());
      // The routing cost sees them too.
      RouteResult r = router.findBestMatch(tokens(48, 70_000), null, 4);
      assertEquals(7, candidateOf(r, 1).activeBlocks());
      assertEquals(2, r.workerId());
      router.recordOutput("unknown", 100); // no error
      assertThrows(NullPointerException.class, () -> router.recordOutput(null, 1));
      assertThrows(IllegalArgumentException.class, () -> router.recordOutput("gen", -1));
      router.freeRequest("gen");
      assertEquals(0, loadOf(router, 1).activeBlocks());
    } finally {
      router.close();
    }
    assertThrows(IllegalStateException.class, () -> router.recordOutput("gen", 1));
    try (Router plain = routerWithWorkers(1)) { // not tracking
      plain.addRequest(PROMPT, 1, 0, RequestOptions.withId("gen"));
      KvRouterException e =
          assertThrows(KvRouterException.class, () -> plain.recordOutput("gen", 40));
      assertEquals(Status.FAILED_PRECONDITION, e.status());
      assertEquals(3, loadOf(plain, 1).activeBlocks());
    }
  }

  @Test
  void closeIsIdempotentAndUseAfterCloseThrows() {
    Router router = routerWithWorkers(2);
    assertFalse(router.isClosed());
    router.close();
    router.close();
    assertTrue(router.isClosed());
    IllegalStateException e =
        assertThrows(IllegalStateException.class, () -> router.findBestMatch(PROMPT));
    assertTrue(e.getMessage().contains("Router is closed"));
    assertThrows(IllegalStateException.class, () -> router.addWorker(9));
    assertThrows(IllegalStateException.class, router::metrics);
    assertThrows(IllegalStateException.class, router::snapshot);

    EventBatch batch = new EventBatch();
    batch.close();
    batch.close();
    assertThrows(IllegalStateException.class, batch::encode);
    assertThrows(IllegalStateException.class, () -> batch.addCleared(1, 0, 0));
  }

  @Test
  void unreachableObjectsAreFreedByTheCleaner() throws Exception {
    // Nothing to assert but the absence of a crash or leak report: objects never closed are
    // freed by the Cleaner once collected.
    for (int i = 0; i < 200; ++i) {
      Router r = routerWithWorkers(1);
      r.findBestMatch(PROMPT);
      new EventBatch().addCleared(1, 0, 0);
    }
    for (int i = 0; i < 5; ++i) {
      System.gc();
      Thread.sleep(20);
    }
    try (Router r = routerWithWorkers(1)) {
      assertNotEquals(0, r.stateDigest());
    }
  }
}
