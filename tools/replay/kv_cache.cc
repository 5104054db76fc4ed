#include "replay/kv_cache.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kvrouter::replay {

PrefixCache::PrefixCache(uint64_t capacity_blocks) : capacity_(capacity_blocks) {}

size_t PrefixCache::MatchPrefix(std::span<const uint64_t> hashes) const {
  size_t hits = 0;
  while (hits < hashes.size() && blocks_.contains(hashes[hits])) ++hits;
  return hits;
}

void PrefixCache::Acquire(std::span<const uint64_t> hashes) {
  for (uint64_t hash : hashes) {
    Block& block = blocks_.at(hash);
    if (block.references++ == 0) lru_.erase(block.lru_position);
  }
}

bool PrefixCache::CanAdmit(std::span<const uint64_t> hits, uint64_t count) const {
  uint64_t leaving = 0;  // unreferenced hits: evictable now, not once acquired
  for (uint64_t hash : hits) {
    if (blocks_.at(hash).references == 0) ++leaving;
  }
  return free_blocks() + evictable_blocks() - leaving >= count;
}

void PrefixCache::AllocatePrivate(uint64_t count, std::vector<uint64_t>& evicted) {
  if (!CanAllocate(count)) {
    throw std::logic_error("KV cache: cannot allocate " + std::to_string(count) + " blocks");
  }
  while (free_blocks() < count) {
    const uint64_t victim = lru_.front();
    lru_.pop_front();
    blocks_.erase(victim);
    evicted.push_back(victim);
  }
  private_blocks_ += count;
}

bool PrefixCache::Commit(uint64_t hash) {
  --private_blocks_;
  auto [it, inserted] = blocks_.try_emplace(hash);
  Block& block = it->second;
  if (!inserted && block.references == 0) lru_.erase(block.lru_position);
  ++block.references;
  return inserted;
}

void PrefixCache::Release(std::span<const uint64_t> hashes, uint64_t private_count) {
  private_blocks_ -= private_count;
  // Last block first: a prompt's tail reaches the LRU head before its prefix does, so the
  // shared prefix survives longest.
  for (auto it = hashes.rbegin(); it != hashes.rend(); ++it) {
    Block& block = blocks_.at(*it);
    if (--block.references == 0) block.lru_position = lru_.insert(lru_.end(), *it);
  }
}

size_t HostPool::MatchPrefix(std::span<const uint64_t> hashes) const {
  size_t hits = 0;
  while (hits < hashes.size() && positions_.contains(hashes[hits])) ++hits;
  return hits;
}

void HostPool::Offload(std::span<const uint64_t> hashes, std::vector<uint64_t>& added,
                       std::vector<uint64_t>& evicted) {
  if (capacity_ == 0) return;
  for (uint64_t hash : hashes) {
    if (auto it = positions_.find(hash); it != positions_.end()) {
      lru_.splice(lru_.end(), lru_, it->second);
      continue;
    }
    if (positions_.size() == capacity_) {
      evicted.push_back(lru_.front());
      positions_.erase(lru_.front());
      lru_.pop_front();
    }
    positions_[hash] = lru_.insert(lru_.end(), hash);
    added.push_back(hash);
  }
}

void HostPool::Touch(std::span<const uint64_t> hashes) {
  for (uint64_t hash : hashes) lru_.splice(lru_.end(), lru_, positions_.at(hash));
}

std::vector<uint64_t> PrefixCache::CachedHashes() const {
  std::vector<uint64_t> hashes;
  hashes.reserve(blocks_.size());
  for (const auto& [hash, block] : blocks_) hashes.push_back(hash);
  std::sort(hashes.begin(), hashes.end());
  return hashes;
}

}  // namespace kvrouter::replay
