// Calling the C ABI from the replay tool: a failure becomes an exception carrying the
// router's message (the tool has no way to go on without its router).
#pragma once

#include <stdexcept>
#include <string>

#include "kvrouter.h"

namespace kvrouter::replay {

// Runs `call(&error)` (an ABI call taking a kvr_error**) and throws std::runtime_error
// "<what> failed: <status>: <message>" unless it returns KVR_OK.
template <typename Call>
void CheckAbi(const char* what, Call call) {
  kvr_error* error = nullptr;
  const kvr_status status = call(&error);
  if (status == KVR_OK) return;
  std::string message = std::string(what) + " failed: " + kvr_status_str(status);
  if (error != nullptr) {
    message += ": ";
    message += kvr_error_message(error);
    kvr_error_free(error);
  }
  throw std::runtime_error(message);
}

}  // namespace kvrouter::replay
