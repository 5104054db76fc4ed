#include "ingest/jetstream_relay.h"

#include <nats/nats.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "ingest/jetstream_stream.h"
#include "wire/endpoint.h"
#include "wire/flatbuffers_codec.h"

namespace kvrouter {
namespace {

constexpr int kPublishWaitMs = 2000;  // for the server's acknowledgement of one message
constexpr int kRetryMs = 100;         // between attempts while the server is away
constexpr size_t kMaxEventsPerMessage = 1024;

// What a queued change costs, roughly: the bound on the queue is in these bytes.
size_t QueuedBytes(const KvEvent& event) {
  size_t bytes = sizeof(KvEvent) + 64;
  if (const auto* stored = std::get_if<StoredEvent>(&event.data)) {
    bytes += 8 * (stored->block_hashes.size() + stored->local_hashes.size()) +
             4 * stored->token_ids.size() + stored->lora_name.size() +
             stored->cache_namespace.size();
    for (const auto& mm : stored->block_mm_hashes) bytes += 24 + 8 * mm.size();
  } else if (const auto* removed = std::get_if<RemovedEvent>(&event.data)) {
    bytes += 8 * removed->block_hashes.size();
  }
  return bytes;
}

struct Queued {
  KvEvent event;
  uint64_t queued_ns = 0;  // Unix time, for the lag counters
};

// Validates what a relay's target may hold: a stream and a plain subject prefix, none of a
// consumer's settings.
absl::Status ValidateTarget(const JetStreamSource& target) {
  if (absl::Status valid = ValidateJetStream(target); !valid.ok()) return valid;
  if (target.subject.find_first_of(" \t\r\n*>") != std::string::npos ||
      target.subject.front() == '.' || target.subject.back() == '.') {
    return absl::InvalidArgumentError(absl::StrCat(
        "a relay's subject '", target.subject,
        "' is a prefix (each worker's changes go to <subject>.<worker id>): no wildcards, "
        "spaces or leading or trailing '.'"));
  }
  if (!target.durable.empty() || target.start_sequence != 0 || target.resume) {
    return absl::InvalidArgumentError(
        "a relay publishes: a durable consumer, a start sequence and resume are a consumer's "
        "settings");
  }
  return absl::OkStatus();
}

// A random token that tells this relay's message ids from any earlier relay's.
std::string BootToken() {
  std::random_device random;
  return absl::StrCat(absl::Hex(random()), absl::Hex(random()));
}

}  // namespace

struct JetStreamRelay::Impl {
  const Router* router = nullptr;
  std::shared_ptr<SourceCounters> counters;
  std::string subject_prefix;
  std::string boot = BootToken();
  uint64_t next_message = 1;  // publisher thread
  size_t max_payload = 0;     // the server's limit on one message
  natsConnection* connection = nullptr;
  jsCtx* js = nullptr;
  std::thread publisher;

  // Shared by the loop thread (Changed) and the publisher thread, under `mutex`.
  std::mutex mutex;
  std::condition_variable wake;
  std::deque<Queued> queue;
  size_t backlog_limit = 0;
  size_t backlog = 0;   // QueuedBytes of `queue`
  bool resync = false;  // the queue overflowed: the stream is behind the index
  bool closing = false;
  std::chrono::steady_clock::time_point flush_deadline;
  // Every rank a change was queued for since its last clear: what a resync clears.
  absl::flat_hash_set<WorkerKey> ranks;

  void Queue(const KvEvent& event);
  // The stream is behind the index: what waits is dropped (counted), and the next thing
  // published is a resync.
  void StartResyncLocked();
  void Run();
  // The next run of changes of one worker (up to a message's worth), or false when closing
  // and done.
  bool Next(std::vector<Queued>& run);
  bool Resync();
  // Publishes `events` (one worker's, in order) in as many messages as they need.
  bool PublishRun(const std::vector<Queued>& run);
  // Retries until the server acknowledges or the relay gives up (closing, past its deadline).
  bool Publish(uint64_t worker_id, const std::vector<KvEvent>& events, uint64_t queued_ns);
  bool GivingUp() {
    std::lock_guard lock(mutex);
    return closing && std::chrono::steady_clock::now() >= flush_deadline;
  }
};

void JetStreamRelay::Impl::Queue(const KvEvent& event) {
  const size_t bytes = QueuedBytes(event);
  std::lock_guard lock(mutex);
  ranks.insert(event.worker);
  Bump(counters->messages);
  if (resync) {  // the resync's dump will hold it
    Bump(counters->missed_messages);
    return;
  }
  if (backlog + bytes > backlog_limit) {
    // The server has been away too long: resync once it is back.
    counters->Gap(1);
    StartResyncLocked();
    return;
  }
  queue.push_back({event, UnixNowNanos()});
  backlog += bytes;
  // A rank whose clear is on its way holds nothing a resync would have to clear: forgotten,
  // so that workers that come and go do not grow the set.
  if (std::holds_alternative<ClearedEvent>(event.data)) ranks.erase(event.worker);
  wake.notify_one();
}

void JetStreamRelay::Impl::StartResyncLocked() {
  // (Changes queued before the resync cannot follow its dump: the dump is newer.)
  if (!queue.empty()) Bump(counters->missed_messages, queue.size());
  for (const Queued& dropped : queue) ranks.insert(dropped.event.worker);  // clears among them
  queue.clear();
  backlog = 0;
  resync = true;
  counters->state_unknown.store(1);
  wake.notify_one();
}

bool JetStreamRelay::Impl::Next(std::vector<Queued>& run) {
  run.clear();
  std::unique_lock lock(mutex);
  wake.wait(lock, [&] { return closing || resync || !queue.empty(); });
  if (resync) return true;          // Run resyncs first
  if (queue.empty()) return false;  // closing, and everything was published
  const uint64_t worker = queue.front().event.worker.worker_id;
  while (!queue.empty() && queue.front().event.worker.worker_id == worker &&
         run.size() < kMaxEventsPerMessage) {
    backlog -= QueuedBytes(queue.front().event);
    run.push_back(std::move(queue.front()));
    queue.pop_front();
  }
  return true;
}

void JetStreamRelay::Impl::Run() {
  std::vector<Queued> run;
  while (Next(run)) {
    const bool published = run.empty() ? Resync() : PublishRun(run);
    if (!published) {  // giving up: closing past the deadline
      Bump(counters->missed_messages, run.size());
      break;
    }
  }
  // What could not be published is lost to the stream: counted.
  std::lock_guard lock(mutex);
  if (!queue.empty()) counters->Gap(queue.size());
}

bool JetStreamRelay::Impl::Resync() {
  // Not before the server is back: a dump taken earlier would only grow stale in the queue.
  while (natsConnection_Status(connection) != NATS_CONN_STATUS_CONNECTED) {
    if (GivingUp()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(kRetryMs));
  }
  absl::flat_hash_set<WorkerKey> relayed;
  {
    std::lock_guard lock(mutex);
    relayed = ranks;
    // Changes queued from now on follow the dump below, which may hold some of them already:
    // applying them again, in order, leaves the index as it was.
    resync = false;
  }
  // A clear of every rank this relay speaks for, then what the index holds of them.
  std::vector<KvEvent> events;
  for (const WorkerKey& rank : relayed) {
    events.push_back({.worker = rank, .data = ClearedEvent{}});
  }
  for (KvEvent& event : router->DumpIndexEvents()) {
    if (relayed.contains(event.worker)) events.push_back(std::move(event));
  }
  std::stable_sort(events.begin(), events.end(), [](const KvEvent& a, const KvEvent& b) {
    return a.worker.worker_id < b.worker.worker_id;
  });
  Bump(counters->messages, events.size());
  std::vector<Queued> run;
  const uint64_t now = UnixNowNanos();
  for (size_t i = 0; i < events.size(); ++i) {
    run.push_back({std::move(events[i]), now});
    const bool last_of_worker = i + 1 == events.size() || events[i + 1].worker.worker_id !=
                                                              run.front().event.worker.worker_id;
    if (last_of_worker || run.size() == kMaxEventsPerMessage) {
      if (!PublishRun(run)) {
        Bump(counters->missed_messages, events.size() - i - 1 + run.size());
        return false;
      }
      run.clear();
    }
  }
  Bump(counters->recoveries);
  std::lock_guard lock(mutex);
  if (!resync) counters->state_unknown.store(0);
  return true;
}

bool JetStreamRelay::Impl::PublishRun(const std::vector<Queued>& run) {
  std::vector<KvEvent> events;
  events.reserve(run.size());
  for (const Queued& q : run) events.push_back(q.event);
  return Publish(run.front().event.worker.worker_id, events, run.front().queued_ns);
}

bool JetStreamRelay::Impl::Publish(uint64_t worker_id, const std::vector<KvEvent>& events,
                                   uint64_t queued_ns) {
  const std::vector<uint8_t> bytes = EncodeEventBatch(events, UnixNowNanos());
  if (bytes.size() > max_payload && events.size() > 1) {
    // Too big for one message: halves, in order.
    const auto middle = events.begin() + static_cast<std::ptrdiff_t>(events.size() / 2);
    return Publish(worker_id, {events.begin(), middle}, queued_ns) &&
           Publish(worker_id, {middle, events.end()}, queued_ns);
  }
  if (bytes.size() > max_payload) {
    // One change bigger than a message can be (a store of very many blocks): the stream
    // cannot carry it as is; a resync's dump does, one block per change.
    counters->Reject(
        IngestReject::kFrameTooLarge,
        absl::StrCat("a change of ", bytes.size(), " bytes is over the server's message limit of ",
                     max_payload, ": resyncing"));
    Bump(counters->missed_messages);
    std::lock_guard lock(mutex);
    StartResyncLocked();
    return true;
  }
  const std::string subject = absl::StrCat(subject_prefix, ".", worker_id);
  const std::string id = absl::StrCat(boot, "-", next_message++);
  jsPubOptions options;
  jsPubOptions_Init(&options);
  options.MsgId = id.c_str();
  options.MaxWait = kPublishWaitMs;
  for (;;) {
    jsPubAck* ack = nullptr;
    const natsStatus s = js_Publish(&ack, js, subject.c_str(), bytes.data(),
                                    static_cast<int>(bytes.size()), &options, nullptr);
    if (s == NATS_OK) {
      counters->stream_sequence.store(ack->Sequence, std::memory_order_relaxed);
      jsPubAck_Destroy(ack);
      Bump(counters->published);
      Bump(counters->events_applied, events.size());
      counters->RecordLag(queued_ns);
      return true;
    }
    jsPubAck_Destroy(ack);
    Bump(counters->publish_failures);
    if (GivingUp()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(kRetryMs));
  }
}

JetStreamRelay::JetStreamRelay(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<JetStreamRelay>> JetStreamRelay::Start(
    const JetStreamSource& target, size_t backlog_bytes, const Router& router,
    std::shared_ptr<SourceCounters> counters) {
  if (absl::Status valid = ValidateTarget(target); !valid.ok()) return valid;
  auto impl = std::make_unique<Impl>();
  impl->router = &router;
  impl->counters = std::move(counters);
  impl->subject_prefix = target.subject;
  impl->backlog_limit = backlog_bytes;
  natsOptions* opts = nullptr;
  natsStatus s = natsOptions_Create(&opts);
  if (s == NATS_OK) s = natsOptions_SetURL(opts, target.url.c_str());
  if (s == NATS_OK) s = natsOptions_SetTimeout(opts, 2000);
  if (s == NATS_OK) s = natsOptions_SetAllowReconnect(opts, true);
  if (s == NATS_OK) s = natsOptions_SetMaxReconnect(opts, -1);  // forever
  if (s == NATS_OK) s = natsOptions_SetReconnectWait(opts, kRetryMs);
  if (s == NATS_OK) s = natsConnection_Connect(&impl->connection, opts);
  natsOptions_Destroy(opts);
  if (s == NATS_OK) s = natsConnection_JetStream(&impl->js, impl->connection, nullptr);
  if (s != NATS_OK) {
    const std::string why =
        absl::StrCat("cannot connect to NATS at ", WithoutUserInfo(target.url), ": ",
                     natsStatus_GetText(s), " (", nats_GetLastError(nullptr), ")");
    natsConnection_Destroy(impl->connection);
    return absl::UnavailableError(why);
  }
  JetStreamSource stream = target;
  stream.subject = absl::StrCat(target.subject, ".>");
  if (absl::Status ensured = EnsureStream(impl->js, stream); !ensured.ok()) {
    jsCtx_Destroy(impl->js);
    natsConnection_Destroy(impl->connection);
    return ensured;
  }
  impl->max_payload = static_cast<size_t>(natsConnection_GetMaxPayload(impl->connection));
  Bump(impl->counters->connections);
  impl->publisher = std::thread([impl = impl.get()] { impl->Run(); });
  return std::unique_ptr<JetStreamRelay>(new JetStreamRelay(std::move(impl)));
}

JetStreamRelay::~JetStreamRelay() {
  {
    std::lock_guard lock(impl_->mutex);
    impl_->closing = true;
    impl_->flush_deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kFlushMs);
  }
  impl_->wake.notify_all();
  impl_->publisher.join();
  jsCtx_Destroy(impl_->js);
  natsConnection_Destroy(impl_->connection);
}

void JetStreamRelay::Changed(const KvEvent& event) { impl_->Queue(event); }

}  // namespace kvrouter
