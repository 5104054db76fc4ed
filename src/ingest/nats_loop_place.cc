#include "ingest/nats_loop_place.h"

#include <new>
#include <utility>

#include "ingest/ingest_loop.h"

namespace kvrouter {

namespace {
thread_local const uv_loop_t* loop_of_this_thread = nullptr;
}  // namespace

// A libuv handle of the place and the loop's share of it, from its init until libuv is done
// with it (a new attachment's poll may open while the last one's is still closing).
template <typename Handle>
struct NatsLoopPlace::Held {
  Handle handle{};
  std::shared_ptr<NatsLoopPlace> place;

  static void Close(Held* held) {
    uv_close(reinterpret_cast<uv_handle_t*>(&held->handle),
             [](uv_handle_t* handle) { delete static_cast<Held*>(handle->data); });
  }
};

std::shared_ptr<NatsLoopPlace> NatsLoopPlace::Make(IngestLoop& loop) {
  return std::make_shared<NatsLoopPlace>(loop);
}

NatsLoopPlace::NatsLoopPlace(IngestLoop& loop) : loop_(loop) {}

const uv_loop_t* NatsLoopPlace::BindLoopThread(const uv_loop_t* loop) {
  return std::exchange(loop_of_this_thread, loop);
}

natsStatus NatsLoopPlace::UseIn(natsOptions* options) {
  return natsOptions_SetEventLoop(options, this, &OnAttach, &OnRead, &OnWrite, &OnDetach);
}

void NatsLoopPlace::CountLossesIn(std::shared_ptr<std::atomic<uint64_t>> losses) {
  std::lock_guard lock(mutex_);
  losses_ = std::move(losses);
}

void NatsLoopPlace::StopCountingLosses() {
  std::shared_ptr<std::atomic<uint64_t>> dropped;  // released once unlocked
  std::lock_guard lock(mutex_);
  dropped = std::move(losses_);
}

void NatsLoopPlace::Abandon() {
  std::unique_lock lock(mutex_);
  detached_ = true;
  (void)Apply(lock);
}

bool NatsLoopPlace::Detached() const {
  std::lock_guard lock(mutex_);
  return detached_;
}

bool NatsLoopPlace::OnLoopThread() const { return loop_of_this_thread == &loop_.loop; }

// After a connection (`*user_data` null) or a reconnection (the place, as set the first time):
// the new socket is polled for reading.
natsStatus NatsLoopPlace::OnAttach(void** user_data, void* place_arg, natsConnection* connection,
                                   natsSock socket) {
  auto* place = static_cast<NatsLoopPlace*>(place_arg);
  const bool first = *user_data == nullptr;
  std::shared_ptr<NatsLoopPlace> refused_share;  // dropped once unlocked
  std::unique_lock lock(place->mutex_);
  if (place->detached_) return NATS_ILLEGAL_STATE;  // abandoned: the loop is closing
  if (first) place->libnats_share_ = place->shared_from_this();
  place->connection_ = connection;
  place->socket_ = socket;
  ++place->attachment_;
  place->events_ = UV_READABLE;
  const natsStatus s = place->Apply(lock);
  if (s == NATS_OK) {
    *user_data = place;
  } else if (first) {
    // libnats fails the connect and never detaches: its share ends here.
    if (!lock.owns_lock()) lock.lock();
    refused_share = std::move(place->libnats_share_);
  }
  return s;
}

natsStatus NatsLoopPlace::OnRead(void* user_data, bool add) {
  auto* place = static_cast<NatsLoopPlace*>(user_data);
  std::unique_lock lock(place->mutex_);
  if (!add && (place->events_ & UV_READABLE) != 0 && place->losses_ != nullptr) {
    place->losses_->fetch_add(1, std::memory_order_release);
  }
  place->events_ = add ? place->events_ | UV_READABLE : place->events_ & ~UV_READABLE;
  return place->Apply(lock);
}

natsStatus NatsLoopPlace::OnWrite(void* user_data, bool add) {
  auto* place = static_cast<NatsLoopPlace*>(user_data);
  std::unique_lock lock(place->mutex_);
  place->events_ = add ? place->events_ | UV_WRITABLE : place->events_ & ~UV_WRITABLE;
  return place->Apply(lock);
}

// The connection's last call: libnats may free it once this returns, so a read or write the
// loop has under way on it ends first (on the loop thread, that call is the one detaching).
natsStatus NatsLoopPlace::OnDetach(void* user_data) {
  auto* place = static_cast<NatsLoopPlace*>(user_data);
  std::shared_ptr<NatsLoopPlace> libnats_share;  // dropped once unlocked
  std::unique_lock lock(place->mutex_);
  place->detached_ = true;
  libnats_share = std::move(place->libnats_share_);
  if (!place->OnLoopThread()) {
    place->dispatch_ended_.wait(lock, [&] { return place->dispatches_ == 0; });
  }
  return place->Apply(lock);
}

// Under mutex_ (released when applied at once). Off the loop thread, one Sync asked for applies
// every change made until it runs: asked through the place's own wake-up handle once the loop
// made it (it works while the loop closes: libnats' flusher asks to write a farewell then),
// through IngestLoop::Post before. Refused (the loop is closed, or no memory to post), the poll
// is left as it is: a closing loop's own closes and Abandon end it.
natsStatus NatsLoopPlace::Apply(std::unique_lock<std::mutex>& lock) {
  if (OnLoopThread()) {
    // libnats may hold its connection's lock here: a socket that cannot be polled is told to
    // it as an error, not closed under it (its close joins threads that wait for that lock).
    lock.unlock();
    return Sync() ? NATS_OK : NATS_ERR;
  }
  if (sync_posted_) return NATS_OK;
  if (wake_ != nullptr) {  // closed under mutex_: sent before, or not at all
    if (uv_async_send(&wake_->handle) != 0) return NATS_ERR;
    sync_posted_ = true;
    return NATS_OK;
  }
  try {
    if (!loop_.Post([place = shared_from_this()] { place->SyncAsked(); })) {
      return NATS_ILLEGAL_STATE;
    }
  } catch (const std::bad_alloc&) {
    return NATS_NO_MEMORY;
  }
  sync_posted_ = true;
  return NATS_OK;
}

// Asked from another thread: libnats holds none of its locks here, so a socket that cannot be
// polled closes the connection (libnats' own adapter did the same).
void NatsLoopPlace::SyncAsked() {
  if (!Sync()) CloseConnection();
}

bool NatsLoopPlace::Sync() {
  std::unique_lock lock(mutex_);
  sync_posted_ = false;
  const bool detached = detached_;
  const natsSock socket = socket_;
  const uint64_t attachment = attachment_;
  const int events = events_;
  if (detached) {
    CloseWakeLocked();
  } else if (wake_ == nullptr) {
    OpenWakeLocked();
  }
  // No poll without a wake-up handle: a detachment off the loop after it closed could not
  // have the poll closed, and the loop would never end.
  const bool wakeable = wake_ != nullptr;
  lock.unlock();
  // A reconnection's socket is a new one (possibly under the old one's number): a new poll.
  if (detached || attachment != polled_attachment_) ClosePoll();
  if (detached || attachment == 0) return true;
  // Nothing wanted and no poll yet: none is opened (libnats may have closed the socket since).
  if (poll_ == nullptr && events == 0) return true;
  if (poll_ == nullptr) {
    if (!wakeable || !OpenPoll(socket)) return false;
    polled_attachment_ = attachment;
  }
  if (events == polled_events_) return true;
  const int rc =
      events != 0 ? uv_poll_start(&poll_->handle, events, &OnReady) : uv_poll_stop(&poll_->handle);
  if (rc != 0) return false;
  polled_events_ = events;
  return true;
}

void NatsLoopPlace::OpenWakeLocked() {
  auto* wake = new (std::nothrow) Held<uv_async_t>;
  if (wake == nullptr) return;
  if (uv_async_init(&loop_.loop, &wake->handle, [](uv_async_t* handle) {
        static_cast<Held<uv_async_t>*>(handle->data)->place->SyncAsked();
      }) != 0) {
    delete wake;
    return;
  }
  wake->place = shared_from_this();
  wake->handle.data = wake;
  wake_ = wake;
}

void NatsLoopPlace::CloseWakeLocked() {
  if (wake_ != nullptr) Held<uv_async_t>::Close(std::exchange(wake_, nullptr));
}

bool NatsLoopPlace::OpenPoll(natsSock socket) {
  auto* poll = new (std::nothrow) Held<uv_poll_t>;
  if (poll == nullptr) return false;
  if (uv_poll_init_socket(&loop_.loop, &poll->handle, socket) != 0) {
    delete poll;
    return false;
  }
  poll->place = shared_from_this();
  poll->handle.data = poll;
  poll_ = poll;
  polled_events_ = 0;
  return true;
}

void NatsLoopPlace::ClosePoll() {
  if (poll_ == nullptr) return;
  Held<uv_poll_t>::Close(std::exchange(poll_, nullptr));
  polled_events_ = 0;
}

// Closing, libnats detaches (on this thread: a Sync of its own).
void NatsLoopPlace::CloseConnection() {
  natsConnection* connection = BeginDispatch();
  if (connection == nullptr) return;
  natsConnection_Close(connection);
  EndDispatch();
}

void NatsLoopPlace::OnReady(uv_poll_t* handle, int status, int events) {
  NatsLoopPlace& place = *static_cast<Held<uv_poll_t>*>(handle->data)->place;
  natsConnection* connection = place.BeginDispatch();
  if (connection == nullptr) return;
  // An error on the socket is read as one: libnats then reconnects.
  if (status < 0 || (events & UV_READABLE) != 0) natsConnection_ProcessReadEvent(connection);
  place.EndDispatch();
  if (status < 0 || (events & UV_WRITABLE) == 0) return;
  // Checked again: the read may have ended the connection.
  connection = place.BeginDispatch();
  if (connection == nullptr) return;
  natsConnection_ProcessWriteEvent(connection);
  place.EndDispatch();
}

natsConnection* NatsLoopPlace::BeginDispatch() {
  std::lock_guard lock(mutex_);
  if (detached_) return nullptr;
  ++dispatches_;
  return connection_;
}

void NatsLoopPlace::EndDispatch() {
  {
    std::lock_guard lock(mutex_);
    --dispatches_;
  }
  dispatch_ended_.notify_all();
}

}  // namespace kvrouter
