// The replay's simulated engine pieces, without a router: the LRU prefix cache, the cost model,
// one engine's event stream, and the trace readers.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <sstream>

#include "replay/cost_model.h"
#include "replay/kv_cache.h"
#include "replay/sim_engine.h"
#include "replay/trace_source.h"

namespace kvrouter::replay {
namespace {

using Hashes = std::vector<uint64_t>;

std::vector<uint64_t> Evict(PrefixCache& cache, uint64_t count) {
  std::vector<uint64_t> evicted;
  cache.AllocatePrivate(count, evicted);
  return evicted;
}

// Puts `hashes` in the cache as one request would (allocate, compute, commit, release).
void CacheAndRelease(PrefixCache& cache, const std::vector<uint64_t>& hashes) {
  std::vector<uint64_t> evicted;
  cache.AllocatePrivate(hashes.size(), evicted);
  for (uint64_t hash : hashes) cache.Commit(hash);
  cache.Release(hashes, 0);
}

TEST(PrefixCacheTest, CapacityCountsCachedAndPrivateBlocks) {
  PrefixCache cache(4);
  EXPECT_TRUE(cache.CanAllocate(4));
  EXPECT_FALSE(cache.CanAllocate(5));
  std::vector<uint64_t> evicted;
  cache.AllocatePrivate(3, evicted);
  EXPECT_TRUE(evicted.empty());
  EXPECT_EQ(cache.free_blocks(), 1u);
  EXPECT_TRUE(cache.Commit(10));  // private → cached, still referenced
  EXPECT_EQ(cache.cached_blocks(), 1u);
  EXPECT_EQ(cache.private_blocks(), 2u);
  EXPECT_FALSE(cache.CanAllocate(2));  // the referenced block cannot be evicted
  cache.Release(std::vector<uint64_t>{10}, 2);
  EXPECT_EQ(cache.evictable_blocks(), 1u);
  EXPECT_TRUE(cache.CanAllocate(4));
}

TEST(PrefixCacheTest, EvictsLeastRecentlyUsedAndPrefixLast) {
  PrefixCache cache(6);
  CacheAndRelease(cache, {1, 2, 3});  // released tail first: 3, 2, 1
  CacheAndRelease(cache, {4, 5, 6});
  EXPECT_EQ(cache.EvictionOrder(), Hashes({3, 2, 1, 6, 5, 4}));
  // A hit on 1 makes it the most recently used once released again.
  cache.Acquire(std::vector<uint64_t>{1});
  cache.Release(std::vector<uint64_t>{1}, 0);
  EXPECT_EQ(cache.EvictionOrder(), Hashes({3, 2, 6, 5, 4, 1}));
  EXPECT_EQ(Evict(cache, 2), Hashes({3, 2}));
  EXPECT_EQ(cache.MatchPrefix(std::vector<uint64_t>{1, 2, 3}), 1u);
  EXPECT_EQ(cache.MatchPrefix(std::vector<uint64_t>{4, 5, 6}), 3u);
}

TEST(PrefixCacheTest, CommitOfABlockCachedMeanwhileSharesIt) {
  PrefixCache cache(4);
  std::vector<uint64_t> evicted;
  cache.AllocatePrivate(2, evicted);
  EXPECT_TRUE(cache.Commit(7));
  EXPECT_FALSE(cache.Commit(7));  // a second request computed the same block
  EXPECT_EQ(cache.cached_blocks(), 1u);
  EXPECT_EQ(cache.free_blocks(), 3u);  // the duplicate's block was given back
  cache.Release(std::vector<uint64_t>{7}, 0);
  EXPECT_EQ(cache.evictable_blocks(), 0u);  // still referenced once
  cache.Release(std::vector<uint64_t>{7}, 0);
  EXPECT_EQ(cache.evictable_blocks(), 1u);
}

// Taking a reference on an unreferenced cached block takes it off the LRU: it can no longer be
// evicted to make room for the same request's private blocks.
TEST(PrefixCacheTest, AdmissionCountsHitsThatLeaveTheEvictablePool) {
  PrefixCache cache(6);
  CacheAndRelease(cache, {1, 2, 3, 4});  // 4 evictable, 2 free
  const std::vector<uint64_t> hits = {1, 2, 3};
  EXPECT_TRUE(cache.CanAllocate(4));      // 2 free + 4 evictable, hits not counted
  EXPECT_FALSE(cache.CanAdmit(hits, 4));  // after acquiring 1-3 only block 4 can be evicted
  EXPECT_TRUE(cache.CanAdmit(hits, 3));
  // A hit that another request references already is not in the pool: it changes nothing.
  cache.Acquire(std::vector<uint64_t>{1});
  EXPECT_TRUE(cache.CanAdmit(hits, 3));
  EXPECT_FALSE(cache.CanAdmit(hits, 4));
}

TEST(CostModelTest, AttentionPairsCountCausalPairs) {
  EXPECT_DOUBLE_EQ(AttentionPairs(1, 0), 1);
  EXPECT_DOUBLE_EQ(AttentionPairs(4, 0), 10);   // 1 + 2 + 3 + 4
  EXPECT_DOUBLE_EQ(AttentionPairs(2, 10), 23);  // 11 + 12
  EXPECT_DOUBLE_EQ(AttentionPairs(0, 100), 0);
}

TEST(CostModelTest, StepTimeAddsEveryTerm) {
  const CostModel model{.step_overhead_s = 1,
                        .prefill_per_token_s = 2,
                        .attention_per_pair_s = 3,
                        .decode_per_sequence_s = 5,
                        .decode_per_context_token_s = 7};
  const StepShape shape{.prefill_tokens = 10,
                        .attention_pairs = 100,
                        .decode_sequences = 4,
                        .decode_context_tokens = 1000};
  EXPECT_DOUBLE_EQ(StepSeconds(model, shape), 1 + 20 + 300 + 20 + 7000);
}

TEST(CostModelTest, DefaultsGiveH100Magnitudes) {
  const CostModel model;
  // 8k uncached tokens from scratch: ~0.3-0.4 s (≈ 25 k tokens/s plus attention).
  const double prefill = IsolatedPrefillSeconds(model, 8192, 0);
  EXPECT_GT(prefill, 0.3);
  EXPECT_LT(prefill, 0.45);
  // A cached prefix saves the linear part but keeps attending to it.
  EXPECT_LT(IsolatedPrefillSeconds(model, 512, 7680), prefill / 5);
  // A decode step at batch 1 with a short context costs about the weight read.
  EXPECT_NEAR(StepSeconds(model, {.decode_sequences = 1, .decode_context_tokens = 1000}), 0.006,
              0.001);
}

// Records what an engine publishes and replays it into a set per tier, as a router's index
// would.
class RecordingObserver final : public EngineObserver {
 public:
  void OnStored(uint32_t, const StoredRun& run) override {
    if (run.tier == Tier::kHost) {
      // A copy: hashes only, of blocks the device holds.
      EXPECT_FALSE(run.has_parent);
      EXPECT_TRUE(run.token_ids.empty());
      for (uint64_t hash : run.block_hashes) {
        EXPECT_TRUE(indexed.contains(hash)) << "host copy of a block not on the device";
        EXPECT_TRUE(host.insert(hash).second);
      }
      ++host_stored_events;
      return;
    }
    if (run.has_parent) {
      EXPECT_TRUE(indexed.contains(run.parent_hash)) << "stored block with an unknown parent";
    }
    EXPECT_EQ(run.token_ids.size(), run.block_hashes.size() * 16);
    for (uint64_t hash : run.block_hashes) EXPECT_TRUE(indexed.insert(hash).second);
    ++stored_events;
  }
  void OnRemoved(uint32_t, std::span<const uint64_t> hashes, Tier tier) override {
    for (uint64_t hash : hashes) EXPECT_EQ((tier == Tier::kHost ? host : indexed).erase(hash), 1u);
  }
  void OnFirstToken(Request& request) override { first_tokens.push_back(request.index); }
  void OnFinished(Request& request) override { finished.push_back(request.index); }

  std::set<uint64_t> indexed, host;
  int stored_events = 0, host_stored_events = 0;
  std::vector<uint32_t> first_tokens, finished;
};

trace::TraceRecord Record(std::vector<uint64_t> ids, uint64_t input, uint64_t output) {
  return trace::TraceRecord{.timestamp_ms = 0,
                            .input_length = input,
                            .output_length = output,
                            .hash_ids = std::move(ids)};
}

Request MakeRequest(uint32_t index, const trace::TraceRecord& record) {
  Request request;
  request.index = index;
  request.record = &record;
  request.prompt_tokens = static_cast<uint32_t>(trace::ExpandedLength(record));
  request.output_tokens = static_cast<uint32_t>(std::max<uint64_t>(1, record.output_length));
  return request;
}

// Runs one engine until it has nothing left; returns the simulated end time.
double Drain(SimEngine& engine, double now) {
  engine.MaybeStartStep(now);
  while (engine.stepping()) {
    now = engine.step_end();
    engine.FinishStep();
    engine.MaybeStartStep(now);
  }
  return now;
}

TEST(SimEngineTest, EventsMatchCacheContentsUnderEviction) {
  // 3 trace blocks of 512 tokens = 96 engine blocks each; capacity for about two requests.
  std::vector<trace::TraceRecord> records;
  for (uint64_t r = 0; r < 6; ++r) records.push_back(Record({0, 100 + r, 200 + r}, 1500, 20));
  RecordingObserver observer;
  SimEngine engine(0, EngineLimits{.block_size = 16, .kv_capacity_blocks = 200}, CostModel{},
                   observer);
  std::vector<Request> requests;
  for (uint32_t i = 0; i < records.size(); ++i) requests.push_back(MakeRequest(i, records[i]));
  double now = 0;
  for (Request& request : requests) {
    engine.Enqueue(&request);
    now = Drain(engine, now);
    const std::vector<uint64_t> cached = engine.cache().CachedHashes();
    EXPECT_EQ(std::set<uint64_t>(cached.begin(), cached.end()), observer.indexed);
    EXPECT_LE(engine.cache().cached_blocks(), 200u);
  }
  EXPECT_EQ(observer.finished.size(), requests.size());
  // Every request after the first finds trace block 0 (32 engine blocks) cached.
  EXPECT_EQ(requests[0].cached_tokens, 0u);
  for (size_t i = 1; i < requests.size(); ++i) EXPECT_EQ(requests[i].cached_tokens, 512u) << i;
  EXPECT_EQ(engine.prefill_tokens_computed(), 1500u + 5 * (1500u - 512u));
}

TEST(SimEngineTest, FirstTokenEndsPrefillAndOutputTakesOneStepPerToken) {
  const trace::TraceRecord record = Record({1}, 100, 5);
  RecordingObserver observer;
  const CostModel cost;
  SimEngine engine(3, EngineLimits{.block_size = 16, .kv_capacity_blocks = 100}, cost, observer);
  Request request = MakeRequest(0, record);
  engine.Enqueue(&request);
  const double end = Drain(engine, 10.0);
  EXPECT_EQ(request.worker, 3u);
  const double prefill =
      StepSeconds(cost, {.prefill_tokens = 100, .attention_pairs = AttentionPairs(100, 0)});
  EXPECT_DOUBLE_EQ(request.first_token_s, 10.0 + prefill);
  EXPECT_EQ(engine.steps(), 5u);  // one prefill step (first token) + 4 decode steps
  EXPECT_DOUBLE_EQ(request.finish_s, end);
  EXPECT_EQ(observer.indexed.size(), 6u);  // 100 tokens: 6 full blocks cached, 4 tokens not
  EXPECT_EQ(engine.cache().private_blocks(), 0u);
}

TEST(SimEngineTest, FullyCachedPromptRecomputesItsLastBlock) {
  const trace::TraceRecord record = Record({5}, 512, 1);
  RecordingObserver observer;
  SimEngine engine(0, EngineLimits{.block_size = 16, .kv_capacity_blocks = 100}, CostModel{},
                   observer);
  Request first = MakeRequest(0, record), second = MakeRequest(1, record);
  engine.Enqueue(&first);
  Drain(engine, 0);
  engine.Enqueue(&second);
  Drain(engine, 1);
  EXPECT_EQ(second.cached_tokens, 512u - 16u);
  EXPECT_EQ(observer.stored_events, 1);  // the recomputed block was cached already
}

// Regression: admission checked the room for a request's private blocks before taking its
// prefix hits off the evictable pool, so a request whose room came from evicting its own hits
// passed the check and then aborted the replay ("KV cache: cannot allocate 3 blocks"). It must
// wait for room instead, and still find its prefix once admitted.
TEST(SimEngineTest, RequestWhoseRoomIsItsOwnHitsWaitsInsteadOfAborting) {
  // 10 blocks of 16 tokens. The first request leaves 4 cached, evictable blocks (its prompt).
  const trace::TraceRecord warm = Record({5}, 64, 1);
  // The second holds 5 blocks while it decodes 60 tokens: 1 block free, 4 evictable.
  const trace::TraceRecord busy = Record({6}, 16, 60);
  // The third shares the first's prompt: 3 usable hits, 3 more blocks needed (81 tokens). Free
  // plus evictable is 5, but once its 3 hits are referenced only 2 blocks are left.
  const trace::TraceRecord again = Record({5}, 64, 17);
  RecordingObserver observer;
  SimEngine engine(0, EngineLimits{.block_size = 16, .kv_capacity_blocks = 10}, CostModel{},
                   observer);
  Request first = MakeRequest(0, warm), second = MakeRequest(1, busy),
          third = MakeRequest(2, again);
  engine.Enqueue(&first);
  double now = Drain(engine, 0);
  engine.Enqueue(&second);
  engine.MaybeStartStep(now);
  engine.Enqueue(&third);
  ASSERT_NO_THROW(Drain(engine, now));
  EXPECT_EQ(observer.finished.size(), 3u);
  EXPECT_GE(third.first_token_s, second.finish_s) << "admitted only once the second ended";
  EXPECT_EQ(third.cached_tokens, 48u);
  EXPECT_EQ(engine.cache().private_blocks(), 0u);
}

// Runs one engine until it has nothing left, checking after every step that what it published
// is what its cache holds (no removal of a block still cached, no store of one it lacks).
double DrainChecked(SimEngine& engine, double now, const RecordingObserver& observer) {
  engine.MaybeStartStep(now);
  while (engine.stepping()) {
    now = engine.step_end();
    engine.FinishStep();
    const std::vector<uint64_t> cached = engine.cache().CachedHashes();
    EXPECT_EQ(std::set<uint64_t>(cached.begin(), cached.end()), observer.indexed) << now;
    EXPECT_LE(engine.cache().cached_blocks() + engine.cache().private_blocks(), 10u);
    engine.MaybeStartStep(now);
  }
  return now;
}

// With preemption, two requests whose prompts fit together but whose outputs do not: both are
// admitted (4 prompt blocks each of 10), decode side by side taking a block each 16 tokens, and
// when the older one needs a 6th block and none is free or evictable, the newer one is preempted:
// its prompt blocks stay cached (evictable, no event), it goes back to the queue, and once the
// older one ends it is re-admitted, prefills its prompt's uncached tail and the 17 tokens it had
// generated again, and finishes. Its first token is not emitted twice.
TEST(SimEngineTest, PreemptionRecomputesTheNewestRequestAndKeepsEventsConsistent) {
  const trace::TraceRecord first = Record({1}, 64, 40), second = Record({2}, 64, 40);
  RecordingObserver observer;
  SimEngine engine(0, EngineLimits{.block_size = 16, .kv_capacity_blocks = 10, .preemption = true},
                   CostModel{}, observer);
  Request a = MakeRequest(0, first), b = MakeRequest(1, second);
  engine.Enqueue(&a);
  engine.Enqueue(&b);
  DrainChecked(engine, 0, observer);

  EXPECT_EQ(observer.finished, (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(observer.first_tokens, (std::vector<uint32_t>{0, 1})) << "once each";
  EXPECT_EQ(engine.preemptions(), 1u);
  EXPECT_EQ(a.preemptions, 0u);
  EXPECT_EQ(b.preemptions, 1u);
  // Both prefilled in the first step: the first tokens came together, before the preemption.
  EXPECT_DOUBLE_EQ(b.first_token_s, a.first_token_s);
  EXPECT_GT(b.finish_s, a.finish_s);
  // Admitted, the second had its 4 prompt blocks cached; the first's growth evicted the last of
  // them (its 7th block), so 3 hit again: 16 prompt tokens and the 17 generated ones recomputed.
  EXPECT_EQ(engine.recompute_tokens(), 16u + 17u);
  EXPECT_EQ(engine.prefill_tokens_computed(), 64u + 64u + 33u);
  EXPECT_EQ(b.cached_tokens, 0u) << "the hit rate counts the first admission";
  EXPECT_EQ(b.generated, 40u);
  // Stores: each prompt once, then the evicted block of the second again.
  EXPECT_EQ(observer.stored_events, 3);
  EXPECT_EQ(engine.cache().private_blocks(), 0u);
  EXPECT_EQ(engine.cache().evictable_blocks(), engine.cache().cached_blocks());

  // Without preemption the first reserves its whole output (7 blocks) and the second (7) waits
  // for it to end.
  RecordingObserver reserved_observer;
  SimEngine reserved(0, EngineLimits{.block_size = 16, .kv_capacity_blocks = 10}, CostModel{},
                     reserved_observer);
  Request ra = MakeRequest(0, first), rb = MakeRequest(1, second);
  reserved.Enqueue(&ra);
  reserved.Enqueue(&rb);
  DrainChecked(reserved, 0, reserved_observer);
  EXPECT_EQ(reserved.preemptions(), 0u);
  EXPECT_GE(rb.first_token_s, ra.finish_s);
  EXPECT_EQ(rb.preemptions, 0u);
  // Preemption let the second start at once: a much earlier first token, and here an earlier end.
  EXPECT_LT(b.first_token_s, rb.first_token_s);
  EXPECT_LT(b.finish_s, rb.finish_s);
}

TEST(HostPoolTest, OffloadEvictsLeastRecentlyUsed) {
  HostPool pool(2);
  std::vector<uint64_t> added, evicted;
  pool.Offload(std::vector<uint64_t>{1, 2}, added, evicted);
  pool.Touch(std::vector<uint64_t>{1});
  pool.Offload(std::vector<uint64_t>{2, 3}, added, evicted);  // 2 is held already
  EXPECT_EQ(added, (std::vector<uint64_t>{1, 2, 3}));
  EXPECT_EQ(evicted, (std::vector<uint64_t>{1}));  // 2 was used after 1 was touched
  EXPECT_EQ(pool.MatchPrefix(std::vector<uint64_t>{2, 3, 4}), 2u);
  EXPECT_EQ(pool.MatchPrefix(std::vector<uint64_t>{1, 2}), 0u);
}

// With a host tier, blocks evicted from the device are offloaded (a host copy published while
// the device holds them, then the device removal), and a prompt that finds them there reloads
// them, paying the transfer time per block instead of the prefill.
TEST(SimEngineTest, EvictedBlocksGoToTheHostAndAreReloadedNotRecomputed) {
  const trace::TraceRecord first = Record({1}, 512, 1);       // 32 blocks, cached once done
  const trace::TraceRecord big = Record({2, 3, 4}, 1536, 1);  // 97 blocks: evicts 29 of them
  RecordingObserver observer;
  CostModel cost;
  cost.host_reload_per_block_s = 1e-3;
  SimEngine engine(
      0, EngineLimits{.block_size = 16, .kv_capacity_blocks = 100, .host_capacity_blocks = 200},
      cost, observer);
  Request a = MakeRequest(0, first), b = MakeRequest(1, big), again = MakeRequest(2, first);
  engine.Enqueue(&a);
  double now = Drain(engine, 0);
  engine.Enqueue(&b);
  now = Drain(engine, now);
  EXPECT_EQ(engine.host().size(), 29u);
  EXPECT_EQ(observer.host.size(), 29u);
  EXPECT_GE(observer.host_stored_events, 1);
  const uint64_t computed_before = engine.prefill_tokens_computed();

  engine.Enqueue(&again);
  const double start = now;
  now = Drain(engine, now);
  // The last prompt block is always computed: 3 device hits + 28 host hits, 16 tokens computed.
  EXPECT_EQ(again.cached_tokens, 31u * 16);
  EXPECT_EQ(again.host_cached_tokens, 28u * 16);
  EXPECT_EQ(engine.prefill_tokens_computed() - computed_before, 16u);
  const double reload = StepSeconds(cost, {.reload_blocks = 28});
  const double prefill =
      StepSeconds(cost, {.prefill_tokens = 16, .attention_pairs = AttentionPairs(16, 496)});
  EXPECT_DOUBLE_EQ(again.first_token_s, start + reload + prefill);
  // What was published matches both tiers' contents.
  const std::vector<uint64_t> cached = engine.cache().CachedHashes();
  EXPECT_EQ(std::set<uint64_t>(cached.begin(), cached.end()), observer.indexed);
  EXPECT_EQ(observer.host.size(), engine.host().size());
  for (uint64_t hash : observer.host) EXPECT_TRUE(engine.host().Contains(hash));
}

TEST(SimEngineTest, EngineHashesChainAndDifferFromPlainContentHashes) {
  std::vector<uint32_t> a(32, 7), b(32, 7);
  b[20] = 8;  // second block differs
  std::vector<uint64_t> ha, hb;
  EngineBlockHashes(a, 16, ha);
  EngineBlockHashes(b, 16, hb);
  ASSERT_EQ(ha.size(), 2u);
  EXPECT_EQ(ha[0], hb[0]);
  EXPECT_NE(ha[1], hb[1]);
  EXPECT_NE(ha[0], ha[1]);  // same tokens, different position in the chain
}

TEST(TraceSourceTest, AzureCsvGivesLengthsAndOptionalSharedPrefixes) {
  const std::string csv =
      "TIMESTAMP,ContextTokens,GeneratedTokens\n"
      "2023-11-16 18:15:46.6805900,1100,44\n"
      "2023-11-16 18:15:47.1805900,600,10\n";
  std::istringstream plain(csv);
  auto records = ParseAzureCsv(plain, "t.csv", {});
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[1].timestamp_ms, 500);
  EXPECT_EQ(records[0].input_length, 1100u);
  EXPECT_EQ(records[0].output_length, 44u);
  EXPECT_EQ(records[0].hash_ids.size(), 3u);
  EXPECT_NE(records[0].hash_ids[0], records[1].hash_ids[0]);  // nothing shared

  std::istringstream shared(csv);
  records = ParseAzureCsv(shared, "t.csv", {.groups = 1, .prefix_tokens = 512, .seed = 1});
  EXPECT_EQ(records[0].hash_ids[0], records[1].hash_ids[0]);
  EXPECT_NE(records[0].hash_ids[1], records[1].hash_ids[1]);
}

TEST(TraceSourceTest, BadAzureLineNamesTheLine) {
  std::istringstream in(
      "TIMESTAMP,ContextTokens,GeneratedTokens\n"
      "2023-11-16 18:15:46.6805900,374,44\n"
      "2023-11-16 18:15:47.0000000,many,44\n");
  try {
    ParseAzureCsv(in, "bad.csv", {});
    FAIL() << "no error";
  } catch (const trace::TraceParseError& e) {
    EXPECT_EQ(e.line_number(), 3u);
    EXPECT_NE(std::string(e.what()).find("bad.csv:3:"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("ContextTokens"), std::string::npos) << e.what();
  }
}

TEST(TraceSourceTest, InfiniteCacheBoundCountsLeadingRepeats) {
  const std::vector<trace::TraceRecord> trace = {Record({0, 1}, 1024, 1), Record({0, 2}, 1024, 1)};
  // Second request: block 0 (512 tokens) hits; 2048 prompt tokens in all.
  EXPECT_DOUBLE_EQ(InfiniteCacheHitRate(trace, 16), 512.0 / 2048.0);
}

TEST(TraceSourceTest, FormatFromExtension) {
  EXPECT_EQ(ResolveTraceFormat("auto", "x/trace.jsonl"), TraceFormat::kMooncake);
  EXPECT_EQ(ResolveTraceFormat("auto", "x/trace.csv"), TraceFormat::kAzure);
  EXPECT_EQ(ResolveTraceFormat("azure", "x/trace.txt"), TraceFormat::kAzure);
  EXPECT_THROW(ResolveTraceFormat("auto", "x/trace.txt"), std::invalid_argument);
}

}  // namespace
}  // namespace kvrouter::replay
