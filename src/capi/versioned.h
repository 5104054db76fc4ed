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
#include <iterator>
#include <string>
#include <type_traits>

#include "abi_tables.h"
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
  X(kvr_ingest_stats, connections)             \
  X(kvr_jetstream_source, max_bytes)

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

// The library's defaults for T, with struct_size = sizeof(T): all zero unless T is one of the
// structs below, whose defaults are defined next to the code that converts them, from the core's
// own defaults wherever the core has the setting. noexcept: _init calls it, and nothing may
// unwind into C.
template <typename T>
T Defaults() noexcept {
  T defaults{};
  defaults.struct_size = sizeof(T);
  return defaults;
}
#define KVR_STRUCTS_WITH_DEFAULTS(X)                                                     \
  X(kvr_router_options)                                                                  \
  X(kvr_worker_config)                                                                   \
  X(kvr_request_options)                                                                 \
  X(kvr_routing_hints) X(kvr_disagg_options) X(kvr_prefill_result) X(kvr_ingest_options) \
      X(kvr_engine_worker) X(kvr_jetstream_source)
#define KVR_DECLARE_DEFAULTS_(T) \
  template <>                    \
  T Defaults<T>() noexcept;
KVR_STRUCTS_WITH_DEFAULTS(KVR_DECLARE_DEFAULTS_)
#undef KVR_DECLARE_DEFAULTS_

// How much larger than this library's a newer caller's struct may be: far beyond any real
// growth, it bounds the scan of an unknown tail when struct_size is garbage.
inline constexpr size_t kMaxNewerTail = 4096;

// Whether `size` can be a caller's struct T: one of T's layouts (the first released one, or one
// ending at a later field), or a newer, larger one.
template <typename T>
constexpr bool SizeFits(size_t size) {
  if (size < StructTraits<T>::kFirstSize || size > sizeof(T) + kMaxNewerTail) return false;
  return size >= sizeof(T) ||
         std::find(std::begin(FieldEnds<T>::kEnds), std::end(FieldEnds<T>::kEnds), size) !=
             std::end(FieldEnds<T>::kEnds);
}

// Why a struct_size cannot be a caller's T, for the error message (SizeFits is false).
template <typename T>
std::string SizeProblem(size_t size) {
  const std::string name = StructTraits<T>::kName;
  const std::string fix = ": initialise it with " + name + "_init(&s, sizeof s)";
  const std::string is = name + ".struct_size is " + std::to_string(size);
  if (size == 0) return is + fix + " first";
  if (size < StructTraits<T>::kFirstSize) {
    return is + ", below the " + std::to_string(StructTraits<T>::kFirstSize) +
           " bytes of its first released layout" + fix;
  }
  if (size > sizeof(T)) {
    return is + ", more than any kvrouter's (" + std::to_string(sizeof(T)) + " bytes here)" + fix;
  }
  return is + ", which ends inside a field: no header's " + name + " has that size" + fix;
}

// Writes T's defaults into the caller's `size` bytes at `p`: never past them, zero past the
// fields this library knows, struct_size = size. A size no caller's T can have (SizeFits) is
// refused and the struct zero-filled instead, still recording the size, so that every later
// call refuses it with a message. A size that cannot even hold struct_size writes nothing.
template <typename T>
kvr_status InitVersioned(T* p, size_t size) noexcept {
  if (p == nullptr || size < sizeof(uint32_t) || size > UINT32_MAX) return KVR_INVALID_ARGUMENT;
  auto* bytes = reinterpret_cast<unsigned char*>(p);
  const bool fits = SizeFits<T>(size);
  if (fits) {
    const T defaults = Defaults<T>();
    std::memcpy(bytes, &defaults, std::min(size, sizeof(T)));
    if (size > sizeof(T)) std::memset(bytes + sizeof(T), 0, size - sizeof(T));
  } else {
    std::memset(bytes, 0, std::min(size, sizeof(T) + kMaxNewerTail));
  }
  const uint32_t recorded = static_cast<uint32_t>(size);
  std::memcpy(bytes, &recorded, sizeof recorded);
  return fits ? KVR_OK : KVR_INVALID_ARGUMENT;
}

kvr_status FailInvalid(kvr_error** err, std::string message);

// The reserved fields of an input struct must be 0 (as _init leaves them), so that a later
// release may give them a meaning without misreading a caller who did not start from _init:
// the name of the first that is not, or NULL. (kvr_stored_event's and kvr_removed_event's
// reserved1 are checked with their event's other rules.)
template <typename T>
const char* NonzeroReserved(const T&) {
  return nullptr;
}
inline const char* NonzeroReserved(const kvr_router_options& o) {
  return o.reserved != 0 ? "reserved" : o.reserved2 != 0 ? "reserved2" : nullptr;
}
inline const char* NonzeroReserved(const kvr_request_options& o) {
  return o.reserved != 0 ? "reserved" : o.reserved2 != 0 ? "reserved2" : nullptr;
}
inline const char* NonzeroReserved(const kvr_removed_event& e) {
  return e.reserved != 0 ? "reserved" : nullptr;
}
inline const char* NonzeroReserved(const kvr_routing_hints& h) {
  return h.reserved != 0 ? "reserved" : nullptr;
}
inline const char* NonzeroReserved(const kvr_disagg_options& o) {
  return o.reserved != 0 ? "reserved" : nullptr;
}
inline const char* NonzeroReserved(const kvr_ingest_options& o) {
  return o.reserved != 0 ? "reserved" : nullptr;
}

// Copies a caller's struct over the library's defaults: only the bytes its struct_size covers
// (an older caller's struct is shorter), refusing a newer caller's struct whose fields this
// library does not know unless they are all zero. NULL = the defaults.
template <typename T>
kvr_status ReadVersioned(kvr_error** err, const T* in, T& out) {
  out = Defaults<T>();
  if (in == nullptr) return KVR_OK;
  uint32_t size;
  std::memcpy(&size, in, sizeof size);  // the caller's struct_size
  if (!SizeFits<T>(size)) return FailInvalid(err, SizeProblem<T>(size));
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
  if (const char* field = NonzeroReserved(out)) {
    return FailInvalid(err, std::string(StructTraits<T>::kName) + "." + field +
                                " is reserved and must be 0 (initialise the struct with " +
                                StructTraits<T>::kName + "_init)");
  }
  return KVR_OK;
}

// KVR_OK if `out` (not NULL) can take a result: its struct_size is one this library writes.
template <typename T>
kvr_status CheckResultStruct(kvr_error** err, const T* out) {
  if (out == nullptr) return FailInvalid(err, "out is NULL");
  uint32_t size;
  std::memcpy(&size, out, sizeof size);
  if (!SizeFits<T>(size)) return FailInvalid(err, SizeProblem<T>(size));
  return KVR_OK;
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
