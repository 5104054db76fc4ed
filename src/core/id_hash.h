// The hash of the tables keyed by string ids that a refused allocation must leave as they were
// (fail_safe_map.h says why not absl's maps): the std::unordered_maps of plans, sessions and
// waiting requests, the load tracker's FailSafeMap of requests. Transparent, so that they are
// looked up by std::string_view. Abseil's string hash, faster than libstdc++'s on short ids
// (Debian's Abseil hashes its own string_view type only).
#pragma once

#include <cstddef>
#include <string_view>

#include "absl/hash/hash.h"
#include "absl/strings/string_view.h"

namespace kvrouter {

struct IdHash {
  using is_transparent = void;
  // Not noexcept on purpose: libstdc++ then keeps each node's hash, so that a lookup compares
  // hashes before ids and an erase or a rehash does not hash again.
  size_t operator()(std::string_view id) const {
    return absl::Hash<absl::string_view>{}(absl::string_view(id.data(), id.size()));
  }
};

}  // namespace kvrouter
