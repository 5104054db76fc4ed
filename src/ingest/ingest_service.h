// KV event ingestion: one libuv loop on its own thread receives events from every source and
// applies them to a Router, concurrently with routing calls on other threads (the Router is
// internally synchronised).
//
// Sources, each a unit of its own (src/README.md):
// - Native stream listeners (TCP, Unix socket): length-prefixed FlatBuffers EventBatches
//   (stream_listener.h).
// - Engine workers (vLLM, SGLang) over ZMQ, with sequence gaps, replay and restarts
//   (engine_subscription.h, sequence_tracker.h). Only in a build with KVR_WITH_ZMQ.
// - NATS subscriptions: native batches and Dynamo's KV event plane; router replica sync
//   (nats_subscription.h, replica_sync.h). Only in a build with KVR_WITH_NATS.
// The loop itself (libuv) is in a build with either transport; without both, Create (and so
// every kvr_ingest_* function) is Unimplemented. TransportAvailable says what a build has.
//
// Every call may come from any thread. Commands made before Start() run on the caller's thread;
// afterwards they are posted to the loop and waited for.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/router.h"

namespace kvrouter {

// The name of the ingest loop's thread (at most 15 characters: the kernel's limit).
inline constexpr char kIngestThreadName[] = "kvr-ingest";

// Why a message or event was not applied.
enum class IngestReject : uint8_t {
  kFrameTooLarge = 0,   // a stream frame header over the limit (connection closed)
  kBadFlatBuffers = 1,  // a frame that is not a valid EventBatch
  kBadMsgpack = 2,      // an engine payload that does not decode
  kBadMessage = 3,      // a ZMQ message without [topic, 8-byte seq, payload]
  kBlockSize = 4,       // a stored event with another block size than the router's
  kIndexRejected = 5,   // the index refused the event (unknown parent, ...)
  kStaleSequence = 6,   // a sequence number already seen (duplicate or reordered)
};
inline constexpr int kNumIngestRejects = 7;

// A copy of one source's counters (or of their sum over every source).
struct IngestStats {
  uint64_t messages = 0;  // frames or ZMQ messages received
  uint64_t events_applied = 0;
  uint64_t rejected[kNumIngestRejects] = {};
  uint64_t gaps = 0;             // sequence jumps forward
  uint64_t missed_messages = 0;  // sum of the jumps' sizes
  uint64_t restarts = 0;         // publisher sequence resets to 0
  uint64_t recoveries = 0;       // clears done because state was lost (gap or restart)
  uint64_t connections = 0;      // stream connections accepted; NATS (re)connections
  uint64_t state_unknown = 0;    // ranks whose state is currently unknown (flagged)
  // Lag from a message's publication time to its events applied, over the messages that
  // carried one. Summed over sources: totals add, maxima take the largest.
  uint64_t lag_samples = 0;
  uint64_t lag_total_us = 0;
  uint64_t lag_max_us = 0;
  uint64_t lag_last_us = 0;
  // Replica sync: changes published, and publications the NATS client refused.
  uint64_t published = 0;
  uint64_t publish_failures = 0;
  // JetStream: the stream sequence of the last message applied (and acknowledged); the
  // position to start from after restoring a snapshot taken after it. Over sources: the
  // largest.
  uint64_t stream_sequence = 0;
  // JetStream: the consumer made again after deliveries were lost on the way or the connection
  // was given up for good by libnats (made again first), counted once the new one is in place,
  // and the attempts that failed and were retried. Core NATS and
  // replica sync: the connection made again after libnats gave it up for good, and the
  // attempts that failed.
  uint64_t consumer_remakes = 0;
  uint64_t consumer_remake_failures = 0;
  // Engine events no router indexes, by design: those of a KV-cache group other than full
  // attention (a hybrid model's sliding-window or Mamba layers), as Dynamo's router leaves them.
  uint64_t events_ignored = 0;
  // Replica sync: publications of a booking with only its leading block ids, the transport's
  // messages being too short for them all (peers under-count their load).
  uint64_t bookings_trimmed = 0;
  // The most recent reject's reason in words (e.g. "event 1: unknown event tag 'X'"), empty if
  // none was given; summed over sources, the most recent of them all.
  std::string last_reject;
  uint64_t last_reject_serial = 0;  // orders the detailed rejects of every source
};

// What a source is (the `kind` label of the Prometheus text).
enum class IngestSourceKind : uint8_t {
  kListener,        // a native stream listener (Listen)
  kEngine,          // an engine worker's ZMQ ranks (AddEngineWorker)
  kNats,            // a NATS subscription to native event batches (SubscribeNats)
  kReplicas,        // router replica sync over NATS (SyncReplicas)
  kJetStream,       // a JetStream consumer of KV events (SubscribeJetStream)
  kJetStreamRelay,  // the relay of the index's changes into a JetStream stream
};

// One source as Sources() lists it.
struct IngestSource {
  uint64_t id = 0;
  IngestSourceKind kind = IngestSourceKind::kListener;
  std::string endpoint;  // as Endpoint(id)
  IngestStats stats;     // as Stats(id)
};

struct IngestOptions {
  uint32_t max_frame_bytes = 64u << 20;
  // How long a replay request may take before the worker is cleared and flagged instead.
  uint32_t replay_timeout_ms = 2000;
  // Replica sync: a heartbeat every replica_heartbeat_ms (0 = none), and the bookings of
  // replicas silent for replica_timeout_ms dropped (0 = never). At most kMaxReplicaLivenessMs.
  uint32_t replica_heartbeat_ms = 1000;
  uint32_t replica_timeout_ms = 10'000;
  // The JetStream relay's queue, while the server is away: beyond it, the relay resyncs.
  size_t relay_backlog_bytes = size_t{64} << 20;
};

// The most ranks one engine worker may have: each is a ZMQ socket and a file descriptor, and
// every worker of an ingest object shares one ZMQ context (1023 sockets by default).
inline constexpr uint32_t kMaxEngineRanks = 256;

struct EngineWorker {
  std::string endpoint;  // tcp://host:port (rank r on port + r; port + dp_size - 1 <= 65535) or
                         // ipc://path (rank r at path_dp<r>)
  uint64_t worker_id = 0;
  uint32_t dp_start = 0;
  uint32_t dp_size = 1;     // 1..kMaxEngineRanks
  uint32_t block_size = 0;  // 0 = the router's; otherwise must equal it
  std::string topic;        // ZMQ subscription prefix; "" = every message
  bool eagle = false;
  // vLLM's replay ROUTER socket (rank r as for `endpoint`); "" = none. On a gap, the missed
  // messages are asked for here first; live messages wait until the replay ends.
  std::string replay_endpoint;
};

// KV events from a NATS JetStream stream (SubscribeJetStream): messages as SubscribeNats takes
// them, kept by the server until this consumer acknowledges each one after applying it.
struct JetStreamSource {
  std::string url;
  std::string stream;   // the stream's name
  std::string subject;  // the subjects to consume (wildcards allowed); the stream's subjects
                        // when it is created
  std::string durable;  // the consumer's name, unique per router; "" = an ephemeral consumer
  uint64_t start_sequence = 0;    // the first stream sequence to deliver; 0 = the stream's first
  bool resume = false;            // an existing durable consumer keeps its position
  bool create_stream = false;     // create the stream if it does not exist, with these limits:
  double max_age_seconds = 3600;  // messages older than this are dropped; 0 = no limit
  int64_t max_bytes = int64_t{1} << 30;  // the oldest messages are dropped beyond; -1 = none
};

class IngestService {
 public:
  // `router` must outlive the service.
  static absl::StatusOr<std::unique_ptr<IngestService>> Create(Router* router,
                                                               IngestOptions options);
  ~IngestService();
  IngestService(const IngestService&) = delete;
  IngestService& operator=(const IngestService&) = delete;

  // Starts the loop thread. FailedPrecondition if already started or stopped.
  absl::Status Start();
  // Closes every source and joins the thread (every caller returns once it has ended; one on
  // the loop thread itself, in a callback, returns at once and the loop ends after the
  // callback). Final: a stopped service takes no more commands. Idempotent.
  void Stop();

  // Listens on "tcp://HOST:PORT" (PORT 0 = any free port) or "unix://PATH". Returns the
  // source id; `bound` receives the endpoint actually bound (with the real port).
  absl::StatusOr<uint64_t> Listen(const std::string& endpoint, std::string* bound);
  // Subscribes to an engine worker's ranks. InvalidArgument for a block size that is not the
  // router's, a dp_size outside 1..kMaxEngineRanks, or an endpoint or replay endpoint that is
  // not tcp://HOST:PORT (a port every rank can have) or ipc://PATH; AlreadyExists for a worker
  // id already subscribed. Returns the source id.
  absl::StatusOr<uint64_t> AddEngineWorker(const EngineWorker& worker);
  // Unsubscribes; with `clear_index`, also drops its entries from the index. NotFound if unknown.
  absl::Status RemoveEngineWorker(uint64_t worker_id, bool clear_index);
  // Subscribes to `subject` (wildcards allowed) on the NATS server at `url`; each message is
  // one native EventBatch (a stream frame's payload, without the length prefix). Reconnects
  // forever and resubscribes after the server restarts. Unavailable if the first connection
  // fails. Returns the source id.
  absl::StatusOr<uint64_t> SubscribeNats(const std::string& url, const std::string& subject);
  // Router replica sync over NATS (shared/reference/dynamo-router.md §7.5): publishes every
  // change to the router's own bookings on `subject` as `replica_id`, and applies the changes
  // other replicas publish there, so that each replica's load view includes the others'
  // requests. The KV index needs no sync: every replica ingests the workers' events itself.
  // `replica_id` must be unique among the live replicas (ValidateReplicaId); joining, the
  // router announces itself (Router::SetSequenceObserver). One sync per ingest object:
  // FailedPrecondition for a second; another publisher installed later on the router replaces
  // it, and stopping this ingest then leaves that one alone. Connection behaviour as
  // SubscribeNats; Unavailable, with nothing left behind, if the server does not confirm the
  // subscription. Returns the source id (its counters: changes received and applied,
  // rejected, published).
  absl::StatusOr<uint64_t> SyncReplicas(const std::string& url, const std::string& subject,
                                        const std::string& replica_id);
  // Consumes KV events from a JetStream stream (JetStreamSource). Each message is acknowledged
  // once applied, so nothing is lost while this router or the server is away: the consumer
  // resumes where it was (unacknowledged messages come again; applying a stretch of events
  // again in order leaves the index as it was). Connects and creates the consumer on the
  // calling thread (not the loop's). InvalidArgument for a bad name, NotFound for a missing
  // stream (without create_stream), Unavailable if the server cannot be reached.
  absl::StatusOr<uint64_t> SubscribeJetStream(const JetStreamSource& source);
  // Republishes every change the other sources make to the index (not a JetStream source's:
  // those are in a stream already) into a JetStream stream, on "<subject>.<worker id>", in
  // order, each message retried until the server acknowledges it (jetstream_relay.h). The
  // stream's consumers (SubscribeJetStream on "<subject>.>") then hold what this router's
  // index holds of those workers. One relay per ingest object (FailedPrecondition for a
  // second); it lasts until Stop, which waits up to JetStreamRelay::kFlushMs for the queue.
  // Errors as SubscribeJetStream; InvalidArgument also for a consumer's settings (durable,
  // start_sequence, resume) or a subject with wildcards. Its counters: `messages` changes
  // handed to it, `events_applied` those acknowledged, `published` messages acknowledged,
  // `publish_failures` attempts retried, `gaps`/`missed_messages` queue overflows and the
  // changes they dropped (a resync sends them again: `recoveries`), `state_unknown` 1 until
  // that resync is acknowledged, `stream_sequence` the last message's position, lag from a
  // change to its acknowledgement.
  absl::StatusOr<uint64_t> RelayToJetStream(const JetStreamSource& target);

  // One source's counters (NotFound if unknown or forgotten, as Endpoint); source_id 0 = the
  // sum over every source ever added.
  absl::StatusOr<IngestStats> Stats(uint64_t source_id) const;
  // Where a source is: a listener's bound endpoint (with its real port), an engine worker's
  // endpoint, a NATS server's url. Kept after the source is removed, for the
  // IngestLoop::kRemovedSourcesKept most recently removed. NotFound if unknown or forgotten.
  absl::StatusOr<std::string> Endpoint(uint64_t source_id) const;
  // Every live source and the most recently removed ones (as Endpoint keeps them), by id.
  std::vector<IngestSource> Sources() const;

  struct Impl;

 private:
  explicit IngestService(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What a build of the library may leave out (CMake options KVR_WITH_ZMQ and KVR_WITH_NATS).
enum class IngestTransport : uint8_t {
  kLoop,  // the ingest loop (libuv) and its stream listeners: with either option ON
  kZmq,   // engine workers (vLLM, SGLang) over ZMQ: KVR_WITH_ZMQ
  kNats,  // NATS subscriptions and replica sync: KVR_WITH_NATS
};

// OK when this build has `transport`; otherwise Unimplemented, naming the build option that
// adds it. The IngestService methods of a transport left out return this error.
absl::Status TransportAvailable(IngestTransport transport);

constexpr std::string_view IngestRejectName(IngestReject reason) {
  switch (reason) {
    case IngestReject::kFrameTooLarge:
      return "frame_too_large";
    case IngestReject::kBadFlatBuffers:
      return "bad_flatbuffers";
    case IngestReject::kBadMsgpack:
      return "bad_msgpack";
    case IngestReject::kBadMessage:
      return "bad_message";
    case IngestReject::kBlockSize:
      return "block_size";
    case IngestReject::kIndexRejected:
      return "index";
    case IngestReject::kStaleSequence:
      return "stale_sequence";
  }
  return "unknown";
}

}  // namespace kvrouter
