package io.kvrouter;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.IOException;
import java.lang.reflect.Method;
import java.lang.reflect.Modifier;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import org.junit.jupiter.api.Test;

/** Loading, versions, statuses, tiers, defaults, and that the glue covers the whole C ABI. */
class LibraryTest {
  private static Path sourceDir() {
    return Path.of(System.getProperty("kvrouter.source.dir", "../.."));
  }

  @Test
  void loadsAndChecksTheVersion() {
    KvRouter.load();
    assertEquals(KvRouter.headerVersion(), KvRouter.version());
    String[] parts = KvRouter.versionString().split("\\.");
    assertEquals(3, parts.length);
    assertEquals(
        Integer.parseInt(parts[0]) * 10000
            + Integer.parseInt(parts[1]) * 100
            + Integer.parseInt(parts[2]),
        KvRouter.version());
    assertEquals(NativeLoader.resourcePath(), "/linux/x86_64/libkvrouter_jni.so");
  }

  @Test
  void statusNamesComeFromTheLibrary() {
    assertEquals("KVR_OK", Status.OK.cName());
    assertEquals("KVR_NOT_FOUND", Status.NOT_FOUND.cName());
    assertEquals("KVR_BUFFER_TOO_SMALL", Status.BUFFER_TOO_SMALL.cName());
    assertEquals("KVR_UNKNOWN", KvRouter.statusName(77));
    for (Status s : Status.values()) {
      if (s != Status.UNKNOWN) assertEquals(s, Status.of(s.code()));
    }
    assertEquals(Status.UNKNOWN, Status.of(77));
    KvRouterException e = new KvRouterException(77, "odd");
    assertEquals(Status.UNKNOWN, e.status());
    assertEquals(77, e.code());
    assertTrue(e.toString().contains("[UNKNOWN 77] odd"), e.toString());
  }

  @Test
  void tiersFromMediums() {
    assertEquals(Tier.DEVICE, KvRouter.tierFromMedium("GPU"));
    assertEquals(Tier.HOST_PINNED, KvRouter.tierFromMedium("cpu_pinned"));
    assertEquals(Tier.DISK, KvRouter.tierFromMedium("DISK"));
    assertEquals(Tier.EXTERNAL, KvRouter.tierFromMedium("EXTERNAL"));
    assertEquals(Tier.DEVICE, KvRouter.tierFromMedium(null));
    assertEquals(Tier.DEVICE, KvRouter.tierFromMedium("something else"));
  }

  @Test
  void defaultsAreTheLibrarys() {
    RouterOptions o = RouterOptions.defaults();
    assertEquals(16, o.blockSize());
    assertEquals(1.0, o.overlapScoreCredit());
    assertEquals(1.0, o.prefillLoadScale());
    assertEquals(0.75, o.hostCacheHitWeight());
    assertEquals(0.25, o.diskCacheHitWeight());
    assertEquals(0.0, o.temperature());
    assertTrue(o.queueThreshold() < 0);
    assertEquals(120.0, o.approxTtlSeconds());
    assertEquals(1L << 20, o.approxMaxBlocks());
    assertEquals(QueuePolicy.FCFS, o.queuePolicy());
    assertTrue(o.assumeKvReuse());
    assertTrue(o.trackPrefillTokens());
    assertFalse(o.approximate());
    assertFalse(o.trackOutputBlocks());
    assertEquals(0.0, o.overlapScoreCreditDecay());
    assertEquals(0.0, o.decodeActiveRequestWeight());
    assertEquals(1, o.indexShards());

    RequestOptions r = RequestOptions.builder().build();
    assertFalse(r.admit());
    assertTrue(Double.isNaN(r.temperature()));
    assertEquals(null, r.assumeKvReuse());
    assertEquals(-1, r.queueTimeoutMs());
    assertTrue(Double.isNaN(r.overlapScoreCreditDecay()));
    assertTrue(Double.isNaN(r.decodeActiveRequestWeight()));

    RoutingHints h = RoutingHints.builder().build();
    assertEquals(Phase.AGGREGATED, h.phase());
    assertEquals(RoutingHints.NO_WORKER, h.workerId());
    assertEquals(-1, h.dpRank());
    assertEquals(SessionMode.HARD, h.sessionMode());
    assertEquals(300.0, h.sessionTtlSeconds());

    WorkerConfig w = WorkerConfig.of(5);
    assertEquals(5, w.workerId());
    assertEquals(1, w.dpSize());

    DisaggOptions d = DisaggOptions.defaults();
    assertEquals(DisaggPolicy.ALWAYS, d.policy());
    assertEquals(512, d.maxLocalPrefillTokens());
    assertTrue(d.decodeBusyThreshold() < 0);

    IngestOptions i = IngestOptions.defaults();
    assertEquals(64 << 20, i.maxFrameBytes());
    assertEquals(2000, i.replayTimeoutMs());
    assertEquals(1000, i.replicaHeartbeatMs());
    assertEquals(10000, i.replicaTimeoutMs());
    IngestOptions liveness =
        IngestOptions.builder().replicaHeartbeatMs(250).replicaTimeoutMs(0).build();
    assertEquals(250, liveness.replicaHeartbeatMs());
    assertEquals(0, liveness.replicaTimeoutMs());
    assertEquals(2000, liveness.replayTimeoutMs()); // the other settings kept

    RouterOptions changed = o.toBuilder().approximate(true).assumeKvReuse(false).build();
    assertTrue(changed.approximate());
    assertFalse(changed.assumeKvReuse());
    assertFalse(o.approximate()); // immutable
    RouterOptions knobs =
        o.toBuilder()
            .overlapScoreCreditDecay(0.25)
            .decodeActiveRequestWeight(1.5)
            .trackOutputBlocks(true)
            .build();
    assertEquals(0.25, knobs.overlapScoreCreditDecay());
    assertEquals(1.5, knobs.decodeActiveRequestWeight());
    assertTrue(knobs.trackOutputBlocks());
    assertFalse(knobs.toBuilder().trackOutputBlocks(false).build().trackOutputBlocks());
    assertEquals(16, knobs.blockSize()); // the other settings kept
    RequestOptions overrides =
        r.toBuilder().overlapScoreCreditDecay(2).decodeActiveRequestWeight(0.5).build();
    assertEquals(2.0, overrides.overlapScoreCreditDecay());
    assertEquals(0.5, overrides.decodeActiveRequestWeight());
    RequestOptions unset = overrides.toBuilder().decodeActiveRequestWeight(Double.NaN).build();
    assertTrue(Double.isNaN(unset.decodeActiveRequestWeight()));
    assertEquals(2.0, unset.overlapScoreCreditDecay());
  }

  @Test
  void badRouterOptionsNameTheSetting() {
    KvRouterException e =
        assertThrows(
            KvRouterException.class,
            () -> new Router(RouterOptions.builder().blockSize(0).build()));
    assertEquals(Status.INVALID_ARGUMENT, e.status());
    assertTrue(e.getMessage().contains("block_size"), e.getMessage());
  }

  /** Every function of kvrouter.h is called by the glue; every native method is implemented. */
  @Test
  void theGlueCoversTheWholeCAbi() throws IOException {
    // The header the glue was compiled against (CMake writes its path), else the source tree's.
    Path build = Path.of(System.getProperty("kvrouter.native.build", "target/native/build"));
    Path headerPath =
        Files.exists(build.resolve("kvrouter-header.txt"))
            ? Path.of(Files.readString(build.resolve("kvrouter-header.txt")).trim())
            : sourceDir().resolve("include/kvrouter.h");
    String header = Files.readString(headerPath, StandardCharsets.UTF_8);
    String glue =
        Files.readString(
            sourceDir().resolve("bindings/java/src/main/c/kvrouter_jni.c"), StandardCharsets.UTF_8);
    Matcher m = Pattern.compile("KVR_API[^;(]*?\\b(kvr_[a-z0-9_]+)\\s*\\(").matcher(header);
    List<String> functions = new ArrayList<>();
    List<String> missing = new ArrayList<>();
    while (m.find()) {
      String name = m.group(1);
      functions.add(name);
      if (!Pattern.compile("\\b" + name + "\\b").matcher(glue).find()) missing.add(name);
    }
    assertTrue(functions.size() >= 88, "parsed " + functions.size() + " functions");
    assertEquals(List.of(), missing, headerPath + ": functions the glue never calls");

    List<String> unimplemented = new ArrayList<>();
    int natives = 0;
    for (Method method : Native.class.getDeclaredMethods()) {
      if (!Modifier.isNative(method.getModifiers())) continue;
      ++natives;
      String name = method.getName();
      // Written out, or made by the glue's DEFAULTS_NATIVE(java, ...) macro.
      boolean defined =
          glue.contains("Java_io_kvrouter_Native_" + name + "(")
              || (name.endsWith("Defaults")
                  && glue.contains(
                      "DEFAULTS_NATIVE(" + name.substring(0, name.length() - 8) + ","));
      if (!defined) unimplemented.add(name);
    }
    assertTrue(natives >= 70, natives + " native methods");
    assertEquals(List.of(), unimplemented);
  }

  @Test
  void hashesMatchDynamoVectorsBitForBit() {
    // data/vectors/dynamo_block_hash_vectors.json
    assertArrayEquals(
        new long[] {
          Long.parseUnsignedLong("15310707395893867146"),
          Long.parseUnsignedLong("15292316782987903195")
        },
        Hashing.blockHashes(TestSupport.tokens(32, 0), 16));
    assertArrayEquals( // partial tail ignored
        Hashing.blockHashes(TestSupport.tokens(32, 0), 16),
        Hashing.blockHashes(TestSupport.tokens(37, 0), 16));
    assertEquals(0, Hashing.blockHashes(TestSupport.tokens(5, 0), 16).length);
    assertArrayEquals(
        new long[] {
          Long.parseUnsignedLong("15310707395893867146"),
          Long.parseUnsignedLong("13769157705258532664")
        },
        Hashing.sequenceHashes(Hashing.blockHashes(TestSupport.tokens(32, 0), 16)));
    assertArrayEquals(
        new long[] {Long.parseUnsignedLong("6665157333201000639")},
        Hashing.blockHashes(
            new int[] {0, 1, 2, 3}, 4, HashOptions.builder().loraName("adapter-a").build()));
    assertArrayEquals(
        Hashing.blockHashes(new int[] {0, 1, 2, 3}, 4),
        Hashing.blockHashes(new int[] {0, 1, 2, 3}, 4, HashOptions.builder().loraName("").build()));
    assertArrayEquals(
        new long[] {Long.parseUnsignedLong("12244549381340615468")},
        Hashing.blockHashes(
            new int[] {0, 1, 2, 3}, 4, HashOptions.builder().cacheNamespace("tenant-1").build()));
    assertArrayEquals(
        new long[] {
          Long.parseUnsignedLong("11802432356634032379"),
          Long.parseUnsignedLong("5964709424852623607")
        },
        Hashing.blockHashes(
            TestSupport.tokens(32, 100),
            16,
            HashOptions.builder().loraName("adapter-b").cacheNamespace("tenant-2").build()));
    assertArrayEquals(
        new long[] {
          Long.parseUnsignedLong("8964971868145781830"),
          Long.parseUnsignedLong("10311331095896773576")
        },
        Hashing.blockHashes(
            new int[] {7, 8, 9, 10, 11, 12},
            3,
            HashOptions.builder().multimodal(new long[] {9, 3, 5}, new int[] {2, 1}).build()));
    assertArrayEquals(
        new long[] {
          Long.parseUnsignedLong("5959138341449004422"),
          Long.parseUnsignedLong("13917772031453556700")
        },
        Hashing.blockHashes(
            new int[] {10, 11, 12, 13, 14}, 2, HashOptions.builder().eagle(true).build()));
    int[] large = new int[32];
    for (int i = 0; i < 32; i += 4) {
      large[i] = (int) 4294967295L;
      large[i + 1] = 0;
      large[i + 2] = (int) 2147483648L;
      large[i + 3] = 1;
    }
    long[] h = Hashing.blockHashes(large, 8);
    assertEquals(4, h.length);
    for (long v : h) assertEquals(Long.parseUnsignedLong("6565018717400035788"), v);
    assertEquals(Long.parseUnsignedLong("13893058671646163016"), Hashing.sequenceHashes(h)[3]);
  }

  @Test
  void hashingErrorsCarryTheStatus() {
    KvRouterException e =
        assertThrows(KvRouterException.class, () -> Hashing.blockHashes(new int[4], 0));
    assertEquals(Status.INVALID_ARGUMENT, e.status());
    // LoRA names are hashed as real UTF-8 (not JNI's modified UTF-8), and differ from ASCII.
    long[] a =
        Hashing.blockHashes(new int[] {1, 2, 3, 4}, 4, HashOptions.builder().loraName("é").build());
    long[] b =
        Hashing.blockHashes(new int[] {1, 2, 3, 4}, 4, HashOptions.builder().loraName("e").build());
    assertNotEquals(a[0], b[0]);
    long[] c =
        Hashing.blockHashes(
            new int[] {1, 2, 3, 4}, 4, HashOptions.builder().loraName("😀").build());
    assertNotEquals(a[0], c[0]);
    assertThrows(
        IllegalArgumentException.class,
        () -> Hashing.blockHashes(new int[4], 4, HashOptions.builder().loraName("a\0b").build()));
    assertThrows(
        IllegalArgumentException.class,
        () ->
            Hashing.blockHashes(new int[4], 4, HashOptions.builder().loraName("\uD800x").build()));
    // A big prompt: 8,192 tokens, 512 blocks.
    assertEquals(512, Hashing.blockHashes(TestSupport.tokens(8192, 9), 16).length);
    assertEquals(0, Hashing.sequenceHashes(new long[0]).length);
  }
}
