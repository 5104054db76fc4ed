package io.kvrouter.micrometer;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.kvrouter.EventBatch;
import io.kvrouter.Ingest;
import io.kvrouter.IngestReject;
import io.kvrouter.KvRouterException;
import io.kvrouter.Listener;
import io.kvrouter.Metrics;
import io.kvrouter.Publisher;
import io.kvrouter.RequestOptions;
import io.kvrouter.Router;
import io.kvrouter.RouterOptions;
import io.kvrouter.StoredEvent;
import io.micrometer.core.instrument.FunctionCounter;
import io.micrometer.core.instrument.FunctionTimer;
import io.micrometer.core.instrument.Gauge;
import io.micrometer.core.instrument.Tags;
import io.micrometer.core.instrument.simple.SimpleMeterRegistry;
import io.micrometer.prometheusmetrics.PrometheusConfig;
import io.micrometer.prometheusmetrics.PrometheusMeterRegistry;
import java.util.Arrays;
import java.util.TreeSet;
import java.util.concurrent.TimeUnit;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import org.junit.jupiter.api.Test;

/** The Micrometer binder: its meters follow the router and the ingest object. */
class KvRouterMetricsTest {
  private static final int BLOCK = 16;

  private static int[] tokens(int n, int base) {
    int[] t = new int[n];
    for (int i = 0; i < n; ++i) t[i] = base + i;
    return t;
  }

  private static Router router() {
    Router router = new Router(RouterOptions.builder().blockSize(BLOCK).build());
    router.addWorker(1);
    router.addWorker(2);
    return router;
  }

  private static double counter(SimpleMeterRegistry registry, String name, String... tags) {
    return registry.get(name).tags(tags).functionCounter().count();
  }

  private static double gauge(SimpleMeterRegistry registry, String name, String... tags) {
    return registry.get(name).tags(tags).gauge().value();
  }

  @Test
  void routerMetersFollowTheRouter() {
    SimpleMeterRegistry registry = new SimpleMeterRegistry();
    try (Router router = router()) {
      new KvRouterMetrics(router, Tags.of("router", "main")).bindTo(registry);
      assertEquals(2.0, gauge(registry, "kvrouter.workers", "router", "main"));
      assertEquals(0.0, counter(registry, "kvrouter.decisions"));

      int[] prompt = tokens(64, 100);
      router.applyStored(
          StoredEvent.builder(2)
              .blockHashes(11, 12)
              .tokenIds(Arrays.copyOf(prompt, 2 * BLOCK))
              .build());
      StoredEvent orphan = // an unknown parent: rejected, and counted
          StoredEvent.builder(1).parentHash(999).blockHashes(21).tokenIds(tokens(BLOCK, 7)).build();
      assertThrows(KvRouterException.class, () -> router.applyStored(orphan));
      assertEquals(1.0, counter(registry, "kvrouter.kv.events", "kind", "stored", "outcome", "ok"));
      assertEquals(
          1.0,
          counter(
              registry, "kvrouter.kv.events", "kind", "stored", "outcome", "parent_block_not_found"));
      assertEquals(2.0, gauge(registry, "kvrouter.index.blocks"));
      assertTrue(gauge(registry, "kvrouter.index.bytes") > 0);
      assertEquals(0.0, counter(registry, "kvrouter.events.refused.for.memory"));
      assertEquals(0.0, counter(registry, "kvrouter.replica.changes.unpublished"));
      assertEquals(0.0, counter(registry, "kvrouter.decisions.priced.again"));
      assertEquals(0.0, counter(registry, "kvrouter.sliding.window.events.applied"));
      assertEquals(0.0, counter(registry, "kvrouter.sliding.window.events.rejected"));
      assertEquals(0.0, gauge(registry, "kvrouter.index.sliding.blocks"));

      assertEquals(2, router.findBestMatch(prompt, RequestOptions.admit("r1")).workerId());
      router.findBestMatch(prompt, RequestOptions.admit("r2"));
      assertEquals(2.0, counter(registry, "kvrouter.decisions"));
      assertEquals(2.0, gauge(registry, "kvrouter.requests.active"));
      router.freeRequest("r1");
      router.freeRequest("r2");
      assertEquals(0.0, gauge(registry, "kvrouter.requests.active"));
      assertEquals(2.0, counter(registry, "kvrouter.decisions"));

      // Every meter carries the binder's tags; 3 kinds x 5 outcomes of events.
      assertEquals(15, registry.get("kvrouter.kv.events").tag("router", "main").meters().size());
    }
    // A closed router reads NaN, not an exception.
    assertTrue(Double.isNaN(gauge(registry, "kvrouter.workers")));
  }

  /** Under a Prometheus registry the names are those of the library's own text. */
  @Test
  void prometheusNamesAreTheLibrarys() {
    PrometheusMeterRegistry registry = new PrometheusMeterRegistry(PrometheusConfig.DEFAULT);
    try (Router router = router()) {
      new KvRouterMetrics(router).bindTo(registry);
      router.findBestMatch(tokens(32, 5));
      String ours = registry.scrape();
      assertTrue(ours.contains("kvrouter_decisions_total 1.0"), ours);
      TreeSet<String> missing = new TreeSet<>();
      TreeSet<String> library = names(router.metricsPrometheus());
      // The per-rank loads are left out (see the class's documentation).
      library.removeIf(n -> n.startsWith("kvrouter_worker_"));
      for (String name : library) {
        if (!names(ours).contains(name)) missing.add(name);
      }
      assertEquals(new TreeSet<String>(), missing, ours);
    }
  }

  private static TreeSet<String> names(String text) {
    TreeSet<String> names = new TreeSet<>();
    Matcher m = Pattern.compile("(?m)^# TYPE (\\S+) ").matcher(text);
    while (m.find()) names.add(m.group(1));
    // The text format names a counter family without _total; the samples carry it.
    Matcher s = Pattern.compile("(?m)^([a-z_]+_total)[{ ]").matcher(text);
    while (s.find()) names.add(s.group(1));
    names.removeIf(n -> !n.endsWith("_total") && names.contains(n + "_total"));
    return names;
  }

  @Test
  void ingestMetersCountPerSourceAndInTotal() throws Exception {
    SimpleMeterRegistry perSource = new SimpleMeterRegistry();
    SimpleMeterRegistry summed = new SimpleMeterRegistry();
    try (Router router = router();
        Ingest ingest = new Ingest(router)) {
      Listener listener = ingest.listen("tcp://127.0.0.1:0");
      ingest.start();
      new KvRouterMetrics(router).ingest(ingest, listener.sourceId()).bindTo(perSource);
      new KvRouterMetrics(router).ingest(ingest).bindTo(summed);
      String source = Long.toString(listener.sourceId());
      try (Publisher publisher = Publisher.connect(listener.endpoint());
          EventBatch batch = new EventBatch()) {
        batch.addStored(
            StoredEvent.builder(1).blockHashes(31).tokenIds(tokens(BLOCK, 50)).build());
        batch.setPublishTime(System.currentTimeMillis() * 1_000_000L);
        publisher.send(batch);
      }
      long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(30);
      while (counter(perSource, "kvrouter.ingest.events.applied", "source_id", source) < 1) {
        assertTrue(System.nanoTime() < deadline, "the event was never applied");
        Thread.sleep(2);
      }
      assertEquals(1.0, counter(perSource, "kvrouter.ingest.messages", "source_id", source));
      assertEquals(1.0, counter(summed, "kvrouter.ingest.messages", "source_id", "0"));
      assertEquals(
          listener.endpoint(),
          perSource.get("kvrouter.ingest.messages").tags("source_id", source).meter().getId()
              .getTag("endpoint"));
      assertEquals(
          0.0,
          counter(perSource, "kvrouter.ingest.rejected", "source_id", source, "reason", "bad_flatbuffers"));
      assertEquals(IngestReject.values().length,
          perSource.get("kvrouter.ingest.rejected").meters().size());
      assertEquals(1.0, counter(summed, "kvrouter.ingest.connections"));
      assertEquals(0.0, counter(summed, "kvrouter.ingest.consumer.remakes"));
      assertEquals(0.0, counter(summed, "kvrouter.ingest.consumer.remake.failures"));
      assertEquals(0.0, counter(summed, "kvrouter.ingest.events.ignored"));
      assertEquals(0.0, counter(summed, "kvrouter.ingest.bookings.trimmed"));
      FunctionTimer lag =
          perSource.get("kvrouter.ingest.lag").tags("source_id", source).functionTimer();
      assertEquals(1.0, lag.count());
      assertTrue(lag.totalTime(TimeUnit.MICROSECONDS) >= 0);
      Gauge unknown = summed.get("kvrouter.ingest.state.unknown.ranks").gauge();
      assertEquals(0.0, unknown.value());
      FunctionCounter applied =
          perSource.get("kvrouter.kv.events").tags("kind", "stored", "outcome", "ok").functionCounter();
      assertEquals(1.0, applied.count());

      // Under a Prometheus registry: the names of the library's ingest text.
      PrometheusMeterRegistry prometheus = new PrometheusMeterRegistry(PrometheusConfig.DEFAULT);
      new KvRouterMetrics(router).ingest(ingest, listener.sourceId()).bindTo(prometheus);
      String ours = prometheus.scrape();
      TreeSet<String> missing = names(ingest.metricsPrometheus());
      missing.removeAll(names(ours));
      assertEquals(new TreeSet<String>(), missing, ours);
      assertTrue(
          ours.contains("kvrouter_ingest_messages_total{endpoint=\"" + listener.endpoint()
              + "\",source_id=\"" + source + "\"} 1"), ours);
    }
  }

  @Test
  void decisionLatencyIsTheLibrarysHistogram() {
    SimpleMeterRegistry registry = new SimpleMeterRegistry();
    try (Router router = router()) {
      new KvRouterMetrics(router).bindTo(registry);
      for (int i = 0; i < 17; ++i) router.findBestMatch(tokens(64, 10 * i));
      FunctionTimer timer = registry.get("kvrouter.decision.duration").functionTimer();
      assertEquals(2.0, timer.count()); // one call in 16 is timed: the 1st and the 17th
      Metrics m = router.metrics();
      assertEquals(m.decisionLatencySumNanos(), timer.totalTime(TimeUnit.NANOSECONDS), 0.5);
      // The same buckets, le for le, as the library's own text.
      String text = router.metricsPrometheus();
      Matcher b =
          Pattern.compile("(?m)^kvrouter_decision_duration_seconds_bucket\\{le=\"([^\"]+)\"\\} (\\d+)$")
              .matcher(text);
      int buckets = 0;
      double previous = 0;
      while (b.find()) {
        ++buckets;
        double ours = counter(registry, "kvrouter.decision.duration.buckets", "le", b.group(1));
        assertEquals(Double.parseDouble(b.group(2)), ours, b.group(1) + " in\n" + text);
        assertTrue(ours >= previous, "cumulative");
        previous = ours;
      }
      assertEquals(Metrics.DECISION_LATENCY_BUCKETS + 1, buckets, text);
      assertEquals(2.0, counter(registry, "kvrouter.decision.duration.buckets", "le", "+Inf"));
      assertEquals("2.56e-07", KvRouterMetrics.formatG(256e-9));
      assertEquals("0.000524288", KvRouterMetrics.formatG(524288e-9));
      assertEquals("0.00209715", KvRouterMetrics.formatG(2097152e-9));
    }
  }
}
