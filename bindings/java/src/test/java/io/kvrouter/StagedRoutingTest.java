package io.kvrouter;

import static io.kvrouter.TestSupport.routerWithWorkers;
import static io.kvrouter.TestSupport.stored;
import static io.kvrouter.TestSupport.tokens;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.time.Duration;
import java.util.Optional;
import org.junit.jupiter.api.Test;

/** Preview, plan, commit, abort; pins; deadlines; sessions; the state and index digests. */
class StagedRoutingTest {
  private static final int[] PROMPT = tokens(64, 7000);

  @Test
  void previewChangesNothing() {
    try (Router router = routerWithWorkers(4)) {
      router.applyStored(stored(3, PROMPT, 4, 0x10));
      router.addRequest(tokens(32, 1), 1, 0, RequestOptions.withId("busy"));
      long digest = router.stateDigest();
      RoutingHints session = RoutingHints.builder().sessionId("s").build();
      for (int i = 0; i < 200; ++i) {
        RouteSignals p =
            router.previewRoute(
                PROMPT, RequestOptions.withId("p" + i), i % 2 == 0 ? null : session);
        assertEquals(3, p.workerId());
        assertEquals(4, p.overlapBlocks());
        assertEquals(4, p.promptBlocks());
        assertEquals(64, p.cachedTokens());
        assertFalse(p.booked());
      }
      assertEquals(digest, router.stateDigest());
      assertEquals(1, router.metrics().requestsActive());
      router.freeRequest("busy");
      assertTrue(digest != router.stateDigest());
    }
  }

  /** Replicas compare index digests: the blocks alone, blind to bookings. */
  @Test
  void indexDigestIsTheBlocksAlone() {
    try (Router a = routerWithWorkers(2);
        Router b = routerWithWorkers(2)) {
      a.applyStored(stored(1, PROMPT, 4, 0x10));
      a.applyStored(stored(2, PROMPT, 2, 0x20));
      b.applyStored(stored(2, PROMPT, 2, 0x20)); // the other order
      b.applyStored(stored(1, PROMPT, 4, 0x10));
      long index = a.indexDigest();
      assertEquals(index, b.indexDigest());

      long state = a.stateDigest();
      a.findBestMatch(PROMPT, RequestOptions.admit("booked"));
      assertTrue(state != a.stateDigest());
      assertEquals(index, a.indexDigest());
    }
  }

  @Test
  void pinsAndAllowedSets() {
    try (Router router = routerWithWorkers(4)) {
      router.applyStored(stored(3, PROMPT, 4, 0x10));
      assertEquals(1, router.previewRoute(PROMPT, null, RoutingHints.pin(1)).workerId());
      KvRouterException e =
          assertThrows(
              KvRouterException.class,
              () -> router.previewRoute(PROMPT, null, RoutingHints.pin(99)));
      assertEquals(Status.NOT_FOUND, e.status());
      e =
          assertThrows(
              KvRouterException.class,
              () ->
                  router.previewRoute(
                      PROMPT,
                      RequestOptions.builder().allowedWorkerIds(2, 4).build(),
                      RoutingHints.pin(1)));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      RoutingHints prefillPin =
          RoutingHints.builder().phase(Phase.PREFILL).prefillWorkerId(2).workerId(1).build();
      assertEquals(2, router.previewRoute(PROMPT, null, prefillPin).workerId());
      RoutingHints decodePin =
          RoutingHints.builder().phase(Phase.DECODE).decodeWorkerId(4).workerId(1).build();
      assertEquals(4, router.previewRoute(PROMPT, null, decodePin).workerId());
    }
  }

  @Test
  void planCommitAbort() {
    try (Router router = routerWithWorkers(4)) {
      router.applyStored(stored(3, PROMPT, 4, 0x10));
      RouteSignals preview = router.previewRoute(PROMPT, RequestOptions.withId("r1"), null);
      RouteSignals plan = router.planRoute(PROMPT, RequestOptions.withId("r1"), null, preview);
      assertTrue(plan.booked());
      assertFalse(plan.moved());
      assertEquals(preview.workerId(), plan.workerId());
      assertEquals(1, router.metrics().requestsActive());
      // idempotent: planning again returns the plan
      assertEquals(
          plan.workerId(),
          router.planRoute(PROMPT, RequestOptions.withId("r1"), null, null).workerId());
      router.commitRoute("r1");
      router.commitRoute("r1"); // idempotent
      router.freeRequest("r1");

      RouteSignals p2 = router.planRoute(PROMPT, RequestOptions.withId("r2"), null, null);
      assertTrue(p2.booked());
      assertTrue(router.abortRoute("r2"));
      assertFalse(router.abortRoute("r2"));
      assertFalse(router.abortRoute("never"));
      assertEquals(0, router.metrics().requestsActive());
      KvRouterException e = assertThrows(KvRouterException.class, () -> router.commitRoute("r2"));
      assertEquals(Status.NOT_FOUND, e.status());

      // a previewed rank that is gone: the plan moves
      RouteSignals onThree = router.previewRoute(PROMPT, null, null);
      assertEquals(3, onThree.workerId());
      router.removeWorker(3);
      RouteSignals moved = router.planRoute(PROMPT, RequestOptions.withId("r3"), null, onThree);
      assertTrue(moved.moved());
      assertTrue(moved.workerId() != 3);

      // a plan whose worker is removed cannot be committed
      long w = moved.workerId();
      router.removeWorker(w);
      e = assertThrows(KvRouterException.class, () -> router.commitRoute("r3"));
      assertEquals(Status.FAILED_PRECONDITION, e.status(), e.toString()); // "plan again"
    }
  }

  @Test
  void planDeadlines() throws InterruptedException {
    try (Router router = routerWithWorkers(2)) {
      KvRouterException e =
          assertThrows(KvRouterException.class, () -> router.setPlanDeadlineSeconds(0));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      e = assertThrows(KvRouterException.class, () -> router.setPlanDeadlineSeconds(Double.NaN));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      // Time passes when the test says: a stalled test thread sees no plan expire early.
      router.setTime(0);
      router.setPlanDeadline(Duration.ofMillis(300));
      router.planRoute(PROMPT, RequestOptions.withId("late"), null, null);
      router.planRoute(PROMPT, RequestOptions.withId("late2"), null, null);
      assertEquals(0, router.expirePlans());
      router.setTime(400_000_000L);
      assertEquals(2, router.expirePlans());
      assertEquals(0, router.metrics().requestsActive());
      e = assertThrows(KvRouterException.class, () -> router.commitRoute("late"));
      assertEquals(Status.NOT_FOUND, e.status());
    }
  }

  @Test
  void sessionsBindAtCommit() throws InterruptedException {
    try (Router router = routerWithWorkers(4)) {
      RoutingHints hints = RoutingHints.session("chat-1");
      RouteSignals plan = router.planRoute(PROMPT, RequestOptions.withId("t1"), hints, null);
      assertEquals(Optional.empty(), router.sessionBinding("chat-1")); // not before commit
      router.commitRoute("t1");
      Optional<WorkerRank> bound = router.sessionBinding("chat-1");
      assertEquals(Optional.of(new WorkerRank(plan.workerId(), plan.dpRank())), bound);
      // the next turn of the conversation goes to the same rank, whatever the load
      router.findBestMatch(PROMPT, RequestOptions.admit("load"));
      for (int i = 0; i < 10; ++i) {
        assertEquals(plan.workerId(), router.previewRoute(tokens(64, 99), null, hints).workerId());
      }
      router.closeSession("chat-1");
      router.closeSession("chat-1"); // no error
      assertEquals(Optional.empty(), router.sessionBinding("chat-1"));

      router.setTime(0); // time passes when the test says
      RoutingHints shortLived =
          RoutingHints.builder()
              .sessionId("brief")
              .sessionMode(SessionMode.SOFT)
              .sessionTtlSeconds(0.3) // not lapsed before it is checked
              .build();
      router.planRoute(PROMPT, RequestOptions.withId("t2"), shortLived, null);
      router.commitRoute("t2");
      RoutingHints shortLived2 = shortLived.toBuilder().sessionId("brief2").build();
      router.planRoute(PROMPT, RequestOptions.withId("t3"), shortLived2, null);
      router.commitRoute("t3");
      assertTrue(router.sessionBinding("brief").isPresent());
      router.setTime(400_000_000L);
      assertEquals(2, router.reclaimSessions());
      assertEquals(Optional.empty(), router.sessionBinding("brief"));
      assertEquals(0, router.reclaimSessions());
    }
  }
}
