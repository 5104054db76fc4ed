// libFuzzer harness, state-aware: one engine rank's ZMQ stream as RankSequence
// (src/ingest/sequence_tracker.h) sees it, against the engine's true history. The input drives
// a publisher (messages numbered from 0, sometimes skipping numbers it never publishes,
// sometimes restarting as a new process that numbers from 0 again), a network that loses live
// messages, a subscriber that falls behind (messages queue up unread, as in its ZMQ socket),
// and the replay endpoint (present or not, how much history it keeps, whether it answers in
// time, what the engine publishes while it answers). The subscriber acts on the tracker's
// verdicts as a source must (src/ingest/engine_subscription.cc): apply, clear the rank on a
// restart, replay or give up on a gap (clearing and flagging the rank), repair a flagged rank by
// a replay from message 0; during a replay it holds the live messages, having read every queued
// one before asking, and afterwards judges them (JudgeHeld) before observing them.
//
// After every message of the engine running now is handled, the rank's applied messages must
// be that engine's (never a dead engine's), and exactly all of them up to the last one handled
// unless the rank is flagged: the index is exact, or flagged as unknown, never silently wrong. A
// held message judged a dead engine's must be one, a repeat must be the running engine's.
//
// A restart is also a reconnection (a new process, a new connection), and the network may break
// and reconnect with the same engine: the subscriber tells the tracker (RankSequence::
// Reconnected) when it reads the next message after the new connection's handshake, as the
// source does, and the socket keeps the messages it had not read across the reconnection: a
// subscriber that was behind reads the dead engine's last messages after the new one's
// handshake.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <optional>
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

struct Message {
  uint32_t epoch = 0;  // the process that published it
  uint64_t seq = 0;
  uint64_t connection = 0;  // the subscriber's connection it came over
  uint64_t digest() const { return Digest(epoch, seq); }
  bool operator<(const Message& o) const {
    return epoch != o.epoch ? epoch < o.epoch : seq < o.seq;
  }
  // The same message whatever connection it came over.
  bool operator==(const Message& o) const { return epoch == o.epoch && seq == o.seq; }
};

class Subscriber {
 public:
  explicit Subscriber(Engine& engine) : engine_(engine) {}

  // A new connection (a restart always makes one): seen when the next message is read.
  void Reconnected() {
    handshake_ = true;
    ++connection_;
  }
  // A live message reaches the subscriber's socket, read later (ReadAll).
  void Deliver(uint64_t seq) { queue_.push_back({engine_.epoch, seq, connection_}); }
  // Whether messages of an earlier connection are still queued.
  bool BehindAConnection() const {
    return !queue_.empty() && queue_.front().connection != connection_;
  }

  // Reads and handles every queued message, checking the rank after each.
  void ReadAll(Input& in) {
    while (!queue_.empty()) {
      Take(Receive(), /*before_request=*/false, in);
    }
  }

  // Once a message of the engine running now is handled, the rank must be its state. Before,
  // the subscriber is behind: it still reads what a dead engine published when it ran.
  void CheckAfter(const Message& handled) const {
    if (handled.epoch == engine_.epoch) Check();
  }

  // In O(log n): every applied message is one the running engine published (the model applies
  // only what it delivered or replayed), so the applied set is the expected one exactly when it
  // lies within [from, last] and has as many messages as the engine published there.
  void Check() const {
    if (flagged_ || unknowable_) return;  // unknown: it may hold anything until repaired
    std::optional<uint64_t> last;         // the running engine's highest message handled or applied
    if (last_heard_epoch_ == engine_.epoch) last = last_heard_;
    if (!applied_.empty()) {
      // Ordered by epoch first, and a dead engine's epoch is lower than the running one's.
      if (applied_.begin()->epoch != engine_.epoch) {
        Fail("a dead engine's message is applied, unflagged");
      }
      last = std::max(last.value_or(0), applied_.rbegin()->seq);
    }
    if (!last) return;
    const uint64_t from = engine_.epoch == baseline_epoch_ ? baseline_ : 0;
    const std::vector<uint64_t>& published = engine_.published;  // ascending
    const auto expected = std::upper_bound(published.begin(), published.end(), *last) -
                          std::lower_bound(published.begin(), published.end(), from);
    const bool within = applied_.empty() || applied_.begin()->seq >= from;
    if (!within || static_cast<ptrdiff_t>(applied_.size()) != std::max<ptrdiff_t>(expected, 0)) {
      Fail("the rank is not flagged but misses or has extra messages");
    }
  }

 private:
  // The socket's next message; the connection events are read after it, before it is handled.
  Message Receive() {
    const Message m = queue_.front();
    queue_.pop_front();
    if (std::exchange(handshake_, false)) tracker_.Reconnected();
    return m;
  }

  void Handle(const Message& m, Input& in) {
    // The first message heard is the baseline: what the engine published before the
    // subscriber listened is unknowable, not lost. A restart's new process is expected whole.
    if (!tracker_.next()) {
      baseline_ = m.seq;
      baseline_epoch_ = m.epoch;
    }
    if (m.epoch == engine_.epoch && (last_heard_epoch_ != engine_.epoch || m.seq > last_heard_)) {
      last_heard_ = m.seq;
      last_heard_epoch_ = m.epoch;
    }
    const RankSequence::Verdict v = tracker_.Observe(m.seq, m.digest());
    LOG("handle %lu (epoch %u): action %d missed %lu\n", m.seq, m.epoch, static_cast<int>(v.action),
        v.missed);
    switch (v.action) {
      case SequenceAction::kApply:
        if (!v.after_reconnection || !Prove(m, in)) {
          if (v.after_reconnection && v.joined) flagged_ = true;  // as the source's Join
          Apply(m);
        }
        break;
      case SequenceAction::kStale:
        break;
      case SequenceAction::kRestart:
        Clear();
        if (v.missed == 0 && !(v.after_reconnection && Prove(m, in))) {
          flagged_ = false;  // a restart heard from message 0: the whole new history follows
          Apply(m);
        } else if (v.missed > 0) {
          Recover(m, in);
        }
        break;
      case SequenceAction::kGap:
        Recover(m, in);
        break;
    }
  }

  void Apply(const Message& m) { applied_.insert(m); }
  void Clear() {
    applied_.clear();
    unknowable_ = false;
  }

  // The messages lost before live message `trigger`: replayed if the engine has an endpoint
  // (and answers in time), else given up on. Held first, the trigger comes next.
  void Recover(const Message& trigger, Input& in) {
    const uint8_t how = in.Byte();
    LOG("  recover before %lu: %s\n", trigger.seq, how % 4 == 0 ? "skip" : "replay");
    if (how % 4 == 0) {  // no replay endpoint, or the request could not be sent
      tracker_.SkipGap(trigger.seq, trigger.digest());
      Clear();
      flagged_ = true;
      Apply(trigger);
      return;
    }
    held_.push_front(trigger);
    bool in_time = how % 4 != 1;
    tracker_.BeginReplay(trigger.seq);
    const bool from_start = tracker_.replaying_from_start();
    RankSequence::Outcome outcome = RunReplay(in_time, in);
    if (outcome == RankSequence::Outcome::kShort && !from_start) {
      Clear();
      flagged_ = true;
      // The repair: ask once for the whole history from 0.
      in_time = in.Byte() % 3 != 0;
      tracker_.BeginReplayFromStart(trigger.seq);
      outcome = RunReplay(in_time, in);
    }
    if (outcome == RankSequence::Outcome::kShort) {
      Clear();
      flagged_ = true;
    }
    if (outcome == RankSequence::Outcome::kCompleteFromStart) KnownFromStart();
    HandleHeld(in);
  }

  // A restart numbered 0, or the first message heard, read first after a reconnection: proven by
  // a replay from 0 when the engine has a replay endpoint (false without one: it is trusted).
  bool Prove(const Message& trigger, Input& in) {
    const uint8_t how = in.Byte();
    LOG("  restart at 0 after a reconnection: %s\n", how % 4 == 0 ? "trusted" : "replay");
    if (how % 4 == 0) {
      // Nothing can tell a dead engine's message 0 still queued from the new engine's: the
      // known limit of an engine without a replay endpoint (docs/ingest.md). The model counts
      // the rank as unknown then, until something makes it known again.
      if (trigger.epoch != engine_.epoch) unknowable_ = true;
      return false;
    }
    held_.push_front(trigger);
    tracker_.BeginReplayFromStart(trigger.seq);
    Clear();
    const RankSequence::Outcome outcome = RunReplay(how % 4 != 1, in);
    if (outcome == RankSequence::Outcome::kCompleteFromStart) {
      KnownFromStart();
    } else {
      flagged_ = true;
      Clear();
    }
    HandleHeld(in);
    return true;
  }

  // A replay from 0 came whole: the running engine's history is known from its message 0.
  void KnownFromStart() {
    flagged_ = false;
    baseline_ = 0;
    baseline_epoch_ = engine_.epoch;
  }

  // One replay: every queued message is held before the request goes out; the engine may
  // publish before it serves the request (those are in its reply and arrive live too) and
  // after (live only).
  RankSequence::Outcome RunReplay(bool in_time, Input& in) {
    while (!queue_.empty()) held_.push_back(Receive());
    before_request_ = held_.size();
    PublishDuringReplay(in);
    const std::vector<uint64_t> reply = engine_.Replay(tracker_.ReplayFrom());
    PublishDuringReplay(in);
    LOG("  replay from %lu (%s)\n", tracker_.ReplayFrom(), in_time ? "in time" : "timeout");
    for (uint64_t seq : reply) {
      const RankSequence::Replayed r = tracker_.AcceptReplayed(seq, Digest(engine_.epoch, seq));
      LOG("    replayed %lu: %d\n", seq, static_cast<int>(r));
      switch (r) {
        case RankSequence::Replayed::kApply:
          Apply({engine_.epoch, seq, connection_});
          break;
        case RankSequence::Replayed::kRestarted:
          Clear();
          break;
        case RankSequence::Replayed::kSkip:
          break;
      }
    }
    // What arrived during the replay; the rest (the live copies of its last messages among
    // them) comes after it, on the subscriber's own connection.
    for (size_t n = in.Byte() % (queue_.size() + 1); n > 0; --n) held_.push_back(Receive());
    const RankSequence::Outcome outcome = tracker_.FinishReplay(in_time);
    LOG("  outcome %d\n", static_cast<int>(outcome));
    return outcome;
  }

  void PublishDuringReplay(Input& in) {
    for (int n = in.Byte() % 3; n > 0; --n) {
      LOG("  engine publishes %lu during the replay\n", engine_.next);
      engine_.published.push_back(engine_.next);
      Deliver(engine_.next++);
    }
  }

  // The held messages in order. One may start another replay (Recover), which holds it first
  // and handles the rest.
  void HandleHeld(Input& in) {
    while (!held_.empty()) {
      const bool before_request = before_request_ > 0;
      if (before_request) --before_request_;
      const Message m = held_.front();
      held_.pop_front();
      Take(m, before_request, in);
    }
  }

  // A message read (live, or held during a replay), judged first after a repair that took the
  // whole reply.
  void Take(const Message& m, bool before_request, Input& in) {
    const RankSequence::Held judged = tracker_.JudgeHeld(m.seq, m.digest(), before_request);
    LOG("  take %lu (epoch %u): judged %d\n", m.seq, m.epoch, static_cast<int>(judged));
    switch (judged) {
      case RankSequence::Held::kObserve:
        Handle(m, in);
        break;
      case RankSequence::Held::kRepeat:
        if (m.epoch != engine_.epoch || !applied_.contains(m)) {
          Fail("a message judged a repeat is not the running engine's, applied");
        }
        break;
      case RankSequence::Held::kDeadEngine:
      case RankSequence::Held::kDeadEngineRestarted:
        if (m.epoch == engine_.epoch) Fail("the running engine's message judged a dead one's");
        break;
    }
    CheckAfter(m);
  }

  Engine& engine_;
  RankSequence tracker_;
  std::deque<Message> queue_;  // delivered, not read yet
  std::deque<Message> held_;   // read during a replay
  size_t before_request_ = 0;  // how many held, from the front, were read before it was asked
  bool handshake_ = false;
  uint64_t connection_ = 0;
  std::set<Message> applied_;
  uint64_t last_heard_ = 0;  // the running engine's highest message handled
  uint32_t last_heard_epoch_ = UINT32_MAX;
  uint64_t baseline_ = 0;  // the first message heard, of the process then running
  uint32_t baseline_epoch_ = 0;
  bool flagged_ = false;
  bool unknowable_ = false;  // the known limit was hit (Prove)
};

}  // namespace
}  // namespace kvrouter

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrouter;
  Input in(data, size);
  Engine engine;
  engine.buffer = 1 + in.Byte() % 16;
  Subscriber subscriber(engine);
  bool behind = false;  // the subscriber reads nothing until it catches up
  while (!in.empty()) {
    const uint8_t op = in.Byte();
    // The socket may hold the messages of one earlier connection unread, not of two: a router
    // still behind across a second reconnection is a known limit (docs/ingest.md).
    if ((op % 16 == 0 || op % 16 == 2) && subscriber.BehindAConnection()) subscriber.ReadAll(in);
    if (op % 16 == 0) {  // the engine restarts: a new process, numbering from 0
      ++engine.epoch;
      LOG("engine restarts (epoch %u)\n", engine.epoch);
      engine.next = 0;
      engine.published.clear();
      subscriber.Reconnected();
    } else if (op % 16 == 2) {  // the network breaks and the connection is made again
      LOG("reconnection\n");
      subscriber.Reconnected();
    } else if (op % 16 == 5) {
      behind = !behind;
      LOG("subscriber %s\n", behind ? "falls behind" : "catches up");
    } else {
      if (op % 16 == 1) engine.next += 1 + in.Byte() % 4;  // numbers skipped, nothing lost
      LOG("engine publishes %lu%s\n", engine.next, op % 16 < 5 ? " (lost)" : "");
      const uint64_t seq = engine.next++;
      engine.published.push_back(seq);
      // Lost on the way (the engine still buffers it).
      if (op % 16 >= 5) subscriber.Deliver(seq);
    }
    if (!behind) subscriber.ReadAll(in);
  }
  subscriber.ReadAll(in);
  return 0;
}
