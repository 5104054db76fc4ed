package io.kvrouter;

import static io.kvrouter.TestSupport.BLOCK;
import static io.kvrouter.TestSupport.await;
import static io.kvrouter.TestSupport.stored;
import static io.kvrouter.TestSupport.tokens;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/** Many threads on one router; the admission queue blocking one thread while others go on. */
@Timeout(120)
class ConcurrencyTest {
  private static final int THREADS = 8;

  @Test
  void manyThreadsRouteBookAndApplyEventsConcurrently() throws Exception {
    int[][] prompts = new int[16][];
    for (int p = 0; p < prompts.length; ++p) prompts[p] = tokens(256, p * 100_000);
    try (Router router = TestSupport.routerWithWorkers(8)) {
      for (int p = 0; p < prompts.length; ++p)
        router.applyStored(stored(1 + p % 8, prompts[p], 8, p * 1000L));
      ExecutorService pool = Executors.newFixedThreadPool(THREADS);
      CountDownLatch start = new CountDownLatch(1);
      AtomicLong routed = new AtomicLong();
      AtomicLong onHolder = new AtomicLong();
      List<Future<?>> futures = new ArrayList<>();
      final int iterations = 1500;
      for (int t = 0; t < THREADS; ++t) {
        final int thread = t;
        futures.add(
            pool.submit(
                () -> {
                  start.await();
                  for (int i = 0; i < iterations; ++i) {
                    int p = (thread * 31 + i) % prompts.length;
                    switch (thread % 4) {
                      case 0:
                      case 1:
                        {
                          String id = "t" + thread + "-" + i;
                          RouteResult r =
                              router.findBestMatch(prompts[p], RequestOptions.admit(id));
                          assertTrue(r.booked());
                          if (r.workerId() == 1 + p % 8) onHolder.incrementAndGet();
                          routed.incrementAndGet();
                          router.markPrefillCompleted(id);
                          router.freeRequest(id);
                          break;
                        }
                      case 2:
                        { // events: a worker caches and evicts a prompt of its own
                          long base = 1_000_000L * (thread + 1) + i * 10L;
                          router.applyStored(stored(1 + i % 8, tokens(64, 5_000_000 + i), 4, base));
                          router.applyRemoved(RemovedEvent.of(1 + i % 8, base + 3));
                          break;
                        }
                      default:
                        {
                          assertEquals(1, router.overlapScores(prompts[p]).size());
                          router.potentialLoads(prompts[p]);
                          router.metrics();
                          router.previewRoute(prompts[p], null, null);
                          break;
                        }
                    }
                  }
                  return null;
                }));
      }
      start.countDown();
      for (Future<?> f : futures) f.get(100, TimeUnit.SECONDS);
      pool.shutdown();
      Metrics m = router.metrics();
      assertEquals(0, m.requestsActive());
      assertEquals(routed.get(), m.decisions());
      assertEquals(4L * iterations, routed.get());
      // concurrent identical requests spread over workers, but the cache holder wins often
      assertTrue(onHolder.get() > routed.get() / 4, onHolder + " of " + routed);
      assertEquals(0, m.eventsRejected(EventKind.STORED) + m.eventsRejected(EventKind.REMOVED));
    }
  }

  @Test
  void aQueuedCallBlocksOnlyItsOwnThread() throws Exception {
    RouterOptions options = RouterOptions.builder().blockSize(BLOCK).queueThreshold(1.0).build();
    int[] prompt = tokens(64, 1);
    try (Router router = new Router(options)) {
      router.addWorker(WorkerConfig.builder(1).maxNumBatchedTokens(32).build());
      assertFalse(router.findBestMatch(prompt, RequestOptions.admit("a")).queued());
      // every rank is now over threshold × max_num_batched_tokens: the next admission waits
      CompletableFuture<RouteResult> waiting =
          CompletableFuture.supplyAsync(
              () -> router.findBestMatch(prompt, RequestOptions.admit("b")));
      // the router is not serialised: other calls proceed while "b" is blocked inside C
      await("b queued", Duration.ofSeconds(10), () -> router.metrics().queuePending() == 1);
      assertFalse(waiting.isDone());
      router.previewRoute(prompt, null, null);
      router.markPrefillCompleted("a"); // frees room: "b" is admitted
      RouteResult b = waiting.get(10, TimeUnit.SECONDS);
      assertTrue(b.queued());
      assertTrue(b.booked());

      // a queue timeout
      RequestOptions timeout =
          RequestOptions.builder().requestId("c").admit(true).queueTimeoutMs(30).build();
      KvRouterException e =
          assertThrows(KvRouterException.class, () -> router.findBestMatch(prompt, timeout));
      assertEquals(Status.DEADLINE_EXCEEDED, e.status());

      // freed while waiting
      CompletableFuture<RouteResult> cancelled =
          CompletableFuture.supplyAsync(
              () -> router.findBestMatch(prompt, RequestOptions.admit("d")));
      await("d queued", Duration.ofSeconds(10), () -> router.metrics().queuePending() == 1);
      router.freeRequest("d");
      ExecutionException ex =
          assertThrows(ExecutionException.class, () -> cancelled.get(10, TimeUnit.SECONDS));
      assertEquals(Status.CANCELLED, ((KvRouterException) ex.getCause()).status());
    }
  }

  /** A router whose only rank is over its queue threshold (0): an admitted call waits. */
  private static Router queueingRouterWithOneBusyRank(int[] prompt) {
    Router router =
        new Router(RouterOptions.builder().blockSize(BLOCK).queueThreshold(0.0).build());
    router.addWorker(WorkerConfig.builder(1).maxNumBatchedTokens(16).build());
    RouteResult busy = router.findBestMatch(prompt, RequestOptions.admit("busy"));
    assertTrue(busy.booked());
    assertFalse(busy.queued());
    return router;
  }

  /**
   * A shutdown closes the queue: a call waiting there with no timeout (which nothing else would
   * end) is cancelled, and so is every later one that would wait, at once; previews and requests
   * admitted at once go on.
   */
  @Test
  void closeQueueCancelsItsWaitersForGood() throws Exception {
    int[] prompt = tokens(64, 7);
    try (Router router = queueingRouterWithOneBusyRank(prompt)) {
      CompletableFuture<RouteResult> waiting =
          TestSupport.onThread(
              "waiter", () -> router.findBestMatch(prompt, RequestOptions.admit("waiting")));
      await("waiting queued", Duration.ofSeconds(10), () -> router.metrics().queuePending() == 1);
      assertEquals(1, router.closeQueue());
      TestSupport.cancelledWithin10s(waiting);
      assertEquals(0, router.metrics().queuePending());

      // A later request that would wait is cancelled at once, not after its timeout.
      RequestOptions late =
          RequestOptions.builder().requestId("late").admit(true).queueTimeoutMs(30_000).build();
      long start = System.nanoTime();
      KvRouterException e =
          assertThrows(KvRouterException.class, () -> router.findBestMatch(prompt, late));
      assertEquals(Status.CANCELLED, e.status());
      assertTrue(System.nanoTime() - start < TimeUnit.SECONDS.toNanos(10));

      // Previews go on, and so does a request admitted at once once there is room.
      RouteResult preview = router.findBestMatch(prompt);
      assertEquals(1, preview.workerId());
      assertFalse(preview.booked());
      assertEquals(1, router.previewRoute(prompt, null, null).workerId());
      router.freeRequest("busy");
      RouteResult fresh = router.findBestMatch(prompt, RequestOptions.admit("fresh"));
      assertTrue(fresh.booked());
      assertFalse(fresh.queued());
      router.freeRequest("fresh");

      assertEquals(0, router.closeQueue());
      assertEquals(0, router.metrics().requestsActive());
    }
  }

  /**
   * A request whose free was lost ("busy", never freed) holds the only rank, and with a queue
   * threshold every later call waits behind it. expireRequests leaves it alone until it is older
   * than the request expiry; then it drops it and admits the waiter, with no routing call coming
   * meanwhile to do it.
   */
  @Test
  void expireRequestsDropsALostRequestAndAdmitsItsWaiter() throws Exception {
    int[] prompt = tokens(64, 9);
    // The default expiry, which the router has.
    long expiryNanos = (long) (RouterOptions.builder().build().requestExpirySeconds() * 1e9);
    Router router = queueingRouterWithOneBusyRank(prompt);
    try (router) {
      router.setTime(0); // the router's time goes on from "busy"'s booking, by hand from now
      CompletableFuture<RouteResult> waiting =
          TestSupport.onThread(
              "waiter", () -> router.findBestMatch(prompt, RequestOptions.admit("waiting")));
      await("waiting queued", Duration.ofSeconds(10), () -> router.metrics().queuePending() == 1);
      assertEquals(0, router.expireRequests());
      router.setTime(expiryNanos + 1_000_000_000L);
      assertEquals(1, router.expireRequests());
      RouteResult admitted = waiting.get(10, TimeUnit.SECONDS);
      assertTrue(admitted.booked());
      assertTrue(admitted.queued());
      Metrics m = router.metrics();
      assertEquals(1, m.requestsActive()); // the waiter's booking alone
      assertEquals(0, m.queuePending());
      assertEquals(0, router.expireRequests());

      // "busy"'s load is gone: once the waiter is freed the rank admits at once, and the lost
      // request's id books again (no ALREADY_EXISTS).
      router.freeRequest("waiting");
      RouteResult again = router.findBestMatch(prompt, RequestOptions.admit("busy"));
      assertTrue(again.booked());
      assertFalse(again.queued());
    }
    assertThrows(IllegalStateException.class, router::expireRequests);
  }

  /**
   * close() while another thread waits in the queue with no timeout: close closes the queue
   * first, so it returns (rather than wait for that call for good) and the call is cancelled.
   */
  @Test
  void closeWhileAThreadWaitsInTheQueueCancelsIt() throws Exception {
    int[] prompt = tokens(64, 8);
    Router router = queueingRouterWithOneBusyRank(prompt);
    CompletableFuture<RouteResult> waiting =
        TestSupport.onThread(
            "waiter", () -> router.findBestMatch(prompt, RequestOptions.admit("waiting")));
    await("waiting queued", Duration.ofSeconds(10), () -> router.metrics().queuePending() == 1);
    CompletableFuture<Boolean> closed =
        TestSupport.onThread(
            "closer",
            () -> {
              router.close();
              return true;
            });
    assertTrue(closed.get(10, TimeUnit.SECONDS), "close() did not return");
    TestSupport.cancelledWithin10s(waiting);
    assertTrue(router.isClosed());
    assertThrows(IllegalStateException.class, router::metrics);
    assertThrows(IllegalStateException.class, router::closeQueue);
  }

  @Test
  void closeWhileOtherThreadsCallFailsThemCleanly() throws Exception {
    int[] prompt = tokens(128, 3);
    for (int round = 0; round < 5; ++round) {
      Router router = TestSupport.routerWithWorkers(4);
      router.applyStored(stored(2, prompt, 4, 1));
      ExecutorService pool = Executors.newFixedThreadPool(THREADS);
      CountDownLatch running = new CountDownLatch(THREADS);
      List<Future<Long>> futures = new ArrayList<>();
      for (int t = 0; t < THREADS; ++t) {
        final int thread = t;
        futures.add(
            pool.submit(
                () -> {
                  long calls = 0;
                  running.countDown();
                  try {
                    while (true) {
                      if (thread % 2 == 0) {
                        router.findBestMatch(prompt, null, 4);
                      } else {
                        String id = "x" + thread + "-" + calls;
                        router.findBestMatch(prompt, RequestOptions.admit(id));
                        router.freeRequest(id);
                      }
                      ++calls;
                    }
                  } catch (IllegalStateException closed) {
                    assertTrue(closed.getMessage().contains("closed"));
                    return calls;
                  }
                }));
      }
      running.await();
      Thread.sleep(20);
      router.close(); // waits for the calls in progress, then frees; later calls throw
      long total = 0;
      for (Future<Long> f : futures) total += f.get(30, TimeUnit.SECONDS);
      pool.shutdown();
      assertTrue(total > 0);
      assertTrue(router.isClosed());
    }
  }

  @Test
  void eventBatchesAndHashingFromManyThreads() throws Exception {
    ExecutorService pool = Executors.newFixedThreadPool(THREADS);
    try (EventBatch shared = new EventBatch();
        Router router = TestSupport.routerWithWorkers(2)) {
      List<Future<?>> futures = new ArrayList<>();
      for (int t = 0; t < THREADS; ++t) {
        final int thread = t;
        futures.add(
            pool.submit(
                () -> {
                  for (int i = 0; i < 200; ++i) {
                    // a shared batch is serialised by the binding, never corrupted
                    shared.addStored(
                        stored(1, tokens(32, thread * 1000 + i), 2, thread * 100_000L + i * 2));
                    assertEquals(512, Hashing.blockHashes(tokens(8192, i), 16).length);
                  }
                  return null;
                }));
      }
      for (Future<?> f : futures) f.get(60, TimeUnit.SECONDS);
      assertEquals(THREADS * 200, shared.size());
      router.applyEventBatch(shared.encode());
      assertEquals(THREADS * 200 * 2, router.metrics().indexBlocks());
    } finally {
      pool.shutdown();
    }
  }
}
