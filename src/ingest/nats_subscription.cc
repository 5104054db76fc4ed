#include "ingest/nats_subscription.h"

#include <nats/nats.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ingest/jetstream_relay.h"
#include "ingest/jetstream_stream.h"
#include "ingest/nats_loop_place.h"
#include "ingest/remake_connector.h"
#include "ingest/replica_sync.h"
#include "ingest/sequence_tracker.h"
#include "wire/endpoint.h"
#include "wire/engine_events.h"
#include "wire/flatbuffers_codec.h"

namespace kvrouter {

// What the connection callbacks need, shared by the connection and its Source: libnats runs
// its callbacks on a thread of its own, possibly after the Source and its NatsSubscriptions
// are gone (a disconnection queued while the source is removed), and the closed callback is
// the connection's last. The source detaches them before the connection is destroyed, so that
// no callback reaches the owner afterwards; libnats may also close the connection on its own
// first (a server's protocol error, e.g. a message over its max_payload). Whichever of the two
// comes second frees them.
struct ConnectionCallbacks {
  std::mutex owner_mutex;
  NatsSubscriptions* owner = nullptr;  // guarded by owner_mutex; null once detached
  bool closed = false;                 // guarded by owner_mutex; the closed callback ran
  bool lost = false;  // guarded by owner_mutex: ranks flagged since the last (re)connection
  // Replica sync: the router and its observer's token, to rejoin on a reconnection (guarded
  // by owner_mutex; unset for other sources).
  Router* router = nullptr;
  uint64_t observer_token = 0;
  std::shared_ptr<SourceCounters> counters;
  std::shared_ptr<SourceRanks> ranks;
  // Core NATS event subscriptions only: what is published while disconnected is lost. (Replica
  // bookings are re-announced by the replicas' own sync; JetStream keeps the messages.)
  bool disconnection_loses_events = false;
  // Core NATS and replica sync sources: the source whose connection is made again when libnats
  // closes it for good (guarded by owner_mutex; 0 for JetStream's, made again by their thread).
  uint64_t remade_source_id = 0;
  // JetStream sources: the source's thread and order, which make the connection and consumer
  // again when libnats closes it for good.
  std::shared_ptr<ConsumerRemaking> jetstream_remaking;
  std::shared_ptr<JetStreamOrder> jetstream_order;

  // Returns once no callback uses the owner, nor will; `callbacks` is not to be used after.
  static void Detach(ConnectionCallbacks* callbacks) {
    Release(callbacks, [](ConnectionCallbacks& c) {
      c.owner = nullptr;
      return c.closed;
    });
  }

  // One of the two shares given up: `let_go` runs under the mutex and says whether the other
  // is gone too, and then the callbacks are freed.
  template <typename LetGo>
  static void Release(ConnectionCallbacks* callbacks, LetGo let_go) {
    bool last;
    {
      std::lock_guard lock(callbacks->owner_mutex);
      last = let_go(*callbacks);
    }
    if (last) delete callbacks;
  }

  void RejoinOnReconnection(Router& replicas_router, uint64_t token) {
    std::lock_guard lock(owner_mutex);
    router = &replicas_router;
    observer_token = token;
  }

  // Whether the connection is closed already (libnats gave it up before this was set).
  bool RemakeWhenClosed(uint64_t source_id) {
    std::lock_guard lock(owner_mutex);
    remade_source_id = source_id;
    return closed;
  }

  // A replica sync joins again (Router::RejoinReplicas): peers may have missed what it
  // published during the outage. Under the mutex, so that the source is not closed meanwhile
  // (its router outlives it); Close clears the observer first, which makes this a no-op.
  static void OnReconnected(natsConnection*, void* closure) {
    auto* callbacks = static_cast<ConnectionCallbacks*>(closure);
    Bump(callbacks->counters->connections);
    std::lock_guard lock(callbacks->owner_mutex);
    callbacks->lost = false;
    if (callbacks->owner != nullptr && callbacks->router != nullptr) {
      (void)callbacks->router->RejoinReplicas(callbacks->observer_token);
    }
  }

  // When the connection is lost: what is published until the reconnection is lost. libnats
  // runs every connection's callbacks on one thread, apart from its message delivery, so this
  // may run after a quick reconnection and after messages received since were posted: the
  // clear carries the connection losses counted so far, and is not applied if a message that
  // came after the loss was, as that message cleared first (SourceRanks::connection_losses).
  // Not asked whether it is reconnecting, for the same reason (a close is flagged once anyway,
  // and one the source makes comes detached).
  static void OnDisconnected(natsConnection*, void* closure) {
    auto* callbacks = static_cast<ConnectionCallbacks*>(closure);
    std::lock_guard lock(callbacks->owner_mutex);
    callbacks->LoseEveryRankLocked();
  }

  // Has the loop clear and flag every rank this source fed, once per loss of the connection,
  // unless the source is being closed (detached). Refused memory to post the clear, the next
  // message the loop handles does it.
  void LoseEveryRankLocked() {
    if (owner == nullptr || lost || !disconnection_loses_events) return;
    lost = true;
    // Every loss counted so far: a report that runs late may cover the next loss's too (then
    // the next report clears nothing more, unless a message of the next connection was
    // applied, which its own count cleared for).
    const uint64_t losses = ranks->ConnectionLosses();
    ContainRefusal([&] { owner->LoseEveryRankLater(counters, ranks, losses); },
                   [&] { ranks->LoseEveryRankLater(); });
  }

  // The connection's last callback. Closed while still attached, by libnats on its own (a
  // server's -ERR other than an authorization or permission error: a message over its
  // max_payload, its maximum connections reached; an authorization error twice in a row): it
  // will not reconnect, so a core NATS source's ranks hear nothing more and are flagged, and the
  // loop makes the connection again (NatsSubscriptions::RemakeConnection).
  static void OnClosed(natsConnection*, void* closure) {
    Release(static_cast<ConnectionCallbacks*>(closure), [](ConnectionCallbacks& c) {
      c.closed = true;
      c.LoseEveryRankLocked();  // flagged once, if a disconnection did not already
      if (c.owner != nullptr && c.jetstream_remaking != nullptr) {
        // Refused memory to ask, the source stays closed (counted as a failed attempt).
        ContainRefusal(
            [&] {
              (void)c.owner->ReconnectJetStreamLater(c.counters, c.jetstream_order,
                                                     c.jetstream_remaking);
            },
            [&] { Bump(c.counters->consumer_remake_failures); });
      } else if (c.owner != nullptr && c.remade_source_id != 0) {
        // Refused memory to ask, the source stays closed (flagged, and counted as a failed
        // attempt, as before it was remade).
        ContainRefusal([&] { (void)c.owner->RemakeLater(c.remade_source_id); },
                       [&] { Bump(c.counters->consumer_remake_failures); });
      }
      return c.owner == nullptr;
    });
  }
};

namespace {

// The largest replica change the server takes (ReplicaMessageLimit), read at every change: a
// reconnection may meet a cluster member with a smaller max_payload. libnats keeps the last
// server's until the next one's INFO arrives.
size_t ReplicaMessageLimitNow(natsConnection* connection) {
  const natsConnStatus status = natsConnection_Status(connection);
  const int64_t max_payload = natsConnection_GetMaxPayload(connection);
  return ReplicaMessageLimit(static_cast<size_t>(std::max<int64_t>(max_payload, 0)),
                             /*reconnecting=*/status != NATS_CONN_STATUS_CONNECTED);
}

// A server whose messages are too short for some replica change (a long request id) would
// drop it unseen: refused at the start, where it can be said.
absl::Status CheckReplicaMessageLimit(natsConnection* connection, const std::string& url) {
  const int64_t max_payload = natsConnection_GetMaxPayload(connection);
  if (max_payload >= static_cast<int64_t>(kMinReplicaTransportMessage)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "the NATS server at ", WithoutUserInfo(url), " takes messages of at most ", max_payload,
      " bytes: replica sync needs a max_payload of at least ", kMinReplicaTransportMessage));
}

std::unique_ptr<ConnectionCallbacks> NewCallbacks(NatsSubscriptions* owner,
                                                  std::shared_ptr<SourceCounters> counters,
                                                  std::shared_ptr<SourceRanks> ranks,
                                                  bool disconnection_loses_events) {
  auto callbacks = std::make_unique<ConnectionCallbacks>();
  callbacks->owner = owner;
  callbacks->counters = std::move(counters);
  callbacks->ranks = std::move(ranks);
  callbacks->disconnection_loses_events = disconnection_loses_events;
  return callbacks;
}

// What every connection shares: `url`, a connect timeout, reconnecting forever, `callbacks`.
natsStatus CreateOptions(const std::string& url, ConnectionCallbacks& callbacks,
                         natsOptions** out) {
  natsOptions* opts = nullptr;
  natsStatus s = ReconnectingOptions(url, &opts);
  if (s == NATS_OK) {
    s = natsOptions_SetReconnectedCB(opts, &ConnectionCallbacks::OnReconnected, &callbacks);
  }
  if (s == NATS_OK) {
    s = natsOptions_SetDisconnectedCB(opts, &ConnectionCallbacks::OnDisconnected, &callbacks);
  }
  if (s == NATS_OK) s = natsOptions_SetClosedCB(opts, &ConnectionCallbacks::OnClosed, &callbacks);
  if (s != NATS_OK && opts != nullptr) natsOptions_Destroy(opts);
  *out = s == NATS_OK ? opts : nullptr;
  return s;
}

// The first connection failed: a connection half made is destroyed (its closed callback frees
// the callbacks, which no longer reach their owner).
absl::Status ConnectFailed(const std::string& url, natsStatus s, natsConnection*& connection,
                           std::unique_ptr<ConnectionCallbacks> callbacks) {
  const std::string why =
      absl::StrCat("cannot connect to NATS at ", url, ": ", natsStatus_GetText(s), " (",
                   nats_GetLastError(nullptr), ")");
  if (connection != nullptr) {
    ConnectionCallbacks::Detach(callbacks.release());
    natsConnection_Destroy(connection);
    connection = nullptr;
  }
  return absl::UnavailableError(why);
}

// A JetStream message's place (all 0 if it has no metadata).
JetStreamPlace PlaceOf(natsMsg* msg) {
  jsMsgMetaData* meta = nullptr;
  if (natsMsg_GetMetaData(&meta, msg) != NATS_OK) return {};
  const JetStreamPlace place{meta->Sequence.Stream, meta->Sequence.Consumer, meta->Timestamp};
  jsMsgMetaData_Destroy(meta);
  return place;
}

}  // namespace

// The loop asks a JetStream source's own thread (NatsSubscriptions::RemakeConsumers) to make
// its consumer again from a stream sequence: the JetStream API's request-reply round trips
// must not hold the loop.
// When a subscription's message handler can no longer run: libnats calls OnComplete once the
// subscription is closed (unsubscribed, or its connection closed) and the handler's last call
// has returned. One per subscription, shared with that callback, which may come after the
// source has moved on to another subscription (a JetStream consumer made again) or is gone.
struct SubscriptionEnd {
  std::mutex mutex;
  std::condition_variable ended_cv;
  bool ended = false;  // guarded by mutex

  // An end and the callback's share of it, made before subscribing: once the subscription
  // exists, nothing may fail for memory before its end is watched.
  struct Watcher {
    std::shared_ptr<SubscriptionEnd> end = std::make_shared<SubscriptionEnd>();
    std::unique_ptr<std::shared_ptr<SubscriptionEnd>> closure =
        std::make_unique<std::shared_ptr<SubscriptionEnd>>(end);
  };
  // Has the end of `subscription` told to `*end` (left null if libnats refuses). Allocates
  // nothing.
  static natsStatus Watch(natsSubscription* subscription, Watcher& watcher,
                          std::shared_ptr<SubscriptionEnd>* end) {
    const natsStatus s =
        natsSubscription_SetOnCompleteCB(subscription, &OnComplete, watcher.closure.get());
    if (s == NATS_OK) {
      (void)watcher.closure.release();  // the callback's now
      *end = std::move(watcher.end);
    }
    return s;
  }
  void Wait(std::chrono::seconds at_most) {
    std::unique_lock lock(mutex);
    ended_cv.wait_for(lock, at_most, [&] { return ended; });
  }

 private:
  static void OnComplete(void* closure) {
    auto* end = static_cast<std::shared_ptr<SubscriptionEnd>*>(closure);
    {
      std::lock_guard lock((*end)->mutex);
      (*end)->ended = true;
      (*end)->ended_cv.notify_all();
    }
    delete end;
  }
};

// Deliver everything from stream sequence `from` (one past the source's position) or, if the
// stream numbers messages anew since, everything stored from `applied_ns` on (when the last
// message the source applied, the one at the position, was stored).
struct RemakeRequest {
  uint64_t from = 0;  // 0: none
  int64_t applied_ns = 0;
};

struct ConsumerRemaking {
  using Request = RemakeRequest;
  std::mutex mutex;
  std::condition_variable wake;
  Request asked;                 // guarded by mutex
  bool busy = false;             // guarded by mutex: a request is being carried out
  bool uncuttable = false;       // guarded by mutex: in a step Close must not cut short
  bool durable_missing = false;  // guarded by mutex: deleted, not yet created again
  bool stopping = false;         // guarded by mutex
  std::thread thread;            // started and joined with its source

  // Any thread; allocates nothing.
  void Ask(Request request) {
    std::lock_guard lock(mutex);
    asked = request;
    wake.notify_one();
  }
  // The request to carry out next, once asked (busy until Next is called again); from 0 once
  // stopping.
  Request Next() {
    std::unique_lock lock(mutex);
    busy = false;
    wake.wait(lock, [&] { return stopping || asked.from != 0; });
    if (stopping) return {};
    busy = true;
    return std::exchange(asked, Request{});
  }
  bool Stopping() {
    std::lock_guard lock(mutex);
    return stopping;
  }
  // Waits `delay` unless stopping meanwhile: whether to go on.
  bool Pause(std::chrono::milliseconds delay) {
    std::unique_lock lock(mutex);
    return !wake.wait_for(lock, delay, [&] { return stopping; });
  }
  // A step the connection must not be closed under (deleting and creating a durable: cut in
  // between, no durable is left and a later resume starts from the stream's start; subscribing
  // and watching the subscription's end). Refused once stopping.
  bool BeginUncuttable() {
    std::lock_guard lock(mutex);
    uncuttable = !stopping;
    return uncuttable;
  }
  void EndUncuttable() {
    std::lock_guard lock(mutex);
    uncuttable = false;
  }
  void DurableMissing(bool missing) {
    std::lock_guard lock(mutex);
    durable_missing = missing;
  }
  bool IsDurableMissing() {
    std::lock_guard lock(mutex);
    return durable_missing;
  }
  // Asks the thread to stop: whether its wait for the server (a JetStream request waits up to
  // 5 s) may be cut short by closing the connection.
  bool StopAsking() {
    {
      std::lock_guard lock(mutex);
      stopping = true;
    }
    wake.notify_all();
    std::lock_guard lock(mutex);
    return busy && !uncuttable && !durable_missing;
  }
  void Join() {
    if (thread.joinable()) thread.join();
  }
};

// ConsumerRemaking::BeginUncuttable and EndUncuttable around a scope (nothing without one).
class UncuttableStep {
 public:
  explicit UncuttableStep(ConsumerRemaking* remaking)
      : remaking_(remaking), taken_(remaking == nullptr || remaking->BeginUncuttable()) {}
  ~UncuttableStep() {
    if (remaking_ != nullptr && taken_) remaking_->EndUncuttable();
  }
  UncuttableStep(const UncuttableStep&) = delete;
  UncuttableStep& operator=(const UncuttableStep&) = delete;
  bool taken() const { return taken_; }

 private:
  ConsumerRemaking* remaking_;
  bool taken_;
};

// The connection a replica sync publishes on. A remake swaps it while the router's observer
// stays installed (a publisher the caller set meanwhile must not be replaced, nor the heartbeat
// interval promised be forgotten); none while the connection is being made again: a change is
// then not published (counted) and every booking is announced again once one is.
struct PublishTarget {
  std::mutex mutex;
  natsConnection* connection = nullptr;  // guarded by mutex
};

struct NatsSubscriptions::Source {
  NatsSubscriptions* owner = nullptr;
  std::shared_ptr<SourceCounters> counters;
  std::shared_ptr<PublisherSequences> dynamo = std::make_shared<PublisherSequences>();
  std::shared_ptr<SourceRanks> ranks;  // counting flags but on ranks its owner's dropped_ has
  std::shared_ptr<JetStreamOrder> order = std::make_shared<JetStreamOrder>();  // JetStream
  std::shared_ptr<ConsumerRemaking> remaking;                                  // JetStream
  JetStreamSource jetstream_config;  // JetStream: how its consumer is made again
  natsConnection* connection = nullptr;
  ConnectionCallbacks* callbacks = nullptr;  // shared with the connection; DetachCallbacks
  std::shared_ptr<NatsLoopPlace> place;      // where the loop polls `connection` (not JetStream's)
  natsSubscription* subscription = nullptr;
  bool replica_sync = false;             // messages are replica changes, not event batches
  bool jetstream = false;                // messages are acknowledged once applied
  uint64_t observer_token = 0;           // replica sync: the router observer it installed
  uv_timer_t* liveness_timer = nullptr;  // replica sync: StartLiveness
  uint64_t source_id = 0;
  std::shared_ptr<SubscriptionEnd> end;  // of `subscription`, if libnats tells it
  // Core NATS and replica sync: what the connection is made from, to make it again once
  // libnats has closed it for good (RemakeConnection), and the timer of the next attempt.
  std::string url, subject, replica_id;
  uv_timer_t* remake_timer = nullptr;  // from subscription to Close
  uint64_t remake_delay_ms = 0;        // of the last attempt scheduled
  uint64_t last_remade_ms = 0;         // when a connection was last made again (uv_now; 0: never)
  bool remake_under_way = false;       // the connector is making its connection
  std::shared_ptr<PublishTarget> publish_target;  // replica sync: PublishOwnBookings

  // On libnats' delivery thread: hands the payload to the loop. After Stop, messages are
  // dropped (the loop is closing).
  static void OnMessage(natsConnection*, natsSubscription*, natsMsg* msg, void* closure) {
    auto* source = static_cast<Source*>(closure);
    if (source->jetstream) return OnJetStreamMessage(source, msg);
    // A message the heap refused memory to is lost, as in an outage: its ranks are lost on the
    // loop, with the next message (a replica change lost is only counted).
    ContainRefusal([&] { PostMessage(source, msg); },
                   [&] {
                     Bump(source->counters->gaps);
                     source->ranks->LoseEveryRankLater();
                   });
    natsMsg_Destroy(msg);
  }

  // An event message carries the connection losses counted when it was delivered: one
  // lost before it whose report has not reached the loop yet is applied first, so that the
  // late report does not clear this message's blocks (SourceRanks::connection_losses).
  static void PostMessage(Source* source, natsMsg* msg) {
    NatsSubscriptions* self = source->owner;
    const auto* data = reinterpret_cast<const uint8_t*>(natsMsg_GetData(msg));
    std::vector<uint8_t> payload(data, data + natsMsg_GetDataLength(msg));
    self->loop_.Post([self, counters = source->counters, dynamo = source->dynamo,
                      ranks = source->ranks, payload = std::move(payload),
                      replica_sync = source->replica_sync,
                      losses = source->ranks->ConnectionLosses()] {
      if (ranks->retired()) return;
      if (replica_sync) {
        ContainRefusal([&] { ApplyReplicaMessage(*self->loop_.router, payload, *counters); },
                       [&] { Bump(counters->gaps); });
        return;
      }
      if (ranks->LossDue(losses)) self->LoseEveryRankContained(*counters, *ranks);
      self->HandleEventsContained(payload, *counters, *dynamo, *ranks);
    });
  }

  // Applied on the loop, then acknowledged: the server delivers it again if this router goes
  // away first. A message the closing loop drops is not acknowledged either.
  // A message the heap refused memory to on the loop is lost as in an outage (and acknowledged,
  // HandleEventsContained); here, it is not acknowledged (the shared_ptr destroys it, also when
  // its own allocation is refused): the next message's delivery number skips it, so the
  // consumer is made again from before it, and it comes again in order.
  static void OnJetStreamMessage(Source* source, natsMsg* raw) {
    ContainRefusal([&] { PostJetStreamMessage(source, raw); }, [] {});
  }

  static void PostJetStreamMessage(Source* source, natsMsg* raw) {
    std::shared_ptr<natsMsg> msg(raw, natsMsg_Destroy);
    NatsSubscriptions* self = source->owner;
    self->loop_.Post([self, msg, counters = source->counters, dynamo = source->dynamo,
                      ranks = source->ranks, order = source->order, remaking = source->remaking] {
      if (ranks->retired()) return;  // not acknowledged: the server delivers it again
      const auto* data = reinterpret_cast<const uint8_t*>(natsMsg_GetData(msg.get()));
      if (self->HandleJetStreamMessage(
              PlaceOf(msg.get()),
              std::span(data, static_cast<size_t>(natsMsg_GetDataLength(msg.get()))), *counters,
              *dynamo, *ranks, *order, *remaking)) {
        (void)natsMsg_Ack(msg.get(), nullptr);
      }
    });
  }
};

absl::StatusOr<uint64_t> NatsSubscriptions::SubscribeEvents(const std::string& url,
                                                            const std::string& subject) {
  return Subscribe(url, subject, "");
}

absl::StatusOr<uint64_t> NatsSubscriptions::SyncReplicas(const std::string& url,
                                                         const std::string& subject,
                                                         const std::string& replica_id) {
  if (absl::Status valid = ValidateReplicaId(replica_id); !valid.ok()) return valid;
  return Subscribe(url, subject, replica_id);
}

absl::StatusOr<uint64_t> NatsSubscriptions::Subscribe(const std::string& url,
                                                      const std::string& subject,
                                                      const std::string& replica_id) {
  if (url.empty()) return absl::InvalidArgumentError("the NATS url is empty");
  if (subject.empty()) return absl::InvalidArgumentError("the NATS subject is empty");
  const bool replica_sync = !replica_id.empty();
  // Refused before connecting when it can be told now (stopped, a second replica sync).
  if (absl::Status free = loop_.Run([&] { return CanList(replica_sync); }); !free.ok()) {
    return free;
  }
  auto source = std::make_unique<Source>();
  source->owner = this;
  source->ranks = std::make_shared<SourceRanks>(&dropped_);
  source->counters = std::make_shared<SourceCounters>();
  source->replica_sync = replica_sync;
  source->url = url;
  source->subject = subject;
  source->replica_id = replica_id;
  // Connected on this thread while the loop goes on: a server that does not answer holds the
  // caller (libnats' connect timeout per server of the url), not every other source. Subscribed
  // on the loop once listed: no message comes for a source the loop does not know.
  absl::StatusOr<Made> made = MakeConnection(url, replica_sync, source->counters, source->ranks,
                                             NatsLoopPlace::Make(loop_));
  if (!made.ok()) return made.status();
  natsConnection* connection = made->connection;  // a remake may replace it once listed
  Source* unlisted = source.release();
  uint64_t id = 0;
  bool running = false, taken = false;
  absl::Status status;
  try {
    status = loop_.Run([&] {
      taken = true;  // ListOnLoop closes both if it refuses them
      running = loop_.running;
      return ListOnLoop(unlisted, *made, id);
    });
  } catch (...) {  // refused memory before the command ran
    if (!taken) DiscardUnlisted(unlisted, *made);
    throw;
  }
  if (!taken) DiscardUnlisted(unlisted, *made);  // stopped meanwhile: not to be done (header)
  if (!status.ok()) return status;
  // Once a PING round trip completes, the server has the SUB: messages published from now on
  // are delivered. It is waited for here, as the loop thread must be free to read the PONG.
  // Before Start, the SUB goes out when the loop starts. (The connection lives until Stop, which
  // is not to be called concurrently with this: no remake replaces it before it is armed below.)
  if (running) {
    if (natsStatus s = natsConnection_FlushTimeout(connection, 5000); s != NATS_OK) {
      // Not half there: the caller gets no source id, so the source must not outlive this.
      (void)loop_.Run([&] { return RemoveOnLoop(id); });
      return absl::UnavailableError(
          absl::StrCat("NATS subscription to '", subject,
                       "' not confirmed by the server: ", natsStatus_GetText(s)));
    }
    // Made again if libnats gives it up, from now on (or at once if it gave it up already).
    // Refused memory for this, the source works (the caller gets its id), but stays closed if
    // libnats gives it up.
    ContainRefusal(
        [&] {
          (void)loop_.Run([&] {
            if (Source* source = FindSource(id)) RemakeWhenClosed(*source);
            return absl::OkStatus();
          });
        },
        [] {});
  }
  return id;
}

// Loop state: whether another source may be listed (`replica_sync`: another replica sync).
absl::Status NatsSubscriptions::CanList(bool replica_sync) const {
  if (replica_sync && replica_sync_active_) {
    return absl::FailedPreconditionError("this ingest object already syncs router replicas");
  }
  return absl::OkStatus();
}

// Must run where the loop is (the loop thread, or the caller's before Start).
absl::Status NatsSubscriptions::ListOnLoop(Source* source, Made& made, uint64_t& id) {
  if (absl::Status free = CanList(source->replica_sync); !free.ok()) {  // one listed meanwhile
    DiscardUnlisted(source, made);
    return free;
  }
  // Refused memory from here on, the source is closed (its handler and connection would
  // otherwise outlive it) before the refusal goes on.
  try {
    if (absl::Status subscribed = SubscribeMade(*source, made); !subscribed.ok()) {
      Close(source);
      return subscribed;
    }
    Bump(source->counters->connections);
    loop_.NewSource(id,
                    source->replica_sync ? IngestSourceKind::kReplicas : IngestSourceKind::kNats,
                    WithoutUserInfo(source->url), source->counters);
    source->source_id = id;
    if (source->replica_sync) {
      PublishOwnBookings(*source);
      StartLiveness(*source);
    }
    // The remake's timer is made now (a refusal here closes the source cleanly; later, it would
    // leave it closed for good), and armed before it is listed (Close must not leave it there).
    // Once the loop runs, Subscribe arms it after its flush: a remake must not destroy the
    // connection the flush is given.
    MakeRemakeTimer(*source);
    if (!loop_.running) RemakeWhenClosed(*source);
    sources_.push_back(source);
  } catch (...) {
    RetireRanks(*source);  // what its subscription queued meanwhile
    RetireRefusedSource(id);
    Close(source);  // SubscribeMade takes the connection before anything may throw
    throw;
  }
  replica_sync_active_ = replica_sync_active_ || source->replica_sync;
  return absl::OkStatus();
}

// A connection made for a source that is never listed: both go (any thread).
void NatsSubscriptions::DiscardUnlisted(Source* source, Made& made) {
  Discard(made);
  delete source;
}

absl::StatusOr<NatsSubscriptions::Made> NatsSubscriptions::MakeConnection(
    const std::string& url, bool replica_sync, std::shared_ptr<SourceCounters> counters,
    std::shared_ptr<SourceRanks> ranks, std::shared_ptr<NatsLoopPlace> place) {
  if (place == nullptr) return OutOfMemoryStatus();
  auto callbacks = NewCallbacks(this, std::move(counters), ranks,
                                /*disconnection_loses_events=*/!replica_sync);
  natsOptions* opts = nullptr;
  natsStatus s = CreateOptions(url, *callbacks, &opts);
  // A replica does not need its own changes back.
  if (s == NATS_OK && replica_sync) s = natsOptions_SetNoEcho(opts, true);
  if (!replica_sync) {
    // The place counts the connection's losses where the source's ranks' messages read them
    // (aliasing: no allocation, kept alive by the ranks).
    place->CountLossesIn(
        std::shared_ptr<std::atomic<uint64_t>>(ranks, &ranks->connection_losses()));
  }
  if (s == NATS_OK) s = place->UseIn(opts);
  Made made;
  if (s == NATS_OK) s = natsConnection_Connect(&made.connection, opts);
  natsOptions_Destroy(opts);
  if (s != NATS_OK) {
    // A failed attachment is never detached by libnats: the handles the loop made go now.
    place->Abandon();
    return ConnectFailed(url, s, made.connection, std::move(callbacks));
  }
  made.callbacks = callbacks.release();  // shared with the connection now
  made.place = std::move(place);
  return made;
}

absl::Status NatsSubscriptions::SubscribeMade(Source& source, Made& made) {
  source.connection = std::exchange(made.connection, nullptr);
  source.callbacks = std::exchange(made.callbacks, nullptr);
  source.place = std::move(made.place);
  if (source.replica_sync) {
    if (absl::Status fits = CheckReplicaMessageLimit(source.connection, source.url); !fits.ok()) {
      return fits;
    }
  }
  SubscriptionEnd::Watcher watcher;
  natsStatus s = natsConnection_Subscribe(&source.subscription, source.connection,
                                          source.subject.c_str(), &Source::OnMessage, &source);
  if (s == NATS_OK) s = SubscriptionEnd::Watch(source.subscription, watcher, &source.end);
  if (s != NATS_OK) {
    return absl::InvalidArgumentError(absl::StrCat("cannot subscribe to '", source.subject, "' at ",
                                                   WithoutUserInfo(source.url), ": ",
                                                   natsStatus_GetText(s)));
  }
  return absl::OkStatus();
}

void NatsSubscriptions::Discard(Made& made) {
  if (made.callbacks != nullptr)
    ConnectionCallbacks::Detach(std::exchange(made.callbacks, nullptr));
  if (made.place != nullptr) made.place->StopCountingLosses();
  if (made.connection != nullptr) natsConnection_Destroy(std::exchange(made.connection, nullptr));
  if (made.place != nullptr) std::exchange(made.place, nullptr)->Abandon();
}

// From now on every change to the router's own bookings is published on the source's subject,
// from the thread that made it (libnats' publish only buffers; its flusher sends).
void NatsSubscriptions::PublishOwnBookings(Source& source) {
  source.publish_target = std::make_shared<PublishTarget>();
  source.publish_target->connection = source.connection;
  source.observer_token = PublishBookings(
      *loop_.router, source.replica_id,
      [target = source.publish_target, subject = source.subject](std::span<const uint8_t> bytes) {
        std::lock_guard lock(target->mutex);
        return target->connection != nullptr &&
               natsConnection_Publish(target->connection, subject.c_str(), bytes.data(),
                                      static_cast<int>(bytes.size())) == NATS_OK;
      },
      source.counters,
      [target = source.publish_target] {
        std::lock_guard lock(target->mutex);
        return target->connection != nullptr
                   ? ReplicaMessageLimitNow(target->connection)
                   : ReplicaMessageLimit(0, /*reconnecting=*/true);  // no server known
      });
  source.callbacks->RejoinOnReconnection(*loop_.router, source.observer_token);
}

// The replica publisher's connection from now on (none: changes are not published).
void NatsSubscriptions::PublishOn(Source& source, natsConnection* connection) {
  if (source.publish_target == nullptr) return;
  std::lock_guard lock(source.publish_target->mutex);
  source.publish_target->connection = connection;
}

// A connection that libnats gives up is made again; one given up already is at once scheduled.
void NatsSubscriptions::RemakeWhenClosed(Source& source) {
  if (source.callbacks->RemakeWhenClosed(source.source_id)) ScheduleRemake(source, false);
}

bool NatsSubscriptions::RemakeLater(uint64_t source_id) {
  return loop_.Post([this, source_id] {
    if (Source* source = FindSource(source_id)) ScheduleRemake(*source, false);
  });
}

// The listed source `source_id` (null: removed, or never listed). Loop thread.
NatsSubscriptions::Source* NatsSubscriptions::FindSource(uint64_t source_id) const {
  for (Source* source : sources_) {
    if (source->source_id == source_id) return source;
  }
  return nullptr;
}

// libnats gives up on a connection for good only after a server's error (above); the first
// attempt waits a second for the server to settle, later ones back off to half a minute: after
// a failed attempt, and after a close soon after the last remake (a server that takes the
// connection and then closes it again, say for an account's limit, is not retried every second).
void NatsSubscriptions::ScheduleRemake(Source& source, bool failed) {
  constexpr uint64_t kFirstRemakeDelayMs = 1'000, kLongestRemakeDelayMs = 30'000;
  const uint64_t now = uv_now(&loop_.loop);
  const bool soon_after_remake =
      source.last_remade_ms != 0 && now - source.last_remade_ms < kLongestRemakeDelayMs;
  source.remake_delay_ms = (failed || soon_after_remake) && source.remake_delay_ms != 0
                               ? std::min(source.remake_delay_ms * 2, kLongestRemakeDelayMs)
                               : kFirstRemakeDelayMs;
  uv_timer_start(
      source.remake_timer,
      [](uv_timer_t* timer) {
        auto& source = *static_cast<Source*>(timer->data);
        // Refused memory, the attempt failed like any other: another comes later.
        ContainRefusal([&] { source.owner->RemakeConnection(source); },
                       [&] { source.owner->RemakeFailed(source); });
      },
      source.remake_delay_ms, 0);
}

// The connection libnats closed is dropped and made again from the source's url and subject:
// the source keeps its id, counters and ranks (flagged by the close until their engines clear
// them), and a replica sync its publisher, which joins again (unless the caller replaced it
// meanwhile). A thread of the connector's makes the connection (a server that does not answer
// holds it for the connect timeout per server of the url, not the loop nor another source's
// remake); TakeRemade subscribes it.
// The same timeout as the first connection's: libnats keeps it for its reconnections too.
void NatsSubscriptions::RemakeConnection(Source& source) {
  if (source.remake_under_way) return;  // asked twice: under way
  if (source.connection != nullptr && !natsConnection_IsClosed(source.connection)) {
    return;  // asked twice: made already
  }
  DropConnection(source);
  if (connector_ == nullptr) connector_ = std::make_unique<RemakeConnector>(loop_);
  connector_->Add([this, id = source.source_id, url = source.url,
                   replica_sync = source.replica_sync, counters = source.counters,
                   ranks = source.ranks](std::shared_ptr<NatsLoopPlace> place) {
    const bool handed = ContainRefusal(
        [&] {
          auto made = std::make_shared<absl::StatusOr<Made>>(OutOfMemoryStatus());
          *made = MakeConnection(url, replica_sync, counters, ranks, std::move(place));
          HandRemadeToLoop(id, std::move(made), *counters);
        },
        [] {});
    if (!handed) TellRemakeFailed(id, *counters);
  });
  source.remake_under_way = true;
}

// A connection the loop cannot take (closed, or refused memory to be asked) is discarded here.
void NatsSubscriptions::HandRemadeToLoop(uint64_t source_id,
                                         std::shared_ptr<absl::StatusOr<Made>> made,
                                         SourceCounters& counters) {
  bool posted = false;
  ContainRefusal(
      [&] {
        posted = loop_.Post([this, source_id, made] { TakeRemade(source_id, std::move(*made)); });
      },
      [] {});
  if (posted) return;
  if (made->ok()) Discard(**made);
  TellRemakeFailed(source_id, counters);
}

// The attempt failed where the loop could not be told what it made (refused memory): the
// source, still waiting for it, is told it failed, so that another is scheduled, retrying for a
// few seconds while memory is refused. Refused all that time, it stays closed (counted).
void NatsSubscriptions::TellRemakeFailed(uint64_t source_id, SourceCounters& counters) {
  constexpr int kTries = 50;
  constexpr auto kPause = std::chrono::milliseconds(100);
  for (int tries = kTries; tries > 0; --tries) {
    // Told, or the loop is closed (Post refuses): nothing waits for the attempt any more.
    if (ContainRefusal(
            [&] {
              (void)loop_.Post([this, source_id] { TakeRemade(source_id, OutOfMemoryStatus()); });
            },
            [] {})) {
      return;
    }
    std::this_thread::sleep_for(kPause);
  }
  Bump(counters.consumer_remake_failures);
}

void NatsSubscriptions::TakeRemade(uint64_t source_id, absl::StatusOr<Made> made) {
  // Taken by the loop from now on: closing, it no longer abandons that place.
  if (made.ok() && connector_ != nullptr) connector_->Taken(made->place);
  Source* source = FindSource(source_id);
  if (source == nullptr) {  // removed meanwhile
    if (made.ok()) Discard(*made);
    return;
  }
  source->remake_under_way = false;
  if (!made.ok()) return RemakeFailed(*source);
  // Refused memory, the attempt failed like any other: another comes later.
  ContainRefusal([&] { SubscribeRemade(*source, *made); },
                 [&] {
                   Discard(*made);  // if the source did not take it yet
                   RemakeFailed(*source);
                 });
}

void NatsSubscriptions::SubscribeRemade(Source& source, Made& made) {
  if (absl::Status subscribed = SubscribeMade(source, made); !subscribed.ok()) {
    return RemakeFailed(source);
  }
  PublishOn(source, source.connection);
  if (source.replica_sync) {
    source.callbacks->RejoinOnReconnection(*loop_.router, source.observer_token);
    (void)loop_.router->RejoinReplicas(source.observer_token);  // what it published meanwhile
  }
  source.last_remade_ms = uv_now(&loop_.loop);
  Bump(source.counters->connections);
  Bump(source.counters->consumer_remakes);
  RemakeWhenClosed(source);
}

void NatsSubscriptions::RemakeFailed(Source& source) {
  Bump(source.counters->consumer_remake_failures);
  DropConnection(source);
  ScheduleRemake(source, true);
}

// Unsubscribes and destroys the connection (closed by libnats, or made in vain by a remake),
// the replica publisher's use of it ended first.
void NatsSubscriptions::DropConnection(Source& source) {
  PublishOn(source, nullptr);
  DetachCallbacks(source);
  Unsubscribe(&source);
  if (source.place != nullptr) source.place->StopCountingLosses();
  if (source.connection != nullptr) {
    natsConnection_Destroy(std::exchange(source.connection, nullptr));
  }
  if (source.place != nullptr) std::exchange(source.place, nullptr)->Abandon();
}

// A source going for good: what it queued on the loop is not applied, its flags stop counting,
// and (core NATS, on the loop) the ranks it heard are cleared: no event of theirs comes through
// it again, so kept, their blocks would over-report for good; cleared, the index under-reports
// until the engine's events come another way. A JetStream source's are kept (any thread): its
// durable consumer, made again, resumes after what it acknowledged.
void NatsSubscriptions::RetireRanks(Source& source) {
  source.ranks->Retire();
  source.counters->state_unknown.store(0);
  if (source.jetstream) return;
  ContainRefusal(
      [&] {
        for (const WorkerKey& rank : source.ranks->Ranks()) loop_.ClearRank(rank, *source.counters);
      },
      [] {});
}

// A source refused memory after it got its id is not listed as live (refused again, it is).
void NatsSubscriptions::RetireRefusedSource(uint64_t id) {
  if (id != 0) ContainRefusal([&] { loop_.RetireSource(id); }, [] {});
}

void NatsSubscriptions::MakeRemakeTimer(Source& source) {
  auto timer = std::make_unique<uv_timer_t>();
  uv_timer_init(&loop_.loop, timer.get());
  timer->data = &source;
  source.remake_timer = timer.release();
}

void NatsSubscriptions::StopRemaking(Source& source) {
  if (source.remake_timer == nullptr) return;
  uv_timer_stop(source.remake_timer);
  uv_close(reinterpret_cast<uv_handle_t*>(std::exchange(source.remake_timer, nullptr)),
           [](uv_handle_t* timer) { delete reinterpret_cast<uv_timer_t*>(timer); });
}

absl::Status NatsSubscriptions::RemoveOnLoop(uint64_t source_id) {
  for (auto it = sources_.begin(); it != sources_.end(); ++it) {
    if ((*it)->source_id != source_id) continue;
    if ((*it)->replica_sync) replica_sync_active_ = false;
    RetireRanks(**it);
    Close(*it);
    sources_.erase(it);
    loop_.RetireSource(source_id);
    return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat("no NATS source ", source_id));
}

// Unsubscribes, waits (bounded) until the handler can no longer run, closes the connection.
void NatsSubscriptions::Close(Source* source) {
  // The router's threads publish on the connection: stop them first (once this returns, the
  // observer is not running and will not run again). Only its own observer (a later
  // kvr_router_set_replica_publisher may have replaced it), which says farewell first: a Reset,
  // so that the peers drop this replica's bookings now, not a liveness timeout later.
  // And, this router no longer hearing its peers, what it holds from them goes: their frees
  // would never come (they stayed until the request expiry).
  StopRemaking(*source);
  if (source->replica_sync &&
      loop_.router->ClearSequenceObserver(source->observer_token, /*farewell=*/true)) {
    loop_.router->ForgetReplicas();
  }
  if (source->liveness_timer != nullptr) {
    uv_timer_stop(source->liveness_timer);
    uv_close(reinterpret_cast<uv_handle_t*>(source->liveness_timer),
             [](uv_handle_t* timer) { delete reinterpret_cast<uv_timer_t*>(timer); });
    source->liveness_timer = nullptr;
  }
  // Detached first: a disconnection or close while it unsubscribes (which may wait) must not
  // flag ranks for a source gone (another may feed them by then), nor may a message its handler
  // posts late carry the close as a loss. A JetStream source's (whose losses flag nothing) once
  // its thread, which may make its connection again, is stopped.
  if (source->remaking == nullptr) DetachCallbacks(*source);
  if (source->place != nullptr) source->place->StopCountingLosses();
  // Unsubscribed at once either way: a retired source must not apply anything more (a sync
  // retried meanwhile would otherwise apply the peers' stream twice, in any order). A JetStream
  // source's own thread subscribes too: it is stopped first.
  if (source->remaking != nullptr) {
    // Busy, its thread may be waiting for a silent server: closing the connection ends that
    // (not a connect under way: that one is waited for).
    if (source->remaking->StopAsking()) CloseConnectionNow(source);
    source->remaking->Join();
    DetachCallbacks(*source);
  }
  Unsubscribe(source);
  // A connection the loop drives (all but JetStream's) goes once what it buffered (the
  // unsubscription, a farewell) is written: destroying it sooner would flush it with a PING
  // and wait for the PONG, which this thread reads, so for all of libnats' 500 ms.
  if (!source->jetstream && source->connection != nullptr) {
    DisconnectOnceWritten(source);
  } else {
    Disconnect(source);
  }
}

// The connection's socket is written by this loop (nats_loop_place.h): what it buffered
// (the unsubscription, a farewell) goes out only once the loop runs, so the connection is
// closed once libnats has nothing buffered or kFarewellMs passed (the server may be gone),
// polling every few milliseconds.
void NatsSubscriptions::DisconnectOnceWritten(Source* source) {
  struct Wait {
    NatsSubscriptions* owner;
    Source* source;
    int polls_left;
  };
  constexpr int kPollMs = 5, kFarewellMs = 500;
  std::unique_ptr<uv_timer_t> owned_timer;
  std::unique_ptr<Wait> wait;
  try {
    owned_timer = std::make_unique<uv_timer_t>();
    wait = std::make_unique<Wait>(Wait{this, source, kFarewellMs / kPollMs});
  } catch (const std::bad_alloc&) {
    return Disconnect(source);  // at once: libnats' flush may then wait its 500 ms
  }
  auto* timer = owned_timer.release();
  uv_timer_init(&loop_.loop, timer);
  timer->data = wait.release();
  uv_timer_start(
      timer,
      [](uv_timer_t* t) {
        auto* wait = static_cast<Wait*>(t->data);
        if (natsConnection_Buffered(wait->source->connection) > 0 && --wait->polls_left > 0) {
          return;
        }
        wait->owner->Disconnect(wait->source);
        delete wait;
        uv_timer_stop(t);
        uv_close(reinterpret_cast<uv_handle_t*>(t),
                 [](uv_handle_t* h) { delete reinterpret_cast<uv_timer_t*>(h); });
      },
      kPollMs, kPollMs);
}

// Waits (bounded) until the handler can no longer run. Whatever unsubscribing returns (the
// connection closed, an ephemeral consumer's deletion timed out), the subscription is closed
// or closing, and its end comes.
void NatsSubscriptions::Unsubscribe(Source* source) {
  if (source->subscription == nullptr) return;
  (void)natsSubscription_Unsubscribe(source->subscription);
  if (source->end != nullptr) source->end->Wait(std::chrono::seconds(5));
  natsSubscription* subscription = std::exchange(source->subscription, nullptr);
  source->end.reset();
  if (source->jetstream) return DestroyAfterQueuedMessages(subscription);
  natsSubscription_Destroy(subscription);
}

// A JetStream message handed to the loop is acknowledged there through its subscription
// (libnats' natsMsg_Ack reads it, and its connection, which the subscription keeps allocated):
// the subscription goes with a command queued after every message the handler queued before
// its end, once that command is done with (run, or dropped with the loop's queue). Retired
// while the loop closes (the command refused), it goes at the end of CloseAll.
NatsSubscriptions::RetiredSubscription::~RetiredSubscription() {
  if (subscription != nullptr) natsSubscription_Destroy(subscription);
}

void NatsSubscriptions::DestroyAfterQueuedMessages(natsSubscription* subscription) {
  // Refused memory for the holder (made before it holds anything), or for keeping it, the
  // subscription is leaked rather than destroyed under a message that may still use it.
  std::shared_ptr<RetiredSubscription> retired;
  if (!ContainRefusal([&] { retired = std::make_shared<RetiredSubscription>(); }, [] {})) return;
  retired->subscription = subscription;
  bool posted = false;
  ContainRefusal([&] { posted = loop_.Post([retired] {}); }, [] {});
  if (posted) return;
  std::lock_guard lock(retired_mutex_);
  ContainRefusal([&] { retired_subscriptions_.push_back(retired); },
                 [&] { retired->subscription = nullptr; });
}

void NatsSubscriptions::Disconnect(Source* source) {
  if (source->connection != nullptr) {
    DetachCallbacks(*source);  // they may run after we are gone
    natsConnection_Destroy(source->connection);
  }
  if (source->place != nullptr) source->place->Abandon();
  delete source;
}

// The connection closed at once; Disconnect still destroys it. Its callbacks are detached
// first.
void NatsSubscriptions::CloseConnectionNow(Source* source) {
  if (source->connection == nullptr) return;
  DetachCallbacks(*source);
  natsConnection_Close(source->connection);
}

void NatsSubscriptions::DetachCallbacks(Source& source) {
  if (source.callbacks == nullptr) return;
  ConnectionCallbacks::Detach(std::exchange(source.callbacks, nullptr));
}

void NatsSubscriptions::StartLiveness(Source& source) {
  const IngestOptions& options = loop_.options;
  if (options.replica_heartbeat_ms == 0 && options.replica_timeout_ms == 0) return;
  // Without heartbeats of its own, the sync still checks four times per timeout.
  const uint64_t period_ms = options.replica_heartbeat_ms > 0
                                 ? options.replica_heartbeat_ms
                                 : std::max<uint64_t>(options.replica_timeout_ms / 4, 1);
  source.liveness_timer = new uv_timer_t;
  uv_timer_init(&loop_.loop, source.liveness_timer);
  source.liveness_timer->data = this;
  uv_timer_start(
      source.liveness_timer,
      [](uv_timer_t* timer) { static_cast<NatsSubscriptions*>(timer->data)->OnLivenessTick(); },
      period_ms, period_ms);
  // The first heartbeat at once, not a period later: the peers track this replica from now
  // on, and every change it publishes carries the interval (one that dies before its second
  // heartbeat still has its bookings dropped).
  if (options.replica_heartbeat_ms > 0) {
    (void)loop_.router->PublishHeartbeat(options.replica_heartbeat_ms);
  }
}

void NatsSubscriptions::OnLivenessTick() {
  // Refused memory, a tick is skipped: the next one does the same.
  ContainRefusal([&] { LivenessTick(); }, [] {});
}

void NatsSubscriptions::LivenessTick() {
  const IngestOptions& options = loop_.options;
  if (options.replica_heartbeat_ms > 0) {
    (void)loop_.router->PublishHeartbeat(options.replica_heartbeat_ms);
  }
  if (options.replica_timeout_ms > 0) {
    (void)loop_.router->ExpireSilentReplicas(MillisToNanos(options.replica_timeout_ms));
  }
}

const uv_loop_t* NatsSubscriptions::BindLoopThread(const uv_loop_t* loop) {
  return NatsLoopPlace::BindLoopThread(loop);
}

NatsSubscriptions::NatsSubscriptions(IngestLoop& loop) : loop_(loop) {}

// A remake's connection still being made is discarded by its thread (the loop, now closed,
// takes it no more), which is joined here, before anything it uses goes.
NatsSubscriptions::~NatsSubscriptions() { connector_.reset(); }

void NatsSubscriptions::CloseAll() {
  if (connector_ != nullptr) connector_->Stop();
  // The relay first: it publishes what the index's last changes queued (up to its deadline).
  loop_.tap = nullptr;
  {
    std::lock_guard lock(relay_mutex_);
    relay_.reset();
  }
  for (Source* source : sources_) Close(source);
  sources_.clear();
  // Every JetStream thread is joined and every message command has run (this is the loop's
  // last): what was retired while the loop closed goes now, not with this object.
  std::lock_guard lock(retired_mutex_);
  retired_subscriptions_.clear();
}

void NatsSubscriptions::RanksChanged(const RankChange& change) noexcept {
  // One recount queued at most: a loop not started yet does not pile up a command per change.
  // Refused memory (or stopped), the counts are made again with each source's next flag change.
  ContainRefusal(
      [&] {
        if (!dropped_.Change(change) || recount_posted_.exchange(true, std::memory_order_acq_rel))
          return;
        const bool posted = loop_.Post([this] {
          recount_posted_.exchange(false, std::memory_order_acq_rel);
          for (Source* source : sources_) StoreUnknown(*source->counters, *source->ranks);
        });
        if (!posted) recount_posted_.store(false);
      },
      [&] { recount_posted_.store(false); });
}

void NatsSubscriptions::StoreUnknown(SourceCounters& source, SourceRanks& ranks) {
  source.state_unknown.store(static_cast<int64_t>(ranks.CountedUnknown()));
  // Retired meanwhile on another thread (a JetStream source refused while listing, whose queued
  // message got past the check): either its zero comes after this store, or this sees the flag
  // (both sequentially consistent).
  if (ranks.retired()) source.state_unknown.store(0);
}

natsStatus ReconnectingOptions(const std::string& url, natsOptions** out) {
  natsOptions* opts = nullptr;
  natsStatus s = natsOptions_Create(&opts);
  if (s == NATS_OK) s = natsOptions_SetURL(opts, url.c_str());
  if (s == NATS_OK) s = natsOptions_SetTimeout(opts, 2000);
  if (s == NATS_OK) s = natsOptions_SetAllowReconnect(opts, true);
  if (s == NATS_OK) s = natsOptions_SetMaxReconnect(opts, -1);  // forever
  if (s == NATS_OK) s = natsOptions_SetReconnectWait(opts, 100);
  if (s != NATS_OK && opts != nullptr) natsOptions_Destroy(opts);
  *out = s == NATS_OK ? opts : nullptr;
  return s;
}

// ---- JetStream ------------------------------------------------------------------------------

// Stream and consumer names become subject tokens in JetStream's API.
static absl::Status ValidateJetStreamName(const std::string& what, const std::string& name) {
  if (name.find_first_of(" \t\r\n.*>") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("the JetStream ", what, " '", name,
                                                   "' must not contain spaces, '.', '*' or '>'"));
  }
  return absl::OkStatus();
}

absl::Status ValidateJetStream(const JetStreamSource& config) {
  if (config.url.empty()) return absl::InvalidArgumentError("the NATS url is empty");
  if (config.stream.empty()) return absl::InvalidArgumentError("the JetStream stream is empty");
  if (config.subject.empty()) return absl::InvalidArgumentError("the NATS subject is empty");
  if (absl::Status s = ValidateJetStreamName("stream", config.stream); !s.ok()) return s;
  if (absl::Status s = ValidateJetStreamName("consumer", config.durable); !s.ok()) return s;
  if (!(config.max_age_seconds >= 0 && config.max_age_seconds <= 1e9)) {
    return absl::InvalidArgumentError("the stream's max age must be 0 (none) or positive");
  }
  if (config.max_bytes < -1 || config.max_bytes == 0) {
    return absl::InvalidArgumentError("the stream's max bytes must be -1 (none) or positive");
  }
  return absl::OkStatus();
}

absl::Status JetStreamError(const std::string& what, natsStatus s, jsErrCode code) {
  return absl::UnavailableError(absl::StrCat(what, ": ", natsStatus_GetText(s), " (",
                                             nats_GetLastError(nullptr), ", error code ",
                                             static_cast<int>(code), ")"));
}

static bool IsNotFound(natsStatus s, jsErrCode code, jsErrCode not_found) {
  return s == NATS_NOT_FOUND || code == not_found;
}

absl::Status EnsureStream(jsCtx* js, const JetStreamSource& config) {
  jsStreamInfo* info = nullptr;
  jsErrCode code = static_cast<jsErrCode>(0);
  natsStatus s = js_GetStreamInfo(&info, js, config.stream.c_str(), nullptr, &code);
  if (s == NATS_OK) {
    jsStreamInfo_Destroy(info);
    return absl::OkStatus();
  }
  if (!IsNotFound(s, code, JSStreamNotFoundErr)) {
    return JetStreamError(absl::StrCat("looking up stream '", config.stream, "'"), s, code);
  }
  if (!config.create_stream) {
    return absl::NotFoundError(
        absl::StrCat("no JetStream stream '", config.stream, "' at ", WithoutUserInfo(config.url)));
  }
  jsStreamConfig stream;
  jsStreamConfig_Init(&stream);
  const char* subjects[] = {config.subject.c_str()};
  stream.Name = config.stream.c_str();
  stream.Subjects = subjects;
  stream.SubjectsLen = 1;
  stream.Storage = js_FileStorage;
  stream.MaxAge = static_cast<int64_t>(config.max_age_seconds * 1e9);
  stream.MaxBytes = config.max_bytes;
  s = js_AddStream(&info, js, &stream, nullptr, &code);
  if (s != NATS_OK) {
    return JetStreamError(absl::StrCat("creating stream '", config.stream, "'"), s, code);
  }
  jsStreamInfo_Destroy(info);
  return absl::OkStatus();
}

namespace {

// Where a new consumer starts: from stream sequence `start` (0: the stream's first message),
// or, `after_ns` non-zero, from the first message stored after that time.
void SetStart(jsConsumerConfig& consumer, uint64_t start, int64_t after_ns = 0) {
  consumer.AckPolicy = js_AckExplicit;
  if (after_ns != 0) {
    consumer.DeliverPolicy = js_DeliverByStartTime;
    consumer.OptStartTime = after_ns + 1;
    return;
  }
  consumer.DeliverPolicy = start > 0 ? js_DeliverByStartSequence : js_DeliverAll;
  consumer.OptStartSeq = start;
}

// The durable consumer exists afterwards: kept as it was with `resume`, else (re)created at
// the start asked for. `*resumed_at`: a kept consumer's acknowledged floor (0 otherwise).
// A consumer to resume that has delivered messages it holds unacknowledged (the ingest before
// stopped before it applied them) is made again from just after its floor: kept, it would
// deliver the messages after them first and them an AckWait later, below the position,
// where they are dropped as redeliveries.
absl::Status CreateDurable(jsCtx* js, const JetStreamSource& config, uint64_t start,
                           int64_t start_after_ns, ConsumerRemaking* remaking);

struct DurableState {
  uint64_t resumed_at = 0;  // a resumed consumer's acknowledged floor
  uint64_t delivered = 0;   // the deliveries a consumer kept had made (0: made now)
};

// `remaking`: a consumer made again after lost deliveries; its thread must not be cut short
// between deleting the durable and creating it.
absl::Status EnsureDurable(jsCtx* js, const JetStreamSource& config, DurableState* state,
                           int64_t start_after_ns = 0, ConsumerRemaking* remaking = nullptr) {
  const char* stream = config.stream.c_str();
  const char* durable = config.durable.c_str();
  jsConsumerInfo* info = nullptr;
  jsErrCode code = static_cast<jsErrCode>(0);
  uint64_t start = config.start_sequence;
  natsStatus s = js_GetConsumerInfo(&info, js, stream, durable, nullptr, &code);
  if (s == NATS_OK) {
    const uint64_t ack_floor = info->AckFloor.Stream;
    const uint64_t delivered = info->Delivered.Consumer;
    const bool unacknowledged = info->NumAckPending > 0;
    jsConsumerInfo_Destroy(info);
    if (config.resume) {
      state->resumed_at = ack_floor;
      if (!unacknowledged) {
        state->delivered = delivered;
        return absl::OkStatus();
      }
      if (ack_floor > 0) start = ack_floor + 1;
    }
    UncuttableStep step(remaking);
    if (!step.taken()) return absl::CancelledError("the source is stopping");
    // Missing from the request on: its reply may be lost after the server deleted it.
    if (remaking != nullptr) remaking->DurableMissing(true);
    s = js_DeleteConsumer(js, stream, durable, nullptr, &code);
    if (s != NATS_OK) return JetStreamError("replacing the durable consumer", s, code);
    return CreateDurable(js, config, start, start_after_ns, remaking);
  } else if (!IsNotFound(s, code, JSConsumerNotFoundErr)) {
    return JetStreamError(absl::StrCat("looking up consumer '", config.durable, "'"), s, code);
  }
  // Missing from here until created, in a step Close does not cut short: a durable marked
  // missing tells Close that this thread, not Close, may still change the connection
  // (RecreateMissingDurable).
  UncuttableStep step(remaking);
  if (!step.taken()) return absl::CancelledError("the source is stopping");
  if (remaking != nullptr) remaking->DurableMissing(true);
  return CreateDurable(js, config, start, start_after_ns, remaking);
}

absl::Status CreateDurable(jsCtx* js, const JetStreamSource& config, uint64_t start,
                           int64_t start_after_ns, ConsumerRemaking* remaking) {
  natsInbox* deliver = nullptr;
  if (natsInbox_Create(&deliver) != NATS_OK) return absl::ResourceExhaustedError("no inbox");
  jsConsumerConfig consumer;
  jsConsumerConfig_Init(&consumer);
  consumer.Durable = config.durable.c_str();
  consumer.DeliverSubject = deliver;
  consumer.FilterSubject = config.subject.c_str();
  SetStart(consumer, start, start_after_ns);
  jsConsumerInfo* info = nullptr;
  jsErrCode code = static_cast<jsErrCode>(0);
  const natsStatus s = js_AddConsumer(&info, js, config.stream.c_str(), &consumer, nullptr, &code);
  natsInbox_Destroy(deliver);
  if (s != NATS_OK) {
    return JetStreamError(absl::StrCat("creating consumer '", config.durable, "'"), s, code);
  }
  jsConsumerInfo_Destroy(info);
  if (remaking != nullptr) remaking->DurableMissing(false);
  return absl::OkStatus();
}

// Where a consumer made again after lost deliveries starts (RemakeRequest): from `from`, and
// `gone` of the messages from there the stream no longer holds (its limits removed them: lost).
// Unless the message at the position is not the one the source applied (not stored when that
// was) or is past the stream's end: the stream numbers messages anew (a server that lost its
// tail), so it starts by time, from when the last message applied was stored, and that is a
// loss too (the lost tail may have held messages not applied).
struct RemakeStart {
  uint64_t sequence = 0;
  int64_t after_ns = 0;
  uint64_t gone = 0;
};

absl::Status FindRemakeStart(jsCtx* js, const std::string& stream, const RemakeRequest& request,
                             RemakeStart* start) {
  jsStreamInfo* info = nullptr;
  jsErrCode code = static_cast<jsErrCode>(0);
  natsStatus s = js_GetStreamInfo(&info, js, stream.c_str(), nullptr, &code);
  if (s != NATS_OK)
    return JetStreamError(absl::StrCat("looking up stream '", stream, "'"), s, code);
  const uint64_t first = info->State.FirstSeq, last = info->State.LastSeq;
  jsStreamInfo_Destroy(info);
  *start = {.sequence = request.from, .gone = first > request.from ? first - request.from : 0};
  const uint64_t position = request.from - 1;
  if (request.applied_ns == 0 || position == 0 || position < first) return absl::OkStatus();
  bool renumbered = position > last;
  if (!renumbered) {
    natsMsg* applied = nullptr;
    s = js_GetMsg(&applied, js, stream.c_str(), position, nullptr, &code);
    if (s == NATS_OK) {
      renumbered = natsMsg_GetTime(applied) != request.applied_ns;
      natsMsg_Destroy(applied);
    } else if (!IsNotFound(s, code, JSNoMessageFoundErr)) {  // deleted: numbering unknown
      return JetStreamError(absl::StrCat("reading message ", position), s, code);
    }
  }
  if (renumbered) {
    // From the whole second (libnats 3.4 encodes a start time's fraction without its leading
    // zeros: up to 0.9 s late); what it delivers again that was applied is dropped
    // (JetStreamOrder::IsRedelivery). What the lost tail held that was not applied is gone.
    constexpr int64_t kSecond = 1'000'000'000;
    *start = {.after_ns = request.applied_ns / kSecond * kSecond - 1, .gone = 1};
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint64_t> NatsSubscriptions::SubscribeJetStream(const JetStreamSource& config) {
  if (absl::Status valid = ValidateJetStream(config); !valid.ok()) return valid;
  auto source = std::make_unique<Source>();
  source->owner = this;
  source->ranks = std::make_shared<SourceRanks>(&dropped_);
  source->counters = std::make_shared<SourceCounters>();
  source->jetstream = true;
  source->counters->relayed = false;  // the events are in a stream already
  source->remaking = std::make_shared<ConsumerRemaking>();
  source->jetstream_config = config;
  absl::StatusOr<Made> made = MakeJetStreamConnection(*source);
  if (!made.ok()) return made.status();
  source->connection = std::exchange(made->connection, nullptr);
  source->callbacks = std::exchange(made->callbacks, nullptr);
  absl::Status consuming = Consume(config, *source);
  if (consuming.ok()) {
    try {
      source->remaking->thread = std::thread([this, s = source.get()] { RemakeConsumers(*s); });
    } catch (const std::exception& e) {
      consuming = absl::ResourceExhaustedError(absl::StrCat("no JetStream thread: ", e.what()));
    }
  }
  if (!consuming.ok()) {
    RetireRanks(*source);  // its consumer may have delivered already
    Close(source.release());
    return consuming;
  }
  uint64_t id = 0;
  absl::Status added;
  try {  // before Start, Run runs the command here, and a refusal comes out of it
    added = loop_.Run([&] {
      Bump(source->counters->connections);
      loop_.NewSource(id, IngestSourceKind::kJetStream, WithoutUserInfo(config.url),
                      source->counters);
      source->source_id = id;
      sources_.push_back(source.get());
      return absl::OkStatus();
    });
  } catch (const std::bad_alloc&) {
    added = absl::ResourceExhaustedError("no memory to add the JetStream source");
  }
  if (!added.ok()) {
    RetireRanks(*source);  // its consumer delivers already
    RetireRefusedSource(id);
    Close(source.release());
    return added;
  }
  (void)source.release();  // sources_ owns it
  return id;
}

absl::StatusOr<uint64_t> NatsSubscriptions::RelayToJetStream(const JetStreamSource& target) {
  std::lock_guard lock(relay_mutex_);
  if (relay_ != nullptr) {
    return absl::FailedPreconditionError("this ingest object relays into a stream already");
  }
  auto counters = std::make_shared<SourceCounters>();
  auto relay =
      JetStreamRelay::Start(target, loop_.options.relay_backlog_bytes, *loop_.router, counters);
  if (!relay.ok()) return relay.status();
  uint64_t id = 0;
  absl::Status added = loop_.Run([&] {
    loop_.NewSource(id, IngestSourceKind::kJetStreamRelay, WithoutUserInfo(target.url), counters);
    loop_.tap = relay->get();
    return absl::OkStatus();
  });
  if (!added.ok()) return added;
  relay_ = std::move(*relay);
  return id;
}

namespace {

using JetStreamContext = std::unique_ptr<jsCtx, decltype(&jsCtx_Destroy)>;

absl::StatusOr<JetStreamContext> JetStreamOf(natsConnection* connection) {
  jsCtx* js = nullptr;
  natsStatus s = natsConnection_JetStream(&js, connection, nullptr);
  if (s != NATS_OK) return JetStreamError("JetStream context", s, static_cast<jsErrCode>(0));
  return JetStreamContext(js, &jsCtx_Destroy);
}

}  // namespace

// Ensures the stream and consumer, then subscribes with acknowledgements by hand.
absl::Status NatsSubscriptions::Consume(const JetStreamSource& config, Source& source) {
  absl::StatusOr<JetStreamContext> context = JetStreamOf(source.connection);
  if (!context.ok()) return context.status();
  jsCtx* js = context->get();
  absl::Status status = EnsureStream(js, config);
  // Until a message comes, the source stands where it starts: just before start_sequence (a
  // router restored from a snapshot holds everything up to there), or at a resumed consumer's
  // acknowledged floor. A snapshot of this router then names a position it really holds.
  uint64_t position = config.start_sequence > 0 ? config.start_sequence - 1 : 0;
  DurableState durable;
  if (status.ok() && !config.durable.empty()) {
    status = EnsureDurable(js, config, &durable);
    if (durable.resumed_at > 0) position = durable.resumed_at;
  }
  source.counters->stream_sequence.store(position, std::memory_order_relaxed);
  // The first delivery's number is known: a delivery lost before it is seen as such.
  source.order->NumberedAfter(durable.delivered);
  return status.ok() ? SubscribeConsumer(config, source) : status;
}

// Subscribes to the durable consumer (made before), or to an ephemeral one made now from
// config.start_sequence, with acknowledgements by hand.
absl::Status NatsSubscriptions::SubscribeConsumer(const JetStreamSource& config, Source& source,
                                                  int64_t start_after_ns) {
  absl::StatusOr<JetStreamContext> js = JetStreamOf(source.connection);
  if (!js.ok()) return js.status();
  SubscriptionEnd::Watcher watcher;
  jsSubOptions options;
  jsSubOptions_Init(&options);
  options.Stream = config.stream.c_str();
  options.ManualAck = true;
  if (!config.durable.empty()) {
    options.Consumer = config.durable.c_str();  // bound: unsubscribing keeps it
  } else {
    SetStart(options.Config, config.start_sequence, start_after_ns);
  }
  jsErrCode code = static_cast<jsErrCode>(0);
  natsStatus s = js_Subscribe(&source.subscription, js->get(), config.subject.c_str(),
                              &Source::OnMessage, &source, nullptr, &options, &code);
  if (s == NATS_OK) s = SubscriptionEnd::Watch(source.subscription, watcher, &source.end);
  return s == NATS_OK ? absl::OkStatus() : JetStreamError("subscribing to the stream", s, code);
}

// Retried until it is done or the source closes: meanwhile nothing is delivered, as in an
// outage (the server unreachable, the heap refusing memory). After kFlagAfter of failures
// (the server refusing, say: the user may not make consumers) every rank the source fed is
// flagged once, as what it misses is unknown; the messages still come once a remake succeeds.
void NatsSubscriptions::RemakeConsumers(Source& source) {
  constexpr std::chrono::milliseconds kLongestPause(2000);
  constexpr std::chrono::seconds kFlagAfter(10);
  for (RemakeRequest request; (request = source.remaking->Next()).from != 0;) {
    const auto since = std::chrono::steady_clock::now();
    std::chrono::milliseconds delay(50);
    bool loss_told = false;  // told the loop once: ranks lost (gone from the stream, or failing)
    for (;; delay = std::min(delay * 2, kLongestPause)) {
      absl::Status status;
      const bool completed =
          ContainRefusal([&] { status = RemakeConsumer(source, request, loss_told); }, [] {});
      if (completed && status.ok()) break;
      // Not when stopping: the stop closed the connection under the attempt (set before it
      // closes), and no attempt follows.
      if (!source.remaking->Stopping()) Bump(source.counters->consumer_remake_failures);
      if (!loss_told && std::chrono::steady_clock::now() - since > kFlagAfter) {
        ContainRefusal([&] { loss_told = LoseEveryRankLater(source.counters, source.ranks); },
                       [] {});
      }
      if (!source.remaking->Pause(delay)) return RecreateMissingDurable(source, request);
    }
  }
}

// Stopping after a remake deleted the durable and could not create it again: one more try, so
// that a later resume finds it (else it starts from the stream's start).
void NatsSubscriptions::RecreateMissingDurable(Source& source, const RemakeRequest& request) {
  if (!source.remaking->IsDurableMissing()) return;
  ContainRefusal(
      [&] {
        // Its connection closed for good (how a remake most often loses the durable), one is
        // made for this try. Close waits for this thread without touching the connection while
        // the durable is missing (ConsumerRemaking::StopAsking), so it is changed here freely.
        if (source.connection == nullptr || natsConnection_IsClosed(source.connection)) {
          absl::StatusOr<Made> made = MakeJetStreamConnection(source);
          if (!made.ok()) return;
          DropConnection(source);
          InstallJetStreamConnection(source, *made);
        }
        absl::StatusOr<JetStreamContext> js = JetStreamOf(source.connection);
        if (!js.ok()) return;
        const JetStreamSource& config = source.jetstream_config;
        jsConsumerInfo* info = nullptr;
        if (js_GetConsumerInfo(&info, js->get(), config.stream.c_str(), config.durable.c_str(),
                               nullptr, nullptr) == NATS_OK) {
          jsConsumerInfo_Destroy(info);  // there after all (a reply was lost, not the create)
          return;
        }
        RemakeStart start;
        if (FindRemakeStart(js->get(), config.stream, request, &start).ok()) {
          (void)CreateDurable(js->get(), config, start.sequence, start.after_ns, nullptr);
        }
      },
      [] {});
}

// A JetStream source's connection, on libnats' own threads, not the loop: setting up the
// consumer takes request-reply round trips on the connecting thread (the caller's, or the
// source's own). libnats closing it for good has the source's thread make it again.
absl::StatusOr<NatsSubscriptions::Made> NatsSubscriptions::MakeJetStreamConnection(
    const Source& source) {
  auto callbacks = NewCallbacks(this, source.counters, source.ranks,
                                /*disconnection_loses_events=*/false);
  callbacks->jetstream_remaking = source.remaking;
  callbacks->jetstream_order = source.order;
  const std::string& url = source.jetstream_config.url;
  natsOptions* opts = nullptr;
  natsStatus s = CreateOptions(url, *callbacks, &opts);
  Made made;
  if (s == NATS_OK) s = natsConnection_Connect(&made.connection, opts);
  natsOptions_Destroy(opts);
  if (s != NATS_OK) return ConnectFailed(url, s, made.connection, std::move(callbacks));
  made.callbacks = callbacks.release();  // shared with the connection now
  return made;
}

// The source's thread: the connection libnats closed for good goes (with its subscription),
// and a new one is made. Each change of the source's connection is an uncuttable step: Close
// touches the connection only when it may cut the thread short, never during one. A connect
// that waits for a silent server is not cut short: Close waits for it (the connect timeout per
// server of the url).
absl::Status NatsSubscriptions::ReconnectJetStream(Source& source) {
  {
    UncuttableStep step(source.remaking.get());
    if (!step.taken()) return absl::CancelledError("the source is stopping");
    DropConnection(source);
  }
  absl::StatusOr<Made> made = MakeJetStreamConnection(source);
  if (!made.ok()) return made.status();
  UncuttableStep step(source.remaking.get());
  if (!step.taken()) {
    Discard(*made);
    return absl::CancelledError("the source is stopping");
  }
  InstallJetStreamConnection(source, *made);
  return absl::OkStatus();
}

void NatsSubscriptions::InstallJetStreamConnection(Source& source, Made& made) {
  source.connection = std::exchange(made.connection, nullptr);
  source.callbacks = std::exchange(made.callbacks, nullptr);
  Bump(source.counters->connections);
}

// The consumer, made again to deliver what the source has not applied (FindRemakeStart): all
// that its lost deliveries skipped comes again, in order. The old subscription ends first, so
// the loop hears, in order, every message it handed over (not applied, the loop awaiting the
// new consumer), then that the new consumer is there (JetStreamOrder::NewConsumer), then what
// it delivers.
absl::Status NatsSubscriptions::RemakeConsumer(Source& source, const RemakeRequest& request,
                                               bool& loss_told) {
  if (source.connection == nullptr || natsConnection_IsClosed(source.connection)) {
    if (absl::Status reconnected = ReconnectJetStream(source); !reconnected.ok()) {
      return reconnected;
    }
  }
  Unsubscribe(&source);
  absl::StatusOr<JetStreamContext> js = JetStreamOf(source.connection);
  if (!js.ok()) return js.status();
  JetStreamSource config = source.jetstream_config;
  RemakeStart start;
  absl::Status status = FindRemakeStart(js->get(), config.stream, request, &start);
  config.start_sequence = start.sequence;
  config.resume = false;  // a durable is made again
  DurableState unused;
  if (status.ok() && !config.durable.empty()) {
    status = EnsureDurable(js->get(), config, &unused, start.after_ns, source.remaking.get());
  }
  if (!status.ok()) return status;
  // From here to the end, the connection is not cut short (Close waits): the marker and the
  // subscription go together, and the subscription's end is watched before Close may look.
  UncuttableStep step(source.remaking.get());
  if (!step.taken()) return absl::CancelledError("the source is stopping");
  const bool lost = start.gone > 0 && !loss_told;  // some may have been this source's
  const bool told = loop_.Post(
      [this, order = source.order, counters = source.counters, ranks = source.ranks, lost] {
        order->NewConsumer();
        if (lost) LoseEveryRankContained(*counters, *ranks);
      });
  if (!told) return absl::OkStatus();  // stopped: nothing more is applied
  loss_told = loss_told || lost;
  absl::Status subscribed = SubscribeConsumer(config, source, start.after_ns);
  if (subscribed.ok()) Bump(source.counters->consumer_remakes);
  return subscribed;
}

// ---- KV events: native batches and Dynamo's event plane -------------------------------------

// A NATS message: a native EventBatch or a message of Dynamo's event plane, told apart by
// content (a batch is verified first; a Dynamo message is a msgpack map, never a valid batch).
// Neither: counted as a bad batch, or as bad msgpack when it is msgpack of the wrong shape.
void NatsSubscriptions::HandleEventsContained(std::span<const uint8_t> payload,
                                              SourceCounters& source, PublisherSequences& dynamo,
                                              SourceRanks& ranks) {
  // A message the heap refused memory to is lost, as in an outage: its ranks are lost with the
  // next message (the flag allocates nothing; losing them now might be refused too).
  ContainRefusal([&] { HandleEvents(payload, source, dynamo, ranks); },
                 [&] {
                   Bump(source.gaps);
                   ranks.LoseEveryRankLater();
                 });
}

void NatsSubscriptions::HandleEvents(std::span<const uint8_t> payload, SourceCounters& source,
                                     PublisherSequences& dynamo, SourceRanks& ranks) {
  // A message lost for memory where the loop could not handle it: its ranks are lost now (the
  // flag stays set until that is done).
  if (ranks.TakeLossForLater()) {
    try {
      ForgetEveryRank(source, ranks);
    } catch (...) {
      ranks.LoseEveryRankLater();  // still to do
      throw;
    }
  }
  ApplyEvents(payload, source, dynamo, ranks);
  Bump(source.messages);  // last: a reader that sees the count sees what it applied
}

// Applies a JetStream message, unless the source applied it already. A delivery number
// skipped before it: deliveries were lost, so this one and all after it are not applied until
// the consumer is made again from just after the position, to deliver the lost ones first.
bool NatsSubscriptions::HandleJetStreamMessage(const JetStreamPlace& place,
                                               std::span<const uint8_t> payload,
                                               SourceCounters& source, PublisherSequences& dynamo,
                                               SourceRanks& ranks, JetStreamOrder& order,
                                               ConsumerRemaking& remaking) {
  const uint64_t position = source.stream_sequence.load(std::memory_order_relaxed);
  if (order.AwaitingNewConsumer()) return false;  // comes again from the new consumer
  if (order.MissedDeliveries(place.delivery) > 0) {
    order.AwaitNewConsumer();
    remaking.Ask({.from = position + 1, .applied_ns = order.last_applied_ns()});
    return false;
  }
  if (order.IsRedelivery(place.stream, place.stored_ns, position)) {
    // Delivered again after later ones: applied already, its acknowledgement lost (a server
    // killed before it stored it redelivers it). Applied now it could restore blocks later
    // ones removed, and the position would go back.
    source.Reject(IngestReject::kStaleSequence);
    Bump(source.messages);
    return true;
  }
  // Refused memory, the message is lost as in an outage, and acknowledged all the same:
  // delivered again after later ones, it could restore blocks they removed.
  HandleEventsContained(payload, source, dynamo, ranks);
  if (place.stream != 0) {
    source.stream_sequence.store(place.stream, std::memory_order_relaxed);
    order.Applied(place.stored_ns);
  }
  return true;
}

void NatsSubscriptions::ApplyEvents(std::span<const uint8_t> payload, SourceCounters& source,
                                    PublisherSequences& dynamo, SourceRanks& ranks) {
  uint64_t publish_time_ns = 0;
  if (auto events = DecodeEventBatch(payload, &publish_time_ns); events.ok()) {
    ApplyHeard(*events, SourceRanks::kNoPublisher, source, ranks);
    source.RecordLag(publish_time_ns);
    return;
  }
  auto message = DecodeDynamoEventPlane(payload);
  if (message.ok()) {
    ApplyDynamoMessage(*message, source, dynamo, ranks);
  } else {
    source.Reject(absl::IsDataLoss(message.status()) ? IngestReject::kBadFlatBuffers
                                                     : IngestReject::kBadMsgpack,
                  std::string(message.status().message()));
  }
}

void NatsSubscriptions::ApplyDynamoMessage(const DynamoMessage& message, SourceCounters& source,
                                           PublisherSequences& dynamo, SourceRanks& ranks) {
  const PublisherSequences::Verdict verdict =
      dynamo.Observe(message.publisher_id, message.sequence);
  if (verdict.action == SequenceAction::kStale) {
    source.Reject(IngestReject::kStaleSequence);
    return;
  }
  if (verdict.action == SequenceAction::kGap) {
    // Messages lost (the event plane has no replay): what the publisher's ranks hold is
    // unknown, so they are cleared and learnt again, as for an engine without replay.
    source.Gap(verdict.missed);
    for (const WorkerKey& rank : verdict.publisher->ranks) LoseRank(rank, source, ranks);
  }
  for (const KvEvent& event : message.events) {
    const bool first_heard = verdict.publisher->ranks.insert(event.worker).second;
    if (!first_heard) continue;
    if (verdict.publisher->joined) {
      // A publisher first heard above its message 0 ran before this router: what each rank it
      // speaks for held then is unknown, until the engine clears it.
      FlagRank(event.worker, source, ranks);
    } else {
      // Heard from its message 0, the publisher holds nothing on a rank but what its messages
      // store, and none stored anything on this one yet: whatever the rank holds (a restored
      // snapshot's blocks of an older process, a worker removed without clearing and added
      // again) is not its own and goes before its events apply, as for an engine heard from 0.
      // Unless messages were lost since: they may have stored on this rank, so it is flagged
      // too, until the engine clears it.
      loop_.ClearRank(event.worker, source);
      if (verdict.publisher->gapped) FlagRank(event.worker, source, ranks);
    }
  }
  ApplyHeard(message.events, message.publisher_id, source, ranks);
  source.RecordLag(message.published_at_ms * 1'000'000);
}

void NatsSubscriptions::ApplyHeard(std::span<const KvEvent> events, uint64_t publisher,
                                   SourceCounters& source, SourceRanks& ranks) {
  for (const KvEvent& event : events) {
    const size_t unknown = ranks.CountedUnknown();
    if (ranks.Heard(event.worker, publisher)) {
      // Another publisher had this rank: the worker restarted, its old blocks are gone.
      loop_.ClearRank(event.worker, source);
      Bump(source.restarts);
    }
    // A flagged rank heard longest ago may have been forgotten to make room.
    if (ranks.CountedUnknown() != unknown) StoreUnknown(source, ranks);
    const bool known_again =
        std::holds_alternative<ClearedEvent>(event.data) && ranks.Cleared(event.worker);
    (void)loop_.ApplyOne(event, source);
    if (known_again) StoreUnknown(source, ranks);
  }
}

// The rank's state was lost: cleared (the index must not keep what the engine may have
// evicted meanwhile) and flagged until the engine clears it itself.
void NatsSubscriptions::LoseRank(WorkerKey rank, SourceCounters& source, SourceRanks& ranks) {
  loop_.ClearRank(rank, source);
  Bump(source.recoveries);
  FlagRank(rank, source, ranks);
}

void NatsSubscriptions::FlagRank(WorkerKey rank, SourceCounters& source, SourceRanks& ranks) {
  ranks.Lose(rank);
  StoreUnknown(source, ranks);
}

bool NatsSubscriptions::ReconnectJetStreamLater(std::shared_ptr<SourceCounters> counters,
                                                std::shared_ptr<JetStreamOrder> order,
                                                std::shared_ptr<ConsumerRemaking> remaking) {
  // As after lost deliveries (HandleJetStreamMessage): what the closed connection still hands
  // over is not applied; the new consumer delivers it again, from just after the position.
  return loop_.Post(
      [counters = std::move(counters), order = std::move(order), remaking = std::move(remaking)] {
        // A remake under way (asked, its consumer not yet there) makes the connection again itself:
        // its attempt on the closed one fails, and the next begins by reconnecting. Asked again, it
        // would make the consumer twice, the second time from a position it no longer stands at.
        if (order->AwaitingNewConsumer()) return;
        order->AwaitNewConsumer();
        const uint64_t position = counters->stream_sequence.load(std::memory_order_relaxed);
        remaking->Ask({.from = position + 1, .applied_ns = order->last_applied_ns()});
      });
}

bool NatsSubscriptions::LoseEveryRankLater(std::shared_ptr<SourceCounters> source,
                                           std::shared_ptr<SourceRanks> ranks,
                                           std::optional<uint64_t> through) {
  return loop_.Post([this, source = std::move(source), ranks = std::move(ranks), through] {
    if (!through.has_value() || ranks->LossDue(*through)) LoseEveryRankContained(*source, *ranks);
  });
}

void NatsSubscriptions::LoseEveryRankContained(SourceCounters& source, SourceRanks& ranks) {
  if (ranks.retired()) return;  // a report queued before its source was removed
  ContainRefusal([&] { LoseEveryRank(source, ranks); }, [&] { ranks.LoseEveryRankLater(); });
}

void NatsSubscriptions::LoseEveryRank(SourceCounters& source, SourceRanks& ranks) {
  Bump(source.gaps);  // an outage: how many messages it took is unknowable
  ForgetEveryRank(source, ranks);
}

void NatsSubscriptions::ForgetEveryRank(SourceCounters& source, SourceRanks& ranks) {
  for (const WorkerKey& rank : ranks.Ranks()) LoseRank(rank, source, ranks);
}

}  // namespace kvrouter
