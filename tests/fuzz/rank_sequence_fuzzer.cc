// libFuzzer harness, state-aware: one engine rank's ZMQ stream as RankSequence
// (src/ingest/sequence_tracker.h) sees it, against the engine's true history. The input drives
// a publisher (messages numbered from 0, sometimes skipping numbers it never publishes,
// sometimes restarting as a new process that numbers from 0 again), a network that loses live
// messages, and the replay endpoint (present or not, how much history it keeps, whether it
// answers in time). The subscriber acts on the tracker's verdicts as the header says a source
// must: apply, clear the rank on a restart, replay or give up on a gap (clearing and flagging
// the rank), repair a flagged rank by a replay from message 0.
//
// After every message the rank's applied messages must be those of the engine running now
// (never a dead engine's), and exactly all of them up to the last one heard unless the rank is
// flagged: the index is exact, or flagged as unknown, never silently wrong.
//
// A restart is also a reconnection (a new process, a new connection), and the network may break
// and reconnect with the same engine: the subscriber tells the tracker (RankSequence::
// Reconnected, as the source does on the socket's second handshake), which is what reaches a
// new process whose first message heard carries exactly the number the old one would have sent
// next.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <utility>
#include <vector>

#include "fuzz_input.h"
#include "ingest/sequence_tracker.h"

namespace kvrouter {
namespace {

using fuzz::Input;
using fuzz::kVerbose;

#define LOG(...) (kVerbose ? std::fprintf(stderr, __VA_ARGS__) : 0)

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "rank state wrong: %s\n", what);
  std::abort();
}

uint64_t Digest(uint32_t epoch, uint64_t seq) { return (uint64_t{epoch} << 40) ^ (seq * 0x9e37); }

// The engine: its process (epoch), every message it published, and the replay buffer's reach.
struct Engine {
  uint32_t epoch = 0;
  uint64_t next = 0;
  std::vector<uint64_t> published;  // this process's messages, in order
  size_t buffer = 8;                // how many recent messages a replay can return

  // Its replay reply from `from`: what it still buffers, and whether `from` was within reach
  // (the end marker then says the reply is all there is).
  std::vector<uint64_t> Replay(uint64_t from) const {
    std::vector<uint64_t> out;
    const size_t first = published.size() > buffer ? published.size() - buffer : 0;
    for (size_t i = first; i < published.size(); ++i) {
      if (published[i] >= from) out.push_back(published[i]);
    }
    return out;
  }
};

using Message = std::pair<uint32_t, uint64_t>;  // (epoch, seq)

class Subscriber {
 public:
  explicit Subscriber(const Engine& engine) : engine_(engine) {}

  // The connection to the engine was made again (a restart always makes one).
  void Reconnected() { tracker_.Reconnected(); }

  void Live(uint64_t seq, Input& in) {
    // The first message heard is the baseline: what the engine published before the
    // subscriber listened is unknowable, not lost. A restart's new process is expected whole.
    if (!tracker_.next()) {
      baseline_ = seq;
      baseline_epoch_ = engine_.epoch;
    }
    const RankSequence::Verdict v = tracker_.Observe(seq, Digest(engine_.epoch, seq));
    LOG("live %lu (epoch %u): action %d missed %lu\n", seq, engine_.epoch,
        static_cast<int>(v.action), v.missed);
    switch (v.action) {
      case SequenceAction::kApply:
        Apply(seq);
        break;
      case SequenceAction::kStale:
        break;
      case SequenceAction::kRestart:
        Clear();
        if (v.missed == 0) {
          flagged_ = false;  // a restart heard from message 0: the whole new history follows
          Apply(seq);
        } else {
          Recover(seq, in);
        }
        break;
      case SequenceAction::kGap:
        Recover(seq, in);
        break;
    }
    last_heard_ = seq;
  }

  void Check() const {
    for (const Message& m : applied_) {
      if (m.first != engine_.epoch) Fail("a dead engine's message is still applied");
    }
    if (flagged_) return;
    std::set<Message> expected;
    const uint64_t from = engine_.epoch == baseline_epoch_ ? baseline_ : 0;
    for (uint64_t seq : engine_.published) {
      if (seq >= from && seq <= last_heard_) expected.insert({engine_.epoch, seq});
    }
    if (expected != applied_) Fail("the rank is not flagged but misses or has extra messages");
  }

 private:
  void Apply(uint64_t seq) { applied_.insert({engine_.epoch, seq}); }
  void Clear() { applied_.clear(); }

  // The messages lost before live message `until`: replayed if the engine has an endpoint (and
  // answers in time), else given up on; either way `until` is applied after.
  void Recover(uint64_t until, Input& in) {
    const uint8_t how = in.Byte();
    LOG("  recover before %lu: %s\n", until, how % 4 == 0 ? "skip" : "replay");
    if (how % 4 == 0) {  // no replay endpoint, or the request could not be sent
      tracker_.SkipGap(until, Digest(engine_.epoch, until));
      Clear();
      flagged_ = true;
      Apply(until);
      return;
    }
    bool in_time = how % 4 != 1;
    tracker_.BeginReplay(until);
    RankSequence::Outcome outcome = RunReplay(in_time);
    if (outcome == RankSequence::Outcome::kShort) {
      Clear();
      flagged_ = true;
      // The repair: ask once for the whole history from 0.
      in_time = in.Byte() % 3 != 0;
      tracker_.BeginReplayFromStart(until);
      outcome = RunReplay(in_time);
      if (outcome == RankSequence::Outcome::kShort) Clear();
    }
    if (outcome == RankSequence::Outcome::kCompleteFromStart) flagged_ = false;
    // The held live message comes next, and must be the one expected.
    if (tracker_.Observe(until, Digest(engine_.epoch, until)).action != SequenceAction::kApply) {
      Fail("after a replay the held live message is not the one expected");
    }
    Apply(until);
  }

  RankSequence::Outcome RunReplay(bool in_time) {
    LOG("  replay from %lu (%s)\n", tracker_.ReplayFrom(), in_time ? "in time" : "timeout");
    for (uint64_t seq : engine_.Replay(tracker_.ReplayFrom())) {
      const RankSequence::Replayed r = tracker_.AcceptReplayed(seq, Digest(engine_.epoch, seq));
      LOG("    replayed %lu: %d\n", seq, static_cast<int>(r));
      switch (r) {
        case RankSequence::Replayed::kApply:
          Apply(seq);
          break;
        case RankSequence::Replayed::kRestarted:
          Clear();
          break;
        case RankSequence::Replayed::kSkip:
          break;
      }
    }
    const RankSequence::Outcome outcome = tracker_.FinishReplay(in_time);
    LOG("  outcome %d\n", static_cast<int>(outcome));
    return outcome;
  }

  const Engine& engine_;
  RankSequence tracker_;
  std::set<Message> applied_;
  uint64_t last_heard_ = 0;
  uint64_t baseline_ = 0;  // the first message heard, of the process then running
  uint32_t baseline_epoch_ = 0;
  bool flagged_ = false;
};

}  // namespace
}  // namespace kvrouter

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrouter;
  Input in(data, size);
  Engine engine;
  engine.buffer = 1 + in.Byte() % 16;
  Subscriber subscriber(engine);
  while (!in.empty()) {
    const uint8_t op = in.Byte();
    if (op % 16 == 0) {  // the engine restarts: a new process, numbering from 0
      ++engine.epoch;
      LOG("engine restarts (epoch %u)\n", engine.epoch);
      engine.next = 0;
      engine.published.clear();
      subscriber.Reconnected();
      continue;
    }
    if (op % 16 == 2) {  // the network breaks and the connection is made again, same engine
      LOG("reconnection\n");
      subscriber.Reconnected();
      continue;
    }
    if (op % 16 == 1) engine.next += 1 + in.Byte() % 4;  // numbers skipped, nothing lost
    LOG("engine publishes %lu%s\n", engine.next, op % 16 < 5 ? " (lost)" : "");
    const uint64_t seq = engine.next++;
    engine.published.push_back(seq);
    if (op % 16 < 5) continue;  // lost on the way (the engine still buffers it)
    subscriber.Live(seq, in);
    subscriber.Check();
  }
  return 0;
}
