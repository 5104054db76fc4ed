// Writes the seed corpora of the harnesses whose inputs kvrouter itself encodes (event batches,
// index snapshots, replica changes) into DIR/<harness>/, made by the library's own encoders so
// that the fuzzers start from inputs that reach deep. Run after a format change:
//   cmake --build build/fuzz --target fuzz_write_seeds
//   build/fuzz/tests/fuzz/fuzz_write_seeds tests/fuzz/seeds
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "fuzz_router.h"
#include "wire/flatbuffers_codec.h"

namespace kvrouter::fuzz {
namespace {

std::filesystem::path seeds_dir;

void Write(const std::string& harness, const std::string& name, std::span<const uint8_t> bytes) {
  const std::filesystem::path dir = seeds_dir / harness;
  std::filesystem::create_directories(dir);
  std::ofstream(dir / (name + ".bin"), std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
}

void Write(const std::string& harness, const std::string& name, kvr_buffer* buffer) {
  Write(harness, name, std::span(kvr_buffer_data(buffer), kvr_buffer_size(buffer)));
  kvr_buffer_free(buffer);
}

void AddStored(kvr_event_batch* batch, uint64_t worker, uint32_t rank, const uint64_t* parent,
               std::vector<uint64_t> engine, uint32_t first_token, kvr_tier tier) {
  std::vector<uint32_t> tokens(engine.size() * kBlockSize);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = first_token + static_cast<uint32_t>(i);
  kvr_stored_event event;
  kvr_stored_event_init(&event, sizeof event);
  event.worker_id = worker;
  event.dp_rank = rank;
  event.tier = tier;
  if (parent != nullptr) {
    event.flags = KVR_STORED_HAS_PARENT;
    event.parent_hash = *parent;
  }
  event.block_hashes = engine.data();
  event.num_blocks = engine.size();
  event.token_ids = tokens.data();
  event.num_tokens = tokens.size();
  kvr_error* err = nullptr;
  Require(kvr_event_batch_add_stored(batch, &event, &err) == KVR_OK, "add_stored", err);
}

void AddRemoved(kvr_event_batch* batch, uint64_t worker, uint32_t rank,
                std::vector<uint64_t> engine) {
  kvr_removed_event event;
  kvr_removed_event_init(&event, sizeof event);
  event.worker_id = worker;
  event.dp_rank = rank;
  event.block_hashes = engine.data();
  event.num_blocks = engine.size();
  kvr_error* err = nullptr;
  Require(kvr_event_batch_add_removed(batch, &event, &err) == KVR_OK, "add_removed", err);
}

// A hybrid model's sliding-window group `group` holds (or, removing, lets go of) these blocks.
void AddSliding(kvr_event_batch* batch, uint64_t worker, int64_t group,
                std::vector<uint64_t> engine, bool removing) {
  kvr_error* err = nullptr;
  if (removing) {
    kvr_removed_event event;
    kvr_removed_event_init(&event, sizeof event);
    event.worker_id = worker;
    event.block_hashes = engine.data();
    event.num_blocks = engine.size();
    event.sliding_group = group;
    event.flags = KVR_REMOVED_SLIDING;
    Require(kvr_event_batch_add_removed(batch, &event, &err) == KVR_OK, "add_removed", err);
    return;
  }
  kvr_stored_event event;
  kvr_stored_event_init(&event, sizeof event);
  event.worker_id = worker;
  event.block_hashes = engine.data();
  event.num_blocks = engine.size();
  event.sliding_group = group;
  event.sliding_window_tokens = 2 * kBlockSize;
  Require(kvr_event_batch_add_stored(batch, &event, &err) == KVR_OK, "add_stored", err);
}

kvr_buffer* Encode(kvr_event_batch* batch) {
  kvr_buffer* out = nullptr;
  kvr_error* err = nullptr;
  Require(kvr_event_batch_set_publish_time(batch, 1'780'000'000'000'000'000ULL, &err) == KVR_OK,
          "set_publish_time", err);
  Require(kvr_event_batch_encode(batch, &out, &err) == KVR_OK, "encode", err);
  kvr_event_batch_clear(batch);
  return out;
}

// A history of every kind of event over the fleet: stores (with and without parent, on two
// tiers, on two ranks), a hybrid model's sliding-window store and removal, a removal, a clear,
// and an event naming an unknown parent.
void FillHistory(kvr_event_batch* batch) {
  const uint64_t parent = 101;
  AddStored(batch, 1, 0, nullptr, {101, 102}, 1, KVR_TIER_DEVICE);
  AddStored(batch, 1, 0, &parent, {103}, 9, KVR_TIER_DEVICE);
  AddSliding(batch, 1, 0, {101, 103}, /*removing=*/false);
  AddSliding(batch, 1, 0, {103}, /*removing=*/true);
  AddStored(batch, 2, 1, nullptr, {201, 202, 203}, 1, KVR_TIER_HOST_PINNED);
  AddStored(batch, 3, 0, nullptr, {301}, 100, KVR_TIER_DEVICE);
  AddRemoved(batch, 1, 0, {102});
  kvr_error* err = nullptr;
  Require(kvr_event_batch_add_cleared(batch, 3, 0, 7, &err) == KVR_OK, "add_cleared", err);
}

void EventBatchSeeds(kvr_event_batch* batch) {
  FillHistory(batch);
  Write("event_batch_fuzzer", "history", Encode(batch));
  const uint64_t unknown = 999;
  AddStored(batch, 2, 0, &unknown, {204}, 50, KVR_TIER_DEVICE);
  AddRemoved(batch, 1, 1, {555});
  Write("event_batch_fuzzer", "rejected_parts", Encode(batch));
  Write("event_batch_fuzzer", "empty", Encode(batch));
}

void SnapshotSeeds(kvr_event_batch* batch) {
  kvr_router* router = NewFleetRouter();
  kvr_buffer* empty = nullptr;
  kvr_error* err = nullptr;
  Require(kvr_router_snapshot(router, &empty, &err) == KVR_OK, "snapshot", err);
  Write("snapshot_restore_fuzzer", "empty", empty);
  FillHistory(batch);
  kvr_buffer* events = Encode(batch);
  Require(kvr_router_apply_event_batch(router, kvr_buffer_data(events), kvr_buffer_size(events),
                                       &err) == KVR_OK,
          "apply_event_batch", err);
  kvr_buffer_free(events);
  kvr_buffer* full = nullptr;
  Require(kvr_router_snapshot(router, &full, &err) == KVR_OK, "snapshot", err);
  Write("snapshot_restore_fuzzer", "history", full);
  kvr_router_free(router);
}

// Messages in the harness's framing: a 2-byte little-endian length, then the message.
void AppendFramed(std::vector<uint8_t>& out, const std::vector<uint8_t>& message) {
  out.push_back(static_cast<uint8_t>(message.size()));
  out.push_back(static_cast<uint8_t>(message.size() >> 8));
  out.insert(out.end(), message.begin(), message.end());
}

void ReplicaSeeds() {
  const std::vector<uint64_t> blocks = {11, 12, 13};
  SequenceChange added{.kind = SequenceChange::Kind::kAdded,
                       .request_id = "req-1",
                       .worker = {2, 1},
                       .block_ids = blocks,
                       .prefill_tokens = 12,
                       .expected_output_tokens = 30};
  SequenceChange prefilled{.kind = SequenceChange::Kind::kPrefillCompleted, .request_id = "req-1"};
  SequenceChange freed{.kind = SequenceChange::Kind::kFreed, .request_id = "req-1"};
  SequenceChange reset{.kind = SequenceChange::Kind::kReset};
  SequenceChange sync{.kind = SequenceChange::Kind::kSyncRequest};
  std::vector<uint8_t> lifecycle, rejoin;
  for (const SequenceChange* c : {&added, &prefilled, &freed}) {
    AppendFramed(lifecycle, EncodeReplicaChange("replica-a", *c));
  }
  Write("replica_change_fuzzer", "lifecycle", lifecycle);
  for (const SequenceChange* c : {&added, &sync, &reset, &added}) {
    AppendFramed(rejoin, EncodeReplicaChange("replica-b", *c));
  }
  Write("replica_change_fuzzer", "rejoin", rejoin);
}

}  // namespace
}  // namespace kvrouter::fuzz

int main(int argc, char** argv) {
  using namespace kvrouter::fuzz;
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s SEEDS_DIR\n", argv[0]);
    return 2;
  }
  seeds_dir = argv[1];
  kvr_event_batch* batch = nullptr;
  kvr_error* err = nullptr;
  Require(kvr_event_batch_new(&batch, &err) == KVR_OK, "kvr_event_batch_new", err);
  EventBatchSeeds(batch);
  SnapshotSeeds(batch);
  ReplicaSeeds();
  kvr_event_batch_free(batch);
  return 0;
}
