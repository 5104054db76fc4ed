// Access to the read-only shared data (traces, vectors) from tests.
#pragma once

#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace kvrouter::testing {

inline std::string SharedPath(const std::string& relative) {
  return std::string(KVR_SHARED_DIR) + "/" + relative;
}

inline nlohmann::json LoadSharedJson(const std::string& relative) {
  std::ifstream in(SharedPath(relative));
  if (!in) throw std::runtime_error("cannot open " + SharedPath(relative));
  return nlohmann::json::parse(in);
}

}  // namespace kvrouter::testing
