// Status names, error objects, library-owned buffers, and the shared helpers of the C ABI.
#include <absl/status/status.h>

#include "capi_internal.h"

namespace kvrouter::capi {
kvr_status Fail(kvr_error** err, kvr_status status, std::string message) {
  if (err != nullptr) {
    // Made before the caller's previous error goes (that one would otherwise leak): refused
    // memory then leaves no pointer to a freed one, only the status.
    kvr_error* made = new (std::nothrow) kvr_error{status, std::move(message)};
    delete *err;
    *err = made;
  }
  return status;
}

kvr_status FailInvalid(kvr_error** err, std::string message) {
  return Fail(err, KVR_INVALID_ARGUMENT, std::move(message));
}

kvr_status FromStatus(kvr_error** err, const absl::Status& status) {
  if (status.ok()) return KVR_OK;
  return Fail(err, static_cast<kvr_status>(status.code()), std::string(status.message()));
}

kvr_status ReadMmHashes(kvr_error** err, const uint64_t* hashes, const size_t* counts,
                        size_t num_blocks, std::vector<std::vector<uint64_t>>& out) {
  out.clear();
  if (counts == nullptr) return KVR_OK;
  if (kvr_status s = CheckArray(err, counts, num_blocks, "mm_counts")) return s;
  // The hashes' total, checked before any is read: counts that add up past any buffer would
  // wrap the position into the caller's first hashes.
  size_t total = 0;
  for (size_t block = 0; block < num_blocks; ++block) {
    if (counts[block] > SIZE_MAX - total) {
      return Fail(err, KVR_INVALID_ARGUMENT, "mm_counts add up past any buffer");
    }
    total += counts[block];
  }
  if (kvr_status s = CheckArray(err, hashes, total, "mm_hashes")) return s;
  size_t next = 0;
  for (size_t block = 0; block < num_blocks; ++block) {
    out.emplace_back(hashes + next, hashes + next + counts[block]);
    next += counts[block];
  }
  return KVR_OK;
}

}  // namespace kvrouter::capi

extern "C" {

KVR_API const char* kvr_status_str(kvr_status status) {
  switch (status) {
#define KVR_STATUS_CASE_(name, value, description) \
  case KVR_##name:                                 \
    return "KVR_" #name;
    KVR_STATUS_MAP(KVR_STATUS_CASE_)
#undef KVR_STATUS_CASE_
    default:
      return "KVR_UNKNOWN";
  }
}

KVR_API kvr_status kvr_error_status(const kvr_error* error) {
  return error == nullptr ? KVR_OK : error->status;
}

KVR_API const char* kvr_error_message(const kvr_error* error) {
  return error == nullptr ? "" : error->message.c_str();
}

KVR_API void kvr_error_free(kvr_error* error) { delete error; }

KVR_API const uint8_t* kvr_buffer_data(const kvr_buffer* buffer) {
  return buffer == nullptr ? nullptr : buffer->bytes.data();
}

KVR_API size_t kvr_buffer_size(const kvr_buffer* buffer) {
  return buffer == nullptr ? 0 : buffer->bytes.size();
}

KVR_API void kvr_buffer_free(kvr_buffer* buffer) { delete buffer; }

}  // extern "C"
