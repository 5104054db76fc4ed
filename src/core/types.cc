#include "core/types.h"

#include <absl/strings/match.h>

#include <array>
#include <utility>

namespace kvrouter {

Tier TierFromMedium(std::string_view medium) {
  // docs/ingest.md has the table of which engine (and version) sends which.
  static constexpr std::array<std::pair<std::string_view, Tier>, 14> kMediums = {{
      {"GPU", Tier::kDevice},
      {"DEVICE", Tier::kDevice},
      {"CPU", Tier::kHostPinned},  // vLLM's offloading connector (CPULoadStoreSpec)
      {"CPU_PINNED", Tier::kHostPinned},
      {"CPU_TIER1", Tier::kHostPinned},
      {"CPU_TIER2", Tier::kDisk},
      {"DISK", Tier::kDisk},
      {"NVME", Tier::kDisk},
      {"STORAGE", Tier::kDisk},  // vLLM's tiered offloading: a worker-local storage tier
      {"EXTERNAL", Tier::kExternal},
      {"NETWORK", Tier::kExternal},
      {"REMOTE", Tier::kExternal},
      {"SHARED", Tier::kExternal},
      {"SHARED_STORAGE", Tier::kExternal},  // vLLM's shared-storage offloading spec
  }};
  // Compared in place: a copy would allocate, and the C ABI's kvr_tier_from_medium has no
  // status to report a refused allocation with.
  const absl::string_view given(medium.data(), medium.size());
  for (const auto& [name, tier] : kMediums) {
    if (absl::EqualsIgnoreCase(given, absl::string_view(name.data(), name.size()))) return tier;
  }
  return Tier::kDevice;
}

}  // namespace kvrouter
