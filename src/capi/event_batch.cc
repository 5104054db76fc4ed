// Building FlatBuffers event batches through the C ABI, for publishers in any language.
#include <optional>

#include "capi_internal.h"
#include "core/clock.h"
#include "wire/flatbuffers_codec.h"
#include "wire/framing.h"

using namespace kvrouter::capi;

struct kvr_event_batch {
  std::vector<kvrouter::KvEvent> events;
  // Set by kvr_event_batch_set_publish_time; otherwise the wall clock at encoding.
  std::optional<uint64_t> publish_time_ns;
};

namespace {

kvr_status Append(kvr_event_batch* batch, kvrouter::KvEvent event) {
  batch->events.push_back(std::move(event));
  return KVR_OK;
}

}  // namespace

extern "C" {

KVR_API kvr_status kvr_event_batch_new(kvr_event_batch** out, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = RequireNonNull(err, out, "out")) return s;
    *out = new kvr_event_batch();
    return KVR_OK;
  });
}

KVR_API void kvr_event_batch_free(kvr_event_batch* batch) { delete batch; }

KVR_API kvr_status kvr_event_batch_add_stored(kvr_event_batch* batch, const kvr_stored_event* event,
                                              kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = RequireNonNull(err, batch, "batch")) return s;
    kvrouter::KvEvent core;
    if (kvr_status s = ToStoredEvent(err, event, core)) return s;
    return Append(batch, std::move(core));
  });
}

KVR_API kvr_status kvr_event_batch_add_removed(kvr_event_batch* batch,
                                               const kvr_removed_event* event, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = RequireNonNull(err, batch, "batch")) return s;
    kvrouter::KvEvent core;
    if (kvr_status s = ToRemovedEvent(err, event, core)) return s;
    return Append(batch, std::move(core));
  });
}

KVR_API kvr_status kvr_event_batch_add_cleared(kvr_event_batch* batch, uint64_t worker_id,
                                               uint32_t dp_rank, uint64_t event_id,
                                               kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = RequireNonNull(err, batch, "batch")) return s;
    return Append(batch, kvrouter::KvEvent{.worker = {worker_id, dp_rank},
                                           .event_id = event_id,
                                           .data = kvrouter::ClearedEvent{}});
  });
}

KVR_API size_t kvr_event_batch_size(const kvr_event_batch* batch) {
  return batch == nullptr ? 0 : batch->events.size();
}

KVR_API kvr_status kvr_event_batch_set_publish_time(kvr_event_batch* batch, uint64_t unix_ns,
                                                    kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = RequireNonNull(err, batch, "batch")) return s;
    batch->publish_time_ns = unix_ns;
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_event_batch_encode(const kvr_event_batch* batch, kvr_buffer** out,
                                          kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = RequireNonNull(err, batch, "batch")) return s;
    if (kvr_status s = RequireNonNull(err, out, "out")) return s;
    // No decoder takes a batch over a frame's limit (kvr_router_apply_event_batch, a stream
    // listener, a NATS source): a larger one is refused here, not there.
    auto encoded = kvrouter::EncodeEventBatchWithin(
        batch->events, batch->publish_time_ns.value_or(kvrouter::UnixNowNanos()),
        kvrouter::kMaxFrameBytes);
    if (!encoded.ok()) return FromStatus(err, encoded.status());
    *out = new kvr_buffer{*std::move(encoded)};
    return KVR_OK;
  });
}

KVR_API void kvr_event_batch_clear(kvr_event_batch* batch) {
  if (batch == nullptr) return;
  batch->events.clear();
  batch->publish_time_ns.reset();
}

}  // extern "C"
