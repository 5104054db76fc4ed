#include "core/approx_index.h"

#include <absl/container/flat_hash_map.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <limits>
#include <mutex>

#include "core/hashing.h"
#include "core/position_table.h"

namespace kvrouter {
namespace {

constexpr Nanos kNever = std::numeric_limits<Nanos>::max();

// Expiry and size pruning are spread over calls: each drops at most this many blocks, or a
// quarter more than the blocks it records, whichever is more (ExpireDue, called while idle,
// drops all). A quarter more: pruning outpaces any stream of decisions, yet a decision never
// pays for much more than its own blocks.
constexpr size_t kMinDropStep = 256;
size_t DropStep(size_t recorded_blocks) {
  return std::max(kMinDropStep, recorded_blocks + recorded_blocks / 4);
}

constexpr uint32_t kNone = ~0u;

// One routing decision: the worker was sent a prompt whose last block is `endpoint`. It keeps
// the whole path from the root to that block alive until it expires.
struct Decision {
  WorkerKey worker;
  Nanos expiry;
  uint64_t endpoint;    // the prompt's last sequence hash (the block's engine hash)
  uint32_t depth;       // blocks on its path still to be taken apart (the prompt's, at first)
  uint32_t prev, next;  // neighbours in recording order (kNone at the ends)
  bool started;         // expiry or pruning has begun taking the path apart
  std::vector<uint64_t> path;  // its engine hashes, root first, once started
};

// The live decisions in recording order, which is expiry order (one TTL, a monotonic clock):
// a doubly linked list over a slab, so that a decision superseded anywhere in it leaves in
// O(1). Slots are reused; the slab is given back whenever the list empties.
class DecisionList {
 public:
  bool empty() const { return head_ == kNone; }
  size_t size() const { return size_; }
  uint32_t front() const { return head_; }
  uint32_t next(uint32_t slot) const { return slots_[slot].next; }
  Decision& operator[](uint32_t slot) { return slots_[slot]; }
  const Decision& operator[](uint32_t slot) const { return slots_[slot]; }

  uint32_t PushBack(Decision d) {
    d.prev = tail_;
    d.next = kNone;
    uint32_t slot;
    if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
      slots_[slot] = std::move(d);
    } else {
      slot = static_cast<uint32_t>(slots_.size());
      slots_.push_back(std::move(d));
    }
    (tail_ == kNone ? head_ : slots_[tail_].next) = slot;
    tail_ = slot;
    ++size_;
    return slot;
  }

  void Erase(uint32_t slot) {
    Decision& d = slots_[slot];
    (d.prev == kNone ? head_ : slots_[d.prev].next) = d.next;
    (d.next == kNone ? tail_ : slots_[d.next].prev) = d.prev;
    d.path = {};
    --size_;
    if (size_ == 0) {
      slots_ = {};
      free_ = {};
    } else {
      free_.push_back(slot);
    }
  }

  template <typename Pred>
  void EraseIf(Pred&& pred) {
    for (uint32_t slot = head_; slot != kNone;) {
      const uint32_t next = slots_[slot].next;
      if (pred(slots_[slot])) Erase(slot);
      slot = next;
    }
  }

 private:
  std::vector<Decision> slots_;
  std::vector<uint32_t> free_;
  uint32_t head_ = kNone, tail_ = kNone;
  size_t size_ = 0;
};

}  // namespace

// The index holds, per worker, the union of the paths of its live decisions, so a block stays
// as long as the latest decision through it: what per-block TTLs would keep, with no per-block
// bookkeeping. Recording a decision costs a binary search for the prefix the worker holds
// (O(log n) lookups), the store of the blocks it lacks, and one lease: the worker's endpoint
// table maps each decision's last block to the latest decision ending there, so a prompt
// recorded again supersedes its earlier decision instead of adding one. Taking a decision
// apart (expiry, or pruning, earliest expiry first) walks its path up from the end and drops
// blocks until one is still in use: another live decision's endpoint, or a block with another
// held block below it. Among decisions with one expiry the deepest blocks go first.
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
    const size_t step = DropStep(n);
    ExpireLocked(now, step);
    if (n > 0) RecordLocked(worker, local_hashes.first(n), sequence_hashes.first(n), now);
    if (index_.CachedBlocks() > options_.max_blocks) pruning_ = true;
    if (pruning_) PruneLocked(step);
    PublishNextExpiry();
  }

  void FindMatches(std::span<const uint64_t> local_hashes, std::vector<WorkerMatch>& out) {
    if (clock_.Now() >= next_expiry_.load(std::memory_order_acquire)) {
      std::lock_guard lock(mu_);
      ExpireLocked(clock_.Now(), kMinDropStep);
      PublishNextExpiry();
    }
    index_.FindMatches(local_hashes, out);
  }

  size_t ExpireDue() {
    std::lock_guard lock(mu_);
    const size_t expired = ExpireLocked(clock_.Now(), std::numeric_limits<size_t>::max());
    PublishNextExpiry();
    return expired;
  }

  size_t RemoveWorker(uint64_t worker_id) {
    std::lock_guard lock(mu_);
    for (auto it = endpoints_.begin(); it != endpoints_.end();) {
      auto here = it++;
      if (here->first.worker_id == worker_id) endpoints_.erase(here);
    }
    decisions_.EraseIf([&](const Decision& d) { return d.worker.worker_id == worker_id; });
    PublishNextExpiry();
    return index_.RemoveWorker(worker_id);
  }

  size_t RemoveWorkerDpRank(WorkerKey worker) {
    std::lock_guard lock(mu_);
    endpoints_.erase(worker);
    decisions_.EraseIf([&](const Decision& d) { return d.worker == worker; });
    PublishNextExpiry();
    return index_.RemoveWorkerDpRank(worker);
  }

  ApproxIndexStats Stats() const {
    std::lock_guard lock(mu_);
    return ApproxIndexStats{.tracked_blocks = index_.CachedBlocks(),
                            .expired_blocks = expired_,
                            .pruned_blocks = pruned_,
                            .decisions = decisions_.size(),
                            .index = index_.Stats()};
  }

  const RadixIndex& index() const { return index_; }

 private:
  void RecordLocked(WorkerKey worker, std::span<const uint64_t> local_hashes,
                    std::span<const uint64_t> sequence_hashes, Nanos now) {
    size_t depth = sequence_hashes.size();
    const size_t held = index_.HeldPrefix(worker, sequence_hashes);
    if (held < depth) {
      StoredEvent stored;
      if (held > 0) stored.parent_hash = sequence_hashes[held - 1];
      stored.block_hashes.assign(sequence_hashes.begin() + held, sequence_hashes.end());
      stored.local_hashes.assign(local_hashes.begin() + held, local_hashes.end());
      if (!index_.Apply(KvEvent{.worker = worker, .data = std::move(stored)}).ok()) {
        depth = index_.HeldPrefix(worker, sequence_hashes);  // keep what was stored covered
        if (depth == 0) return;
      }
    }
    const uint64_t endpoint = sequence_hashes[depth - 1];
    const uint32_t slot = decisions_.PushBack(Decision{.worker = worker,
                                                       .expiry = now + ttl_,
                                                       .endpoint = endpoint,
                                                       .depth = static_cast<uint32_t>(depth),
                                                       .prev = kNone,
                                                       .next = kNone,
                                                       .started = false,
                                                       .path = {}});
    PositionTable& endpoints = endpoints_.try_emplace(worker, &endpoint_bytes_).first->second;
    // Table values are never 0: slot + 1.
    if (const uint64_t previous = endpoints.Exchange(endpoint, uint64_t{slot} + 1)) {
      decisions_.Erase(static_cast<uint32_t>(previous - 1));  // superseded
    }
  }

  const PositionTable* EndpointsOf(WorkerKey worker) const {
    auto it = endpoints_.find(worker);
    return it == endpoints_.end() ? nullptr : &it->second;
  }

  // Drops up to `limit` blocks from the decisions at the front of the list, while `due()`
  // holds for the front one. Among the decisions sharing the front's expiry (several only
  // when recorded at one instant), the deepest path goes first, down to the next deepest.
  template <typename Due>
  size_t DropFromFront(size_t limit, Due&& due) {
    size_t dropped = 0;
    while (dropped < limit && !decisions_.empty() && due(decisions_[decisions_.front()])) {
      const Nanos expiry = decisions_[decisions_.front()].expiry;
      uint32_t deepest = kNone, next_depth = 0;
      for (uint32_t slot = decisions_.front(); slot != kNone && decisions_[slot].expiry == expiry;
           slot = decisions_.next(slot)) {
        const uint32_t depth = decisions_[slot].depth;
        if (deepest == kNone || depth > decisions_[deepest].depth) {
          if (deepest != kNone) next_depth = std::max(next_depth, decisions_[deepest].depth);
          deepest = slot;
        } else {
          next_depth = std::max(next_depth, depth);
        }
      }
      Decision& d = decisions_[deepest];
      const size_t step = std::max<size_t>(1, d.depth - next_depth);
      dropped += TakeApart(d, std::min(step, limit - dropped));
      if (d.depth == 0) decisions_.Erase(deepest);
    }
    return dropped;
  }

  // Drops up to `limit` of the decision's deepest blocks not in use by another; returns how
  // many. Its depth becomes 0 once nothing more of it can go.
  size_t TakeApart(Decision& d, size_t limit) {
    if (!d.started) {
      d.started = true;
      endpoints_.find(d.worker)->second.Erase(d.endpoint);
      ComputeSequenceHashesInto(index_.PathTo(d.worker, d.endpoint), d.path);
      d.depth = static_cast<uint32_t>(std::min<size_t>(d.depth, d.path.size()));
    }
    const PositionTable* endpoints = EndpointsOf(d.worker);
    const auto in_use = [&](uint64_t block) {
      return endpoints != nullptr && endpoints->Contains(block);
    };
    const RadixIndex::TailDrop drop =
        index_.DropPathTail(d.worker, std::span(d.path).first(d.depth), limit, in_use);
    d.depth = drop.finished ? 0 : d.depth - static_cast<uint32_t>(drop.dropped);
    return drop.dropped;
  }

  size_t ExpireLocked(Nanos now, size_t limit) {
    const size_t expired =
        DropFromFront(limit, [&](const Decision& front) { return front.expiry <= now; });
    expired_ += expired;
    return expired;
  }

  // Prunes toward the target, at most `limit` blocks now. A prune to 80 % of a large budget is
  // hundreds of thousands of removals; done at once it would stall the routing decision that
  // triggered it, so it is spread over the next decisions. Each decision prunes twice what it
  // records, so the index still shrinks to the target and never grows past the budget by
  // more than one prompt.
  void PruneLocked(size_t limit) {
    const auto target = static_cast<uint64_t>(static_cast<double>(options_.max_blocks) *
                                              options_.prune_target_ratio);
    const uint64_t tracked = index_.CachedBlocks();
    if (tracked > target) {
      pruned_ +=
          DropFromFront(std::min(limit, tracked - target), [](const Decision&) { return true; });
    }
    pruning_ = index_.CachedBlocks() > target;
  }

  void PublishNextExpiry() {
    next_expiry_.store(decisions_.empty() ? kNever : decisions_[decisions_.front()].expiry,
                       std::memory_order_release);
  }

  const ApproxIndexOptions options_;
  const Clock& clock_;
  const Nanos ttl_;
  RadixIndex index_;
  mutable std::mutex mu_;  // guards everything below; the index has its own lock
  int64_t endpoint_bytes_ = 0;
  // Per worker: each live decision's endpoint -> its slot in decisions_ + 1.
  absl::flat_hash_map<WorkerKey, PositionTable> endpoints_;
  DecisionList decisions_;
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
