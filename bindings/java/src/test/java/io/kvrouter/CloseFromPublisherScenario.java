package io.kvrouter;

import java.util.concurrent.CountDownLatch;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicReference;

/**
 * One scenario of {@link CloseFromPublisherTest}, run in a JVM of its own so that a deadlock fails
 * that test only. Prints the routing path its router calls take ("path ffm" or "path jni"), then
 * "ok" once every check passed; anything else (an exception, no "ok") is a failure.
 *
 * <p>Arguments: the mode.
 */
public final class CloseFromPublisherScenario {
  private CloseFromPublisherScenario() {}

  public static void main(String[] args) throws Exception {
    String mode = args[0];
    System.out.println("path " + HotPath.kind());
    switch (mode) {
      case "router-close", "router-close-queue", "disagg-close" -> refused(mode);
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

  private static void check(boolean condition, String what) {
    if (!condition) throw new AssertionError(what);
  }
}
