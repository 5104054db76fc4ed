package io.kvrouter;

import static io.kvrouter.TestSupport.await;
import static io.kvrouter.TestSupport.routerWithWorkers;
import static io.kvrouter.TestSupport.tokens;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.time.Duration;
import java.util.List;
import java.util.concurrent.ConcurrentLinkedQueue;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.atomic.AtomicInteger;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/** Router replicas: each one's bookings count as load at the others (callback and NATS). */
@Timeout(60)
class ReplicaTest {
  private static final int[] PROMPT = tokens(64, 300);

  private static long activeOn(Router router, long worker) {
    return router.potentialLoads(PROMPT).stream()
        .filter(l -> l.workerId() == worker)
        .mapToLong(PotentialLoad::activeRequests)
        .sum();
  }

  @Test
  void bookingsPublishedByOneReplicaAreLoadAtTheOther() {
    try (Router a = routerWithWorkers(2);
        Router b = routerWithWorkers(2)) {
      ConcurrentLinkedQueue<byte[]> bus = new ConcurrentLinkedQueue<>();
      a.setReplicaPublisher("replica-a", bus::add);

      RouteResult r = a.findBestMatch(PROMPT, RequestOptions.admit("req-1"));
      assertEquals(1, bus.size());
      for (byte[] change; (change = bus.poll()) != null; ) b.applyReplicaEvent(change);
      assertEquals(1, activeOn(b, r.workerId()));
      Metrics mb = b.metrics();
      assertEquals(1, mb.replicaChangesApplied());
      assertEquals(1, mb.replicaRequestsActive());
      assertEquals(1, mb.requestsActive());
      // b now sends a request for the same prompt to the other worker
      assertTrue(b.findBestMatch(PROMPT).workerId() != r.workerId());

      a.markPrefillCompleted("req-1");
      a.freeRequest("req-1");
      assertEquals(2, bus.size());
      for (byte[] change; (change = bus.poll()) != null; ) b.applyReplicaEvent(change);
      assertEquals(0, b.metrics().replicaRequestsActive());
      assertEquals(0, activeOn(b, r.workerId()));

      // previews publish nothing; a cleared publisher is no longer called
      a.findBestMatch(PROMPT);
      assertEquals(0, bus.size());
      a.setReplicaPublisher(null, null);
      a.findBestMatch(PROMPT, RequestOptions.admit("req-2"));
      assertEquals(0, bus.size());
    }
  }

  @Test
  void badChangesAndReservedIds() {
    try (Router a = routerWithWorkers(3);
        Router b = routerWithWorkers(1)) {
      List<byte[]> bus = new CopyOnWriteArrayList<>();
      a.setReplicaPublisher("a", bus::add);
      KvRouterException e =
          assertThrows(KvRouterException.class, () -> b.applyReplicaEvent("junk".getBytes()));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      a.addRequest(PROMPT, 3, 0, RequestOptions.withId("on-3"));
      e = assertThrows(KvRouterException.class, () -> b.applyReplicaEvent(bus.get(0)));
      assertEquals(Status.NOT_FOUND, e.status()); // b has no worker 3
      assertEquals(2, b.metrics().replicaChangesRejected());
      a.applyReplicaEvent(bus.get(0)); // its own change: ignored
      assertEquals(1, a.metrics().requestsActive());

      e =
          assertThrows(
              KvRouterException.class,
              () -> a.findBestMatch(PROMPT, RequestOptions.admit("\u001Ereserved")));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      e = assertThrows(KvRouterException.class, () -> a.setReplicaPublisher("", bus::add));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
    }
  }

  @Test
  void aThrowingPublisherDoesNotBreakRouting() throws Exception {
    AtomicInteger calls = new AtomicInteger();
    List<Throwable> reported = new CopyOnWriteArrayList<>();
    Thread t =
        new Thread(
            () -> {
              try (Router a = routerWithWorkers(2)) {
                a.setReplicaPublisher(
                    "a",
                    change -> {
                      calls.incrementAndGet();
                      throw new IllegalStateException("bus down");
                    });
                for (int i = 0; i < 10; ++i) {
                  assertTrue(a.findBestMatch(PROMPT, RequestOptions.admit("r" + i)).booked());
                  a.freeRequest("r" + i);
                }
                // the publisher is replaced many times while nothing leaks or dangles
                for (int i = 0; i < 100; ++i) a.setReplicaPublisher("a" + i, change -> {});
              }
            });
    t.setUncaughtExceptionHandler((thread, e) -> reported.add(e));
    t.start();
    t.join();
    assertEquals(20, calls.get());
    assertEquals(20, reported.size());
    assertTrue(reported.get(0) instanceof IllegalStateException);
  }

  @Test
  void replicasSyncOverNats() throws Exception {
    try (NatsServer nats = NatsServer.startOrSkip();
        Router a = routerWithWorkers(2);
        Router b = routerWithWorkers(2);
        Ingest ia = new Ingest(a);
        Ingest ib = new Ingest(b)) {
      ia.start();
      ib.start();
      long sa =
          ia.syncReplicas(
              nats.url(), "kvrouter.test.replicas", "a-" + ProcessHandle.current().pid());
      long sb =
          ib.syncReplicas(
              nats.url(), "kvrouter.test.replicas", "b-" + ProcessHandle.current().pid());
      KvRouterException e =
          assertThrows(KvRouterException.class, () -> ia.syncReplicas(nats.url(), "x", "again"));
      assertEquals(Status.FAILED_PRECONDITION, e.status());
      RouteResult r = a.findBestMatch(PROMPT, RequestOptions.admit("req"));
      await(
          "b sees a's booking",
          Duration.ofSeconds(10),
          () -> b.metrics().replicaRequestsActive() == 1);
      assertEquals(1, activeOn(b, r.workerId()));
      assertEquals(1, ia.stats(sa).published());
      assertEquals(0, ia.stats(sa).publishFailures());
      assertEquals(1, ib.stats(sb).eventsApplied());
      a.freeRequest("req");
      await(
          "b sees the free",
          Duration.ofSeconds(10),
          () -> b.metrics().replicaRequestsActive() == 0);
    }
  }
}
