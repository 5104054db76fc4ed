// A libnats connection's place on the ingest loop: libnats' event-loop adapter
// (natsOptions_SetEventLoop) over IngestLoop, in place of the libuv adapter libnats ships
// (nats/adapters/libuv.h). libnats reads and writes the connection's socket when the loop finds
// it ready (natsConnection_ProcessReadEvent and ProcessWriteEvent), and asks from any thread for
// the socket to be polled for reading or writing, attached after a (re)connection, detached when
// the connection closes. Every such request is kept as the state wanted and applied by the loop:
// at once when asked on the loop thread, else woken through IngestLoop::Post the first time and
// through the place's own uv_async handle once the loop has made it (that one still works while
// the loop closes, when libnats' flusher asks to write a farewell). So a connection may be made
// on any thread: the caller's, or a helper's, while the loop goes on serving the other sources.
// (libnats' own adapter must make a connection's first attachment on the loop thread, so the
// connect held the loop for as long as a silent server took to time out; and it read its
// wake-up handle after unlocking, racing the loop that frees it on a detach. Here the handle is
// woken and closed under the place's mutex.)
//
// Lifetime: shared by its owner (the source or the helper making the connection), by libnats
// from the first attachment until the detachment, and by the loop while a handle of it is open
// or a request is posted. libnats may free the connection once the detachment returns: a
// detachment off the loop waits for a read or write the loop has under way on it, and after it
// the loop touches the connection no more. Every handle closes once the place is detached or
// abandoned, so the loop can end (the socket is polled only once the wake-up handle is made,
// which a detachment off the loop, even while it closes, can then always use).
#pragma once

#include <nats/nats.h>
#include <uv.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

namespace kvrouter {

struct IngestLoop;

class NatsLoopPlace : public std::enable_shared_from_this<NatsLoopPlace> {
 public:
  static std::shared_ptr<NatsLoopPlace> Make(IngestLoop& loop);
  // The thread about to run `loop` says so (every other thread hands requests to it): the loop
  // it ran before (null: none).
  static const uv_loop_t* BindLoopThread(const uv_loop_t* loop);

  // Has `options` make their connection here: one connection per place.
  natsStatus UseIn(natsOptions* options);
  // Before UseIn: `losses` counts each time libnats stops reading the socket, which it does
  // only when the connection is lost or closed (libnats 3.x, _evStopPolling), at once and
  // before it reconnects, unlike its disconnection report (SourceRanks::connection_losses).
  void CountLossesIn(std::shared_ptr<std::atomic<uint64_t>> losses);
  // Before its owner destroys a connection that may still be up: that is no loss to count.
  void StopCountingLosses();
  // The socket is polled no more, whatever libnats asks later (the poll closed at once on the
  // loop thread, else by the loop). Once its owner has destroyed the connection (a detachment
  // the closing loop could no longer take), or for a connection no owner will take (one being
  // made off the loop when the loop closes): the loop must not keep a poll open (it would run
  // on forever) nor touch the connection.
  void Abandon();
  // Whether the socket is polled no more: detached by libnats, or abandoned. Any thread.
  bool Detached() const;

  explicit NatsLoopPlace(IngestLoop& loop);  // Make
  NatsLoopPlace(const NatsLoopPlace&) = delete;
  NatsLoopPlace& operator=(const NatsLoopPlace&) = delete;

 private:
  template <typename Handle>
  struct Held;

  // libnats' calls (natsEvLoop_Attach, ReadAddRemove, WriteAddRemove, Detach), any thread.
  static natsStatus OnAttach(void** user_data, void* place, natsConnection* connection,
                             natsSock socket);
  static natsStatus OnRead(void* user_data, bool add);
  static natsStatus OnWrite(void* user_data, bool add);
  static natsStatus OnDetach(void* user_data);

  // The state wanted changed (under mutex_): applied now on the loop thread, else posted.
  natsStatus Apply(std::unique_lock<std::mutex>& lock);
  bool OnLoopThread() const;
  // Loop thread: makes the loop's poll match the state wanted; false if the socket cannot be
  // polled.
  bool Sync();
  void SyncAsked();
  void OpenWakeLocked();
  void CloseWakeLocked();
  void ClosePoll();
  bool OpenPoll(natsSock socket);
  static void OnReady(uv_poll_t* handle, int status, int events);
  // A call into the connection from the loop: null if it is detached (it may be freed).
  natsConnection* BeginDispatch();
  void EndDispatch();
  // The socket cannot be polled (asked off libnats' locks): the connection is closed.
  void CloseConnection();

  IngestLoop& loop_;
  mutable std::mutex mutex_;
  std::condition_variable dispatch_ended_;
  // Wanted, guarded by mutex_ (set by libnats from any thread).
  natsConnection* connection_ = nullptr;
  natsSock socket_ = -1;
  uint64_t attachment_ = 0;  // counts (re)attachments: a new one needs a new poll
  int events_ = 0;           // UV_READABLE | UV_WRITABLE
  bool detached_ = false;    // by libnats, or abandoned
  bool sync_posted_ = false;
  int dispatches_ = 0;  // calls into the connection under way (nested when libnats asks back)
  std::shared_ptr<NatsLoopPlace> libnats_share_;   // from the first attachment to the detachment
  std::shared_ptr<std::atomic<uint64_t>> losses_;  // CountLossesIn; guarded by mutex_
  // Made and closed by the loop, under mutex_: other threads wake the loop with it.
  Held<uv_async_t>* wake_ = nullptr;
  // Loop thread.
  Held<uv_poll_t>* poll_ = nullptr;  // closed when the attachment changes or ends
  uint64_t polled_attachment_ = 0;
  int polled_events_ = 0;
};

}  // namespace kvrouter
