// Sequence numbers of KV event publishers, without sockets: what to do with each message given
// what came before (apply it, drop it as stale, recover from a gap or a restart) and when a
// replay has filled a gap. The sources (engine_subscription.cc, nats_subscription.cc) act on
// these decisions; the tests drive them with plain numbers (tests/ingest/sequence_tracker_test.cc).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/hash/hash.h"
#include "core/rank_listeners.h"
#include "core/types.h"

namespace kvrouter {

enum class SequenceAction : uint8_t {
  kApply,    // the expected message (or the first one heard): apply it
  kGap,      // messages were lost before this one: recover, then apply it
  kRestart,  // the publisher restarted (its sequence went back): clear, then apply it
  kStale,    // a sequence number already seen (duplicate or reordered): drop it
};

// One engine rank's live stream (vLLM and SGLang number their ZMQ messages per rank): the first
// message sets the baseline (`joined` when it is not message 0); a jump forward is a gap; any
// step back is a restart.
//
// A step back is a restart however far it goes: on one ZMQ connection messages are neither
// repeated nor reordered, so a lower number can only come from a new publisher process (an
// engine restarted while this subscriber was reconnecting loses its first messages to the
// reconnection, so its first number heard may be anything below the old one). Its messages
// before the one heard (`missed`, 0 when it is numbered 0) were lost; the caller clears the
// rank first, then replays them from 0 or gives them up.
//
// A gap is repaired by a replay when the engine has a replay endpoint: ReplayFrom (where to
// ask), BeginReplay, then each replayed message through AcceptReplayed, then FinishReplay. Live
// messages that arrive during the replay are held by the caller and observed after
// FinishReplay. Without a replay (none, or it could not be requested), SkipGap: the lost
// events are given up on and the rank cleared.
//
// A gap's replay asks from the last message heard, whose payload digest the tracker keeps: the
// same digest in the reply proves the same engine answers (a restarted one, whose own
// numbering has passed the old one's, would otherwise replay its history onto the dead
// engine's blocks), and that its buffer reaches back past the hole, so that numbers in the
// hole the replay does not have were skipped by the engine, not lost.
//
// A replay from message 0 (a repair, a join, a restart's lost messages) takes the engine's whole
// reply, not only up to the trigger, and remembers its digests; then each held message is
// judged (JudgeHeld) before it is observed. That is for a router that was behind: the socket
// keeps the messages it had not read across a reconnection, ahead of the new connection's, so
// the held ones (the trigger among them) may be a dead engine's. One the reply holds with the
// same digest is a repeat; one received before the replay was asked for that the reply does not
// hold as it is cannot be the answering engine's (everything it had published by then is in its
// reply) and is dropped. The caller must have read every queued message into its held queue
// before asking: a dead engine's all came before the new connection's handshake. A restart
// numbered 0, or the first message ever heard, read first after a reconnection is proven so too
// (Verdict::after_reconnection).
class RankSequence {
 public:
  // The most messages a replay from 0 may carry, its digests remembered (vLLM buffers 10,000 by
  // default); a longer reply is short.
  static constexpr size_t kMaxReplyDigests = size_t{1} << 17;

  struct Verdict {
    SequenceAction action = SequenceAction::kApply;
    // kGap: how many messages were lost; kRestart: the new publisher's messages before this
    // one (lost to the reconnection), 0 when it is numbered 0.
    uint64_t missed = 0;
    // kApply of the first message heard, numbered above 0: the publisher ran before this
    // subscriber heard it, and what it published before is unknown here (the caller flags the
    // rank, or replays the publisher's history from 0).
    bool joined = false;
    // kApply of the first message heard, numbered 0: the publisher is heard from its start, so
    // it holds nothing but what its messages store. Whatever the rank holds before them (a
    // restored snapshot's blocks of an older engine, a worker removed and added again without
    // clearing its index) is not this publisher's: the caller clears the rank first.
    bool from_zero = false;
    // kRestart numbered 0, or kApply of the first message heard, read first after a
    // reconnection: it may be a message of an engine that is gone, still queued; the caller
    // proves it by a replay from 0 when the engine has a replay endpoint (its whole reply is
    // taken and the held messages judged).
    bool after_reconnection = false;
  };

  // What to do with live message `seq`, whose payload has digest `digest`. kApply moves the
  // expectation past it; kRestart with nothing missed too; kRestart with messages missed
  // expects the new publisher's message 0 (BeginReplay or SkipGap next); kGap leaves the
  // expectation for the caller to BeginReplay or SkipGap; kStale changes nothing.
  Verdict Observe(uint64_t seq, uint64_t digest = 0);

  // The connection to the publisher was made again (the socket's handshake, after the first).
  // The next message may then come from a new publisher process even when it carries the
  // number expected: the old engine died, and the new one's first messages, published while
  // nobody was connected, took it exactly there. So Observe reports that message as a gap of
  // 0 (missed 0), which only a replay's check can prove continuous (FinishReplay is short
  // without it); the caller otherwise gives up on it as on any gap. Before the first message
  // heard, the first one may be of either connection (Verdict::after_reconnection).
  void Reconnected() { reconnected_ = true; }

  // Gives up on the messages lost before live message `seq` (observed as kGap or kRestart),
  // which is applied now: seq + 1 is expected next.
  void SkipGap(uint64_t seq, uint64_t digest = 0);

  // The first sequence a replay asks for: the last message heard when its digest is known (the
  // check), else the first one missing.
  uint64_t ReplayFrom() const;
  // Asks for the messages missing before live message `until` (observed as kGap or kRestart).
  void BeginReplay(uint64_t until);
  // Forgets everything heard to ask the publisher for its whole history, from 0, before live
  // message `until`: the repair of a rank whose state was lost (the caller has cleared it).
  void BeginReplayFromStart(uint64_t until);
  bool replaying() const { return replay_until_.has_value(); }
  // The replay in progress: the live message it ends before, and whether it asked from 0.
  std::optional<uint64_t> replay_until() const { return replay_until_; }
  bool replaying_from_start() const { return replay_until_.has_value() && from_start_; }

  enum class Replayed : uint8_t {
    kSkip,       // not needed: before the hole, a repeat, or past it
    kApply,      // it fills the hole: apply it
    kRestarted,  // the check message differs: another engine answers; clear, the replay fails
  };
  // A replayed message with its payload's digest. After the check is passed any number in the
  // hole fills it (the engine skipped the ones between). A reply that goes past the check
  // without it fills nothing (nothing proves the same engine answers): the replay is short.
  // Without a check (a replay from 0, or no digest heard), only a contiguous run fills it.
  Replayed AcceptReplayed(uint64_t seq, uint64_t digest);

  enum class Outcome : uint8_t {
    kComplete,           // every missing message came, or the check proved the rest never existed
    kCompleteFromStart,  // as kComplete, and the replay went back to message 0: the whole history
    kShort,              // some are lost: given up on, as by SkipGap; the rank must be cleared
  };
  // Ends the replay: `ended` when the engine sent its end marker (the replay is all it has),
  // false on a timeout. Either way the held live messages are observed next, `until` first
  // (after a replay from 0, judged first: JudgeHeld).
  Outcome FinishReplay(bool ended);

  enum class Held : uint8_t {
    kObserve,     // observe it as usual
    kRepeat,      // the reply applied it already: drop it, it was counted with the reply
    kDeadEngine,  // queued from an engine that is gone: drop it as stale
    // As kDeadEngine, and the first proof of that restart (unless the failed replay before
    // this one found the other engine, and the restart was counted then): count it.
    kDeadEngineRestarted,
  };
  // A held message, or a live one, after a replay from 0 that applied the engine's whole reply.
  // `before_request`: it was held, received before the replay was asked for. The judging goes
  // on past the held messages, as the live copies of the reply's last messages may arrive after
  // it; it ends with the first live message that is not a repeat (the engine's stream is in
  // order: every copy of the reply's messages came before it) or with the next replay.
  Held JudgeHeld(uint64_t seq, uint64_t digest, bool before_request);
  bool judging_held() const { return judging_; }

  // The sequence expected next; nullopt before the first message.
  std::optional<uint64_t> next() const { return next_; }

 private:
  std::optional<uint64_t> next_;
  std::optional<uint64_t> digest_;  // of message next_ - 1, when known
  // The replay in progress.
  std::optional<uint64_t> replay_until_;
  std::optional<uint64_t> check_;  // the message whose digest the reply must repeat
  bool verified_ = false;
  bool from_start_ = false;  // a replay from 0: the whole reply, then the held messages judged
  bool other_engine_ = false;
  bool unproven_ = false;     // the reply passed the check message without it
  bool reconnected_ = false;  // Reconnected() since the last message observed
  bool needs_check_ = false;  // the gap in hand is a reconnection's: only the check proves it
  // The replay just short found another engine (kRestarted, counted): the repair from 0 that
  // follows must not count the restart again when it finds the dead engine's messages held.
  bool found_other_engine_ = false;
  bool restart_counted_ = false;
  bool reply_broken_ = false;            // the whole reply skipped a number or was too long
  std::vector<uint64_t> reply_digests_;  // the whole reply's, by sequence (it runs from 0)
  bool judging_ = false;

  Outcome FinishWholeReply(uint64_t until, bool ended);
  void EndJudging();
};

// The publishers heard on one subscription of Dynamo's KV event plane: each numbers its
// messages from 0 and nothing replays them, so a gap clears the ranks its publisher wrote to.
// Publishers come and go with their workers: past kMaxPublishers, the longest silent one is
// forgotten.
class PublisherSequences {
 public:
  static constexpr size_t kMaxPublishers = 4096;

  struct Publisher {
    uint64_t next_sequence = 0;
    uint64_t last_heard = 0;  // the message count when it was last heard
    std::unordered_set<WorkerKey, absl::Hash<WorkerKey>> ranks;  // what a gap must clear
    // First heard above its message 0: it ran before this subscriber, and what its ranks held
    // then is unknown here.
    bool joined = false;
    // Messages went missing since it was first heard: they may have stored blocks on a rank it
    // has not spoken for here yet, so what such a rank holds is unknown.
    bool gapped = false;
  };
  struct Verdict {
    SequenceAction action = SequenceAction::kApply;  // kApply, kGap or kStale
    uint64_t missed = 0;                             // kGap: how many messages were lost
    Publisher* publisher = nullptr;  // valid until the next Observe; its ranks before this one
  };

  // Message `sequence` of publisher `id`. A publisher first heard at `sequence` starts there:
  // what it published before this subscription existed is unknowable, not lost. kApply and
  // kGap move the publisher's expectation past `sequence`; a first message above 0 sets
  // joined, a kGap gapped.
  Verdict Observe(uint64_t id, uint64_t sequence);

  size_t size() const { return by_id_.size(); }

 private:
  void ForgetLongestSilent(uint64_t keep);

  // Not absl's tables (here and below): one refused growth corrupts them (core/fail_safe_map.h); a
  // single insert into libstdc++'s is all or nothing.
  std::unordered_map<uint64_t, Publisher> by_id_;
  uint64_t messages_ = 0;
};

// The ranks the router dropped (a worker removed, an update to fewer ranks) and has not added
// back since, as its rank listener tells them (core/rank_listeners.h): a source's flag on one is
// not counted in state_unknown, for the router no longer routes to it, and its engine may never
// clear it (the count stayed up for good). A worker removed whole drops every rank of its id
// until it is added back; then only the ranks it is added back with count again (those it had,
// or an earlier update dropped, stay dropped). Bounded: past kMaxDrops the oldest drop is
// forgotten (its rank's flag, if any, counts again). Drops made before the ingest object existed
// are not known to it. Thread-safe: changed on the router's threads, read on the loop.
class DroppedRanks {
 public:
  static constexpr size_t kMaxDrops = 1 << 16;

  // Whether it changed what Contains says.
  bool Change(const RankChange& change);
  bool Contains(WorkerKey rank) const;
  size_t size() const;
  // Counts the changes, for a SourceRanks to tell whether its count is still current.
  uint64_t version() const { return version_.load(std::memory_order_acquire); }

 private:
  // A drop: a worker removed whole (dp_rank empty) or one rank.
  struct Drop {
    uint64_t worker_id = 0;
    std::optional<uint32_t> dp_rank;
  };
  // Records (or renews) a drop of `key` in `drops` (workers_ or ranks_), numbered in order_.
  template <typename Map, typename Key>
  void RecordLocked(Map& drops, const Key& key, Drop drop);
  template <typename Map, typename Key>
  size_t EraseLocked(Map& drops, const Key& key);

  mutable std::mutex mutex_;
  // Each drop numbered, in order_ by number (the oldest is forgotten first): workers removed
  // whole, and ranks.
  std::unordered_map<uint64_t, uint64_t> workers_;
  std::unordered_map<WorkerKey, uint64_t, absl::Hash<WorkerKey>> ranks_;
  std::map<uint64_t, Drop> order_;
  uint64_t drops_ = 0;
  std::atomic<uint64_t> version_{0};
};

// The ranks a NATS source has heard, who publishes each, and which ones it has lost track of.
// Core NATS drops what is published while a subscriber is disconnected, with nothing to replay
// it from: when the connection is lost every rank heard before is cleared and flagged unknown (the
// index then under-reports it, never over-reports), until the engine clears the rank itself,
// after which the index is exact again. A rank whose events come from another Dynamo
// publisher than before belongs to a restarted worker (a new process, a new publisher id): its
// old blocks are the dead process's, so it is cleared first, as an engine restart is.
class SourceRanks {
 public:
  static constexpr uint64_t kNoPublisher = 0;  // native batches: no publisher identity
  // Beyond this many ranks, the rank heard longest ago is forgotten (bounded memory when
  // workers churn); a forgotten rank is cleared on no reconnection.
  static constexpr size_t kMaxRanks = 1 << 16;

  // `dropped` (the source's owner's, which outlives it; may be null): ranks whose flags are not
  // counted.
  explicit SourceRanks(const DroppedRanks* dropped = nullptr) : dropped_(dropped) {}

  // An event for `rank` from `publisher`: true when another publisher had the rank (the
  // caller clears it before applying the event).
  bool Heard(WorkerKey rank, uint64_t publisher);
  // Every rank heard (when the connection is lost, the caller loses each).
  std::vector<WorkerKey> Ranks() const;
  // The caller cleared `rank` because its state was lost (a gap, an outage): flagged unknown.
  // Whether it was not flagged already.
  bool Lose(WorkerKey rank);
  // The engine cleared `rank` itself: known again. Whether it was flagged.
  bool Cleared(WorkerKey rank);
  size_t unknown() const { return unknown_.size(); }
  // The flagged ranks the router has not dropped: the source's state_unknown (counted again
  // when what the router dropped has changed since).
  size_t CountedUnknown();
  size_t size() const { return ranks_.size(); }
  // The source goes for good: what its deliveries and loss reports have queued on the loop is
  // not applied from now on (no message of its would ever clear a flag they set). Any thread.
  void Retire() { retired_.store(true); }
  bool retired() const { return retired_.load(); }

  // From any thread, allocating nothing: a message was lost for memory where its ranks could
  // not be lost at once (libnats' thread, or the loss itself refused). The loop loses every
  // rank with the next message (and sets the flag again if that is refused).
  void LoseEveryRankLater() { loss_for_later_.store(true, std::memory_order_relaxed); }
  bool TakeLossForLater() { return loss_for_later_.exchange(false, std::memory_order_relaxed); }

  // Connections lost, counted where libnats stops reading the socket (NatsLoopPlace), before
  // it reconnects: a message delivered after the count is read may come after that loss,
  // never before it. libnats reports the loss later, on its callback thread, apart from the
  // messages: a message and a report each carry the count read when they were handed on, and
  // the loop clears only for losses it has not cleared for (a report that runs late may carry
  // later losses too, which a message of the next connection may have cleared for already).
  // Counted from any thread.
  std::atomic<uint64_t>& connection_losses() { return connection_losses_; }
  uint64_t ConnectionLosses() const { return connection_losses_.load(std::memory_order_acquire); }
  // Loop: whether the losses up to `losses` (a message's count or a report's) are still to be
  // applied; the caller applies them now.
  bool LossDue(uint64_t losses) {
    if (losses <= losses_applied_) return false;
    losses_applied_ = losses;
    return true;
  }

 private:
  struct Rank {
    uint64_t publisher = kNoPublisher;
    uint64_t last_heard = 0;
  };
  void ForgetOldest();
  bool Counts(WorkerKey rank) const { return dropped_ == nullptr || !dropped_->Contains(rank); }
  // Makes counted_ current with dropped_.
  void Recount();

  const DroppedRanks* dropped_;
  std::unordered_map<WorkerKey, Rank, absl::Hash<WorkerKey>> ranks_;
  std::unordered_set<WorkerKey, absl::Hash<WorkerKey>> unknown_;
  size_t counted_ = 0;  // of unknown_, those Counts, as of dropped_'s version counted_for_
  uint64_t counted_for_ = 0;
  std::atomic<bool> loss_for_later_{false};
  std::atomic<uint64_t> connection_losses_{0};
  uint64_t losses_applied_ = 0;  // loop
  std::atomic<bool> retired_{false};
  uint64_t events_ = 0;
};

// The order of a JetStream source's messages, on its loop.
//
// Deliveries: the consumer numbers them one by one, redeliveries included (seen with
// nats-server 2.9: a message delivered again gets the next number), so a number skipped is a
// message lost on the way: as the connection broke, or dropped by the client as a slow
// consumer. A number that goes back (the server restarted on an older copy of the consumer's
// state, or the consumer was made again) starts afresh. After a loss the source makes its
// consumer again (NewConsumer), whose numbers start at 1; meanwhile what the consumer it
// replaces delivers is not applied.
//
// Redeliveries: a message at or below the source's position was applied already (its
// acknowledgement lost) or its first delivery was lost (a skipped number), unless it was
// stored after the newest message applied: a stream that lost its tail (its server crashed
// before the tail reached the disk) numbers new messages again from there, and those are new.
// Where a JetStream message stands: its stream sequence, its consumer's delivery number, and
// when the server stored it (ns on the server's clock).
struct JetStreamPlace {
  uint64_t stream = 0;
  uint64_t delivery = 0;
  int64_t stored_ns = 0;
};

class JetStreamOrder {
 public:
  // Delivery `number` (0: unknown, ignored) came: how many before it never did. Until a
  // baseline is known (NumberedAfter, NewConsumer), the first number seen is taken as one.
  uint64_t MissedDeliveries(uint64_t number) {
    if (number == 0) return 0;
    const uint64_t missed =
        numbered_ && number > last_delivery_ + 1 ? number - last_delivery_ - 1 : 0;
    last_delivery_ = number;
    numbered_ = true;
    return missed;
  }
  // The consumer has delivered `delivered` messages before this source (0: a new one).
  void NumberedAfter(uint64_t delivered) {
    last_delivery_ = delivered;
    numbered_ = true;
  }

  // Deliveries were lost: the consumer is being made again, and until NewConsumer what the one
  // it replaces delivers is not to be applied.
  void AwaitNewConsumer() { awaiting_new_consumer_ = true; }
  bool AwaitingNewConsumer() const { return awaiting_new_consumer_; }
  // What comes from here on comes from a new consumer, numbering its deliveries from 1.
  void NewConsumer() {
    awaiting_new_consumer_ = false;
    NumberedAfter(0);
  }

  // Whether the message at `stream_sequence`, stored at `stored_ns` (the server's clock), is
  // one the source must not apply, its position being `position`.
  bool IsRedelivery(uint64_t stream_sequence, int64_t stored_ns, uint64_t position) const {
    return stream_sequence != 0 && stream_sequence <= position && stored_ns <= newest_stored_ns_;
  }

  // When the last message applied (the one at the position) was stored (0: none yet).
  int64_t last_applied_ns() const { return last_stored_ns_; }

  // A message stored at `stored_ns` was applied.
  void Applied(int64_t stored_ns) {
    newest_stored_ns_ = std::max(newest_stored_ns_, stored_ns);
    last_stored_ns_ = stored_ns;
  }

 private:
  uint64_t last_delivery_ = 0;
  bool numbered_ = false;
  bool awaiting_new_consumer_ = false;
  int64_t newest_stored_ns_ = 0;
  int64_t last_stored_ns_ = 0;
};

}  // namespace kvrouter
