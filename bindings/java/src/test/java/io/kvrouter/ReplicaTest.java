package io.kvrouter;

import static io.kvrouter.TestSupport.await;
import static io.kvrouter.TestSupport.routerWithWorkers;
import static io.kvrouter.TestSupport.tokens;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collection;
import java.util.List;
import java.util.Set;
import java.util.TreeSet;
import java.util.concurrent.ConcurrentLinkedQueue;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.atomic.AtomicInteger;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * Router replicas: each one's bookings count as load at the others (callback and NATS); a
 * replica that starts publishing announces itself (Reset, its bookings, SyncRequest) and its
 * peers answer with theirs.
 */
@Timeout(60)
class ReplicaTest {
  private static final int[] PROMPT = tokens(64, 300);
  private static final int[] OTHER_PROMPT = tokens(48, 9000);

  /** SequenceChangeKind of schema/replica_events.fbs, in the order of its values. */
  enum Kind {
    ADDED,
    PREFILL_COMPLETED,
    FREED,
    RESET,
    SYNC_REQUEST,
    HEARTBEAT
  }

  /**
   * What these tests read of a published change (a FlatBuffers SequenceChange: origin is field
   * 0, kind field 1, request_id field 2), decoded by hand since the tests have no FlatBuffers
   * library.
   */
  record Change(String origin, Kind kind, String requestId) {
    static Change decode(byte[] bytes) {
      ByteBuffer b = ByteBuffer.wrap(bytes).order(ByteOrder.LITTLE_ENDIAN);
      assertEquals("KVSC", new String(bytes, 4, 4, StandardCharsets.US_ASCII), "file identifier");
      int table = b.getInt(0);
      int vtable = table - b.getInt(table);
      int kindAt = field(b, table, vtable, 1);
      return new Change(
          string(b, field(b, table, vtable, 0)),
          Kind.values()[kindAt == 0 ? 0 : b.get(kindAt) & 0xFF],
          string(b, field(b, table, vtable, 2)));
    }

    /** Where field {@code index} is, or 0 when it is absent (its default). */
    private static int field(ByteBuffer b, int table, int vtable, int index) {
      int slot = 4 + 2 * index;
      if (slot >= (b.getShort(vtable) & 0xFFFF)) return 0;
      int offset = b.getShort(vtable + slot) & 0xFFFF;
      return offset == 0 ? 0 : table + offset;
    }

    private static String string(ByteBuffer b, int at) {
      if (at == 0) return "";
      int s = at + b.getInt(at);
      return new String(b.array(), s + 4, b.getInt(s), StandardCharsets.UTF_8);
    }
  }

  private static List<Change> decode(Iterable<byte[]> bus) {
    List<Change> changes = new ArrayList<>();
    for (byte[] bytes : bus) changes.add(Change.decode(bytes));
    return changes;
  }

  private static List<Kind> kinds(Iterable<byte[]> bus) {
    return decode(bus).stream().map(Change::kind).toList();
  }

  /** The request ids of the Added changes on {@code bus}. */
  private static Set<String> added(Iterable<byte[]> bus) {
    Set<String> ids = new TreeSet<>();
    for (Change c : decode(bus)) if (c.kind() == Kind.ADDED) ids.add(c.requestId());
    return ids;
  }

  /** Applies every change on {@code bus} to {@code to}, in order, and empties the bus. */
  private static void deliver(Collection<byte[]> bus, Router to) {
    for (byte[] change : List.copyOf(bus)) to.applyReplicaEvent(change);
    bus.clear();
  }

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
      // Joining with no bookings: exactly a Reset and a SyncRequest, naming no request.
      assertEquals(
          List.of(
              new Change("replica-a", Kind.RESET, ""),
              new Change("replica-a", Kind.SYNC_REQUEST, "")),
          decode(bus));
      // A peer applies them (it has no publisher, so it answers nothing) and changes nothing.
      long digest = b.stateDigest();
      deliver(bus, b);
      Metrics joined = b.metrics();
      assertEquals(2, joined.replicaChangesApplied());
      assertEquals(0, joined.replicaChangesRejected());
      assertEquals(0, joined.replicaRequestsActive());
      assertEquals(0, joined.requestsActive());
      assertEquals(digest, b.stateDigest());
      assertEquals(0, bus.size());

      RouteResult r = a.findBestMatch(PROMPT, RequestOptions.admit("req-1"));
      assertEquals(List.of(new Change("replica-a", Kind.ADDED, "req-1")), decode(bus));
      deliver(bus, b);
      assertEquals(1, activeOn(b, r.workerId()));
      Metrics mb = b.metrics();
      assertEquals(3, mb.replicaChangesApplied());
      assertEquals(1, mb.replicaRequestsActive());
      assertEquals(1, mb.requestsActive());
      // b now sends a request for the same prompt to the other worker
      assertTrue(b.findBestMatch(PROMPT).workerId() != r.workerId());

      a.markPrefillCompleted("req-1");
      a.freeRequest("req-1");
      assertEquals(List.of(Kind.PREFILL_COMPLETED, Kind.FREED), kinds(bus));
      deliver(bus, b);
      assertEquals(0, b.metrics().replicaRequestsActive());
      assertEquals(0, activeOn(b, r.workerId()));

      // previews publish nothing; a cleared publisher says farewell, then is no longer called
      a.findBestMatch(PROMPT);
      assertEquals(0, bus.size());
      a.setReplicaPublisher(null, null);
      assertEquals(List.of(new Change("replica-a", Kind.RESET, "")), decode(bus));
      bus.clear();
      a.findBestMatch(PROMPT, RequestOptions.admit("req-2"));
      assertEquals(0, bus.size());
    }
  }

  @Test
  void aSilentReplicaThatSentHeartbeatsIsExpiredWithItsBookings() {
    try (Router a = routerWithWorkers(2);
        Router b = routerWithWorkers(2)) {
      ConcurrentLinkedQueue<byte[]> bus = new ConcurrentLinkedQueue<>();
      a.setReplicaPublisher("replica-a", bus::add);
      b.setTime(0);
      deliver(bus, b); // the Reset and the SyncRequest
      a.findBestMatch(PROMPT, RequestOptions.admit("req-1"));
      a.replicaHeartbeat(1000);
      assertEquals(
          List.of(
              new Change("replica-a", Kind.ADDED, "req-1"),
              new Change("replica-a", Kind.HEARTBEAT, "")),
          decode(bus));
      deliver(bus, b);
      Metrics mb = b.metrics();
      assertEquals(1, mb.replicasLive());
      assertEquals(0, mb.replicasExpired());
      assertEquals(1, mb.replicaRequestsActive());
      // The router counts a heartbeat as an applied change, as it counts a Reset or a SyncRequest.
      assertEquals(4, mb.replicaChangesApplied());

      // 9 s of silence is within a 10 s timeout (three 1 s intervals are less); 11 s is not.
      b.setTime(9_000_000_000L);
      assertEquals(0, b.expireReplicas(Duration.ofSeconds(10)));
      b.setTime(11_000_000_000L);
      assertEquals(1, b.expireReplicas(Duration.ofSeconds(10)));
      mb = b.metrics();
      assertEquals(0, mb.replicasLive());
      assertEquals(1, mb.replicasExpired());
      assertEquals(0, mb.replicaRequestsActive());
      assertEquals(0, mb.requestsActive());
      assertEquals(0, b.expireReplicas(Duration.ofSeconds(10)));
      assertEquals(1, a.metrics().requestsActive(), "a keeps its own booking");

      assertEquals(
          Status.INVALID_ARGUMENT,
          assertThrows(KvRouterException.class, () -> a.replicaHeartbeat(0)).status());
      assertEquals(
          Status.INVALID_ARGUMENT,
          assertThrows(KvRouterException.class, () -> a.replicaHeartbeat(-1)).status());
      assertEquals( // b has no publisher
          Status.FAILED_PRECONDITION,
          assertThrows(KvRouterException.class, () -> b.replicaHeartbeat(1000)).status());
      assertEquals(
          Status.INVALID_ARGUMENT,
          assertThrows(KvRouterException.class, () -> b.expireReplicas(Duration.ZERO)).status());
      assertEquals(0, bus.size(), "refused heartbeats publish nothing");
    }
  }

  /**
   * A publisher runs under its router's lock: the library refuses a call into that router from
   * it ({@code FAILED_PRECONDITION}) rather than block the thread for good.
   */
  @Test
  void expireRequestsFromThePublisherIsRefused() {
    try (Router a = routerWithWorkers(2)) {
      List<Object> seen = new CopyOnWriteArrayList<>();
      a.setReplicaPublisher(
          "a",
          change -> {
            try {
              seen.add(a.expireRequests());
            } catch (KvRouterException e) {
              seen.add(e.status());
            }
          });
      a.findBestMatch(PROMPT, RequestOptions.admit("req-1"));
      assertTrue(!seen.isEmpty(), "the publisher was not called");
      for (Object outcome : seen) assertEquals(Status.FAILED_PRECONDITION, outcome);
      a.setReplicaPublisher(null, null);
      assertEquals(0, a.expireRequests());
    }
  }

  @Test
  void installingThePublisherAnnouncesTheBookingsHeld() {
    try (Router a = routerWithWorkers(2);
        Router b = routerWithWorkers(2)) {
      a.findBestMatch(PROMPT, RequestOptions.admit("r1"));
      a.markPrefillCompleted("r1");
      a.findBestMatch(OTHER_PROMPT, RequestOptions.admit("r2"));
      a.addRequest(PROMPT, 2, 0, RequestOptions.withId("on-2"));
      a.findBestMatch(OTHER_PROMPT, RequestOptions.admit("gone"));
      a.freeRequest("gone");
      assertEquals(3, a.metrics().requestsActive());

      List<byte[]> bus = new CopyOnWriteArrayList<>();
      a.setReplicaPublisher("a", bus::add); // the calls happen before this returns
      assertEquals(
          List.of(Kind.RESET, Kind.ADDED, Kind.ADDED, Kind.ADDED, Kind.SYNC_REQUEST), kinds(bus));
      assertEquals(Set.of("r1", "r2", "on-2"), added(bus));
      for (Change c : decode(bus)) assertEquals("a", c.origin());
      List<byte[]> announcement = List.copyOf(bus);

      // A fresh peer that applies them holds what a holds, as a sees it (r1's prefill included).
      deliver(bus, b);
      Metrics mb = b.metrics();
      assertEquals(3, mb.replicaRequestsActive());
      assertEquals(3, mb.requestsActive());
      assertEquals(5, mb.replicaChangesApplied());
      assertEquals(0, mb.replicaChangesRejected());
      assertEquals(a.potentialLoads(PROMPT), b.potentialLoads(PROMPT));
      assertEquals(a.potentialLoads(OTHER_PROMPT), b.potentialLoads(OTHER_PROMPT));

      // The same announcement again (an answer to another SyncRequest) replaces, never doubles:
      // its Reset comes first, so no booking is a duplicate.
      for (byte[] change : announcement) b.applyReplicaEvent(change);
      assertEquals(3, b.metrics().replicaRequestsActive());
      assertEquals(0, b.metrics().replicaChangesRejected());
      assertEquals(a.potentialLoads(PROMPT), b.potentialLoads(PROMPT));

      // Reinstalling the publisher says farewell through the old one (a Reset), then announces
      // what a holds now.
      a.freeRequest("r2");
      assertEquals(List.of(Kind.FREED), kinds(bus));
      bus.clear();
      a.setReplicaPublisher("a", bus::add);
      assertEquals(
          List.of(Kind.RESET, Kind.RESET, Kind.ADDED, Kind.ADDED, Kind.SYNC_REQUEST), kinds(bus));
      assertEquals(Set.of("r1", "on-2"), added(bus));
      deliver(bus, b);
      assertEquals(2, b.metrics().replicaRequestsActive());

      // a restarts under the same id with nothing booked: its Reset drops what b held from it.
      try (Router restarted = routerWithWorkers(2)) {
        restarted.setReplicaPublisher("a", bus::add);
        assertEquals(List.of(Kind.RESET, Kind.SYNC_REQUEST), kinds(bus));
        deliver(bus, b);
      }
      assertEquals(0, b.metrics().replicaRequestsActive());
      assertEquals(0, b.metrics().requestsActive());
      assertEquals(0, activeOn(b, 1) + activeOn(b, 2));
    }
  }

  @Test
  void aSyncRequestIsAnsweredWithTheBookings() {
    try (Router a = routerWithWorkers(2);
        Router b = routerWithWorkers(2);
        Router quiet = routerWithWorkers(2)) {
      List<byte[]> busA = new CopyOnWriteArrayList<>();
      List<byte[]> busB = new CopyOnWriteArrayList<>();
      a.setReplicaPublisher("a", busA::add);
      busA.clear(); // nobody listened yet
      a.findBestMatch(PROMPT, RequestOptions.admit("a1"));
      a.addRequest(OTHER_PROMPT, 1, 0, RequestOptions.withId("a2"));
      busA.clear(); // b missed those: it was not running yet

      b.findBestMatch(OTHER_PROMPT, RequestOptions.admit("b1"));
      b.setReplicaPublisher("b", busB::add);
      assertEquals(List.of(Kind.RESET, Kind.ADDED, Kind.SYNC_REQUEST), kinds(busB));
      List<byte[]> joining = List.copyOf(busB);
      // a takes b's booking and answers the SyncRequest through its own publisher, with a
      // Reset and its own bookings only (not b's, and no SyncRequest of its own).
      deliver(busB, a);
      assertEquals(1, a.metrics().replicaRequestsActive());
      for (Change c : decode(busA)) assertEquals("a", c.origin());
      assertEquals(List.of(Kind.RESET, Kind.ADDED, Kind.ADDED), kinds(busA));
      assertEquals(Set.of("a1", "a2"), added(busA));
      deliver(busA, b);
      assertEquals(2, b.metrics().replicaRequestsActive());
      assertEquals(3, b.metrics().requestsActive());
      assertEquals(0, busB.size()); // a Reset and Added changes ask nothing back
      // Both see the same load now.
      assertEquals(a.potentialLoads(PROMPT), b.potentialLoads(PROMPT));
      assertEquals(a.potentialLoads(OTHER_PROMPT), b.potentialLoads(OTHER_PROMPT));

      // A router without a publisher applies a SyncRequest and has nothing to answer through.
      for (byte[] change : joining) quiet.applyReplicaEvent(change);
      assertEquals(1, quiet.metrics().replicaRequestsActive());
      assertEquals(3, quiet.metrics().replicaChangesApplied());
    }
  }

  @Test
  void aResetDropsOnlyItsOriginsBookings() {
    try (Router a = routerWithWorkers(2);
        Router ab = routerWithWorkers(2);
        Router b = routerWithWorkers(2)) {
      List<byte[]> bus = new CopyOnWriteArrayList<>();
      a.findBestMatch(PROMPT, RequestOptions.admit("x"));
      ab.findBestMatch(PROMPT, RequestOptions.admit("x"));
      b.findBestMatch(PROMPT, RequestOptions.admit("x"));
      // "a" is a prefix of "ab": a Reset from "a" must not reach "ab"'s bookings.
      a.setReplicaPublisher("a", bus::add);
      ab.setReplicaPublisher("ab", bus::add);
      deliver(bus, b);
      assertEquals(2, b.metrics().replicaRequestsActive());
      assertEquals(3, b.metrics().requestsActive());

      try (Router restarted = routerWithWorkers(2)) {
        restarted.setReplicaPublisher("a", bus::add);
        deliver(bus, b);
      }
      assertEquals(1, b.metrics().replicaRequestsActive());
      assertEquals(2, b.metrics().requestsActive());
      // the one left is ab's: its free releases it
      ab.freeRequest("x");
      deliver(bus, b);
      assertEquals(0, b.metrics().replicaRequestsActive());
      assertEquals(1, b.metrics().requestsActive()); // b's own
    }
  }

  @Test
  void badChangesAndReservedIds() {
    try (Router a = routerWithWorkers(3);
        Router b = routerWithWorkers(1)) {
      List<byte[]> bus = new CopyOnWriteArrayList<>();
      a.setReplicaPublisher("a", bus::add);
      assertEquals(List.of(Kind.RESET, Kind.SYNC_REQUEST), kinds(bus));
      KvRouterException e =
          assertThrows(KvRouterException.class, () -> b.applyReplicaEvent("junk".getBytes()));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      a.addRequest(PROMPT, 3, 0, RequestOptions.withId("on-3"));
      byte[] addedOn3 = bus.get(2);
      assertEquals(new Change("a", Kind.ADDED, "on-3"), Change.decode(addedOn3));
      e = assertThrows(KvRouterException.class, () -> b.applyReplicaEvent(addedOn3));
      assertEquals(Status.NOT_FOUND, e.status()); // b has no worker 3
      assertEquals(2, b.metrics().replicaChangesRejected());
      // its own changes are ignored: its Reset drops nothing, its SyncRequest is not answered
      for (byte[] change : List.copyOf(bus)) a.applyReplicaEvent(change);
      assertEquals(1, a.metrics().requestsActive());
      assertEquals(0, a.metrics().replicaRequestsActive());
      assertEquals(3, bus.size());

      e =
          assertThrows(
              KvRouterException.class,
              () -> a.findBestMatch(PROMPT, RequestOptions.admit("\u001Ereserved")));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      e = assertThrows(KvRouterException.class, () -> a.setReplicaPublisher("", bus::add));
      assertEquals(Status.INVALID_ARGUMENT, e.status());

      // Byte 0x1F ends a replica id inside booking names: refused, and the publisher in place
      // stays (nothing announced, later changes still go out under "a").
      e = assertThrows(KvRouterException.class, () -> a.setReplicaPublisher("a\u001Fb", bus::add));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      assertEquals(3, bus.size());
      a.freeRequest("on-3");
      assertEquals(new Change("a", Kind.FREED, "on-3"), Change.decode(bus.get(3)));
      try (Ingest ingest = new Ingest(b)) {
        e =
            assertThrows(
                KvRouterException.class,
                () -> ingest.syncReplicas("nats://127.0.0.1:1", "replicas", "b\u001F"));
        assertEquals(Status.INVALID_ARGUMENT, e.status());
      }

      // A change whose origin has byte 0x1F (written by hand: no router publishes one).
      List<byte[]> other = new ArrayList<>();
      try (Router c = routerWithWorkers(1)) {
        c.setReplicaPublisher("c?d", other::add);
      }
      byte[] reset = other.get(0);
      int at = indexOf(reset, "c?d".getBytes(StandardCharsets.US_ASCII));
      assertTrue(at > 0);
      reset[at + 1] = 0x1F;
      assertEquals(new Change("c\u001Fd", Kind.RESET, ""), Change.decode(reset));
      long rejected = b.metrics().replicaChangesRejected();
      e = assertThrows(KvRouterException.class, () -> b.applyReplicaEvent(reset));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      assertEquals(rejected + 1, b.metrics().replicaChangesRejected());
    }
  }

  private static int indexOf(byte[] haystack, byte[] needle) {
    outer:
    for (int i = 0; i + needle.length <= haystack.length; ++i) {
      for (int j = 0; j < needle.length; ++j) if (haystack[i + j] != needle[j]) continue outer;
      return i;
    }
    return -1;
  }

  @Test
  void aThrowingPublisherDoesNotBreakRouting() throws Exception {
    AtomicInteger calls = new AtomicInteger();
    List<Throwable> reported = new CopyOnWriteArrayList<>();
    Thread t =
        new Thread(
            () -> {
              try (Router a = routerWithWorkers(2)) {
                // called twice at once (Reset, SyncRequest), on this thread
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
    // 2 on installing, 2 per request (booked, freed), 1 farewell when first replaced
    assertEquals(23, calls.get());
    assertEquals(23, reported.size());
    assertTrue(reported.get(0) instanceof IllegalStateException);
  }

  @Test
  void replicasSyncOverNats() throws Exception {
    try (NatsServer nats = NatsServer.startOrSkip();
        Router a = routerWithWorkers(2);
        Router b = routerWithWorkers(2);
        // Without heartbeats (the first goes out as a sync starts): every message is counted.
        Ingest ia = new Ingest(a, IngestOptions.builder().replicaHeartbeatMs(0).build());
        Ingest ib = new Ingest(b, IngestOptions.builder().replicaHeartbeatMs(0).build())) {
      ia.start();
      ib.start();
      String subject = "kvrouter.test.replicas";
      long pid = ProcessHandle.current().pid();
      // Booked before a syncs: announced with a's joining messages, which syncReplicas flushes
      // before it returns, so nobody hears them. (A booking published after the sync is only
      // buffered by the NATS client and could still reach b if it subscribed in time.)
      RouteResult early = a.findBestMatch(PROMPT, RequestOptions.admit("early"));
      long sa = ia.syncReplicas(nats.url(), subject, "a-" + pid); // Reset, Added, SyncRequest
      KvRouterException e =
          assertThrows(KvRouterException.class, () -> ia.syncReplicas(nats.url(), "x", "again"));
      assertEquals(Status.FAILED_PRECONDITION, e.status());
      assertEquals(3, ia.stats(sa).published());

      // b joins: its SyncRequest makes a answer with a Reset and "early", which b never heard.
      long sb = ib.syncReplicas(nats.url(), subject, "b-" + pid);
      await(
          "b learns a's earlier booking",
          Duration.ofSeconds(10),
          () -> b.metrics().replicaRequestsActive() == 1);
      assertEquals(1, activeOn(b, early.workerId()));
      await("a's two messages", Duration.ofSeconds(10), () -> ia.stats(sa).eventsApplied() == 2);
      await("b's two messages", Duration.ofSeconds(10), () -> ib.stats(sb).eventsApplied() == 2);
      assertEquals(5, ia.stats(sa).published()); // + the answer: Reset, Added
      assertEquals(2, ib.stats(sb).published()); // Reset, SyncRequest
      assertEquals(2, a.metrics().replicaChangesApplied()); // b's Reset and SyncRequest
      assertEquals(0, a.metrics().replicaRequestsActive());

      a.findBestMatch(PROMPT, RequestOptions.admit("req"));
      await(
          "b sees a's booking",
          Duration.ofSeconds(10),
          () -> b.metrics().replicaRequestsActive() == 2);
      a.freeRequest("req");
      a.freeRequest("early");
      await(
          "b sees the frees",
          Duration.ofSeconds(10),
          () -> b.metrics().replicaRequestsActive() == 0);
      await("b's messages", Duration.ofSeconds(10), () -> ib.stats(sb).eventsApplied() == 5);
      assertEquals(8, ia.stats(sa).published());
      assertEquals(0, ia.stats(sa).publishFailures());
      assertEquals(5, ib.stats(sb).messages());
      assertEquals(2, ia.stats(sa).messages()); // no echo of its own
      assertEquals(5, b.metrics().replicaChangesApplied());
      assertEquals(0, ia.stats(sa).bookingsTrimmed()); // short bookings, 1 MiB messages
    }
  }

  /**
   * Over a server whose messages are at most 4 KiB (the least syncReplicas accepts; the default is
   * 1 MiB), a booking of 1,000 blocks (8 KB of block ids) goes with its leading block ids and is
   * counted in bookingsTrimmed; a short booking, and a free (no block ids), are not.
   */
  @Test
  void bookingsTooLongForTheServersMessagesAreTrimmed() throws Exception {
    try (NatsServer nats = NatsServer.startOrSkip(false, "max_payload: 4096\n");
        Router a = routerWithWorkers(1);
        Ingest ia = new Ingest(a, IngestOptions.builder().replicaHeartbeatMs(0).build())) {
      ia.start();
      long sa = ia.syncReplicas(nats.url(), "kvrouter.test.trimmed", "a"); // Reset, SyncRequest
      // The changes are published, and counted, within the routing calls.
      a.addRequest(tokens(4 * TestSupport.BLOCK, 500), 1, 0, RequestOptions.withId("short"));
      assertEquals(0, ia.stats(sa).bookingsTrimmed());
      a.addRequest(tokens(1000 * TestSupport.BLOCK, 100_000), 1, 0, RequestOptions.withId("long"));
      a.freeRequest("long");
      IngestStats stats = ia.stats(sa);
      assertEquals(1, stats.bookingsTrimmed(), stats::toString);
      assertEquals(5, stats.published());
      assertEquals(0, stats.publishFailures());
      assertEquals(1, ia.stats(0).bookingsTrimmed());
    }
  }
}
