package io.kvrouter;

/**
 * The counters of one ingest source, or of every source together ({@code kvr_ingest_stats}). For
 * every source together (id 0): sums, and the maximum lag.
 */
public final class IngestStats {
  private final long[] a; // kvr_ingest_stats in the slots of Abi.IngestStats
  private static final int LAST_REJECT_CHARS = 128;

  IngestStats(long[] encoded) {
    this.a = encoded;
  }

  /** Ranks whose state was lost (a gap) and not yet re-established. */
  public int stateUnknown() {
    return (int) a[Abi.IngestStats.STATE_UNKNOWN];
  }

  /** Frames or messages received. */
  public long messages() {
    return a[Abi.IngestStats.MESSAGES];
  }

  public long eventsApplied() {
    return a[Abi.IngestStats.EVENTS_APPLIED];
  }

  /** Messages or events rejected for one reason. */
  public long rejected(IngestReject reason) {
    return a[Abi.IngestStats.REJECTED + reason.code()];
  }

  /** Rejections summed over every reason (those newer than this binding too). */
  public long rejectedTotal() {
    long sum = 0;
    for (int i = 0; i < Abi.INGEST_REJECT_REASONS; ++i) sum += a[Abi.IngestStats.REJECTED + i];
    return sum;
  }

  /** Sequence jumps forward. */
  public long gaps() {
    return a[Abi.IngestStats.GAPS];
  }

  /** Messages lost in those jumps. */
  public long missedMessages() {
    return a[Abi.IngestStats.MISSED_MESSAGES];
  }

  /** Publisher sequence resets to 0. */
  public long restarts() {
    return a[Abi.IngestStats.RESTARTS];
  }

  /** Worker states cleared or replayed because they were lost. */
  public long recoveries() {
    return a[Abi.IngestStats.RECOVERIES];
  }

  /** Stream connections accepted; NATS connections and reconnections. */
  public long connections() {
    return a[Abi.IngestStats.CONNECTIONS];
  }

  /** Messages whose lag (publication to events applied) was measured. */
  public long lagSamples() {
    return a[Abi.IngestStats.LAG_SAMPLES];
  }

  /** Their lags summed, in microseconds. */
  public long lagTotalMicros() {
    return a[Abi.IngestStats.LAG_TOTAL_US];
  }

  /** The largest lag, in microseconds. */
  public long lagMaxMicros() {
    return a[Abi.IngestStats.LAG_MAX_US];
  }

  /** The most recent message's lag, in microseconds. */
  public long lagLastMicros() {
    return a[Abi.IngestStats.LAG_LAST_US];
  }

  /**
   * Replica sync ({@link Ingest#syncReplicas}): changes published, including the Reset, Added
   * and SyncRequest messages that announce the router when the sync starts and those answering
   * other replicas' SyncRequests.
   */
  public long published() {
    return a[Abi.IngestStats.PUBLISHED];
  }

  /** Replica sync: changes the NATS client refused to publish. */
  public long publishFailures() {
    return a[Abi.IngestStats.PUBLISH_FAILURES];
  }

  /**
   * The most recent reject's reason in words (e.g. "event 1: unknown event tag 'X'"), empty if none
   * was given; for every source together, the most recent of them all.
   */
  public String lastReject() {
    // kvr_ingest_stats.last_reject[128] (fields appended after it: not LEN - LAST_REJECT).
    byte[] bytes = new byte[LAST_REJECT_CHARS];
    int n = 0;
    while (n < bytes.length && a[Abi.IngestStats.LAST_REJECT + n] != 0) {
      bytes[n] = (byte) a[Abi.IngestStats.LAST_REJECT + n];
      ++n;
    }
    return new String(bytes, 0, n, java.nio.charset.StandardCharsets.UTF_8);
  }

  /**
   * A JetStream source's ({@link Ingest#subscribeJetStream}) last stream sequence applied (and
   * acknowledged); for every source together, the largest; 0 for other sources.
   */
  public long streamSequence() {
    return a[Abi.IngestStats.STREAM_SEQUENCE];
  }

  /**
   * A JetStream source's consumer made again because deliveries were lost on the way (they come
   * again, in order, from the new consumer), or a core NATS, replica sync or JetStream relay
   * source's connection made again after the NATS client gave it up (a server's error); for
   * every source together, the sum; 0 for other sources.
   */
  public long consumerRemakes() {
    return a[Abi.IngestStats.CONSUMER_REMAKES];
  }

  /**
   * A JetStream source's attempts to make its consumer (or a NATS source's its connection) again
   * that failed and were retried; for every source together, the sum.
   */
  public long consumerRemakeFailures() {
    return a[Abi.IngestStats.CONSUMER_REMAKE_FAILURES];
  }

  /**
   * Engine events no router indexes, by design: those of a KV-cache group neither full attention
   * nor a sliding window whose size the engine said (a hybrid model's Mamba layers; sliding
   * windows limit a rank's hit). Not rejects: the rest of their batch applies. For every source together, the sum.
   */
  public long eventsIgnored() {
    return a[Abi.IngestStats.EVENTS_IGNORED];
  }

  /**
   * Replica sync ({@link Ingest#syncReplicas}): publications of a booking with only its leading
   * block ids, the NATS server's messages (its max_payload) too short for them all, or the
   * connection reconnecting (3,584 bytes then); a booking announced again counts again. Peers
   * count those bookings' prefix blocks only. For every source together, the sum.
   */
  public long bookingsTrimmed() {
    return a[Abi.IngestStats.BOOKINGS_TRIMMED];
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
