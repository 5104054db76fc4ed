package io.kvrouter;

/** A router's counters at one moment ({@code kvr_metrics}). */
public final class Metrics {
  private final long[] a; // kvr_metrics in the slots of Abi.Metrics

  Metrics(long[] encoded) {
    this.a = encoded;
  }

  /** The slot of events[kind][outcome] (row by row). */
  private static int event(int kind, int outcome) {
    return Abi.Metrics.EVENTS + kind * Abi.EVENT_OUTCOMES + outcome;
  }

  /** Events of a kind applied ({@link EventOutcome#OK}) or rejected for a reason. */
  public long events(EventKind kind, EventOutcome outcome) {
    return a[event(kind.code(), outcome.code())];
  }

  /** Events of a kind rejected for any reason. */
  public long eventsRejected(EventKind kind) {
    long sum = 0;
    for (int o = 0; o < Abi.EVENT_OUTCOMES; ++o) {
      if (o != EventOutcome.OK.code()) sum += a[event(kind.code(), o)];
    }
    return sum;
  }

  /** Event batches that failed verification. */
  public long eventBatchesRejected() {
    return a[Abi.Metrics.EVENT_BATCHES_REJECTED];
  }

  /** Routing calls that picked a worker. */
  public long decisions() {
    return a[Abi.Metrics.DECISIONS];
  }

  public long requestsActive() {
    return a[Abi.Metrics.REQUESTS_ACTIVE];
  }

  public long queuePending() {
    return a[Abi.Metrics.QUEUE_PENDING];
  }

  public long queuePendingTokens() {
    return a[Abi.Metrics.QUEUE_PENDING_TOKENS];
  }

  public long workers() {
    return a[Abi.Metrics.WORKERS];
  }

  public long indexNodes() {
    return a[Abi.Metrics.INDEX_NODES];
  }

  /** Cached (block, rank) entries. */
  public long indexBlocks() {
    return a[Abi.Metrics.INDEX_BLOCKS];
  }

  public long indexBytes() {
    return a[Abi.Metrics.INDEX_BYTES];
  }

  /** Other replicas' booking changes applied here. */
  public long replicaChangesApplied() {
    return a[Abi.Metrics.REPLICA_CHANGES_APPLIED];
  }

  /** Other replicas' booking changes refused (undecodable, unknown rank, duplicate). */
  public long replicaChangesRejected() {
    return a[Abi.Metrics.REPLICA_CHANGES_REJECTED];
  }

  /** Of {@link #requestsActive()}, those booked by other replicas. */
  public long replicaRequestsActive() {
    return a[Abi.Metrics.REPLICA_REQUESTS_ACTIVE];
  }

  /** Other replicas heard sending heartbeats and not expired. */
  public long replicasLive() {
    return a[Abi.Metrics.REPLICAS_LIVE];
  }

  /** Replicas whose bookings {@link Router#expireReplicas} dropped because they fell silent. */
  public long replicasExpired() {
    return a[Abi.Metrics.REPLICAS_EXPIRED];
  }

  /**
   * KV events the index could not apply for want of memory (a {@link KvRouterException} with
   * {@code RESOURCE_EXHAUSTED}), before they changed anything or midway, the rank then left
   * holding nothing; 0 in approximate mode, which takes no events.
   */
  public long eventsRefusedForMemory() {
    return a[Abi.Metrics.EVENTS_REFUSED_FOR_MEMORY];
  }

  /**
   * This router's own booking changes its replica publisher lost for want of memory or its
   * transport refused (the booking stands; each loss is repaired by announcing every booking
   * again).
   */
  public long replicaChangesUnpublished() {
    return a[Abi.Metrics.REPLICA_CHANGES_UNPUBLISHED];
  }

  /**
   * Routing decisions decided a second time: priced outside the router's lock while another call
   * changed what they priced (the chosen rank's load, the queue, the session's binding), then
   * decided again under it. Such a change comes from another thread (another routing call, a
   * release, another replica's booking); 0 while nothing else calls the router. What concurrent
   * callers cost each other.
   */
  public long decisionsPricedAgain() {
    return a[Abi.Metrics.DECISIONS_PRICED_AGAIN];
  }

  /**
   * Events of hybrid models' sliding-window KV-cache groups applied (their stores and removals:
   * docs/ingest.md, "Sliding windows"); 0 for models without such groups.
   */
  public long slidingEventsApplied() {
    return a[Abi.Metrics.SLIDING_EVENTS_APPLIED];
  }

  /**
   * Sliding-window events rejected, whole or in part: a stored block the rank does not hold in
   * full attention, a removed block the group lacks, a window of 0, a tier other than the device.
   */
  public long slidingEventsRejected() {
    return a[Abi.Metrics.SLIDING_EVENTS_REJECTED];
  }

  /**
   * (sliding-window group, block) entries held over every rank: what hybrid models' windows hold
   * beside {@link #indexBlocks()}; 0 for models without such groups.
   */
  public long indexSlidingBlocks() {
    return a[Abi.Metrics.INDEX_SLIDING_BLOCKS];
  }

  /** The number of buckets of the decision-latency histogram ({@code KVR_DECISION_LATENCY_BUCKETS}). */
  public static final int DECISION_LATENCY_BUCKETS = Abi.DECISION_LATENCY_BUCKETS;

  /**
   * The upper bounds of the decision-latency histogram's buckets, in nanoseconds, rising (the
   * library's choice; the +Inf bucket is {@link #decisionLatencyCount()}).
   */
  public long[] decisionLatencyBoundsNanos() {
    long[] b = new long[DECISION_LATENCY_BUCKETS];
    System.arraycopy(a, Abi.Metrics.DECISION_LATENCY_BOUNDS_NS, b, 0, b.length);
    return b;
  }

  /**
   * The decision-latency histogram's cumulative bucket counts: element i counts the routing calls
   * (routes, plans and previews answered without queueing) that took at most {@code
   * decisionLatencyBoundsNanos()[i]}.
   */
  public long[] decisionLatencyBuckets() {
    long[] b = new long[DECISION_LATENCY_BUCKETS];
    System.arraycopy(a, Abi.Metrics.DECISION_LATENCY_LE, b, 0, b.length);
    return b;
  }

  /** Routing calls measured by the decision-latency histogram (its +Inf bucket). */
  public long decisionLatencyCount() {
    return a[Abi.Metrics.DECISION_LATENCY_COUNT];
  }

  /** Their decision latencies summed, in nanoseconds. */
  public long decisionLatencySumNanos() {
    return a[Abi.Metrics.DECISION_LATENCY_SUM_NS];
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
