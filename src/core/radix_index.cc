#include "core/radix_index.h"

#include <absl/container/flat_hash_map.h>
#include <absl/container/flat_hash_set.h>
#include <absl/container/inlined_vector.h>
#include <absl/strings/str_format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <mutex>

#include "core/counting_allocator.h"
#include "core/hashing.h"
#include "core/shrink.h"
#include "core/slab_pool.h"

namespace kvrouter {

namespace {

using NodeId = uint32_t;
constexpr NodeId kRoot = 0;
constexpr NodeId kNoNode = ~0u;
// Node ids share a 32-bit word with 4 tier bits in the per-worker block tables.
constexpr uint64_t kMaxNodes = uint64_t{1} << 28;

uint8_t TierBit(Tier tier) { return static_cast<uint8_t>(1u << static_cast<int>(tier)); }

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

  Member* Insert(uint32_t slot, Alloc alloc) {
    if (size_ == Capacity()) Reallocate(size_ == 0 ? 1 : std::max<uint32_t>(4, 2 * size_), alloc);
    Member* first = data();
    Member* it = std::lower_bound(first, first + size_, NewMember(slot));
    std::memmove(it + 1, it, (first + size_ - it) * sizeof(Member));
    *it = NewMember(slot);
    ++size_;
    return it;
  }

  void Erase(Member* it, Alloc alloc) {
    Member* first = data();
    std::memmove(it, it + 1, (first + size_ - it - 1) * sizeof(Member));
    --size_;
    if (capacity_ > 0 && size_ <= capacity_ / 4) Reallocate(size_ <= 1 ? 0 : capacity_ / 2, alloc);
  }

  void Release(Alloc alloc) {
    if (capacity_ > 0) alloc.deallocate(heap_, capacity_);
    capacity_ = 0;
    size_ = 0;
  }

 private:
  uint32_t Capacity() const { return capacity_ == 0 ? 1 : capacity_; }

  // capacity 0 means the single inline slot.
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

using ChildMap = absl::flat_hash_map<uint64_t, NodeId, absl::Hash<uint64_t>, std::equal_to<>,
                                     CountingAllocator<std::pair<const uint64_t, NodeId>>>;

// One block position in the tree. 40 bytes; children are a single id in the common case.
struct Node {
  uint64_t local_hash;
  NodeId parent;
  uint32_t num_children;
  union {
    NodeId only_child;   // num_children == 1
    ChildMap* children;  // num_children >= 2
  };
  MemberList members;
};

// Per-worker table value: node id and the tiers on which this engine hash is held.
uint32_t PackEntry(NodeId node, uint8_t tiers) { return (node << 4) | tiers; }
NodeId EntryNode(uint32_t entry) { return entry >> 4; }
uint8_t EntryTiers(uint32_t entry) { return entry & 0xf; }

// One entry of a worker's table: an engine hash and PackEntry(node, tiers), packed into 12
// bytes. (A map's pair<uint64_t, uint32_t> pads to 16; with a worker's table the largest
// structure in the index, the 4 bytes are 7% of the memory per cached block.)
struct BlockSlot {
  BlockSlot(uint64_t engine_hash, uint32_t entry)
      : hash_low(static_cast<uint32_t>(engine_hash)),
        hash_high(static_cast<uint32_t>(engine_hash >> 32)),
        entry(entry) {}
  uint64_t engine_hash() const { return (static_cast<uint64_t>(hash_high) << 32) | hash_low; }

  uint32_t hash_low;
  uint32_t hash_high;
  mutable uint32_t entry;  // not part of the key
};
static_assert(sizeof(BlockSlot) == 12);

// Hash and equality that also take a bare engine hash, so lookups need no BlockSlot.
struct BlockSlotHash {
  using is_transparent = void;
  size_t operator()(uint64_t engine_hash) const { return absl::Hash<uint64_t>()(engine_hash); }
  size_t operator()(const BlockSlot& s) const { return (*this)(s.engine_hash()); }
};
struct BlockSlotEq {
  using is_transparent = void;
  static uint64_t Key(uint64_t engine_hash) { return engine_hash; }
  static uint64_t Key(const BlockSlot& s) { return s.engine_hash(); }
  template <typename A, typename B>
  bool operator()(const A& a, const B& b) const {
    return Key(a) == Key(b);
  }
};

using BlockTable =
    absl::flat_hash_set<BlockSlot, BlockSlotHash, BlockSlotEq, CountingAllocator<BlockSlot>>;

struct WorkerState {
  WorkerKey key;
  bool in_use = false;
  BlockTable blocks;  // engine hash -> PackEntry(node, tiers)
};

uint64_t Mix(uint64_t x) {  // splitmix64 finaliser: a fixed, well-spread 64-bit mix
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t Combine(uint64_t a, uint64_t b) { return Mix(a ^ Mix(b)); }

// Per-worker progress along a prompt while matching: which tier it is matching on now and
// where that tier's run started.
struct ActiveWorker {
  uint32_t slot;
  uint8_t tier;
  uint32_t tier_start;
  std::array<uint32_t, kNumTiers> counts;
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
        free_slots_(CountingAllocator<uint32_t>(&bytes_)) {
    const NodeId root = nodes_.Allocate();
    InitNode(root, 0, kNoNode);
  }

  ~Impl() {
    for (auto& w : workers_) w.blocks = MakeTable();
    ReleaseSubtree(kRoot);
  }

  uint32_t block_size() const { return options_.block_size; }

  ApplyResult Apply(const KvEvent& event) {
    return std::visit([&](const auto& data) { return ApplyData(event, data); }, event.data);
  }

  void FindMatches(std::span<const uint64_t> local_hashes, std::vector<WorkerMatch>& out) const {
    out.clear();
    std::shared_lock lock(mu_);
    if (local_hashes.empty()) return;
    NodeId node = FindChild(kRoot, local_hashes[0]);
    if (node == kNoNode) return;
    absl::InlinedVector<ActiveWorker, 16> active;
    for (Member m : nodes_[node].members) {
      active.push_back(
          {MemberSlot(m), static_cast<uint8_t>(std::countr_zero(MemberTiers(m))), 0, {}});
    }
    const MemberList* previous = &nodes_[node].members;
    uint32_t depth = 1;
    for (; depth < local_hashes.size() && !active.empty(); ++depth) {
      const NodeId child = FindChild(node, local_hashes[depth]);
      if (child == kNoNode) break;
      const MemberList& members = nodes_[child].members;
      // Most steps see exactly the previous node's holders: nothing to update then.
      if (!members.SameAs(*previous)) Reconcile(active, members, depth, out);
      previous = &members;
      node = child;
    }
    for (ActiveWorker& a : active) {
      a.counts[a.tier] += depth - a.tier_start;
      out.push_back(ToMatch(a));
    }
  }

  size_t RemoveWorker(uint64_t worker_id) {
    std::unique_lock lock(mu_);
    size_t dropped = 0;
    for (uint32_t slot : SlotsOf(worker_id)) dropped += ReleaseSlot(slot);
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
    s.cached_blocks = cached_blocks_;
    s.workers = slot_of_.size();
    s.allocated_bytes = bytes_;
    s.events = events_;
    s.duplicate_stores = duplicate_stores_;
    s.rekeyed_blocks = rekeyed_blocks_;
    return s;
  }

  std::vector<KvEvent> DumpEvents() const;
  uint64_t StateDigest() const;

 private:
  // ---- Tree structure ----------------------------------------------------------------------

  BlockTable MakeTable() {
    return BlockTable(0, BlockSlotHash(), BlockSlotEq(), CountingAllocator<BlockSlot>(&bytes_));
  }

  void InitNode(NodeId id, uint64_t local_hash, NodeId parent) {
    Node& n = nodes_[id];
    n.local_hash = local_hash;
    n.parent = parent;
    n.num_children = 0;
    n.only_child = kNoNode;
    n.members = MemberList();
  }

  NodeId FindChild(NodeId parent, uint64_t local_hash) const {
    const Node& p = nodes_[parent];
    if (p.num_children == 1) {
      return nodes_[p.only_child].local_hash == local_hash ? p.only_child : kNoNode;
    }
    if (p.num_children == 0) return kNoNode;
    auto it = p.children->find(local_hash);
    return it == p.children->end() ? kNoNode : it->second;
  }

  NodeId AddChild(NodeId parent, uint64_t local_hash) {
    const NodeId child = nodes_.Allocate();
    InitNode(child, local_hash, parent);
    Node& p = nodes_[parent];
    if (p.num_children == 0) {
      p.only_child = child;
    } else {
      if (p.num_children == 1) {
        const NodeId first = p.only_child;
        CountingAllocator<ChildMap> alloc(&bytes_);
        p.children = new (alloc.allocate(1))
            ChildMap(0, absl::Hash<uint64_t>(), std::equal_to<>(),
                     CountingAllocator<std::pair<const uint64_t, NodeId>>(&bytes_));
        p.children->emplace(nodes_[first].local_hash, first);
      }
      p.children->emplace(local_hash, child);
    }
    ++p.num_children;
    return child;
  }

  void DeleteChildMap(ChildMap* map) {
    map->~ChildMap();
    CountingAllocator<ChildMap>(&bytes_).deallocate(map, 1);
  }

  void UnlinkChild(NodeId parent, NodeId child) {
    Node& p = nodes_[parent];
    if (p.num_children == 1) {
      p.only_child = kNoNode;
    } else {
      p.children->erase(nodes_[child].local_hash);
      if (p.num_children == 2) {
        ChildMap* map = p.children;
        p.only_child = map->begin()->second;
        DeleteChildMap(map);
      } else {
        ShrinkTableIfSparse(*p.children);
      }
    }
    --p.num_children;
  }

  // Frees `id` and every ancestor that is left holding nothing and leading nowhere.
  void FreeIfUnused(NodeId id) {
    while (id != kRoot && nodes_[id].members.empty() && nodes_[id].num_children == 0) {
      const NodeId parent = nodes_[id].parent;
      UnlinkChild(parent, id);
      nodes_[id].members.Release(MemberList::Alloc(&bytes_));
      nodes_.Free(id);
      id = parent;
    }
  }

  void ReleaseSubtree(NodeId root) {  // destructor only: no unlinking needed
    std::vector<NodeId> stack{root};
    while (!stack.empty()) {
      const NodeId id = stack.back();
      stack.pop_back();
      Node& n = nodes_[id];
      if (n.num_children == 1) stack.push_back(n.only_child);
      if (n.num_children >= 2) {
        for (const auto& [hash, child] : *n.children) stack.push_back(child);
        DeleteChildMap(n.children);
      }
      n.members.Release(MemberList::Alloc(&bytes_));
      nodes_.Free(id);
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

  // ---- Workers -----------------------------------------------------------------------------

  uint32_t SlotFor(WorkerKey key) {
    auto [it, inserted] = slot_of_.try_emplace(key, 0);
    if (!inserted) return it->second;
    uint32_t slot;
    if (!free_slots_.empty()) {
      slot = free_slots_.back();
      free_slots_.pop_back();
    } else {
      slot = static_cast<uint32_t>(workers_.size());
      workers_.push_back(WorkerState{.key = key, .in_use = false, .blocks = MakeTable()});
    }
    workers_[slot].key = key;
    workers_[slot].in_use = true;
    it->second = slot;
    return slot;
  }

  std::vector<uint32_t> SlotsOf(uint64_t worker_id) const {
    std::vector<uint32_t> slots;
    for (const auto& [key, slot] : slot_of_) {
      if (key.worker_id == worker_id) slots.push_back(slot);
    }
    return slots;
  }

  // Drops every block of the slot; the worker stays known. Returns the blocks dropped.
  size_t ClearSlot(uint32_t slot) {
    BlockTable& blocks = workers_[slot].blocks;
    const size_t dropped = blocks.size();
    // Several engine hashes of one worker may name the same node; visit each node once, since
    // freeing it on the first visit would leave the second reading a dead node.
    std::vector<NodeId> held;
    held.reserve(blocks.size());
    for (const BlockSlot& b : blocks) held.push_back(EntryNode(b.entry));
    std::sort(held.begin(), held.end());
    held.erase(std::unique(held.begin(), held.end()), held.end());
    for (NodeId node : held) {
      MemberList& members = nodes_[node].members;
      if (Member* m = members.Find(slot)) members.Erase(m, MemberList::Alloc(&bytes_));
      FreeIfUnused(node);
    }
    blocks = MakeTable();  // also returns the table's capacity to the heap
    cached_blocks_ -= dropped;
    return dropped;
  }

  size_t ReleaseSlot(uint32_t slot) {
    const size_t dropped = ClearSlot(slot);
    slot_of_.erase(workers_[slot].key);
    workers_[slot].in_use = false;
    free_slots_.push_back(slot);
    CompactWorkers();
    return dropped;
  }

  // Gives back the slots of removed workers at the end of the slot array, and spare capacity.
  void CompactWorkers() {
    while (!workers_.empty() && !workers_.back().in_use) workers_.pop_back();
    std::erase_if(free_slots_, [&](uint32_t slot) { return slot >= workers_.size(); });
    ShrinkIfSparse(workers_);
    ShrinkIfSparse(free_slots_);
    ShrinkTableIfSparse(slot_of_);
  }

  // ---- Events ------------------------------------------------------------------------------

  ApplyResult Fail(EventKind kind, EventError error, std::string message) {
    ++events_[static_cast<int>(kind)][static_cast<int>(error)];
    return ApplyResult{error, std::move(message)};
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
    return Store(event.worker, event.tier, stored, locals);
  }

  ApplyResult Store(WorkerKey worker, Tier tier, const StoredEvent& stored,
                    std::span<const uint64_t> locals) {
    const uint32_t slot = SlotFor(worker);
    BlockTable& blocks = workers_[slot].blocks;
    NodeId parent = kRoot;
    if (stored.parent_hash) {
      auto it = blocks.find(*stored.parent_hash);
      if (it == blocks.end()) {
        return Fail(EventKind::kStored, EventError::kParentBlockNotFound,
                    absl::StrFormat("parent block %u not found for worker %u rank %u",
                                    *stored.parent_hash, worker.worker_id, worker.dp_rank));
      }
      parent = EntryNode(it->entry);
    }
    const size_t n = std::min(stored.block_hashes.size(), locals.size());
    absl::InlinedVector<NodeId, 32> path;  // nodes this event walked, to catch cycles
    path.push_back(parent);
    for (size_t i = 0; i < n; ++i) {
      const uint64_t engine_hash = stored.block_hashes[i];
      auto [it, inserted] = blocks.emplace(engine_hash, 0);
      if (!inserted) {
        const NodeId known = EntryNode(it->entry);
        if (std::find(path.begin(), path.end(), known) != path.end()) {
          return Fail(EventKind::kStored, EventError::kInvalidBlockSequence,
                      absl::StrFormat("block %u (index %u) repeats an earlier block of its "
                                      "sequence; %u of %u blocks applied",
                                      engine_hash, i, i, stored.block_hashes.size()));
        }
        const NodeId existing = FindChild(parent, locals[i]);
        if (known == existing) {
          StoreAgain(slot, tier, existing, it->entry);
          parent = existing;
          path.push_back(parent);
          continue;
        }
        // The engine reused this hash for another prefix: it now names this block only.
        ++rekeyed_blocks_;
        RemoveFromNode(known, slot, EntryTiers(it->entry));
        FreeIfUnused(known);
        --cached_blocks_;
      }
      NodeId child = FindChild(parent, locals[i]);
      if (child == kNoNode) {
        if (nodes_.live() >= kMaxNodes) {
          blocks.erase(it);
          return Fail(EventKind::kStored, EventError::kInvalidBlock,
                      "index is full (2^28 nodes); block not stored");
        }
        child = AddChild(parent, locals[i]);
      }
      it->entry = PackEntry(child, TierBit(tier));
      AddToNode(child, slot, tier);
      ++cached_blocks_;
      parent = child;
      path.push_back(parent);
    }
    if (stored.block_hashes.size() != locals.size()) {
      return Fail(
          EventKind::kStored, EventError::kInvalidBlock,
          absl::StrFormat("%u block hashes but %u complete blocks of %u tokens; the "
                          "first %u blocks applied",
                          stored.block_hashes.size(), locals.size(), options_.block_size, n));
    }
    return Succeed(EventKind::kStored);
  }

  // The worker stores a block it already holds under the same engine hash (maybe on another
  // tier, e.g. an offload copy).
  void StoreAgain(uint32_t slot, Tier tier, NodeId node, uint32_t& entry) {
    if (EntryTiers(entry) & TierBit(tier)) {
      ++duplicate_stores_;
      return;
    }
    entry |= TierBit(tier);
    AddToNode(node, slot, tier);
  }

  ApplyResult ApplyData(const KvEvent& event, const RemovedEvent& removed) {
    std::unique_lock lock(mu_);
    auto slot_it = slot_of_.find(event.worker);
    std::string first_missing;
    size_t missing = 0;
    for (uint64_t engine_hash : removed.block_hashes) {
      if (slot_it == slot_of_.end() || !RemoveBlock(slot_it->second, event.tier, engine_hash)) {
        if (missing++ == 0) first_missing = absl::StrFormat("%u", engine_hash);
      }
    }
    if (missing > 0) {
      return Fail(EventKind::kRemoved, EventError::kBlockNotFound,
                  absl::StrFormat("%u of %u removed blocks not found on tier %s for worker %u "
                                  "rank %u (first: %s); the others were removed",
                                  missing, removed.block_hashes.size(), TierName(event.tier),
                                  event.worker.worker_id, event.worker.dp_rank, first_missing));
    }
    return Succeed(EventKind::kRemoved);
  }

  bool RemoveBlock(uint32_t slot, Tier tier, uint64_t engine_hash) {
    BlockTable& blocks = workers_[slot].blocks;
    auto it = blocks.find(engine_hash);
    if (it == blocks.end() || !(EntryTiers(it->entry) & TierBit(tier))) return false;
    const NodeId node = EntryNode(it->entry);
    RemoveFromNode(node, slot, TierBit(tier));
    it->entry &= ~static_cast<uint32_t>(TierBit(tier));
    if (EntryTiers(it->entry) == 0) {
      blocks.erase(it);
      --cached_blocks_;
      ShrinkTableIfSparse(blocks);
    }
    FreeIfUnused(node);
    return true;
  }

  ApplyResult ApplyData(const KvEvent& event, const ClearedEvent&) {
    std::unique_lock lock(mu_);
    SlotFor(event.worker);  // a cleared worker is known, holding nothing
    for (uint32_t slot : SlotsOf(event.worker.worker_id)) ClearSlot(slot);
    return Succeed(EventKind::kCleared);
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
  void Reconcile(absl::InlinedVector<ActiveWorker, 16>& active, const MemberList& members,
                 uint32_t depth, std::vector<WorkerMatch>& out) const {
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
  mutable std::shared_mutex mu_;
  int64_t bytes_ = 0;  // declared before every container that counts into it
  SlabPool<Node> nodes_;
  std::vector<WorkerState, CountingAllocator<WorkerState>> workers_;
  absl::flat_hash_map<WorkerKey, uint32_t, absl::Hash<WorkerKey>, std::equal_to<>,
                      CountingAllocator<std::pair<const WorkerKey, uint32_t>>>
      slot_of_;
  std::vector<uint32_t, CountingAllocator<uint32_t>> free_slots_;
  uint64_t cached_blocks_ = 0;
  std::array<std::array<uint64_t, kNumEventErrors>, kNumEventKinds> events_{};
  uint64_t duplicate_stores_ = 0;
  uint64_t rekeyed_blocks_ = 0;
};

// ---- Dump and digest ---------------------------------------------------------------------------

namespace {

// For one (node, worker slot): the worker's engine hashes naming that node, with their tiers.
using HeldBlocks = absl::InlinedVector<std::pair<uint64_t, uint8_t>, 1>;
uint64_t NodeSlotKey(NodeId node, uint32_t slot) {
  return (static_cast<uint64_t>(node) << 32) | slot;
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
  absl::flat_hash_map<uint64_t, HeldBlocks> held;
  for (uint32_t slot = 0; slot < workers_.size(); ++slot) {
    if (!workers_[slot].in_use) continue;
    for (const BlockSlot& b : workers_[slot].blocks) {
      held[NodeSlotKey(EntryNode(b.entry), slot)].emplace_back(b.engine_hash(),
                                                               EntryTiers(b.entry));
    }
  }
  std::vector<KvEvent> out;
  uint64_t event_id = 0;
  // Workers first, so that cleared workers (known, holding nothing) survive a replay.
  for (const WorkerState& w : workers_) {
    if (w.in_use && w.blocks.empty()) {
      out.push_back(KvEvent{.worker = w.key, .event_id = event_id++, .data = ClearedEvent{}});
    }
  }
  // The engine hash naming `node` for `slot`, if the worker holds it.
  auto held_hash = [&](NodeId node, uint32_t slot) -> std::optional<uint64_t> {
    auto it = held.find(NodeSlotKey(node, slot));
    if (it == held.end()) return std::nullopt;
    return it->second.front().first;
  };
  // Depth first (pre-order): parents still come before children, and an index rebuilt from
  // the dump allocates each path's nodes together, as the engines' own events did. (Breadth
  // first scattered every path across the node pool: lookups on a restored index of the
  // Mooncake trace were 20x slower.)
  std::vector<NodeId> stack;
  auto push_children = [&](NodeId id) {
    const Node& n = nodes_[id];
    if (n.num_children == 1) stack.push_back(n.only_child);
    if (n.num_children >= 2) {
      for (const auto& [hash, child] : *n.children) stack.push_back(child);
    }
  };
  push_children(kRoot);
  while (!stack.empty()) {
    const NodeId id = stack.back();
    stack.pop_back();
    push_children(id);
    const Node& node = nodes_[id];
    for (Member m : node.members) {
      const uint32_t slot = MemberSlot(m);
      const WorkerKey worker = workers_[slot].key;
      for (const auto& [engine_hash, tiers] : held.at(NodeSlotKey(id, slot))) {
        // The worker must be able to name the parent. When it lost the parent (removals do
        // not cascade), rebuild the path with temporary blocks and remove them right after.
        std::vector<uint64_t> temp_hashes, temp_locals;
        std::optional<uint64_t> parent;
        NodeId ancestor = node.parent;
        std::vector<NodeId> missing;
        while (ancestor != kRoot && !(parent = held_hash(ancestor, slot))) {
          missing.push_back(ancestor);
          ancestor = nodes_[ancestor].parent;
        }
        uint64_t temp = Mix(engine_hash ^ 0x7e3d0a11ull);
        for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
          while (workers_[slot].blocks.contains(temp)) temp = Mix(temp);
          temp_hashes.push_back(temp);
          temp_locals.push_back(nodes_[*it].local_hash);
          temp = Mix(temp);
        }
        const Tier first_tier = static_cast<Tier>(std::countr_zero(tiers));
        std::vector<uint64_t> hashes = temp_hashes, locals = temp_locals;
        hashes.push_back(engine_hash);
        locals.push_back(node.local_hash);
        out.push_back(StoredBlocks(worker, first_tier, event_id++, parent, hashes, locals));
        const std::optional<uint64_t> direct_parent =
            temp_hashes.empty() ? parent : std::optional<uint64_t>(temp_hashes.back());
        for (int t = std::countr_zero(tiers) + 1; t < kNumTiers; ++t) {
          if (!((tiers >> t) & 1)) continue;
          out.push_back(StoredBlocks(worker, static_cast<Tier>(t), event_id++, direct_parent,
                                     {engine_hash}, {node.local_hash}));
        }
        if (!temp_hashes.empty()) {
          out.push_back(KvEvent{.worker = worker,
                                .tier = first_tier,
                                .event_id = event_id++,
                                .data = RemovedEvent{.block_hashes = temp_hashes}});
        }
      }
    }
  }
  return out;
}

uint64_t RadixIndex::Impl::StateDigest() const {
  std::shared_lock lock(mu_);
  absl::flat_hash_map<NodeId, uint64_t> path_hash{{kRoot, 0}};
  std::vector<NodeId> pending;
  auto path_of = [&](NodeId id) {
    for (NodeId n = id; !path_hash.contains(n); n = nodes_[n].parent) pending.push_back(n);
    while (!pending.empty()) {
      const NodeId n = pending.back();
      pending.pop_back();
      path_hash[n] = Combine(path_hash.at(nodes_[n].parent), nodes_[n].local_hash);
    }
    return path_hash.at(id);
  };
  uint64_t digest = Mix(nodes_.live());
  for (const WorkerState& w : workers_) {
    if (!w.in_use) continue;
    const uint64_t worker = Combine(w.key.worker_id, w.key.dp_rank);
    digest += Mix(worker);
    for (const BlockSlot& b : w.blocks) {
      digest += Combine(Combine(worker, b.engine_hash()),
                        Combine(EntryTiers(b.entry), path_of(EntryNode(b.entry))));
    }
  }
  return digest;
}

// ---- Public wrappers -------------------------------------------------------------------------

RadixIndex::RadixIndex(RadixIndexOptions options) : impl_(std::make_unique<Impl>(options)) {}
RadixIndex::~RadixIndex() = default;
uint32_t RadixIndex::block_size() const { return impl_->block_size(); }
ApplyResult RadixIndex::Apply(const KvEvent& event) { return impl_->Apply(event); }
void RadixIndex::FindMatches(std::span<const uint64_t> local_hashes,
                             std::vector<WorkerMatch>& out) const {
  impl_->FindMatches(local_hashes, out);
}
std::vector<WorkerMatch> RadixIndex::FindMatches(std::span<const uint64_t> local_hashes) const {
  std::vector<WorkerMatch> out;
  impl_->FindMatches(local_hashes, out);
  return out;
}
size_t RadixIndex::RemoveWorker(uint64_t worker_id) { return impl_->RemoveWorker(worker_id); }
size_t RadixIndex::RemoveWorkerDpRank(WorkerKey worker) {
  return impl_->RemoveWorkerDpRank(worker);
}
uint64_t RadixIndex::TreeSize(WorkerKey worker) const { return impl_->TreeSize(worker); }
std::vector<WorkerKey> RadixIndex::Workers() const { return impl_->Workers(); }
IndexStats RadixIndex::Stats() const { return impl_->Stats(); }
std::vector<KvEvent> RadixIndex::DumpEvents() const { return impl_->DumpEvents(); }
uint64_t RadixIndex::StateDigest() const { return impl_->StateDigest(); }

}  // namespace kvrouter
