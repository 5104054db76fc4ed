package io.kvrouter;

import static io.kvrouter.TestSupport.BLOCK;
import static io.kvrouter.TestSupport.stored;
import static io.kvrouter.TestSupport.tokens;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.IntBuffer;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicLong;
import java.util.function.LongFunction;
import java.util.function.Supplier;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * The Java 22+ path of the hot calls (META-INF/versions/22/io/kvrouter/HotPath, java.lang.foreign)
 * against the JNI path ({@link JniHotPath}) on the same routers: the same results, the same state
 * changes, the same exceptions. Run by failsafe on a JDK 22+ with the jar on the class path (so
 * that the versioned class is the one loaded); see pom.xml.
 */
@Timeout(120)
class HotPathFfmIT {
  static final int[] PROMPT = tokens(4 * BLOCK + 5, 1000);
  static final long[] HASHES = Hashing.blockHashes(PROMPT, BLOCK);

  /** A call's outcome: its result, or the exception it threw. */
  private record Outcome(Object result, Class<?> thrown, String message, int code) {
    static Outcome of(Supplier<?> call) {
      try {
        return new Outcome(call.get(), null, null, 0);
      } catch (KvRouterException e) {
        return new Outcome(null, e.getClass(), e.getMessage(), e.code());
      } catch (RuntimeException e) {
        return new Outcome(null, e.getClass(), e.getMessage(), 0);
      }
    }
  }

  private static void same(Supplier<?> ffm, Supplier<?> jni) {
    Outcome f = Outcome.of(ffm);
    Outcome j = Outcome.of(jni);
    assertEquals(j, f, "FFM path (left: JNI)");
  }

  static Router router() {
    Router r = TestSupport.routerWithWorkers(4);
    for (int w = 1; w <= 4; ++w) {
      r.applyStored(stored(w, tokens(8 * BLOCK, 1000), w, w * 100L));
    }
    return r;
  }

  /**
   * Two routers built alike and given the same calls in the same order, one through each path:
   * ties between ranks are broken by the router's seeded random draws, so the calls of the two
   * paths are compared on twins rather than one after the other on one router (whose draws
   * would differ between the two calls).
   */
  private static final class Twins implements AutoCloseable {
    final Router ffm = router();
    final Router jni = router();
    final long f = handle(ffm);
    final long j = handle(jni);

    void same(LongFunction<?> ffmCall, LongFunction<?> jniCall) {
      HotPathFfmIT.same(() -> ffmCall.apply(f), () -> jniCall.apply(j));
      // The bookings as the cost model sees them (per rank: active requests, blocks, prefill
      // tokens), and the counters the calls move. (stateDigest covers the booking times too,
      // which differ between two routers' clocks.)
      assertEquals(jni.potentialLoads(PROMPT), ffm.potentialLoads(PROMPT));
      Metrics mf = ffm.metrics();
      Metrics mj = jni.metrics();
      assertEquals(mj.requestsActive(), mf.requestsActive());
      assertEquals(mj.decisions(), mf.decisions());
    }

    @Override
    public void close() {
      ffm.close();
      jni.close();
    }
  }

  private static long handle(Router r) {
    long h = r.acquire();
    r.release(); // the tests keep the router open while they use the handle
    return h;
  }

  static IntBuffer direct(int[] tokens, int position) {
    IntBuffer b =
        ByteBuffer.allocateDirect(4 * (tokens.length + position))
            .order(ByteOrder.nativeOrder())
            .asIntBuffer();
    b.position(position);
    b.put(tokens);
    b.position(position);
    return b;
  }

  @Test
  void theJarServesTheHotCallsThroughFfm() {
    assertTrue(Runtime.version().feature() >= 22, "run on JDK 22+: " + Runtime.version());
    assertEquals("ffm", HotPath.kind());
  }

  @Test
  void previewsAgree() {
    try (Twins t = new Twins()) {
      List<RequestOptions> options = new ArrayList<>();
      options.add(null);
      options.add(RequestOptions.withId("p-1"));
      options.add(RequestOptions.builder().loraName("adapter").build());
      options.add(RequestOptions.builder().requestId("p-2").cacheNamespace("tenant-é").build());
      for (int[] prompt :
          new int[][] {PROMPT, tokens(0, 0), tokens(3, 7), tokens(8192, 1000), tokens(64, 9)}) {
        for (RequestOptions o : options) {
          t.same(
              h -> HotPath.findBestMatch(h, prompt, null, 0, prompt.length, o),
              h -> JniHotPath.findBestMatch(h, prompt, null, 0, prompt.length, o));
          IntBuffer d = direct(prompt, 3);
          t.same(
              h -> HotPath.findBestMatch(h, null, d, d.position(), d.remaining(), o),
              h -> JniHotPath.findBestMatch(h, null, d, d.position(), d.remaining(), o));
          assertEquals(3, d.position());
          IntBuffer readOnly = d.asReadOnlyBuffer();
          t.same(
              h -> HotPath.findBestMatch(h, null, readOnly, 3, prompt.length, o),
              h -> JniHotPath.findBestMatch(h, null, readOnly, 3, prompt.length, o));
          t.same(
              h -> HotPath.previewRoute(h, prompt, o, null),
              h -> JniHotPath.previewRoute(h, prompt, o, null));
        }
      }
      // Through Router, the public calls.
      t.same(h -> t.ffm.findBestMatch(PROMPT), h -> t.jni.findBestMatch(PROMPT));
      t.same(
          h -> t.ffm.previewRoute(PROMPT, RequestOptions.withId("q"), null),
          h -> t.jni.previewRoute(PROMPT, RequestOptions.withId("q"), null));
      assertEquals(0, t.ffm.metrics().requestsActive());
    }
  }

  /**
   * A hybrid model's sliding-window group (StoredEvent.Builder.slidingWindow,
   * RemovedEvent.Builder.sliding, applied through JNI on every JDK): both paths route by the
   * windows. Worker 4 holds PROMPT's four blocks (engine hashes 400..403), its 32-token window
   * blocks 2 and 3, so it holds the whole prompt; once the window lets block 3 go, it holds
   * nothing of it and worker 3's three blocks win.
   */
  @Test
  void slidingWindowsAgree() {
    try (Twins t = new Twins()) {
      StoredEvent window =
          StoredEvent.builder(4).blockHashes(402, 403).slidingWindow(0, 2 * BLOCK).build();
      RemovedEvent evicted = RemovedEvent.builder(4).blockHashes(403).sliding(0).build();
      for (int[] expected : new int[][] {{4, 4}, {3, 3}}) { // worker, overlap blocks
        if (expected[0] == 4) {
          t.ffm.applyStored(window);
          t.jni.applyStored(window);
        } else {
          t.ffm.applyRemoved(evicted);
          t.jni.applyRemoved(evicted);
        }
        t.same(
            h -> HotPath.findBestMatch(h, PROMPT, null, 0, PROMPT.length, null),
            h -> JniHotPath.findBestMatch(h, PROMPT, null, 0, PROMPT.length, null));
        t.same(
            h -> HotPath.previewRoute(h, PROMPT, null, null),
            h -> JniHotPath.previewRoute(h, PROMPT, null, null));
        RouteSignals s = t.ffm.previewRoute(PROMPT, null, null);
        assertEquals(expected[0], s.workerId());
        assertEquals(expected[1], s.overlapBlocks());
      }
      assertEquals(1, t.ffm.metrics().indexSlidingBlocks());
    }
  }

  @Test
  void admittedCallsMarksAndFreesAgree() {
    try (Twins t = new Twins()) {
      t.ffm.setTime(1_000_000_000L); // clocks that stand still
      t.jni.setTime(1_000_000_000L);
      int[] big = tokens(8192, 1000); // larger than the first native prompt buffer
      String longId = "x".repeat(1000); // longer than the first string buffer
      for (String id : new String[] {"a-1", "ré-中-😀", longId}) {
        for (int[] prompt : new int[][] {PROMPT, big, tokens(0, 0)}) {
          for (RequestOptions o :
              new RequestOptions[] {
                RequestOptions.admit(id),
                RequestOptions.builder().requestId(id).admit(true).loraName("l").build()
              }) {
            t.same(
                h -> HotPath.findBestMatch(h, prompt, null, 0, prompt.length, o),
                h -> JniHotPath.findBestMatch(h, prompt, null, 0, prompt.length, o));
            t.same(
                h -> run(() -> HotPath.markPrefillCompleted(h, id)),
                h -> run(() -> JniHotPath.markPrefillCompleted(h, id)));
            t.same(
                h -> run(() -> HotPath.freeRequest(h, id)),
                h -> run(() -> JniHotPath.freeRequest(h, id)));
            IntBuffer d = direct(prompt, 5);
            t.same(
                h -> HotPath.findBestMatch(h, null, d, 5, prompt.length, o),
                h -> JniHotPath.findBestMatch(h, null, d, 5, prompt.length, o));
            t.same(h -> run(() -> t.ffm.freeRequest(id)), h -> run(() -> t.jni.freeRequest(id)));
            IntBuffer readOnly = d.asReadOnlyBuffer();
            t.same(
                h -> HotPath.findBestMatch(h, null, readOnly, 5, prompt.length, o),
                h -> JniHotPath.findBestMatch(h, null, readOnly, 5, prompt.length, o));
            t.same(h -> run(() -> t.ffm.freeRequest(id)), h -> run(() -> t.jni.freeRequest(id)));
          }
        }
        // On one router: an id booked through one path is the id the other path frees.
        try (Router r = router()) {
          long h = handle(r);
          r.findBestMatch(PROMPT, RequestOptions.admit(id));
          assertEquals(1, r.metrics().requestsActive());
          JniHotPath.freeRequest(h, id);
          assertEquals(0, r.metrics().requestsActive());
          JniHotPath.findBestMatch(h, PROMPT, null, 0, PROMPT.length, RequestOptions.admit(id));
          HotPath.markPrefillCompleted(h, id);
          r.freeRequest(id);
          assertEquals(0, r.metrics().requestsActive());
        }
      }
      // Frees and marks of unknown ids are no error on either path.
      t.same(
          h -> run(() -> HotPath.freeRequest(h, "nobody")),
          h -> run(() -> JniHotPath.freeRequest(h, "nobody")));
      t.same(
          h -> run(() -> HotPath.markPrefillCompleted(h, "nobody")),
          h -> run(() -> JniHotPath.markPrefillCompleted(h, "nobody")));
      assertEquals(0, t.ffm.metrics().requestsActive());
    }
  }

  private static String run(Runnable call) {
    call.run();
    return "ok";
  }

  @Test
  void hashedPromptsAgree() {
    try (Twins t = new Twins()) {
      t.ffm.setTime(1_000_000_000L);
      t.jni.setTime(1_000_000_000L);
      List<RequestOptions> options = new ArrayList<>();
      options.add(null);
      options.add(RequestOptions.withId("h-1"));
      options.add(RequestOptions.builder().loraName("adapter").build()); // unused: in the hashes
      options.add(RequestOptions.admit("h-2"));
      options.add(
          RequestOptions.builder().requestId("h-3").admit(true).cacheNamespace("é").build());
      for (int[] prompt :
          new int[][] {PROMPT, tokens(0, 0), tokens(3, 7), tokens(8192, 1000), tokens(64, 9)}) {
        long[] hashes = Hashing.blockHashes(prompt, BLOCK); // 512 for 8,192 tokens: 4 KiB
        long n = prompt.length;
        for (RequestOptions o : options) {
          String id = o == null ? null : o.requestId();
          boolean admitted = o != null && o.admit();
          t.same(
              h -> HotPath.findBestMatchHashed(h, hashes, n, o),
              h -> JniHotPath.findBestMatchHashed(h, hashes, n, o));
          if (admitted) {
            t.same(
                h -> run(() -> HotPath.freeRequest(h, id)),
                h -> run(() -> JniHotPath.freeRequest(h, id)));
          }
          t.same(
              h -> HotPath.previewRouteHashed(h, hashes, n, o, null),
              h -> JniHotPath.previewRouteHashed(h, hashes, n, o, null));
          // The thread's options struct held the hashes: a call with tokens right after must not
          // see them (tokens beside hashes would be refused).
          t.same(
              h -> HotPath.findBestMatch(h, prompt, null, 0, prompt.length, o),
              h -> JniHotPath.findBestMatch(h, prompt, null, 0, prompt.length, o));
          if (admitted) {
            t.same(h -> run(() -> t.ffm.freeRequest(id)), h -> run(() -> t.jni.freeRequest(id)));
          }
          t.same(
              h -> HotPath.previewRoute(h, prompt, o, null),
              h -> JniHotPath.previewRoute(h, prompt, o, null));
        }
      }
      // Through Router, the public calls, and options the FFM path leaves to JNI.
      RequestOptions full = RequestOptions.builder().expectedOutputTokens(5).build();
      t.same(
          h -> t.ffm.findBestMatchHashed(HASHES, PROMPT.length, full),
          h -> t.jni.findBestMatchHashed(HASHES, PROMPT.length, full));
      RoutingHints pin = RoutingHints.builder().workerId(2).build();
      t.same(
          h -> t.ffm.previewRouteHashed(HASHES, PROMPT.length, null, pin),
          h -> t.jni.previewRouteHashed(HASHES, PROMPT.length, null, pin));
      // Refusals: a count that is not the prompt's blocks, tokens' length and all.
      for (long n : new long[] {PROMPT.length + BLOCK, BLOCK - 1, 0}) {
        t.same(
            h -> HotPath.findBestMatchHashed(h, HASHES, n, RequestOptions.admit("x")),
            h -> JniHotPath.findBestMatchHashed(h, HASHES, n, RequestOptions.admit("x")));
        t.same(
            h -> HotPath.previewRouteHashed(h, HASHES, n, null, null),
            h -> JniHotPath.previewRouteHashed(h, HASHES, n, null, null));
      }
      KvRouterException e =
          assertThrows(
              KvRouterException.class, () -> t.ffm.findBestMatchHashed(HASHES, 1, null));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      assertEquals(0, t.ffm.metrics().requestsActive());
    }
    // On one router through the FFM path: the hashes get the tokens' decision (worker 4 holds
    // every complete block of PROMPT, so no draw decides).
    try (Router r = router()) {
      long h = handle(r);
      RouteResult byTokens = HotPath.findBestMatch(h, PROMPT, null, 0, PROMPT.length, null);
      assertEquals(byTokens, HotPath.findBestMatchHashed(h, HASHES, PROMPT.length, null));
      assertEquals(4, byTokens.workerId());
      assertEquals(PROMPT.length, byTokens.promptTokens());
      assertEquals(
          HotPath.previewRoute(h, PROMPT, null, null),
          HotPath.previewRouteHashed(h, HASHES, PROMPT.length, null, null));
      RouteResult booked =
          HotPath.findBestMatchHashed(h, HASHES, PROMPT.length, RequestOptions.admit("b"));
      assertTrue(booked.booked());
      for (PotentialLoad l : r.potentialLoads(PROMPT)) {
        assertEquals(l.workerId() == 4 ? 1 : 0, l.activeRequests(), l.toString());
      }
      HotPath.freeRequest(h, "b");
      assertEquals(0, r.metrics().requestsActive());
    }
  }

  @Test
  void errorsAgree() {
    try (Twins t = new Twins()) {
      // A duplicate request id.
      RequestOptions dup = RequestOptions.admit("dup");
      t.same(
          h -> HotPath.findBestMatch(h, PROMPT, null, 0, PROMPT.length, dup),
          h -> JniHotPath.findBestMatch(h, PROMPT, null, 0, PROMPT.length, dup));
      t.same(
          h -> HotPath.findBestMatch(h, PROMPT, null, 0, PROMPT.length, dup),
          h -> JniHotPath.findBestMatch(h, PROMPT, null, 0, PROMPT.length, dup));
      IntBuffer d = direct(PROMPT, 0);
      t.same(
          h -> HotPath.findBestMatch(h, null, d, 0, PROMPT.length, dup),
          h -> JniHotPath.findBestMatch(h, null, d, 0, PROMPT.length, dup));
      KvRouterException e =
          assertThrows(KvRouterException.class, () -> t.ffm.findBestMatch(PROMPT, dup));
      assertEquals(Status.ALREADY_EXISTS, e.status());
      t.ffm.freeRequest("dup");
      t.jni.freeRequest("dup");
      // Admission without an id.
      RequestOptions noId = RequestOptions.builder().admit(true).build();
      t.same(
          h -> HotPath.findBestMatch(h, PROMPT, null, 0, PROMPT.length, noId),
          h -> JniHotPath.findBestMatch(h, PROMPT, null, 0, PROMPT.length, noId));
      // Strings the library cannot take: the glue's checks, the glue's messages.
      for (String bad : new String[] {"a\0b", "x\uD800", "\uDC00y", "\uD800\uD800"}) {
        RequestOptions o = RequestOptions.admit(bad);
        t.same(
            h -> HotPath.findBestMatch(h, PROMPT, null, 0, PROMPT.length, o),
            h -> JniHotPath.findBestMatch(h, PROMPT, null, 0, PROMPT.length, o));
        RequestOptions lora = RequestOptions.builder().loraName(bad).build();
        t.same(
            h -> HotPath.findBestMatch(h, PROMPT, null, 0, PROMPT.length, lora),
            h -> JniHotPath.findBestMatch(h, PROMPT, null, 0, PROMPT.length, lora));
        t.same(
            h -> HotPath.previewRoute(h, PROMPT, lora, null),
            h -> JniHotPath.previewRoute(h, PROMPT, lora, null));
        t.same(
            h -> run(() -> HotPath.freeRequest(h, bad)),
            h -> run(() -> JniHotPath.freeRequest(h, bad)));
        t.same(
            h -> run(() -> HotPath.markPrefillCompleted(h, bad)),
            h -> run(() -> JniHotPath.markPrefillCompleted(h, bad)));
      }
      // A pin to an unknown worker (routing hints: the JNI path on both sides).
      RoutingHints pin = RoutingHints.builder().workerId(99).build();
      t.same(
          h -> HotPath.previewRoute(h, PROMPT, null, pin),
          h -> JniHotPath.previewRoute(h, PROMPT, null, pin));
      // No eligible worker.
      for (long w = 1; w <= 4; ++w) {
        t.ffm.removeWorker(w);
        t.jni.removeWorker(w);
      }
      t.same(
          h -> HotPath.findBestMatch(h, PROMPT, null, 0, PROMPT.length, null),
          h -> JniHotPath.findBestMatch(h, PROMPT, null, 0, PROMPT.length, null));
      t.same(
          h -> HotPath.findBestMatch(h, PROMPT, null, 0, PROMPT.length, dup),
          h -> JniHotPath.findBestMatch(h, PROMPT, null, 0, PROMPT.length, dup));
      t.same(
          h -> HotPath.previewRoute(h, PROMPT, null, null),
          h -> JniHotPath.previewRoute(h, PROMPT, null, null));
      e = assertThrows(KvRouterException.class, () -> t.ffm.findBestMatch(PROMPT));
      assertEquals(Status.UNAVAILABLE, e.status());
    }
  }

  @Test
  void aClosedRouterRefusesEveryHotCall() {
    Router r = router();
    r.close();
    List<Runnable> calls =
        List.of(
            () -> r.findBestMatch(PROMPT),
            () -> r.findBestMatch(PROMPT, RequestOptions.admit("c")),
            () -> r.findBestMatch(direct(PROMPT, 0), RequestOptions.admit("c")),
            () -> r.previewRoute(PROMPT, null, null),
            () -> r.findBestMatchHashed(HASHES, PROMPT.length, RequestOptions.admit("c")),
            () -> r.previewRouteHashed(HASHES, PROMPT.length, null, null),
            () -> r.markPrefillCompleted("c"),
            () -> r.freeRequest("c"));
    for (Runnable call : calls) {
      IllegalStateException e = assertThrows(IllegalStateException.class, call::run);
      assertEquals("Router is closed", e.getMessage());
    }
  }

  /**
   * Admitted calls waiting in the admission queue through the FFM path (an array, a direct buffer,
   * a prompt given hashed; no queue timeout) are cancelled by close(), which closes the queue
   * before it waits for them, and throw what JNI throws.
   */
  @Test
  void callsWaitingInTheQueueAreCancelledByClose() throws Exception {
    Router r = new Router(RouterOptions.builder().blockSize(BLOCK).queueThreshold(0.0).build());
    r.addWorker(WorkerConfig.builder(1).maxNumBatchedTokens(16).build());
    assertTrue(r.findBestMatch(PROMPT, RequestOptions.admit("busy")).booked()); // over threshold
    List<CompletableFuture<RouteResult>> waiting =
        List.of(
            TestSupport.onThread(
                "array", () -> r.findBestMatch(PROMPT, RequestOptions.admit("a"))),
            TestSupport.onThread(
                "buffer", () -> r.findBestMatch(direct(PROMPT, 3), RequestOptions.admit("b"))),
            TestSupport.onThread(
                "hashed",
                () -> r.findBestMatchHashed(HASHES, PROMPT.length, RequestOptions.admit("c"))));
    TestSupport.await("3 queued", Duration.ofSeconds(10), () -> r.metrics().queuePending() == 3);
    CompletableFuture<Boolean> closed =
        TestSupport.onThread(
            "closer",
            () -> {
              r.close();
              return true;
            });
    assertTrue(closed.get(10, TimeUnit.SECONDS), "close() did not return");
    for (CompletableFuture<RouteResult> call : waiting) {
      KvRouterException e = TestSupport.cancelledWithin10s(call);
      assertTrue(e.getMessage().contains("the admission queue is closed"), e.getMessage());
    }
  }

  /**
   * An admitted call waiting through the FFM path behind a request whose free was lost is
   * admitted by expireRequests (a JNI call on every JDK) once that request is past its expiry,
   * and returns its booking.
   */
  @Test
  void aCallWaitingBehindALostRequestIsAdmittedByExpireRequests() throws Exception {
    long expiryNanos = (long) (RouterOptions.builder().build().requestExpirySeconds() * 1e9);
    try (Router r =
        new Router(RouterOptions.builder().blockSize(BLOCK).queueThreshold(0.0).build())) {
      r.addWorker(WorkerConfig.builder(1).maxNumBatchedTokens(16).build());
      assertTrue(r.findBestMatch(PROMPT, RequestOptions.admit("busy")).booked()); // never freed
      r.setTime(0);
      CompletableFuture<RouteResult> waiting =
          TestSupport.onThread("array", () -> r.findBestMatch(PROMPT, RequestOptions.admit("a")));
      TestSupport.await("a queued", Duration.ofSeconds(10), () -> r.metrics().queuePending() == 1);
      assertEquals(0, r.expireRequests());
      r.setTime(expiryNanos + 1_000_000_000L);
      assertEquals(1, r.expireRequests());
      RouteResult admitted = waiting.get(10, TimeUnit.SECONDS);
      assertTrue(admitted.booked());
      assertTrue(admitted.queued());
      assertEquals(1, admitted.workerId());
      assertEquals(PROMPT.length, admitted.promptTokens());
      assertEquals(1, r.metrics().requestsActive());
    }
  }

  @Test
  void aPublisherCallingBackOnTheSameThreadGetsABufferOfItsOwn() {
    try (Router a = router();
        Router b = router()) {
      AtomicLong nested = new AtomicLong();
      // Called inside a's admitted call and free (ordinary downcalls), on the same thread: each
      // hot call made here must not disturb the buffer the outer call is using.
      a.setReplicaPublisher(
          "a",
          change -> {
            b.applyReplicaEvent(change);
            RouteResult p = b.findBestMatch(tokens(3 * BLOCK, 77));
            assertNotNull(p);
            b.findBestMatch(PROMPT, RequestOptions.admit("nested-" + nested.incrementAndGet()));
            b.freeRequest("nested-" + nested.get());
            b.markPrefillCompleted("elsewhere");
          });
      for (int i = 0; i < 20; ++i) {
        String id = "outer-" + i + "-" + "é".repeat(i * 25); // up to 960 of the 1,024 bytes
        RouteResult r = a.findBestMatch(PROMPT, RequestOptions.admit(id));
        assertTrue(r.booked());
        assertEquals(PROMPT.length, r.promptTokens());
        assertEquals(1, b.metrics().replicaRequestsActive());
        a.freeRequest(id);
        assertEquals(0, b.metrics().replicaRequestsActive());
        assertEquals(0, a.metrics().requestsActive());
      }
      assertTrue(nested.get() >= 40);
      a.setReplicaPublisher(null, null);
    }
  }

  @Test
  void manyThreadsAndACloseKeepTheGuard() throws Exception {
    for (int round = 0; round < 5; ++round) {
      Router r = router();
      ExecutorService pool = Executors.newFixedThreadPool(6);
      CountDownLatch started = new CountDownLatch(6);
      AtomicBoolean wrong = new AtomicBoolean();
      AtomicLong calls = new AtomicLong();
      List<Future<?>> futures = new ArrayList<>();
      for (int t = 0; t < 6; ++t) {
        final int thread = t;
        futures.add(
            pool.submit(
                () -> {
                  started.countDown();
                  IntBuffer d = direct(PROMPT, 0);
                  for (int i = 0; ; ++i) {
                    String id = "t" + thread + "-" + i;
                    try {
                      RouteResult p = r.findBestMatch(PROMPT);
                      if (p.booked()) wrong.set(true);
                      RouteResult a =
                          thread % 2 == 0
                              ? r.findBestMatch(PROMPT, RequestOptions.admit(id))
                              : r.findBestMatch(d, RequestOptions.admit(id));
                      if (!a.booked()) wrong.set(true);
                      r.previewRoute(PROMPT, null, null);
                      r.markPrefillCompleted(id);
                      r.freeRequest(id);
                      calls.incrementAndGet();
                    } catch (IllegalStateException e) {
                      if (!r.isClosed()) wrong.set(true);
                      return null;
                    }
                  }
                }));
      }
      started.await();
      while (calls.get() < 200) Thread.onSpinWait();
      r.close();
      for (Future<?> f : futures) assertNull(f.get(60, TimeUnit.SECONDS));
      pool.shutdown();
      assertTrue(pool.awaitTermination(10, TimeUnit.SECONDS));
      assertEquals(false, wrong.get());
    }
  }
}
