package io.kvrouter;

import java.util.Objects;

/**
 * Blocks one worker rank evicted, named by the engine's hashes ({@code kvr_removed_event}). The
 * hash array is not copied.
 *
 * <p>With {@link Builder#sliding}, the blocks a hybrid model's sliding-window group evicted
 * ({@code KVR_REMOVED_SLIDING}; docs/ingest.md, "Sliding windows"): the rank's full-attention
 * blocks stay (a window lets go of a block long before full attention does), and a prefix whose
 * window needs one of them is no longer cached there.
 */
public final class RemovedEvent {
  // Read by the JNI glue: keep the names and types. scalars: kvr_removed_event in the slots of
  // Abi.RemovedEvent (the glue takes num_blocks from blockHashes).
  final long[] scalars;
  final long[] blockHashes;

  private RemovedEvent(long[] scalars, long[] blockHashes) {
    this.scalars = scalars;
    this.blockHashes = Objects.requireNonNull(blockHashes, "blockHashes");
  }

  /** Worker {@code workerId}, rank 0, device tier, event id 0. */
  public static RemovedEvent of(long workerId, long... blockHashes) {
    return builder(workerId).blockHashes(blockHashes).build();
  }

  public static Builder builder(long workerId) {
    return new Builder(Native.removedEventDefaults()).workerId(workerId);
  }

  public long workerId() {
    return scalars[Abi.RemovedEvent.WORKER_ID];
  }

  public int dpRank() {
    return (int) scalars[Abi.RemovedEvent.DP_RANK];
  }

  public long eventId() {
    return scalars[Abi.RemovedEvent.EVENT_ID];
  }

  public Tier tier() {
    return Tier.of((int) scalars[Abi.RemovedEvent.TIER]);
  }

  public int numBlocks() {
    return blockHashes.length;
  }

  /** The blocks left a sliding-window group ({@link Builder#sliding}), not full attention. */
  public boolean isSliding() {
    return (scalars[Abi.RemovedEvent.FLAGS] & Abi.REMOVED_SLIDING) != 0;
  }

  /** The sliding-window group's index (read only by a sliding removal; 0 by default). */
  public long slidingGroup() {
    return scalars[Abi.RemovedEvent.SLIDING_GROUP];
  }

  /** Builds {@link RemovedEvent}. */
  public static final class Builder {
    private final long[] scalars;
    private long[] blockHashes;

    private Builder(long[] defaults) {
      this.scalars = defaults;
    }

    public Builder workerId(long workerId) {
      scalars[Abi.RemovedEvent.WORKER_ID] = workerId;
      return this;
    }

    public Builder dpRank(int dpRank) {
      scalars[Abi.RemovedEvent.DP_RANK] = Integer.toUnsignedLong(dpRank);
      return this;
    }

    public Builder eventId(long eventId) {
      scalars[Abi.RemovedEvent.EVENT_ID] = eventId;
      return this;
    }

    public Builder tier(Tier tier) {
      scalars[Abi.RemovedEvent.TIER] = tier.code();
      return this;
    }

    public Builder blockHashes(long... blockHashes) {
      this.blockHashes = blockHashes;
      return this;
    }

    /**
     * The blocks left sliding-window group {@code group} (the engine's KV-cache group index), not
     * full attention, which keeps them ({@code KVR_REMOVED_SLIDING}, {@code sliding_group}).
     */
    public Builder sliding(long group) {
      scalars[Abi.RemovedEvent.FLAGS] |= Abi.REMOVED_SLIDING;
      scalars[Abi.RemovedEvent.SLIDING_GROUP] = group;
      return this;
    }

    /** A full-attention removal (the default): undoes {@link #sliding}. */
    public Builder fullAttention() {
      scalars[Abi.RemovedEvent.FLAGS] &= ~Abi.REMOVED_SLIDING;
      scalars[Abi.RemovedEvent.SLIDING_GROUP] = 0;
      return this;
    }

    public RemovedEvent build() {
      return new RemovedEvent(scalars.clone(), blockHashes);
    }
  }
}
