// Staged routing through the C ABI: preview, plan, commit and abort, per-phase pins, session
// affinity and the state and index digests. The core (Router::Preview / Plan / Commit / Abort)
// does the work; this file converts the C structs and maps statuses.
#include <cstring>
#include <optional>
#include <span>

#include "capi_internal.h"
#include "core/disagg_router.h"

using namespace kvrouter::capi;
using kvrouter::WorkerKey;

namespace kvrouter::capi {

kvr_status ToRoutingHints(kvr_error** err, const kvr_routing_hints* in, RoutingHints& hints,
                          kvr_routing_hints& c) {
  if (kvr_status s = ReadVersioned(err, in, c)) return s;
  if (kvr_status s =
          CheckValue(err, KnownPhase, c.phase, "kvr_routing_hints.phase", "KVR_PHASE_*")) {
    return s;
  }
  if (kvr_status s = CheckValue(err, KnownSessionMode, c.session_mode,
                                "kvr_routing_hints.session_mode", "KVR_SESSION_*")) {
    return s;
  }
  const auto worker = [](uint64_t id) {
    return id == KVR_WORKER_NONE ? std::nullopt : std::optional<uint64_t>(id);
  };
  const auto rank = [](int32_t r) {
    return r < 0 ? std::nullopt : std::optional<uint32_t>(static_cast<uint32_t>(r));
  };
  hints.worker_id = worker(c.worker_id);
  hints.prefill_worker_id = worker(c.prefill_worker_id);
  hints.decode_worker_id = worker(c.decode_worker_id);
  hints.dp_rank = rank(c.dp_rank);
  hints.prefill_dp_rank = rank(c.prefill_dp_rank);
  return KVR_OK;
}

kvr_status ApplyHints(kvr_error** err, const kvr_routing_hints* in, RouteOptions& route,
                      kvr_routing_hints& c) {
  RoutingHints hints;
  if (kvr_status s = ToRoutingHints(err, in, hints, c)) return s;
  route.pin = PinForPhase(hints, static_cast<Phase>(c.phase));
  route.session_id = OrEmpty(c.session_id);
  route.session_mode = c.session_mode == KVR_SESSION_SOFT ? SessionMode::kSoft : SessionMode::kHard;
  route.session_ttl_seconds = c.session_ttl_seconds;
  return KVR_OK;
}

kvr_route_signals ToSignals(const RouteDecision& d) {
  kvr_route_signals out = Defaults<kvr_route_signals>();
  out.worker_id = d.worker.worker_id;
  out.dp_rank = d.worker.dp_rank;
  out.overlap_blocks = d.device_overlap_blocks;
  out.prompt_blocks = d.prompt_blocks;
  out.cached_tokens = d.cached_tokens;
  out.potential_decode_blocks = d.potential_decode_blocks;
  out.total_kv_blocks = d.total_kv_blocks;
  out.cost = d.candidates.empty() ? 0 : d.candidates[d.chosen].cost;
  out.prompt_tokens = d.prompt_tokens;
  out.booked = d.booked ? 1 : 0;
  out.moved = d.moved_from_preferred ? 1 : 0;
  out.queued = d.queued ? 1 : 0;
  return out;
}

template <>
kvr_routing_hints Defaults() noexcept {
  const kvrouter::RouteOptions core;
  kvr_routing_hints c{};
  c.struct_size = sizeof c;
  c.phase = KVR_PHASE_AGGREGATED;
  c.worker_id = KVR_WORKER_NONE;
  c.prefill_worker_id = KVR_WORKER_NONE;
  c.decode_worker_id = KVR_WORKER_NONE;
  c.dp_rank = -1;
  c.prefill_dp_rank = -1;
  c.session_mode = static_cast<kvr_session_mode>(core.session_mode);
  c.session_ttl_seconds = core.session_ttl_seconds;
  return c;
}

}  // namespace kvrouter::capi

namespace {

kvr_status RequireId(kvr_error** err, const char* id, const char* name) {
  if (id == nullptr || *id == '\0') {
    return Fail(err, KVR_INVALID_ARGUMENT, std::string(name) + " is NULL or empty");
  }
  return KVR_OK;
}

}  // namespace

extern "C" {

KVR_API kvr_status kvr_routing_hints_init(kvr_routing_hints* hints, size_t size) {
  return InitVersioned(hints, size);
}

KVR_API kvr_status kvr_route_signals_init(kvr_route_signals* signals, size_t size) {
  return InitVersioned(signals, size);
}

KVR_API kvr_status kvr_preview_route(kvr_router* router, const uint32_t* tokens, size_t num_tokens,
                                     const kvr_request_options* opts,
                                     const kvr_routing_hints* hints, kvr_route_signals* out,
                                     kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = CheckResultStruct(err, out)) return s;
    RequestOptions options;
    if (kvr_status s = ToRequest(err, tokens, num_tokens, opts, options)) return s;
    kvr_routing_hints c;
    if (kvr_status s = ApplyHints(err, hints, options.route, c)) return s;
    auto preview = router->router->Preview(options.tokens, options.route);
    if (!preview.ok()) return FromStatus(err, preview.status());
    return WriteVersioned(err, ToSignals(*preview), out);
  });
}

KVR_API kvr_status kvr_plan_route(kvr_router* router, const uint32_t* tokens, size_t num_tokens,
                                  const kvr_request_options* opts, const kvr_routing_hints* hints,
                                  const kvr_route_signals* previewed, kvr_route_signals* out,
                                  kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = CheckResultStruct(err, out)) return s;
    RequestOptions options;
    if (kvr_status s = ToRequest(err, tokens, num_tokens, opts, options)) return s;
    kvr_routing_hints c;
    if (kvr_status s = ApplyHints(err, hints, options.route, c)) return s;
    std::optional<WorkerKey> preferred;
    if (previewed != nullptr) {
      kvr_route_signals p;
      if (kvr_status s = ReadVersioned(err, previewed, p)) return s;
      preferred = WorkerKey{p.worker_id, p.dp_rank};
    }
    auto plan = router->router->Plan(options.tokens, options.route, preferred);
    if (!plan.ok()) return FromStatus(err, plan.status());
    return WriteVersioned(err, ToSignals(*plan), out);
  });
}

KVR_API kvr_status kvr_commit_route(kvr_router* router, const char* request_id, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = RequireId(err, request_id, "request_id")) return s;
    return FromStatus(err, router->router->Commit(request_id));
  });
}

KVR_API kvr_status kvr_abort_route(kvr_router* router, const char* request_id, int* freed,
                                   kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = RequireId(err, request_id, "request_id")) return s;
    const bool any = router->router->Abort(request_id);
    if (freed != nullptr) *freed = any ? 1 : 0;
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_router_set_plan_deadline(kvr_router* router, double seconds,
                                                kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    return FromStatus(err, router->router->SetPlanDeadline(seconds));
  });
}

KVR_API kvr_status kvr_router_expire_plans(kvr_router* router, size_t* expired, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    const size_t n = router->router->ExpirePlans();
    if (expired != nullptr) *expired = n;
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_router_session_binding(kvr_router* router, const char* session_id,
                                              uint64_t* worker_id, uint32_t* dp_rank,
                                              kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = RequireId(err, session_id, "session_id")) return s;
    auto bound = router->router->SessionBinding(session_id);
    if (!bound) {
      return Fail(err, KVR_NOT_FOUND,
                  std::string("session '") + session_id + "' is not bound (or expired)");
    }
    if (worker_id != nullptr) *worker_id = bound->worker_id;
    if (dp_rank != nullptr) *dp_rank = bound->dp_rank;
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_router_close_session(kvr_router* router, const char* session_id,
                                            kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = RequireId(err, session_id, "session_id")) return s;
    router->router->CloseSession(session_id);
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_router_reclaim_sessions(kvr_router* router, size_t* reclaimed,
                                               kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    const size_t n = router->router->ReclaimExpiredSessions();
    if (reclaimed != nullptr) *reclaimed = n;
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_router_state_digest(kvr_router* router, uint64_t* out, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = RequireNonNull(err, out, "out")) return s;
    *out = router->router->StateDigest();
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_router_index_digest(kvr_router* router, uint64_t* out, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckRouter(err, router)) return s;
    if (kvr_status s = RequireNonNull(err, out, "out")) return s;
    *out = router->router->IndexDigest();
    return KVR_OK;
  });
}

}  // extern "C"
