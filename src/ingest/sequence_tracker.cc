#include "ingest/sequence_tracker.h"

#include <algorithm>
#include <utility>

namespace kvrouter {

RankSequence::Verdict RankSequence::Observe(uint64_t seq, uint64_t digest) {
  const bool reconnected = std::exchange(reconnected_, false);
  if (reconnected && next_ && seq == *next_) {
    needs_check_ = true;
    return {SequenceAction::kGap, 0};
  }
  if (!next_ || seq == *next_) {
    const bool first = !next_;
    next_ = seq + 1;
    digest_ = digest;
    return {.action = SequenceAction::kApply,
            .joined = first && seq > 0,
            .from_zero = first && seq == 0,
            .after_reconnection = first && reconnected};
  }
  if (seq > *next_) return {SequenceAction::kGap, seq - *next_};
  // Back: a new publisher process. Numbered 0, nothing of it was lost; otherwise its messages
  // before `seq` were, and it is expected from 0.
  if (seq == 0) {
    next_ = 1;
    digest_ = digest;
    return {.action = SequenceAction::kRestart, .after_reconnection = reconnected};
  }
  next_ = 0;
  digest_.reset();
  return {SequenceAction::kRestart, seq};
}

void RankSequence::SkipGap(uint64_t seq, uint64_t digest) {
  needs_check_ = false;
  next_ = seq + 1;
  digest_ = digest;
}

uint64_t RankSequence::ReplayFrom() const {
  const uint64_t next = next_.value_or(0);
  return digest_ && next > 0 ? next - 1 : next;
}

void RankSequence::BeginReplay(uint64_t until) {
  EndJudging();
  replay_until_ = until;
  const uint64_t next = next_.value_or(0);
  check_.reset();
  if (digest_ && next > 0) check_ = next - 1;
  verified_ = false;
  from_start_ = next == 0;
  restart_counted_ = std::exchange(found_other_engine_, false);
  reply_broken_ = false;
  other_engine_ = false;
  unproven_ = false;
}

void RankSequence::BeginReplayFromStart(uint64_t until) {
  needs_check_ = false;  // the whole history from 0 proves itself, message by message
  next_ = 0;
  digest_.reset();
  BeginReplay(until);
}

RankSequence::Replayed RankSequence::AcceptReplayed(uint64_t seq, uint64_t digest) {
  if (!replay_until_ || other_engine_ || !next_) return Replayed::kSkip;
  if (from_start_) {  // the engine's whole history, from 0, every message in turn
    if (reply_broken_ || seq < *next_) return Replayed::kSkip;
    if (seq > *next_ || reply_digests_.size() == kMaxReplyDigests) {
      reply_broken_ = true;
      return Replayed::kSkip;
    }
    next_ = seq + 1;
    digest_ = digest;
    reply_digests_.push_back(digest);
    return Replayed::kApply;
  }
  if (check_ && seq <= *check_) {
    if (seq < *check_) return Replayed::kSkip;
    check_.reset();
    if (digest != digest_) {
      other_engine_ = true;
      return Replayed::kRestarted;
    }
    verified_ = true;
    return Replayed::kSkip;
  }
  if (check_) {
    // The reply went past the check message without it: nothing proves that the engine
    // answering is the one heard before (a restarted engine whose buffer starts right at the
    // hole replies alike), so the reply fills nothing and the replay comes back short.
    check_.reset();
    unproven_ = true;
  }
  if (unproven_) return Replayed::kSkip;
  if (seq < *next_ || seq >= *replay_until_) return Replayed::kSkip;
  if (seq != *next_ && !verified_) return Replayed::kSkip;
  next_ = seq + 1;
  digest_ = digest;
  return Replayed::kApply;
}

RankSequence::Outcome RankSequence::FinishReplay(bool ended) {
  const std::optional<uint64_t> until = replay_until_;
  replay_until_.reset();
  check_.reset();
  if (!until) return Outcome::kComplete;
  if (from_start_) return FinishWholeReply(*until, ended);
  const bool needed_check = std::exchange(needs_check_, false);
  const bool proven = verified_ || !needed_check;
  const bool complete =
      proven && !other_engine_ && !unproven_ && (next_ == until || (verified_ && ended));
  if (next_ != until) {
    next_ = *until;
    digest_.reset();  // the held message at `until` sets it
  }
  if (!complete) {
    found_other_engine_ = other_engine_;  // the repair that follows needs not count it again
    return Outcome::kShort;
  }
  return Outcome::kComplete;
}

// Complete only with the end marker: the reply is then everything the engine had published
// when it answered, which is what proves a held message it lacks is not the engine's.
RankSequence::Outcome RankSequence::FinishWholeReply(uint64_t until, bool ended) {
  if (!ended || reply_broken_) {
    reply_digests_ = {};
    next_ = until;
    digest_.reset();  // the held message at `until` sets it
    return Outcome::kShort;
  }
  judging_ = true;  // next_ and digest_ follow the reply's last message
  return Outcome::kCompleteFromStart;
}

RankSequence::Held RankSequence::JudgeHeld(uint64_t seq, uint64_t digest, bool before_request) {
  if (!judging_) return Held::kObserve;
  if (seq < reply_digests_.size() && reply_digests_[seq] == digest) return Held::kRepeat;
  if (!before_request) {
    EndJudging();
    return Held::kObserve;
  }
  return std::exchange(restart_counted_, true) ? Held::kDeadEngine : Held::kDeadEngineRestarted;
}

void RankSequence::EndJudging() {
  judging_ = false;
  reply_digests_ = {};  // its memory too
}

PublisherSequences::Verdict PublisherSequences::Observe(uint64_t id, uint64_t sequence) {
  ++messages_;
  auto [it, added] = by_id_.try_emplace(id);
  if (added) {
    it->second.next_sequence = sequence;
    it->second.joined = sequence > 0;
    if (by_id_.size() > kMaxPublishers) {
      ForgetLongestSilent(id);
      it = by_id_.find(id);
    }
  }
  Publisher& publisher = it->second;
  publisher.last_heard = messages_;
  Verdict verdict{.publisher = &publisher};
  if (sequence < publisher.next_sequence) {
    verdict.action = SequenceAction::kStale;
    return verdict;
  }
  if (sequence > publisher.next_sequence) {
    verdict.action = SequenceAction::kGap;
    verdict.missed = sequence - publisher.next_sequence;
    publisher.gapped = true;
  }
  publisher.next_sequence = sequence + 1;
  return verdict;
}

void PublisherSequences::ForgetLongestSilent(uint64_t keep) {
  auto oldest = by_id_.end();
  for (auto it = by_id_.begin(); it != by_id_.end(); ++it) {
    if (it->first != keep &&
        (oldest == by_id_.end() || it->second.last_heard < oldest->second.last_heard)) {
      oldest = it;
    }
  }
  by_id_.erase(oldest);
}

bool SourceRanks::Heard(WorkerKey rank, uint64_t publisher) {
  auto [it, added] = ranks_.try_emplace(rank);
  const bool other_publisher = !added && it->second.publisher != publisher;
  it->second.publisher = publisher;
  it->second.last_heard = ++events_;
  if (added && ranks_.size() > kMaxRanks) ForgetOldest();
  return other_publisher;
}

std::vector<WorkerKey> SourceRanks::Ranks() const {
  std::vector<WorkerKey> ranks;
  ranks.reserve(ranks_.size());
  for (const auto& [rank, state] : ranks_) ranks.push_back(rank);
  return ranks;
}

bool DroppedRanks::Change(const RankChange& change) {
  const uint64_t id = change.worker_id;
  std::lock_guard lock(mutex_);
  // First, under the lock (which Contains takes): a count made after reading the new version
  // sees the change, even one a refused allocation cut short.
  version_.fetch_add(1, std::memory_order_release);
  if (change.kind == RankChange::Kind::kAdded) {
    size_t erased = EraseLocked(workers_, id);
    for (const WorkerKey& rank : change.ranks) erased += EraseLocked(ranks_, rank);
    return erased > 0;
  }
  if (change.whole_worker) RecordLocked(workers_, id, {.worker_id = id, .dp_rank = std::nullopt});
  for (const WorkerKey& rank : change.ranks) {
    RecordLocked(ranks_, rank, {.worker_id = id, .dp_rank = rank.dp_rank});
  }
  while (order_.size() > kMaxDrops) {
    const Drop oldest = order_.begin()->second;
    if (oldest.dp_rank) {
      EraseLocked(ranks_, WorkerKey{oldest.worker_id, *oldest.dp_rank});
    } else {
      EraseLocked(workers_, oldest.worker_id);
    }
  }
  return true;
}

template <typename Map, typename Key>
void DroppedRanks::RecordLocked(Map& drops, const Key& key, Drop drop) {
  const uint64_t number = ++drops_;
  order_.emplace(number, drop);  // refused: nothing changed
  try {
    auto [it, added] = drops.try_emplace(key, number);
    if (!added) order_.erase(std::exchange(it->second, number));
  } catch (...) {
    order_.erase(number);
    throw;
  }
}

template <typename Map, typename Key>
size_t DroppedRanks::EraseLocked(Map& drops, const Key& key) {
  const auto it = drops.find(key);
  if (it == drops.end()) return 0;
  order_.erase(it->second);
  drops.erase(it);
  return 1;
}

bool DroppedRanks::Contains(WorkerKey rank) const {
  std::lock_guard lock(mutex_);
  return workers_.contains(rank.worker_id) || ranks_.contains(rank);
}

size_t DroppedRanks::size() const {
  std::lock_guard lock(mutex_);
  return order_.size();
}

bool SourceRanks::Lose(WorkerKey rank) {
  Recount();
  if (!unknown_.insert(rank).second) return false;
  if (Counts(rank)) ++counted_;
  return true;
}

bool SourceRanks::Cleared(WorkerKey rank) {
  Recount();
  if (unknown_.erase(rank) == 0) return false;
  if (Counts(rank)) --counted_;
  return true;
}

size_t SourceRanks::CountedUnknown() {
  Recount();
  return counted_;
}

void SourceRanks::Recount() {
  if (dropped_ == nullptr || dropped_->version() == counted_for_) return;
  counted_for_ = dropped_->version();
  counted_ = static_cast<size_t>(
      std::count_if(unknown_.begin(), unknown_.end(), [this](WorkerKey r) { return Counts(r); }));
}

void SourceRanks::ForgetOldest() {
  auto oldest = ranks_.begin();
  for (auto it = ranks_.begin(); it != ranks_.end(); ++it) {
    if (it->second.last_heard < oldest->second.last_heard) oldest = it;
  }
  Cleared(oldest->first);
  ranks_.erase(oldest);
}

}  // namespace kvrouter
