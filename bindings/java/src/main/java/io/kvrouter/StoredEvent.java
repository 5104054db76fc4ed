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
  static final int FLAG_HAS_PARENT = 0x1;
  static final int FLAG_EAGLE = 0x2;

  // Read by the JNI glue: keep the names and types.
  final long[] scalars; // dp_rank, worker_id, event_id, tier, flags, parent_hash
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
    return new Builder(Native.defaults(Native.DEFAULTS_STORED_EVENT, Native.STORED_EVENT_LEN))
        .workerId(workerId);
  }

  public long workerId() {
    return scalars[1];
  }

  public int dpRank() {
    return (int) scalars[0];
  }

  public long eventId() {
    return scalars[2];
  }

  public Tier tier() {
    return Tier.of((int) scalars[3]);
  }

  public boolean hasParent() {
    return (scalars[4] & FLAG_HAS_PARENT) != 0;
  }

  public long parentHash() {
    return scalars[5];
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
      scalars[1] = workerId;
      return this;
    }

    public Builder dpRank(int dpRank) {
      scalars[0] = Integer.toUnsignedLong(dpRank);
      return this;
    }

    public Builder eventId(long eventId) {
      scalars[2] = eventId;
      return this;
    }

    public Builder tier(Tier tier) {
      scalars[3] = tier.code();
      return this;
    }

    /** The engine hash of the block before the first one (absent: the sequence starts here). */
    public Builder parentHash(long parentHash) {
      scalars[4] |= FLAG_HAS_PARENT;
      scalars[5] = parentHash;
      return this;
    }

    /** No parent (the default). */
    public Builder noParent() {
      scalars[4] &= ~FLAG_HAS_PARENT;
      scalars[5] = 0;
      return this;
    }

    /** The token ids use eagle windows (block_size + 1 tokens per block). */
    public Builder eagle(boolean eagle) {
      scalars[4] = eagle ? (scalars[4] | FLAG_EAGLE) : (scalars[4] & ~FLAG_EAGLE);
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
