package io.kvrouter;

import java.util.Objects;

/**
 * Blocks newly cached by one worker rank, consecutive along one sequence ({@code
 * kvr_stored_event}). Each block has the engine's own hash and either a precomputed local hash or
 * its tokens: {@code tokenIds} holds every block's tokens concatenated (block_size per block, plus
 * one look-ahead token with eagle windows).
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

    public StoredEvent build() {
      return new StoredEvent(this);
    }
  }
}
