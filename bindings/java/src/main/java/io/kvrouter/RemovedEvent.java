package io.kvrouter;

import java.util.Objects;

/**
 * Blocks one worker rank evicted, named by the engine's hashes ({@code kvr_removed_event}). The
 * hash array is not copied.
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

    public RemovedEvent build() {
      return new RemovedEvent(scalars.clone(), blockHashes);
    }
  }
}
