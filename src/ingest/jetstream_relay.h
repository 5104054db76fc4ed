// The JetStream relay: every change this ingest's sources make to the router's index (after
// their sequence checks, replays, restarts and copies), republished into a JetStream stream as
// native EventBatches, so that router replicas consuming the stream (SubscribeJetStream) hold
// what a router subscribed to the engines itself would, without subscribing to them. It is how
// vLLM and SGLang engines, which publish over ZMQ only, feed a durable stream.
//
// Changes are queued on the loop thread (IndexChangeTap) and published in order by a thread of
// the relay's own: consecutive changes of one worker form one message, on subject
// "<subject>.<worker id>", each retried until the server acknowledges it (with a message id, so
// a retry the server had already stored is not stored twice). The queue is bounded: a change
// that does not fit drops the queue, and once the server acknowledges again the relay resyncs
// the stream: a clear of every rank it relays, then what the index holds of them, then the
// changes queued since. A replica that applies that ends where the index is.
#pragma once

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "core/router.h"
#include "ingest/ingest_loop.h"
#include "ingest/ingest_service.h"

namespace kvrouter {

class JetStreamRelay final : public IndexChangeTap {
 public:
  // Connects to `target.url` (libnats' own threads; reconnecting forever), makes sure the
  // stream exists (created on "<subject>.>" with `create_stream`) and starts publishing.
  // InvalidArgument for a bad configuration (a subject with wildcards, a durable consumer, a
  // start sequence, resume: those are a consumer's), NotFound for a missing stream,
  // Unavailable if the server cannot be reached. `router` is the index the changes are
  // applied to (read when resyncing); it must outlive the relay.
  static absl::StatusOr<std::unique_ptr<JetStreamRelay>> Start(
      const JetStreamSource& target, size_t backlog_bytes, const Router& router,
      std::shared_ptr<SourceCounters> counters);
  // Publishes what is queued for up to kFlushMs more, then closes the connection.
  ~JetStreamRelay() override;
  JetStreamRelay(const JetStreamRelay&) = delete;
  JetStreamRelay& operator=(const JetStreamRelay&) = delete;

  // Loop thread: one change, applied to the index.
  void Changed(const KvEvent& event) override;

  static constexpr int kFlushMs = 2000;

  struct Impl;

 private:
  explicit JetStreamRelay(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvrouter
