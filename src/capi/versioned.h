// The versioned structs of the C ABI: how they are initialised, read and written so that a
// caller compiled against an older or newer kvrouter.h never has bytes touched outside its own
// struct (docs/api-stability.md).
//
// Each struct begins with `uint32_t struct_size`, the size of the struct as its caller compiled
// it. The library knows sizeof(T) (its own layout) and the size of the struct's first released
// layout; every layout in between is a prefix of sizeof(T), because fields are only appended
// and no struct ends in padding.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "kvrouter.h"

namespace kvrouter::capi {

// The size of T up to and including `field`: the end of a layout whose last field it was.
#define KVR_LAYOUT_END(T, field) (offsetof(T, field) + sizeof(T::field))

// Every versioned struct with the last field of its first released layout (0.1.0: the layouts
// of 0.1.0's history are all prefixes of today's, so each is accepted). A struct added later
// names its own last field: its first layout is then its whole current one.
#define KVR_VERSIONED_STRUCTS(X)               \
  X(kvr_hash_options, mm_num_blocks)           \
  X(kvr_router_options, random_seed)           \
  X(kvr_worker_config, max_num_batched_tokens) \
  X(kvr_stored_event, mm_counts)               \
  X(kvr_removed_event, num_blocks)             \
  X(kvr_request_options, queue_timeout_ms)     \
  X(kvr_route_result, queued)                  \
  X(kvr_metrics, index_bytes)                  \
  X(kvr_routing_hints, session_ttl_seconds)    \
  X(kvr_route_signals, reserved)               \
  X(kvr_disagg_options, decode_busy_threshold) \
  X(kvr_prefill_result, cached_tokens)         \
  X(kvr_ingest_options, reserved)              \
  X(kvr_engine_worker, replay_endpoint)        \
  X(kvr_ingest_stats, connections)

template <typename T>
struct StructTraits;  // name and first released size, for each versioned struct

#define KVR_STRUCT_TRAITS_(T, first_last_field)                                  \
  template <>                                                                    \
  struct StructTraits<T> {                                                       \
    static constexpr const char* kName = #T;                                     \
    static constexpr size_t kFirstSize = KVR_LAYOUT_END(T, first_last_field);    \
    static_assert(kFirstSize <= sizeof(T));                                      \
    static_assert(offsetof(T, struct_size) == 0 && sizeof(T::struct_size) == 4); \
    static_assert(std::is_trivially_copyable_v<T>);                              \
  };
KVR_VERSIONED_STRUCTS(KVR_STRUCT_TRAITS_)
#undef KVR_STRUCT_TRAITS_

// The library's defaults for T, with struct_size = sizeof(T). Defined next to the code that
// converts T, from the core's own defaults wherever the core has the setting.
template <typename T>
T Defaults();
#define KVR_DECLARE_DEFAULTS_(T, first_last_field) \
  template <>                                      \
  T Defaults<T>();
KVR_VERSIONED_STRUCTS(KVR_DECLARE_DEFAULTS_)
#undef KVR_DECLARE_DEFAULTS_

// Writes T's defaults into the caller's `size` bytes at `p`: never past them, zero past the
// fields this library knows, struct_size = size. Below the first released size the struct is
// zero-filled instead, so that every later call refuses it with a message.
template <typename T>
kvr_status InitVersioned(T* p, size_t size) noexcept {
  if (p == nullptr || size < sizeof(uint32_t) || size > UINT32_MAX) return KVR_INVALID_ARGUMENT;
  auto* bytes = reinterpret_cast<unsigned char*>(p);
  const bool known = size >= StructTraits<T>::kFirstSize;
  if (known) {
    const T defaults = Defaults<T>();
    std::memcpy(bytes, &defaults, std::min(size, sizeof(T)));
  } else {
    std::memset(bytes, 0, size);
  }
  if (size > sizeof(T)) std::memset(bytes + sizeof(T), 0, size - sizeof(T));
  const uint32_t recorded = static_cast<uint32_t>(size);
  std::memcpy(bytes, &recorded, sizeof recorded);
  return known ? KVR_OK : KVR_INVALID_ARGUMENT;
}

// The message for a struct_size this library cannot take, or "" when it can.
template <typename T>
std::string CheckStructSize(uint32_t size) {
  constexpr const char* name = StructTraits<T>::kName;
  if (size >= StructTraits<T>::kFirstSize) return {};
  const std::string init = std::string(name) + "_init";
  if (size == 0) {
    return std::string(name) + ".struct_size is 0: initialise it with " + init +
           "(&s, sizeof s) first";
  }
  return std::string(name) + ".struct_size is " + std::to_string(size) + ", below the " +
         std::to_string(StructTraits<T>::kFirstSize) +
         " bytes of its first released layout: pass sizeof the struct to " + init;
}

kvr_status FailInvalid(kvr_error** err, std::string message);

// Copies a caller's struct over the library's defaults: only the bytes its struct_size covers
// (an older caller's struct is shorter), refusing a newer caller's struct whose fields this
// library does not know unless they are all zero. NULL = the defaults.
template <typename T>
kvr_status ReadVersioned(kvr_error** err, const T* in, T& out) {
  out = Defaults<T>();
  if (in == nullptr) return KVR_OK;
  const uint32_t size = in->struct_size;
  if (std::string problem = CheckStructSize<T>(size); !problem.empty()) {
    return FailInvalid(err, std::move(problem));
  }
  const auto* bytes = reinterpret_cast<const unsigned char*>(in);
  for (size_t i = sizeof(T); i < size; ++i) {
    if (bytes[i] != 0) {
      return FailInvalid(err, std::string(StructTraits<T>::kName) +
                                  " is from a newer kvrouter (struct_size " + std::to_string(size) +
                                  " > " + std::to_string(sizeof(T)) +
                                  ") and sets fields this library does not know");
    }
  }
  std::memcpy(&out, in, std::min<size_t>(size, sizeof(T)));
  out.struct_size = sizeof(T);
  return KVR_OK;
}

// KVR_OK if `out` (not NULL) can take a result: its struct_size is one this library writes.
template <typename T>
kvr_status CheckResultStruct(kvr_error** err, const T* out) {
  if (out == nullptr) return FailInvalid(err, "out is NULL");
  std::string problem = CheckStructSize<T>(out->struct_size);
  return problem.empty() ? KVR_OK : FailInvalid(err, std::move(problem));
}

// Writes a result struct back, no further than the caller's struct_size (checked first with
// CheckResultStruct); a newer caller's tail keeps the zeros its _init wrote.
template <typename T>
kvr_status WriteVersioned(kvr_error** err, const T& value, T* out) {
  if (kvr_status s = CheckResultStruct(err, out)) return s;
  const size_t size = std::min<size_t>(out->struct_size, sizeof(T));
  std::memcpy(reinterpret_cast<char*>(out) + sizeof(uint32_t),
              reinterpret_cast<const char*>(&value) + sizeof(uint32_t), size - sizeof(uint32_t));
  return KVR_OK;
}

}  // namespace kvrouter::capi
