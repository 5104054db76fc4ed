// The publisher of kvrouter's native event stream through the C ABI, over
// kvrouter::StreamPublisher (src/ingest/stream_publisher.h).
#include "capi_internal.h"
#include "ingest/stream_publisher.h"

using namespace kvrouter::capi;

struct kvr_publisher {
  std::unique_ptr<kvrouter::StreamPublisher> client;
};

extern "C" {

KVR_API kvr_status kvr_publisher_connect(const char* endpoint, kvr_publisher** out,
                                         kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = RequireNonNull(err, endpoint, "endpoint")) return s;
    if (kvr_status s = RequireNonNull(err, out, "out")) return s;
    auto client = kvrouter::StreamPublisher::Connect(endpoint);
    if (!client.ok()) return FromStatus(err, client.status());
    *out = new kvr_publisher{std::move(*client)};
    return KVR_OK;
  });
}

KVR_API kvr_status kvr_publisher_send_encoded(kvr_publisher* publisher, const void* data,
                                              size_t size, kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = RequireNonNull(err, publisher, "publisher")) return s;
    if (kvr_status s = RequireNonNull(err, data, "data")) return s;
    return FromStatus(err,
                      publisher->client->Send(std::span(static_cast<const uint8_t*>(data), size)));
  });
}

KVR_API kvr_status kvr_publisher_send(kvr_publisher* publisher, const kvr_event_batch* batch,
                                      kvr_error** err) {
  return Guard(err, [&]() -> kvr_status {
    if (kvr_status s = RequireNonNull(err, publisher, "publisher")) return s;
    kvr_buffer* encoded = nullptr;
    if (kvr_status s = kvr_event_batch_encode(batch, &encoded, err)) return s;
    std::unique_ptr<kvr_buffer, decltype(&kvr_buffer_free)> owned(encoded, &kvr_buffer_free);
    return kvr_publisher_send_encoded(publisher, encoded->bytes.data(), encoded->bytes.size(), err);
  });
}

KVR_API void kvr_publisher_free(kvr_publisher* publisher) { delete publisher; }

}  // extern "C"
