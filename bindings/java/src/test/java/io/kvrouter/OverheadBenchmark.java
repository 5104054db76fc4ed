package io.kvrouter;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.IntBuffer;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;
import java.util.Locale;

/**
 * What the binding adds per call beyond the same call made from C in the same process, measured as
 * issue 16 asks: chunks of calls through the binding and chunks of the same calls from a loop in C
 * (Native.benchChunk, on the same router), alternating many times in one run; per chunk the mean
 * time per call; over the chunks the min and the 10th percentile of each side, and their
 * difference (the overhead). Only same-run differences mean anything on a noisy machine.
 *
 * <p>The router is small so that the C call is short and the binding's share shows: 8 workers, 64
 * prompts of 64 tokens (4 blocks, some cached), ids request-0 ... request-255. Calls: a preview,
 * an admitted findBestMatch and freeRequest of its id (admit+free; also with the prompt in a direct
 * IntBuffer), markPrefillCompleted and freeRequest (mark+free).
 *
 * <pre>
 * java [-Dblocks=4] -cp target/classes:target/test-classes io.kvrouter.OverheadBenchmark \
 *     [rounds] [chunk]
 * </pre>
 */
public final class OverheadBenchmark {
  // -Dblocks=N: prompts of N blocks (default 4), e.g. 512 to see what the copy of a large
  // prompt costs an admitted call, and what a direct IntBuffer saves.
  private static final int QLEN = Integer.getInteger("blocks", 4) * TestSupport.BLOCK;

  private OverheadBenchmark() {}

  public static void main(String[] args) {
    int rounds = args.length > 0 ? Integer.parseInt(args[0]) : 200;
    int chunk = args.length > 1 ? Integer.parseInt(args[1]) : 2000;
    try (Router router = TestSupport.routerWithWorkers(8)) {
      int[][] prompts = new int[64][];
      int[] flat = new int[64 * QLEN];
      for (int q = 0; q < 64; ++q) {
        prompts[q] = TestSupport.tokens(QLEN, q * 1000);
        System.arraycopy(prompts[q], 0, flat, q * QLEN, QLEN);
        router.applyStored(TestSupport.stored(q % 8 + 1, prompts[q], 1 + q % 4, (q + 1) * 100L));
      }
      IntBuffer[] direct = new IntBuffer[64];
      for (int q = 0; q < 64; ++q) {
        direct[q] =
            ByteBuffer.allocateDirect(4 * QLEN).order(ByteOrder.nativeOrder()).asIntBuffer();
        direct[q].put(prompts[q]).flip();
      }
      String[] ids = new String[256];
      RequestOptions[] admits = new RequestOptions[ids.length];
      int stride = 16;
      byte[] cIds = new byte[ids.length * stride];
      for (int i = 0; i < ids.length; ++i) {
        ids[i] = "request-" + i;
        admits[i] = RequestOptions.admit(ids[i]);
        byte[] b = ids[i].getBytes(StandardCharsets.UTF_8);
        System.arraycopy(b, 0, cIds, i * stride, b.length);
      }
      Bench[] benches = {
        new Bench("preview", 0) {
          @Override
          void run(int n) {
            for (int i = 0; i < n; ++i) router.findBestMatch(prompts[i % 64]);
          }
        },
        admitFree(router, prompts, null, admits),
        admitFree(router, prompts, direct, admits),
        new Bench("mark+free", 2) {
          @Override
          void run(int n) {
            for (int i = 0; i < n; ++i) {
              router.markPrefillCompleted(ids[i % ids.length]);
              router.freeRequest(ids[i % ids.length]);
            }
          }
        },
      };
      long h = router.acquire();
      router.release(); // the router stays open for the whole run
      System.out.printf(
          Locale.ROOT,
          "%d pairs of chunks of %d calls; ns per call (min / p10 of chunk means), %s, %s path%n",
          rounds,
          chunk,
          System.getProperty("java.vm.version"),
          HotPath.kind());
      for (Bench b : benches) {
        for (int w = 0; w < 20; ++w) { // warm-up: JIT
          b.run(chunk);
          Native.benchChunk(h, b.op, flat, 64, QLEN, cIds, stride, ids.length, chunk);
        }
        double[] j = new double[rounds];
        double[] c = new double[rounds];
        for (int r = 0; r < rounds; ++r) {
          long t = System.nanoTime();
          b.run(chunk);
          j[r] = (double) (System.nanoTime() - t) / chunk;
          long ns = Native.benchChunk(h, b.op, flat, 64, QLEN, cIds, stride, ids.length, chunk);
          if (ns < 0) throw new AssertionError("the C loop failed");
          c[r] = (double) ns / chunk;
        }
        Arrays.sort(j);
        Arrays.sort(c);
        double jp = j[rounds / 10];
        double cp = c[rounds / 10];
        System.out.printf(
            Locale.ROOT,
            "%-29s java min %7.1f p10 %7.1f | C min %7.1f p10 %7.1f | overhead min %+6.1f p10 %+6.1f%n",
            b.name,
            j[0],
            jp,
            c[0],
            cp,
            j[0] - c[0],
            jp - cp);
      }
    }
  }

  /** Admitted findBestMatch and freeRequest, the prompt from an int[] or a direct IntBuffer. */
  private static Bench admitFree(
      Router router, int[][] prompts, IntBuffer[] direct, RequestOptions[] admits) {
    return new Bench(direct == null ? "admit+free" : "admit+free, direct IntBuffer", 1) {
      @Override
      void run(int n) {
        for (int i = 0; i < n; ++i) {
          RequestOptions admit = admits[i % admits.length];
          if (direct == null) {
            router.findBestMatch(prompts[i % prompts.length], admit);
          } else {
            router.findBestMatch(direct[i % direct.length], admit);
          }
          router.freeRequest(admit.requestId);
        }
      }
    };
  }

  private abstract static class Bench {
    final String name;
    final int op;

    Bench(String name, int op) {
      this.name = name;
      this.op = op;
    }

    abstract void run(int n);
  }
}
