// Sequence numbers of KV event publishers, without sockets: what to do with each message given
// what came before (apply it, drop it as stale, recover from a gap or a restart) and when a
// replay has filled a gap. The sources (engine_subscription.cc, nats_subscription.cc) act on
// these decisions; the tests drive them with plain numbers (tests/ingest/sequence_tracker_test.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "core/types.h"

namespace kvrouter {

enum class SequenceAction : uint8_t {
  kApply,    // the expected message (or the first one heard): apply it
  kGap,      // messages were lost before this one: recover, then apply it
  kRestart,  // the publisher restarted (its sequence went back to 0): clear, then apply it
  kStale,    // a sequence number already seen (duplicate or reordered): drop it
};

// One engine rank's live stream (vLLM and SGLang number their ZMQ messages per rank): the first
// message sets the baseline; a jump forward is a gap; going back to 0 is a restart.
//
// A gap is repaired by a replay when the engine has a replay endpoint: BeginReplay, then each
// replayed message through AcceptReplayed, then FinishReplay. Live messages that arrive during
// the replay are held by the caller and observed after FinishReplay. Without a replay (none, or
// it could not be requested), SkipGap: the lost events are given up on and the rank cleared.
class RankSequence {
 public:
  struct Verdict {
    SequenceAction action = SequenceAction::kApply;
    uint64_t missed = 0;  // kGap: how many messages were lost
  };

  // What to do with live message `seq`. kApply and kRestart move the expectation past it; kGap
  // leaves it for the caller to BeginReplay or SkipGap; kStale changes nothing.
  Verdict Observe(uint64_t seq);

  // Gives up on the messages lost before live message `seq` (observed as kGap), which is
  // applied now: seq + 1 is expected next.
  void SkipGap(uint64_t seq);

  // Asks for the messages missing before live message `until` (observed as kGap).
  void BeginReplay(uint64_t until);
  bool replaying() const { return replay_until_.has_value(); }
  // A replayed message: true when it fills the hole (it is the next one missing), and then
  // applied; the replies also repeat messages before the hole and run on past it.
  bool AcceptReplayed(uint64_t seq);
  // Ends the replay (complete, short or timed out). True when every missing message came;
  // false when some did not: they are given up on, as by SkipGap, and the rank must be
  // cleared. Either way the held live messages are observed next, the one at `until` first.
  bool FinishReplay();

  // The sequence expected next; nullopt before the first message.
  std::optional<uint64_t> next() const { return next_; }

 private:
  std::optional<uint64_t> next_;
  std::optional<uint64_t> replay_until_;
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
    uint64_t last_heard = 0;               // the message count when it was last heard
    absl::flat_hash_set<WorkerKey> ranks;  // where its events went: what a gap must clear
  };
  struct Verdict {
    SequenceAction action = SequenceAction::kApply;  // kApply, kGap or kStale
    uint64_t missed = 0;                             // kGap: how many messages were lost
    Publisher* publisher = nullptr;  // valid until the next Observe; its ranks before this one
  };

  // Message `sequence` of publisher `id`. A publisher first heard at `sequence` starts there:
  // what it published before this subscription existed is unknowable, not lost. kApply and
  // kGap move the publisher's expectation past `sequence`.
  Verdict Observe(uint64_t id, uint64_t sequence);

  size_t size() const { return by_id_.size(); }

 private:
  void ForgetLongestSilent(uint64_t keep);

  absl::flat_hash_map<uint64_t, Publisher> by_id_;
  uint64_t messages_ = 0;
};

}  // namespace kvrouter
