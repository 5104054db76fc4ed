// Router counters through the C ABI, as a struct and in Prometheus text format.
#include <absl/strings/str_format.h>

#include "capi_internal.h"
#include "prometheus_text.h"

using namespace kvrouter::capi;

namespace {

kvr_metrics Collect(const kvr_router& router) {
  kvr_metrics m = Defaults<kvr_metrics>();
  const kvrouter::IndexStats index = router.router->IndexStats();
  for (int kind = 0; kind < KVR_EVENT_KINDS; ++kind) {
    for (int outcome = 0; outcome < KVR_EVENT_OUTCOMES; ++outcome) {
      m.events[kind][outcome] = index.events[kind][outcome];
    }
  }
  const kvrouter::Router::Counters counters = router.router->counters();
  m.event_batches_rejected = counters.event_batches_rejected;
  m.decisions = counters.decisions;
  m.requests_active = router.router->active_requests();
  m.queue_pending = router.router->pending_count();
  m.queue_pending_tokens = router.router->pending_tokens();
  m.workers = router.router->Workers().size();
  m.index_nodes = index.nodes;
  m.index_blocks = index.cached_blocks;
  m.index_bytes = index.allocated_bytes;
  const kvrouter::Router::ReplicaStats replicas = router.router->replica_stats();
  m.replica_changes_applied = replicas.changes_applied;
  m.replica_changes_rejected = replicas.changes_rejected;
  m.replica_requests_active = replicas.active_requests;
  m.replicas_live = replicas.live;
  m.replicas_expired = replicas.expired;
  m.events_refused_for_memory = counters.events_refused_for_memory;
  m.replica_changes_unpublished = replicas.changes_unpublished;
  m.decisions_priced_again = counters.decisions_priced_again;
  for (const auto& per_kind : index.sliding_events) {
    m.sliding_events_applied += per_kind[static_cast<int>(kvrouter::EventError::kNone)];
    for (size_t outcome = 1; outcome < per_kind.size(); ++outcome) {
      m.sliding_events_rejected += per_kind[outcome];
    }
  }
  m.index_sliding_blocks = index.sliding_blocks;
  const kvrouter::LatencyHistogram::Snapshot latency = router.router->decision_latency();
  static_assert(kvrouter::LatencyHistogram::kBuckets == KVR_DECISION_LATENCY_BUCKETS);
  for (int i = 0; i < KVR_DECISION_LATENCY_BUCKETS; ++i) {
    m.decision_latency_bounds_ns[i] =
        static_cast<uint64_t>(kvrouter::LatencyHistogram::kBoundsNanos[i]);
    m.decision_latency_le[i] = latency.at_most[i];
  }
  m.decision_latency_count = latency.count;
  m.decision_latency_sum_ns = latency.sum_nanos;
  return m;
}

// The decision-latency histogram in seconds, as Prometheus names its buckets.
void AppendDecisionLatency(PrometheusText& text, const kvr_metrics& m) {
  constexpr std::string_view kName = "kvrouter_decision_duration_seconds";
  text.Family(kName, "histogram",
              "Time from a routing call's start to its decision, one call in 16 (queued requests "
              "excluded).");
  const std::string bucket = std::string(kName) + "_bucket";
  for (int i = 0; i < KVR_DECISION_LATENCY_BUCKETS; ++i) {
    const std::string le = absl::StrFormat("%g", m.decision_latency_bounds_ns[i] / 1e9);
    text.Sample(bucket, {{"le", le}}, m.decision_latency_le[i]);
  }
  text.Sample(bucket, {{"le", "+Inf"}}, m.decision_latency_count);
  text.Sample(std::string(kName) + "_sum", {}, m.decision_latency_sum_ns / 1e9);
  text.Sample(std::string(kName) + "_count", {}, m.decision_latency_count);
}

std::string RenderPrometheus(const kvr_router& router) {
  const kvr_metrics m = Collect(router);
  PrometheusText text;
  text.Family("kvrouter_kv_events_total", "counter",
              "KV events by kind and outcome (ok, or the reason they were rejected).");
  for (int kind = 0; kind < KVR_EVENT_KINDS; ++kind) {
    for (int outcome = 0; outcome < KVR_EVENT_OUTCOMES; ++outcome) {
      text.Sample(
          "kvrouter_kv_events_total",
          {{"kind", kvrouter::EventKindName(static_cast<kvrouter::EventKind>(kind))},
           {"outcome", kvrouter::EventErrorName(static_cast<kvrouter::EventError>(outcome))}},
          m.events[kind][outcome]);
    }
  }
  text.Scalar("kvrouter_event_batches_rejected_total", "counter",
              "Event batches that failed verification; nothing of them was applied.",
              m.event_batches_rejected);
  text.Scalar("kvrouter_events_refused_for_memory_total", "counter",
              "KV events the index could not apply for want of memory (a rank refused midway "
              "is left holding nothing).",
              m.events_refused_for_memory);
  text.Scalar("kvrouter_decisions_total", "counter",
              "Routing calls that picked a worker (routes and plans; not previews).", m.decisions);
  AppendDecisionLatency(text, m);
  text.Scalar("kvrouter_requests_active", "gauge", "Requests booked and not yet freed.",
              m.requests_active);
  text.Scalar("kvrouter_queue_pending_requests", "gauge", "Requests waiting for admission.",
              m.queue_pending);
  text.Scalar("kvrouter_queue_pending_tokens", "gauge", "Prompt tokens of the requests waiting.",
              m.queue_pending_tokens);
  text.Scalar("kvrouter_workers", "gauge", "Registered workers.", m.workers);
  text.Scalar("kvrouter_index_nodes", "gauge",
              "Radix tree nodes in the KV index (each a run of blocks held alike).", m.index_nodes);
  text.Scalar("kvrouter_index_blocks", "gauge",
              "Cached (block, worker rank) entries in the KV index.", m.index_blocks);
  text.Scalar("kvrouter_index_bytes", "gauge", "Heap bytes held by the KV index.", m.index_bytes);
  text.Scalar("kvrouter_sliding_window_events_applied_total", "counter",
              "Sliding-window KV events (hybrid models) applied.", m.sliding_events_applied);
  text.Scalar("kvrouter_sliding_window_events_rejected_total", "counter",
              "Sliding-window KV events (hybrid models) rejected, whole or in part.",
              m.sliding_events_rejected);
  text.Scalar("kvrouter_index_sliding_blocks", "gauge",
              "(sliding-window group, block) entries of hybrid models' worker ranks.",
              m.index_sliding_blocks);
  text.Scalar("kvrouter_replica_changes_applied_total", "counter",
              "Booking changes of other router replicas applied here.", m.replica_changes_applied);
  text.Scalar("kvrouter_replica_changes_rejected_total", "counter",
              "Booking changes of other router replicas rejected (undecodable, unknown worker "
              "rank, duplicate booking).",
              m.replica_changes_rejected);
  text.Scalar("kvrouter_replica_requests_active", "gauge",
              "Requests booked by other router replicas, counted as load here.",
              m.replica_requests_active);
  text.Scalar("kvrouter_replicas_live", "gauge",
              "Other router replicas sending heartbeats and not expired.", m.replicas_live);
  text.Scalar("kvrouter_replicas_expired_total", "counter",
              "Other router replicas whose bookings were dropped here because they fell silent.",
              m.replicas_expired);
  text.Scalar("kvrouter_replica_changes_unpublished_total", "counter",
              "Own booking changes the replica publisher lost for want of memory or its "
              "transport refused (each repaired by announcing every booking again).",
              m.replica_changes_unpublished);
  text.Scalar("kvrouter_decisions_priced_again_total", "counter",
              "Routing decisions decided again under the router's lock because another call "
              "changed what they priced outside it.",
              m.decisions_priced_again);
  const auto loads = router.router->Loads();
  const auto per_rank = [&](std::string_view name, std::string_view help, auto value_of) {
    text.Family(name, "gauge", help);
    for (const auto& l : loads) {
      text.Sample(name,
                  {{"worker_id", absl::StrCat(l.worker.worker_id)},
                   {"dp_rank", absl::StrCat(l.worker.dp_rank)}},
                  static_cast<uint64_t>(value_of(l)));
    }
  };
  per_rank("kvrouter_worker_active_prefill_tokens",
           "Prompt tokens booked on the rank and not yet prefilled.",
           [](const auto& l) { return l.active_prefill_tokens; });
  per_rank("kvrouter_worker_active_decode_blocks",
           "Distinct KV blocks held by the rank's active requests.",
           [](const auto& l) { return l.active_blocks; });
  return std::move(text).Take();
}

}  // namespace

extern "C" {

KVR_API kvr_status kvr_metrics_init(kvr_metrics* metrics, size_t size) {
  return InitVersioned(metrics, size);
}

KVR_API kvr_status kvr_router_get_metrics(kvr_router* router, kvr_metrics* out, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = CheckResultStruct(err, out)) return s;
    return WriteVersioned(err, Collect(*router), out);
  });
}

KVR_API kvr_status kvr_router_metrics_prometheus(kvr_router* router, char* buf, size_t cap,
                                                 size_t* len, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    return CopyOutString(err, RenderPrometheus(*router), buf, cap, len, "Prometheus text");
  });
}

}  // extern "C"
