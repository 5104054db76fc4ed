package io.kvrouter;

import java.util.Objects;

/**
 * Blocks newly cached by one worker rank, consecutive along one sequence ({@code
 * kvr_stored_event}). Each block has the engine's own hash and either a precomputed local hash or
 * its tokens: {@code tokenIds} holds every block's tokens concatenated (block_size per block, plus
 * one look-ahead token with eagle windows).
 *
 * <p>A hybrid model's sliding-window store instead ({@link Builder#slidingWindow}; docs/ingest.md,
 * "Sliding windows"): the blocks KV-cache group {@code slidingGroup} (the engine's group index,
 * its window {@code windowTokens} tokens) now holds, by engine hash, each one the rank holds in
 * full attention under that hash (the others are skipped: {@link Status#NOT_FOUND}). A prefix is
 * then cached on the rank only where its sliding-window groups also hold the blocks before the
 * prefix's end that their windows need, as the engine counts it. Such a store names blocks only:
 * a parent, local hashes, tokens, eagle, a LoRA name, a namespace or multimodal hashes make it
 * {@link Status#INVALID_ARGUMENT}, and so does a tier other than the device.
 *
 * <p>Immutable from the outside; the arrays given to the builder are not copied (events can be
 * large), so do not change them while the event is in use.
 */
public final class StoredEvent {
  // Read by the JNI glue: keep the names and types. scalars: kvr_stored_event in the slots of
  // Abi.StoredEvent (the glue takes num_blocks and num_tokens from the arrays).
  final long[] scalars;
  final long[] blockHashes;
  final long[] localHashes;
  final int[] tokenIds;
  final String loraName;
  final String cacheNamespace;
  final long[] mmHashes;
  final int[] mmCounts;

  private StoredEvent(Builder b) {
    this.scalars = b.scalars.clone();
    this.blockHashes = Objects.requireNonNull(b.blockHashes, "blockHashes");
    this.localHashes = b.localHashes;
    this.tokenIds = b.tokenIds;
    this.loraName = b.loraName;
    this.cacheNamespace = b.cacheNamespace;
    this.mmHashes = b.mmHashes;
    this.mmCounts = b.mmCounts;
  }

  /** A stored event of {@code workerId} (rank 0, device tier, no parent). */
  public static Builder builder(long workerId) {
    return new Builder(Native.storedEventDefaults()).workerId(workerId);
  }

  public long workerId() {
    return scalars[Abi.StoredEvent.WORKER_ID];
  }

  public int dpRank() {
    return (int) scalars[Abi.StoredEvent.DP_RANK];
  }

  public long eventId() {
    return scalars[Abi.StoredEvent.EVENT_ID];
  }

  public Tier tier() {
    return Tier.of((int) scalars[Abi.StoredEvent.TIER]);
  }

  public boolean hasParent() {
    return (scalars[Abi.StoredEvent.FLAGS] & Abi.STORED_HAS_PARENT) != 0;
  }

  public long parentHash() {
    return scalars[Abi.StoredEvent.PARENT_HASH];
  }

  public int numBlocks() {
    return blockHashes.length;
  }

  /** A sliding-window store ({@link Builder#slidingWindow}), not a full-attention one. */
  public boolean isSlidingWindow() {
    return scalars[Abi.StoredEvent.SLIDING_WINDOW_TOKENS] != 0;
  }

  /** The sliding-window group's index (read only by a sliding-window store; 0 by default). */
  public long slidingGroup() {
    return scalars[Abi.StoredEvent.SLIDING_GROUP];
  }

  /** The sliding window in tokens; 0: a full-attention store (the default). */
  public int slidingWindowTokens() {
    return (int) scalars[Abi.StoredEvent.SLIDING_WINDOW_TOKENS];
  }

  /** Builds {@link StoredEvent}. */
  public static final class Builder {
    private final long[] scalars;
    private long[] blockHashes;
    private long[] localHashes;
    private int[] tokenIds;
    private String loraName;
    private String cacheNamespace;
    private long[] mmHashes;
    private int[] mmCounts;

    private Builder(long[] defaults) {
      this.scalars = defaults;
    }

    public Builder workerId(long workerId) {
      scalars[Abi.StoredEvent.WORKER_ID] = workerId;
      return this;
    }

    public Builder dpRank(int dpRank) {
      scalars[Abi.StoredEvent.DP_RANK] = Integer.toUnsignedLong(dpRank);
      return this;
    }

    public Builder eventId(long eventId) {
      scalars[Abi.StoredEvent.EVENT_ID] = eventId;
      return this;
    }

    public Builder tier(Tier tier) {
      scalars[Abi.StoredEvent.TIER] = tier.code();
      return this;
    }

    /** The engine hash of the block before the first one (absent: the sequence starts here). */
    public Builder parentHash(long parentHash) {
      scalars[Abi.StoredEvent.FLAGS] |= Abi.STORED_HAS_PARENT;
      scalars[Abi.StoredEvent.PARENT_HASH] = parentHash;
      return this;
    }

    /** No parent (the default). */
    public Builder noParent() {
      scalars[Abi.StoredEvent.FLAGS] &= ~Abi.STORED_HAS_PARENT;
      scalars[Abi.StoredEvent.PARENT_HASH] = 0;
      return this;
    }

    /** The token ids use eagle windows (block_size + 1 tokens per block). */
    public Builder eagle(boolean eagle) {
      int f = Abi.StoredEvent.FLAGS;
      scalars[f] = eagle ? (scalars[f] | Abi.STORED_EAGLE) : (scalars[f] & ~Abi.STORED_EAGLE);
      return this;
    }

    /** The engine's own hash of each block (required; their count is the block count). */
    public Builder blockHashes(long... blockHashes) {
      this.blockHashes = blockHashes;
      return this;
    }

    /** Precomputed local hashes, one per block; then the tokens are not read. */
    public Builder localHashes(long... localHashes) {
      this.localHashes = localHashes;
      return this;
    }

    /** Every block's tokens, concatenated. */
    public Builder tokenIds(int... tokenIds) {
      this.tokenIds = tokenIds;
      return this;
    }

    public Builder loraName(String loraName) {
      this.loraName = loraName;
      return this;
    }

    public Builder cacheNamespace(String cacheNamespace) {
      this.cacheNamespace = cacheNamespace;
      return this;
    }

    /** Per-block multimodal hashes: block i owns the next counts[i] values of hashes. */
    public Builder multimodal(long[] hashes, int[] counts) {
      if ((hashes == null) != (counts == null)) {
        throw new IllegalArgumentException("multimodal hashes and counts go together");
      }
      this.mmHashes = hashes;
      this.mmCounts = counts;
      return this;
    }

    /**
     * Makes this a hybrid model's sliding-window store ({@code kvr_stored_event.sliding_group},
     * {@code sliding_window_tokens}): the blocks KV-cache group {@code group} (the engine's group
     * index) now holds, its window {@code windowTokens} tokens. Name the blocks by {@link
     * #blockHashes} only, on the device tier (see the class comment).
     *
     * @throws IllegalArgumentException if {@code windowTokens} is not positive
     */
    public Builder slidingWindow(long group, int windowTokens) {
      if (windowTokens <= 0) {
        throw new IllegalArgumentException(
            "a sliding window has a positive number of tokens: " + windowTokens);
      }
      scalars[Abi.StoredEvent.SLIDING_GROUP] = group;
      scalars[Abi.StoredEvent.SLIDING_WINDOW_TOKENS] = windowTokens;
      return this;
    }

    /** A full-attention store (the default): undoes {@link #slidingWindow}. */
    public Builder fullAttention() {
      scalars[Abi.StoredEvent.SLIDING_GROUP] = 0;
      scalars[Abi.StoredEvent.SLIDING_WINDOW_TOKENS] = 0;
      return this;
    }

    public StoredEvent build() {
      return new StoredEvent(this);
    }
  }
}
