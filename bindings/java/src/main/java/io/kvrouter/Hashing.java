package io.kvrouter;

import java.util.Objects;

/**
 * Dynamo-compatible block hashing, bit for bit: XXH3-64 with seed 1337 over each complete block of
 * tokens, with LoRA, namespace and multimodal salts. Hashes are unsigned 64-bit values held in
 * {@code long}s ({@link Long#toUnsignedString(long)} prints them). Stateless and safe from any
 * thread.
 */
public final class Hashing {
  private Hashing() {}

  /** Local hashes of every complete block of {@code tokens} (token ids as unsigned ints). */
  public static long[] blockHashes(int[] tokens, int blockSize) {
    return blockHashes(tokens, blockSize, HashOptions.none());
  }

  /**
   * Local hashes of every complete block of {@code tokens}: {@code tokens.length / blockSize}
   * values (one token fewer with eagle windows).
   *
   * @throws KvRouterException {@link Status#INVALID_ARGUMENT} for block size 0 or bad multimodal
   *     counts
   */
  public static long[] blockHashes(int[] tokens, int blockSize, HashOptions options) {
    Objects.requireNonNull(tokens, "tokens");
    HashOptions o = options == null ? HashOptions.none() : options;
    return Native.computeBlockHashes(
        tokens, blockSize, o.eagle, o.loraName, o.cacheNamespace, o.mmHashes, o.mmCounts);
  }

  /** Chained sequence hashes of local block hashes, one per input. */
  public static long[] sequenceHashes(long[] localHashes) {
    Objects.requireNonNull(localHashes, "localHashes");
    return Native.computeSequenceHashes(localHashes);
  }
}
