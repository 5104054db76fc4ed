// One simulated worker's KV cache: a fixed number of blocks with prefix caching and LRU eviction,
// in the manner of vLLM's block pool.
//
// A block is either private (allocated to a running request: a block being prefilled, the partial
// last block of a prompt, or room reserved for the output) or cached (a full prompt block whose
// KV has been computed, known by its engine hash). Cached blocks carry a reference count: the
// running requests using them. Unreferenced cached blocks stay in the cache (that is what makes a
// later prefix hit possible) on an LRU list, and are evicted from its head when a request needs
// room. A request releases its blocks last-first, so a prompt's tail is evicted before its head,
// as in vLLM's free-block queue.
//
// The cache reports what it stores and evicts to the caller, which turns it into the KV events a
// vLLM engine publishes (BlockStored, BlockRemoved).
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace kvrouter::replay {

class PrefixCache {
 public:
  explicit PrefixCache(uint64_t capacity_blocks);

  uint64_t capacity() const { return capacity_; }
  uint64_t cached_blocks() const { return blocks_.size(); }
  uint64_t private_blocks() const { return private_blocks_; }
  uint64_t evictable_blocks() const { return lru_.size(); }
  uint64_t free_blocks() const { return capacity_ - cached_blocks() - private_blocks_; }
  bool Contains(uint64_t hash) const { return blocks_.contains(hash); }

  // How many leading hashes of a prompt are cached (a prefix hit stops at the first miss).
  size_t MatchPrefix(std::span<const uint64_t> hashes) const;

  // Takes a reference on each hash (all must be cached), taking unreferenced ones off the LRU.
  void Acquire(std::span<const uint64_t> hashes);

  // Whether `count` private blocks fit once every unreferenced cached block is evicted.
  bool CanAllocate(uint64_t count) const { return free_blocks() + evictable_blocks() >= count; }

  // Whether a request can take references on its prefix hits `hits` (all cached) and then
  // allocate `count` private blocks. Hits nobody references yet leave the evictable pool when
  // acquired, so they cannot also be evicted to make the request's room.
  bool CanAdmit(std::span<const uint64_t> hits, uint64_t count) const;

  // Allocates `count` private blocks, evicting least recently used unreferenced blocks as needed;
  // the evicted hashes are appended to `evicted`, oldest first. Requires CanAllocate(count).
  void AllocatePrivate(uint64_t count, std::vector<uint64_t>& evicted);

  // A private block now holds the computed KV of the full block `hash`. Returns true if the block
  // joins the cache (newly stored: publish it), false if another request cached the same block
  // meanwhile (the copy is dropped and the existing block referenced instead).
  bool Commit(uint64_t hash);

  // A request ends: drops its reference on `hashes` (last first) and frees `private_count`
  // private blocks. Blocks nobody references any more become evictable.
  void Release(std::span<const uint64_t> hashes, uint64_t private_count);

  // Every cached hash, sorted (for tests and checks).
  std::vector<uint64_t> CachedHashes() const;
  // The LRU order of unreferenced blocks, next victim first (for tests).
  std::vector<uint64_t> EvictionOrder() const { return {lru_.begin(), lru_.end()}; }

 private:
  struct Block {
    uint32_t references = 0;
    std::list<uint64_t>::iterator lru_position;  // valid when references == 0
  };

  const uint64_t capacity_;
  uint64_t private_blocks_ = 0;
  absl::flat_hash_map<uint64_t, Block> blocks_;
  std::list<uint64_t> lru_;  // unreferenced cached blocks, least recently used first
};

// The host-memory tier of one worker: blocks evicted from the device are offloaded here (a
// fixed number of blocks, LRU). A prompt whose device prefix hit stops at a block the host holds
// reloads the blocks that continue it from here instead of recomputing them.
class HostPool {
 public:
  explicit HostPool(uint64_t capacity_blocks) : capacity_(capacity_blocks) {}

  uint64_t capacity() const { return capacity_; }
  uint64_t size() const { return positions_.size(); }
  bool Contains(uint64_t hash) const { return positions_.contains(hash); }

  // How many leading hashes the pool holds.
  size_t MatchPrefix(std::span<const uint64_t> hashes) const;

  // Offloads `hashes` (just evicted from the device), making each the most recently used; the
  // ones not held before are appended to `added` and the ones evicted for room to `evicted`, in
  // order (a block of `hashes` can be in both when they outnumber the capacity).
  void Offload(std::span<const uint64_t> hashes, std::vector<uint64_t>& added,
               std::vector<uint64_t>& evicted);

  // Marks `hashes` (all held) most recently used: they were just reloaded.
  void Touch(std::span<const uint64_t> hashes);

 private:
  const uint64_t capacity_;
  std::list<uint64_t> lru_;  // least recently used first
  absl::flat_hash_map<uint64_t, std::list<uint64_t>::iterator> positions_;
};

}  // namespace kvrouter::replay
