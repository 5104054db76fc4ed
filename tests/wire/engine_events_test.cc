// The vLLM / SGLang msgpack decoder against every wire vector of
// data/vectors/{vllm,sglang}_kv_events_vectors.json. Each vector's payload is decoded and
// compared, field by field, with the vector's own "decoded" view (an independent JSON rendering
// of what the bytes mean), then checked against hand-written expectations of its meaning.
#include "wire/engine_events.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "core/router.h"

namespace kvrouter {
namespace {

using nlohmann::json;

json LoadVectors(const std::string& file) {
  std::ifstream in(std::string(KVR_DATA_DIR) + "/vectors/" + file);
  EXPECT_TRUE(in.good()) << file;
  return json::parse(in);
}

std::vector<uint8_t> FromHex(const std::string& hex) {
  std::vector<uint8_t> out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<uint8_t>(std::stoul(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

// A hash as the JSON view writes it: a signed or unsigned integer, or {"$bytes_hex": digest}.
uint64_t ExpectedHash(const json& j) {
  if (j.is_object()) {
    const auto bytes = FromHex(j.at("$bytes_hex").get<std::string>());
    uint64_t v = 0;
    for (size_t i = bytes.size() - 8; i < bytes.size(); ++i) v = (v << 8) | bytes[i];
    return v;
  }
  if (j.is_number_unsigned()) return j.get<uint64_t>();
  return static_cast<uint64_t>(j.get<int64_t>());
}

const std::vector<std::string> kStoredOrder = {
    "block_hashes", "parent_block_hash", "token_ids",  "block_size", "lora_id",
    "medium",       "lora_name",         "extra_keys", "group_idx",  "kv_cache_spec_kind"};
const std::vector<std::string> kRemovedOrder = {"block_hashes", "medium", "group_idx"};

// An event's fields by name, whether the JSON view is positional or a map.
std::map<std::string, json> FieldsOf(const json& event, std::string& tag) {
  std::map<std::string, json> out;
  if (event.is_object()) {
    tag = event.at("type").get<std::string>();
    for (auto it = event.begin(); it != event.end(); ++it) out[it.key()] = it.value();
    return out;
  }
  tag = event.at(0).get<std::string>();
  const auto& order = tag == "BlockStored" ? kStoredOrder : kRemovedOrder;
  for (size_t i = 1; i < event.size(); ++i) {
    if (event[i].is_object()) {
      out["metadata"] = event[i];  // SGLang's trailing metadata map
    } else if (i - 1 < order.size()) {
      out[order[i - 1]] = event[i];
    }
  }
  return out;
}

bool Present(const std::map<std::string, json>& f, const std::string& name) {
  auto it = f.find(name);
  return it != f.end() && !it->second.is_null();
}

// Checks a decoded batch against the vector's JSON view of the same bytes.
void ExpectMatchesView(const EngineBatch& batch, const json& view) {
  json events;
  json rank;
  if (view.is_object()) {
    EXPECT_DOUBLE_EQ(view.at("ts").get<double>(), batch.timestamp);
    events = view.at("events");
    rank = view.value("data_parallel_rank", json());
  } else {
    EXPECT_DOUBLE_EQ(view.at(0).get<double>(), batch.timestamp);
    events = view.at(1);
    rank = view.size() >= 3 ? view.at(2) : json();
  }
  if (rank.is_null()) {
    EXPECT_FALSE(batch.dp_rank.has_value());
  } else {
    ASSERT_TRUE(batch.dp_rank.has_value());
    EXPECT_EQ(rank.get<uint32_t>(), *batch.dp_rank);
  }
  ASSERT_EQ(events.size(), batch.events.size());
  for (size_t i = 0; i < events.size(); ++i) {
    SCOPED_TRACE("event " + std::to_string(i));
    const EngineEvent& got = batch.events[i];
    std::string tag;
    const auto f = FieldsOf(events[i], tag);
    if (tag == "AllBlocksCleared") {
      EXPECT_EQ(EngineEventKind::kCleared, got.kind);
      continue;
    }
    EXPECT_EQ(tag == "BlockStored" ? EngineEventKind::kStored : EngineEventKind::kRemoved,
              got.kind);
    std::vector<uint64_t> hashes;
    for (const json& h : f.at("block_hashes")) hashes.push_back(ExpectedHash(h));
    EXPECT_EQ(hashes, got.block_hashes);
    const std::string medium = Present(f, "medium") ? f.at("medium").get<std::string>() : "";
    EXPECT_EQ(TierFromMedium(medium), got.tier);
    EXPECT_EQ(medium, got.medium.value_or(""));
    if (tag != "BlockStored") continue;
    if (Present(f, "parent_block_hash")) {
      ASSERT_TRUE(got.parent_hash.has_value());
      EXPECT_EQ(ExpectedHash(f.at("parent_block_hash")), *got.parent_hash);
    } else {
      EXPECT_FALSE(got.parent_hash.has_value());
    }
    EXPECT_EQ(f.at("token_ids").get<std::vector<uint32_t>>(), got.token_ids);
    EXPECT_EQ(f.at("block_size").get<uint32_t>(), got.block_size.value_or(0));
    EXPECT_EQ(Present(f, "lora_name"), got.lora_name.has_value());
    if (Present(f, "metadata")) {
      EXPECT_EQ(f.at("metadata").at("cache_salt").get<std::string>(), got.cache_salt.value_or(""));
    }
    if (Present(f, "kv_cache_spec_kind")) {
      EXPECT_EQ(f.at("kv_cache_spec_kind").get<std::string>(), got.kv_cache_spec_kind.value_or(""));
    }
  }
}

struct Vector {
  std::string file;
  json body;
};

std::vector<Vector> AllVectors() {
  std::vector<Vector> out;
  for (const char* file : {"vllm_kv_events_vectors.json", "sglang_kv_events_vectors.json"}) {
    const json vectors = LoadVectors(file);
    for (const json& v : vectors.at("vectors")) out.push_back({file, v});
  }
  return out;
}

class EngineVectorTest : public ::testing::TestWithParam<Vector> {};

// Every vector: the payload decodes to exactly what its JSON view says, and its sequence frame
// to its seq.
TEST_P(EngineVectorTest, DecodesToItsView) {
  const json& v = GetParam().body;
  const json& frames = v.at("zmq_frames");
  auto seq = DecodeSequence(FromHex(frames.at("seq_hex").get<std::string>()));
  ASSERT_TRUE(seq.has_value());
  EXPECT_EQ(frames.at("seq").get<uint64_t>(), *seq);
  auto batch = DecodeEnginePayload(FromHex(frames.at("payload_hex").get<std::string>()));
  ASSERT_TRUE(batch.ok()) << batch.status();
  ExpectMatchesView(*batch, v.at("decoded"));
}

// Every vector survives truncation at any point as an error, never a crash or a wrong batch.
TEST_P(EngineVectorTest, TruncationIsAnError) {
  const auto payload =
      FromHex(GetParam().body.at("zmq_frames").at("payload_hex").get<std::string>());
  for (size_t n = 0; n < payload.size(); ++n) {
    EXPECT_FALSE(DecodeEnginePayload(std::span(payload.data(), n)).ok()) << "length " << n;
  }
}

std::string VectorName(const ::testing::TestParamInfo<Vector>& info) {
  return info.param.body.at("name").get<std::string>();
}

INSTANTIATE_TEST_SUITE_P(WireVectors, EngineVectorTest, ::testing::ValuesIn(AllVectors()),
                         VectorName);

// ---- The meaning of particular vectors, written out by hand. --------------------------------

EngineBatch Decode(const std::string& file, const std::string& name) {
  const json vectors = LoadVectors(file);  // kept alive: the loop walks into it
  for (const json& v : vectors.at("vectors")) {
    if (v.at("name").get<std::string>() != name) continue;
    auto batch =
        DecodeEnginePayload(FromHex(v.at("zmq_frames").at("payload_hex").get<std::string>()));
    EXPECT_TRUE(batch.ok()) << batch.status();
    return batch.ok() ? *batch : EngineBatch{};
  }
  ADD_FAILURE() << "no vector " << name;
  return {};
}

EngineBatch Vllm(const std::string& name) { return Decode("vllm_kv_events_vectors.json", name); }
EngineBatch Sglang(const std::string& name) {
  return Decode("sglang_kv_events_vectors.json", name);
}

std::vector<uint32_t> Range(uint32_t first, uint32_t last) {
  std::vector<uint32_t> out;
  for (uint32_t t = first; t <= last; ++t) out.push_back(t);
  return out;
}

TEST(VllmVectors, LegacyArrayHasNoRankAndNegativeHashes) {
  const EngineBatch b = Vllm("legacy_array_store_no_dp");
  EXPECT_FALSE(b.dp_rank.has_value());
  ASSERT_EQ(1u, b.events.size());
  EXPECT_EQ(EngineEventKind::kStored, b.events[0].kind);
  EXPECT_EQ((std::vector<uint64_t>{static_cast<uint64_t>(int64_t{-4417543712399862035}),
                                   6011398571287513001u}),
            b.events[0].block_hashes);
  EXPECT_FALSE(b.events[0].medium.has_value());
  EXPECT_EQ(Tier::kDevice, b.events[0].tier);
  EXPECT_EQ(Range(1001, 1032), b.events[0].token_ids);
}

TEST(VllmVectors, ArrayWithRankMediumAndContinuation) {
  const EngineBatch first = Vllm("array_store_dp_medium");
  ASSERT_EQ(0u, first.dp_rank.value_or(99));
  EXPECT_EQ((std::vector<uint64_t>{13873306188318471009u, 6954383379811354547u}),
            first.events[0].block_hashes);
  EXPECT_FALSE(first.events[0].parent_hash.has_value());
  const EngineBatch next = Vllm("array_store_continuation");
  EXPECT_EQ(6954383379811354547u, next.events[0].parent_hash.value_or(0));
  EXPECT_EQ(Range(1033, 1048), next.events[0].token_ids);
}

TEST(VllmVectors, FullSchemaAndRemovals) {
  const EngineBatch stored = Vllm("array_store_full_schema");
  EXPECT_EQ(0, stored.events[0].group_idx.value_or(-1));
  EXPECT_EQ("full_attention", stored.events[0].kv_cache_spec_kind.value_or(""));
  EXPECT_FALSE(stored.events[0].lora_name.has_value());
  for (const char* name : {"array_remove_full_schema", "array_remove_medium_only"}) {
    const EngineBatch removed = Vllm(name);
    ASSERT_EQ(1u, removed.events.size()) << name;
    EXPECT_EQ(EngineEventKind::kRemoved, removed.events[0].kind);
    EXPECT_EQ(std::vector<uint64_t>{4887838800748829271u}, removed.events[0].block_hashes);
    EXPECT_EQ(Tier::kDevice, removed.events[0].tier);
  }
  EXPECT_EQ(EngineEventKind::kCleared, Vllm("array_all_cleared").events.at(0).kind);
}

TEST(VllmVectors, BytesHashesAreTheIntegerFormOfTheSameDigests) {
  EXPECT_EQ(Vllm("array_store_dp_medium").events[0].block_hashes,
            Vllm("array_store_bytes_hashes").events[0].block_hashes);
}

TEST(VllmVectors, MapEventsDecodeAsTheirArrayTwins) {
  const EngineBatch map = Vllm("map_store");
  const EngineBatch array = Vllm("array_store_full_schema");
  EXPECT_EQ(array.events[0].block_hashes, map.events[0].block_hashes);
  EXPECT_EQ(array.events[0].token_ids, map.events[0].token_ids);
  EXPECT_EQ(6954383379811354547u, Vllm("map_store_continuation").events[0].parent_hash.value_or(0));
  const EngineBatch mixed = Vllm("map_remove_and_clear");
  ASSERT_EQ(2u, mixed.events.size());
  EXPECT_EQ(EngineEventKind::kRemoved, mixed.events[0].kind);
  EXPECT_EQ(EngineEventKind::kCleared, mixed.events[1].kind);
  // Even the (unconfirmed) map-shaped outer batch.
  const EngineBatch outer = Vllm("map_outer_batch_UNCONFIRMED");
  EXPECT_EQ(map.events[0].block_hashes, outer.events.at(0).block_hashes);
  EXPECT_EQ(0u, outer.dp_rank.value_or(99));
}

TEST(VllmVectors, SaltedStoreOnRankOne) {
  const EngineBatch b = Vllm("map_store_salted_dp1");
  EXPECT_EQ(1u, b.dp_rank.value_or(99));
  EXPECT_EQ(std::vector<uint64_t>{17727205874650126851u}, b.events[0].block_hashes);
  ASSERT_EQ(1u, b.events[0].extra_keys.size());
  EXPECT_EQ(std::vector<std::string>{"tenant-a"}, b.events[0].extra_keys[0]);
  // The rank goes into the router event.
  const ConvertedBatch c = ToKvEvents(b, 7, 0, 16, false, 1);
  ASSERT_EQ(1u, c.events.size());
  EXPECT_EQ((WorkerKey{7, 1}), c.events[0].worker);
}

TEST(SglangVectors, Meaning) {
  const EngineBatch legacy = Sglang("sglang_legacy_array_store");
  EXPECT_FALSE(legacy.dp_rank.has_value());
  EXPECT_EQ(std::vector<uint64_t>{8796689484619490361u}, legacy.events[0].block_hashes);

  const EngineBatch pages = Sglang("sglang_array_store_medium_dp");
  ASSERT_EQ(2u, pages.events.size());  // one event per page
  EXPECT_EQ(8796689484619490361u, pages.events[1].parent_hash.value_or(0));
  EXPECT_EQ(Range(1017, 1032), pages.events[1].token_ids);

  const EngineBatch negative = Sglang("sglang_array_store_negative_hash");
  EXPECT_EQ(std::vector<uint64_t>{static_cast<uint64_t>(int64_t{-745911699836886992})},
            negative.events[0].block_hashes);

  EXPECT_EQ("tenant-a",
            Sglang("sglang_array_store_with_metadata").events[0].cache_salt.value_or(""));

  const EngineBatch cpu = Sglang("sglang_array_remove_cpu");
  EXPECT_EQ("CPU_PINNED", cpu.events[0].medium.value_or(""));
  EXPECT_EQ(Tier::kHostPinned, cpu.events[0].tier);

  EXPECT_EQ(legacy.events[0].block_hashes, Sglang("sglang_map_store").events[0].block_hashes);
  EXPECT_EQ(EngineEventKind::kCleared, Sglang("sglang_all_cleared").events.at(0).kind);
}

// Dual key: applied to a router, the events index the router's own hashes of the token ids,
// so a prompt of those tokens matches, whatever the engine's hash algorithm was.
TEST(EngineToRouter, LocalHashesComeFromTheTokens) {
  auto router = Router::Create(RouterOptions{.block_size = 16});
  ASSERT_TRUE(router.ok());
  ASSERT_TRUE((*router)->AddWorker(WorkerConfig{.worker_id = 3, .block_size = 16}).ok());
  uint64_t event_id = 1;
  for (const char* name : {"array_store_dp_medium", "array_store_continuation"}) {
    const ConvertedBatch c = ToKvEvents(Vllm(name), 3, 0, 16, false, event_id);
    event_id += c.events.size();
    for (const KvEvent& e : c.events) {
      auto applied = (*router)->ApplyEvent(e);
      ASSERT_TRUE(applied.ok() && applied->ok()) << name;
    }
  }
  const auto prompt = Range(1001, 1048);
  auto scores = (*router)->OverlapScores(prompt);
  ASSERT_TRUE(scores.ok());
  ASSERT_EQ(1u, scores->size());
  EXPECT_EQ((WorkerKey{3, 0}), (*scores)[0].worker);
  EXPECT_EQ(3u, (*scores)[0].overlap.device_blocks);

  // A removal by engine hash drops the third block.
  for (const KvEvent& e :
       ToKvEvents(Vllm("array_remove_full_schema"), 3, 0, 16, false, 10).events) {
    ASSERT_TRUE((*router)->ApplyEvent(e).ok());
  }
  scores = (*router)->OverlapScores(prompt);
  EXPECT_EQ(2u, (*scores)[0].overlap.device_blocks);
}

TEST(EngineToRouter, OtherBlockSizesAndNonAttentionGroupsAreNotIndexed) {
  const ConvertedBatch c = ToKvEvents(Vllm("array_store_dp_medium"), 1, 0, 32, false, 1);
  EXPECT_TRUE(c.events.empty());
  ASSERT_EQ(1u, c.block_size_mismatches.size());
  EXPECT_NE(std::string::npos, c.block_size_mismatches[0].reason.find("block size 16"));
  EngineBatch sliding = Vllm("array_store_full_schema");
  sliding.events[0].kv_cache_spec_kind = "sliding_window";
  EXPECT_EQ(1u, ToKvEvents(sliding, 1, 0, 16, false, 1).skipped_other_groups);
  // Its removals name the group by index: left out once a store said what the group is.
  sliding.events[0].group_idx = 1;
  EngineBatch removal = Vllm("array_remove_full_schema");
  removal.events[0].group_idx = 1;
  KvCacheGroups groups;
  EXPECT_EQ(1u, ToKvEvents(removal, 1, 0, 16, false, 1, nullptr, &groups).events.size());
  (void)ToKvEvents(sliding, 1, 0, 16, false, 1, nullptr, &groups);
  const ConvertedBatch removed = ToKvEvents(removal, 1, 0, 16, false, 1, nullptr, &groups);
  EXPECT_TRUE(removed.events.empty());
  EXPECT_EQ(1u, removed.skipped_other_groups);
  removal.events[0].group_idx = 0;  // another group, never stored: applied
  EXPECT_EQ(1u, ToKvEvents(removal, 1, 0, 16, false, 1, nullptr, &groups).events.size());
}

// Every full-attention kind vLLM names is indexed: MLA models (DeepSeek, Kimi) store as
// "mla_attention", and were never indexed; the kinds that keep part of a prefix are not. A
// store without its kind, of a group a store showed to be another kind, is left out too.
TEST(EngineToRouter, EveryFullAttentionKindIsIndexed) {
  for (const char* kind : {"full_attention", "mla_attention", "sink_full_attention"}) {
    EngineBatch store = Vllm("array_store_full_schema");
    store.events[0].kv_cache_spec_kind = kind;
    EXPECT_EQ(1u, ToKvEvents(store, 1, 0, 16, false, 1).events.size()) << kind;
  }
  for (const char* kind : {"sliding_window", "sliding_window_mla", "chunked_local_attention",
                           "mamba", "cross_attention", "encoder_only_attention", "unknown"}) {
    EngineBatch store = Vllm("array_store_full_schema");
    store.events[0].kv_cache_spec_kind = kind;
    EXPECT_TRUE(ToKvEvents(store, 1, 0, 16, false, 1).events.empty()) << kind;
  }
  KvCacheGroups groups;
  EngineBatch sliding = Vllm("array_store_full_schema");
  sliding.events[0].kv_cache_spec_kind = "sliding_window";
  sliding.events[0].group_idx = 1;
  (void)ToKvEvents(sliding, 1, 0, 16, false, 1, nullptr, &groups);
  sliding.events[0].kv_cache_spec_kind.reset();  // the same group, its kind not said
  EXPECT_TRUE(ToKvEvents(sliding, 1, 0, 16, false, 1, nullptr, &groups).events.empty());
}

// A sliding-window group that says its window: its store becomes a SlidingStoredEvent after the
// batch's other events (vLLM sends it first), its removal (by group index) a
// SlidingRemovedEvent; before a clear, those waiting go first. A model with no full-attention
// group has nothing to place them by: ignored, as are windows out of range and other tiers.
TEST(EngineToRouter, SlidingWindowGroupsBecomeSlidingEventsAfterTheBatchsOthers) {
  auto event = [](EngineEventKind kind, uint64_t hash, std::optional<std::string> spec,
                  std::optional<uint32_t> window, int64_t group) {
    EngineEvent e;
    e.kind = kind;
    e.block_hashes = {hash};
    if (kind == EngineEventKind::kStored) e.token_ids = Range(1, 16);
    e.kv_cache_spec_kind = std::move(spec);
    e.sliding_window = window;
    e.group_idx = group;
    return e;
  };
  EngineBatch batch;
  batch.events = {event(EngineEventKind::kStored, 7, "sliding_window", 64, 0),
                  event(EngineEventKind::kStored, 7, "full_attention", std::nullopt, 1),
                  event(EngineEventKind::kRemoved, 7, std::nullopt, std::nullopt, 0),
                  event(EngineEventKind::kCleared, 0, std::nullopt, std::nullopt, 0),
                  event(EngineEventKind::kStored, 8, "sliding_window", 64, 0)};
  for (size_t i = 0; i < batch.events.size(); ++i) batch.events[i].position = i;
  KvCacheGroups groups;
  const ConvertedBatch c = ToKvEvents(batch, 1, 0, 16, false, 100, nullptr, &groups);
  ASSERT_EQ(5u, c.events.size());
  EXPECT_TRUE(std::holds_alternative<StoredEvent>(c.events[0].data));
  const auto* sliding = std::get_if<SlidingStoredEvent>(&c.events[1].data);
  ASSERT_NE(nullptr, sliding);
  EXPECT_EQ(0, sliding->group);
  EXPECT_EQ(64u, sliding->window_tokens);
  EXPECT_EQ(std::vector<uint64_t>{7}, sliding->block_hashes);
  EXPECT_TRUE(std::holds_alternative<SlidingRemovedEvent>(c.events[2].data));
  EXPECT_TRUE(std::holds_alternative<ClearedEvent>(c.events[3].data));
  EXPECT_TRUE(std::holds_alternative<SlidingStoredEvent>(c.events[4].data));
  for (size_t i = 0; i < c.events.size(); ++i) EXPECT_EQ(100 + i, c.events[i].event_id);
  EXPECT_EQ(0u, c.skipped_other_groups);

  // Every layer windowed: one sliding group, no full attention to place its blocks by.
  EngineBatch all_sliding;
  all_sliding.events = {event(EngineEventKind::kStored, 7, "sliding_window", 4096, 0)};
  KvCacheGroups one_group;
  EXPECT_EQ(1u,
            ToKvEvents(all_sliding, 1, 0, 16, false, 1, nullptr, &one_group).skipped_other_groups);
  // A sliding kind without its window (an older vLLM, or one out of range) or on another tier.
  EngineBatch unsized;
  unsized.events = {event(EngineEventKind::kStored, 7, "sliding_window", std::nullopt, 0)};
  EXPECT_EQ(1u, ToKvEvents(unsized, 1, 0, 16, false, 1, nullptr, &groups).skipped_other_groups);
  EngineBatch on_host;
  on_host.events = {event(EngineEventKind::kStored, 7, "sliding_window", 64, 0)};
  on_host.events[0].tier = Tier::kHostPinned;
  EXPECT_EQ(1u, ToKvEvents(on_host, 1, 0, 16, false, 1, nullptr, &groups).skipped_other_groups);
}

// ---- Malformed input. ----------------------------------------------------------------------

// A salt is held while some block has it: the salts of blocks forgotten went with them only at
// the engine's clear, so an engine serving a stream of tenants grew a string per tenant for good.
// Slots are reused, and a block recorded again under another salt moves to it.
TEST(SaltedBlocksTest, KeepsOnlyTheSaltsItsBlocksHave) {
  SaltedBlocks salted;
  for (uint64_t tenant = 0; tenant < 1000; ++tenant) {
    const uint64_t blocks[] = {2 * tenant, 2 * tenant + 1};
    salted.Record(blocks, "tenant-" + std::to_string(tenant), Tier::kDevice);
    salted.Forget(blocks, Tier::kDevice);
  }
  EXPECT_EQ(0u, salted.size());
  EXPECT_EQ(0u, salted.salts());

  const uint64_t a[] = {1, 2};
  const uint64_t b[] = {3};
  salted.Record(a, "a", Tier::kDevice);
  salted.Record(b, "b", Tier::kDevice);
  EXPECT_EQ(2u, salted.salts());
  salted.Forget(std::span<const uint64_t>(a, 1), Tier::kDevice);  // block 1 goes, block 2 keeps "a"
  EXPECT_EQ("a", salted.Of(2));
  EXPECT_EQ("", salted.Of(1));
  salted.Forget(std::span<const uint64_t>(a + 1, 1), Tier::kDevice);
  EXPECT_EQ(1u, salted.salts());
  const uint64_t c[] = {4};
  salted.Record(c, "c", Tier::kDevice);  // in the slot "a" had
  EXPECT_EQ("b", salted.Of(3));
  EXPECT_EQ("c", salted.Of(4));
  salted.Record(b, "c", Tier::kDevice);  // block 3 moves to "c": "b" has no block left
  EXPECT_EQ("c", salted.Of(3));
  EXPECT_EQ(1u, salted.salts());
  salted.Record(b, "c", Tier::kDevice);  // the same again changes nothing
  salted.Forget(c, Tier::kDevice);
  EXPECT_EQ("c", salted.Of(3));
  EXPECT_EQ(1u, salted.salts());
  salted.Clear();
  EXPECT_EQ(0u, salted.salts());
  EXPECT_EQ("", salted.Of(3));
}

// A salted block is kept while some tier holds it: one stored on the host with its tokens (an
// LMCache-style tier) was forgotten only at the engine's clear, so its salt and entry stayed for
// good; one copied to the host lost its salt when the device evicted it.
TEST(SaltedBlocksTest, KeepsABlockWhileSomeTierHoldsIt) {
  SaltedBlocks salted;
  for (uint64_t tenant = 0; tenant < 1000; ++tenant) {  // stored and evicted on the host
    const uint64_t blocks[] = {tenant};
    salted.Record(blocks, "tenant-" + std::to_string(tenant), Tier::kHostPinned);
    salted.Forget(blocks, Tier::kHostPinned);
  }
  EXPECT_EQ(0u, salted.size());
  EXPECT_EQ(0u, salted.salts());

  const uint64_t offloaded[] = {7};
  salted.Record(offloaded, "a", Tier::kDevice);
  salted.Copied(offloaded, Tier::kHostPinned);
  salted.Forget(offloaded, Tier::kDevice);  // the host still holds it
  EXPECT_EQ("a", salted.Of(7));
  salted.Forget(offloaded, Tier::kDisk);  // a tier that never held it changes nothing
  EXPECT_EQ("a", salted.Of(7));
  salted.Copied(offloaded, Tier::kDevice);  // loaded back
  salted.Forget(offloaded, Tier::kHostPinned);
  EXPECT_EQ("a", salted.Of(7));
  salted.Forget(offloaded, Tier::kDevice);  // its last tier
  EXPECT_EQ("", salted.Of(7));
  EXPECT_EQ(0u, salted.size());
  EXPECT_EQ(0u, salted.salts());

  const uint64_t unsalted[] = {8};
  salted.Copied(unsalted, Tier::kHostPinned);  // no salt known: nothing kept
  EXPECT_EQ(0u, salted.size());
}

TEST(EngineDecoder, RejectsGarbageWithAReason) {
  const std::vector<std::vector<uint8_t>> bad = {
      {},
      {0xc1},                          // never-used msgpack byte
      {0x93, 0xcb},                    // truncated float
      {0xdd, 0xff, 0xff, 0xff, 0xff},  // array of 4 billion elements, no body
      {0x92, 0x01, 0x90, 0x00},        // trailing byte
      {0x2a},                          // a bare integer
      {0x92, 0x01, 0x91, 0x92, 0xab, 'B', 'l', 'o', 'c', 'k', 'S', 't', 'o', 'r', 'e', 'd',
       0x90},  // BlockStored without token_ids
  };
  for (const auto& bytes : bad) {
    auto batch = DecodeEnginePayload(bytes);
    ASSERT_FALSE(batch.ok());
    EXPECT_EQ(absl::StatusCode::kInvalidArgument, batch.status().code());
    EXPECT_FALSE(batch.status().message().empty());
  }
  EXPECT_FALSE(DecodeSequence(std::vector<uint8_t>(7)).has_value());
  EXPECT_EQ(0x0102030405060708u,
            DecodeSequence(std::vector<uint8_t>{1, 2, 3, 4, 5, 6, 7, 8}).value_or(0));
}

// Issue 19: one unknown event type rejected the whole batch.
TEST(EngineDecoder, SkipsAnEventOfAnUnknownTypeAndKeepsTheRest) {
  // [1, [["Foo"], ["AllBlocksCleared"], {"type": "Bar"}]]
  std::vector<uint8_t> payload = {0x92, 0x01, 0x93, 0x91, 0xa3, 'F', 'o', 'o', 0x91, 0xb0};
  for (char c : std::string("AllBlocksCleared")) payload.push_back(static_cast<uint8_t>(c));
  payload.insert(payload.end(), {0x81, 0xa4, 't', 'y', 'p', 'e', 0xa3, 'B', 'a', 'r'});
  auto batch = DecodeEnginePayload(payload);
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_EQ(1u, batch->events.size());
  EXPECT_EQ(EngineEventKind::kCleared, batch->events[0].kind);
  std::vector<std::string> reasons;
  for (const ConversionReject& skipped : batch->skipped) {
    EXPECT_EQ(ConversionReject::Kind::kUnknownType, skipped.kind);
    reasons.push_back(skipped.reason);
  }
  EXPECT_EQ((std::vector<std::string>{"event 0: unknown event tag 'Foo'",
                                      "event 2: unknown event tag 'Bar'"}),
            reasons);
  EXPECT_EQ(1u, batch->events[0].position);
  // Handed on in their place among the events, with the batch's positions.
  std::vector<std::string> order;
  ApplyKvEvents(
      *batch, 1, 0, 16, false, 1, nullptr, nullptr, [&](KvEvent&) { order.push_back("clear"); },
      [&](ConversionReject& r) { order.push_back(std::to_string(r.event_index)); });
  EXPECT_EQ((std::vector<std::string>{"0", "clear", "2"}), order);
}

TEST(EngineDecoder, ToleratesExtraTrailingFields) {
  // ["AllBlocksCleared", 1, 2] and a removal with a future fourth field.
  const std::vector<uint8_t> payload = {
      0x92, 0x01, 0x92, 0x93, 0xb0, 'A', 'l',  'l',  'B',  'l',  'o',  'c',  'k', 's', 'C',
      'l',  'e',  'a',  'r',  'e',  'd', 0x01, 0x02, 0x95, 0xac, 'B',  'l',  'o', 'c', 'k',
      'R',  'e',  'm',  'o',  'v',  'e', 'd',  0x91, 0x05, 0xc0, 0xc0, 0xa3, 'x', 'y', 'z'};
  auto batch = DecodeEnginePayload(payload);
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_EQ(2u, batch->events.size());
  EXPECT_EQ(std::vector<uint64_t>{5}, batch->events[1].block_hashes);
  EXPECT_EQ(Tier::kDevice, batch->events[1].tier);
}

}  // namespace
}  // namespace kvrouter
