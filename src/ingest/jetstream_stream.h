// What the JetStream consumer (nats_subscription.cc) and the JetStream relay
// (jetstream_relay.cc) share: checking a stream's configuration, and making sure the stream
// exists. Internal to the NATS units (it includes libnats' header).
#pragma once

#include <nats/nats.h>

#include <string>

#include "absl/status/status.h"
#include "ingest/ingest_service.h"

namespace kvrouter {

// New connection options every NATS connection of the ingest shares: `url`, a 2 s connect
// timeout, reconnecting forever every 100 ms. NATS_OK, or the failure (nothing allocated).
natsStatus ReconnectingOptions(const std::string& url, natsOptions** out);

// The url, stream and subject are given and the names and limits are valid (the durable
// consumer's name too, when there is one).
absl::Status ValidateJetStream(const JetStreamSource& config);

// A JetStream API call that failed, in words (the server's error code when it gave one).
absl::Status JetStreamError(const std::string& what, natsStatus s, jsErrCode code);

// The stream exists afterwards (created on `config.subject` with its limits when
// `create_stream`), or NotFound.
absl::Status EnsureStream(jsCtx* js, const JetStreamSource& config);

}  // namespace kvrouter
