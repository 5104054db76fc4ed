// IngestService: the ingest loop (ingest_loop.h) with the sources this build has, each a unit
// of its own: stream listeners, engine subscriptions (KVR_WITH_ZMQ), NATS subscriptions and
// replica sync (KVR_WITH_NATS).
#include "ingest/ingest_service.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "ingest/ingest_loop.h"
#include "ingest/stream_listener.h"
#include "wire/framing.h"
#if KVR_WITH_ZMQ
#include "ingest/engine_subscription.h"
#endif
#if KVR_WITH_NATS
#include "ingest/nats_subscription.h"
#endif

namespace kvrouter {

struct IngestService::Impl : IngestLoop {
  StreamListeners listeners{*this};
#if KVR_WITH_ZMQ
  EngineSubscriptions engines{*this};
#endif
#if KVR_WITH_NATS
  NatsSubscriptions nats{*this};
#endif

  void CloseEverything() {
    listeners.CloseAll();
#if KVR_WITH_ZMQ
    engines.CloseAll();
#endif
#if KVR_WITH_NATS
    nats.CloseAll();
#endif
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
  auto impl = std::make_unique<Impl>();
  impl->router = router;
  impl->options = options;
#if KVR_WITH_NATS
  NatsSubscriptions::InitAdapter();
#endif
  if (int rc = uv_loop_init(&impl->loop); rc != 0) {
    return absl::InternalError(absl::StrCat("uv_loop_init: ", uv_strerror(rc)));
  }
  impl->wake.data = impl.get();
  uv_async_init(&impl->loop, &impl->wake,
                [](uv_async_t* a) { static_cast<Impl*>(a->data)->RunCommands(); });
  return std::unique_ptr<IngestService>(new IngestService(std::move(impl)));
}

absl::Status IngestService::Start() {
  std::lock_guard lock(impl_->command_mutex);
  if (impl_->running || impl_->stopped) {
    return absl::FailedPreconditionError("the ingest service was already started");
  }
  impl_->running = true;
  impl_->thread = std::thread([impl = impl_.get()] {
#if KVR_WITH_NATS
    NatsSubscriptions::BindLoopThread(&impl->loop);
#endif
    uv_run(&impl->loop, UV_RUN_DEFAULT);
  });
  return absl::OkStatus();
}

void IngestService::Stop() {
  std::unique_lock lock(impl_->command_mutex);
  if (impl_->stopped) return;
  impl_->stopped = true;
  if (impl_->running) {
    // The loop ends by itself once the last handle is closed.
    impl_->commands.push_back([impl = impl_.get()] { impl->CloseEverything(); });
    uv_async_send(&impl_->wake);
    lock.unlock();
    impl_->thread.join();
  } else {
    impl_->CloseEverything();
    lock.unlock();
    uv_run(&impl_->loop, UV_RUN_DEFAULT);  // runs the close callbacks
  }
}

IngestService::~IngestService() {
  Stop();
  uv_loop_close(&impl_->loop);
}

absl::StatusOr<uint64_t> IngestService::Listen(const std::string& endpoint, std::string* bound) {
  return impl_->listeners.Listen(endpoint, bound);
}

absl::StatusOr<uint64_t> IngestService::AddEngineWorker(const EngineWorker& worker) {
#if KVR_WITH_ZMQ
  return impl_->engines.Add(worker);
#else
  return TransportAvailable(IngestTransport::kZmq);
#endif
}

absl::Status IngestService::RemoveEngineWorker(uint64_t worker_id, bool clear_index) {
#if KVR_WITH_ZMQ
  return impl_->engines.Remove(worker_id, clear_index);
#else
  return TransportAvailable(IngestTransport::kZmq);
#endif
}

absl::StatusOr<uint64_t> IngestService::SubscribeNats(const std::string& url,
                                                      const std::string& subject) {
#if KVR_WITH_NATS
  return impl_->nats.SubscribeEvents(url, subject);
#else
  return TransportAvailable(IngestTransport::kNats);
#endif
}

absl::StatusOr<uint64_t> IngestService::SyncReplicas(const std::string& url,
                                                     const std::string& subject,
                                                     const std::string& replica_id) {
#if KVR_WITH_NATS
  return impl_->nats.SyncReplicas(url, subject, replica_id);
#else
  return TransportAvailable(IngestTransport::kNats);
#endif
}

absl::StatusOr<IngestStats> IngestService::Stats(uint64_t source_id) const {
  std::lock_guard lock(impl_->stats_mutex);
  IngestStats stats;
  if (source_id == 0) {
    for (const auto& [id, c] : impl_->counters) c->AddTo(stats);
    return stats;
  }
  auto it = impl_->counters.find(source_id);
  if (it == impl_->counters.end()) {
    return absl::NotFoundError(absl::StrCat("no ingest source ", source_id));
  }
  it->second->AddTo(stats);
  return stats;
}

absl::StatusOr<std::string> IngestService::Endpoint(uint64_t source_id) const {
  std::lock_guard lock(impl_->stats_mutex);
  auto it = impl_->endpoints.find(source_id);
  if (it == impl_->endpoints.end()) {
    return absl::NotFoundError(absl::StrCat("no ingest source ", source_id));
  }
  return it->second;
}

}  // namespace kvrouter
