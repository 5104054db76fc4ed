package io.kvrouter;

/** A router's counters at one moment ({@code kvr_metrics}). */
public final class Metrics {
  private static final int KINDS = EventKind.values().length;
  private static final int OUTCOMES = EventOutcome.values().length;

  private final long[] a; // Native.METRICS_LEN

  Metrics(long[] encoded) {
    this.a = encoded;
  }

  /** Events of a kind applied ({@link EventOutcome#OK}) or rejected for a reason. */
  public long events(EventKind kind, EventOutcome outcome) {
    return a[kind.ordinal() * OUTCOMES + outcome.ordinal()];
  }

  /** Events of a kind rejected for any reason. */
  public long eventsRejected(EventKind kind) {
    long sum = 0;
    for (int o = 1; o < OUTCOMES; ++o) sum += a[kind.ordinal() * OUTCOMES + o];
    return sum;
  }

  private long at(int field) {
    return a[KINDS * OUTCOMES + field];
  }

  /** Event batches that failed verification. */
  public long eventBatchesRejected() {
    return at(0);
  }

  /** Routing calls that picked a worker. */
  public long decisions() {
    return at(1);
  }

  public long requestsActive() {
    return at(2);
  }

  public long queuePending() {
    return at(3);
  }

  public long queuePendingTokens() {
    return at(4);
  }

  public long workers() {
    return at(5);
  }

  public long indexNodes() {
    return at(6);
  }

  /** Cached (block, rank) entries. */
  public long indexBlocks() {
    return at(7);
  }

  public long indexBytes() {
    return at(8);
  }

  /** Other replicas' booking changes applied here. */
  public long replicaChangesApplied() {
    return at(9);
  }

  /** Other replicas' booking changes refused (undecodable, unknown rank, duplicate). */
  public long replicaChangesRejected() {
    return at(10);
  }

  /** Of {@link #requestsActive()}, those booked by other replicas. */
  public long replicaRequestsActive() {
    return at(11);
  }

  @Override
  public String toString() {
    return "Metrics{decisions="
        + decisions()
        + ", requestsActive="
        + requestsActive()
        + ", queuePending="
        + queuePending()
        + ", workers="
        + workers()
        + ", indexBlocks="
        + indexBlocks()
        + ", storedOk="
        + events(EventKind.STORED, EventOutcome.OK)
        + "}";
  }
}
