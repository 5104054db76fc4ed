#include "core/approx_index.h"

#include <absl/container/flat_hash_map.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <mutex>

namespace kvrouter {
namespace {

struct BlockKey {
  WorkerKey worker;
  uint64_t sequence_hash;
  friend bool operator==(const BlockKey&, const BlockKey&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const BlockKey& k) {
    return H::combine(std::move(h), k.worker, k.sequence_hash);
  }
};

struct Lease {
  Nanos expiry;
  uint32_t position;  // block index in its prompt: deeper blocks are pruned first
};

struct HeapEntry {
  Nanos expiry;
  uint32_t position;
  BlockKey key;
};

// Orders the heap so its top is the block to drop first: earliest expiry, then deepest.
struct DropsLater {
  bool operator()(const HeapEntry& a, const HeapEntry& b) const {
    if (a.expiry != b.expiry) return a.expiry > b.expiry;
    return a.position < b.position;
  }
};

constexpr Nanos kNever = std::numeric_limits<Nanos>::max();

// Size pruning is spread over decisions: each prunes at least this many blocks, or this many
// times the blocks it records, whichever is more.
constexpr size_t kMinPruneStep = 4096;
constexpr size_t kPruneStepsPerBlock = 4;

}  // namespace

class ApproxIndex::Impl {
 public:
  Impl(ApproxIndexOptions options, const Clock& clock)
      : options_(options),
        clock_(clock),
        ttl_(SecondsToNanos(options.ttl_seconds)),
        index_(RadixIndexOptions{.block_size = options.block_size}) {}

  void Record(WorkerKey worker, std::span<const uint64_t> local_hashes,
              std::span<const uint64_t> sequence_hashes) {
    const size_t n = std::min(local_hashes.size(), sequence_hashes.size());
    std::lock_guard lock(mu_);
    const Nanos now = clock_.Now();
    ExpireLocked(now);
    StoreUntracked(worker, local_hashes.first(n), sequence_hashes.first(n));
    for (size_t i = 0; i < n; ++i) {
      const BlockKey key{worker, sequence_hashes[i]};
      leases_[key] = Lease{now + ttl_, static_cast<uint32_t>(i)};
      heap_.push_back(HeapEntry{now + ttl_, static_cast<uint32_t>(i), key});
      std::push_heap(heap_.begin(), heap_.end(), DropsLater());
    }
    if (leases_.size() > options_.max_blocks) pruning_ = true;
    if (pruning_) PruneLocked(std::max<size_t>(kMinPruneStep, kPruneStepsPerBlock * n));
    CompactHeapIfStale();
    PublishNextExpiry();
  }

  void FindMatches(std::span<const uint64_t> local_hashes, std::vector<WorkerMatch>& out) {
    if (clock_.Now() >= next_expiry_.load(std::memory_order_acquire)) ExpireDue();
    index_.FindMatches(local_hashes, out);
  }

  size_t ExpireDue() {
    std::lock_guard lock(mu_);
    const size_t expired = ExpireLocked(clock_.Now());
    PublishNextExpiry();
    return expired;
  }

  size_t RemoveWorker(uint64_t worker_id) {
    std::lock_guard lock(mu_);
    absl::erase_if(leases_, [&](const auto& kv) { return kv.first.worker.worker_id == worker_id; });
    return index_.RemoveWorker(worker_id);
  }

  size_t RemoveWorkerDpRank(WorkerKey worker) {
    std::lock_guard lock(mu_);
    absl::erase_if(leases_, [&](const auto& kv) { return kv.first.worker == worker; });
    return index_.RemoveWorkerDpRank(worker);
  }

  ApproxIndexStats Stats() const {
    std::lock_guard lock(mu_);
    return ApproxIndexStats{.tracked_blocks = leases_.size(),
                            .expired_blocks = expired_,
                            .pruned_blocks = pruned_,
                            .index = index_.Stats()};
  }

  const RadixIndex& index() const { return index_; }

 private:
  // Stores the prompt's blocks from the first one this worker does not hold yet; the blocks
  // before it are in the index already and serve as its parent.
  void StoreUntracked(WorkerKey worker, std::span<const uint64_t> local_hashes,
                      std::span<const uint64_t> sequence_hashes) {
    size_t first = 0;
    while (first < sequence_hashes.size() &&
           leases_.contains(BlockKey{worker, sequence_hashes[first]})) {
      ++first;
    }
    if (first == sequence_hashes.size()) return;
    StoredEvent stored;
    if (first > 0) stored.parent_hash = sequence_hashes[first - 1];
    stored.block_hashes.assign(sequence_hashes.begin() + first, sequence_hashes.end());
    stored.local_hashes.assign(local_hashes.begin() + first, local_hashes.end());
    index_.Apply(KvEvent{.worker = worker, .data = std::move(stored)});
  }

  // Pops the heap's top while it is stale (its block was re-recorded or removed since).
  bool TopIsLive() {
    while (!heap_.empty()) {
      const HeapEntry& top = heap_.front();
      auto it = leases_.find(top.key);
      if (it != leases_.end() && it->second.expiry == top.expiry &&
          it->second.position == top.position) {
        return true;
      }
      std::pop_heap(heap_.begin(), heap_.end(), DropsLater());
      heap_.pop_back();
    }
    return false;
  }

  // Drops the top block; the caller batches the index removals per worker.
  void DropTop(absl::flat_hash_map<WorkerKey, std::vector<uint64_t>>& removals) {
    const BlockKey key = heap_.front().key;
    std::pop_heap(heap_.begin(), heap_.end(), DropsLater());
    heap_.pop_back();
    leases_.erase(key);
    removals[key.worker].push_back(key.sequence_hash);
  }

  void ApplyRemovals(absl::flat_hash_map<WorkerKey, std::vector<uint64_t>>& removals) {
    for (auto& [worker, hashes] : removals) {
      index_.Apply(KvEvent{.worker = worker, .data = RemovedEvent{std::move(hashes)}});
    }
  }

  size_t ExpireLocked(Nanos now) {
    absl::flat_hash_map<WorkerKey, std::vector<uint64_t>> removals;
    size_t expired = 0;
    while (TopIsLive() && heap_.front().expiry <= now) {
      DropTop(removals);
      ++expired;
    }
    ApplyRemovals(removals);
    expired_ += expired;
    return expired;
  }

  // Prunes toward the target, at most `limit` blocks now. A prune to 80 % of a large budget
  // is hundreds of thousands of removals; done at once it would stall every routing decision
  // behind the router's gate for tens of milliseconds, so it is spread over the next
  // decisions. Each decision prunes several times what it records, so the index still shrinks
  // to the target within a few decisions and never grows past the budget by more than one
  // prompt.
  void PruneLocked(size_t limit) {
    const auto target = static_cast<uint64_t>(static_cast<double>(options_.max_blocks) *
                                              options_.prune_target_ratio);
    absl::flat_hash_map<WorkerKey, std::vector<uint64_t>> removals;
    size_t dropped = 0;
    while (leases_.size() > target && dropped < limit && TopIsLive()) {
      DropTop(removals);
      ++dropped;
    }
    pruned_ += dropped;
    pruning_ = leases_.size() > target;
    ApplyRemovals(removals);
  }

  // Re-recorded blocks leave stale heap entries behind; rebuild before they dominate.
  void CompactHeapIfStale() {
    if (heap_.size() <= 2 * leases_.size() + 1024) return;
    heap_.clear();
    for (const auto& [key, lease] : leases_) {
      heap_.push_back(HeapEntry{lease.expiry, lease.position, key});
    }
    std::make_heap(heap_.begin(), heap_.end(), DropsLater());
  }

  void PublishNextExpiry() {
    next_expiry_.store(TopIsLive() ? heap_.front().expiry : kNever, std::memory_order_release);
  }

  const ApproxIndexOptions options_;
  const Clock& clock_;
  const Nanos ttl_;
  RadixIndex index_;
  mutable std::mutex mu_;  // guards everything below; the index has its own lock
  absl::flat_hash_map<BlockKey, Lease> leases_;
  std::vector<HeapEntry> heap_;
  std::atomic<Nanos> next_expiry_{kNever};
  uint64_t expired_ = 0;
  uint64_t pruned_ = 0;
  bool pruning_ = false;  // over budget: keep pruning toward the target on every decision
};

ApproxIndex::ApproxIndex(ApproxIndexOptions options, const Clock& clock)
    : impl_(std::make_unique<Impl>(options, clock)) {}
ApproxIndex::~ApproxIndex() = default;
void ApproxIndex::RecordRoutingDecision(WorkerKey worker, std::span<const uint64_t> local_hashes,
                                        std::span<const uint64_t> sequence_hashes) {
  impl_->Record(worker, local_hashes, sequence_hashes);
}
void ApproxIndex::FindMatches(std::span<const uint64_t> local_hashes,
                              std::vector<WorkerMatch>& out) {
  impl_->FindMatches(local_hashes, out);
}
size_t ApproxIndex::ExpireDue() { return impl_->ExpireDue(); }
size_t ApproxIndex::RemoveWorker(uint64_t worker_id) { return impl_->RemoveWorker(worker_id); }
size_t ApproxIndex::RemoveWorkerDpRank(WorkerKey worker) {
  return impl_->RemoveWorkerDpRank(worker);
}
ApproxIndexStats ApproxIndex::Stats() const { return impl_->Stats(); }
const RadixIndex& ApproxIndex::index() const { return impl_->index(); }

}  // namespace kvrouter
