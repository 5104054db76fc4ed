#include "router_model.h"

#include <gtest/gtest.h>

#include <sstream>

namespace kvrouter::model {

const std::vector<std::vector<uint32_t>>& Prompts() {
  static const std::vector<std::vector<uint32_t>> prompts = [] {
    std::vector<std::vector<uint32_t>> out;
    uint32_t next_token = 1;
    const auto blocks = [&](size_t n) {
      std::vector<uint32_t> tokens;
      for (size_t i = 0; i < n * kBlockSize; ++i) tokens.push_back(next_token++);
      return tokens;
    };
    for (size_t stem = 0; stem < 3; ++stem) out.push_back(blocks(3 + stem));
    for (size_t i = 0; i < 6; ++i) {
      std::vector<uint32_t> prompt = out[i % 3];
      prompt.resize((1 + i % 3) * kBlockSize);  // a prefix of its stem, then its own blocks
      const std::vector<uint32_t> own = blocks(1 + i % 4);
      prompt.insert(prompt.end(), own.begin(), own.end());
      out.push_back(prompt);
    }
    return out;
  }();
  return prompts;
}

uint64_t EngineHash(const std::vector<uint32_t>& prompt, size_t block) {
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < (block + 1) * kBlockSize; ++i) h = (h ^ prompt[i]) * 1099511628211ULL;
  return h;
}

kvr_router* NewRouter() {
  kvr_router_options options;
  kvr_router_options_init(&options, sizeof options);
  options.block_size = kBlockSize;
  kvr_router* router = nullptr;
  const Outcome created =
      Try([&](kvr_error** err) { return kvr_router_new(&options, &router, err); });
  EXPECT_TRUE(created.ok()) << created.message;
  // Time stands still: no plan or session expires behind the model's back.
  EXPECT_TRUE(Try([&](kvr_error** err) { return kvr_router_set_time(router, 0, err); }).ok());
  return router;
}

static kvr_worker_config WorkerConfig(uint64_t id, uint32_t dp_size) {
  kvr_worker_config config;
  kvr_worker_config_init(&config, sizeof config);
  config.worker_id = id;
  config.dp_size = dp_size;
  config.total_kv_blocks = 1000;
  return config;
}

Outcome AddWorker(kvr_router* router, uint64_t id, uint32_t dp_size) {
  const kvr_worker_config config = WorkerConfig(id, dp_size);
  return Try([&](kvr_error** err) { return kvr_router_add_worker(router, &config, err); });
}

Outcome UpdateWorker(kvr_router* router, uint64_t id, uint32_t dp_size) {
  const kvr_worker_config config = WorkerConfig(id, dp_size);
  return Try([&](kvr_error** err) { return kvr_router_update_worker(router, &config, err); });
}

// The engine hashes of blocks [first, first + count) of the prompt.
static std::vector<uint64_t> EngineHashes(const std::vector<uint32_t>& prompt, size_t first,
                                          size_t count) {
  std::vector<uint64_t> hashes;
  for (size_t b = first; b < first + count; ++b) hashes.push_back(EngineHash(prompt, b));
  return hashes;
}

Outcome StoreBlocks(kvr_router* router, Rank rank, const std::vector<uint32_t>& prompt,
                    size_t first, size_t count, kvr_tier tier) {
  const std::vector<uint64_t> hashes = EngineHashes(prompt, first, count);
  kvr_stored_event event;
  kvr_stored_event_init(&event, sizeof event);
  event.worker_id = rank.worker_id;
  event.dp_rank = rank.dp_rank;
  event.tier = tier;
  if (first > 0) {
    event.flags = KVR_STORED_HAS_PARENT;
    event.parent_hash = EngineHash(prompt, first - 1);
  }
  event.block_hashes = hashes.data();
  event.num_blocks = hashes.size();
  event.token_ids = prompt.data() + first * kBlockSize;
  event.num_tokens = count * kBlockSize;
  return Try([&](kvr_error** err) { return kvr_router_apply_stored(router, &event, err); });
}

Outcome RemoveBlocks(kvr_router* router, Rank rank, const std::vector<uint32_t>& prompt,
                     size_t first, size_t count) {
  const std::vector<uint64_t> hashes = EngineHashes(prompt, first, count);
  kvr_removed_event event;
  kvr_removed_event_init(&event, sizeof event);
  event.worker_id = rank.worker_id;
  event.dp_rank = rank.dp_rank;
  event.block_hashes = hashes.data();
  event.num_blocks = hashes.size();
  return Try([&](kvr_error** err) { return kvr_router_apply_removed(router, &event, err); });
}

uint64_t Digest(kvr_router* router) {
  uint64_t digest = 0;
  EXPECT_TRUE(
      Try([&](kvr_error** err) { return kvr_router_state_digest(router, &digest, err); }).ok());
  return digest;
}

kvr_metrics Metrics(kvr_router* router) {
  kvr_metrics metrics;
  kvr_metrics_init(&metrics, sizeof metrics);
  EXPECT_TRUE(
      Try([&](kvr_error** err) { return kvr_router_get_metrics(router, &metrics, err); }).ok());
  return metrics;
}

std::map<Rank, kvr_potential_load> Loads(kvr_router* router) {
  std::vector<kvr_potential_load> loads(kMaxWorkerId * kMaxDpSize + 1);
  size_t len = 0;
  const std::vector<uint32_t>& probe = Prompts()[0];
  const Outcome outcome = Try([&](kvr_error** err) {
    return kvr_router_potential_loads(router, probe.data(), kBlockSize, nullptr, loads.data(),
                                      loads.size(), &len, err);
  });
  EXPECT_TRUE(outcome.ok()) << outcome.message;
  std::map<Rank, kvr_potential_load> out;
  for (size_t i = 0; i < len && i < loads.size(); ++i) {
    out[Rank{loads[i].worker_id, loads[i].dp_rank}] = loads[i];
  }
  return out;
}

std::string IndexView(kvr_router* router) {
  std::ostringstream view;
  for (const std::vector<uint32_t>& prompt : Prompts()) {
    std::vector<uint64_t> local(prompt.size() / kBlockSize);
    size_t num_hashes = 0;
    EXPECT_TRUE(Try([&](kvr_error** err) {
                  return kvr_compute_block_hashes(prompt.data(), prompt.size(), kBlockSize, nullptr,
                                                  local.data(), local.size(), &num_hashes, err);
                }).ok());
    std::vector<kvr_match> matches(kMaxWorkerId * kMaxDpSize * 4);
    size_t len = 0;
    EXPECT_TRUE(Try([&](kvr_error** err) {
                  return kvr_router_find_matches(router, local.data(), num_hashes, matches.data(),
                                                 matches.size(), &len, err);
                }).ok());
    std::map<Rank, std::string> rows;
    for (size_t i = 0; i < len; ++i) {
      const kvr_match& m = matches[i];
      rows[Rank{m.worker_id, m.dp_rank}] =
          std::to_string(m.device_blocks) + "/" + std::to_string(m.host_blocks) + "/" +
          std::to_string(m.disk_blocks) + "/" + std::to_string(m.external_blocks) + " of " +
          std::to_string(m.tree_size);
    }
    for (const auto& [rank, row] : rows) {
      view << rank.worker_id << "." << rank.dp_rank << ":" << row << " ";
    }
    view << "| ";
  }
  return view.str();
}

kvr_router* RestoredCopy(kvr_router* router, const std::map<uint64_t, uint32_t>& workers) {
  kvr_buffer* snapshot = nullptr;
  EXPECT_TRUE(
      Try([&](kvr_error** err) { return kvr_router_snapshot(router, &snapshot, err); }).ok());
  kvr_router* copy = NewRouter();
  for (const auto& [id, dp_size] : workers) EXPECT_TRUE(AddWorker(copy, id, dp_size).ok());
  const Outcome restored = Try([&](kvr_error** err) {
    return kvr_router_restore(copy, kvr_buffer_data(snapshot), kvr_buffer_size(snapshot), err);
  });
  EXPECT_TRUE(restored.ok()) << restored.message;
  kvr_buffer_free(snapshot);
  return copy;
}

}  // namespace kvrouter::model
