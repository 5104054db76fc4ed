package io.kvrouter.micrometer;

import io.kvrouter.EventKind;
import io.kvrouter.EventOutcome;
import io.kvrouter.Ingest;
import io.kvrouter.IngestReject;
import io.kvrouter.IngestStats;
import io.kvrouter.Metrics;
import io.kvrouter.Router;
import io.micrometer.core.instrument.FunctionCounter;
import io.micrometer.core.instrument.FunctionTimer;
import io.micrometer.core.instrument.Gauge;
import io.micrometer.core.instrument.MeterRegistry;
import io.micrometer.core.instrument.Tag;
import io.micrometer.core.instrument.Tags;
import io.micrometer.core.instrument.binder.BaseUnits;
import io.micrometer.core.instrument.binder.MeterBinder;
import java.util.ArrayList;
import java.util.List;
import java.util.Locale;
import java.util.Objects;
import java.util.concurrent.TimeUnit;
import java.util.function.ToDoubleFunction;
import java.util.function.ToLongFunction;

/**
 * A Micrometer {@link MeterBinder} over a {@link Router}'s metrics and, when given, an {@link
 * Ingest}'s counters: the series of the library's own Prometheus text ({@link
 * Router#metricsPrometheus()}) under Micrometer's naming convention, so that a Prometheus registry
 * exposes them under the same names ({@code kvrouter.decisions} is {@code kvrouter_decisions_total},
 * {@code kvrouter.kv.events} with tags {@code kind} and {@code outcome} is {@code
 * kvrouter_kv_events_total{kind,outcome}}, {@code kvrouter.requests.active} is {@code
 * kvrouter_requests_active}; hybrid models' sliding windows: {@code
 * kvrouter.sliding.window.events.applied} and {@code .rejected}, counters, and {@code
 * kvrouter.index.sliding.blocks}, a gauge).
 *
 * <pre>{@code
 * new KvRouterMetrics(router).ingest(ingest).bindTo(registry);
 * }</pre>
 *
 * <p>Counters are {@link FunctionCounter}s and levels {@link Gauge}s that read the router when the
 * registry asks (one {@code kvr_router_get_metrics} call per meter read, about a microsecond): there
 * is no polling thread and nothing to stop. As Micrometer's function meters do, they hold the
 * router and the ingest object weakly (the application holds them to use them); once either is
 * closed (or collected) its meters read NaN, and {@link MeterRegistry#remove} takes them away.
 *
 * <p>The decision-latency histogram, pre-aggregated by the library, is a FunctionTimer (count and
 * sum) and a cumulative FunctionCounter per bucket tagged {@code le} (see {@link
 * #bindDecisionLatency}).
 *
 * <p>Left out: the per-rank loads ({@code kvrouter_worker_active_*{worker_id,dp_rank}}), whose set
 * of series changes as workers come and go, which a binder registered once cannot follow; the
 * library's text ({@link Router#metricsPrometheus()}) has them.
 *
 * <p>Micrometer is an optional dependency of the kvrouter jar: this class is the only one that
 * needs it, and only an application that uses it loads it.
 */
public final class KvRouterMetrics implements MeterBinder {
  private final Router router;
  private final Tags tags;
  private Ingest ingest;
  private final List<Long> sources = new ArrayList<>();

  /** Meters over {@code router}'s metrics. */
  public KvRouterMetrics(Router router) {
    this(router, Tags.empty());
  }

  /** Meters over {@code router}'s metrics, every one with {@code tags} too (e.g. a router name). */
  public KvRouterMetrics(Router router, Iterable<Tag> tags) {
    this.router = Objects.requireNonNull(router, "router");
    this.tags = Tags.of(Objects.requireNonNull(tags, "tags"));
  }

  /**
   * Also the counters of {@code ingest}'s sources ({@code kvrouter.ingest.*}): one series per
   * source id given (what {@link Ingest#listen}, {@link Ingest#addEngineWorker}, {@link
   * Ingest#subscribeNats} returned), tagged {@code source_id} and {@code endpoint} (its {@link
   * Ingest#sourceEndpoint}); with no id, one series summed over every source, tagged {@code
   * source_id="0"} (the library's id for the sum) and an empty {@code endpoint}. Sources added
   * later need a binder of their own (or {@link Ingest#metricsPrometheus()}, which has them all).
   */
  public KvRouterMetrics ingest(Ingest ingest, long... sourceIds) {
    this.ingest = Objects.requireNonNull(ingest, "ingest");
    sources.clear();
    for (long id : sourceIds) sources.add(id);
    return this;
  }

  @Override
  public void bindTo(MeterRegistry registry) {
    bindRouter(registry);
    if (ingest == null) return;
    if (sources.isEmpty()) {
      bindIngest(registry, 0, Tags.of("source_id", "0", "endpoint", ""));
    }
    for (long id : sources) {
      bindIngest(
          registry,
          id,
          Tags.of("source_id", Long.toUnsignedString(id), "endpoint", ingest.sourceEndpoint(id)));
    }
  }

  // ---- the router

  /** A value of the router's metrics, or NaN once the router is closed. */
  private static double read(Router router, ToLongFunction<Metrics> field) {
    try {
      return field.applyAsLong(router.metrics());
    } catch (IllegalStateException closed) {
      return Double.NaN;
    }
  }

  private void counter(
      MeterRegistry registry, String name, String help, Tags extra, ToLongFunction<Metrics> field) {
    FunctionCounter.builder(name, router, r -> read(r, field))
        .description(help)
        .tags(tags.and(extra))
        .register(registry);
  }

  private void gauge(
      MeterRegistry registry,
      String name,
      String unit,
      String help,
      ToLongFunction<Metrics> field) {
    Gauge.builder(name, router, (ToDoubleFunction<Router>) r -> read(r, field))
        .description(help)
        .baseUnit(unit)
        .tags(tags)
        .register(registry);
  }

  private void bindRouter(MeterRegistry registry) {
    for (EventKind kind : EventKind.values()) {
      for (EventOutcome outcome : EventOutcome.values()) {
        counter(
            registry,
            "kvrouter.kv.events",
            "KV events by kind and outcome (ok, or the reason they were rejected).",
            Tags.of("kind", label(kind), "outcome", label(outcome)),
            m -> m.events(kind, outcome));
      }
    }
    counter(
        registry,
        "kvrouter.event.batches.rejected",
        "Event batches that failed verification; nothing of them was applied.",
        Tags.empty(),
        Metrics::eventBatchesRejected);
    counter(
        registry,
        "kvrouter.decisions",
        "Routing decisions made.",
        Tags.empty(),
        Metrics::decisions);
    gauge(
        registry,
        "kvrouter.requests.active",
        null,
        "Requests booked and not yet freed.",
        Metrics::requestsActive);
    gauge(
        registry,
        "kvrouter.queue.pending.requests",
        null,
        "Requests waiting for admission.",
        Metrics::queuePending);
    gauge(
        registry,
        "kvrouter.queue.pending.tokens",
        null,
        "Prompt tokens of the requests waiting.",
        Metrics::queuePendingTokens);
    gauge(registry, "kvrouter.workers", null, "Registered workers.", Metrics::workers);
    gauge(
        registry,
        "kvrouter.index.nodes",
        null,
        "Radix tree nodes in the KV index (each a run of blocks held alike).",
        Metrics::indexNodes);
    gauge(
        registry,
        "kvrouter.index.blocks",
        null,
        "Cached (block, worker rank) entries in the KV index.",
        Metrics::indexBlocks);
    gauge(
        registry,
        "kvrouter.index.bytes",
        BaseUnits.BYTES,
        "Heap bytes held by the KV index.",
        Metrics::indexBytes);
    gauge(
        registry,
        "kvrouter.index.sliding.blocks",
        null,
        "(sliding-window group, block) entries of hybrid models' worker ranks.",
        Metrics::indexSlidingBlocks);
    counter(
        registry,
        "kvrouter.replica.changes.applied",
        "Booking changes of other router replicas applied here.",
        Tags.empty(),
        Metrics::replicaChangesApplied);
    counter(
        registry,
        "kvrouter.replica.changes.rejected",
        "Booking changes of other router replicas rejected (undecodable, unknown worker rank, "
            + "duplicate booking).",
        Tags.empty(),
        Metrics::replicaChangesRejected);
    gauge(
        registry,
        "kvrouter.replica.requests.active",
        null,
        "Requests booked by other router replicas, counted as load here.",
        Metrics::replicaRequestsActive);
    gauge(
        registry,
        "kvrouter.replicas.live",
        null,
        "Other router replicas sending heartbeats and not expired.",
        Metrics::replicasLive);
    counter(
        registry,
        "kvrouter.replicas.expired",
        "Other router replicas whose bookings were dropped here because they fell silent.",
        Tags.empty(),
        Metrics::replicasExpired);
    counter(
        registry,
        "kvrouter.events.refused.for.memory",
        "KV events the index could not apply for want of memory (a rank refused midway is left"
            + " holding nothing).",
        Tags.empty(),
        Metrics::eventsRefusedForMemory);
    counter(
        registry,
        "kvrouter.replica.changes.unpublished",
        "Own booking changes the replica publisher lost for want of memory or its transport "
            + "refused (each repaired by announcing every booking again).",
        Tags.empty(),
        Metrics::replicaChangesUnpublished);
    counter(
        registry,
        "kvrouter.decisions.priced.again",
        "Routing decisions decided again under the router's lock because another call changed"
            + " what they priced outside it.",
        Tags.empty(),
        Metrics::decisionsPricedAgain);
    counter(
        registry,
        "kvrouter.sliding.window.events.applied",
        "Sliding-window KV events (hybrid models) applied.",
        Tags.empty(),
        Metrics::slidingEventsApplied);
    counter(
        registry,
        "kvrouter.sliding.window.events.rejected",
        "Sliding-window KV events (hybrid models) rejected, whole or in part.",
        Tags.empty(),
        Metrics::slidingEventsRejected);
    bindDecisionLatency(registry);
  }

  /**
   * The decision-latency histogram, pre-aggregated by the library, which Micrometer has no meter
   * for (its histograms are of values it records itself): a FunctionTimer for the count and the
   * sum ({@code kvrouter.decision.duration}: Prometheus {@code
   * kvrouter_decision_duration_seconds_count} and {@code _sum}, as in the library's text), and
   * a FunctionCounter per bucket with the {@code le} tag as the library's text spells it, the
   * last one {@code +Inf} ({@code kvrouter.decision.duration.buckets}: Prometheus {@code
   * kvrouter_decision_duration_buckets_total{le}}, cumulative, which {@code histogram_quantile}
   * reads as it reads {@code _bucket} series).
   */
  private void bindDecisionLatency(MeterRegistry registry) {
    FunctionTimer.builder(
            "kvrouter.decision.duration",
            router,
            r -> (long) read(r, Metrics::decisionLatencyCount),
            r -> read(r, Metrics::decisionLatencySumNanos),
            TimeUnit.NANOSECONDS)
        .description(
            "Time from a routing call's start to its decision (queued requests excluded).")
        .tags(tags)
        .register(registry);
    long[] bounds = router.metrics().decisionLatencyBoundsNanos(); // fixed by the library
    for (int i = 0; i <= bounds.length; ++i) {
      int bucket = i;
      String le = i == bounds.length ? "+Inf" : formatG(bounds[i] / 1e9);
      counter(
          registry,
          "kvrouter.decision.duration.buckets",
          "Routing calls that decided within le seconds (cumulative).",
          Tags.of("le", le),
          m -> bucket == bounds.length ? m.decisionLatencyCount() : m.decisionLatencyBuckets()[bucket]);
    }
  }

  /** A positive number as C's printf %g writes it (6 significant digits, no trailing zeros). */
  static String formatG(double v) {
    if (v == 0) return "0";
    String e = String.format(Locale.ROOT, "%.5e", v); // d.ddddde[+-]XX
    int exponent = Integer.parseInt(e.substring(e.indexOf('e') + 1));
    if (exponent < -4 || exponent >= 6) {
      String mantissa = stripZeros(e.substring(0, e.indexOf('e')));
      return mantissa + "e" + (exponent < 0 ? "-" : "+") + String.format(Locale.ROOT, "%02d", Math.abs(exponent));
    }
    return stripZeros(String.format(Locale.ROOT, "%." + (5 - exponent) + "f", v));
  }

  private static String stripZeros(String s) {
    if (s.indexOf('.') < 0) return s;
    s = s.replaceAll("0+$", "");
    return s.endsWith(".") ? s.substring(0, s.length() - 1) : s;
  }

  // ---- the ingest object

  /** A value of one source's counters, or NaN once the ingest object is closed. */
  private static double read(Ingest ingest, long source, ToDoubleFunction<IngestStats> field) {
    try {
      return field.applyAsDouble(ingest.stats(source));
    } catch (IllegalStateException closed) {
      return Double.NaN;
    }
  }

  private void bindIngest(MeterRegistry registry, long source, Tags sourceTags) {
    Tags t = tags.and(sourceTags);
    Ingest in = ingest;
    class Counters {
      void counter(String name, String help, Tags extra, ToLongFunction<IngestStats> field) {
        FunctionCounter.builder(name, in, i -> read(i, source, s -> field.applyAsLong(s)))
            .description(help)
            .tags(t.and(extra))
                .register(registry);
      }

      void gauge(String name, String unit, String help, ToDoubleFunction<IngestStats> field) {
        Gauge.builder(name, in, (ToDoubleFunction<Ingest>) i -> read(i, source, field))
            .description(help)
            .baseUnit(unit)
            .tags(t)
                .register(registry);
      }
    }
    Counters c = new Counters();
    c.counter(
        "kvrouter.ingest.messages",
        "Frames or messages received.",
        Tags.empty(),
        IngestStats::messages);
    c.counter(
        "kvrouter.ingest.events.applied",
        "KV events applied to the router.",
        Tags.empty(),
        IngestStats::eventsApplied);
    for (IngestReject reason : IngestReject.values()) {
      c.counter(
          "kvrouter.ingest.rejected",
          "Messages or events rejected, by reason.",
          Tags.of("reason", label(reason)),
          s -> s.rejected(reason));
    }
    c.counter("kvrouter.ingest.gaps", "Sequence jumps forward.", Tags.empty(), IngestStats::gaps);
    c.counter(
        "kvrouter.ingest.missed.messages",
        "Messages lost in sequence gaps.",
        Tags.empty(),
        IngestStats::missedMessages);
    c.counter(
        "kvrouter.ingest.restarts",
        "Publisher sequence resets to 0.",
        Tags.empty(),
        IngestStats::restarts);
    c.counter(
        "kvrouter.ingest.recoveries",
        "Worker states cleared or replayed because they were lost.",
        Tags.empty(),
        IngestStats::recoveries);
    c.counter(
        "kvrouter.ingest.connections",
        "Stream connections accepted; NATS connections and reconnections.",
        Tags.empty(),
        IngestStats::connections);
    c.gauge(
        "kvrouter.ingest.stream.sequence",
        null,
        "JetStream: the stream sequence of the last message applied (0 for other sources).",
        IngestStats::streamSequence);
    c.counter(
        "kvrouter.ingest.consumer.remakes",
        "JetStream: the consumer made again because deliveries were lost on the way; NATS: the "
            + "connection made again after the client gave it up.",
        Tags.empty(),
        IngestStats::consumerRemakes);
    c.counter(
        "kvrouter.ingest.consumer.remake.failures",
        "Attempts to make a JetStream consumer or a NATS connection again that failed.",
        Tags.empty(),
        IngestStats::consumerRemakeFailures);
    c.counter(
        "kvrouter.ingest.events.ignored",
        "Engine events of KV-cache groups neither full attention nor a sized sliding window"
            + " (hybrid models), not indexed by design.",
        Tags.empty(),
        IngestStats::eventsIgnored);
    c.gauge(
        "kvrouter.ingest.state.unknown.ranks",
        null,
        "Worker ranks whose state was lost (a gap) and not yet re-established.",
        IngestStats::stateUnknown);
    c.counter(
        "kvrouter.ingest.published",
        "Replica sync: booking changes published.",
        Tags.empty(),
        IngestStats::published);
    c.counter(
        "kvrouter.ingest.publish.failures",
        "Replica sync: publications the NATS client refused.",
        Tags.empty(),
        IngestStats::publishFailures);
    c.counter(
        "kvrouter.ingest.bookings.trimmed",
        "Replica sync: publications of a booking with only its leading block ids (the"
            + " transport's messages too short for them all).",
        Tags.empty(),
        IngestStats::bookingsTrimmed);
    // The lag: a count and a sum, which is what a FunctionTimer reads (Prometheus:
    // kvrouter_ingest_lag_seconds_count and _sum), and its largest and most recent values.
    FunctionTimer.builder(
            "kvrouter.ingest.lag",
            in,
            i -> (long) read(i, source, IngestStats::lagSamples),
            i -> read(i, source, IngestStats::lagTotalMicros),
            TimeUnit.MICROSECONDS)
        .description("From a message's publication to its events applied.")
        .tags(t)
        .register(registry);
    c.gauge(
        "kvrouter.ingest.lag.max",
        "seconds",
        "The largest lag measured.",
        s -> s.lagMaxMicros() / 1e6);
    c.gauge(
        "kvrouter.ingest.lag.last",
        "seconds",
        "The most recent message's lag.",
        s -> s.lagLastMicros() / 1e6);
  }

  /** An enum constant as the library's text spells it (stored, parent_block_not_found, ...). */
  private static String label(Enum<?> value) {
    return value.name().toLowerCase(Locale.ROOT);
  }
}
