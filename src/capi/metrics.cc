// Router counters through the C ABI, as a struct and in Prometheus text format.
#include <absl/strings/str_format.h>

#include "capi_internal.h"

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
  return m;
}

void AppendMetric(std::string& out, std::string_view name, std::string_view type,
                  std::string_view help) {
  absl::StrAppendFormat(&out, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

std::string RenderPrometheus(const kvr_router& router) {
  const kvr_metrics m = Collect(router);
  std::string out;
  AppendMetric(out, "kvrouter_kv_events_total", "counter",
               "KV events by kind and outcome (ok, or the reason they were rejected).");
  for (int kind = 0; kind < KVR_EVENT_KINDS; ++kind) {
    for (int outcome = 0; outcome < KVR_EVENT_OUTCOMES; ++outcome) {
      absl::StrAppendFormat(&out, "kvrouter_kv_events_total{kind=\"%s\",outcome=\"%s\"} %u\n",
                            kvrouter::EventKindName(static_cast<kvrouter::EventKind>(kind)),
                            kvrouter::EventErrorName(static_cast<kvrouter::EventError>(outcome)),
                            m.events[kind][outcome]);
    }
  }
  const struct {
    const char* name;
    const char* type;
    const char* help;
    int64_t value;
  } scalars[] = {
      {"kvrouter_event_batches_rejected_total", "counter",
       "Event batches that failed verification; nothing of them was applied.",
       static_cast<int64_t>(m.event_batches_rejected)},
      {"kvrouter_decisions_total", "counter", "Routing decisions made.",
       static_cast<int64_t>(m.decisions)},
      {"kvrouter_requests_active", "gauge", "Requests booked and not yet freed.",
       static_cast<int64_t>(m.requests_active)},
      {"kvrouter_queue_pending_requests", "gauge", "Requests waiting for admission.",
       static_cast<int64_t>(m.queue_pending)},
      {"kvrouter_queue_pending_tokens", "gauge", "Prompt tokens of the requests waiting.",
       static_cast<int64_t>(m.queue_pending_tokens)},
      {"kvrouter_workers", "gauge", "Registered workers.", static_cast<int64_t>(m.workers)},
      {"kvrouter_index_nodes", "gauge",
       "Radix tree nodes in the KV index (each a run of blocks held alike).",
       static_cast<int64_t>(m.index_nodes)},
      {"kvrouter_index_blocks", "gauge", "Cached (block, worker rank) entries in the KV index.",
       static_cast<int64_t>(m.index_blocks)},
      {"kvrouter_index_bytes", "gauge", "Heap bytes held by the KV index.", m.index_bytes},
      {"kvrouter_replica_changes_applied_total", "counter",
       "Booking changes of other router replicas applied here.",
       static_cast<int64_t>(m.replica_changes_applied)},
      {"kvrouter_replica_changes_rejected_total", "counter",
       "Booking changes of other router replicas rejected (undecodable, unknown worker rank, "
       "duplicate booking).",
       static_cast<int64_t>(m.replica_changes_rejected)},
      {"kvrouter_replica_requests_active", "gauge",
       "Requests booked by other router replicas, counted as load here.",
       static_cast<int64_t>(m.replica_requests_active)},
  };
  for (const auto& s : scalars) {
    AppendMetric(out, s.name, s.type, s.help);
    absl::StrAppendFormat(&out, "%s %d\n", s.name, s.value);
  }
  AppendMetric(out, "kvrouter_worker_active_prefill_tokens", "gauge",
               "Prompt tokens booked on the rank and not yet prefilled.");
  const auto loads = router.router->Loads();
  for (const auto& l : loads) {
    absl::StrAppendFormat(&out,
                          "kvrouter_worker_active_prefill_tokens{worker_id=\"%u\",dp_rank=\"%u\"} "
                          "%u\n",
                          l.worker.worker_id, l.worker.dp_rank, l.active_prefill_tokens);
  }
  AppendMetric(out, "kvrouter_worker_active_decode_blocks", "gauge",
               "Distinct KV blocks held by the rank's active requests.");
  for (const auto& l : loads) {
    absl::StrAppendFormat(&out,
                          "kvrouter_worker_active_decode_blocks{worker_id=\"%u\",dp_rank=\"%u\"} "
                          "%u\n",
                          l.worker.worker_id, l.worker.dp_rank, l.active_blocks);
  }
  return out;
}

}  // namespace

extern "C" {

KVR_API kvr_status kvr_metrics_init(kvr_metrics* metrics, size_t size) {
  return InitVersioned(metrics, size);
}

KVR_API kvr_status kvr_router_get_metrics(kvr_router* router, kvr_metrics* out, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = RequireNonNull(err, router, "router")) return s;
    if (kvr_status s = CheckResultStruct(err, out)) return s;
    return WriteVersioned(err, Collect(*router), out);
  });
}

KVR_API kvr_status kvr_router_metrics_prometheus(kvr_router* router, char* buf, size_t cap,
                                                 size_t* len, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = RequireNonNull(err, router, "router")) return s;
    return CopyOutString(err, RenderPrometheus(*router), buf, cap, len, "Prometheus text");
  });
}

}  // extern "C"
