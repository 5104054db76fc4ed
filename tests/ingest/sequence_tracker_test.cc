// The sequence tracker without sockets: gaps, restarts, stale messages and replays of an engine
// rank (RankSequence), and Dynamo event-plane publishers (PublisherSequences).
#include "ingest/sequence_tracker.h"

#include <gtest/gtest.h>

namespace kvrouter {
namespace {

using A = SequenceAction;

// A rank that heard `first`, then `gap_at` (a gap), and asked for the messages missing between.
RankSequence Replaying(uint64_t first, uint64_t gap_at) {
  RankSequence s;
  s.Observe(first);
  EXPECT_EQ(s.Observe(gap_at).action, A::kGap);
  s.BeginReplay(gap_at);
  return s;
}

TEST(RankSequence, TheFirstMessageSetsTheBaselineThenEachMustFollow) {
  RankSequence s;
  EXPECT_FALSE(s.next().has_value());
  EXPECT_EQ(s.Observe(41).action, A::kApply);  // heard from the middle of the stream
  EXPECT_EQ(s.next(), 42u);
  EXPECT_EQ(s.Observe(42).action, A::kApply);
  EXPECT_EQ(s.Observe(43).action, A::kApply);
  EXPECT_EQ(s.next(), 44u);
}

TEST(RankSequence, DuplicatesAndReorderedMessagesAreStale) {
  RankSequence s;
  s.Observe(5);
  s.Observe(6);
  EXPECT_EQ(s.Observe(6).action, A::kStale);
  EXPECT_EQ(s.Observe(3).action, A::kStale);
  EXPECT_EQ(s.next(), 7u);  // unchanged
}

TEST(RankSequence, GoingBackToZeroIsARestart) {
  RankSequence s;
  s.Observe(9);
  EXPECT_EQ(s.Observe(0).action, A::kRestart);
  EXPECT_EQ(s.next(), 1u);
  EXPECT_EQ(s.Observe(1).action, A::kApply);
  // A first message numbered 0 is no restart; a 0 after it is one (as any 0 that goes back).
  RankSequence fresh;
  EXPECT_EQ(fresh.Observe(0).action, A::kApply);
  EXPECT_EQ(fresh.Observe(0).action, A::kRestart);
}

TEST(RankSequence, AGapSaysHowManyWereLostAndWaitsForTheCallersDecision) {
  RankSequence s;
  s.Observe(10);
  const RankSequence::Verdict v = s.Observe(15);
  EXPECT_EQ(v.action, A::kGap);
  EXPECT_EQ(v.missed, 4u);  // 11, 12, 13, 14
  EXPECT_EQ(s.next(), 11u);
  // Without a replay, the lost messages are given up on and the one that showed the gap applies.
  s.SkipGap(15);
  EXPECT_EQ(s.next(), 16u);
  EXPECT_EQ(s.Observe(16).action, A::kApply);
}

TEST(RankSequence, AReplayAcceptsOnlyWhatFillsTheHole) {
  RankSequence s = Replaying(10, 14);  // 11, 12, 13 missing
  EXPECT_TRUE(s.replaying());
  // Engines replay their buffer from the sequence asked for, on past the hole.
  EXPECT_FALSE(s.AcceptReplayed(10));  // before the hole
  EXPECT_TRUE(s.AcceptReplayed(11));
  EXPECT_FALSE(s.AcceptReplayed(13));  // out of order: 12 comes first
  EXPECT_TRUE(s.AcceptReplayed(12));
  EXPECT_TRUE(s.AcceptReplayed(13));
  EXPECT_FALSE(s.AcceptReplayed(14));  // the live message held by the caller
  EXPECT_TRUE(s.FinishReplay());       // complete
  EXPECT_FALSE(s.replaying());
  EXPECT_EQ(s.Observe(14).action, A::kApply);  // the held message, then on
  EXPECT_EQ(s.Observe(15).action, A::kApply);
}

TEST(RankSequence, AShortReplayGivesUpOnTheRest) {
  RankSequence s = Replaying(1, 5);
  EXPECT_TRUE(s.AcceptReplayed(2));
  EXPECT_FALSE(s.FinishReplay());  // 3 and 4 never came (or the replay timed out): clear
  EXPECT_EQ(s.next(), 5u);
  EXPECT_EQ(s.Observe(5).action, A::kApply);
  EXPECT_FALSE(s.AcceptReplayed(6));  // no replay in progress
}

TEST(RankSequence, AGapDuringTheHeldMessagesStartsAnotherReplay) {
  RankSequence s = Replaying(1, 3);
  EXPECT_TRUE(s.AcceptReplayed(2));
  EXPECT_TRUE(s.FinishReplay());
  // Held: 3, 6.
  EXPECT_EQ(s.Observe(3).action, A::kApply);
  const RankSequence::Verdict v = s.Observe(6);
  EXPECT_EQ(v.action, A::kGap);
  EXPECT_EQ(v.missed, 2u);
}

TEST(PublisherSequences, EachPublisherStartsWhereItIsFirstHeard) {
  PublisherSequences p;
  EXPECT_EQ(p.Observe(7, 100).action, A::kApply);
  EXPECT_EQ(p.Observe(8, 0).action, A::kApply);
  EXPECT_EQ(p.Observe(7, 101).action, A::kApply);
  EXPECT_EQ(p.Observe(8, 1).action, A::kApply);
  EXPECT_EQ(p.size(), 2u);
}

TEST(PublisherSequences, StaleMessagesChangeNothingAndGapsMovePast) {
  PublisherSequences p;
  p.Observe(1, 0);
  PublisherSequences::Verdict v = p.Observe(1, 0);
  EXPECT_EQ(v.action, A::kStale);
  v = p.Observe(1, 4);
  EXPECT_EQ(v.action, A::kGap);
  EXPECT_EQ(v.missed, 3u);
  EXPECT_EQ(v.publisher->next_sequence, 5u);
  EXPECT_EQ(p.Observe(1, 5).action, A::kApply);
  // A publisher that restarts numbering is stale until it passes where it was (no replay plane).
  EXPECT_EQ(p.Observe(1, 0).action, A::kStale);
}

TEST(PublisherSequences, RemembersTheRanksAGapMustClear) {
  PublisherSequences p;
  PublisherSequences::Verdict v = p.Observe(1, 0);
  v.publisher->ranks.insert({3, 0});
  v.publisher->ranks.insert({3, 1});
  v = p.Observe(1, 2);
  ASSERT_EQ(v.action, A::kGap);
  EXPECT_EQ(v.publisher->ranks.size(), 2u);
}

TEST(PublisherSequences, ForgetsTheLongestSilentPublisherPastTheLimit) {
  PublisherSequences p;
  for (uint64_t id = 0; id < PublisherSequences::kMaxPublishers; ++id) p.Observe(id, 0);
  p.Observe(0, 1);  // publisher 0 speaks again: publisher 1 is now the longest silent
  EXPECT_EQ(p.size(), PublisherSequences::kMaxPublishers);
  p.Observe(PublisherSequences::kMaxPublishers, 0);  // one more
  EXPECT_EQ(p.size(), PublisherSequences::kMaxPublishers);
  // Publisher 1 was forgotten: heard again, it starts afresh wherever it is.
  EXPECT_EQ(p.Observe(1, 50).action, A::kApply);
  // Publisher 0 was kept: its next message is 2.
  EXPECT_EQ(p.Observe(0, 5).action, A::kGap);
}

}  // namespace
}  // namespace kvrouter
