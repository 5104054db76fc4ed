// IngestService: the ingest loop (ingest_loop.h) with the sources this build has, each a unit
// of its own: stream listeners, engine subscriptions (KVR_WITH_ZMQ), NATS subscriptions and
// replica sync (KVR_WITH_NATS).
#include "ingest/ingest_service.h"

#include <pthread.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "ingest/ingest_loop.h"
#include "ingest/replica_sync.h"
#include "ingest/stream_listener.h"
#include "wire/framing.h"
#if KVR_WITH_ZMQ
#include "ingest/engine_subscription.h"
#endif
#if KVR_WITH_NATS
#include "ingest/nats_subscription.h"
#endif

namespace kvrouter {
namespace {

// A source whose transport this build left out: each of its calls says so.
template <IngestTransport kTransport>
struct LeftOut {
  explicit LeftOut(IngestLoop&) {}
  template <typename... Args>
  absl::Status Call(const Args&...) const {
    return TransportAvailable(kTransport);
  }
  void CloseAll() {}
};

#if KVR_WITH_ZMQ
using Engines = EngineSubscriptions;
#else
struct Engines : LeftOut<IngestTransport::kZmq> {
  using LeftOut::LeftOut;
  absl::Status Add(const EngineWorker& w) const { return Call(w); }
  absl::Status Remove(uint64_t id, bool clear) const { return Call(id, clear); }
};
#endif

#if KVR_WITH_NATS
using Nats = NatsSubscriptions;
#else
struct Nats : LeftOut<IngestTransport::kNats> {
  using LeftOut::LeftOut;
  absl::Status SubscribeEvents(const std::string& url, const std::string& subject) const {
    return Call(url, subject);
  }
  absl::Status SyncReplicas(const std::string& url, const std::string& subject,
                            const std::string& replica_id) const {
    return Call(url, subject, replica_id);
  }
  absl::Status SubscribeJetStream(const JetStreamSource& source) const { return Call(source); }
  absl::Status RelayToJetStream(const JetStreamSource& target) const { return Call(target); }
  static const uv_loop_t* BindLoopThread(const uv_loop_t*) { return nullptr; }
  void RanksChanged(const RankChange&) const noexcept {}
};
#endif

}  // namespace

struct IngestService::Impl : IngestLoop {
  StreamListeners listeners{*this};
  Engines engines{*this};
  Nats nats{*this};

  // The NATS calls that connect and confirm on their caller's thread (SubscribeNats,
  // SyncReplicas, SubscribeJetStream, RelayToJetStream) use their connection there after the
  // loop took it: a Stop closing everything meanwhile would destroy it under them. Stop waits
  // for those in flight (each bounded by its connect and confirmation timeouts) and refuses
  // those after it. A Stop on the loop thread cannot wait (a caller in flight may be waiting for
  // that thread): it refuses later calls only.
  std::mutex calls_mutex;
  std::condition_variable calls_ended;
  int calls_in_flight = 0;
  bool calls_closed = false;

  template <typename Call>
  absl::StatusOr<uint64_t> OnCallerThread(Call&& call) {
    {
      std::lock_guard lock(calls_mutex);
      if (calls_closed) return absl::FailedPreconditionError("the ingest service is stopped");
      ++calls_in_flight;
    }
    struct Ended {
      Impl* impl;
      ~Ended() {
        std::lock_guard lock(impl->calls_mutex);
        if (--impl->calls_in_flight == 0) impl->calls_ended.notify_all();
      }
    } ended{this};
    return call();
  }

  void CloseCallerThreadCalls(bool wait) {
    std::unique_lock lock(calls_mutex);
    calls_closed = true;
    if (wait) calls_ended.wait(lock, [&] { return calls_in_flight == 0; });
  }

  // Stopped before Start: this thread runs the loop until everything is closed. What was queued
  // for it runs first (a NATS connection's attachment: its socket is then polled, so that what
  // it buffered, an unsubscription, is written rather than waited for); what is queued after
  // goes with the stop (a JetStream subscription kept for its messages), not the ingest object.
  void CloseWithoutStart() {
    const uv_loop_t* previous = Nats::BindLoopThread(&loop);
    RunCommands();
    CloseEverything();
    uv_run(&loop, UV_RUN_DEFAULT);  // writes what was buffered, runs the close callbacks
    Nats::BindLoopThread(previous);
    std::deque<std::function<void()>> never_run;
    std::lock_guard dropping(command_mutex);
    never_run.swap(commands);
  }

  // The router's rank listener (Router::AddRankListener), until the service is destroyed.
  uint64_t rank_listener = 0;

  void CloseEverything() {
    listeners.CloseAll();
    engines.CloseAll();
    nats.CloseAll();
    if (!uv_is_closing(reinterpret_cast<uv_handle_t*>(&wake))) {
      uv_close(reinterpret_cast<uv_handle_t*>(&wake), nullptr);
    }
  }
};

IngestService::IngestService(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<IngestService>> IngestService::Create(Router* router,
                                                                     IngestOptions options) {
  if (router == nullptr) return absl::InvalidArgumentError("router is null");
  if (options.max_frame_bytes == 0 || options.max_frame_bytes > kMaxFrameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_frame_bytes must be in 1..", kMaxFrameBytes));
  }
  if (options.replica_heartbeat_ms > kMaxReplicaLivenessMs ||
      options.replica_timeout_ms > kMaxReplicaLivenessMs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replica_heartbeat_ms and replica_timeout_ms must be at most ", kMaxReplicaLivenessMs));
  }
  auto impl = std::make_unique<Impl>();
  impl->router = router;
  impl->options = options;
  if (int rc = uv_loop_init(&impl->loop); rc != 0) {
    return absl::InternalError(absl::StrCat("uv_loop_init: ", uv_strerror(rc)));
  }
  impl->wake.data = impl.get();
  uv_async_init(&impl->loop, &impl->wake,
                [](uv_async_t* a) { static_cast<Impl*>(a->data)->RunCommands(); });
  auto service = std::unique_ptr<IngestService>(new IngestService(std::move(impl)));
  // Once the loop can be woken (Post); refused memory, the destructor removes token 0: nothing.
  Impl* loop = service->impl_.get();
  loop->rank_listener = router->AddRankListener(
      [loop](const RankChange& change) { loop->nats.RanksChanged(change); });
  return service;
}

absl::Status IngestService::Start() {
  // Not while a command runs on its caller's thread (IngestLoop::Run before Start).
  std::lock_guard before_start(impl_->before_start_mutex);
  std::lock_guard lock(impl_->command_mutex);
  if (impl_->running || impl_->stopped) {
    return absl::FailedPreconditionError("the ingest service was already started");
  }
  impl_->running = true;
  impl_->thread = std::thread([impl = impl_.get()] {
    // Named for `top -H`, gdb and perf (and the ingest's allocation-failure tests).
    pthread_setname_np(pthread_self(), kIngestThreadName);
    Nats::BindLoopThread(&impl->loop);
    uv_run(&impl->loop, UV_RUN_DEFAULT);
  });
  return absl::OkStatus();
}

void IngestService::Stop() {
  bool on_loop_thread;
  {
    std::lock_guard lock(impl_->command_mutex);  // (Start sets the thread under it)
    on_loop_thread = impl_->running && std::this_thread::get_id() == impl_->thread.get_id();
  }
  impl_->CloseCallerThreadCalls(/*wait=*/!on_loop_thread);
  // Not while a command runs on its caller's thread (IngestLoop::Run before Start).
  std::unique_lock before_start(impl_->before_start_mutex);
  std::unique_lock lock(impl_->command_mutex);
  if (!impl_->stopped) {
    impl_->stopped = true;
    if (!impl_->running) {
      // Unlocked first: closing detaches connection callbacks, which may be posting a command
      // (a disconnection's clear) under their own lock; stopped, they post nothing more.
      lock.unlock();
      impl_->CloseWithoutStart();
      return;
    }
    // The loop ends by itself once the last handle is closed.
    impl_->commands.push_back([impl = impl_.get()] { impl->CloseEverything(); });
    uv_async_send(&impl_->wake);
  }
  // A callback on the loop thread (a route admitted by a replica's free, a replica
  // publisher's) may call Stop too: the loop ends once it returns, so it waits for nothing.
  const bool join = impl_->running && std::this_thread::get_id() != impl_->thread.get_id();
  lock.unlock();
  // Not held while the loop ends: that callback's Stop (or Start) would wait for this one.
  before_start.unlock();
  if (!join) return;
  std::lock_guard joining(impl_->join_mutex);  // two callers may be here at once
  if (impl_->thread.joinable()) impl_->thread.join();
}

IngestService::~IngestService() {
  impl_->router->RemoveRankListener(impl_->rank_listener);  // posts to the loop no more
  Stop();
  uv_loop_close(&impl_->loop);
}

absl::StatusOr<uint64_t> IngestService::Listen(const std::string& endpoint, std::string* bound) {
  return impl_->listeners.Listen(endpoint, bound);
}

absl::StatusOr<uint64_t> IngestService::AddEngineWorker(const EngineWorker& worker) {
  return impl_->engines.Add(worker);
}

absl::Status IngestService::RemoveEngineWorker(uint64_t worker_id, bool clear_index) {
  return impl_->engines.Remove(worker_id, clear_index);
}

absl::StatusOr<uint64_t> IngestService::SubscribeNats(const std::string& url,
                                                      const std::string& subject) {
  return impl_->OnCallerThread([&] { return impl_->nats.SubscribeEvents(url, subject); });
}

absl::StatusOr<uint64_t> IngestService::SyncReplicas(const std::string& url,
                                                     const std::string& subject,
                                                     const std::string& replica_id) {
  return impl_->OnCallerThread([&] { return impl_->nats.SyncReplicas(url, subject, replica_id); });
}

absl::StatusOr<uint64_t> IngestService::SubscribeJetStream(const JetStreamSource& source) {
  return impl_->OnCallerThread([&] { return impl_->nats.SubscribeJetStream(source); });
}

absl::StatusOr<uint64_t> IngestService::RelayToJetStream(const JetStreamSource& target) {
  return impl_->OnCallerThread([&] { return impl_->nats.RelayToJetStream(target); });
}

absl::StatusOr<IngestStats> IngestService::Stats(uint64_t source_id) const {
  std::lock_guard lock(impl_->stats_mutex);
  if (source_id == 0) {
    IngestStats stats = impl_->forgotten_totals;
    for (const auto& [id, source] : impl_->sources) source.counters->AddTo(stats);
    return stats;
  }
  auto it = impl_->sources.find(source_id);
  if (it == impl_->sources.end()) {
    return absl::NotFoundError(absl::StrCat("no ingest source ", source_id));
  }
  IngestStats stats;
  it->second.counters->AddTo(stats);
  return stats;
}

std::vector<IngestSource> IngestService::Sources() const {
  std::lock_guard lock(impl_->stats_mutex);
  std::vector<IngestSource> sources;
  sources.reserve(impl_->sources.size());
  for (const auto& [id, record] : impl_->sources) {
    IngestSource& source = sources.emplace_back();
    source.id = id;
    source.kind = record.kind;
    source.endpoint = record.endpoint;
    record.counters->AddTo(source.stats);
  }
  return sources;
}

absl::StatusOr<std::string> IngestService::Endpoint(uint64_t source_id) const {
  std::lock_guard lock(impl_->stats_mutex);
  auto it = impl_->sources.find(source_id);
  if (it == impl_->sources.end()) {
    return absl::NotFoundError(absl::StrCat("no ingest source ", source_id));
  }
  return it->second.endpoint;
}

}  // namespace kvrouter
