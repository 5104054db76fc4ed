#include "ingest/sequence_tracker.h"

namespace kvrouter {

RankSequence::Verdict RankSequence::Observe(uint64_t seq) {
  if (!next_ || seq == *next_) {
    next_ = seq + 1;
    return {SequenceAction::kApply};
  }
  if (seq > *next_) return {SequenceAction::kGap, seq - *next_};
  if (seq == 0) {  // the publisher restarted, with an empty cache
    next_ = 1;
    return {SequenceAction::kRestart};
  }
  return {SequenceAction::kStale};
}

void RankSequence::SkipGap(uint64_t seq) { next_ = seq + 1; }

void RankSequence::BeginReplay(uint64_t until) { replay_until_ = until; }

bool RankSequence::AcceptReplayed(uint64_t seq) {
  if (!replay_until_ || !next_ || seq != *next_ || seq >= *replay_until_) return false;
  next_ = seq + 1;
  return true;
}

bool RankSequence::FinishReplay() {
  const std::optional<uint64_t> until = replay_until_;
  replay_until_.reset();
  if (!until || next_ == until) return true;
  next_ = *until;
  return false;
}

PublisherSequences::Verdict PublisherSequences::Observe(uint64_t id, uint64_t sequence) {
  ++messages_;
  auto [it, added] = by_id_.try_emplace(id);
  if (added) {
    it->second.next_sequence = sequence;
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

}  // namespace kvrouter
