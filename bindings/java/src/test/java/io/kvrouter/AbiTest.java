package io.kvrouter;

import static io.kvrouter.TestSupport.BLOCK;
import static io.kvrouter.TestSupport.await;
import static io.kvrouter.TestSupport.tokens;
import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertDoesNotThrow;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.lang.reflect.Field;
import java.lang.reflect.Modifier;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.EnumMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;
import java.util.function.UnaryOperator;
import java.util.regex.Pattern;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;
import org.junit.jupiter.api.io.TempDir;

/**
 * The generated struct plumbing (Abi.java and kvrouter_jni_abi.h, both from kvrouter.h) as the
 * hand-written classes use it: defaults read from the right slots, every option reaching the
 * library as the C field it is meant for (the library names the field it refuses), results and
 * counter arrays landing in the right accessors, and the library versions the binding accepts.
 */
@Timeout(60)
class AbiTest {
  private static final int[] PROMPT = tokens(48, 3000); // 3 blocks

  /** The slots of one Abi struct class by C field name ("block_size" -> 0), without LEN. */
  private static Map<String, Integer> slots(Class<?> abiStruct) throws IllegalAccessException {
    Map<String, Integer> slots = new TreeMap<>();
    for (Field f : abiStruct.getDeclaredFields()) {
      if (!Modifier.isStatic(f.getModifiers()) || f.getName().equals("LEN")) continue;
      slots.put(f.getName().toLowerCase(), f.getInt(null));
    }
    return slots;
  }

  private static long bits(double v) {
    return Double.doubleToRawLongBits(v);
  }

  @Test
  void theGlueEncodesEveryStructInItsGeneratedSlots() {
    assertEquals(Abi.RouterOptions.LEN, Native.routerOptionsDefaults().length);
    assertEquals(Abi.WorkerConfig.LEN, Native.workerConfigDefaults().length);
    assertEquals(Abi.RequestOptions.LEN, Native.requestOptionsDefaults().length);
    assertEquals(Abi.RoutingHints.LEN, Native.routingHintsDefaults().length);
    assertEquals(Abi.DisaggOptions.LEN, Native.disaggOptionsDefaults().length);
    assertEquals(Abi.IngestOptions.LEN, Native.ingestOptionsDefaults().length);
    assertEquals(Abi.EngineWorker.LEN, Native.engineWorkerDefaults().length);
    assertEquals(Abi.JetstreamSource.LEN, Native.jetstreamSourceDefaults().length);
    assertEquals(Abi.StoredEvent.LEN, Native.storedEventDefaults().length);
    assertEquals(Abi.RemovedEvent.LEN, Native.removedEventDefaults().length);
    assertEquals(
        Abi.Metrics.EVENTS + Abi.EVENT_KINDS * Abi.EVENT_OUTCOMES,
        Abi.Metrics.EVENT_BATCHES_REJECTED);
    assertEquals(Abi.IngestStats.REJECTED + Abi.INGEST_REJECT_REASONS, Abi.IngestStats.GAPS);
    try (Router router = TestSupport.routerWithWorkers(1)) {
      long h = router.acquire();
      try {
        assertEquals(Abi.Metrics.LEN, Native.metrics(h).length);
      } finally {
        router.release();
      }
    }
  }

  /**
   * kvr_router_options' defaults as kvrouter.h documents them, field by field: in the library's
   * encoded defaults (slot by C field name) and through RouterOptions' accessors.
   */
  @Test
  void routerOptionsDefaultsAreTheHeadersFieldByField() throws IllegalAccessException {
    Map<String, Long> documented = new LinkedHashMap<>();
    documented.put("block_size", 16L);
    documented.put("flags", 0L); // Dynamo's defaults
    documented.put("queue_policy", (long) QueuePolicy.FCFS.code());
    documented.put("overlap_score_credit", bits(1.0));
    documented.put("prefill_load_scale", bits(1.0));
    documented.put("host_cache_hit_weight", bits(0.75));
    documented.put("disk_cache_hit_weight", bits(0.25));
    documented.put("temperature", bits(0.0));
    documented.put("queue_threshold", null); // negative: never queue
    documented.put("approx_ttl_seconds", bits(120.0));
    documented.put("approx_max_blocks", 1L << 20);
    documented.put("approx_prune_target_ratio", bits(0.8));
    documented.put("request_expiry_seconds", bits(300.0));
    documented.put("random_seed", 0L);
    documented.put("overlap_score_credit_decay", bits(0.0));
    documented.put("decode_active_request_weight", bits(0.0));
    documented.put("index_shards", 1L);
    documented.put("cost_function", (long) CostFunction.CREDIT.code());
    documented.put("prefill_tokens_per_second", bits(0.0));
    documented.put("ttft_miss_weight", bits(3.0));

    // A field added to kvr_router_options fails here until it has a default, an accessor and a
    // builder setter (README.md: adding a field).
    Map<String, Integer> slots = slots(Abi.RouterOptions.class);
    assertEquals(new TreeMap<>(documented).keySet(), slots.keySet());
    long[] c = Native.routerOptionsDefaults();
    for (Map.Entry<String, Long> e : documented.entrySet()) {
      long value = c[slots.get(e.getKey())];
      if (e.getValue() == null) {
        assertTrue(Double.longBitsToDouble(value) < 0, e.getKey());
      } else {
        assertEquals(e.getValue(), value, e.getKey());
      }
    }

    RouterOptions o = RouterOptions.defaults();
    assertArrayEquals(c, o.encoded());
    assertEquals(16, o.blockSize());
    assertFalse(o.approximate());
    assertTrue(o.assumeKvReuse());
    assertTrue(o.trackPrefillTokens());
    assertFalse(o.eagle());
    assertFalse(o.entropySeed());
    assertFalse(o.trackOutputBlocks());
    assertEquals(QueuePolicy.FCFS, o.queuePolicy());
    assertEquals(1.0, o.overlapScoreCredit());
    assertEquals(1.0, o.prefillLoadScale());
    assertEquals(0.75, o.hostCacheHitWeight());
    assertEquals(0.25, o.diskCacheHitWeight());
    assertEquals(0.0, o.temperature());
    assertTrue(o.queueThreshold() < 0);
    assertEquals(120.0, o.approxTtlSeconds());
    assertEquals(1L << 20, o.approxMaxBlocks());
    assertEquals(0.8, o.approxPruneTargetRatio());
    assertEquals(300.0, o.requestExpirySeconds());
    assertEquals(0, o.randomSeed());
    assertEquals(0.0, o.overlapScoreCreditDecay());
    assertEquals(0.0, o.decodeActiveRequestWeight());
    assertEquals(1, o.indexShards());
    assertEquals(CostFunction.CREDIT, o.costFunction());
    assertEquals(0.0, o.prefillTokensPerSecond());
    assertEquals(3.0, o.ttftMissWeight());
  }

  /** An invalid value of one setter, and the C field the library must name refusing it. */
  private record Refused<B>(String field, UnaryOperator<B> set) {}

  private static void assertNamesOnly(String field, List<String> fields, KvRouterException e) {
    assertEquals(Status.INVALID_ARGUMENT, e.status(), e.getMessage());
    for (String other : fields) {
      boolean named = Pattern.compile("\\b" + other + "\\b").matcher(e.getMessage()).find();
      assertEquals(other.equals(field), named, field + " refused as: " + e.getMessage());
    }
  }

  /**
   * Each RouterOptions setter reaches kvr_router_new as the C field of its name: given a value
   * the library refuses, the refusal names that field and no other. Then every setting at once,
   * valid, round-trips through the builder and makes a router.
   */
  @Test
  void everyRouterOptionReachesTheLibraryAsItsCField() {
    List<Refused<RouterOptions.Builder>> refused =
        List.of(
            new Refused<>("block_size", b -> b.blockSize(0)),
            new Refused<>("overlap_score_credit", b -> b.overlapScoreCredit(-1)),
            new Refused<>("prefill_load_scale", b -> b.prefillLoadScale(-1)),
            new Refused<>("host_cache_hit_weight", b -> b.hostCacheHitWeight(2)),
            new Refused<>("disk_cache_hit_weight", b -> b.diskCacheHitWeight(2)),
            new Refused<>("temperature", b -> b.temperature(-1)),
            new Refused<>("queue_threshold", b -> b.queueThreshold(Double.POSITIVE_INFINITY)),
            new Refused<>("approx_ttl_seconds", b -> b.approxTtlSeconds(0)),
            new Refused<>("approx_max_blocks", b -> b.approxMaxBlocks(0)),
            new Refused<>("approx_prune_target_ratio", b -> b.approxPruneTargetRatio(1.5)),
            new Refused<>("request_expiry_seconds", b -> b.requestExpirySeconds(0)),
            new Refused<>("overlap_score_credit_decay", b -> b.overlapScoreCreditDecay(-1)),
            new Refused<>("decode_active_request_weight", b -> b.decodeActiveRequestWeight(-1)),
            new Refused<>("index_shards", b -> b.indexShards(0)),
            new Refused<>("index_shards", b -> b.indexShards(65)),
            new Refused<>("prefill_tokens_per_second", b -> b.prefillTokensPerSecond(-1)),
            new Refused<>("ttft_miss_weight", b -> b.ttftMissWeight(-1)));
    List<String> fields = new ArrayList<>();
    for (Refused<RouterOptions.Builder> r : refused) fields.add(r.field());
    for (Refused<RouterOptions.Builder> r : refused) {
      RouterOptions options = r.set().apply(RouterOptions.builder()).build();
      assertNamesOnly(
          r.field(), fields, assertThrows(KvRouterException.class, () -> new Router(options)));
    }

    // The flags: approximate mode takes no KV events; output tracking enables recordOutput.
    try (Router approx = new Router(RouterOptions.builder().approximate(true).build())) {
      approx.addWorker(1);
      StoredEvent event = TestSupport.stored(1, PROMPT, 1, 1);
      KvRouterException e =
          assertThrows(KvRouterException.class, () -> approx.applyStored(event));
      assertEquals(Status.FAILED_PRECONDITION, e.status());
    }
    try (Router tracking = new Router(RouterOptions.builder().trackOutputBlocks(true).build());
        Router plain = new Router()) {
      assertDoesNotThrow(() -> tracking.recordOutput("r", 1));
      KvRouterException e =
          assertThrows(KvRouterException.class, () -> plain.recordOutput("r", 1));
      assertEquals(Status.FAILED_PRECONDITION, e.status());
    }

    RouterOptions all =
        RouterOptions.builder()
            .blockSize(32)
            .approximate(true)
            .assumeKvReuse(false)
            .trackPrefillTokens(false)
            .eagle(true)
            .entropySeed(true)
            .trackOutputBlocks(true)
            .queuePolicy(QueuePolicy.WSPT)
            .overlapScoreCredit(0.5)
            .prefillLoadScale(2.5)
            .hostCacheHitWeight(0.5)
            .diskCacheHitWeight(0.125)
            .temperature(0.25)
            .queueThreshold(3.5)
            .approxTtlSeconds(60)
            .approxMaxBlocks(12345)
            .approxPruneTargetRatio(0.5)
            .requestExpirySeconds(99)
            .randomSeed(-2)
            .overlapScoreCreditDecay(0.75)
            .decodeActiveRequestWeight(4)
            .indexShards(4)
            .costFunction(CostFunction.PREDICTED_TTFT)
            .prefillTokensPerSecond(5000)
            .ttftMissWeight(0.5)
            .build()
            .toBuilder()
            .build();
    assertEquals(32, all.blockSize());
    assertTrue(all.approximate());
    assertFalse(all.assumeKvReuse());
    assertFalse(all.trackPrefillTokens());
    assertTrue(all.eagle());
    assertTrue(all.entropySeed());
    assertTrue(all.trackOutputBlocks());
    assertEquals(QueuePolicy.WSPT, all.queuePolicy());
    assertEquals(0.5, all.overlapScoreCredit());
    assertEquals(2.5, all.prefillLoadScale());
    assertEquals(0.5, all.hostCacheHitWeight());
    assertEquals(0.125, all.diskCacheHitWeight());
    assertEquals(0.25, all.temperature());
    assertEquals(3.5, all.queueThreshold());
    assertEquals(60.0, all.approxTtlSeconds());
    assertEquals(12345, all.approxMaxBlocks());
    assertEquals(0.5, all.approxPruneTargetRatio());
    assertEquals(99.0, all.requestExpirySeconds());
    assertEquals(-2, all.randomSeed());
    assertEquals(0.75, all.overlapScoreCreditDecay());
    assertEquals(4.0, all.decodeActiveRequestWeight());
    assertEquals(4, all.indexShards());
    assertEquals(CostFunction.PREDICTED_TTFT, all.costFunction());
    assertEquals(5000.0, all.prefillTokensPerSecond());
    assertEquals(0.5, all.ttftMissWeight());
    long flags =
        Abi.ROUTER_APPROXIMATE
            | Abi.ROUTER_NO_KV_REUSE
            | Abi.ROUTER_NO_PREFILL_TRACKING
            | Abi.ROUTER_EAGLE
            | Abi.ROUTER_ENTROPY_SEED
            | Abi.ROUTER_TRACK_OUTPUT_BLOCKS;
    assertEquals(flags, all.encoded()[Abi.RouterOptions.FLAGS]);
    // The predicted-TTFT cost needs prefill tracking, which `all` turns off.
    try (Router router = new Router(all.toBuilder().costFunction(CostFunction.CREDIT).build())) {
      assertEquals(0, router.metrics().workers());
    }
    KvRouterException needsTracking = assertThrows(KvRouterException.class, () -> new Router(all));
    assertEquals(Status.INVALID_ARGUMENT, needsTracking.status());
  }

  /** Each per-request override reaches the router as its C field (validated per request). */
  @Test
  void everyRequestOverrideReachesTheLibraryAsItsCField() {
    List<Refused<RequestOptions.Builder>> refused =
        List.of(
            new Refused<>("overlap_score_credit", b -> b.overlapScoreCredit(-1)),
            new Refused<>("prefill_load_scale", b -> b.prefillLoadScale(-1)),
            new Refused<>("host_cache_hit_weight", b -> b.hostCacheHitWeight(2)),
            new Refused<>("disk_cache_hit_weight", b -> b.diskCacheHitWeight(2)),
            new Refused<>("temperature", b -> b.temperature(-1)),
            new Refused<>("overlap_score_credit_decay", b -> b.overlapScoreCreditDecay(-1)),
            new Refused<>("decode_active_request_weight", b -> b.decodeActiveRequestWeight(-1)),
            new Refused<>("ttft_miss_weight", b -> b.ttftMissWeight(-1)));
    List<String> fields = new ArrayList<>();
    for (Refused<RequestOptions.Builder> r : refused) fields.add(r.field());
    try (Router router = TestSupport.routerWithWorkers(2)) {
      for (Refused<RequestOptions.Builder> r : refused) {
        RequestOptions options = r.set().apply(RequestOptions.builder()).build();
        assertNamesOnly(
            r.field(),
            fields,
            assertThrows(KvRouterException.class, () -> router.findBestMatch(PROMPT, options)));
      }
      // The defaults (NaN, -1) keep the router's settings; admission books under the id.
      RouteResult r = router.findBestMatch(PROMPT, RequestOptions.admit("booked"));
      assertTrue(r.booked());
      assertEquals(1, router.metrics().requestsActive());
    }
  }

  /** A worker's ranks and capacity reach the router and come back in loads and signals. */
  @Test
  void workerConfigReachesTheRouter() {
    try (Router router = TestSupport.routerWithWorkers(0)) {
      router.addWorker(
          WorkerConfig.builder(9)
              .blockSize(BLOCK)
              .dpStart(3)
              .dpSize(2)
              .totalKvBlocks(777)
              .maxNumBatchedTokens(4096)
              .build());
      List<PotentialLoad> loads = router.potentialLoads(PROMPT);
      assertEquals(2, loads.size());
      for (PotentialLoad l : loads) {
        assertEquals(9, l.workerId());
        assertTrue(l.dpRank() == 3 || l.dpRank() == 4, l.toString());
        assertEquals(PROMPT.length, l.potentialPrefillTokens());
        assertEquals(3, l.potentialDecodeBlocks());
        assertEquals(0, l.activeRequests());
      }
      RoutingHints rank4 = RoutingHints.builder().workerId(9).dpRank(4).build();
      RouteSignals s = router.previewRoute(PROMPT, null, rank4);
      assertEquals(9, s.workerId());
      assertEquals(4, s.dpRank());
      assertEquals(777, s.totalKvBlocks());
      assertEquals(3, s.promptBlocks());
      assertEquals(PROMPT.length, s.promptTokens());
      assertEquals(3, s.potentialDecodeBlocks());
      assertFalse(s.booked());

      KvRouterException e =
          assertThrows(
              KvRouterException.class,
              () -> router.addWorker(WorkerConfig.builder(10).blockSize(2 * BLOCK).build()));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      e = assertThrows(KvRouterException.class, () -> router.addWorker(WorkerConfig.of(9)));
      assertEquals(Status.ALREADY_EXISTS, e.status());
    }
  }

  /**
   * A route result, its candidates and the overlaps agree on what they describe (the candidate
   * count rides in the slot after the route result's), and a stored event's tier lands in the
   * overlap's tier counts.
   */
  @Test
  void routeResultsCandidatesAndOverlapsLandInTheirAccessors() {
    try (Router router = TestSupport.routerWithWorkers(3)) {
      router.applyStored(TestSupport.stored(2, PROMPT, 2, 0x100)); // device, 2 blocks
      router.applyStored(
          StoredEvent.builder(3)
              .tier(Tier.HOST_PINNED)
              .blockHashes(0x200)
              .tokenIds(java.util.Arrays.copyOf(PROMPT, BLOCK))
              .build());
      RouteResult r = router.findBestMatch(PROMPT, null, 10);
      assertEquals(2, r.workerId());
      assertEquals(0, r.dpRank());
      assertEquals(3, r.promptBlocks());
      assertEquals(2, r.deviceOverlapBlocks());
      assertEquals(2.0, r.effectiveOverlapBlocks());
      assertEquals(2 * BLOCK, r.cachedTokens());
      assertEquals(PROMPT.length, r.promptTokens());
      assertFalse(r.booked());
      assertFalse(r.queued());
      assertEquals(3, r.totalCandidates());
      assertEquals(3, r.candidates().size());
      Candidate chosen = null;
      for (Candidate c : r.candidates()) {
        if (c.chosen()) {
          assertEquals(null, chosen, "one candidate chosen");
          chosen = c;
        }
      }
      assertEquals(2, chosen.workerId());
      assertEquals(r.dpRank(), chosen.dpRank());
      assertEquals(2, chosen.deviceBlocks());
      assertEquals(r.cachedTokens(), chosen.cachedTokens());
      assertEquals(r.effectiveOverlapBlocks(), chosen.effectiveOverlapBlocks());
      assertEquals(r.cost(), chosen.cost());
      assertEquals(1.0, chosen.creditDecay());
      assertEquals(0.0, chosen.requestCost());

      RouteResult one = router.findBestMatch(PROMPT, null, 1);
      assertEquals(1, one.candidates().size());
      assertEquals(3, one.totalCandidates());

      Map<Long, Overlap> overlaps = new TreeMap<>();
      for (Overlap o : router.overlapScores(PROMPT)) overlaps.put(o.workerId(), o);
      assertEquals(List.of(2L, 3L), new ArrayList<>(overlaps.keySet()));
      Overlap device = overlaps.get(2L);
      assertEquals(2, device.deviceBlocks());
      assertEquals(0, device.hostBlocks());
      assertEquals(2.0, device.effectiveOverlapBlocks());
      assertEquals(2 * BLOCK, device.cachedTokens());
      assertEquals(2, device.treeSize());
      Overlap host = overlaps.get(3L);
      assertEquals(0, host.deviceBlocks());
      assertEquals(1, host.hostBlocks());
      assertEquals(0, host.diskBlocks());
      assertEquals(0, host.externalBlocks());
      assertEquals(0.75, host.effectiveOverlapBlocks());
      assertEquals(12, host.cachedTokens()); // round(0.75 × 16)
      assertEquals(1, host.treeSize());
    }
  }

  /**
   * Each cell of kvr_metrics.events[kind][outcome] (15 slots, row by row) lands in its accessor:
   * the cells are given distinct counts and every other cell stays 0.
   */
  @Test
  void metricsEventCellsLandInTheirAccessors() {
    try (Router router = TestSupport.routerWithWorkers(3)) {
      router.applyStored(TestSupport.stored(1, PROMPT, 1, 0x10)); // STORED OK: 1
      for (int i = 0; i < 2; ++i) { // STORED PARENT_BLOCK_NOT_FOUND: 2
        StoredEvent orphan =
            StoredEvent.builder(1)
                .parentHash(0xDEAD + i)
                .blockHashes(0x20 + i)
                .tokenIds(tokens(BLOCK, 5))
                .build();
        assertThrows(KvRouterException.class, () -> router.applyStored(orphan));
      }
      for (int i = 0; i < 3; ++i) { // STORED INVALID_BLOCK: 3
        StoredEvent partial =
            StoredEvent.builder(2).blockHashes(0x30 + i).tokenIds(tokens(5, 5)).build();
        assertThrows(KvRouterException.class, () -> router.applyStored(partial));
      }
      for (int i = 0; i < 4; ++i) { // REMOVED BLOCK_NOT_FOUND: 4
        RemovedEvent unknown = RemovedEvent.of(2, 0x40 + i);
        assertThrows(KvRouterException.class, () -> router.applyRemoved(unknown));
      }
      for (int i = 0; i < 5; ++i) router.applyCleared(3, 0, i); // CLEARED OK: 5
      router.applyRemoved(RemovedEvent.of(1, 0x10)); // REMOVED OK: 1 (the stored block)
      assertThrows(KvRouterException.class, () -> router.applyEventBatch(new byte[] {1, 2, 3}));
      router.findBestMatch(PROMPT);

      Map<EventKind, Map<EventOutcome, Long>> expected = new EnumMap<>(EventKind.class);
      for (EventKind k : EventKind.values()) expected.put(k, new EnumMap<>(EventOutcome.class));
      expected.get(EventKind.STORED).put(EventOutcome.OK, 1L);
      expected.get(EventKind.STORED).put(EventOutcome.PARENT_BLOCK_NOT_FOUND, 2L);
      expected.get(EventKind.STORED).put(EventOutcome.INVALID_BLOCK, 3L);
      expected.get(EventKind.REMOVED).put(EventOutcome.BLOCK_NOT_FOUND, 4L);
      expected.get(EventKind.REMOVED).put(EventOutcome.OK, 1L);
      expected.get(EventKind.CLEARED).put(EventOutcome.OK, 5L);
      Metrics m = router.metrics();
      for (EventKind k : EventKind.values()) {
        long rejected = 0;
        for (EventOutcome o : EventOutcome.values()) {
          long want = expected.get(k).getOrDefault(o, 0L);
          assertEquals(want, m.events(k, o), k + "/" + o + " in " + m);
          if (o != EventOutcome.OK) rejected += want;
        }
        assertEquals(rejected, m.eventsRejected(k), k.toString());
      }
      // The fields after the array.
      assertEquals(1, m.eventBatchesRejected());
      assertEquals(1, m.decisions());
      assertEquals(0, m.requestsActive());
      assertEquals(0, m.queuePending());
      assertEquals(3, m.workers());
      assertEquals(0, m.indexBlocks());
      assertEquals(0, m.replicaChangesApplied());
      // Rejected events are not refusals for memory; nothing was refused memory here.
      assertEquals(0, m.eventsRefusedForMemory());
      assertEquals(0, m.replicaChangesUnpublished());
      assertEquals(0, m.decisionsPricedAgain()); // one caller at a time
      // No hybrid model here: no sliding-window group's events, nor blocks.
      assertEquals(0, m.slidingEventsApplied());
      assertEquals(0, m.slidingEventsRejected());
      assertEquals(0, m.indexSlidingBlocks());
    }
  }

  /**
   * Each reason of kvr_ingest_stats.rejected[8] lands in its accessor (distinct counts, every
   * other reason 0, the unnamed eighth slot too), and the counters after the array in theirs.
   */
  @Test
  void ingestRejectionsLandInTheirAccessors(@TempDir Path dir) {
    try (Router router = TestSupport.routerWithWorkers(2);
        Ingest ingest = new Ingest(router)) {
      Listener listener = ingest.listen("unix://" + dir.resolve("abi.sock"));
      ingest.start();
      try (Publisher publisher = Publisher.connect(listener.endpoint());
          EventBatch batch = new EventBatch()) {
        for (int i = 0; i < 2; ++i) publisher.sendEncoded(new byte[] {9, 9, 9, 9, 9, 9, 9, 9});
        batch.addStored(TestSupport.stored(1, PROMPT, 2, 0x60));
        publisher.send(batch);
        batch
            .clear()
            .addStored(
                StoredEvent.builder(1)
                    .parentHash(0xBEEF)
                    .blockHashes(0x70)
                    .tokenIds(tokens(BLOCK, 7))
                    .build());
        publisher.send(batch);
      }
      Duration wait = Duration.ofSeconds(10);
      await("4 frames", wait, () -> ingest.stats(listener.sourceId()).messages() >= 4);
      IngestStats stats = ingest.stats(listener.sourceId());
      Map<IngestReject, Long> expected = new EnumMap<>(IngestReject.class);
      expected.put(IngestReject.BAD_FLATBUFFERS, 2L);
      expected.put(IngestReject.INDEX, 1L);
      for (IngestReject reason : IngestReject.values()) {
        long want = expected.getOrDefault(reason, 0L);
        assertEquals(want, stats.rejected(reason), reason + " in " + stats);
      }
      assertEquals(3, stats.rejectedTotal()); // the eighth slot, no reason yet, is 0
      assertEquals(4, stats.messages());
      assertEquals(1, stats.eventsApplied());
      assertEquals(0, stats.stateUnknown());
      assertEquals(0, stats.gaps());
      assertEquals(0, stats.missedMessages());
      assertEquals(0, stats.restarts());
      assertEquals(0, stats.recoveries());
      assertEquals(1, stats.connections());
      assertEquals(0, stats.published());
      assertEquals(0, stats.publishFailures());
      assertEquals(0, stats.streamSequence()); // not a JetStream source
      assertEquals(0, stats.consumerRemakes());
      assertEquals(0, stats.consumerRemakeFailures());
      assertEquals(0, stats.eventsIgnored()); // not an engine source
      assertEquals(0, stats.bookingsTrimmed()); // not a replica sync
      IngestStats total = ingest.stats(0);
      assertEquals(stats.rejectedTotal(), total.rejectedTotal());
      assertEquals(2, router.overlapScores(PROMPT).get(0).deviceBlocks());
      // The same prompt, hashed by the caller, gets the same rows.
      long[] hashes = Hashing.blockHashes(PROMPT, BLOCK);
      assertEquals(router.overlapScores(PROMPT), router.overlapScoresHashed(hashes, null));
    }
  }

  /**
   * kvr_jetstream_source: the builder starts from the library's defaults (the header's 1 h and 1
   * GiB), and every setter lands in its own slot (each flag alone too). A field added to the struct
   * fails here until it has a setter.
   */
  @Test
  void jetStreamSourceSettersLandInTheirSlots() throws IllegalAccessException {
    assertEquals(
        Set.of("flags", "start_sequence", "max_age_seconds", "max_bytes"),
        slots(Abi.JetstreamSource.class).keySet());
    long[] defaults = Native.jetstreamSourceDefaults();
    JetStreamSource d = JetStreamSource.builder("nats://127.0.0.1:1", "KV", "kv.>").build();
    assertArrayEquals(defaults, d.scalars);
    assertEquals(0, d.startSequence());
    assertFalse(d.resume());
    assertFalse(d.createStream());
    assertEquals(3600.0, d.maxAgeSeconds());
    assertEquals(1L << 30, d.maxBytes());
    assertNull(d.durable());

    JetStreamSource all =
        JetStreamSource.builder("nats://127.0.0.1:1", "KV", "kv.>")
            .durable("gw-1")
            .startSequence(7)
            .resume(true)
            .createStream(true)
            .maxAgeSeconds(90)
            .maxBytes(1 << 20)
            .build();
    long[] want = defaults.clone();
    want[Abi.JetstreamSource.FLAGS] = Abi.JETSTREAM_RESUME | Abi.JETSTREAM_CREATE_STREAM;
    want[Abi.JetstreamSource.START_SEQUENCE] = 7;
    want[Abi.JetstreamSource.MAX_AGE_SECONDS] = bits(90.0);
    want[Abi.JetstreamSource.MAX_BYTES] = 1 << 20;
    assertArrayEquals(want, all.scalars);
    assertEquals("gw-1", all.durable());
    assertEquals(
        Abi.JETSTREAM_RESUME,
        JetStreamSource.builder("u", "s", "x").resume(true).build().scalars[Abi.JetstreamSource.FLAGS]);
    assertEquals(
        Abi.JETSTREAM_CREATE_STREAM,
        JetStreamSource.builder("u", "s", "x")
            .createStream(true)
            .build()
            .scalars[Abi.JetstreamSource.FLAGS]);
    assertEquals(
        0,
        JetStreamSource.builder("u", "s", "x")
            .resume(true)
            .resume(false)
            .build()
            .scalars[Abi.JetstreamSource.FLAGS]);
  }

  /** The library versions the binding loads: its ABI's major.minor, from its header's patch. */
  @Test
  void theVersionRule() {
    int abi = Abi.VERSION_MAJOR * 10000 + Abi.VERSION_MINOR * 100;
    assertEquals(abi / 100, KvRouter.headerVersion() / 100);
    assertEquals(abi / 100, KvRouter.version() / 100);
    assertDoesNotThrow(() -> NativeLoader.checkVersion(abi, "same", abi));
    assertDoesNotThrow(() -> NativeLoader.checkVersion(abi + 7, "newer patch", abi));
    assertDoesNotThrow(() -> NativeLoader.checkVersion(abi + 7, "newer patch", abi + 3));
    UnsatisfiedLinkError e =
        assertThrows(
            UnsatisfiedLinkError.class, () -> NativeLoader.checkVersion(abi + 3, "older", abi + 4));
    assertTrue(e.getMessage().contains("older"), e.getMessage());
    assertThrows(
        UnsatisfiedLinkError.class, () -> NativeLoader.checkVersion(abi + 100, "next minor", abi));
    assertThrows(
        UnsatisfiedLinkError.class,
        () -> NativeLoader.checkVersion(abi + 10000, "next major", abi));
    if (Abi.VERSION_MINOR > 0) {
      assertThrows(
          UnsatisfiedLinkError.class, () -> NativeLoader.checkVersion(abi - 100, "previous", abi));
    }
    // A glue built against another minor's header than the classes were generated from.
    e =
        assertThrows(
            UnsatisfiedLinkError.class,
            () -> NativeLoader.checkVersion(abi + 100, "glue", abi + 100));
    assertTrue(e.getMessage().contains("JNI glue"), e.getMessage());
  }
}
