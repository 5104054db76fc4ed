#include "core/approx_index.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <utility>

#include "core/fail_safe_map.h"
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

// One routing decision: the worker was sent a prompt whose last block was `tail`. It keeps the
// whole path from the root to its tail alive until it expires; taking it apart moves the tail
// up. No copy of the path is kept: it is rebuilt from the tree when needed (PathOf).
struct Decision {
  WorkerKey worker;
  Nanos expiry;
  uint64_t tail;        // engine hash of its deepest block still to go; until started, also
                        // its key among the endpoints (the prompt's last block)
  uint32_t depth;       // blocks on its path still to be taken apart: the tail's depth
  uint32_t prev, next;  // neighbours in recording order (kNone at the ends); a free slot's
                        // `next` is the next free slot
  bool started;         // expiry or pruning has begun taking the path apart
};

// The live decisions in recording order, which is expiry order (one TTL, a monotonic clock):
// a doubly linked list over a slab, so that a decision superseded anywhere in it leaves in
// O(1). Free slots are chained through `next`, so that erasing never allocates; the slab is
// given back whenever the list empties.
class DecisionList {
 public:
  bool empty() const { return head_ == kNone; }
  size_t size() const { return size_; }
  uint32_t front() const { return head_; }
  uint32_t next(uint32_t slot) const { return slots_[slot].next; }
  Decision& operator[](uint32_t slot) { return slots_[slot]; }
  const Decision& operator[](uint32_t slot) const { return slots_[slot]; }

  // Room for one more: the next PushBack allocates nothing. Throws std::bad_alloc, the list
  // unchanged, if the heap refuses a larger slab.
  void ReserveOne() {
    if (free_ == kNone && slots_.size() == slots_.capacity()) {
      slots_.reserve(std::max<size_t>(16, 2 * slots_.size()));
    }
  }

  uint32_t PushBack(const Decision& d) {
    uint32_t slot;
    if (free_ != kNone) {
      slot = free_;
      free_ = slots_[slot].next;
      slots_[slot] = d;
    } else {
      slot = static_cast<uint32_t>(slots_.size());
      slots_.push_back(d);
    }
    slots_[slot].prev = tail_;
    slots_[slot].next = kNone;
    (tail_ == kNone ? head_ : slots_[tail_].next) = slot;
    tail_ = slot;
    ++size_;
    return slot;
  }

  void Erase(uint32_t slot) {
    Decision& d = slots_[slot];
    (d.prev == kNone ? head_ : slots_[d.prev].next) = d.next;
    (d.next == kNone ? tail_ : slots_[d.next].prev) = d.prev;
    --size_;
    if (size_ == 0) {
      slots_ = {};
      free_ = kNone;
    } else {
      d.next = free_;
      free_ = slot;
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
  uint32_t free_ = kNone;
  uint32_t head_ = kNone, tail_ = kNone;
  size_t size_ = 0;
};

// Per worker, the live decisions not yet started, by their last block (engine hash): each one's
// slot in the DecisionList + 1 (table values are never 0). A table per worker keeps the
// lookups of one path taken apart in one small table (one table for all workers, keyed by
// worker and block, made a pruning decision 1.12-1.15x slower at the median in
// bench/router_bench's BM_FindBestMatchApprox/budget:65536: its lookups missed the cache). The
// workers' tables are found through a FailSafeMap: absl::flat_hash_map corrupts itself when
// the heap refuses its growth.
class EndpointTables {
 public:
  EndpointTables() = default;
  ~EndpointTables() {
    tables_.ForEach([](WorkerKey, PositionTable* table) { delete table; });
  }
  EndpointTables(const EndpointTables&) = delete;
  EndpointTables& operator=(const EndpointTables&) = delete;

  PositionTable* Find(WorkerKey worker) const {
    PositionTable* const* table = tables_.Find(worker);
    return table == nullptr ? nullptr : *table;
  }

  // The worker's table, a new empty one if it has none. Throws std::bad_alloc with nothing
  // changed.
  PositionTable& Get(WorkerKey worker) {
    if (PositionTable* table = Find(worker)) return *table;
    tables_.Reserve(tables_.size() + 1);
    auto table = std::make_unique<PositionTable>(&bytes_);
    tables_.Set(worker, table.get());  // allocates nothing after the Reserve
    return *table.release();
  }

  // Drops the tables of the workers `pred` is true for. Allocates nothing.
  template <typename Pred>
  void EraseIf(Pred&& pred) {
    tables_.EraseIf([&](WorkerKey worker, PositionTable* table) {
      if (!pred(worker)) return false;
      delete table;
      return true;
    });
    tables_.ShrinkIfMostlyEmpty(0);
  }

  size_t entries() const {
    size_t n = 0;
    tables_.ForEach([&](WorkerKey, const PositionTable* table) { n += table->size(); });
    return n;
  }

 private:
  FailSafeMap<WorkerKey, PositionTable*> tables_;
  int64_t bytes_ = 0;  // what the tables hold
};

}  // namespace

// The index holds, per worker, the union of the paths of its live decisions, so a block stays
// as long as the latest decision through it: what per-block TTLs would keep, with no per-block
// bookkeeping. Recording a decision costs a binary search for the prefix the worker holds
// (O(log n) lookups), the store of the blocks it lacks, and one lease: the endpoint table maps
// each decision's last block (per worker) to the latest decision ending there, so a prompt
// recorded again supersedes its earlier decision instead of adding one. Taking a decision
// apart (expiry, or pruning, earliest expiry first) walks its path up from the end and drops
// blocks until one is still in use: another live decision's endpoint, or a block with another
// held block below it. Among decisions with one expiry the deepest blocks go first.
//
// Running out of memory (see the header): what a decision needs is taken before the index
// changes (its slab slot, its worker's endpoint table, room to rebuild its path), so once the
// store is in nothing can fail (but its endpoint's entry, which it can do without); taking
// decisions apart allocates nothing of its own.
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
    if (n > 0) {
      try {
        RecordLocked(worker, local_hashes.first(n), sequence_hashes.first(n), now);
      } catch (...) {
        PublishNextExpiry();  // expiry may have moved the front
        throw;
      }
    }
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

  // The index first: it allocates before it changes anything, so a refusal leaves both as
  // they were. Nothing after it allocates.
  size_t RemoveWorker(uint64_t worker_id) {
    std::lock_guard lock(mu_);
    const size_t dropped = index_.RemoveWorker(worker_id);
    endpoints_.EraseIf([&](WorkerKey w) { return w.worker_id == worker_id; });
    decisions_.EraseIf([&](const Decision& d) { return d.worker.worker_id == worker_id; });
    ReleaseSpare();
    PublishNextExpiry();
    return dropped;
  }

  size_t RemoveWorkerDpRank(WorkerKey worker) {
    std::lock_guard lock(mu_);
    const size_t dropped = index_.RemoveWorkerDpRank(worker);
    endpoints_.EraseIf([&](WorkerKey w) { return w == worker; });
    decisions_.EraseIf([&](const Decision& d) { return d.worker == worker; });
    ReleaseSpare();
    PublishNextExpiry();
    return dropped;
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

  std::string CheckInvariants() const;

 private:
  void RecordLocked(WorkerKey worker, std::span<const uint64_t> local_hashes,
                    std::span<const uint64_t> sequence_hashes, Nanos now) {
    const size_t n = sequence_hashes.size();
    // What may be refused, before the index changes: once the blocks are stored, a decision
    // must cover them, or they would never expire.
    decisions_.ReserveOne();
    PositionTable& endpoints = endpoints_.Get(worker);
    if (path_.capacity() < n) path_.reserve(n);  // no path is longer than its prompt
    size_t depth = n;
    const size_t held = index_.HeldPrefix(worker, sequence_hashes);
    if (held < n) {
      StoredEvent stored;
      if (held > 0) stored.parent_hash = sequence_hashes[held - 1];
      stored.block_hashes.assign(sequence_hashes.begin() + held, sequence_hashes.end());
      stored.local_hashes.assign(local_hashes.begin() + held, local_hashes.end());
      // Refused midway, the store leaves the worker holding nothing and throws: its earlier
      // decisions then cover nothing, and end as they come up for expiry.
      if (!index_.Apply(KvEvent{.worker = worker, .data = std::move(stored)}).ok()) {
        depth = index_.HeldPrefix(worker, sequence_hashes);  // keep what was stored covered
        if (depth == 0) return;
      }
    }
    AddDecision(worker, endpoints, sequence_hashes[depth - 1], depth, now);
  }

  // Never throws, after RecordLocked's reservations: if the heap refuses the endpoint's entry
  // the decision goes in without one (see the header).
  void AddDecision(WorkerKey worker, PositionTable& endpoints, uint64_t endpoint, size_t depth,
                   Nanos now) {
    const uint32_t slot = decisions_.PushBack(Decision{.worker = worker,
                                                       .expiry = now + ttl_,
                                                       .tail = endpoint,
                                                       .depth = static_cast<uint32_t>(depth),
                                                       .prev = kNone,
                                                       .next = kNone,
                                                       .started = false});
    uint64_t previous = 0;
    try {
      previous = endpoints.Exchange(endpoint, uint64_t{slot} + 1);
    } catch (const std::bad_alloc&) {
      // As if already started: it supersedes no decision, and an earlier decision's expiry
      // may drop its blocks; what is left of them goes at its own.
      decisions_[slot].started = true;
      return;
    }
    if (previous != 0) decisions_.Erase(static_cast<uint32_t>(previous - 1));  // superseded
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
    ReleaseSpare();
    return dropped;
  }

  // Drops up to `limit` of the decision's deepest blocks not in use by another; returns how
  // many. Its depth becomes 0 once nothing more of it can go. Never throws: it allocates
  // nothing but the index's splits, and a split the heap refuses leaves the worker holding
  // nothing (RadixIndex::DropPathTail, counted in IndexStats::refused_events), which ends
  // this decision too.
  size_t TakeApart(Decision& d, size_t limit) {
    const std::span<const uint64_t> path = PathOf(d);
    PositionTable* endpoints = endpoints_.Find(d.worker);
    if (!d.started) {
      d.started = true;
      if (endpoints != nullptr) endpoints->Erase(d.tail);  // its own: not in use for itself
    }
    const auto in_use = [&](uint64_t block) {
      return endpoints != nullptr && endpoints->Contains(block);
    };
    RadixIndex::TailDrop drop;
    try {
      drop = index_.DropPathTail(d.worker, path, limit, in_use);
    } catch (const std::bad_alloc&) {
      d.depth = 0;
      return 0;
    }
    d.depth = drop.finished ? 0 : static_cast<uint32_t>(path.size() - drop.dropped);
    if (d.depth > 0) d.tail = path[d.depth - 1];
    return drop.dropped;
  }

  // The engine (sequence) hashes of the decision's path, root first, down to its tail; empty
  // if the worker no longer holds its tail. path_ keeps the path taken apart last, which is
  // usually this decision's (resumed by the next call) or shares its prefix: a chain's hash
  // names its whole prefix, so a match at the tail's depth is the path. Otherwise it is
  // rebuilt from the tree into path_, which never needs the heap for it: its capacity was
  // reserved for the longest prompt recorded, the tree holds nothing deeper, and it is given
  // back only when no decision is left (so no block either).
  std::span<const uint64_t> PathOf(const Decision& d) {
    if (d.depth > 0 && d.depth <= path_.size() && path_[d.depth - 1] == d.tail) {
      return std::span<const uint64_t>(path_).first(d.depth);
    }
    index_.PathTo(d.worker, d.tail, path_);  // local hashes
    for (size_t k = 1; k < path_.size(); ++k) path_[k] = NextSequenceHash(path_[k - 1], path_[k]);
    return path_;
  }

  size_t ExpireLocked(Nanos now, size_t limit) {
    const size_t expired =
        DropFromFront(limit, [&](const Decision& front) { return front.expiry <= now; });
    expired_ += expired;
    return expired;
  }

  // Prunes toward the target, at most `limit` blocks now. A prune to 80 % of a large budget is
  // hundreds of thousands of removals; done at once it would stall the routing decision that
  // triggered it, so it is spread over the next decisions. Each decision prunes a quarter
  // more than it records (DropStep), so the index still shrinks to the target and never grows
  // past the budget by more than one prompt.
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

  // Gives back what the live decisions no longer need (nothing here fails).
  void ReleaseSpare() {
    if (decisions_.empty()) path_ = {};
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
  EndpointTables endpoints_;
  DecisionList decisions_;
  std::vector<uint64_t> path_;  // PathOf's: a path's engine hashes, root first
  std::atomic<Nanos> next_expiry_{kNever};
  uint64_t expired_ = 0;
  uint64_t pruned_ = 0;
  bool pruning_ = false;  // over budget: keep pruning toward the target on every decision
};

// Walks everything, allocating as it likes (tests only).
std::string ApproxIndex::Impl::CheckInvariants() const {
  std::lock_guard lock(mu_);
  if (std::string broken = index_.CheckInvariants(); !broken.empty()) return "index: " + broken;
  // The list: links both ways, its size, expiry order; each decision not yet started is its
  // endpoint's entry, and the entries are those.
  size_t listed = 0, waiting = 0;
  std::map<WorkerKey, std::set<uint64_t>> covered;
  for (uint32_t prev = kNone, slot = decisions_.front(); slot != kNone;
       prev = slot, slot = decisions_.next(slot)) {
    const Decision& d = decisions_[slot];
    if (d.prev != prev) return "the decisions' links are broken";
    if (prev != kNone && decisions_[prev].expiry > d.expiry) return "decisions out of order";
    if (++listed > decisions_.size()) return "more decisions listed than counted";
    if (d.depth == 0) return "a finished decision is still listed";
    if (!d.started) {
      ++waiting;
      const PositionTable* endpoints = endpoints_.Find(d.worker);
      if (endpoints == nullptr || endpoints->Get(d.tail) != uint64_t{slot} + 1) {
        return "a decision is not its endpoint's entry";
      }
    }
    // What it keeps alive: the path to its tail, if the worker still holds that.
    const std::vector<uint64_t> path = ComputeSequenceHashes(index_.PathTo(d.worker, d.tail));
    if (path.empty()) continue;
    if (path.size() != d.depth) {
      return "a decision's depth " + std::to_string(d.depth) + " is not its tail's, " +
             std::to_string(path.size());
    }
    covered[d.worker].insert(path.begin(), path.end());
  }
  if (listed != decisions_.size()) return "fewer decisions listed than counted";
  if (waiting != endpoints_.entries()) return "endpoint entries without their decision";
  // Every block a worker holds is on the path of one of its live decisions, so it expires.
  for (WorkerKey w : index_.Workers()) {
    const std::set<uint64_t>& blocks = covered[w];
    for (uint64_t block : blocks) {
      if (index_.HeldPrefix(w, std::span(&block, 1)) != 1) {
        return "worker " + std::to_string(w.worker_id) + " lacks a block a decision keeps";
      }
    }
    if (index_.TreeSize(w) != blocks.size()) {
      return "worker " + std::to_string(w.worker_id) + "." + std::to_string(w.dp_rank) + " holds " +
             std::to_string(index_.TreeSize(w)) + " blocks, its live decisions " +
             std::to_string(blocks.size());
    }
  }
  return "";
}

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
std::string ApproxIndex::CheckInvariants() const { return impl_->CheckInvariants(); }

}  // namespace kvrouter
