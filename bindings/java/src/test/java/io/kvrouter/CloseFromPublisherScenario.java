package io.kvrouter;

import java.time.Duration;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicReference;

/**
 * One scenario of {@link CloseFromPublisherTest}, run in a JVM of its own so that an abort (the
 * free of an ingest object joining the thread it runs on) or a deadlock fails that test only.
 * Prints the routing path its router calls take ("path ffm" or "path jni"), then "ok" once every
 * check passed; anything else (an exception, no "ok") is a failure.
 *
 * <p>Arguments: the mode, and for the {@code loop-} modes a NATS server's url.
 */
public final class CloseFromPublisherScenario {
  private CloseFromPublisherScenario() {}

  public static void main(String[] args) throws Exception {
    String mode = args[0];
    System.out.println("path " + HotPath.kind());
    switch (mode) {
      case "loop-close", "loop-stop" -> onTheLoopThread(mode, args[1]);
      case "routing-close", "routing-stop" -> onARoutingThread(mode);
      case "router-close", "router-close-queue", "disagg-close" -> refused(mode);
      case "set-publisher-announcement" -> setPublisherInItsAnnouncement();
      case "set-publisher-routing", "set-publisher-cross" -> setPublisherFromARoutingCall(mode);
      default -> throw new IllegalArgumentException("unknown mode " + mode);
    }
    System.out.println("ok");
  }

  /** A publisher that runs {@code inside} once, when armed; what it threw goes to {@code thrown}. */
  private static ReplicaPublisher once(
      AtomicBoolean armed,
      Runnable inside,
      AtomicReference<Throwable> thrown,
      AtomicReference<String> thread,
      CountDownLatch done) {
    return change -> {
      if (!armed.compareAndSet(true, false)) return;
      thread.set(Thread.currentThread().getName());
      try {
        inside.run();
      } catch (Throwable t) {
        thrown.set(t);
      }
      done.countDown();
    };
  }

  /**
   * The publisher {@link Router#setReplicaPublisher} put in place of the sync's runs on the
   * ingest's loop thread: its heartbeats, every 10 ms. It closes (or stops) that ingest there.
   */
  private static void onTheLoopThread(String mode, String url) throws Exception {
    Router router = TestSupport.routerWithWorkers(1);
    Ingest ingest = new Ingest(router, IngestOptions.builder().replicaHeartbeatMs(10).build());
    ingest.start();
    ingest.syncReplicas(url, "kv.replicas", "gw-a");
    AtomicBoolean armed = new AtomicBoolean();
    AtomicReference<Throwable> thrown = new AtomicReference<>();
    AtomicReference<String> thread = new AtomicReference<>();
    CountDownLatch done = new CountDownLatch(1);
    Runnable inside = mode.equals("loop-close") ? ingest::close : ingest::stop;
    router.setReplicaPublisher("gw-a", once(armed, inside, thrown, thread, done));
    armed.set(true); // from now on only the loop calls the publisher: its heartbeats
    check(done.await(60, TimeUnit.SECONDS), "no heartbeat reached the publisher in a minute");
    check(thrown.get() == null, "the publisher's call threw " + thrown.get());
    check(
        !Thread.currentThread().getName().equals(thread.get()),
        "the publisher ran on this thread, not the loop's");
    if (mode.equals("loop-close")) {
      check(ingest.isClosed(), "not closed once close() returned");
      ingest.close(); // a no-op
      try {
        ingest.stats();
        throw new AssertionError("stats() on an ingest closed from its publisher");
      } catch (IllegalStateException expected) {
        // closed
      }
    } else {
      stopsSoon(ingest);
      ingest.close();
    }
    router.close();
  }

  /** A publisher a routing call runs, on this thread, under the router's lock. */
  private static void onARoutingThread(String mode) {
    Router router = TestSupport.routerWithWorkers(1);
    Ingest ingest = new Ingest(router);
    ingest.start();
    AtomicBoolean armed = new AtomicBoolean();
    AtomicReference<Throwable> thrown = new AtomicReference<>();
    AtomicReference<String> thread = new AtomicReference<>();
    CountDownLatch done = new CountDownLatch(1);
    Runnable inside = mode.equals("routing-close") ? ingest::close : ingest::stop;
    router.setReplicaPublisher("gw-a", once(armed, inside, thrown, thread, done));
    armed.set(true);
    router.findBestMatch(TestSupport.tokens(64, 0), RequestOptions.admit("r1"));
    check(done.getCount() == 0, "the routing call did not publish");
    check(thrown.get() == null, "the publisher's call threw " + thrown.get());
    if (mode.equals("routing-close")) {
      check(ingest.isClosed(), "not closed once close() returned");
      ingest.close();
    } else {
      stopsSoon(ingest);
      ingest.close();
    }
    router.close();
  }

  /** Once stopped, the calls that add a source are refused. */
  private static void stopsSoon(Ingest ingest) {
    TestSupport.await(
        "the ingest to stop",
        Duration.ofSeconds(60),
        () -> {
          try {
            ingest.listen("tcp://127.0.0.1:0");
            return false;
          } catch (KvRouterException e) {
            check(e.status() == Status.FAILED_PRECONDITION, "listen: " + e);
            return true;
          }
        });
  }

  /**
   * Router.close, Router.closeQueue and DisaggRouter.close close an admission queue, under the
   * lock the publisher runs under: refused there, the router staying open.
   */
  private static void refused(String mode) {
    Router router = TestSupport.routerWithWorkers(1);
    DisaggRouter disagg = mode.equals("disagg-close") ? new DisaggRouter() : null;
    Router publishing = disagg != null ? disagg.decodeRouter() : router;
    if (disagg != null) publishing.addWorker(1);
    Runnable call =
        switch (mode) {
          case "router-close" -> router::close;
          case "router-close-queue" -> router::closeQueue;
          default -> disagg::close;
        };
    AtomicBoolean armed = new AtomicBoolean();
    AtomicReference<Throwable> thrown = new AtomicReference<>();
    AtomicReference<String> thread = new AtomicReference<>();
    CountDownLatch done = new CountDownLatch(1);
    publishing.setReplicaPublisher("gw-a", once(armed, call, thrown, thread, done));
    armed.set(true);
    if (disagg != null) {
      disagg.routeDecode(TestSupport.tokens(64, 0), RequestOptions.withId("r1"), null, false);
    } else {
      router.findBestMatch(TestSupport.tokens(64, 0), RequestOptions.admit("r1"));
    }
    check(done.getCount() == 0, "the routing call did not publish");
    check(
        thrown.get() instanceof KvRouterException e && e.status() == Status.FAILED_PRECONDITION,
        "from the publisher: " + thrown.get() + ", want FAILED_PRECONDITION");
    check(!publishing.isClosed() && (disagg == null || !disagg.isClosed()), "closed anyway");
    call.run(); // after the publisher it goes through
    check(publishing.isClosed() == !mode.equals("router-close-queue"), "closed: wrong state");
    router.close();
  }

  /**
   * A publisher that clears itself on its first message: the announcement's Reset, which runs
   * inside setReplicaPublisher, on this thread. Refused; the publisher stays in place.
   */
  private static void setPublisherInItsAnnouncement() {
    Router router = TestSupport.routerWithWorkers(1);
    AtomicReference<Throwable> thrown = new AtomicReference<>();
    AtomicInteger calls = new AtomicInteger();
    AtomicBoolean first = new AtomicBoolean(true);
    router.setReplicaPublisher(
        "gw-a",
        change -> {
          if (first.compareAndSet(true, false)) {
            try {
              router.setReplicaPublisher("gw-a", null);
            } catch (Throwable t) {
              thrown.set(t);
            }
          }
          calls.incrementAndGet();
        });
    checkRefused(thrown.get());
    int before = calls.get();
    router.findBestMatch(TestSupport.tokens(64, 0), RequestOptions.admit("r1"));
    check(calls.get() > before, "the publisher was not kept");
    router.setReplicaPublisher("gw-a", null); // after the publisher it goes through
    before = calls.get(); // the farewell counted
    router.findBestMatch(TestSupport.tokens(64, 1), RequestOptions.admit("r2"));
    check(calls.get() == before, "a publisher cleared is still called");
    router.close();
  }

  /**
   * From a publisher a routing call runs, on this thread, under the router's lock ("routing":
   * refused by the library before); "cross": meanwhile another thread's setReplicaPublisher
   * holds the binding's lock and waits in C for the router's lock this thread holds, so the
   * publisher's own call must not wait for the binding's lock.
   */
  private static void setPublisherFromARoutingCall(String mode) throws InterruptedException {
    Router router = TestSupport.routerWithWorkers(1);
    AtomicReference<Throwable> other = new AtomicReference<>();
    AtomicBoolean otherReturned = new AtomicBoolean();
    Thread elsewhere =
        new Thread(
            () -> {
              try {
                router.setReplicaPublisher("gw-b", null);
                otherReturned.set(true);
              } catch (Throwable t) {
                other.set(t);
              }
            });
    elsewhere.setDaemon(true);
    Runnable inside =
        () -> {
          if (mode.equals("set-publisher-cross")) {
            elsewhere.start();
            try {
              Thread.sleep(500); // it now holds the binding's lock, waiting for the router's
            } catch (InterruptedException e) {
              Thread.currentThread().interrupt();
            }
          }
          router.setReplicaPublisher("gw-c", null);
        };
    AtomicBoolean armed = new AtomicBoolean();
    AtomicReference<Throwable> thrown = new AtomicReference<>();
    AtomicReference<String> thread = new AtomicReference<>();
    CountDownLatch done = new CountDownLatch(1);
    router.setReplicaPublisher("gw-a", once(armed, inside, thrown, thread, done));
    armed.set(true);
    router.findBestMatch(TestSupport.tokens(64, 0), RequestOptions.admit("r1"));
    check(done.getCount() == 0, "the routing call did not publish");
    checkRefused(thrown.get());
    if (mode.equals("set-publisher-cross")) {
      elsewhere.join(60_000);
      check(!elsewhere.isAlive(), "the other thread's setReplicaPublisher still waits");
      check(otherReturned.get(), "the other thread's setReplicaPublisher threw " + other.get());
    }
    router.close();
  }

  private static void checkRefused(Throwable thrown) {
    check(
        thrown instanceof KvRouterException e && e.status() == Status.FAILED_PRECONDITION,
        "from the publisher: " + thrown + ", want FAILED_PRECONDITION");
  }

  private static void check(boolean condition, String what) {
    if (!condition) throw new AssertionError(what);
  }
}
