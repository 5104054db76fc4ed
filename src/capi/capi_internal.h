// What every C entry point shares: the opaque types behind the handles, the exception fence,
// error reporting, and copying results into caller buffers (versioned structs: versioned.h).
#pragma once

#include <absl/status/status.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "core/disagg_router.h"
#include "core/router.h"
#include "enumerations.h"
#include "kvrouter.h"
#include "versioned.h"

struct kvr_error {
  kvr_status status;
  std::string message;
};

struct kvr_buffer {
  std::vector<uint8_t> bytes;
};

struct kvr_router {
  // The router's clock (kvr_router_set_time); declared first: the router reads it to the end.
  kvrouter::HandDrivenClock clock;
  std::unique_ptr<kvrouter::Router> router;
};

namespace kvrouter::capi {

// Reports a failure through the optional error out-parameter and returns its status.
kvr_status Fail(kvr_error** err, kvr_status status, std::string message);
kvr_status FromStatus(kvr_error** err, const absl::Status& status);

// A failure whose error object could not be made (its message refused memory): the caller's
// previous error goes, so that *err does not describe an older failure; the status alone tells.
inline kvr_status ForgetError(kvr_error** err, kvr_status status) noexcept {
  if (err != nullptr) {
    delete *err;
    *err = nullptr;
  }
  return status;
}

// Runs `body` with every exception turned into a status: nothing unwinds into C. Running out of
// memory is KVR_RESOURCE_EXHAUSTED (the core leaves its state whole: RadixIndex::Apply), any
// other exception KVR_INTERNAL. The error object itself needs memory: without it, the status.
template <typename Body>
kvr_status Guard(kvr_error** err, Body&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    try {
      return Fail(err, KVR_RESOURCE_EXHAUSTED, "out of memory");
    } catch (...) {
      return ForgetError(err, KVR_RESOURCE_EXHAUSTED);
    }
  } catch (const std::exception& e) {
    try {
      return Fail(err, KVR_INTERNAL, std::string("internal error: ") + e.what());
    } catch (...) {
      return ForgetError(err, KVR_INTERNAL);
    }
  } catch (...) {
    try {
      return Fail(err, KVR_INTERNAL, "internal error: an exception of no standard type");
    } catch (...) {
      return ForgetError(err, KVR_INTERNAL);
    }
  }
}

// KVR_INVALID_ARGUMENT naming the NULL argument, or KVR_OK.
inline kvr_status RequireNonNull(kvr_error** err, const void* p, const char* name) {
  return p != nullptr ? KVR_OK : Fail(err, KVR_INVALID_ARGUMENT, std::string(name) + " is NULL");
}

// KVR_INVALID_ARGUMENT for a NULL router; KVR_FAILED_PRECONDITION for a call from the router's
// own replica publisher, which runs under the router's lock: the call would wait for that lock
// for ever (the publisher's thread holds it). Every entry point taking a router checks this.
inline kvr_status CheckRouter(kvr_error** err, const kvr_router* router) {
  if (kvr_status s = RequireNonNull(err, router, "router")) return s;
  if (router->router->ObserverRunningOnThisThread()) {
    return Fail(err, KVR_FAILED_PRECONDITION,
                "called from the router's own replica publisher, which runs under the router's "
                "lock: a publisher must not call into its router");
  }
  return KVR_OK;
}

// A caller's array of `count` elements at `p`: KVR_INVALID_ARGUMENT naming it when it is NULL
// with elements, or when no buffer can hold that many (their bytes past PTRDIFF_MAX: the end
// pointer would wrap and a short copy be taken for the whole); else KVR_OK.
template <typename T>
kvr_status CheckArray(kvr_error** err, const T* p, size_t count, const char* name) {
  if (count > 0 && p == nullptr) return RequireNonNull(err, p, name);
  if (count > static_cast<size_t>(PTRDIFF_MAX) / sizeof(T)) {
    return Fail(err, KVR_INVALID_ARGUMENT,
                std::string(name) + ": " + std::to_string(count) +
                    " elements are more than any buffer holds");
  }
  return KVR_OK;
}

// Sets `*len` to `needed`: KVR_OK when a caller buffer of `cap` entries at `out` takes them,
// KVR_BUFFER_TOO_SMALL (naming `what`) when not. Callers that know the size before computing
// the entries check first, so that a short buffer costs nothing.
inline kvr_status CheckCapacity(kvr_error** err, size_t needed, const void* out, size_t cap,
                                size_t* len, const char* what) {
  if (kvr_status s = RequireNonNull(err, len, "len")) return s;
  if (cap > 0 && out == nullptr) return RequireNonNull(err, out, "out");
  *len = needed;
  if (needed > cap) {
    return Fail(err, KVR_BUFFER_TOO_SMALL,
                std::string(what) + " needs " + std::to_string(needed) +
                    " entries; the buffer has " + std::to_string(cap));
  }
  return KVR_OK;
}

// For a call that knows its output's size before computing it: KVR_OK when `needed` entries
// fit the caller's buffer (nothing written: *len is set with the result, by CopyOut or
// ConvertOut), else CheckCapacity's refusal, before anything is computed.
inline kvr_status RefuseShortBuffer(kvr_error** err, size_t needed, const void* out, size_t cap,
                                    size_t* len, const char* what) {
  if (len != nullptr && needed <= cap && (cap == 0 || out != nullptr)) return KVR_OK;
  return CheckCapacity(err, needed, out, cap, len, what);
}

// Each of `rows`, converted, into a caller buffer of `cap` entries; `*len` is how many there
// are (KVR_BUFFER_TOO_SMALL, nothing written, when they do not fit). `convert` returns the
// entry, or fills it in place (convert(row, entry)), which the hot per-rank rows use (passed
// as lambdas, so that the conversion inlines into the loop).
template <typename T, typename Rows, typename Convert>
kvr_status ConvertOut(kvr_error** err, const Rows& rows, const Convert& convert, T* out, size_t cap,
                      size_t* len, const char* what) {
  if (kvr_status s = CheckCapacity(err, rows.size(), out, cap, len, what)) return s;
  for (size_t i = 0; i < rows.size(); ++i) {
    if constexpr (std::is_invocable_v<const Convert&, decltype(rows[i]), T&>) {
      convert(rows[i], out[i]);
    } else {
      out[i] = convert(rows[i]);
    }
  }
  return KVR_OK;
}

// Copies `items` into a caller buffer of `cap` elements, or reports the size needed.
template <typename T>
kvr_status CopyOut(kvr_error** err, std::span<const T> items, T* out, size_t cap, size_t* len,
                   const char* what) {
  return ConvertOut(
      err, items, [](const T& item) { return item; }, out, cap, len, what);
}

template <typename T>
kvr_status CopyOut(kvr_error** err, const std::vector<T>& items, T* out, size_t cap, size_t* len,
                   const char* what) {
  return CopyOut(err, std::span<const T>(items), out, cap, len, what);
}

// `text` and its NUL into a caller buffer of `cap` bytes, or the size needed.
inline kvr_status CopyOutString(kvr_error** err, const std::string& text, char* out, size_t cap,
                                size_t* len, const char* what) {
  return CopyOut(err, std::span<const char>(text.c_str(), text.size() + 1), out, cap, len, what);
}

inline std::string_view OrEmpty(const char* s) { return s == nullptr ? std::string_view() : s; }

// Applies `bind(c_field, core_field)` to the fields a C worker description (kvr_worker_config,
// kvr_engine_worker) shares with its core counterpart (WorkerConfig, EngineWorker): its id, its
// data-parallel ranks and its block size (0: the router's). One list for the C defaults (core
// to C) and the conversion (C to core).
template <typename CWorker, typename CoreWorker, typename Bind>
void BindWorkerRanks(CWorker& c, CoreWorker& core, Bind&& bind) {
  bind(c.worker_id, core.worker_id);
  bind(c.dp_start, core.dp_start);
  bind(c.dp_size, core.dp_size);
  bind(c.block_size, core.block_size);
}

// Per-block multimodal hashes from the flat C form (values + count per block).
kvr_status ReadMmHashes(kvr_error** err, const uint64_t* hashes, const size_t* counts,
                        size_t num_blocks, std::vector<std::vector<uint64_t>>& out);

// A request's options with the storage their views point into.
struct RequestOptions {
  kvr_request_options c;
  std::vector<std::vector<uint64_t>> mm;
  kvrouter::RouteOptions route;
  std::span<const uint32_t> tokens;  // the prompt's tokens (ToRequest); none when prehashed
};

// kvr_request_options (NULL = defaults) to core RouteOptions, views into `out`. The prompt's
// own options only: KVR_REQUEST_PREHASHED is ToRequest's.
kvr_status ToRouteOptions(kvr_error** err, const kvr_request_options* opts, RequestOptions& out);
// A routing call's prompt and options: `tokens` (KVR_INVALID_ARGUMENT for NULL with a non-zero
// count), or with KVR_REQUEST_PREHASHED opts' local hashes, `num_tokens` the prompt's length
// and `tokens` NULL.
kvr_status ToRequest(kvr_error** err, const uint32_t* tokens, size_t num_tokens,
                     const kvr_request_options* opts, RequestOptions& out);

// kvr_routing_hints (NULL = defaults) to core hints; `c` receives the defaulted C copy.
kvr_status ToRoutingHints(kvr_error** err, const kvr_routing_hints* in, RoutingHints& hints,
                          kvr_routing_hints& c);
// The pin of the hints' phase and the session into `route` (views into `c`).
kvr_status ApplyHints(kvr_error** err, const kvr_routing_hints* in, RouteOptions& route,
                      kvr_routing_hints& c);
kvr_route_signals ToSignals(const RouteDecision& decision);

// C event structs to core events, with argument checks.
// With the router's `block_size` (0: not known, as in a batch), more tokens than the event's
// blocks need are refused before anything is copied.
kvr_status ToStoredEvent(kvr_error** err, const kvr_stored_event* event, KvEvent& out,
                         uint32_t block_size = 0);
kvr_status ToRemovedEvent(kvr_error** err, const kvr_removed_event* event, KvEvent& out);

}  // namespace kvrouter::capi
