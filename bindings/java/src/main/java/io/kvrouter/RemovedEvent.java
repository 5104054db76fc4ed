package io.kvrouter;

import java.util.Objects;

/**
 * Blocks one worker rank evicted, named by the engine's hashes ({@code kvr_removed_event}). The
 * hash array is not copied.
 */
public final class RemovedEvent {
  // Read by the JNI glue: keep the names and types.
  final long[] scalars; // dp_rank, worker_id, event_id, tier
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
    return new Builder(Native.defaults(Native.DEFAULTS_REMOVED_EVENT, Native.REMOVED_EVENT_LEN))
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

    public Builder blockHashes(long... blockHashes) {
      this.blockHashes = blockHashes;
      return this;
    }

    public RemovedEvent build() {
      return new RemovedEvent(scalars.clone(), blockHashes);
    }
  }
}
