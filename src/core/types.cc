#include "core/types.h"

#include <absl/strings/ascii.h>

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
  const std::string upper = absl::AsciiStrToUpper(absl::string_view(medium.data(), medium.size()));
  for (const auto& [name, tier] : kMediums) {
    if (upper == name) return tier;
  }
  return Tier::kDevice;
}

}  // namespace kvrouter
