package io.kvrouter;

/**
 * The counters of one ingest source, or of every source together ({@code kvr_ingest_stats}). For
 * every source together (id 0): sums, and the maximum lag.
 */
public final class IngestStats {
  private static final int REASONS = 8; // KVR_INGEST_REJECT_REASONS

  private final long[] a; // Native.INGEST_STATS_LEN

  IngestStats(long[] encoded) {
    this.a = encoded;
  }

  /** Ranks whose state was lost (a gap) and not yet re-established. */
  public int stateUnknown() {
    return (int) a[0];
  }

  /** Frames or messages received. */
  public long messages() {
    return a[1];
  }

  public long eventsApplied() {
    return a[2];
  }

  /** Messages or events rejected for one reason. */
  public long rejected(IngestReject reason) {
    return a[3 + reason.ordinal()];
  }

  /** Rejections summed over every reason. */
  public long rejectedTotal() {
    long sum = 0;
    for (int i = 0; i < REASONS; ++i) sum += a[3 + i];
    return sum;
  }

  /** Sequence jumps forward. */
  public long gaps() {
    return a[3 + REASONS];
  }

  /** Messages lost in those jumps. */
  public long missedMessages() {
    return a[4 + REASONS];
  }

  /** Publisher sequence resets to 0. */
  public long restarts() {
    return a[5 + REASONS];
  }

  /** Worker states cleared or replayed because they were lost. */
  public long recoveries() {
    return a[6 + REASONS];
  }

  /** Stream connections accepted; NATS connections and reconnections. */
  public long connections() {
    return a[7 + REASONS];
  }

  /** Messages whose lag (publication to events applied) was measured. */
  public long lagSamples() {
    return a[8 + REASONS];
  }

  /** Their lags summed, in microseconds. */
  public long lagTotalMicros() {
    return a[9 + REASONS];
  }

  /** The largest lag, in microseconds. */
  public long lagMaxMicros() {
    return a[10 + REASONS];
  }

  /** The most recent message's lag, in microseconds. */
  public long lagLastMicros() {
    return a[11 + REASONS];
  }

  /**
   * Replica sync ({@link Ingest#syncReplicas}): changes published, including the Reset, Added
   * and SyncRequest messages that announce the router when the sync starts and those answering
   * other replicas' SyncRequests.
   */
  public long published() {
    return a[12 + REASONS];
  }

  /** Replica sync: changes the NATS client refused to publish. */
  public long publishFailures() {
    return a[13 + REASONS];
  }

  /** The mean lag in microseconds, or NaN without samples. */
  public double lagMeanMicros() {
    return lagSamples() == 0 ? Double.NaN : (double) lagTotalMicros() / lagSamples();
  }

  @Override
  public String toString() {
    return "IngestStats{messages="
        + messages()
        + ", eventsApplied="
        + eventsApplied()
        + ", rejected="
        + rejectedTotal()
        + ", gaps="
        + gaps()
        + ", connections="
        + connections()
        + ", lagSamples="
        + lagSamples()
        + "}";
  }
}
