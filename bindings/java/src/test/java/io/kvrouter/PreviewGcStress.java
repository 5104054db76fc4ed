package io.kvrouter;

import static io.kvrouter.TestSupport.BLOCK;
import static io.kvrouter.TestSupport.stored;
import static io.kvrouter.TestSupport.tokens;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.IntBuffer;
import java.nio.charset.StandardCharsets;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.AtomicReference;

/**
 * Previews and bookings with a replica publisher that allocates, while another thread forces
 * collections: run in a child JVM by {@link PreviewGcStressTest} (JNI) and {@code
 * PreviewGcStressFfmIT} (the FFM path), which fail if it does not finish.
 *
 * <p>Every routing decision, previews included, takes the router's admission lock, and a thread
 * that books a request holds that lock while the library calls its replica publisher, in Java.
 * A preview that waited for the lock inside a JNI critical region (GetPrimitiveArrayCritical), or
 * inside an FFM critical downcall (which never leaves the Java thread state), deadlocked the
 * process: the publisher's allocation needs a collection, which waits for the critical region
 * (JNI's GC locker) or for the preview to reach a safepoint (FFM: the whole JVM stops), while the
 * preview waits for the lock the publisher holds. The child's threads then never finish (nor can
 * the child report anything, as the FFM deadlock stops every Java thread): the parent waits for
 * it with a generous timeout and kills it.
 *
 * <p>The previews are every call that reads an {@code int[]} prompt (or a direct buffer) without
 * booking: findBestMatch without admission (int[] through the full and the simple entry point,
 * and a direct IntBuffer), previewRoute, potentialLoads, overlapScores, findMatches,
 * prefillWorkerBusy on a disaggregated router whose prefill pool publishes, hashing, and the
 * calls of a prompt given hashed (its hashes copied, as an int[] prompt is).
 */
final class PreviewGcStress {
  private PreviewGcStress() {}

  static final String OK = "preview gc stress OK";

  // What the publisher allocates per change: enough to fill a small young generation quickly.
  private static final int SINK_BYTES = 64 * 1024;
  // Keeps the publisher's allocations from being optimised away.
  static volatile Object sink;

  /**
   * Runs this class in a child JVM on {@code java} with the current class path; returns its
   * output, or throws AssertionError if it fails or does not finish in time (then killed).
   */
  static String runChild(String java, List<String> jvmOptions, int iterations, long timeoutSeconds)
      throws IOException, InterruptedException {
    List<String> command = new ArrayList<>();
    command.add(java);
    // A small heap: the publisher's allocations need collections all the time.
    command.add("-Xms48m");
    command.add("-Xmx48m");
    command.add("--enable-native-access=ALL-UNNAMED");
    command.add("-Dkvrouter.source.dir=" + System.getProperty("kvrouter.source.dir", "../.."));
    command.add(
        "-Dkvrouter.native.build="
            + System.getProperty("kvrouter.native.build", "target/native/build"));
    command.addAll(jvmOptions);
    command.add("-cp");
    command.add(System.getProperty("java.class.path"));
    command.add(PreviewGcStress.class.getName());
    command.add(Integer.toString(iterations));
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
    if (!child.waitFor(timeoutSeconds, TimeUnit.SECONDS)) {
      child.destroyForcibly();
      child.waitFor();
      reader.join(10_000);
      throw new AssertionError(
          "the child JVM ("
              + String.join(" ", jvmOptions)
              + ") did not finish "
              + iterations
              + " iterations per thread in "
              + timeoutSeconds
              + " s: previews deadlocked with a publisher allocating under the router's lock?\n"
              + output.get());
    }
    reader.join();
    String out = output.get();
    if (child.exitValue() != 0 || !out.contains(OK)) {
      throw new AssertionError("the child JVM failed (exit " + child.exitValue() + "):\n" + out);
    }
    return out;
  }

  public static void main(String[] args) throws Exception {
    int iterations = args.length > 0 ? Integer.parseInt(args[0]) : 2000;
    int[][] prompts = new int[8][];
    for (int p = 0; p < prompts.length; ++p) prompts[p] = tokens(16 * BLOCK, 1 + p * 10_000);
    IntBuffer direct = ByteBuffer.allocateDirect(4 * prompts[0].length)
        .order(ByteOrder.nativeOrder())
        .asIntBuffer();
    direct.put(prompts[0]).flip();
    long[] hashes = Hashing.blockHashes(prompts[0], BLOCK);
    int hashed = prompts[0].length;
    AtomicLong published = new AtomicLong();
    ReplicaPublisher allocating =
        change -> {
          byte[] garbage = new byte[SINK_BYTES];
          garbage[0] = change[0];
          sink = garbage;
          published.incrementAndGet();
        };
    RouterOptions options = RouterOptions.builder().blockSize(BLOCK).randomSeed(7).build();
    try (Router router = new Router(options);
        DisaggRouter disagg = new DisaggRouter(options, options, null)) {
      Router prefill = disagg.prefillRouter();
      for (int w = 1; w <= 4; ++w) {
        router.addWorker(w);
        prefill.addWorker(w);
        disagg.decodeRouter().addWorker(w);
      }
      for (int p = 0; p < prompts.length; ++p) {
        router.applyStored(stored(1 + p % 4, prompts[p], 4, 1000L * (p + 1)));
        prefill.applyStored(stored(1 + p % 4, prompts[p], 4, 1000L * (p + 1)));
      }
      router.setReplicaPublisher("stress", allocating);
      prefill.setReplicaPublisher("stress-prefill", allocating);

      List<Thread> workers = new ArrayList<>();
      AtomicReference<Throwable> failure = new AtomicReference<>();
      AtomicLong previews = new AtomicLong();
      AtomicLong bookings = new AtomicLong();
      for (int t = 0; t < 2; ++t) { // bookers: each change is published under the lock
        final int thread = t;
        final Router target = t == 0 ? router : prefill;
        workers.add(
            new Thread(
                () -> {
                  for (int i = 0; i < iterations; ++i) {
                    String id = "b" + thread + "-" + i;
                    target.findBestMatch(prompts[i % prompts.length], RequestOptions.admit(id));
                    target.markPrefillCompleted(id);
                    target.freeRequest(id);
                    bookings.incrementAndGet();
                  }
                },
                "booker-" + t));
      }
      for (int t = 0; t < 2; ++t) { // previewers: every call that looks without booking
        final int thread = t;
        workers.add(
            new Thread(
                () -> {
                  for (int i = 0; i < iterations; ++i) {
                    int[] prompt = prompts[(thread + i) % prompts.length];
                    switch (i % 10) {
                      case 0 -> router.findBestMatch(prompt);
                      case 1 -> router.findBestMatch(prompt, RequestOptions.builder().build(), 4);
                      case 2 -> router.findBestMatch(direct.duplicate(), null);
                      case 3 -> router.previewRoute(prompt, null, null);
                      case 4 -> router.potentialLoads(prompt);
                      case 5 -> disagg.prefillWorkerBusy(prompt, null, 1.0);
                      case 6 -> router.overlapScores(prompt);
                      case 7 -> {
                        router.findBestMatchHashed(hashes, hashed, null);
                        router.previewRouteHashed(hashes, hashed, null, null);
                      }
                      case 8 -> {
                        router.potentialLoadsHashed(hashes, hashed, null);
                        disagg.prefillWorkerBusyHashed(hashes, hashed, null, 1.0);
                      }
                      default -> {
                        router.findMatches(hashes);
                        Hashing.blockHashes(prompt, BLOCK);
                      }
                    }
                    previews.incrementAndGet();
                  }
                },
                "previewer-" + t));
      }
      for (Thread w : workers) {
        w.setUncaughtExceptionHandler((th, e) -> failure.compareAndSet(null, e));
        w.start();
      }
      Thread collector =
          new Thread(
              () -> {
                while (workers.stream().anyMatch(Thread::isAlive)) System.gc();
              },
              "collector");
      collector.setDaemon(true);
      collector.start();
      for (Thread w : workers) w.join(); // the parent times the whole run
      if (failure.get() != null) throw new AssertionError("a thread failed", failure.get());
      System.out.println(
          OK
              + ": path "
              + HotPath.kind()
              + ", "
              + bookings.get()
              + " bookings, "
              + previews.get()
              + " previews, "
              + published.get()
              + " changes published");
      router.setReplicaPublisher(null, null);
      prefill.setReplicaPublisher(null, null);
    }
  }

  /** The java of the running JVM. */
  static String currentJava() {
    return Path.of(System.getProperty("java.home"), "bin", "java").toString();
  }
}
