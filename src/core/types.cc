#include "core/types.h"

#include <absl/strings/ascii.h>

#include <array>
#include <utility>

namespace kvrouter {

Tier TierFromMedium(std::string_view medium) {
  static constexpr std::array<std::pair<std::string_view, Tier>, 11> kMediums = {{
      {"GPU", Tier::kDevice},
      {"DEVICE", Tier::kDevice},
      {"CPU_PINNED", Tier::kHostPinned},
      {"CPU_TIER1", Tier::kHostPinned},
      {"CPU_TIER2", Tier::kDisk},
      {"DISK", Tier::kDisk},
      {"NVME", Tier::kDisk},
      {"EXTERNAL", Tier::kExternal},
      {"NETWORK", Tier::kExternal},
      {"REMOTE", Tier::kExternal},
      {"SHARED", Tier::kExternal},
  }};
  const std::string upper = absl::AsciiStrToUpper(absl::string_view(medium.data(), medium.size()));
  for (const auto& [name, tier] : kMediums) {
    if (upper == name) return tier;
  }
  return Tier::kDevice;
}

}  // namespace kvrouter
