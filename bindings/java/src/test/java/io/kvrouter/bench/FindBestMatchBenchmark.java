package io.kvrouter.bench;

import io.kvrouter.Hashing;
import io.kvrouter.KvRouter;
import io.kvrouter.RequestOptions;
import io.kvrouter.RouteResult;
import io.kvrouter.Router;
import io.kvrouter.RouterOptions;
import io.kvrouter.StoredEvent;
import io.kvrouter.WorkerConfig;
import java.io.BufferedReader;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashSet;
import java.util.List;
import java.util.Locale;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * Times {@link Router#findBestMatch} through the Java binding, on the setup of
 * bench/router_bench.cc so the figures compare with BENCHMARKS.md: the Mooncake conversation trace
 * loaded into the index (each request's prompt expanded at block size 16 and stored on one of 64
 * workers, round-robin, as only the blocks new to that worker), queries = the first 1,024 trace
 * prompts of at least 512 blocks, cut to 8,192 tokens. Per-call timing with System.nanoTime; prints
 * p50 and p99 per repetition and the median p50 over repetitions.
 *
 * <p>Modes: admit (hash, match, price 64 candidates, book; then free, timed apart) and preview
 * (nothing booked). Also times a bare JNI call (kvr_version) as the transition floor.
 *
 * <pre>
 * java -cp target/classes:target/test-classes io.kvrouter.bench.FindBestMatchBenchmark \
 *     [--trace PATH] [--workers 64] [--iterations 20000] [--repetitions 5] [--dump DIR]
 *     [--restore DIR]
 * </pre>
 *
 * Without a trace file it falls back to a synthetic index (64 workers sharing prefixes).
 */
public final class FindBestMatchBenchmark {
  private static final int BLOCK = 16;
  private static final int QUERY_TOKENS = 8192;
  private static final int MAX_QUERIES = 1024;
  private static final int TRACE_BLOCK_TOKENS = 512;

  private FindBestMatchBenchmark() {}

  public static void main(String[] args) throws IOException {
    String trace = null;
    int workers = 64;
    int iterations = 20_000;
    int repetitions = 5;
    Path dump = null;
    Path restore = null;
    for (int i = 0; i < args.length; ++i) {
      switch (args[i]) {
        case "--trace":
          trace = args[++i];
          break;
        case "--workers":
          workers = Integer.parseInt(args[++i]);
          break;
        case "--iterations":
          iterations = Integer.parseInt(args[++i]);
          break;
        case "--repetitions":
          repetitions = Integer.parseInt(args[++i]);
          break;
        case "--dump": // writes the events, the index snapshot and the queries to DIR (for C)
          dump = Path.of(args[++i]);
          break;
        case "--restore": // the index and queries from a --dump instead of the trace
          restore = Path.of(args[++i]);
          break;
        default:
          throw new IllegalArgumentException("unknown argument " + args[i]);
      }
    }
    if (trace == null) {
      Path source = Path.of(System.getProperty("kvrouter.source.dir", "../.."));
      trace = source.resolve("data/mooncake/conversation_trace.jsonl").toString();
    }

    KvRouter.load();
    System.out.printf(
        Locale.ROOT,
        "kvrouter %s, Java %s (%s), %d workers, %d iterations x %d repetitions%n",
        KvRouter.versionString(),
        System.getProperty("java.version"),
        System.getProperty("java.vm.name"),
        workers,
        iterations,
        repetitions);

    RouterOptions options = RouterOptions.builder().blockSize(BLOCK).randomSeed(1).build();
    try (Router router = new Router(options)) {
      for (int w = 0; w < workers; ++w) {
        router.addWorker(WorkerConfig.builder(w).maxNumBatchedTokens(16384).build());
      }
      long start = System.nanoTime();
      if (dump != null) {
        Files.createDirectories(dump);
        events =
            new java.io.DataOutputStream(
                new java.io.BufferedOutputStream(
                    Files.newOutputStream(dump.resolve("events.u64"))));
      }
      List<int[]> queries;
      if (restore != null) {
        router.restore(Files.readAllBytes(restore.resolve("index.snapshot")));
        java.nio.IntBuffer b =
            java.nio.ByteBuffer.wrap(Files.readAllBytes(restore.resolve("queries.u32")))
                .order(java.nio.ByteOrder.LITTLE_ENDIAN)
                .asIntBuffer();
        queries = new ArrayList<>();
        while (b.remaining() >= QUERY_TOKENS) {
          int[] q = new int[QUERY_TOKENS];
          b.get(q);
          queries.add(q);
        }
        trace = restore.resolve("index.snapshot").toString();
      } else if (Files.isReadable(Path.of(trace))) {
        queries = loadTrace(router, Path.of(trace), workers);
      } else {
        queries = loadSynthetic(router, workers);
      }
      System.out.printf(
          Locale.ROOT,
          "index: %,d blocks, %,d nodes, loaded in %.1f s from %s; %d queries of %d tokens%n",
          router.metrics().indexBlocks(),
          router.metrics().indexNodes(),
          (System.nanoTime() - start) / 1e9,
          Files.isReadable(Path.of(trace)) ? trace : "a synthetic index",
          queries.size(),
          QUERY_TOKENS);

      if (dump != null) {
        if (events != null) events.close();
        Files.write(dump.resolve("index.snapshot"), router.snapshot());
        java.nio.ByteBuffer b =
            java.nio.ByteBuffer.allocate(queries.size() * QUERY_TOKENS * 4)
                .order(java.nio.ByteOrder.LITTLE_ENDIAN);
        for (int[] q : queries) for (int t : q) b.putInt(t);
        Files.write(dump.resolve("queries.u32"), b.array());
        System.out.println("wrote events.u64, index.snapshot and queries.u32 to " + dump);
      }

      String[] ids = new String[4096];
      RequestOptions[] admit = new RequestOptions[ids.length];
      for (int i = 0; i < ids.length; ++i) {
        ids[i] = "request-" + i;
        admit[i] = RequestOptions.admit(ids[i]);
      }

      double[] admitP50 = new double[repetitions];
      double[] previewP50 = new double[repetitions];
      double[] freeP50 = new double[repetitions];
      double[] floorP50 = new double[repetitions];
      long[] find = new long[iterations];
      int[] prompt = new int[QUERY_TOKENS];
      long[] free = new long[iterations];
      double cached = 0;
      for (int rep = 0; rep < repetitions; ++rep) {
        // admit: find_best_match with admission, then free (as BM_FindBestMatch/inflight:0)
        for (int i = -iterations / 10; i < iterations; ++i) { // the first tenth warms up
          int k = Math.floorMod(i, ids.length);
          // As router_bench: the prompt is copied into a reused buffer before the clock starts
          // (a request's tokens are in cache right after they were decoded).
          System.arraycopy(
              queries.get(Math.floorMod(i, queries.size())), 0, prompt, 0, QUERY_TOKENS);
          long t0 = System.nanoTime();
          RouteResult r = router.findBestMatch(prompt, admit[k]);
          long t1 = System.nanoTime();
          router.freeRequest(ids[k]);
          long t2 = System.nanoTime();
          if (i >= 0) {
            find[i] = t1 - t0;
            free[i] = t2 - t1;
            cached += r.cachedTokens();
          }
        }
        double[] a = percentiles(find);
        double[] f = percentiles(free);
        // preview: nothing booked (as BM_FindBestMatchPreview)
        for (int i = -iterations / 10; i < iterations; ++i) {
          System.arraycopy(
              queries.get(Math.floorMod(i, queries.size())), 0, prompt, 0, QUERY_TOKENS);
          long t0 = System.nanoTime();
          router.findBestMatch(prompt);
          long t1 = System.nanoTime();
          if (i >= 0) find[i] = t1 - t0;
        }
        double[] p = percentiles(find);
        // the JNI floor: a native call that does nothing (kvr_version)
        for (int i = -iterations / 10; i < iterations; ++i) {
          long t0 = System.nanoTime();
          KvRouter.version();
          long t1 = System.nanoTime();
          if (i >= 0) find[i] = t1 - t0;
        }
        double[] j = percentiles(find);
        admitP50[rep] = a[0];
        previewP50[rep] = p[0];
        freeP50[rep] = f[0];
        floorP50[rep] = j[0];
        System.out.printf(
            Locale.ROOT,
            "rep %d: findBestMatch+admit p50 %.2f us p99 %.2f us | free p50 %.2f us | preview"
                + " p50 %.2f us p99 %.2f us | bare JNI call p50 %.3f us%n",
            rep + 1,
            a[0],
            a[1],
            f[0],
            p[0],
            p[1],
            j[0]);
      }
      System.out.printf(
          Locale.ROOT,
          "median of %d: findBestMatch (admit) p50 %.2f us, preview p50 %.2f us, free p50 %.2f us,"
              + " bare JNI call %.3f us; mean cached tokens %.0f%n",
          repetitions,
          median(admitP50),
          median(previewP50),
          median(freeP50),
          median(floorP50),
          cached / ((double) iterations * repetitions));
    }
  }

  /** p50 and p99 in microseconds. */
  private static double[] percentiles(long[] nanos) {
    long[] sorted = nanos.clone();
    Arrays.sort(sorted);
    return new double[] {
      sorted[sorted.length / 2] / 1e3,
      sorted[(int) Math.min(sorted.length - 1, sorted.length * 0.99)] / 1e3
    };
  }

  private static double median(double[] values) {
    double[] sorted = values.clone();
    Arrays.sort(sorted);
    return sorted[sorted.length / 2];
  }

  // ---- The Mooncake trace, expanded as tools/replay/trace/mooncake_trace.cc does ----

  private static final Pattern INPUT_LENGTH = Pattern.compile("\"input_length\"\\s*:\\s*(\\d+)");
  private static final Pattern HASH_IDS = Pattern.compile("\"hash_ids\"\\s*:\\s*\\[([^\\]]*)\\]");

  /** splitmix64's finaliser. */
  private static long mix64(long x) {
    x += 0x9e3779b97f4a7c15L;
    x = (x ^ (x >>> 30)) * 0xbf58476d1ce4e5b9L;
    x = (x ^ (x >>> 27)) * 0x94d049bb133111ebL;
    return x ^ (x >>> 31);
  }

  /** Each hash id is 512 deterministic tokens (in pairs); truncated to input_length. */
  static int[] expand(long inputLength, long[] hashIds) {
    int length = (int) Math.min(inputLength, (long) hashIds.length * TRACE_BLOCK_TOKENS);
    int[] out = new int[length];
    for (int pos = 0; pos < length; pos += 2) {
      long id = hashIds[pos / TRACE_BLOCK_TOKENS];
      long pair = mix64(id * (TRACE_BLOCK_TOKENS / 2) + (pos % TRACE_BLOCK_TOKENS) / 2);
      out[pos] = (int) pair;
      if (pos + 1 < length) out[pos + 1] = (int) (pair >>> 32);
    }
    return out;
  }

  /** With --dump: every stored event applied, as the C benchmark replays it. */
  private static java.io.DataOutputStream events;

  private static void recordEvent(
      long worker, long parent, boolean hasParent, long[] engine, long[] local) throws IOException {
    if (events == null) return;
    events.writeLong(Long.reverseBytes(worker));
    events.writeLong(Long.reverseBytes(hasParent ? 1 : 0));
    events.writeLong(Long.reverseBytes(parent));
    events.writeLong(Long.reverseBytes(engine.length));
    for (long h : engine) events.writeLong(Long.reverseBytes(h));
    for (long h : local) events.writeLong(Long.reverseBytes(h));
  }

  private static List<int[]> loadTrace(Router router, Path trace, int workers) throws IOException {
    List<HashSet<Long>> held = new ArrayList<>();
    for (int w = 0; w < workers; ++w) held.add(new HashSet<>());
    List<int[]> queries = new ArrayList<>();
    try (BufferedReader in = Files.newBufferedReader(trace, StandardCharsets.UTF_8)) {
      long i = 0;
      for (String line = in.readLine(); line != null; line = in.readLine()) {
        if (line.isBlank()) continue;
        Matcher len = INPUT_LENGTH.matcher(line);
        Matcher ids = HASH_IDS.matcher(line);
        if (!len.find() || !ids.find()) throw new IOException("bad trace line " + (i + 1));
        String[] parts = ids.group(1).trim().isEmpty() ? new String[0] : ids.group(1).split(",");
        long[] hashIds = new long[parts.length];
        for (int p = 0; p < parts.length; ++p) hashIds[p] = Long.parseLong(parts[p].trim());
        int[] tokens = expand(Long.parseLong(len.group(1)), hashIds);
        long[] local = Hashing.blockHashes(tokens, BLOCK);
        long[] engine = Hashing.sequenceHashes(local);
        int w = (int) (i % workers);
        HashSet<Long> mine = held.get(w);
        int firstNew = 0;
        while (firstNew < engine.length && mine.contains(engine[firstNew])) ++firstNew;
        if (firstNew < engine.length) {
          StoredEvent.Builder event =
              StoredEvent.builder(w)
                  .eventId(i)
                  .blockHashes(Arrays.copyOfRange(engine, firstNew, engine.length))
                  .localHashes(Arrays.copyOfRange(local, firstNew, local.length));
          if (firstNew > 0) event.parentHash(engine[firstNew - 1]);
          StoredEvent stored = event.build();
          router.applyStored(stored);
          recordEvent(
              w,
              firstNew > 0 ? engine[firstNew - 1] : 0,
              firstNew > 0,
              Arrays.copyOfRange(engine, firstNew, engine.length),
              Arrays.copyOfRange(local, firstNew, local.length));
          for (int b = firstNew; b < engine.length; ++b) mine.add(engine[b]);
        }
        if (queries.size() < MAX_QUERIES && local.length >= QUERY_TOKENS / BLOCK) {
          queries.add(Arrays.copyOf(tokens, QUERY_TOKENS));
        }
        ++i;
      }
    }
    return queries;
  }

  /** 256 prompts of 8,192 tokens sharing 4 prefixes, spread over the workers. */
  private static List<int[]> loadSynthetic(Router router, int workers) {
    List<int[]> queries = new ArrayList<>();
    for (int q = 0; q < 256; ++q) {
      long[] ids = new long[QUERY_TOKENS / TRACE_BLOCK_TOKENS];
      for (int b = 0; b < ids.length; ++b) ids[b] = b < 4 ? (q % 4) * 1000 + b : q * 1000 + b;
      int[] tokens = expand(QUERY_TOKENS, ids);
      long[] local = Hashing.blockHashes(tokens, BLOCK);
      int blocks = local.length / 2 + q % (local.length / 2);
      router.applyStored(
          StoredEvent.builder(q % workers)
              .eventId(q)
              .blockHashes(Arrays.copyOf(Hashing.sequenceHashes(local), blocks))
              .localHashes(Arrays.copyOf(local, blocks))
              .build());
      queries.add(tokens);
    }
    return queries;
  }
}
