package io.kvrouter;

import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.params.ParameterizedTest;
import org.junit.jupiter.params.provider.ValueSource;

/**
 * Closing from inside a replica publisher, which runs on the thread that changed a booking, under
 * the router's lock; that thread may be an {@link Ingest}'s own loop thread (its heartbeats, once
 * {@link Router#setReplicaPublisher} replaced its sync's publisher). Each scenario ({@link
 * CloseFromPublisherScenario}) runs in a child JVM, so that an abort or a deadlock fails its test
 * only. {@code CloseFromPublisherFfmIT} runs the routing ones on the FFM path.
 */
class CloseFromPublisherTest {
  /**
   * {@link Ingest#close()} or {@link Ingest#stop()} in a publisher that the ingest's own heartbeats
   * call, on its loop thread: the object is closed at once (a later close does nothing, calls
   * throw IllegalStateException), and a new thread stops and frees it once the publisher has
   * returned; the router then closes. (Before, close freed it there: kvr_ingest_free joined its
   * own thread, and the JVM aborted, SIGABRT.)
   */
  @ParameterizedTest
  @ValueSource(strings = {"loop-close", "loop-stop"})
  void anIngestClosedFromAPublisherOnItsOwnLoopThread(String mode) throws Exception {
    try (NatsServer nats = NatsServer.startOrSkip()) {
      run(mode, nats.url());
    }
  }

  /**
   * There the publisher holds the router's lock, which the loop a stop joins may need: close and
   * stop return at once, the ingest is stopped and freed soon after.
   */
  @ParameterizedTest
  @ValueSource(strings = {"routing-close", "routing-stop"})
  void anIngestClosedFromAPublisherARoutingCallRuns(String mode) {
    run(mode, "");
  }

  /**
   * Router.close, Router.closeQueue and DisaggRouter.close close an admission queue, which takes
   * the router's lock the publisher runs under: FAILED_PRECONDITION, the router staying open.
   * (Before, the thread blocked for good, and every call on the router with it.)
   */
  @ParameterizedTest
  @ValueSource(strings = {"router-close", "router-close-queue", "disagg-close"})
  void closingAQueueFromAPublisherIsRefused(String mode) {
    run(mode, "");
  }

  /**
   * Router.setReplicaPublisher takes the binding's lock around the swap of publishers, then the
   * router's lock in C: from a publisher it throws FAILED_PRECONDITION before taking either (the
   * library refuses a call into the router whose lock the publisher holds). "announcement": the
   * publisher clears itself during its own announcement (the lock is reentrant: the library
   * refused it before too); "routing": from a routing call's publisher (refused before too);
   * "cross": another thread holds the binding's lock, waiting in C for the router's lock the
   * publisher's thread holds (before, the publisher waited for the binding's lock: a deadlock).
   */
  @ParameterizedTest
  @ValueSource(
      strings = {"set-publisher-announcement", "set-publisher-routing", "set-publisher-cross"})
  void settingAPublisherFromAPublisherIsRefused(String mode) {
    run(mode, "");
  }

  @Test
  void outsideAPublisherNothingIsRefused() {
    assertTrue(!ReplicaSink.inPublisher());
    ReplicaSink.refuseInPublisher("nothing"); // does not throw
  }

  /**
   * Runs {@code mode} in a child JVM on the running JVM's java and class path; returns its output,
   * or throws AssertionError if it fails, or does not finish in 100 s (then killed).
   */
  static String run(String mode, String url) {
    List<String> command = new ArrayList<>();
    command.add(PreviewGcStress.currentJava());
    command.add("--enable-native-access=ALL-UNNAMED");
    command.add("-Dkvrouter.source.dir=" + System.getProperty("kvrouter.source.dir", "../.."));
    command.add(
        "-Dkvrouter.native.build="
            + System.getProperty("kvrouter.native.build", "target/native/build"));
    command.add("-cp");
    command.add(System.getProperty("java.class.path"));
    command.add(CloseFromPublisherScenario.class.getName());
    command.add(mode);
    command.add(url);
    try {
      Process child = new ProcessBuilder(command).redirectErrorStream(true).start();
      // Read on a thread of its own: a hung child never closes its output.
      AtomicReference<String> output = new AtomicReference<>("");
      Thread reader =
          new Thread(
              () -> {
                try {
                  output.set(
                      new String(child.getInputStream().readAllBytes(), StandardCharsets.UTF_8));
                } catch (IOException e) {
                  output.set("reading the child's output: " + e);
                }
              });
      reader.setDaemon(true);
      reader.start();
      if (!child.waitFor(100, TimeUnit.SECONDS)) {
        child.destroyForcibly();
        child.waitFor();
        reader.join(10_000);
        throw new AssertionError(
            mode + ": the child JVM still runs after 100 s (a deadlock)\n" + output.get());
      }
      reader.join();
      String out = output.get();
      int exit = child.exitValue();
      if (exit != 0 || !out.contains("\nok\n")) {
        String signal = exit > 128 ? " (signal " + (exit - 128) + ")" : "";
        throw new AssertionError(
            mode + ": the child JVM failed (exit " + exit + signal + "):\n" + out);
      }
      return out;
    } catch (IOException e) {
      throw new UncheckedIOException(e);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      throw new AssertionError("interrupted", e);
    }
  }
}
