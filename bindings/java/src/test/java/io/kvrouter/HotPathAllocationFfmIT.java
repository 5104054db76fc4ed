package io.kvrouter;

import static io.kvrouter.HotPathFfmIT.PROMPT;
import static io.kvrouter.HotPathFfmIT.direct;
import static io.kvrouter.HotPathFfmIT.router;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.lang.management.ManagementFactory;
import java.nio.IntBuffer;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * What the Java 22+ path of the hot calls allocates. A class of its own, which failsafe runs in
 * a JVM of its own (pom.xml: reuseForks false): the JIT removes the calls' temporaries (escape
 * analysis) from what it compiles after this test's calls alone, not after the other tests'
 * error paths and options, which left them allocated in some runs.
 */
@Timeout(300)
class HotPathAllocationFfmIT {
  /** Bytes the current thread allocated (HotSpot's counter). */
  private static long allocated() {
    return ((com.sun.management.ThreadMXBean) ManagementFactory.getThreadMXBean())
        .getCurrentThreadAllocatedBytes();
  }

  /**
   * The least mean of bytes allocated per call over rounds of calls, once the JIT has compiled
   * them (escape analysis removes the temporaries): at least 6 rounds, then more until one is
   * down to {@code enough}, for at least 40 rounds and 60 s (a loaded machine starves the JIT's
   * compiler threads: CI once needed more than 40 rounds, 4 s). A call that keeps allocating
   * still fails, only later.
   */
  static double bytesPerCall(Runnable call, double enough) {
    double least = Double.MAX_VALUE;
    long patience = System.nanoTime() + 60_000_000_000L;
    for (int round = 0;
        round < 6 || (least > enough && (round < 40 || System.nanoTime() < patience));
        ++round) {
      int n = 50_000;
      long before = allocated();
      for (int i = 0; i < n; ++i) call.run();
      least = Math.min(least, (double) (allocated() - before) / n);
    }
    return least;
  }

  @Test
  void theHotCallsAllocateNothingButTheirResult() {
    try (Router r = router()) {
      IntBuffer d = direct(PROMPT, 0);
      RequestOptions admit = RequestOptions.admit("alloc-é");
      // The result record: 80 bytes (RouteResult, RouteSignals) with HotSpot's default compressed
      // pointers. The JNI path allocates a long[] besides: 184 bytes per call on JDK 25.
      double result = 96;
      double[] perCall = {
        bytesPerCall(() -> r.findBestMatch(PROMPT), result),
        bytesPerCall(() -> r.findBestMatch(d, null), result),
        bytesPerCall(() -> r.previewRoute(PROMPT, null, null), result),
      };
      for (double b : perCall) assertTrue(b <= result, b + " bytes per preview");
      double admitFree =
          bytesPerCall(
              () -> {
                r.findBestMatch(PROMPT, admit);
                r.freeRequest("alloc-é");
              },
              result);
      double directAdmitFree =
          bytesPerCall(
              () -> {
                r.findBestMatch(d, admit);
                r.freeRequest("alloc-é");
              },
              result);
      assertTrue(admitFree <= result, admitFree + " bytes per admit+free");
      assertTrue(
          directAdmitFree <= result, directAdmitFree + " bytes per admit+free");
      double markFree =
          bytesPerCall(
              () -> {
                r.markPrefillCompleted("alloc-é");
                r.freeRequest("alloc-é");
              },
              0.5);
      assertTrue(markFree < 1, markFree + " bytes per mark+free");
    }
  }

}
