#include "ingest/jetstream_relay.h"

#include <nats/nats.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <variant>
#include <vector>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "ingest/jetstream_stream.h"
#include "wire/endpoint.h"
#include "wire/flatbuffers_codec.h"

namespace kvrouter {
namespace {

constexpr int kPublishWaitMs = 2000;  // for the server's acknowledgement of one message
constexpr int kRetryMs = 100;         // between attempts while the server is away
// Between attempts to make again a connection the NATS client gave up, doubling from kRetryMs.
constexpr std::chrono::milliseconds kLongestRemakePause(2000);
constexpr size_t kMaxEventsPerMessage = 1024;
constexpr size_t kHeaderRoom = 1024;  // the message id header js_Publish adds

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
  } else if (const auto* sliding = std::get_if<SlidingStoredEvent>(&event.data)) {
    bytes += 8 * (sliding->block_hashes.size() + sliding->sequence_hashes.size());
  } else if (const auto* sliding_removed = std::get_if<SlidingRemovedEvent>(&event.data)) {
    bytes += 8 * sliding_removed->block_hashes.size();
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

// `event` as two changes of about half its blocks each, in order (the second's parent the
// first's last block), or false if it has fewer than two blocks (or tokens that do not divide
// by block).
bool SplitInHalf(const KvEvent& event, uint32_t block_size, KvEvent& first, KvEvent& second) {
  first = event;
  second = event;
  // Sliding-window blocks are independent of each other (no parent): any cut will do.
  if (const auto* sliding = std::get_if<SlidingStoredEvent>(&event.data)) {
    const size_t blocks = sliding->block_hashes.size(), half = blocks / 2;
    if (blocks < 2) return false;
    auto& a = std::get<SlidingStoredEvent>(first.data);
    auto& b = std::get<SlidingStoredEvent>(second.data);
    a.block_hashes.resize(half);
    b.block_hashes.erase(b.block_hashes.begin(), b.block_hashes.begin() + half);
    if (!sliding->sequence_hashes.empty()) {
      a.sequence_hashes.resize(half);
      b.sequence_hashes.erase(b.sequence_hashes.begin(), b.sequence_hashes.begin() + half);
    }
    return true;
  }
  if (const auto* removed = std::get_if<SlidingRemovedEvent>(&event.data)) {
    const size_t blocks = removed->block_hashes.size(), half = blocks / 2;
    if (blocks < 2) return false;
    std::get<SlidingRemovedEvent>(first.data).block_hashes.resize(half);
    auto& rest = std::get<SlidingRemovedEvent>(second.data).block_hashes;
    rest.erase(rest.begin(), rest.begin() + half);
    return true;
  }
  if (const auto* removed = std::get_if<RemovedEvent>(&event.data)) {
    const auto& hashes = removed->block_hashes;
    if (hashes.size() < 2) return false;
    const auto middle = hashes.begin() + static_cast<std::ptrdiff_t>(hashes.size() / 2);
    std::get<RemovedEvent>(first.data).block_hashes.assign(hashes.begin(), middle);
    std::get<RemovedEvent>(second.data).block_hashes.assign(middle, hashes.end());
    return true;
  }
  const auto* stored = std::get_if<StoredEvent>(&event.data);
  if (stored == nullptr || stored->block_hashes.size() < 2) return false;
  const size_t blocks = stored->block_hashes.size(), half = blocks / 2;
  const size_t lookahead = stored->eagle ? 1 : 0;  // eagle windows end one token further
  const bool tokens = !stored->token_ids.empty();
  if (tokens && stored->token_ids.size() != blocks * block_size + lookahead) return false;
  auto slice = [](const auto& all, size_t from, size_t to) {
    return std::decay_t<decltype(all)>(all.begin() + static_cast<std::ptrdiff_t>(from),
                                       all.begin() + static_cast<std::ptrdiff_t>(to));
  };
  auto& a = std::get<StoredEvent>(first.data);
  auto& b = std::get<StoredEvent>(second.data);
  a.block_hashes = slice(stored->block_hashes, 0, half);
  b.block_hashes = slice(stored->block_hashes, half, blocks);
  b.parent_hash = stored->block_hashes[half - 1];
  if (stored->local_hashes.size() == blocks) {
    a.local_hashes = slice(stored->local_hashes, 0, half);
    b.local_hashes = slice(stored->local_hashes, half, blocks);
  }
  if (stored->block_mm_hashes.size() == blocks) {
    a.block_mm_hashes = slice(stored->block_mm_hashes, 0, half);
    b.block_mm_hashes = slice(stored->block_mm_hashes, half, blocks);
  }
  if (tokens) {
    a.token_ids = slice(stored->token_ids, 0, half * block_size + lookahead);
    b.token_ids = slice(stored->token_ids, half * block_size, blocks * block_size + lookahead);
  }
  return true;
}

// Whether a NATS subject pattern (`*` one token, `>` the rest) matches `subject`.
bool SubjectMatches(std::string_view pattern, std::string_view subject) {
  // (Debian's Abseil has a string_view of its own: strings in, strings out.)
  const std::vector<std::string> p = absl::StrSplit(std::string(pattern), '.');
  const std::vector<std::string> s = absl::StrSplit(std::string(subject), '.');
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] == ">") return s.size() > i;
    if (i >= s.size() || (p[i] != "*" && p[i] != s[i])) return false;
  }
  return p.size() == s.size();
}

// The stream takes every "<prefix>.<worker id>" (one of its subjects matches two of them: no
// pattern names worker ids one by one), or InvalidArgument naming its subjects.
absl::Status CheckStreamTakes(jsCtx* js, const JetStreamSource& target) {
  jsStreamInfo* info = nullptr;
  jsErrCode code = static_cast<jsErrCode>(0);
  natsStatus s = js_GetStreamInfo(&info, js, target.stream.c_str(), nullptr, &code);
  if (s != NATS_OK) return JetStreamError("looking up the stream", s, code);
  bool takes = false;
  std::vector<std::string> subjects;
  for (int i = 0; i < info->Config->SubjectsLen; ++i) {
    const std::string_view pattern = info->Config->Subjects[i];
    subjects.emplace_back(pattern);
    takes = takes || (SubjectMatches(pattern, absl::StrCat(target.subject, ".0")) &&
                      SubjectMatches(pattern, absl::StrCat(target.subject, ".1")));
  }
  jsStreamInfo_Destroy(info);
  if (takes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("the JetStream stream '", target.stream,
                                                 "' takes ", absl::StrJoin(subjects, ", "),
                                                 ", not ", target.subject, ".<worker id>"));
}

// A connection to `url` (reconnecting forever) and its JetStream context, or the failure in
// words (nothing left allocated).
absl::Status ConnectJetStream(const std::string& url, natsConnection** connection, jsCtx** js) {
  natsOptions* opts = nullptr;
  natsStatus s = ReconnectingOptions(url, &opts);
  if (s == NATS_OK) s = natsConnection_Connect(connection, opts);
  natsOptions_Destroy(opts);
  if (s == NATS_OK) s = natsConnection_JetStream(js, *connection, nullptr);
  if (s == NATS_OK) return absl::OkStatus();
  const std::string why =
      absl::StrCat("cannot connect to NATS at ", WithoutUserInfo(url), ": ", natsStatus_GetText(s),
                   " (", nats_GetLastError(nullptr), ")");
  natsConnection_Destroy(std::exchange(*connection, nullptr));
  return absl::UnavailableError(why);
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
  uint32_t block_size = 0;
  size_t acknowledged = 0;  // publisher thread: events of the current run acknowledged
  // The publisher thread's (and Start's, before it runs; the destructor's, after).
  std::string url;
  natsConnection* connection = nullptr;
  jsCtx* js = nullptr;
  size_t max_payload = 0;  // the server's limit on one message, less the header's room
  std::chrono::steady_clock::time_point next_remake;  // of a connection given up
  // Reset only once a message is acknowledged: a server that takes the connection and closes
  // it again (an account's limit refused) is not connected to ten times a second.
  std::chrono::milliseconds remake_pause{kRetryMs};
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
  std::unordered_set<WorkerKey, absl::Hash<WorkerKey>> ranks;  // not absl's: see block_copies.h

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
  // `changes`: how many of the run's changes its acknowledgement completes.
  bool Publish(uint64_t worker_id, const std::vector<KvEvent>& events, uint64_t queued_ns,
               size_t changes);
  bool PublishInParts(uint64_t worker_id, const std::vector<KvEvent>& events, uint64_t queued_ns,
                      size_t changes);
  // Reads max_payload: when a connection is made, and when the client refused a message as too
  // large (a reconnection may meet another server).
  void ReadMaxPayload() {
    const auto limit = static_cast<size_t>(natsConnection_GetMaxPayload(connection));
    max_payload = limit > 2 * kHeaderRoom ? limit - kHeaderRoom : limit / 2;
  }
  // A connection the NATS client gave up for good (a server's error, such as an authorization
  // refused twice; it retries anything else forever) is made again: its own retries never
  // will. Attempts back off to kLongestRemakePause; what waits is published once one succeeds
  // (a message retried keeps its id: the server stores it once, within the stream's duplicate
  // window). None while closing: the stop would wait for its connect.
  void RemakeIfGivenUp();
  bool Closing() {
    std::lock_guard lock(mutex);
    return closing;
  }
  bool GivingUp() {
    std::lock_guard lock(mutex);
    return closing && std::chrono::steady_clock::now() >= flush_deadline;
  }
  // How long the server may take to acknowledge: less, closing, than what is left of the
  // deadline.
  int64_t PublishWaitMs() {
    std::lock_guard lock(mutex);
    if (!closing) return kPublishWaitMs;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        flush_deadline - std::chrono::steady_clock::now());
    return std::clamp<int64_t>(left.count(), 1, kPublishWaitMs);
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
    acknowledged = 0;
    const bool published = !GivingUp() && (run.empty() ? Resync() : PublishRun(run));
    if (!published) {  // giving up: closing past the deadline
      Bump(counters->missed_messages, run.size() - acknowledged);
      break;
    }
  }
  // What could not be published is lost to the stream: counted.
  std::lock_guard lock(mutex);
  if (!queue.empty()) counters->Gap(queue.size());
}

void JetStreamRelay::Impl::RemakeIfGivenUp() {
  if (std::chrono::steady_clock::now() < next_remake || Closing() ||
      natsConnection_Status(connection) != NATS_CONN_STATUS_CLOSED) {
    return;
  }
  natsConnection* made = nullptr;
  jsCtx* made_js = nullptr;
  if (ConnectJetStream(url, &made, &made_js).ok()) {
    jsCtx_Destroy(std::exchange(js, made_js));
    natsConnection_Destroy(std::exchange(connection, made));
    ReadMaxPayload();
    Bump(counters->connections);
    Bump(counters->consumer_remakes);
  } else {
    Bump(counters->consumer_remake_failures);
  }
  // From the attempt's end: a connect that timed out is no pause.
  next_remake = std::chrono::steady_clock::now() + remake_pause;
  remake_pause = std::min(remake_pause * 2, kLongestRemakePause);
}

bool JetStreamRelay::Impl::Resync() {
  // Not before the server is back: a dump taken earlier would only grow stale in the queue.
  while (natsConnection_Status(connection) != NATS_CONN_STATUS_CONNECTED) {
    if (GivingUp()) return false;
    RemakeIfGivenUp();
    std::this_thread::sleep_for(std::chrono::milliseconds(kRetryMs));
  }
  std::unordered_set<WorkerKey, absl::Hash<WorkerKey>> relayed;
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
      acknowledged = 0;
      if (GivingUp() || !PublishRun(run)) {
        Bump(counters->missed_messages, events.size() - i - 1 + run.size() - acknowledged);
        acknowledged = 0;
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
  return Publish(run.front().event.worker.worker_id, events, run.front().queued_ns, events.size());
}

bool JetStreamRelay::Impl::Publish(uint64_t worker_id, const std::vector<KvEvent>& events,
                                   uint64_t queued_ns, size_t changes) {
  const std::vector<uint8_t> bytes = EncodeEventBatch(events, UnixNowNanos());
  const std::string subject = absl::StrCat(subject_prefix, ".", worker_id);
  const std::string id = absl::StrCat(boot, "-", next_message++);
  jsPubOptions options;
  jsPubOptions_Init(&options);
  options.MsgId = id.c_str();
  for (;;) {
    // (At every attempt: the server met on a reconnection may take less. Then, if an earlier
    // attempt was stored without its acknowledgement coming back, its parts are stored too:
    // a consumer applies the same changes twice, in order.)
    if (bytes.size() > max_payload) return PublishInParts(worker_id, events, queued_ns, changes);
    options.MaxWait = PublishWaitMs();
    jsPubAck* ack = nullptr;
    const natsStatus s = js_Publish(&ack, js, subject.c_str(), bytes.data(),
                                    static_cast<int>(bytes.size()), &options, nullptr);
    if (s == NATS_OK) {
      counters->stream_sequence.store(ack->Sequence, std::memory_order_relaxed);
      jsPubAck_Destroy(ack);
      Bump(counters->published);
      Bump(counters->events_applied, changes);
      acknowledged += changes;
      counters->RecordLag(queued_ns);
      remake_pause = std::chrono::milliseconds(kRetryMs);
      return true;
    }
    jsPubAck_Destroy(ack);
    if (s == NATS_MAX_PAYLOAD) ReadMaxPayload();
    Bump(counters->publish_failures);
    if (GivingUp()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(kRetryMs));
    RemakeIfGivenUp();
  }
}

// Too big for one message: two halves of the run, in order, or of its one change (a store or
// removal of very many blocks, split by blocks). A change counts once, when its last part is
// acknowledged: `changes` are the run's last ones.
bool JetStreamRelay::Impl::PublishInParts(uint64_t worker_id, const std::vector<KvEvent>& events,
                                          uint64_t queued_ns, size_t changes) {
  std::vector<KvEvent> first, second;
  if (events.size() > 1) {
    const size_t half = events.size() / 2;
    first.assign(events.begin(), events.begin() + static_cast<std::ptrdiff_t>(half));
    second.assign(events.begin() + static_cast<std::ptrdiff_t>(half), events.end());
  } else {
    first.resize(1);
    second.resize(1);
    if (!SplitInHalf(events.front(), block_size, first.front(), second.front())) {
      // One block over the limit: it cannot be carried at all.
      counters->Reject(IngestReject::kFrameTooLarge,
                       absl::StrCat("a change of one block is over the server's message limit "
                                    "of ",
                                    max_payload, " bytes: not relayed"));
      Bump(counters->missed_messages, changes);
      return true;
    }
  }
  const size_t counted_in_first =
      first.size() > events.size() - changes ? first.size() - (events.size() - changes) : 0;
  const size_t parts_of_one = events.size() == 1 ? 0 : counted_in_first;
  return Publish(worker_id, first, queued_ns, parts_of_one) &&
         Publish(worker_id, second, queued_ns, changes - parts_of_one);
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
  impl->url = target.url;
  if (absl::Status connected = ConnectJetStream(target.url, &impl->connection, &impl->js);
      !connected.ok()) {
    return connected;
  }
  impl->ReadMaxPayload();
  JetStreamSource stream = target;
  stream.subject = absl::StrCat(target.subject, ".>");
  absl::Status ready = EnsureStream(impl->js, stream);
  if (ready.ok()) ready = CheckStreamTakes(impl->js, target);
  if (!ready.ok()) {
    jsCtx_Destroy(impl->js);
    natsConnection_Destroy(impl->connection);
    return ready;
  }
  impl->block_size = router.block_size();
  // What the index holds already (a restored snapshot, sources added first) goes out first,
  // as a resync: the stream's consumers hold it too, whatever they held of those ranks.
  for (const KvEvent& event : router.DumpIndexEvents()) {
    if (std::holds_alternative<StoredEvent>(event.data) ||
        std::holds_alternative<SlidingStoredEvent>(event.data)) {
      impl->ranks.insert(event.worker);
    }
  }
  if (!impl->ranks.empty()) {
    impl->resync = true;
    impl->counters->state_unknown.store(1);
  }
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
