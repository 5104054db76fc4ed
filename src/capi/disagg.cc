// Disaggregated prefill / decode through the C ABI: a kvr_disagg owns two kvr_router pools
// (usable with every kvr_router_* function) and a core DisaggRouter over them.
#include <cmath>
#include <cstring>
#include <memory>
#include <span>

#include "capi_internal.h"

using namespace kvrouter::capi;

struct kvr_disagg {
  kvr_router* prefill = nullptr;
  kvr_router* decode = nullptr;
  std::unique_ptr<kvrouter::DisaggRouter> core;
  ~kvr_disagg() {
    core.reset();  // it refers to the pools
    kvr_router_free(prefill);
    kvr_router_free(decode);
  }
};

namespace {

// As BindRouterOptions (router.cc), for kvr_disagg_options and the core's DisaggOptions.
template <typename COptions, typename CoreOptions, typename Bind>
void BindDisaggOptions(COptions& c, CoreOptions& core, Bind&& bind) {
  bind(c.max_local_prefill_tokens, core.max_local_prefill_tokens);
  bind(c.max_local_prefill_ratio, core.max_local_prefill_ratio);
  bind(c.prefill_busy_threshold, core.prefill_busy_threshold);
}

kvr_status ToDisaggOptions(kvr_error** err, const kvr_disagg_options* opts,
                           kvrouter::DisaggOptions& out) {
  kvr_disagg_options c;
  if (kvr_status s = ReadVersioned(err, opts, c)) return s;
  if (kvr_status s = CheckValue(err, KnownDisaggPolicy, c.policy, "kvr_disagg_options.policy",
                                "KVR_DISAGG_*")) {
    return s;
  }
  BindDisaggOptions(c, out, [](const auto& c_field, auto& core_field) { core_field = c_field; });
  out.policy = static_cast<kvrouter::DisaggPolicy>(c.policy);
  out.enforce = c.enforce != 0;
  if (std::isnan(c.decode_busy_threshold)) {  // neither negative nor a fraction
    return FailInvalid(err,
                       "kvr_disagg_options.decode_busy_threshold is NaN (negative: the "
                       "signal is unavailable)");
  }
  if (c.decode_busy_threshold >= 0) out.decode_busy_threshold = c.decode_busy_threshold;
  return FromStatus(err, kvrouter::ValidateDisaggOptions(out));
}

// As CheckRouter, for both pools: routing a request books on each.
kvr_status CheckDisagg(kvr_error** err, const kvr_disagg* disagg) {
  if (kvr_status s = RequireNonNull(err, disagg, "disagg")) return s;
  if (kvr_status s = CheckRouter(err, disagg->prefill)) return s;
  return CheckRouter(err, disagg->decode);
}

}  // namespace

namespace kvrouter::capi {

template <>
kvr_disagg_options Defaults() noexcept {
  const kvrouter::DisaggOptions core;
  kvr_disagg_options c{};
  c.struct_size = sizeof c;
  BindDisaggOptions(c, core, [](auto& c_field, const auto& core_field) { c_field = core_field; });
  c.policy = static_cast<kvr_disagg_policy>(core.policy);
  c.enforce = core.enforce ? 1 : 0;
  c.decode_busy_threshold = core.decode_busy_threshold.value_or(-1.0);  // negative: unavailable
  return c;
}

template <>
kvr_prefill_result Defaults() noexcept {
  kvr_prefill_result c{};
  c.struct_size = sizeof c;
  c.bootstrap_room = -1;  // not remote
  return c;
}

}  // namespace kvrouter::capi

extern "C" {

KVR_API kvr_status kvr_disagg_options_init(kvr_disagg_options* options, size_t size) {
  return InitVersioned(options, size);
}

KVR_API kvr_status kvr_prefill_result_init(kvr_prefill_result* result, size_t size) {
  return InitVersioned(result, size);
}

KVR_API kvr_status kvr_disagg_new(const kvr_router_options* prefill,
                                  const kvr_router_options* decode, const kvr_disagg_options* opts,
                                  kvr_disagg** out, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = RequireNonNull(err, out, "out")) return s;
    kvrouter::DisaggOptions options;
    if (kvr_status s = ToDisaggOptions(err, opts, options)) return s;
    auto disagg = std::make_unique<kvr_disagg>();
    if (kvr_status s = kvr_router_new(prefill, &disagg->prefill, err)) return s;
    if (kvr_status s = kvr_router_new(decode, &disagg->decode, err)) return s;
    options.random_seed = kvrouter::EntropySeed();
    auto core =
        kvrouter::DisaggRouter::Create(*disagg->prefill->router, *disagg->decode->router, options);
    if (!core.ok()) return FromStatus(err, core.status());
    disagg->core = std::move(*core);
    *out = disagg.release();
    return KVR_OK;
  });
}

KVR_API void kvr_disagg_free(kvr_disagg* disagg) { delete disagg; }

KVR_API kvr_router* kvr_disagg_prefill_router(kvr_disagg* disagg) {
  return disagg == nullptr ? nullptr : disagg->prefill;
}

KVR_API kvr_router* kvr_disagg_decode_router(kvr_disagg* disagg) {
  return disagg == nullptr ? nullptr : disagg->decode;
}

KVR_API kvr_status kvr_disagg_route_prefill(kvr_disagg* disagg, const uint32_t* tokens,
                                            size_t num_tokens, const kvr_request_options* opts,
                                            const kvr_routing_hints* hints, kvr_prefill_result* out,
                                            kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckDisagg(err, disagg)) return s;
    if (kvr_status s = CheckResultStruct(err, out)) return s;
    RequestOptions options;
    if (kvr_status s = ToRequest(err, tokens, num_tokens, opts, options)) return s;
    kvrouter::RoutingHints core_hints;
    kvr_routing_hints c;
    if (kvr_status s = ToRoutingHints(err, hints, core_hints, c)) return s;
    auto route = disagg->core->RoutePrefill(options.tokens, options.route, core_hints);
    if (!route.ok()) return FromStatus(err, route.status());
    kvr_prefill_result result = Defaults<kvr_prefill_result>();
    result.remote = route->remote() ? 1 : 0;
    result.reason = static_cast<uint32_t>(route->placement);
    if (route->remote()) {
      result.worker_id = route->decision.worker.worker_id;
      result.dp_rank = route->decision.worker.dp_rank;
      result.bootstrap_room = route->bootstrap_room;
      result.cached_tokens = route->decision.cached_tokens;
    }
    return WriteVersioned(err, result, out);
  });
}

KVR_API kvr_status kvr_disagg_route_decode(kvr_disagg* disagg, const uint32_t* tokens,
                                           size_t num_tokens, const kvr_request_options* opts,
                                           const kvr_routing_hints* hints, int remote_prefill,
                                           kvr_route_signals* out, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckDisagg(err, disagg)) return s;
    if (kvr_status s = CheckResultStruct(err, out)) return s;
    RequestOptions options;
    if (kvr_status s = ToRequest(err, tokens, num_tokens, opts, options)) return s;
    kvrouter::RoutingHints core_hints;
    kvr_routing_hints c;
    if (kvr_status s = ToRoutingHints(err, hints, core_hints, c)) return s;
    auto decision =
        disagg->core->RouteDecode(options.tokens, options.route, remote_prefill != 0, core_hints);
    if (!decision.ok()) return FromStatus(err, decision.status());
    return WriteVersioned(err, ToSignals(*decision), out);
  });
}

KVR_API kvr_status kvr_disagg_prefill_worker_busy(kvr_disagg* disagg, const uint32_t* tokens,
                                                  size_t num_tokens,
                                                  const kvr_request_options* opts, double threshold,
                                                  int* busy, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = CheckDisagg(err, disagg)) return s;
    if (kvr_status s = RequireNonNull(err, busy, "busy")) return s;
    RequestOptions options;
    if (kvr_status s = ToRequest(err, tokens, num_tokens, opts, options)) return s;
    auto result = disagg->core->PrefillWorkerBusy(options.tokens, options.route, threshold);
    if (!result.ok()) return FromStatus(err, result.status());
    *busy = *result ? 1 : 0;
    return KVR_OK;
  });
}

}  // extern "C"
