// Checks of the enumerated values and flag bits callers pass, from the header's own lists (the
// X-macro lists and the generated flag masks): a value this library does not know is refused
// with a message, never cast into the core. enumerations.cc checks the lists against the core.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "abi_tables.h"
#include "kvrouter.h"

namespace kvrouter::capi {

#define KVR_CASE_(name, value, description) case value:
#define KVR_KNOWN_VALUE_(function, map)     \
  constexpr bool function(uint32_t value) { \
    switch (value) {                        \
      map(KVR_CASE_) return true;           \
      default:                              \
        return false;                       \
    }                                       \
  }
KVR_KNOWN_VALUE_(KnownTier, KVR_TIER_MAP)
KVR_KNOWN_VALUE_(KnownQueuePolicy, KVR_QUEUE_POLICY_MAP)
KVR_KNOWN_VALUE_(KnownCostFunction, KVR_COST_FUNCTION_MAP)
KVR_KNOWN_VALUE_(KnownPhase, KVR_PHASE_MAP)
KVR_KNOWN_VALUE_(KnownSessionMode, KVR_SESSION_MODE_MAP)
KVR_KNOWN_VALUE_(KnownDisaggPolicy, KVR_DISAGG_POLICY_MAP)
KVR_KNOWN_VALUE_(KnownEngine, KVR_ENGINE_MAP)
#undef KVR_KNOWN_VALUE_
#undef KVR_CASE_

kvr_status FailInvalid(kvr_error** err, std::string message);

// KVR_INVALID_ARGUMENT naming the field unless `known(value)`; `kind` names the constants
// ("KVR_QUEUE_*").
inline kvr_status CheckValue(kvr_error** err, bool (*known)(uint32_t), uint32_t value,
                             const char* field, const char* kind) {
  if (known(value)) return KVR_OK;
  return FailInvalid(err, std::string(field) + " " + std::to_string(value) + " is not a " + kind +
                              " value this library knows");
}

// KVR_INVALID_ARGUMENT naming the field if `flags` has a bit outside `known`: a newer caller's
// flag is refused rather than ignored, as its unknown fields are.
inline kvr_status CheckFlags(kvr_error** err, uint32_t flags, uint32_t known, const char* field) {
  if ((flags & ~known) == 0) return KVR_OK;
  char text[96];
  std::snprintf(text, sizeof text, " 0x%x has bits this library does not know (it knows 0x%x)",
                flags, known);
  return FailInvalid(err, field + std::string(text));
}

}  // namespace kvrouter::capi
