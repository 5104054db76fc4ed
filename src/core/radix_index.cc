#include "core/radix_index.h"

#include <absl/container/inlined_vector.h>
#include <absl/hash/hash.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <mutex>
#include <new>
#include <string_view>
#include <type_traits>
#include <unordered_map>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "core/child_table.h"
#include "core/counting_allocator.h"
#include "core/hashing.h"
#include "core/position_table.h"
#include "core/prefetch.h"
#include "core/scalable_shared_mutex.h"
#include "core/shrink.h"
#include "core/slab_pool.h"
#include "core/sliding_windows.h"

namespace kvrouter {

namespace {

using NodeId = uint32_t;
constexpr NodeId kRoot = 0;
constexpr NodeId kNoNode = ~0u;
constexpr uint64_t kMaxNodes = uint64_t{1} << 31;
// Blocks in one node: offsets within a node take 16 bits of a position.
constexpr uint32_t kMaxRun = 1u << 15;
// How far ahead a pass over many blocks' table entries prefetches: enough to overlap the
// misses, few enough that the prefetches are still in cache when their turn comes.
constexpr size_t kPrefetchAhead = 16;
// How many hashes of a lookup's sweeps (the prompt's, a node's run) are prefetched up front:
// 4 KiB each, a 512-block prompt, well inside L1 with the node's.
constexpr size_t kSweepPrefetch = 512;

// For a pass over `keys` in order: at key k, prefetches the one kPrefetchAhead further on (at
// key 0, the first kPrefetchAhead as well).
void PrefetchAhead(const PositionTable& table, std::span<const uint64_t> keys, size_t k) {
  if (k == 0) {
    for (size_t j = 0; j < std::min(keys.size(), kPrefetchAhead); ++j) table.Prefetch(keys[j]);
  }
  if (k + kPrefetchAhead < keys.size()) table.Prefetch(keys[k + kPrefetchAhead]);
}

uint8_t TierBit(Tier tier) { return static_cast<uint8_t>(1u << static_cast<int>(tier)); }

// Messages are built with std::string, never absl::StrFormat, which cannot pass a
// std::bad_alloc on through Debian's libabsl (std::terminate). And an event must not fail for
// its message: if the heap refuses, the message is "out of memory" (short enough for
// std::string's inline buffer, so that needs no allocation).
void AppendPart(std::string& s, std::string_view part) { s += part; }
template <typename N>
requires std::is_integral_v<N>
void AppendPart(std::string& s, N n) { s += std::to_string(n); }
template <typename... Parts>
std::string Message(const Parts&... parts) {
  try {
    std::string s;
    (AppendPart(s, parts), ...);
    return s;
  } catch (const std::bad_alloc&) {
    return "out of memory";
  }
}

// ---- Membership of one worker rank in one node ---------------------------------------------
// One 64-bit word: the worker's slot in the high half, then one byte per tier counting the
// worker's engine blocks that name this node on that tier (almost always 0 or 1). Sorting the
// words sorts by slot, and two nodes with equal member words answer a match identically.
using Member = uint64_t;

uint32_t MemberSlot(Member m) { return static_cast<uint32_t>(m >> 32); }
Member NewMember(uint32_t slot) { return static_cast<uint64_t>(slot) << 32; }

uint8_t MemberTiers(Member m) {
  uint8_t bits = 0;
  for (int t = 0; t < kNumTiers; ++t) {
    if ((m >> (8 * t)) & 0xff) bits |= static_cast<uint8_t>(1u << t);
  }
  return bits;
}

uint8_t MemberCount(Member m, int tier) { return static_cast<uint8_t>(m >> (8 * tier)); }

Member WithCount(Member m, int tier, uint8_t count) {
  const uint64_t shift = 8 * tier;
  return (m & ~(uint64_t{0xff} << shift)) | (static_cast<uint64_t>(count) << shift);
}

// A sorted array of Members with room for one inline, so a block held by a single worker (the
// common case) costs no extra allocation. Trivially copyable; its owner releases it.
class MemberList {
 public:
  using Alloc = CountingAllocator<Member>;

  uint32_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const Member* data() const { return capacity_ == 0 ? &inline_ : heap_; }
  Member* data() { return capacity_ == 0 ? &inline_ : heap_; }
  const Member* begin() const { return data(); }
  const Member* end() const { return data() + size_; }

  bool SameAs(const MemberList& other) const {
    return size_ == other.size_ && std::memcmp(data(), other.data(), size_ * sizeof(Member)) == 0;
  }

  // Position of the slot's member, or nullptr.
  Member* Find(uint32_t slot) {
    Member* first = data();
    Member* it = std::lower_bound(first, first + size_, NewMember(slot));
    return (it != first + size_ && MemberSlot(*it) == slot) ? it : nullptr;
  }

  bool Contains(uint32_t slot) const {
    const Member* it = std::lower_bound(begin(), end(), NewMember(slot));
    return it != end() && MemberSlot(*it) == slot;
  }

  Member* Insert(uint32_t slot, Alloc alloc) {
    if (size_ == Capacity()) Reallocate(size_ == 0 ? 1 : std::max<uint32_t>(4, 2 * size_), alloc);
    Member* first = data();
    Member* it = std::lower_bound(first, first + size_, NewMember(slot));
    std::memmove(it + 1, it, (first + size_ - it) * sizeof(Member));
    *it = NewMember(slot);
    ++size_;
    return it;
  }

  // Never fails: giving back spare room is optional (a refused smaller array keeps this one).
  void Erase(Member* it, Alloc alloc) {
    Member* first = data();
    std::memmove(it, it + 1, (first + size_ - it - 1) * sizeof(Member));
    --size_;
    if (capacity_ > 0 && size_ <= capacity_ / 4) {
      try {
        Reallocate(size_ <= 1 ? 0 : capacity_ / 2, alloc);
      } catch (const std::bad_alloc&) {
      }
    }
  }

  // An independent copy (a node split gives both halves the same holders).
  MemberList Clone(Alloc alloc) const {
    MemberList copy;
    if (capacity_ > 0) {
      copy.heap_ = alloc.allocate(capacity_);
      std::memcpy(copy.heap_, heap_, size_ * sizeof(Member));
    } else {
      copy.inline_ = inline_;
    }
    copy.size_ = size_;
    copy.capacity_ = capacity_;
    return copy;
  }

  void Release(Alloc alloc) {
    if (capacity_ > 0) alloc.deallocate(heap_, capacity_);
    capacity_ = 0;
    size_ = 0;
  }

 private:
  uint32_t Capacity() const { return capacity_ == 0 ? 1 : capacity_; }

  // capacity 0 means the single inline slot. Allocates before it changes anything.
  void Reallocate(uint32_t capacity, Alloc alloc) {
    if (capacity == 1) capacity = 0;
    Member* old = data();
    const uint32_t old_capacity = capacity_;
    if (capacity == 0) {
      const Member keep = size_ ? old[0] : 0;
      if (old_capacity > 0) alloc.deallocate(old, old_capacity);
      inline_ = keep;
    } else {
      Member* fresh = alloc.allocate(capacity);
      std::memcpy(fresh, old, size_ * sizeof(Member));
      if (old_capacity > 0) alloc.deallocate(old, old_capacity);
      heap_ = fresh;
    }
    capacity_ = capacity;
  }

  union {
    Member inline_;
    Member* heap_;
  };
  uint32_t size_ = 0;
  uint32_t capacity_ = 0;
};

// A run of consecutive blocks of one path that every holder holds alike (path compression):
// the blocks' local hashes in order, and their holders. Children hang off the run's last block,
// keyed by their first block's local hash. Membership is uniform over the run by construction:
// a change to some of its blocks first splits the run around them. 56 bytes.
struct Node {
  NodeId parent;
  // Where this node's suffix went when the node was last split. A worker's table may still
  // name a position past this node's end; it is found again by following these links
  // (Impl::Resolve), and the table entry is then repaired.
  NodeId continuation;
  uint32_t len;       // blocks
  uint32_t capacity;  // of the heap array of hashes; 0: the single hash is inline
  union {
    uint64_t inline_hash;  // capacity == 0
    uint64_t* hashes;      // capacity > 0
  };
  uint32_t num_children;
  union {
    NodeId only_child;    // num_children == 1
    ChildTable children;  // num_children >= 2
  };
  MemberList members;
};

// A block: its node and its index in the node's run.
struct Position {
  NodeId node;
  uint32_t offset;
  friend bool operator==(const Position&, const Position&) = default;
};

// A worker table's value: where the block is, and the tiers this engine hash holds it on.
// Never 0: a held block has at least one tier.
uint64_t PackEntry(Position p, uint8_t tiers) {
  return p.node | (static_cast<uint64_t>(p.offset) << 32) | (static_cast<uint64_t>(tiers) << 48);
}
Position EntryPosition(uint64_t entry) {
  return {static_cast<NodeId>(entry), static_cast<uint32_t>(entry >> 32) & 0xffff};
}
uint8_t EntryTiers(uint64_t entry) { return static_cast<uint8_t>(entry >> 48); }

struct WorkerState {
  WorkerKey key;
  bool in_use = false;
  PositionTable blocks;  // engine hash -> PackEntry(position, tiers)
};

uint64_t Mix(uint64_t x) {  // splitmix64 finaliser: a fixed, well-spread 64-bit mix
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t Combine(uint64_t a, uint64_t b) { return Mix(a ^ Mix(b)); }

// How many leading hashes of `a` and `b` (n of each) are equal, from `i` on.
size_t CommonPrefixFrom(const uint64_t* a, const uint64_t* b, size_t i, size_t n) {
  for (; i + 4 <= n; i += 4) {  // four at a time: no branch per block on a long equal run
    if ((a[i] ^ b[i]) | (a[i + 1] ^ b[i + 1]) | (a[i + 2] ^ b[i + 2]) | (a[i + 3] ^ b[i + 3]))
      break;
  }
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

#if defined(__x86_64__)
// Eight hashes per step in two 256-bit registers: a lookup is mostly this comparison along a
// run (hundreds of blocks), and the scalar loop is bound by its two loads per hash.
__attribute__((target("avx2"))) size_t CommonPrefixAvx2(const uint64_t* a, const uint64_t* b,
                                                        size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const auto* va = reinterpret_cast<const __m256i*>(a + i);
    const auto* vb = reinterpret_cast<const __m256i*>(b + i);
    const __m256i diff =
        _mm256_or_si256(_mm256_xor_si256(_mm256_loadu_si256(va), _mm256_loadu_si256(vb)),
                        _mm256_xor_si256(_mm256_loadu_si256(va + 1), _mm256_loadu_si256(vb + 1)));
    if (!_mm256_testz_si256(diff, diff)) break;
  }
  return CommonPrefixFrom(a, b, i, n);
}

// Checked once at load; __builtin_cpu_init first, as this may run before libgcc's own
// constructor has filled in what the CPU supports.
const bool kHasAvx2 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") != 0;
}();
#endif

// How many leading hashes of `a` and `b` (n of each) are equal.
size_t CommonPrefix(const uint64_t* a, const uint64_t* b, size_t n) {
#if defined(__x86_64__)
  if (kHasAvx2) return CommonPrefixAvx2(a, b, n);
#endif
  return CommonPrefixFrom(a, b, 0, n);
}

// Per-worker progress along a prompt while matching: which tier it is matching on now and
// where that tier's run started.
struct ActiveWorker {
  uint32_t slot = 0;
  uint8_t tier = 0;
  uint32_t tier_start = 0;
  std::array<uint32_t, kNumTiers> counts{};
};

}  // namespace

class RadixIndex::Impl {
 public:
  explicit Impl(RadixIndexOptions options)
      : options_(options),
        nodes_(&bytes_),
        workers_(CountingAllocator<WorkerState>(&bytes_)),
        slot_of_(0, absl::Hash<WorkerKey>(), std::equal_to<>(),
                 CountingAllocator<std::pair<const WorkerKey, uint32_t>>(&bytes_)),
        free_slots_(CountingAllocator<uint32_t>(&bytes_)),
        held_(CountingAllocator<NodeId>(&bytes_)),
        sliding_(&bytes_, options.block_size) {
    const NodeId root = nodes_.Allocate();
    InitNode(root, kNoNode, {});
  }

  ~Impl() {
    for (auto& w : workers_) w.blocks.Clear();
    ReleaseSubtree(kRoot);
  }

  uint32_t block_size() const { return options_.block_size; }

  ApplyResult Apply(const KvEvent& event) {
    return std::visit([&](const auto& data) { return ApplyData(event, data); }, event.data);
  }

  // Appends the matches of this tree's workers to `out`, with what their sliding-window groups
  // allow (RadixIndex::FindMatches).
  void AppendMatches(std::span<const uint64_t> local_hashes, size_t computable_blocks,
                     std::vector<WorkerMatch>& out) const {
    std::shared_lock lock(mu_);
    const size_t first = out.size();
    AppendFullAttentionMatches(local_hashes, out);
    if (!sliding_.empty()) LimitBySlidingWindows(local_hashes, computable_blocks, first, out);
  }

  // What each rank of a hybrid model can resume from: the full-attention hit (capped at the
  // blocks the engine may take from its cache) lowered by its sliding-window groups
  // (SlidingWindows::Hit). A hit the cap alone lowered stays whole, as it does for a rank
  // without such groups (the engine computes at least the prompt's last token either way).
  // A lowered hit ends on the device: the lower tiers' runs after it no longer continue it.
  void LimitBySlidingWindows(std::span<const uint64_t> local_hashes, size_t computable_blocks,
                             size_t first, std::vector<WorkerMatch>& out) const {
    thread_local std::vector<uint64_t> sequence;  // of the prompt, as far as a rank needed
    sequence.clear();
    size_t kept = first;
    for (size_t i = first; i < out.size(); ++i) {
      WorkerMatch m = out[i];
      if (m.device_blocks > 0 && sliding_.Has(m.worker)) {
        const uint32_t limit =
            static_cast<uint32_t>(std::min<size_t>(m.device_blocks, computable_blocks));
        for (size_t k = sequence.size(); k < limit; ++k) {
          sequence.push_back(k == 0 ? local_hashes[0]
                                    : NextSequenceHash(sequence.back(), local_hashes[k]));
        }
        const uint32_t hit = sliding_.Hit(m.worker, sequence, limit);
        if (hit < limit) {
          m = WorkerMatch{.worker = m.worker, .device_blocks = hit, .tree_size = m.tree_size};
        }
      }
      // As with a rank that holds nothing of the prompt: not a match.
      if (m.device_blocks + m.host_hits + m.disk_hits + m.external_hits == 0) continue;
      out[kept++] = m;
    }
    out.resize(kept);
  }

  // Appends what each rank holds of the prompt in full attention.
  void AppendFullAttentionMatches(std::span<const uint64_t> local_hashes,
                                  std::vector<WorkerMatch>& out) const {
    if (local_hashes.empty()) return;
    NodeId node = FindChild(kRoot, local_hashes[0]);
    if (node == kNoNode) return;
    // Sized once and filled field by field: building each entry on the stack and copying it
    // in stalled on store forwarding (the byte-wide tier), a third of a 1,000-worker lookup.
    const MemberList& holders = nodes_[node].members;
    // Reused per thread: sixty-four holders would otherwise cost a heap allocation per lookup.
    thread_local std::vector<ActiveWorker> active;
    active.resize(holders.size());
    for (size_t i = 0; i < holders.size(); ++i) {
      const Member m = holders.begin()[i];
      active[i].slot = MemberSlot(m);
      active[i].tier = static_cast<uint8_t>(std::countr_zero(MemberTiers(m)));
      active[i].tier_start = 0;
      active[i].counts = {};
    }
    const uint64_t* prompt = local_hashes.data();
    const size_t total = local_hashes.size();
    // A lookup is a sweep along the prompt's hashes and each node's: start both sweeps'
    // misses at once (the first 4 KiB of each; the hardware prefetcher carries on from there).
    PrefetchRange(prompt + 1, std::min<size_t>(total - 1, kSweepPrefetch));
    size_t depth = 0;  // blocks matched before `node`
    for (;;) {
      // The run's first hash matched when the child was found; compare the rest in one sweep.
      const Node& n = nodes_[node];
      const size_t want = std::min<size_t>(n.len, total - depth);
      PrefetchRange(Hashes(n) + 1, std::min<size_t>(want - 1, kSweepPrefetch));
      const size_t run = 1 + CommonPrefix(prompt + depth + 1, Hashes(n) + 1, want - 1);
      depth += run;
      if (run < n.len || depth == total) break;
      const NodeId child = FindChild(node, prompt[depth]);
      if (child == kNoNode) break;
      const MemberList& members = nodes_[child].members;
      // Most runs are held by exactly the previous run's holders: nothing to update then.
      if (!members.SameAs(n.members)) {
        Reconcile(active, members, static_cast<uint32_t>(depth), out);
        if (active.empty()) break;
      }
      node = child;
    }
    out.reserve(out.size() + active.size());
    for (ActiveWorker& a : active) {
      a.counts[a.tier] += static_cast<uint32_t>(depth) - a.tier_start;
      out.push_back(ToMatch(a));
    }
  }

  size_t RemoveWorker(uint64_t worker_id) {
    std::unique_lock lock(mu_);
    // From the last slot down: a release gives back trailing free slots only, so the slots
    // still to visit keep their numbers. Allocates nothing.
    size_t dropped = 0;
    for (size_t slot = workers_.size(); slot-- > 0;) {
      if (slot < workers_.size() && workers_[slot].in_use &&
          workers_[slot].key.worker_id == worker_id) {
        dropped += ReleaseSlot(static_cast<uint32_t>(slot));
      }
    }
    return dropped;
  }

  size_t RemoveWorkerDpRank(WorkerKey worker) {
    std::unique_lock lock(mu_);
    auto it = slot_of_.find(worker);
    return it == slot_of_.end() ? 0 : ReleaseSlot(it->second);
  }

  uint64_t TreeSize(WorkerKey worker) const {
    std::shared_lock lock(mu_);
    auto it = slot_of_.find(worker);
    return it == slot_of_.end() ? 0 : workers_[it->second].blocks.size();
  }

  uint64_t CachedBlocks() const {
    std::shared_lock lock(mu_);
    return cached_blocks_;
  }

  size_t HeldPrefix(WorkerKey worker, std::span<const uint64_t> engine_hashes) const {
    std::shared_lock lock(mu_);
    const PositionTable* blocks = BlocksOf(worker);
    if (blocks == nullptr) return 0;
    size_t held = 0, unknown_from = engine_hashes.size();  // held <= answer < unknown_from
    while (held < unknown_from) {
      const size_t mid = held + (unknown_from - held) / 2;
      if (blocks->Contains(engine_hashes[mid])) {
        held = mid + 1;
      } else {
        unknown_from = mid;
      }
    }
    return held;
  }

  void PathTo(WorkerKey worker, uint64_t engine_hash, std::vector<uint64_t>& path) const {
    std::shared_lock lock(mu_);
    path.clear();
    const PositionTable* blocks = BlocksOf(worker);
    const uint64_t entry = blocks ? blocks->Get(engine_hash) : 0;
    if (entry == 0) return;
    LocalPathReversed(Resolve(EntryPosition(entry)), path);
    std::reverse(path.begin(), path.end());
  }

  // Appends the local hashes of the blocks from `p` up to the root's child, `p`'s first.
  void LocalPathReversed(Position p, std::vector<uint64_t>& path) const {
    for (NodeId node = p.node; node != kRoot; node = nodes_[node].parent) {
      const uint64_t* hashes = Hashes(nodes_[node]);
      const uint32_t end = node == p.node ? p.offset + 1 : nodes_[node].len;
      for (uint32_t k = end; k-- > 0;) path.push_back(hashes[k]);
    }
  }

  // Drops the deepest blocks of a path the worker holds, as long as nothing else it holds
  // hangs below them (see the header). Walks the path up from its end through the nodes (no
  // table lookups), then takes each node's part off as one run, deepest node first.
  TailDrop DropPathTail(WorkerKey worker, std::span<const uint64_t> path, size_t limit,
                        absl::FunctionRef<bool(uint64_t)> keep) {
    std::unique_lock lock(mu_);
    auto slot_it = slot_of_.find(worker);
    if (slot_it == slot_of_.end() || path.empty()) return {.dropped = 0, .finished = true};
    const uint32_t slot = slot_it->second;
    PositionTable& blocks = workers_[slot].blocks;
    const uint64_t entry = blocks.Get(path.back());
    if (entry == 0) return {.dropped = 0, .finished = true};
    Position p = ResolveEntry(blocks, path.back(), entry);
    struct Cut {
      NodeId node;
      uint32_t from, to;  // the node's blocks [from, to) go
    };
    // At most kMaxCuts runs a call, so that the cuts never go to the heap: approximate mode's
    // expiry must be able to give memory back when the heap refuses more.
    constexpr size_t kMaxCuts = 32;
    absl::InlinedVector<Cut, kMaxCuts> cuts;
    NodeId below = kNoNode;  // the path's node under p's, once the walk has left one
    bool finished = false;
    size_t count = 0;
    while (true) {
      if (count == limit) break;
      const Node& n = nodes_[p.node];
      // Mid-run, the block below is the path's (dropped already), or, at the path's end, one
      // the worker holds (membership is uniform over a run).
      const bool in_use =
          p.offset + 1 < n.len ? count == 0 : HoldsAChildBesides(slot, p.node, below);
      if (keep(path[path.size() - 1 - count]) || in_use || !n.members.Contains(slot)) {
        finished = true;
        break;
      }
      if (cuts.empty() || cuts.back().node != p.node) {
        if (cuts.size() == kMaxCuts) break;  // not finished: the caller resumes from here
        cuts.push_back({p.node, p.offset, p.offset + 1});
      }
      cuts.back().from = p.offset;
      ++count;
      if (count == path.size()) {
        finished = true;
        break;
      }
      if (p.offset > 0) {
        --p.offset;
      } else {
        below = p.node;
        const NodeId parent = n.parent;
        if (parent == kRoot) {  // the path is longer than the tree's: not this worker's chain
          finished = true;
          break;
        }
        p = Position{parent, nodes_[parent].len - 1};
      }
    }
    size_t cut_blocks = 0;         // the path's last blocks that the cuts so far took off
    for (const Cut& cut : cuts) {  // deepest first: isolating one never moves a shallower one
      NodeId run;
      try {
        run = Isolate(cut.node, cut.from, cut.to);
      } catch (const std::bad_alloc&) {
        // The blocks cut so far may be freed: their entries go before the rank is cleared.
        for (uint64_t engine_hash : path.last(cut_blocks)) blocks.Erase(engine_hash);
        cached_blocks_ -= cut_blocks;
        DropAfterRefusal(worker);
        throw;
      }
      const Member* m = nodes_[run].members.Find(slot);
      RemoveFromNode(run, slot, MemberTiers(*m));
      FreeIfUnused(run);
      cut_blocks += cut.to - cut.from;
    }
    const auto dropped = path.last(count);
    for (size_t k = 0; k < count; ++k) {
      PrefetchAhead(blocks, dropped, k);
      blocks.Erase(dropped[k]);
    }
    cached_blocks_ -= count;
    return {.dropped = count, .finished = finished};
  }

  // Whether the worker holds a child of node `id`'s last block other than `besides`.
  bool HoldsAChildBesides(uint32_t slot, NodeId id, NodeId besides) const {
    bool held = false;
    ForEachChild(nodes_[id], [&](NodeId c) {
      held = held || (c != besides && nodes_[c].members.Contains(slot));
    });
    return held;
  }

  std::vector<WorkerKey> Workers() const {
    std::shared_lock lock(mu_);
    std::vector<WorkerKey> out;
    for (const auto& [key, slot] : slot_of_) out.push_back(key);
    std::sort(out.begin(), out.end());
    return out;
  }

  IndexStats Stats() const {
    std::shared_lock lock(mu_);
    IndexStats s;
    s.nodes = nodes_.live();
    s.tree_blocks = tree_blocks_;
    s.cached_blocks = cached_blocks_;
    s.workers = slot_of_.size();
    s.allocated_bytes = bytes_;
    s.events = events_;
    s.duplicate_stores = duplicate_stores_;
    s.rekeyed_blocks = rekeyed_blocks_;
    s.refused_events = refused_events_;
    s.sliding_blocks = sliding_.blocks();
    s.sliding_events = sliding_events_;
    return s;
  }

  std::vector<KvEvent> DumpEvents() const;
  uint64_t StateDigest() const;
  std::string CheckInvariants() const;

 private:
  // ---- Nodes and their runs ----------------------------------------------------------------

  static const uint64_t* Hashes(const Node& n) {
    return n.capacity == 0 ? &n.inline_hash : n.hashes;
  }
  static uint64_t* Hashes(Node& n) { return n.capacity == 0 ? &n.inline_hash : n.hashes; }

  CountingAllocator<uint64_t> HashAlloc() { return CountingAllocator<uint64_t>(&bytes_); }

  // Gives `n` room for `len` hashes, keeping the first `keep`; a single hash lives inline.
  void ResizeRun(Node& n, uint32_t len, uint32_t keep) {
    const uint32_t capacity = len <= 1 ? 0 : len;
    if (capacity == n.capacity) return;
    uint64_t* fresh = capacity == 0 ? nullptr : HashAlloc().allocate(capacity);
    const uint64_t* old = Hashes(n);
    uint64_t kept[1];
    std::memcpy(capacity == 0 ? kept : fresh, old, std::min(keep, std::max(len, 1u)) * 8);
    if (n.capacity > 0) HashAlloc().deallocate(n.hashes, n.capacity);
    n.capacity = capacity;
    if (capacity == 0) {
      n.inline_hash = kept[0];
    } else {
      n.hashes = fresh;
    }
  }

  void InitNode(NodeId id, NodeId parent, std::span<const uint64_t> hashes) {
    Node& n = nodes_[id];
    n.parent = parent;
    n.continuation = kNoNode;
    n.len = 0;
    n.capacity = 0;
    n.inline_hash = 0;
    n.num_children = 0;
    n.only_child = kNoNode;
    n.members = MemberList();
    if (!hashes.empty()) {
      ResizeRun(n, static_cast<uint32_t>(hashes.size()), 0);
      std::memcpy(Hashes(n), hashes.data(), hashes.size() * 8);
      n.len = static_cast<uint32_t>(hashes.size());
    }
  }

  // Appends hashes to a leaf's run, growing its array by half again when full.
  void ExtendRun(Node& n, std::span<const uint64_t> hashes) {
    const uint32_t len = n.len + static_cast<uint32_t>(hashes.size());
    if (len > std::max(n.capacity, 1u)) {
      const uint32_t capacity = std::min(kMaxRun, std::max(len, n.len + n.len / 2));
      ResizeRun(n, capacity, n.len);
    }
    std::memcpy(Hashes(n) + n.len, hashes.data(), hashes.size() * 8);
    n.len = len;
    tree_blocks_ += hashes.size();
  }

  // Shortens a run to its first `len` hashes, giving back spare room. Never fails: if the heap
  // refuses the smaller array the run keeps its room.
  void TruncateRun(Node& n, uint32_t len) {
    n.len = len;
    if (n.capacity > 0 && (len <= 1 || len * 2 <= n.capacity)) {
      try {
        ResizeRun(n, len, len);
      } catch (const std::bad_alloc&) {
      }
    }
  }

  NodeId FindChild(NodeId parent, uint64_t local_hash) const {
    const Node& p = nodes_[parent];
    if (p.num_children == 1) {
      return Hashes(nodes_[p.only_child])[0] == local_hash ? p.only_child : kNoNode;
    }
    if (p.num_children == 0) return kNoNode;
    const uint64_t child = p.children.Get(local_hash);
    return child == 0 ? kNoNode : static_cast<NodeId>(child);
  }

  template <typename F>
  void ForEachChild(const Node& n, F&& f) const {
    if (n.num_children == 1) f(n.only_child);
    if (n.num_children >= 2) {
      n.children.ForEach([&](uint64_t, uint64_t child) { f(static_cast<NodeId>(child)); });
    }
  }

  // Throws std::bad_alloc with nothing changed.
  void LinkChild(NodeId parent, NodeId child) {
    Node& p = nodes_[parent];
    const uint64_t key = Hashes(nodes_[child])[0];
    if (p.num_children == 0) {
      p.only_child = child;
    } else if (p.num_children == 1) {
      p.children = ChildTable::Make(ChildAlloc(), {Hashes(nodes_[p.only_child])[0], p.only_child},
                                    {key, child});
    } else {
      p.children.Insert(key, child, ChildAlloc());
    }
    ++p.num_children;
  }

  ChildTable::Alloc ChildAlloc() { return ChildTable::Alloc(&bytes_); }

  void UnlinkChild(NodeId parent, NodeId child) {
    Node& p = nodes_[parent];
    if (p.num_children == 1) {
      p.only_child = kNoNode;
    } else {
      p.children.Erase(Hashes(nodes_[child])[0], ChildAlloc());  // never fails
      if (p.num_children == 2) {
        ChildTable table = p.children;
        table.ForEach([&](uint64_t, uint64_t other) { p.only_child = static_cast<NodeId>(other); });
        table.Release(ChildAlloc());
      }
    }
    --p.num_children;
  }

  // A node with the run `hashes` and no holders, in the tree under `parent` or not yet linked
  // anywhere. Each throws std::bad_alloc with nothing changed; DiscardNode takes back one not
  // yet linked.
  NodeId NewNode(NodeId parent, std::span<const uint64_t> hashes) {
    const NodeId id = nodes_.Allocate();
    try {
      InitNode(id, parent, hashes);
    } catch (const std::bad_alloc&) {
      nodes_.Free(id);
      throw;
    }
    return id;
  }
  NodeId NewChild(NodeId parent, std::span<const uint64_t> hashes) {
    const NodeId id = NewNode(parent, hashes);
    try {
      LinkChild(parent, id);
    } catch (const std::bad_alloc&) {
      DiscardNode(id);
      throw;
    }
    tree_blocks_ += hashes.size();
    return id;
  }
  void DiscardNode(NodeId id) {
    Node& n = nodes_[id];
    if (n.capacity > 0) HashAlloc().deallocate(n.hashes, n.capacity);
    n.members.Release(MemberList::Alloc(&bytes_));
    nodes_.Free(id);
  }

  // Splits node `id` before its block `at` (0 < at < len): the node keeps blocks [0, at) and a
  // new node, its only child, takes the rest with the node's holders and children. The new
  // node is the old one's continuation, so positions past `at` still resolve. The new node is
  // made whole before anything is relinked, so a refused allocation changes nothing.
  NodeId Split(NodeId id, uint32_t at) {
    const NodeId tail =
        NewNode(id, std::span<const uint64_t>(Hashes(nodes_[id]) + at, nodes_[id].len - at));
    Node& n = nodes_[id];  // slab chunks never move: references stay valid
    Node& t = nodes_[tail];
    try {
      t.members = n.members.Clone(MemberList::Alloc(&bytes_));
    } catch (const std::bad_alloc&) {
      DiscardNode(tail);
      throw;
    }
    t.continuation = n.continuation;
    t.num_children = n.num_children;
    if (n.num_children == 1) t.only_child = n.only_child;
    if (n.num_children >= 2) t.children = n.children;
    ForEachChild(t, [&](NodeId c) { nodes_[c].parent = tail; });
    n.continuation = tail;
    n.num_children = 1;
    n.only_child = tail;
    TruncateRun(n, at);
    return tail;
  }

  // The node holding exactly blocks [from, to) of node `id`'s run, splitting it as needed.
  NodeId Isolate(NodeId id, uint32_t from, uint32_t to) {
    if (from > 0) {
      id = Split(id, from);
      to -= from;
    }
    if (to < nodes_[id].len) Split(id, to);
    return id;
  }

  // Where a position recorded before later splits is now.
  Position Resolve(Position p) const {
    while (p.offset >= nodes_[p.node].len) {
      p.offset -= nodes_[p.node].len;
      p.node = nodes_[p.node].continuation;
    }
    return p;
  }

  // Resolves a worker's table entry and repairs it, so the next use needs no walk.
  Position ResolveEntry(PositionTable& blocks, uint64_t engine_hash, uint64_t entry) {
    const Position p = Resolve(EntryPosition(entry));
    if (!(p == EntryPosition(entry))) blocks.Update(engine_hash, PackEntry(p, EntryTiers(entry)));
    return p;
  }

  // Frees `id` and every ancestor that is left holding nothing and leading nowhere.
  // `freed`, if given: ids sorted (ignoring kFreedMark) in which each node freed here is marked.
  void FreeIfUnused(NodeId id, std::span<NodeId> freed = {}) {
    while (id != kRoot && nodes_[id].members.empty() && nodes_[id].num_children == 0) {
      const NodeId parent = nodes_[id].parent;
      UnlinkChild(parent, id);
      ReleaseNode(id);
      if (!freed.empty()) MarkFreed(freed, id);
      id = parent;
    }
  }

  static constexpr NodeId kFreedMark = NodeId{1} << 31;  // above every id (kMaxNodes)
  static void MarkFreed(std::span<NodeId> ids, NodeId id) {
    auto it = std::lower_bound(ids.begin(), ids.end(), id,
                               [](NodeId a, NodeId b) { return (a & ~kFreedMark) < b; });
    if (it != ids.end() && (*it & ~kFreedMark) == id) *it |= kFreedMark;
  }

  void ReleaseNode(NodeId id) {
    tree_blocks_ -= nodes_[id].len;
    DiscardNode(id);
  }

  void ReleaseSubtree(NodeId root) {  // destructor only: no unlinking needed
    std::vector<NodeId> stack{root};
    while (!stack.empty()) {
      const NodeId id = stack.back();
      stack.pop_back();
      Node& n = nodes_[id];
      ForEachChild(n, [&](NodeId c) { stack.push_back(c); });
      if (n.num_children >= 2) n.children.Release(ChildAlloc());
      ReleaseNode(id);
    }
  }

  // ---- Membership --------------------------------------------------------------------------

  void AddToNode(NodeId id, uint32_t slot, Tier tier) {
    MemberList& members = nodes_[id].members;
    Member* m = members.Find(slot);
    if (m == nullptr) m = members.Insert(slot, MemberList::Alloc(&bytes_));
    const int t = static_cast<int>(tier);
    const uint8_t count = MemberCount(*m, t);
    if (count < 0xff) *m = WithCount(*m, t, count + 1);
  }

  void RemoveFromNode(NodeId id, uint32_t slot, uint8_t tiers) {
    MemberList& members = nodes_[id].members;
    Member* m = members.Find(slot);
    if (m == nullptr) return;
    for (int t = 0; t < kNumTiers; ++t) {
      const uint8_t count = MemberCount(*m, t);
      if ((tiers >> t) & 1 && count > 0) *m = WithCount(*m, t, count - 1);
    }
    if (MemberTiers(*m) == 0) members.Erase(m, MemberList::Alloc(&bytes_));
  }

  // A node the worker may grow by appending: a leaf that only this worker holds, once, on
  // exactly this tier, so appended blocks are held alike (a decode extending its own tail).
  bool CanExtend(NodeId id, uint32_t slot, Tier tier, size_t more) const {
    const Node& n = nodes_[id];
    if (id == kRoot || n.num_children != 0 || n.len + more > kMaxRun) return false;
    if (n.members.size() != 1) return false;
    const Member m = *n.members.begin();
    return MemberSlot(m) == slot && m == WithCount(NewMember(slot), static_cast<int>(tier), 1);
  }

  // ---- Workers -----------------------------------------------------------------------------

  const PositionTable* BlocksOf(WorkerKey worker) const {
    auto it = slot_of_.find(worker);
    return it == slot_of_.end() ? nullptr : &workers_[it->second].blocks;
  }

  // The worker's slot, a new one if it is new. Allocates first (room for the slot, and for its
  // number in free_slots_ when it goes, so that a removal never allocates), so a refused
  // allocation leaves the workers as they were.
  uint32_t SlotFor(WorkerKey key) {
    if (auto it = slot_of_.find(key); it != slot_of_.end()) return it->second;
    const bool reuse = !free_slots_.empty();
    const uint32_t slot = reuse ? free_slots_.back() : static_cast<uint32_t>(workers_.size());
    if (!reuse) {
      const size_t room = std::max<size_t>(4, 2 * workers_.size());
      if (workers_.capacity() == workers_.size()) workers_.reserve(room);
      if (free_slots_.capacity() <= workers_.size()) free_slots_.reserve(room);
    }
    slot_of_.emplace(key, slot);  // strongly exception-safe: the last thing that may throw
    if (reuse) {
      free_slots_.pop_back();
    } else {
      workers_.push_back(
          WorkerState{.key = key, .in_use = false, .blocks = PositionTable(&bytes_)});
    }
    workers_[slot].key = key;
    workers_[slot].in_use = true;
    return slot;
  }

  // Drops every block of the slot; the worker stays known. Returns the blocks dropped. Never
  // allocates, so it cannot fail: it is also how an event the heap refused is undone
  // (DropAfterRefusal), and a removed event passes the positions whose entries it had already
  // taken off the table in `also_held`.
  size_t ClearSlot(uint32_t slot, std::span<const Position> also_held = {}) {
    PositionTable& blocks = workers_[slot].blocks;
    const size_t dropped = blocks.size();
    // A worker holds whole nodes (membership is uniform over a run): drop it from each node
    // once. Resolve every entry first: freeing nodes breaks the links stale entries follow.
    // held_ has room for the largest table and a removed event's blocks (ReserveToClear).
    held_.clear();
    blocks.ForEach(
        [&](uint64_t, uint64_t entry) { held_.push_back(Resolve(EntryPosition(entry)).node); });
    for (Position p : also_held) held_.push_back(Resolve(p).node);
    std::sort(held_.begin(), held_.end());
    held_.erase(std::unique(held_.begin(), held_.end()), held_.end());
    // Dropping the rank from a node may free it and its ancestors. An ancestor the rank named in
    // its table but was not yet a member of (an event refused midway) is freed that way if it
    // is left empty, and must not be visited after: freed nodes are marked in held_.
    for (NodeId& node : held_) {
      if (node & kFreedMark) continue;
      MemberList& members = nodes_[node].members;
      Member* m = members.Find(slot);
      if (m == nullptr) continue;  // not the rank's: left as it is
      members.Erase(m, MemberList::Alloc(&bytes_));
      FreeIfUnused(node, held_);
    }
    held_.clear();
    blocks.Clear();
    cached_blocks_ -= dropped;
    sliding_.Release(workers_[slot].key);
    return dropped;
  }

  // Room in held_ for clearing a table of `entries` entries (and `more` positions): taken before
  // an event makes a table larger, so that clearing it later never allocates.
  void ReserveToClear(size_t entries, size_t more = 0) {
    if (held_.capacity() < entries + more) {
      held_.reserve(std::max(entries + more, held_.capacity() + held_.capacity() / 2));
    }
  }

  // An event the heap refused part of: its rank is left holding nothing (known, as after a
  // cleared event), which understates its cache but never claims a block it lacks, and the
  // refusal goes on to the caller. `also_held`: see ClearSlot.
  void DropAfterRefusal(WorkerKey worker, std::span<const Position> also_held = {}) {
    repeated_.clear();
    auto it = slot_of_.find(worker);
    if (it == slot_of_.end()) return;
    ClearSlot(it->second, also_held);
    ++refused_events_;
  }

  size_t ReleaseSlot(uint32_t slot) {
    const size_t dropped = ClearSlot(slot);
    slot_of_.erase(workers_[slot].key);
    workers_[slot].in_use = false;
    free_slots_.push_back(slot);  // SlotFor kept room for it
    CompactWorkers();
    return dropped;
  }

  // Gives back the slots of removed workers at the end of the slot array, and spare capacity
  // (all optional: nothing here fails).
  void CompactWorkers() {
    while (!workers_.empty() && !workers_.back().in_use) workers_.pop_back();
    std::erase_if(free_slots_, [&](uint32_t slot) { return slot >= workers_.size(); });
    ShrinkIfSparse(workers_);
    ShrinkKeepingRoomFor(workers_.size(), free_slots_);
    size_t largest = 0;
    for (const WorkerState& w : workers_) largest = std::max(largest, w.blocks.size());
    ShrinkKeepingRoomFor(largest, held_);
    if (workers_.empty()) {  // nothing kept for workers that are all gone
      held_ = decltype(held_)(held_.get_allocator());
      free_slots_ = decltype(free_slots_)(free_slots_.get_allocator());
    }
    try {
      if (slot_of_.empty()) {
        slot_of_ = decltype(slot_of_)(0, slot_of_.hash_function(), slot_of_.key_eq(),
                                      slot_of_.get_allocator());
      } else if (slot_of_.size() * 8 < slot_of_.bucket_count()) {
        slot_of_.rehash(0);  // strongly exception-safe
      }
    } catch (const std::bad_alloc&) {
    }
  }

  // ---- Events ------------------------------------------------------------------------------

  ApplyResult Fail(EventKind kind, EventError error, std::string message) {
    ++events_[static_cast<int>(kind)][static_cast<int>(error)];
    ApplyResult result;
    result.error = error;
    result.message = std::move(message);
    return result;
  }

  ApplyResult Succeed(EventKind kind) {
    ++events_[static_cast<int>(kind)][static_cast<int>(EventError::kNone)];
    return ApplyResult{};
  }

  ApplyResult ApplyData(const KvEvent& event, const StoredEvent& stored) {
    // Hash outside the lock: it is the expensive part and touches no shared state.
    std::vector<uint64_t> computed;
    std::span<const uint64_t> locals = stored.local_hashes;
    if (locals.empty() && !stored.token_ids.empty()) {
      BlockHashOptions options{.lora_name = stored.lora_name,
                               .cache_namespace = stored.cache_namespace,
                               .eagle = stored.eagle,
                               .block_mm_hashes = stored.block_mm_hashes};
      ComputeLocalBlockHashesInto(stored.token_ids, options_.block_size, options, computed);
      locals = computed;
    }
    std::unique_lock lock(mu_);
    // What may be refused before anything changes: room to clear the rank, and its slot.
    const auto known = slot_of_.find(event.worker);
    ReserveToClear((known == slot_of_.end() ? 0 : workers_[known->second].blocks.size()) +
                   stored.block_hashes.size());
    const uint32_t slot = SlotFor(event.worker);
    try {
      ApplyResult result = Store(slot, event.worker, event.tier, stored, locals);
      result.repeated.swap(repeated_);  // repeated_ is left empty for the next store
      return result;
    } catch (const std::bad_alloc&) {
      DropAfterRefusal(event.worker);
      throw;
    }
  }

  // One stored event, a run of blocks at a time: blocks the tree already has are joined as one
  // run per node (one split at most at each end), blocks it lacks become one new node (or
  // extend the worker's own leaf). Never a node per block.
  ApplyResult Store(uint32_t slot, WorkerKey worker, Tier tier, const StoredEvent& stored,
                    std::span<const uint64_t> locals) {
    if (locals.empty() && stored.token_ids.empty() && !stored.parent_hash) {
      return StoreCopies(slot, worker, tier, stored.block_hashes);
    }
    PositionTable& blocks = workers_[slot].blocks;
    StoreCursor cursor;
    if (stored.parent_hash) {
      const uint64_t entry = blocks.Get(*stored.parent_hash);
      if (entry == 0) {
        return Fail(EventKind::kStored, EventError::kParentBlockNotFound,
                    Message("parent block ", *stored.parent_hash, " not found for worker ",
                            worker.worker_id, " rank ", worker.dp_rank));
      }
      cursor.Advance(ResolveEntry(blocks, *stored.parent_hash, entry), 1);
    }
    const std::span<const uint64_t> engine = stored.block_hashes;
    const size_t n = std::min(engine.size(), locals.size());
    for (size_t i = 0; i < n;) {
      if (const uint64_t entry = blocks.Get(engine[i])) {
        const Position known = ResolveEntry(blocks, engine[i], entry);
        if (cursor.OnPath(known, *this)) {
          return Fail(EventKind::kStored, EventError::kInvalidBlockSequence,
                      Message("block ", engine[i], " (index ", i,
                              ") repeats an earlier block of its sequence; ", i, " of ",
                              engine.size(), " blocks applied"));
        }
        if (Next(cursor, locals[i]) == known) {
          i = StoreAgain(slot, tier, engine, locals, i, cursor);
          continue;
        }
        // The engine reused this hash for another prefix: it now names this block only.
        ++rekeyed_blocks_;
        DropBlock(slot, known, EntryTiers(entry));
        blocks.Erase(engine[i]);
        --cached_blocks_;
      }
      if (nodes_.live() >= kMaxNodes) {
        return Fail(EventKind::kStored, EventError::kInvalidBlock,
                    Message("index is full (2^31 nodes); block not stored"));
      }
      const std::optional<Position> next = Next(cursor, locals[i]);
      i = next ? JoinRun(slot, tier, engine, locals, i, n, *next, cursor)
               : AddNewRun(slot, tier, engine, locals, i, n, cursor);
    }
    if (engine.size() != locals.size()) {
      return Fail(
          EventKind::kStored, EventError::kInvalidBlock,
          Message(engine.size(), " block hashes but ", locals.size(), " complete blocks of ",
                  options_.block_size, " tokens; the first ", n, " blocks applied"));
    }
    return Succeed(EventKind::kStored);
  }

  // Where a stored event has got to: the position of its last block (none: the root), and
  // the runs of blocks it has placed, to catch an engine hash that names one of them again.
  struct StoreCursor {
    struct Run {
      Position first;
      uint32_t count;
    };
    std::optional<Position> last;
    absl::InlinedVector<Run, 4> path;

    // Whether `p` is one of the placed blocks (positions recorded before later splits are
    // resolved again: rare, an engine hash already held is the only caller).
    bool OnPath(Position p, const Impl& index) const {
      for (const Run& run : path) {
        for (uint32_t k = 0; k < run.count; ++k) {
          if (index.Resolve({run.first.node, run.first.offset + k}) == p) return true;
        }
      }
      return false;
    }
    void Advance(Position first, uint32_t count) {
      last = Position{first.node, first.offset + count - 1};
      path.push_back({first, count});
    }
  };

  // The position of the block after the cursor with this local hash, if the tree has it.
  std::optional<Position> Next(StoreCursor& cursor, uint64_t local_hash) {
    NodeId node = kRoot;
    uint32_t end = 0;
    if (cursor.last) {
      cursor.last = Resolve(*cursor.last);
      node = cursor.last->node;
      end = cursor.last->offset + 1;
    }
    const Node& n = nodes_[node];
    if (end < n.len) {
      if (Hashes(n)[end] == local_hash) return Position{node, end};
      return std::nullopt;
    }
    const NodeId child = FindChild(node, local_hash);
    if (child == kNoNode) return std::nullopt;
    return Position{child, 0};
  }

  // Blocks [i, ...) of the event continue the tree's own path from `at`: the worker joins the
  // longest run of them inside that node (consecutive, matching hashes, new to the worker:
  // the insert into its table stops the run at a hash it already has, this event's included).
  size_t JoinRun(uint32_t slot, Tier tier, std::span<const uint64_t> engine,
                 std::span<const uint64_t> locals, size_t i, size_t n, Position at,
                 StoreCursor& cursor) {
    PositionTable& blocks = workers_[slot].blocks;
    const Node& node = nodes_[at.node];
    const auto candidates = engine.subspan(i, std::min<size_t>(n - i, node.len - at.offset));
    uint32_t count = 0;
    try {
      while (count < candidates.size() && Hashes(node)[at.offset + count] == locals[i + count]) {
        PrefetchAhead(blocks, candidates, count);
        if (!blocks.TryInsert(candidates[count],
                              PackEntry({at.node, at.offset + count}, TierBit(tier)))) {
          break;
        }
        ++count;
      }
    } catch (const std::bad_alloc&) {
      cached_blocks_ += count;  // every entry is counted, also those of a refused event
      throw;
    }
    cached_blocks_ += count;
    // The entries name positions in the node as it was; once the run is isolated they resolve
    // (and are repaired) through the split links. (If the heap refuses a split, the rank is
    // cleared: ClearSlot finds each node through the entries, and skips those it is not a
    // member of yet.)
    const NodeId run = Isolate(at.node, at.offset, at.offset + count);
    AddToNode(run, slot, tier);
    cursor.Advance({run, 0}, count);
    return i + count;
  }

  // Blocks [i, ...) of the event are new to the tree: they become one run under the cursor
  // (the cursor's node split after the cursor if the cursor is inside it), or extend the
  // worker's own leaf when the cursor is its end. The run stops before a hash the worker
  // already has (the insert into its table says so): that block is then handled on its own.
  size_t AddNewRun(uint32_t slot, Tier tier, std::span<const uint64_t> engine,
                   std::span<const uint64_t> locals, size_t i, size_t n, StoreCursor& cursor) {
    PositionTable& blocks = workers_[slot].blocks;
    const auto run = locals.subspan(i, std::min<size_t>(n - i, kMaxRun));
    NodeId parent = kRoot;
    if (cursor.last) {
      parent = cursor.last->node;  // resolved by Next just before
      if (cursor.last->offset + 1 < nodes_[parent].len) Split(parent, cursor.last->offset + 1);
    }
    const bool extend = CanExtend(parent, slot, tier, run.size());
    const NodeId node = extend ? parent : NewChild(parent, run);
    const uint32_t first = extend ? nodes_[node].len : 0;
    if (extend) {
      ExtendRun(nodes_[node], run);
    } else {
      AddToNode(node, slot, tier);  // a new node's one member is inline: nothing to allocate
    }
    const auto keys = engine.subspan(i, run.size());
    uint32_t count = 0;
    try {
      while (count < keys.size()) {
        PrefetchAhead(blocks, keys, count);
        if (!blocks.TryInsert(keys[count], PackEntry({node, first + count}, TierBit(tier)))) {
          break;
        }
        ++count;
      }
    } catch (const std::bad_alloc&) {
      cached_blocks_ += count;
      DropRunTail(node, first + count);  // keeps the blocks whose entries went in
      throw;
    }
    cached_blocks_ += count;
    if (count < run.size()) DropRunTail(node, first + count);
    if (count > 0) cursor.Advance({node, first}, count);
    return i + count;
  }

  // Takes back the blocks of a just-made (or just-extended) run from `len` on: the event
  // named a hash the worker already holds there, which is handled on its own.
  void DropRunTail(NodeId id, uint32_t len) {
    Node& n = nodes_[id];
    if (len > 0) {
      tree_blocks_ -= n.len - len;
      TruncateRun(n, len);
      return;
    }
    const NodeId parent = n.parent;  // nothing of the run was kept: it goes
    UnlinkChild(parent, id);
    ReleaseNode(id);
  }

  // Whether engine[j] already appears in engine[i, j) (a run must not name a block twice).
  static bool RepeatsWithin(std::span<const uint64_t> engine, size_t i, size_t j) {
    return std::find(engine.begin() + i, engine.begin() + j, engine[j]) != engine.begin() + j;
  }

  // The worker stores blocks it already holds under the same engine hashes at the cursor (an
  // offload copy on another tier, or a repeat): the longest such run in one node at once.
  size_t StoreAgain(uint32_t slot, Tier tier, std::span<const uint64_t> engine,
                    std::span<const uint64_t> locals, size_t i, StoreCursor& cursor) {
    PositionTable& blocks = workers_[slot].blocks;
    const uint64_t entry = blocks.Get(engine[i]);
    const Position at = EntryPosition(entry);  // resolved by the caller
    if (EntryTiers(entry) & TierBit(tier)) {
      ++duplicate_stores_;
      repeated_.push_back(engine[i]);
      cursor.Advance(at, 1);
      return i + 1;
    }
    // Extend over following blocks held the same way: next in the run, same tiers, new tier.
    const Node& node = nodes_[at.node];
    const uint8_t tiers = EntryTiers(entry);
    size_t j = i + 1;
    while (j < engine.size() && j < locals.size() && at.offset + (j - i) < node.len &&
           Hashes(node)[at.offset + (j - i)] == locals[j]) {
      const uint64_t e = blocks.Get(engine[j]);
      if (e == 0 || EntryTiers(e) != tiers || RepeatsWithin(engine, i, j) ||
          Resolve(EntryPosition(e)) !=
              Position{at.node, at.offset + static_cast<uint32_t>(j - i)}) {
        break;
      }
      ++j;
    }
    const uint32_t count = static_cast<uint32_t>(j - i);
    const NodeId run = Isolate(at.node, at.offset, at.offset + count);
    AddToNode(run, slot, tier);
    for (uint32_t k = 0; k < count; ++k) {
      blocks.Update(engine[i + k], PackEntry({run, k}, tiers | TierBit(tier)));
    }
    cursor.Advance({run, 0}, count);
    return j;
  }

  // A store that names blocks by engine hash alone, without tokens, local hashes or parent
  // (vLLM's offloading connector reports its copies so): each is a copy, on `tier`, of a block
  // the worker already holds on another tier. Hashes it does not hold are skipped and reported.
  ApplyResult StoreCopies(uint32_t slot, WorkerKey worker, Tier tier,
                          std::span<const uint64_t> engine) {
    PositionTable& blocks = workers_[slot].blocks;
    size_t missing = 0;
    uint64_t first_missing = 0;
    for (size_t i = 0; i < engine.size(); ++i) {
      const uint64_t entry = blocks.Get(engine[i]);
      if (entry == 0) {
        if (missing++ == 0) first_missing = engine[i];
        continue;
      }
      const Position at = ResolveEntry(blocks, engine[i], entry);
      const uint64_t local = Hashes(nodes_[at.node])[at.offset];
      StoreCursor cursor;
      StoreAgain(slot, tier, engine.subspan(i, 1), std::span<const uint64_t>(&local, 1), 0, cursor);
    }
    if (missing > 0) {
      return Fail(EventKind::kStored, EventError::kBlockNotFound,
                  Message(missing, " of ", engine.size(),
                          " blocks stored without tokens are not held by worker ", worker.worker_id,
                          " rank ", worker.dp_rank, " on any tier (first: ", first_missing,
                          "); the others were added to tier ", TierName(tier)));
    }
    return Succeed(EventKind::kStored);
  }

  // The worker no longer holds the block at `p` on `tiers`.
  void DropBlock(uint32_t slot, Position p, uint8_t tiers) {
    std::vector<Position> one{p};
    DropBlocks(slot, tiers, one);
  }

  ApplyResult ApplyData(const KvEvent& event, const RemovedEvent& removed) {
    std::unique_lock lock(mu_);
    const std::span<const uint64_t> hashes = removed.block_hashes;
    size_t missing = 0;
    uint64_t first_missing = 0;
    auto slot_it = slot_of_.find(event.worker);
    if (slot_it == slot_of_.end()) {
      missing = hashes.size();
      if (missing > 0) first_missing = hashes[0];
    } else {
      const uint32_t slot = slot_it->second;
      PositionTable& blocks = workers_[slot].blocks;
      // Allocated before anything changes: the positions, and the room to clear the rank.
      std::vector<Position> dropped;
      dropped.reserve(hashes.size());
      ReserveToClear(blocks.size(), hashes.size());
      try {
        for (size_t k = 0; k < hashes.size(); ++k) {
          PrefetchAhead(blocks, hashes, k);
          if (std::optional<Position> p = ForgetBlock(slot, event.tier, hashes[k])) {
            dropped.push_back(*p);
          } else if (missing++ == 0) {
            first_missing = hashes[k];
          }
        }
        if (!dropped.empty()) DropBlocks(slot, TierBit(event.tier), dropped);
      } catch (const std::bad_alloc&) {
        // The entries of `dropped` are off the table already; DropBlocks left in it the blocks
        // the rank still holds.
        DropAfterRefusal(event.worker, dropped);
        throw;
      }
    }
    if (missing > 0) {
      return Fail(
          EventKind::kRemoved, EventError::kBlockNotFound,
          Message(missing, " of ", hashes.size(), " removed blocks not found on tier ",
                  TierName(event.tier), " for worker ", event.worker.worker_id, " rank ",
                  event.worker.dp_rank, " (first: ", first_missing, "); the others were removed"));
    }
    return Succeed(EventKind::kRemoved);
  }

  // Takes a block off the worker's table for one tier; its position, if it held it there.
  std::optional<Position> ForgetBlock(uint32_t slot, Tier tier, uint64_t engine_hash) {
    PositionTable& blocks = workers_[slot].blocks;
    const uint64_t entry = blocks.Get(engine_hash);
    if (entry == 0 || !(EntryTiers(entry) & TierBit(tier))) return std::nullopt;
    const Position p = Resolve(EntryPosition(entry));
    const uint8_t left = EntryTiers(entry) & static_cast<uint8_t>(~TierBit(tier));
    if (left == 0) {
      blocks.Erase(engine_hash);
      --cached_blocks_;
    } else {
      blocks.Update(engine_hash, PackEntry(p, left));  // repaired when next used
    }
    return p;
  }

  // The worker no longer holds these blocks on `tier_bit`: consecutive ones of one node are
  // taken off as one run (one isolation), nodes from their last blocks down, so that
  // splitting off a later run never moves an earlier one. An evicted sequence costs a split,
  // not a node per block.
  //
  // If the heap refuses a split, `blocks` is left holding the blocks still held (where the run
  // being dropped had got to, and the runs after it: those before may be freed) and the
  // std::bad_alloc goes on.
  void DropBlocks(uint32_t slot, uint8_t tier_bit, std::vector<Position>& blocks) {
    std::sort(blocks.begin(), blocks.end(), [](const Position& a, const Position& b) {
      return a.node != b.node ? a.node < b.node : a.offset > b.offset;
    });
    for (size_t i = 0; i < blocks.size();) {
      size_t j = i + 1;
      while (j < blocks.size() && blocks[j].node == blocks[i].node &&
             blocks[j].offset + (j - i) == blocks[i].offset) {
        ++j;
      }
      // blocks[j - 1] is the run's first block. An equal position dropped before (the same
      // block under a second engine hash) may have split the node anywhere in the run, so the
      // run is dropped piece by piece, each resolved where it now is: one piece per node.
      Position at = blocks[j - 1];
      for (uint32_t left = static_cast<uint32_t>(j - i); left > 0;) {
        const Position p = Resolve(at);
        const uint32_t n = std::min(left, nodes_[p.node].len - p.offset);
        NodeId run;
        try {
          run = Isolate(p.node, p.offset, p.offset + n);
        } catch (const std::bad_alloc&) {
          // blocks[i, i + left) are the run's blocks from `at` on (offsets descending): still
          // held, and maybe in later nodes (a duplicate's earlier drop may have split the run).
          blocks.erase(blocks.begin() + static_cast<ptrdiff_t>(i + left),
                       blocks.begin() + static_cast<ptrdiff_t>(j));
          blocks.erase(blocks.begin(), blocks.begin() + static_cast<ptrdiff_t>(i));
          throw;
        }
        RemoveFromNode(run, slot, tier_bit);
        // Not freed while a later piece of this run hangs below it.
        FreeIfUnused(run);
        at.offset += n;
        left -= n;
      }
      i = j;
    }
  }

  // The publishing rank's cache was emptied: each data-parallel rank of an engine has a cache
  // of its own (and Dynamo 1.6.1 clears only the rank too). Its other ranks keep their blocks.
  ApplyResult ApplyData(const KvEvent& event, const ClearedEvent&) {
    std::unique_lock lock(mu_);
    ClearSlot(SlotFor(event.worker));  // a cleared rank is known, holding nothing
    return Succeed(EventKind::kCleared);
  }

  // ---- Sliding-window groups ---------------------------------------------------------------

  ApplyResult SlidingFail(EventKind kind, EventError error, std::string message) {
    ++sliding_events_[SlidingRow(kind)][static_cast<int>(error)];
    ApplyResult result;
    result.error = error;
    result.message = std::move(message);
    return result;
  }
  static int SlidingRow(EventKind kind) { return kind == EventKind::kStored ? 0 : 1; }

  ApplyResult ApplyData(const KvEvent& event, const SlidingStoredEvent& stored) {
    std::unique_lock lock(mu_);  // before the counters too
    if (stored.window_tokens == 0) {
      return SlidingFail(EventKind::kStored, EventError::kInvalidBlock,
                         "a sliding-window store with a window of 0 tokens");
    }
    // A request resumes on the device only: what a window keeps elsewhere limits nothing.
    if (event.tier != Tier::kDevice) {
      return SlidingFail(EventKind::kStored, EventError::kInvalidBlock,
                         Message("a sliding-window store on tier ", TierName(event.tier),
                                 "; only the device's are tracked"));
    }
    const std::span<const uint64_t> given = stored.sequence_hashes;
    if (!given.empty() && given.size() != stored.block_hashes.size()) {
      return SlidingFail(EventKind::kStored, EventError::kInvalidBlock,
                         Message(stored.block_hashes.size(), " block hashes but ", given.size(),
                                 " sequence hashes; none applied"));
    }
    const uint32_t slot = SlotFor(event.worker);  // known from now on, as after a clear
    const PositionTable& blocks = workers_[slot].blocks;
    // Stores name consecutive blocks mostly: each one's sequence hash then follows from the
    // last one's, without walking to the root again.
    std::optional<std::pair<Position, uint64_t>> last;
    auto sequence_hash = [&](size_t i) -> std::optional<uint64_t> {
      if (!given.empty()) return given[i];
      const uint64_t entry = blocks.Get(stored.block_hashes[i]);
      if (entry == 0) return std::nullopt;
      const Position p = Resolve(EntryPosition(entry));
      const uint64_t local = Hashes(nodes_[p.node])[p.offset];
      uint64_t sequence;
      if (last && FollowsOn(last->first, p)) {
        sequence = NextSequenceHash(last->second, local);
      } else {
        thread_local std::vector<uint64_t> path;  // reversed: the block first
        path.clear();
        LocalPathReversed(p, path);
        sequence = path.back();
        for (size_t k = path.size() - 1; k-- > 0;) sequence = NextSequenceHash(sequence, path[k]);
      }
      last.emplace(p, sequence);
      return sequence;
    };
    SlidingWindows::Outcome outcome;
    try {
      outcome = sliding_.Store(event.worker, stored.group, stored.window_tokens,
                               stored.block_hashes, sequence_hash);
    } catch (const std::bad_alloc&) {
      // As for any event refused midway: the rank holds nothing (its sliding groups are gone
      // already), which its source learns from the refusal.
      DropAfterRefusal(event.worker);
      throw;
    }
    if (outcome.too_many_groups) {
      return SlidingFail(
          EventKind::kStored, EventError::kInvalidBlock,
          Message("worker ", event.worker.worker_id, " rank ", event.worker.dp_rank, " has ",
                  SlidingWindows::kMaxGroups, " sliding-window groups already; group ",
                  stored.group, " not recorded"));
    }
    return SlidingResult(EventKind::kStored, event.worker, stored.group, stored.block_hashes.size(),
                         outcome);
  }

  // A sliding event applied, or some of its blocks not: not held in full attention, for a store
  // (nowhere to place them), or not held by the group, for a removal.
  ApplyResult SlidingResult(EventKind kind, WorkerKey worker, int64_t group, size_t blocks,
                            const SlidingWindows::Outcome& outcome) {
    if (outcome.missing == 0) {
      ++sliding_events_[SlidingRow(kind)][static_cast<int>(EventError::kNone)];
      return ApplyResult{};
    }
    const bool stored = kind == EventKind::kStored;
    return SlidingFail(
        kind, EventError::kBlockNotFound,
        Message(outcome.missing, " of ", blocks, stored ? " stored" : " removed",
                " sliding-window blocks of group ", group, " not held by worker ", worker.worker_id,
                " rank ", worker.dp_rank, stored ? " in full attention" : " in that group",
                " (first: ", outcome.first_missing, "); the others applied"));
  }

  // Whether block `p` comes right after block `before` on one path.
  bool FollowsOn(Position before, Position p) const {
    if (p.node == before.node) return p.offset == before.offset + 1;
    return p.offset == 0 && nodes_[p.node].parent == before.node &&
           before.offset + 1 == nodes_[before.node].len;
  }

  ApplyResult ApplyData(const KvEvent& event, const SlidingRemovedEvent& removed) {
    std::unique_lock lock(mu_);
    if (event.tier != Tier::kDevice) {  // as for stores: it would take the device's copy
      return SlidingFail(EventKind::kRemoved, EventError::kInvalidBlock,
                         Message("a sliding-window removal on tier ", TierName(event.tier),
                                 "; only the device's are tracked"));
    }
    return SlidingResult(EventKind::kRemoved, event.worker, removed.group,
                         removed.block_hashes.size(),
                         sliding_.Remove(event.worker, removed.group, removed.block_hashes));
  }

  // ---- Matching ----------------------------------------------------------------------------

  WorkerMatch ToMatch(const ActiveWorker& a) const {
    const WorkerState& w = workers_[a.slot];
    return WorkerMatch{.worker = w.key,
                       .device_blocks = a.counts[0],
                       .host_hits = a.counts[1],
                       .disk_hits = a.counts[2],
                       .external_hits = a.counts[3],
                       .tree_size = w.blocks.size()};
  }

  // Moves each active worker on to `members` at `depth`: it keeps matching on its tier, moves
  // on to a later tier it holds this block on (device, then host, disk, external: §2.6), or
  // stops, and is then reported.
  void Reconcile(std::vector<ActiveWorker>& active, const MemberList& members, uint32_t depth,
                 std::vector<WorkerMatch>& out) const {
    const Member* m = members.begin();
    const Member* end = members.end();
    size_t kept = 0;
    for (ActiveWorker& a : active) {
      while (m != end && MemberSlot(*m) < a.slot) ++m;
      const uint8_t tiers = (m != end && MemberSlot(*m) == a.slot) ? MemberTiers(*m) : 0;
      if (!(tiers & (1u << a.tier))) {
        a.counts[a.tier] += depth - a.tier_start;
        const uint8_t later = tiers & static_cast<uint8_t>(~((2u << a.tier) - 1));
        if (later == 0) {
          out.push_back(ToMatch(a));
          continue;
        }
        a.tier = static_cast<uint8_t>(std::countr_zero(later));
        a.tier_start = depth;
      }
      active[kept++] = a;
    }
    active.resize(kept);
  }

  friend class RadixIndex;

  const RadixIndexOptions options_;
  mutable ScalableSharedMutex mu_;
  int64_t bytes_ = 0;  // declared before every container that counts into it
  SlabPool<Node> nodes_;
  std::vector<WorkerState, CountingAllocator<WorkerState>> workers_;
  // std::unordered_map: an insert the heap refuses leaves it as it was (not so Debian's abseil
  // flat_hash_map, see child_table.h). Looked up once per event, never per block.
  std::unordered_map<WorkerKey, uint32_t, absl::Hash<WorkerKey>, std::equal_to<>,
                     CountingAllocator<std::pair<const WorkerKey, uint32_t>>>
      slot_of_;
  std::vector<uint32_t, CountingAllocator<uint32_t>> free_slots_;  // room for every slot
  // ClearSlot's scratch: room for the largest table's nodes (ReserveToClear).
  std::vector<NodeId, CountingAllocator<NodeId>> held_;
  uint64_t refused_events_ = 0;  // events the heap refused part of (DropAfterRefusal)
  uint64_t cached_blocks_ = 0;
  uint64_t tree_blocks_ = 0;
  std::array<std::array<uint64_t, kNumEventErrors>, kNumEventKinds> events_{};
  uint64_t duplicate_stores_ = 0;
  std::vector<uint64_t> repeated_;  // the store being applied's repeats (ApplyResult::repeated)
  uint64_t rekeyed_blocks_ = 0;
  SlidingWindows sliding_;  // the sliding-window groups of hybrid models' ranks
  // Sliding-window stores [0] and removals [1], applied or not, by EventError.
  std::array<std::array<uint64_t, kNumEventErrors>, 2> sliding_events_{};
};

// ---- Dump, digest and invariants ---------------------------------------------------------------

namespace {

// The engine hashes (with their tiers) one worker slot holds one block under.
using HeldBlocks = absl::InlinedVector<std::pair<uint64_t, uint8_t>, 1>;

uint64_t BlockSlotKey(NodeId node, uint32_t offset, uint32_t slot) {
  return Combine(Combine(node, offset), slot);
}

KvEvent StoredBlocks(WorkerKey worker, Tier tier, uint64_t event_id, std::optional<uint64_t> parent,
                     std::vector<uint64_t> engine_hashes, std::vector<uint64_t> local_hashes) {
  StoredEvent stored;
  stored.parent_hash = parent;
  stored.block_hashes = std::move(engine_hashes);
  stored.local_hashes = std::move(local_hashes);
  return KvEvent{.worker = worker, .tier = tier, .event_id = event_id, .data = std::move(stored)};
}

}  // namespace

std::vector<KvEvent> RadixIndex::Impl::DumpEvents() const {
  std::shared_lock lock(mu_);
  // Every worker's blocks by position, each with its engine hashes (almost always one).
  // (std::unordered_map here and below: a growth the heap refuses must leave a map that can
  // still be destroyed, which Debian's abseil does not, see child_table.h.)
  std::unordered_map<uint64_t, HeldBlocks> held;
  for (uint32_t slot = 0; slot < workers_.size(); ++slot) {
    if (!workers_[slot].in_use) continue;
    workers_[slot].blocks.ForEach([&](uint64_t engine_hash, uint64_t entry) {
      const Position p = Resolve(EntryPosition(entry));
      held[BlockSlotKey(p.node, p.offset, slot)].emplace_back(engine_hash, EntryTiers(entry));
    });
  }
  for (auto& [key, hashes] : held) std::sort(hashes.begin(), hashes.end());
  auto held_at = [&](NodeId node, uint32_t offset, uint32_t slot) -> const HeldBlocks* {
    auto it = held.find(BlockSlotKey(node, offset, slot));
    return it == held.end() ? nullptr : &it->second;
  };
  std::vector<KvEvent> out;
  uint64_t event_id = 0;
  // Workers first, so that cleared workers (known, holding nothing) survive a replay.
  for (const WorkerState& w : workers_) {
    if (w.in_use && w.blocks.empty()) {
      out.push_back(KvEvent{.worker = w.key, .event_id = event_id++, .data = ClearedEvent{}});
    }
  }
  // Depth first (pre-order): parents come before children, and an index rebuilt from the dump
  // allocates each path together, as the engines' own events did (breadth first scattered the
  // paths: lookups on a restored index were 20x slower). One stored event per (run, worker)
  // when the worker holds the run simply (one engine hash per block, on one tier); the rare
  // other cases block by block.
  std::vector<NodeId> stack;
  ForEachChild(nodes_[kRoot], [&](NodeId c) { stack.push_back(c); });
  while (!stack.empty()) {
    const NodeId id = stack.back();
    stack.pop_back();
    const Node& node = nodes_[id];
    ForEachChild(node, [&](NodeId c) { stack.push_back(c); });
    const uint64_t* locals = Hashes(node);
    for (Member m : node.members) {
      const uint32_t slot = MemberSlot(m);
      const WorkerKey worker = workers_[slot].key;
      // The worker must be able to name the parent block. When it lost it (removals do not
      // cascade), rebuild the path with temporary blocks and remove them right after.
      std::optional<uint64_t> parent;
      std::vector<uint64_t> temp_hashes, temp_locals;
      {
        Position before{id, 0};  // the block before the run: walk back until one is held
        std::vector<uint64_t> missing;
        for (;;) {
          if (before.offset > 0) {
            --before.offset;
          } else {
            const NodeId up = nodes_[before.node].parent;
            if (up == kRoot) break;
            before = {up, nodes_[up].len - 1};
          }
          if (const HeldBlocks* h = held_at(before.node, before.offset, slot)) {
            parent = h->front().first;
            break;
          }
          missing.push_back(Hashes(nodes_[before.node])[before.offset]);
        }
        uint64_t temp = Mix(locals[0] ^ worker.worker_id ^ 0x7e3d0a11ull);
        for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
          while (workers_[slot].blocks.Contains(temp)) temp = Mix(temp);
          temp_hashes.push_back(temp);
          temp_locals.push_back(*it);
          temp = Mix(temp);
        }
      }
      const HeldBlocks& first = *held_at(id, 0, slot);
      bool simple = true;
      for (uint32_t k = 0; k < node.len && simple; ++k) {
        const HeldBlocks& h = *held_at(id, k, slot);
        simple = h.size() == 1 && h.front().second == first.front().second &&
                 std::has_single_bit(first.front().second);
      }
      std::optional<uint64_t> direct_parent =
          temp_hashes.empty() ? parent : std::optional<uint64_t>(temp_hashes.back());
      // The tiers the temporary blocks get stored on (one per stored event that starts with
      // them): each needs its removal.
      uint8_t temp_tiers = 0;
      auto temp_prefix = [&](Tier tier, std::vector<uint64_t>& hashes, std::vector<uint64_t>& ls) {
        hashes = temp_hashes;
        ls = temp_locals;
        temp_tiers |= static_cast<uint8_t>(1u << static_cast<int>(tier));
      };
      if (simple) {
        const Tier tier = static_cast<Tier>(std::countr_zero(first.front().second));
        std::vector<uint64_t> hashes, ls;
        temp_prefix(tier, hashes, ls);
        for (uint32_t k = 0; k < node.len; ++k) {
          hashes.push_back(held_at(id, k, slot)->front().first);
          ls.push_back(locals[k]);
        }
        out.push_back(StoredBlocks(worker, tier, event_id++, parent, hashes, ls));
      } else {
        for (uint32_t k = 0; k < node.len; ++k) {
          const HeldBlocks& h = *held_at(id, k, slot);
          for (const auto& [engine_hash, tiers] : h) {
            const Tier first_tier = static_cast<Tier>(std::countr_zero(tiers));
            std::vector<uint64_t> hashes, ls;
            if (k == 0) temp_prefix(first_tier, hashes, ls);
            hashes.push_back(engine_hash);
            ls.push_back(locals[k]);
            const std::optional<uint64_t> before =
                k == 0 ? parent : std::optional<uint64_t>(held_at(id, k - 1, slot)->front().first);
            out.push_back(StoredBlocks(worker, first_tier, event_id++, before, hashes, ls));
            const std::optional<uint64_t> block_parent = k == 0 ? direct_parent : before;
            for (int t = std::countr_zero(tiers) + 1; t < kNumTiers; ++t) {
              if (!((tiers >> t) & 1)) continue;
              out.push_back(StoredBlocks(worker, static_cast<Tier>(t), event_id++, block_parent,
                                         {engine_hash}, {locals[k]}));
            }
          }
        }
      }
      for (int t = 0; t < kNumTiers && !temp_hashes.empty(); ++t) {
        if (!((temp_tiers >> t) & 1)) continue;
        out.push_back(KvEvent{.worker = worker,
                              .tier = static_cast<Tier>(t),
                              .event_id = event_id++,
                              .data = RemovedEvent{.block_hashes = temp_hashes}});
      }
    }
  }
  // The sliding-window groups last, each whole in one store that names its blocks' places by
  // sequence hash: they need not be held in full attention any more (a group outlives a full-
  // attention block its engine evicted first). A group holding nothing is stored all the same:
  // that a rank has it changes its answers.
  sliding_.ForEachGroup([&](WorkerKey rank, int64_t group, uint32_t window_tokens,
                            std::span<const std::pair<uint64_t, uint64_t>> blocks) {
    SlidingStoredEvent stored;
    stored.group = group;
    stored.window_tokens = window_tokens;
    for (const auto& [engine_hash, sequence] : blocks) {
      stored.block_hashes.push_back(engine_hash);
      stored.sequence_hashes.push_back(sequence);
    }
    out.push_back(KvEvent{.worker = rank, .event_id = event_id++, .data = std::move(stored)});
  });
  return out;
}

uint64_t RadixIndex::Impl::StateDigest() const {
  std::shared_lock lock(mu_);
  // The path hash of every block a worker holds (its local hashes from the root), which does
  // not depend on how the runs happen to be split: a restored index has the same digest.
  std::unordered_map<NodeId, std::vector<uint64_t>> block_paths;
  std::vector<NodeId> pending;
  auto paths_of = [&](NodeId id) -> const std::vector<uint64_t>& {
    for (NodeId n = id; n != kRoot && !block_paths.contains(n); n = nodes_[n].parent) {
      pending.push_back(n);
    }
    while (!pending.empty()) {
      const NodeId n = pending.back();
      pending.pop_back();
      const NodeId up = nodes_[n].parent;
      uint64_t path = up == kRoot ? 0 : block_paths.at(up).back();
      std::vector<uint64_t>& paths = block_paths[n];
      for (uint32_t k = 0; k < nodes_[n].len; ++k) {
        path = Combine(path, Hashes(nodes_[n])[k]);
        paths.push_back(path);
      }
    }
    return block_paths.at(id);
  };
  uint64_t digest = 0;
  for (const WorkerState& w : workers_) {
    // A rank holding nothing is left out: whether this index ever heard of it (a replica that
    // saw a worker's blocks come and go, one restored from a snapshot without them) changes no
    // answer, and replicas comparing digests must agree.
    if (!w.in_use || w.blocks.empty()) continue;
    const uint64_t worker = Combine(w.key.worker_id, w.key.dp_rank);
    digest += Mix(worker);
    w.blocks.ForEach([&](uint64_t engine_hash, uint64_t entry) {
      const Position p = Resolve(EntryPosition(entry));
      digest += Combine(Combine(worker, engine_hash),
                        Combine(EntryTiers(entry), paths_of(p.node)[p.offset]));
    });
  }
  sliding_.ForEachGroup([&](WorkerKey rank, int64_t group, uint32_t window_tokens,
                            std::span<const std::pair<uint64_t, uint64_t>> blocks) {
    const uint64_t key = Combine(Combine(Combine(rank.worker_id, rank.dp_rank), ~uint64_t{0}),
                                 Combine(static_cast<uint64_t>(group), window_tokens));
    digest += Mix(key);
    for (const auto& [engine_hash, sequence] : blocks) {
      digest += Combine(key, Combine(engine_hash, sequence));
    }
  });
  return digest;
}

// Every structural promise, checked: "" when all hold, else the first broken one.
std::string RadixIndex::Impl::CheckInvariants() const {
  std::shared_lock lock(mu_);
  if (std::string broken = sliding_.CheckInvariants(); !broken.empty()) return broken;
  std::string unknown_rank;
  sliding_.ForEachGroup(
      [&](WorkerKey rank, int64_t group, uint32_t, std::span<const std::pair<uint64_t, uint64_t>>) {
        if (!slot_of_.contains(rank) && unknown_rank.empty()) {
          unknown_rank = Message("sliding-window group ", group, " of worker ", rank.worker_id,
                                 " rank ", rank.dp_rank, ", which the index does not know");
        }
      });
  if (!unknown_rank.empty()) return unknown_rank;
  // Per (node, slot, tier): how many of the slot's engine hashes name each block of the run.
  std::unordered_map<uint64_t, std::vector<std::array<uint32_t, kNumTiers>>> counts;
  uint64_t entries = 0;
  for (uint32_t slot = 0; slot < workers_.size(); ++slot) {
    if (!workers_[slot].in_use) continue;
    std::string problem;
    workers_[slot].blocks.ForEach([&](uint64_t engine_hash, uint64_t entry) {
      ++entries;
      const Position p = Resolve(EntryPosition(entry));
      if (p.node == kNoNode || p.offset >= nodes_[p.node].len) {
        problem = Message("entry ", engine_hash, " of slot ", slot, " resolves nowhere");
        return;
      }
      auto& per_block = counts[Combine(p.node, slot)];
      per_block.resize(nodes_[p.node].len);
      for (int t = 0; t < kNumTiers; ++t) {
        if ((EntryTiers(entry) >> t) & 1) ++per_block[p.offset][t];
      }
    });
    if (!problem.empty()) return problem;
  }
  if (entries != cached_blocks_) {
    return Message(entries, " table entries, ", cached_blocks_, " cached blocks counted");
  }
  uint64_t nodes = 0;
  std::vector<NodeId> stack{kRoot};
  while (!stack.empty()) {
    const NodeId id = stack.back();
    stack.pop_back();
    ++nodes;
    const Node& n = nodes_[id];
    bool linked = true;
    ForEachChild(n, [&](NodeId c) {
      stack.push_back(c);
      linked = linked && nodes_[c].parent == id && FindChild(id, Hashes(nodes_[c])[0]) == c;
    });
    if (!linked) return Message("a child of node ", id, " is not linked both ways");
    if (id != kRoot && n.len == 0) return Message("node ", id, " has an empty run");
    if (id != kRoot && n.members.empty() && n.num_children == 0) {
      return Message("node ", id, " holds nothing and leads nowhere");
    }
    // Each member holds every block of the run with the same counts its word records.
    for (Member m : n.members) {
      auto it = counts.find(Combine(id, MemberSlot(m)));
      if (it == counts.end()) {
        return Message("slot ", MemberSlot(m), " is a member of node ", id,
                       " but names none of its blocks");
      }
      for (uint32_t k = 0; k < n.len; ++k) {
        for (int t = 0; t < kNumTiers; ++t) {
          if (it->second[k][t] != MemberCount(m, t)) {
            return Message("node ", id, " block ", k, ": slot ", MemberSlot(m), " holds it ",
                           it->second[k][t], " times on tier ", t, ", its member word says ",
                           MemberCount(m, t));
          }
        }
      }
      counts.erase(it);
    }
  }
  if (!counts.empty()) return "a worker names blocks of a node it is not a member of";
  if (nodes != nodes_.live()) {
    return Message(nodes, " nodes reachable, ", nodes_.live(), " allocated");
  }
  return {};
}

// ---- Public wrappers -------------------------------------------------------------------------

// The shards: one tree per group of workers, a worker's ranks all in one (its events and its
// removal touch one tree): worker w in tree w mod shards, a rule an applier can use to give
// each of its threads whole trees. Calls about one worker go to its shard; lookups and totals
// visit every shard.
namespace {

size_t ShardCount(const RadixIndexOptions& options) {
  return std::clamp<size_t>(options.shards, 1, kMaxIndexShards);
}

}  // namespace

RadixIndex::RadixIndex(RadixIndexOptions options) : options_(options) {
  options_.shards = static_cast<uint32_t>(ShardCount(options));
  for (uint32_t s = 0; s < options_.shards; ++s)
    shards_.push_back(std::make_unique<Impl>(options_));
}
RadixIndex::~RadixIndex() = default;

uint32_t RadixIndex::ShardOf(uint64_t worker_id) const {
  return static_cast<uint32_t>(worker_id % shards_.size());
}
RadixIndex::Impl& RadixIndex::Shard(uint64_t worker_id) const {
  return *shards_[ShardOf(worker_id)];
}

uint32_t RadixIndex::block_size() const { return options_.block_size; }
uint32_t RadixIndex::shards() const { return options_.shards; }
ApplyResult RadixIndex::Apply(const KvEvent& event) {
  return Shard(event.worker.worker_id).Apply(event);
}
void RadixIndex::FindMatches(std::span<const uint64_t> local_hashes, std::vector<WorkerMatch>& out,
                             size_t computable_blocks) const {
  out.clear();
  for (const auto& shard : shards_) shard->AppendMatches(local_hashes, computable_blocks, out);
}
std::vector<WorkerMatch> RadixIndex::FindMatches(std::span<const uint64_t> local_hashes,
                                                 size_t computable_blocks) const {
  std::vector<WorkerMatch> out;
  FindMatches(local_hashes, out, computable_blocks);
  return out;
}
size_t RadixIndex::RemoveWorker(uint64_t worker_id) {
  return Shard(worker_id).RemoveWorker(worker_id);
}
size_t RadixIndex::RemoveWorkerDpRank(WorkerKey worker) {
  return Shard(worker.worker_id).RemoveWorkerDpRank(worker);
}
uint64_t RadixIndex::TreeSize(WorkerKey worker) const {
  return Shard(worker.worker_id).TreeSize(worker);
}
uint64_t RadixIndex::CachedBlocks() const {
  uint64_t total = 0;
  for (const auto& shard : shards_) total += shard->CachedBlocks();
  return total;
}
size_t RadixIndex::HeldPrefix(WorkerKey worker, std::span<const uint64_t> engine_hashes) const {
  return Shard(worker.worker_id).HeldPrefix(worker, engine_hashes);
}
std::vector<uint64_t> RadixIndex::PathTo(WorkerKey worker, uint64_t engine_hash) const {
  std::vector<uint64_t> path;
  Shard(worker.worker_id).PathTo(worker, engine_hash, path);
  return path;
}
void RadixIndex::PathTo(WorkerKey worker, uint64_t engine_hash, std::vector<uint64_t>& path) const {
  Shard(worker.worker_id).PathTo(worker, engine_hash, path);
}
RadixIndex::TailDrop RadixIndex::DropPathTail(WorkerKey worker,
                                              std::span<const uint64_t> engine_hashes, size_t limit,
                                              absl::FunctionRef<bool(uint64_t)> keep) {
  return Shard(worker.worker_id).DropPathTail(worker, engine_hashes, limit, keep);
}
std::vector<WorkerKey> RadixIndex::Workers() const {
  std::vector<WorkerKey> all;
  for (const auto& shard : shards_) {
    const std::vector<WorkerKey> some = shard->Workers();
    all.insert(all.end(), some.begin(), some.end());
  }
  return all;
}
IndexStats RadixIndex::Stats() const {
  IndexStats total;
  for (const auto& shard : shards_) {
    const IndexStats s = shard->Stats();
    total.nodes += s.nodes;
    total.tree_blocks += s.tree_blocks;
    total.cached_blocks += s.cached_blocks;
    total.workers += s.workers;
    total.allocated_bytes += s.allocated_bytes;
    for (size_t k = 0; k < total.events.size(); ++k) {
      for (size_t e = 0; e < total.events[k].size(); ++e) total.events[k][e] += s.events[k][e];
    }
    total.duplicate_stores += s.duplicate_stores;
    total.rekeyed_blocks += s.rekeyed_blocks;
    total.refused_events += s.refused_events;
    total.sliding_blocks += s.sliding_blocks;
    for (size_t k = 0; k < total.sliding_events.size(); ++k) {
      for (size_t e = 0; e < total.sliding_events[k].size(); ++e) {
        total.sliding_events[k][e] += s.sliding_events[k][e];
      }
    }
  }
  return total;
}
std::vector<KvEvent> RadixIndex::DumpEvents() const {
  std::vector<KvEvent> all;
  for (const auto& shard : shards_) {
    std::vector<KvEvent> some = shard->DumpEvents();
    for (KvEvent& e : some) {
      e.event_id = all.size();
      all.push_back(std::move(e));
    }
  }
  return all;
}
uint64_t RadixIndex::StateDigest() const {
  uint64_t digest = 0;  // a sum over worker ranks, as each shard's is
  for (const auto& shard : shards_) digest += shard->StateDigest();
  return digest;
}
std::string RadixIndex::CheckInvariants() const {
  for (const auto& shard : shards_) {
    if (std::string broken = shard->CheckInvariants(); !broken.empty()) return broken;
  }
  return "";
}

}  // namespace kvrouter
