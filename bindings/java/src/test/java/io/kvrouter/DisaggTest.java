package io.kvrouter;

import static io.kvrouter.TestSupport.BLOCK;
import static io.kvrouter.TestSupport.tokens;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertSame;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.time.Duration;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/** Disaggregated prefill / decode through the pool routers. */
@Timeout(120)
class DisaggTest {
  private static final int[] PROMPT = tokens(128, 50);

  @Test
  void remotePrefillThenDecode() {
    try (DisaggRouter d = new DisaggRouter()) {
      Router prefill = d.prefillRouter();
      Router decode = d.decodeRouter();
      assertSame(prefill, d.prefillRouter());
      assertTrue(prefill.isPool());
      prefill.addWorker(WorkerConfig.builder(10).maxNumBatchedTokens(8192).build());
      prefill.addWorker(WorkerConfig.builder(11).maxNumBatchedTokens(8192).build());
      decode.addWorker(WorkerConfig.builder(20).totalKvBlocks(1000).build());
      prefill.applyStored(
          StoredEvent.builder(11)
              .blockHashes(1, 2, 3)
              .tokenIds(java.util.Arrays.copyOf(PROMPT, 48))
              .build());

      PrefillResult where = d.routePrefill(PROMPT, RequestOptions.withId("r1"), null);
      assertTrue(where.remote());
      assertEquals(PrefillReason.REMOTE, where.reason());
      assertEquals(11, where.workerId());
      assertEquals(48, where.cachedTokens());
      assertTrue(where.bootstrapRoom() >= 0);
      assertEquals(1, prefill.metrics().requestsActive());

      RouteSignals dec = d.routeDecode(PROMPT, RequestOptions.withId("r1"), null, where.remote());
      assertEquals(20, dec.workerId());
      assertTrue(dec.booked());
      assertEquals(1000, dec.totalKvBlocks());
      assertEquals(1, decode.metrics().requestsActive());

      prefill.freeRequest("r1");
      decode.freeRequest("r1");
      assertFalse(d.prefillWorkerBusy(PROMPT, null, 1.0));
      KvRouterException e =
          assertThrows(KvRouterException.class, () -> d.prefillWorkerBusy(PROMPT, null, -1.0));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      // with threshold 0, any prefill load on the chosen rank is busy
      d.routePrefill(PROMPT, RequestOptions.withId("load"), null);
      assertTrue(d.prefillWorkerBusy(PROMPT, null, 0.0));
      prefill.freeRequest("load");

      // prefill pins apply
      PrefillResult pinned =
          d.routePrefill(
              PROMPT,
              RequestOptions.withId("r2"),
              RoutingHints.builder().phase(Phase.PREFILL).prefillWorkerId(10).build());
      assertEquals(10, pinned.workerId());
    }
  }

  @Test
  void noPrefillWorkersRunsAggregatedUnlessEnforced() {
    try (DisaggRouter d = new DisaggRouter()) {
      d.decodeRouter().addWorker(1);
      PrefillResult where = d.routePrefill(PROMPT, RequestOptions.withId("a"), null);
      assertFalse(where.remote());
      assertEquals(PrefillReason.NO_PREFILL_WORKERS, where.reason());
      assertEquals(-1, where.bootstrapRoom());
    }
    RouterOptions pool = RouterOptions.builder().blockSize(BLOCK).build();
    try (DisaggRouter d =
        new DisaggRouter(pool, pool, DisaggOptions.builder().enforce(true).build())) {
      d.decodeRouter().addWorker(1);
      KvRouterException e =
          assertThrows(
              KvRouterException.class,
              () -> d.routePrefill(PROMPT, RequestOptions.withId("a"), null));
      assertEquals(Status.FAILED_PRECONDITION, e.status());
    }
  }

  @Test
  void islBoundingPrefillsShortPromptsLocally() {
    DisaggOptions options =
        DisaggOptions.builder()
            .policy(DisaggPolicy.ISL_BOUNDING)
            .maxLocalPrefillTokens(64)
            .decodeBusyThreshold(0.9)
            .build();
    try (DisaggRouter d = new DisaggRouter(null, null, options)) {
      d.prefillRouter().addWorker(10);
      d.decodeRouter().addWorker(WorkerConfig.builder(20).totalKvBlocks(10000).build());
      PrefillResult shortPrompt = d.routePrefill(tokens(32, 1), RequestOptions.withId("s"), null);
      assertFalse(shortPrompt.remote());
      assertEquals(PrefillReason.SHORT_ISL, shortPrompt.reason());
      PrefillResult longPrompt = d.routePrefill(tokens(512, 1), RequestOptions.withId("l"), null);
      assertTrue(longPrompt.remote());
    }
  }

  /**
   * Closing the DisaggRouter closes both pools' queues first: a routePrefill waiting in the
   * prefill pool's queue and an admitted call waiting in the decode pool's (through its pool
   * router), neither with a timeout, are cancelled, and close() returns.
   */
  @Test
  void closeCancelsCallsWaitingInEitherPoolsQueue() throws Exception {
    RouterOptions queueing = RouterOptions.builder().blockSize(BLOCK).queueThreshold(0.0).build();
    int[] prompt = tokens(64, 9);
    DisaggRouter d = new DisaggRouter(queueing, queueing, null);
    Router prefill = d.prefillRouter();
    Router decode = d.decodeRouter();
    prefill.addWorker(WorkerConfig.builder(10).maxNumBatchedTokens(16).build());
    decode.addWorker(WorkerConfig.builder(20).maxNumBatchedTokens(16).build());
    // each pool's only rank over its threshold
    assertTrue(d.routePrefill(prompt, RequestOptions.withId("p-busy"), null).remote());
    assertTrue(d.routeDecode(prompt, RequestOptions.withId("d-busy"), null, false).booked());
    CompletableFuture<PrefillResult> prefillWaiting =
        TestSupport.onThread(
            "prefill waiter", () -> d.routePrefill(prompt, RequestOptions.withId("p-w"), null));
    CompletableFuture<RouteResult> decodeWaiting =
        TestSupport.onThread(
            "decode waiter", () -> decode.findBestMatch(prompt, RequestOptions.admit("d-w")));
    TestSupport.await(
        "both queued",
        Duration.ofSeconds(10),
        () -> prefill.metrics().queuePending() == 1 && decode.metrics().queuePending() == 1);
    CompletableFuture<Boolean> closed =
        TestSupport.onThread(
            "closer",
            () -> {
              d.close();
              return true;
            });
    assertTrue(closed.get(10, TimeUnit.SECONDS), "close() did not return");
    TestSupport.cancelledWithin10s(prefillWaiting);
    TestSupport.cancelledWithin10s(decodeWaiting);
    assertTrue(prefill.isClosed() && decode.isClosed());
  }

  /**
   * Closing a pool router (only that handle) closes that pool's queue too, so that close() does not
   * wait for good for a call waiting there through it; the other pool goes on.
   */
  @Test
  void closingAPoolRouterCancelsACallWaitingInThatPool() throws Exception {
    RouterOptions queueing = RouterOptions.builder().blockSize(BLOCK).queueThreshold(0.0).build();
    int[] prompt = tokens(64, 11);
    try (DisaggRouter d = new DisaggRouter(queueing, queueing, null)) {
      Router decode = d.decodeRouter();
      d.prefillRouter().addWorker(WorkerConfig.builder(10).maxNumBatchedTokens(16).build());
      decode.addWorker(WorkerConfig.builder(20).maxNumBatchedTokens(16).build());
      assertTrue(decode.findBestMatch(prompt, RequestOptions.admit("busy")).booked());
      CompletableFuture<RouteResult> waiting =
          TestSupport.onThread(
              "decode waiter", () -> decode.findBestMatch(prompt, RequestOptions.admit("w")));
      TestSupport.await(
          "w queued", Duration.ofSeconds(10), () -> decode.metrics().queuePending() == 1);
      CompletableFuture<Boolean> closed =
          TestSupport.onThread(
              "closer",
              () -> {
                decode.close();
                return true;
              });
      assertTrue(closed.get(10, TimeUnit.SECONDS), "close() did not return");
      TestSupport.cancelledWithin10s(waiting);
      assertTrue(decode.isClosed());
      assertFalse(d.isClosed());
      assertTrue(d.routePrefill(prompt, RequestOptions.withId("p"), null).remote());
      assertEquals(0, d.prefillRouter().closeQueue());
    }
  }

  @Test
  void closingTheDisaggClosesItsPoolsButAnIngestKeepsThemAlive() {
    DisaggRouter d = new DisaggRouter();
    Router decode = d.decodeRouter();
    decode.addWorker(1);
    Ingest ingest = new Ingest(decode);
    d.close();
    assertTrue(decode.isClosed());
    assertThrows(IllegalStateException.class, () -> decode.addWorker(2));
    assertThrows(
        IllegalStateException.class,
        () -> d.routePrefill(PROMPT, RequestOptions.withId("x"), null));
    // the native pools are still alive for the ingest object
    Listener l = ingest.listen("tcp://127.0.0.1:0");
    ingest.start();
    assertTrue(l.endpoint().startsWith("tcp://127.0.0.1:"));
    assertEquals(0, ingest.stats().messages());
    ingest.close();
    d.close(); // idempotent
  }
}
