// The engine source: vLLM and SGLang workers publishing KV events over ZMQ. One SUB socket per
// data-parallel rank (rank r of a tcp endpoint on port + r, as vLLM binds them), its fd under
// uv_poll on the ingest loop, drained while ZMQ_EVENTS has ZMQ_POLLIN (the fd is
// edge-triggered). Messages are [topic, 8-byte big-endian sequence, msgpack payload]
// (wire/engine_events.h).
//
// Sequence numbers are per rank (RankSequence, sequence_tracker.h). A gap is first repaired by
// replay when the worker has a replay endpoint (vLLM: request the start sequence, receive (seq,
// payload) up to the end marker -1; live messages are held meanwhile). If there is none, or the
// replay times out or falls short, the rank's index entries are cleared and the source is
// flagged state_unknown (the index then under-reports that worker); the
// flag drops when the engine itself clears or restarts, i.e. its true state is known again. A
// restart clears too: a restarted engine has an empty cache. A rank whose connection dropped
// is flagged too, its blocks kept (then the index may over-report it, until a message of the
// next connection is judged: the engine may be dead, or come back as a new process with an
// empty cache, or the same one after a break).
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ingest/ingest_loop.h"

namespace kvrouter {

class EngineSubscriptions {
 public:
  explicit EngineSubscriptions(IngestLoop& loop) : loop_(loop) {}
  // Terminates the ZMQ context: after CloseAll.
  ~EngineSubscriptions();
  EngineSubscriptions(const EngineSubscriptions&) = delete;
  EngineSubscriptions& operator=(const EngineSubscriptions&) = delete;

  // IngestService::AddEngineWorker and RemoveEngineWorker (ingest_service.h). Any thread.
  absl::StatusOr<uint64_t> Add(const EngineWorker& worker);
  absl::Status Remove(uint64_t worker_id, bool clear_index);
  // Closes every subscription. Loop thread (or before Start).
  void CloseAll();

 private:
  struct Subscription;
  struct Replay;
  enum class Verdict { kApply, kDrop, kHold };

  absl::Status AddOnLoop(const EngineWorker& worker, uint64_t& id);
  absl::Status RemoveOnLoop(uint64_t worker_id, bool clear_index);
  void CloseSubscription(Subscription* sub);
  absl::Status OpenRanks(const EngineWorker& worker, std::vector<Subscription*>& subs);
  // Starts polling a subscription's socket and its monitor, as part of `source` `id`.
  // ResourceExhausted if libuv refuses (the caller closes the subscription); allocates only then
  // (its message).
  absl::Status Poll(Subscription& sub, std::shared_ptr<SourceCounters> source, uint64_t id);
  // The live socket's poll callback: Drain, contained (ContainRefusal).
  void OnReadable(Subscription& sub);
  void Drain(Subscription& sub);
  void LostForMemory(Subscription& sub);
  absl::Status WatchConnections(Subscription& sub);
  void ReadConnectionEvents(Subscription& sub);
  static void CloseSockets(Subscription* sub);
  void Process(Subscription& sub, std::vector<std::vector<uint8_t>> parts,
               bool before_request = false);
  void SetUnknown(Subscription& sub, bool unknown);
  // Counts the rank in state_unknown while its state is unknown or its connection is down.
  void CountUnknown(Subscription& sub);
  // Ends a disconnection's flag once a message of the next connection has been judged.
  void SettleDisconnection(Subscription& sub);
  void ClearRank(Subscription& sub);
  void ClearAndFlag(Subscription& sub);
  // `parts`: the message, which a replay started for it holds (Verdict::kHold).
  Verdict TrackSequence(Subscription& sub, uint64_t seq, uint64_t digest,
                        const std::vector<std::vector<uint8_t>>& parts);
  Verdict Join(Subscription& sub, uint64_t seq, const std::vector<std::vector<uint8_t>>& parts);
  // Whether the message was held for a replay (it counts once handled).
  bool HandleMessage(Subscription& sub, const std::vector<std::vector<uint8_t>>& parts);
  void ApplyPayload(Subscription& sub, const std::vector<uint8_t>& payload);
  void ApplyEngineEvent(Subscription& sub, KvEvent& event);
  // `trigger`: the live message the replay is for, held first (before the reply is read: a
  // reply already queued may end the replay at once, and the held messages then go on).
  bool StartReplay(Subscription& sub, uint64_t until, bool from_start = false,
                   const std::vector<std::vector<uint8_t>>* trigger = nullptr);
  void DrainReplay(Subscription& sub);
  // Runs the replay socket's or timer's `work` (DrainReplay, FinishReplay), contained.
  template <typename Work>
  void ContainReplay(Subscription& sub, Work work);
  void FinishReplay(Subscription& sub, bool ended);
  void HandleHeld(Subscription& sub);
  bool DropJudged(Subscription& sub, const std::vector<std::vector<uint8_t>>& parts,
                  bool before_request);
  static void CloseReplay(Replay* replay);

  IngestLoop& loop_;
  void* zmq_context_ = nullptr;
  uint64_t next_monitor_ = 0;  // names each socket monitor's inproc endpoint
  std::map<uint64_t, std::vector<Subscription*>> workers_;  // by worker id
};

}  // namespace kvrouter
