// The children of an index node that has two or more: the first local hash of each child's run
// -> the child's node id. One array (a header slot, then the slots), open addressing with
// linear probing, as a handle the owner passes its allocator to (as MemberList is).
//
// Why not absl::flat_hash_map: in Debian's abseil a growth the heap refuses leaves the map
// corrupt (it sets the new capacity before allocating, abseil issue #1581), and the index must
// survive a refused allocation. Here every growth allocates the larger array first and a shrink
// is optional, so std::bad_alloc leaves the table as it was. Why not PositionTable: two
// allocations per table, one of them 64-byte aligned, cost storing the Mooncake trace 3 % more
// time in malloc, and its smallest table is 128 bytes where most nodes have two children.
//
// Ids are never 0 (the root is nobody's child): 0 marks an empty slot. Not thread-safe.
#pragma once

#include <bit>
#include <cstdint>
#include <new>

#include "core/counting_allocator.h"

namespace kvrouter {

class ChildTable {
 public:
  struct Slot {
    uint64_t key;
    uint64_t child;  // 0: empty
  };
  using Alloc = CountingAllocator<Slot>;

  // A table holding `a` and `b` (distinct keys). Throws std::bad_alloc.
  static ChildTable Make(Alloc alloc, Slot a, Slot b) {
    ChildTable t = Allocate(alloc, kMinLog2);
    t.Place(a);
    t.Place(b);
    t.header().key = 2;
    return t;
  }

  void Release(Alloc alloc) {
    alloc.deallocate(block_, Capacity() + 1);
    block_ = nullptr;
  }

  uint64_t size() const { return block_[0].key; }

  // The child under `key`, or 0.
  uint64_t Get(uint64_t key) const {
    const uint64_t mask = Capacity() - 1;
    for (uint64_t i = Home(key);; i = (i + 1) & mask) {
      const Slot& s = slots()[i];
      if (s.child == 0) return 0;
      if (s.key == key) return s.child;
    }
  }

  // Adds an absent key. Growing first if the table would be over 3/4 full: std::bad_alloc
  // then leaves it as it was.
  void Insert(uint64_t key, uint64_t child, Alloc alloc) {
    if ((size() + 1) * 4 > Capacity() * 3) Resize(Log2() + 1, alloc);
    Place({key, child});
    ++header().key;
  }

  // Removes a present key. Never fails: giving back room when the table is under 1/8 full is
  // optional.
  void Erase(uint64_t key, Alloc alloc) {
    const uint64_t mask = Capacity() - 1;
    uint64_t hole = Home(key);
    while (slots()[hole].key != key || slots()[hole].child == 0) hole = (hole + 1) & mask;
    // Backward shift: later entries of the probe sequence move into the hole when their home
    // allows, so no tombstones are needed.
    for (uint64_t j = (hole + 1) & mask; slots()[j].child != 0; j = (j + 1) & mask) {
      const uint64_t home = Home(slots()[j].key);
      const bool movable = hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
      if (movable) {
        slots()[hole] = slots()[j];
        hole = j;
      }
    }
    slots()[hole] = Slot{0, 0};
    --header().key;
    if (size() * 8 < Capacity() && Log2() > kMinLog2) {
      try {
        Resize(Log2() - 1, alloc);
      } catch (const std::bad_alloc&) {
      }
    }
  }

  template <typename F>
  void ForEach(F&& f) const {
    for (uint64_t i = 0; i < Capacity(); ++i) {
      if (slots()[i].child != 0) f(slots()[i].key, slots()[i].child);
    }
  }

 private:
  static constexpr uint64_t kMinLog2 = 2;  // four slots: two children at half load

  // Slot 0 is the header: key = size, child = log2 of the capacity.
  Slot& header() { return block_[0]; }
  uint64_t Log2() const { return block_[0].child; }
  uint64_t Capacity() const { return uint64_t{1} << Log2(); }
  Slot* slots() { return block_ + 1; }
  const Slot* slots() const { return block_ + 1; }

  // Fibonacci hashing: the top bits of the key times 2^64 / phi (local hashes are already
  // well spread; this only has to fold them onto the table).
  uint64_t Home(uint64_t key) const { return (key * 0x9e3779b97f4a7c15ull) >> (64 - Log2()); }

  static ChildTable Allocate(Alloc alloc, uint64_t log2) {
    ChildTable t;
    const uint64_t capacity = uint64_t{1} << log2;
    t.block_ = alloc.allocate(capacity + 1);
    for (uint64_t i = 0; i <= capacity; ++i) t.block_[i] = Slot{0, 0};
    t.block_[0].child = log2;
    return t;
  }

  void Place(Slot s) {
    const uint64_t mask = Capacity() - 1;
    uint64_t i = Home(s.key);
    while (slots()[i].child != 0) i = (i + 1) & mask;
    slots()[i] = s;
  }

  // Everything moves to a new array of 2^log2 slots, allocated before anything changes.
  void Resize(uint64_t log2, Alloc alloc) {
    ChildTable bigger = Allocate(alloc, log2);
    ForEach([&](uint64_t key, uint64_t child) { bigger.Place({key, child}); });
    bigger.header().key = size();
    Release(alloc);
    block_ = bigger.block_;
  }

  Slot* block_;  // no initialiser: the handle lives in a union of the index's nodes
};

}  // namespace kvrouter
