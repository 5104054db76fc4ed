// The NATS source: subjects (wildcards allowed) on a NATS server, through libnats with its
// socket polled by the ingest loop (nats_loop_place.h). libnats calls message handlers on its own
// delivery thread, so each message is handed to the loop (IngestLoop::Post) and applied there.
// Connections are made off the loop (a server that does not answer holds the subscribing caller,
// or a remake's own thread, for libnats' connect timeout, not every other source). A connection
// reconnects forever and resubscribes after the server restarts; one libnats gives up for good
// (a server's error) is made again (RemakeConnection).
//
// A subscription carries KV events: native EventBatches, or the messages of Dynamo's KV event
// plane (told apart by content; a Dynamo publisher's gap clears the ranks it wrote to, as
// nothing replays that plane), or, for replica sync (replica_sync.h), other router replicas'
// booking changes.
#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ingest/ingest_loop.h"
#include "ingest/ingest_service.h"
#include "ingest/sequence_tracker.h"

typedef struct __natsConnection natsConnection;  // libnats' (nats/nats.h)
typedef struct __natsSubscription natsSubscription;

namespace kvrouter {

class JetStreamOrder;
class NatsLoopPlace;
class RemakeConnector;
struct ConnectionCallbacks;
struct ConsumerRemaking;
struct RemakeRequest;
class JetStreamRelay;
struct DynamoMessage;
struct JetStreamPlace;

class NatsSubscriptions {
 public:
  // From any thread (libnats' closed callback): the source `source_id`'s connection, closed for
  // good by libnats, is made again (RemakeConnection: a thread of the connector's connects, the
  // loop subscribes); false once the loop is stopped.
  bool RemakeLater(uint64_t source_id);
  // From any thread (libnats' closed callback): a JetStream source's connection, closed for good
  // by libnats, is made again by the source's thread, its consumer from just after the
  // source's position; false once the loop is stopped.
  bool ReconnectJetStreamLater(std::shared_ptr<SourceCounters> counters,
                               std::shared_ptr<JetStreamOrder> order,
                               std::shared_ptr<ConsumerRemaking> remaking);
  // From any thread (a lost connection, on libnats'): LoseEveryRank, on the loop, unless
  // `through` (the connection losses the report covers, SourceRanks::connection_losses) were
  // applied already; false once the loop is stopped.
  bool LoseEveryRankLater(std::shared_ptr<SourceCounters> source,
                          std::shared_ptr<SourceRanks> ranks,
                          std::optional<uint64_t> through = std::nullopt);
  explicit NatsSubscriptions(IngestLoop& loop);
  ~NatsSubscriptions();  // after CloseAll
  NatsSubscriptions(const NatsSubscriptions&) = delete;
  NatsSubscriptions& operator=(const NatsSubscriptions&) = delete;

  // IngestService::SubscribeNats and SyncReplicas (ingest_service.h). Any thread; not
  // concurrently with IngestService::Stop.
  absl::StatusOr<uint64_t> SubscribeEvents(const std::string& url, const std::string& subject);
  absl::StatusOr<uint64_t> SyncReplicas(const std::string& url, const std::string& subject,
                                        const std::string& replica_id);
  // IngestService::SubscribeJetStream. Any thread but the loop's; not concurrently with Stop.
  absl::StatusOr<uint64_t> SubscribeJetStream(const JetStreamSource& config);
  // IngestService::RelayToJetStream. Any thread but the loop's; not concurrently with Stop.
  absl::StatusOr<uint64_t> RelayToJetStream(const JetStreamSource& target);
  // Unsubscribes and closes every connection. Loop thread (or before Start).
  void CloseAll();
  // The router's registry gained or dropped ranks (IngestService's rank listener, under the
  // router's lock: any thread, quick): the ranks it dropped are left out of every event source's
  // state_unknown until added back, the counts made again on the loop.
  void RanksChanged(const RankChange& change) noexcept;

  // On the loop thread before it runs: libnats' requests made there are applied at once. The
  // loop this thread ran before.
  static const uv_loop_t* BindLoopThread(const uv_loop_t* loop);

 private:
  struct Source;
  // A connection made for a source, not yet subscribed: the source's once SubscribeMade takes it
  // (leaving this empty). Discard destroys one no source took.
  struct Made {
    natsConnection* connection = nullptr;
    ConnectionCallbacks* callbacks = nullptr;  // shared with the connection
    std::shared_ptr<NatsLoopPlace> place;
  };

  // `replica_id` empty: KV events. Otherwise replica sync under that id.
  absl::StatusOr<uint64_t> Subscribe(const std::string& url, const std::string& subject,
                                     const std::string& replica_id);
  // Loop state: whether another source may be listed.
  absl::Status CanList(bool replica_sync) const;
  // Subscribes `source` on `made` and lists it (the loop thread, or the caller's before Start);
  // closes both if refused.
  absl::Status ListOnLoop(Source* source, Made& made, uint64_t& id);
  static void DiscardUnlisted(Source* source, Made& made);
  // Connects to `url` for a source with these counters and ranks. Any thread but the running
  // loop's: it waits for the servers of the url (the connect timeout each).
  absl::StatusOr<Made> MakeConnection(const std::string& url, bool replica_sync,
                                      std::shared_ptr<SourceCounters> counters,
                                      std::shared_ptr<SourceRanks> ranks,
                                      std::shared_ptr<NatsLoopPlace> place);
  // `made` becomes the source's, subscribed to its subject; on failure whatever was made is
  // left in the source (Close or DropConnection undo it). Where the loop is (ListOnLoop,
  // TakeRemade).
  absl::Status SubscribeMade(Source& source, Made& made);
  // Destroys a connection no source took.
  static void Discard(Made& made);
  // Replica sync: the router's booking changes published through the source's connection.
  void PublishOwnBookings(Source& source);
  void PublishOn(Source& source, natsConnection* connection);
  void RemakeWhenClosed(Source& source);
  Source* FindSource(uint64_t source_id) const;
  // A connection libnats closed for good, made again after a delay (backing off while it fails,
  // or when it closes again soon after a remake).
  void ScheduleRemake(Source& source, bool failed);
  void RemakeConnection(Source& source);
  // A thread of the connector's: hands what it made for the source `source_id` to the loop.
  void HandRemadeToLoop(uint64_t source_id, std::shared_ptr<absl::StatusOr<Made>> made,
                        SourceCounters& counters);
  void TellRemakeFailed(uint64_t source_id, SourceCounters& counters);
  // Loop thread: takes it (discarded if the source is gone), or schedules another attempt.
  void TakeRemade(uint64_t source_id, absl::StatusOr<Made> made);
  void SubscribeRemade(Source& source, Made& made);
  void RemakeFailed(Source& source);
  void DropConnection(Source& source);
  void MakeRemakeTimer(Source& source);
  void RetireRanks(Source& source);
  void RetireRefusedSource(uint64_t id);
  void StopRemaking(Source& source);
  absl::Status RemoveOnLoop(uint64_t source_id);
  void Close(Source* source);
  void Unsubscribe(Source* source);
  void DestroyAfterQueuedMessages(natsSubscription* subscription);
  void DisconnectOnceWritten(Source* source);
  void Disconnect(Source* source);
  void CloseConnectionNow(Source* source);
  // Gives up the source's share of its connection's callbacks (ConnectionCallbacks::Detach).
  static void DetachCallbacks(Source& source);
  absl::Status Consume(const JetStreamSource& config, Source& source);
  // A JetStream source's connection (callbacks included), not yet the source's.
  absl::StatusOr<Made> MakeJetStreamConnection(const Source& source);
  // The source's thread: its connection, closed for good, made again.
  absl::Status ReconnectJetStream(Source& source);
  static void InstallJetStreamConnection(Source& source, Made& made);
  // `start_after_ns` non-zero: an ephemeral consumer starts after that time, not at
  // config.start_sequence.
  absl::Status SubscribeConsumer(const JetStreamSource& config, Source& source,
                                 int64_t start_after_ns = 0);
  // A JetStream source's thread: makes its consumer again when the loop asks (deliveries were
  // lost), until the source closes.
  void RemakeConsumers(Source& source);
  absl::Status RemakeConsumer(Source& source, const RemakeRequest& request, bool& loss_told);
  void RecreateMissingDurable(Source& source, const RemakeRequest& request);
  // Replica sync: heartbeats published and silent replicas dropped on a timer
  // (IngestOptions::replica_heartbeat_ms and replica_timeout_ms).
  void StartLiveness(Source& source);
  void OnLivenessTick();
  void LivenessTick();
  // Loop thread: one message of an events subscription.
  // HandleEvents, with a message the heap refused memory to lost as in an outage.
  void HandleEventsContained(std::span<const uint8_t> payload, SourceCounters& source,
                             PublisherSequences& dynamo, SourceRanks& ranks);
  void HandleEvents(std::span<const uint8_t> payload, SourceCounters& source,
                    PublisherSequences& dynamo, SourceRanks& ranks);
  // Loop thread: one message of a JetStream source, at `place`, unless applied already.
  // Whether to acknowledge it (not if it is to come again).
  bool HandleJetStreamMessage(const JetStreamPlace& place, std::span<const uint8_t> payload,
                              SourceCounters& source, PublisherSequences& dynamo,
                              SourceRanks& ranks, JetStreamOrder& order,
                              ConsumerRemaking& remaking);
  void ApplyEvents(std::span<const uint8_t> payload, SourceCounters& source,
                   PublisherSequences& dynamo, SourceRanks& ranks);
  void ApplyDynamoMessage(const DynamoMessage& message, SourceCounters& source,
                          PublisherSequences& dynamo, SourceRanks& ranks);
  // Applies events heard from `publisher` (SourceRanks::kNoPublisher for native batches),
  // clearing first a rank that another publisher had, and unflagging a rank the engine clears.
  void ApplyHeard(std::span<const KvEvent> events, uint64_t publisher, SourceCounters& source,
                  SourceRanks& ranks);
  void LoseRank(WorkerKey rank, SourceCounters& source, SourceRanks& ranks);
  // Flags `rank` unknown (without clearing it) until its engine clears it.
  void FlagRank(WorkerKey rank, SourceCounters& source, SourceRanks& ranks);
  // The connection was lost: every rank heard may miss events until it is back.
  // LoseEveryRank, a refusal of memory left for the next message (SourceRanks::LoseEveryRankLater).
  void LoseEveryRankContained(SourceCounters& source, SourceRanks& ranks);
  void LoseEveryRank(SourceCounters& source, SourceRanks& ranks);
  // LoseEveryRank without counting a gap (it was counted when the loss happened).
  void ForgetEveryRank(SourceCounters& source, SourceRanks& ranks);

  // The state_unknown of a source.
  static void StoreUnknown(SourceCounters& source, SourceRanks& ranks);

  IngestLoop& loop_;
  DroppedRanks dropped_;                     // what the router dropped (RanksChanged)
  std::atomic<bool> recount_posted_{false};  // a recount of every source is queued on the loop
  std::list<Source*> sources_;
  bool replica_sync_active_ = false;
  std::mutex relay_mutex_;  // one relay: RelayToJetStream may run on several threads
  // A JetStream subscription dropped, destroyed with its holder (DestroyAfterQueuedMessages).
  struct RetiredSubscription {
    natsSubscription* subscription = nullptr;
    ~RetiredSubscription();
  };
  // Those retired while the loop closed (its commands refused), until CloseAll ends.
  std::mutex retired_mutex_;
  std::vector<std::shared_ptr<RetiredSubscription>> retired_subscriptions_;
  std::unique_ptr<JetStreamRelay> relay_;
  // Makes remakes' connections on a thread of its own; joined by the destructor.
  std::unique_ptr<RemakeConnector> connector_;
};

}  // namespace kvrouter
