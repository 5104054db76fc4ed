// Status names, error objects, library-owned buffers, and the shared helpers of the C ABI.
#include <absl/status/status.h>

#include "capi_internal.h"

namespace kvrouter::capi {
namespace {

// The C status codes below 100 are absl::StatusCode's numbers, so mapping is a cast.
static_assert(KVR_CANCELLED == static_cast<int>(absl::StatusCode::kCancelled));
static_assert(KVR_INVALID_ARGUMENT == static_cast<int>(absl::StatusCode::kInvalidArgument));
static_assert(KVR_DEADLINE_EXCEEDED == static_cast<int>(absl::StatusCode::kDeadlineExceeded));
static_assert(KVR_NOT_FOUND == static_cast<int>(absl::StatusCode::kNotFound));
static_assert(KVR_ALREADY_EXISTS == static_cast<int>(absl::StatusCode::kAlreadyExists));
static_assert(KVR_RESOURCE_EXHAUSTED == static_cast<int>(absl::StatusCode::kResourceExhausted));
static_assert(KVR_FAILED_PRECONDITION == static_cast<int>(absl::StatusCode::kFailedPrecondition));
static_assert(KVR_UNIMPLEMENTED == static_cast<int>(absl::StatusCode::kUnimplemented));
static_assert(KVR_INTERNAL == static_cast<int>(absl::StatusCode::kInternal));
static_assert(KVR_UNAVAILABLE == static_cast<int>(absl::StatusCode::kUnavailable));

}  // namespace

kvr_status Fail(kvr_error** err, kvr_status status, std::string message) {
  if (err != nullptr) {
    delete *err;  // the caller's previous error, if any, would otherwise leak
    *err = new kvr_error{status, std::move(message)};
  }
  return status;
}

kvr_status FromStatus(kvr_error** err, const absl::Status& status) {
  if (status.ok()) return KVR_OK;
  return Fail(err, static_cast<kvr_status>(status.code()), std::string(status.message()));
}

kvr_status ReadMmHashes(kvr_error** err, const uint64_t* hashes, const size_t* counts,
                        size_t num_blocks, std::vector<std::vector<uint64_t>>& out) {
  out.clear();
  if (counts == nullptr) return KVR_OK;
  size_t next = 0;
  for (size_t block = 0; block < num_blocks; ++block) {
    if (counts[block] > 0 && hashes == nullptr) return RequireNonNull(err, hashes, "mm_hashes");
    out.emplace_back(hashes + next, hashes + next + counts[block]);
    next += counts[block];
  }
  return KVR_OK;
}

}  // namespace kvrouter::capi

extern "C" {

KVR_API const char* kvr_status_str(kvr_status status) {
  switch (status) {
    case KVR_OK:
      return "KVR_OK";
    case KVR_CANCELLED:
      return "KVR_CANCELLED";
    case KVR_INVALID_ARGUMENT:
      return "KVR_INVALID_ARGUMENT";
    case KVR_DEADLINE_EXCEEDED:
      return "KVR_DEADLINE_EXCEEDED";
    case KVR_NOT_FOUND:
      return "KVR_NOT_FOUND";
    case KVR_ALREADY_EXISTS:
      return "KVR_ALREADY_EXISTS";
    case KVR_RESOURCE_EXHAUSTED:
      return "KVR_RESOURCE_EXHAUSTED";
    case KVR_FAILED_PRECONDITION:
      return "KVR_FAILED_PRECONDITION";
    case KVR_UNIMPLEMENTED:
      return "KVR_UNIMPLEMENTED";
    case KVR_INTERNAL:
      return "KVR_INTERNAL";
    case KVR_UNAVAILABLE:
      return "KVR_UNAVAILABLE";
    case KVR_BUFFER_TOO_SMALL:
      return "KVR_BUFFER_TOO_SMALL";
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
