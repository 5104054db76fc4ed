// A hash map of small, trivially copyable keys and values whose every change is whole or not
// at all when the heap refuses an allocation. It grows and shrinks by allocating the new table
// first, so a refused allocation throws std::bad_alloc and leaves the map as it was; erasing
// never allocates and leaves no tombstones (backward-shift deletion), so a key inserted after an
// erase never grows the table either. absl::flat_hash_map gives neither: in Debian 12's Abseil
// (20220623) raw_hash_set::resize sets the new capacity before it allocates, and a refused
// growth leaves a map that even its destructor cannot walk (abseil issue #1581).
//
// Open addressing with linear probing over a power-of-two table at most 3/4 full; a control
// byte per slot (0: empty, else 0x80 | the hash's top 7 bits) keeps most probes off the keys,
// and each entry keeps its hash, so that neither an erase nor a growth hashes a key again.
// For the load tracker's tables (ranks, the booking trie's edges, requests by id), read on
// every decision. Lookups take any type Hash hashes and K compares with (a std::string_view
// key is looked up by std::string too).
//
// The radix index's child maps are the same idea but not this class (child_table.h): there a
// table must be one pointer inside a node's union, allocated through the index's counting
// allocator passed in per call, with no control bytes (most nodes have two children); this one
// owns its block and keeps its size and capacity beside it, as a member table should.
//
// Thread-safety: none.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <optional>
#include <type_traits>
#include <utility>

#include "absl/hash/hash.h"

namespace kvrouter {

template <typename K, typename V, typename Hash = absl::Hash<K>>
class FailSafeMap {
  static_assert(std::is_trivially_copyable_v<K> && std::is_trivially_copyable_v<V>,
                "slots are moved by copying and never destroyed");

 public:
  FailSafeMap() = default;
  ~FailSafeMap() { Release(block_); }
  FailSafeMap(const FailSafeMap&) = delete;
  FailSafeMap& operator=(const FailSafeMap&) = delete;

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  size_t capacity() const { return capacity_; }

  // The value under `key`, or null.
  template <typename Q>
  const V* Find(const Q& key) const {
    const size_t i = IndexOf(key);
    return i == kNone ? nullptr : &slots_[i].value;
  }
  template <typename Q>
  V* Find(const Q& key) {
    const size_t i = IndexOf(key);
    return i == kNone ? nullptr : &slots_[i].value;
  }
  template <typename Q>
  bool Contains(const Q& key) const {
    return IndexOf(key) != kNone;
  }

  // Inserts `key` or overwrites its value. Throws std::bad_alloc, the map unchanged, when a new
  // key needs a larger table and the heap refuses it; never throws after Reserve(size() + 1).
  void Set(const K& key, const V& value) {
    const size_t h = Hash{}(key);
    if (const size_t i = IndexOf(key, h); i != kNone) {
      slots_[i].value = value;
      return;
    }
    if (size_ + 1 > MaxLoad(capacity_)) Rehash(CapacityFor(size_ + 1));
    Place(Slot{key, value, h});
    ++size_;
  }

  // Room for `n` entries: until the map holds that many, Set allocates nothing. Throws
  // std::bad_alloc, the map unchanged, when the heap refuses the larger table.
  void Reserve(size_t n) {
    if (n > MaxLoad(capacity_)) Rehash(CapacityFor(n));
  }

  // Removes `key`; whether it was there. Allocates nothing.
  template <typename Q>
  bool Erase(const Q& key) {
    const size_t i = IndexOf(key);
    if (i == kNone) return false;
    EraseAt(i);
    return true;
  }

  // Removes `key` and returns its value (nullopt if absent). Allocates nothing.
  template <typename Q>
  std::optional<V> Take(const Q& key) {
    const size_t i = IndexOf(key);
    if (i == kNone) return std::nullopt;
    const V value = slots_[i].value;
    EraseAt(i);
    return value;
  }

  // Calls f(key, value) for every entry, in no particular order.
  template <typename F>
  void ForEach(F f) const {
    for (size_t i = 0; i < capacity_; ++i) {
      if (ctrl_[i] != kEmpty) f(slots_[i].key, slots_[i].value);
    }
  }

  // Calls f(key, value) for every entry and erases those it returns true for; how many.
  // Allocates nothing. The key of an entry f erases is not read again (f may free what it
  // refers to).
  template <typename F>
  size_t EraseIf(F f) {
    size_t erased = 0;
    for (size_t i = 0; i < capacity_; ++i) {
      // An erase may shift a later entry into slot i: look at it again. (One shifted there
      // from the table's start, after the wrap, is looked at twice; f said false to it.)
      while (ctrl_[i] != kEmpty && f(slots_[i].key, slots_[i].value)) {
        EraseAt(i);
        ++erased;
      }
    }
    return erased;
  }

  // Moves the entries to the smallest table that holds them when the map is larger than
  // `min_capacity` and less than 1/8 full (the factor keeps a map that hovers around one size
  // from being resized back and forth). A refused allocation keeps the larger table: whether
  // it shrank. Never throws.
  bool ShrinkIfMostlyEmpty(size_t min_capacity) noexcept {
    if (capacity_ <= min_capacity || size_ * 8 >= capacity_) return false;
    try {
      Rehash(size_ == 0 ? 0 : CapacityFor(size_));
    } catch (const std::bad_alloc&) {
      return false;
    }
    return true;
  }

 private:
  struct Slot {
    K key;
    V value;
    size_t hash;
  };
  static constexpr uint8_t kEmpty = 0;
  static constexpr size_t kNone = ~size_t{0};
  static constexpr size_t kMinCapacity = 16;
  static_assert(alignof(Slot) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__);

  static uint8_t TagOf(size_t h) { return static_cast<uint8_t>(0x80 | (h >> (8 * sizeof(h) - 7))); }
  static size_t MaxLoad(size_t capacity) { return capacity - capacity / 4; }
  static size_t CapacityFor(size_t n) {
    size_t capacity = kMinCapacity;
    while (MaxLoad(capacity) < n) capacity *= 2;
    return capacity;
  }
  // The control bytes, then the slots, in one block.
  static size_t SlotsOffset(size_t capacity) {
    return (capacity + alignof(Slot) - 1) / alignof(Slot) * alignof(Slot);
  }
  static void Release(void* block) { ::operator delete(block); }

  template <typename Q>
  size_t IndexOf(const Q& key) const {
    return capacity_ == 0 ? kNone : IndexOf(key, Hash{}(key));
  }
  template <typename Q>
  size_t IndexOf(const Q& key, size_t h) const {
    if (capacity_ == 0) return kNone;
    const uint8_t tag = TagOf(h);
    const size_t mask = capacity_ - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
      const uint8_t c = ctrl_[i];
      if (c == kEmpty) return kNone;
      if (c == tag && slots_[i].key == key) return i;
    }
  }

  // Backward shift: each later entry of the probe run whose home is not between the hole and
  // itself moves into the hole, so no lookup ever has to step over a removed slot.
  void EraseAt(size_t hole) {
    const size_t mask = capacity_ - 1;
    for (size_t j = (hole + 1) & mask; ctrl_[j] != kEmpty; j = (j + 1) & mask) {
      const size_t home = slots_[j].hash & mask;
      if (((j - home) & mask) >= ((j - hole) & mask)) {
        ctrl_[hole] = ctrl_[j];
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    ctrl_[hole] = kEmpty;
    --size_;
  }

  // Into a table with room (the key absent).
  void Place(const Slot& slot) {
    const size_t mask = capacity_ - 1;
    size_t i = slot.hash & mask;
    while (ctrl_[i] != kEmpty) i = (i + 1) & mask;
    ctrl_[i] = TagOf(slot.hash);
    slots_[i] = slot;
  }

  // The only allocation: before anything changes.
  void Rehash(size_t capacity) {
    void* block = nullptr;
    if (capacity > 0) {
      block = ::operator new(SlotsOffset(capacity) + capacity * sizeof(Slot));
      std::memset(block, kEmpty, capacity);
    }
    void* old_block = block_;
    const uint8_t* old_ctrl = ctrl_;
    const Slot* old_slots = slots_;
    const size_t old_capacity = capacity_;
    block_ = block;
    ctrl_ = static_cast<uint8_t*>(block);
    slots_ = capacity > 0
                 ? reinterpret_cast<Slot*>(static_cast<char*>(block) + SlotsOffset(capacity))
                 : nullptr;
    capacity_ = capacity;
    for (size_t i = 0; i < old_capacity; ++i) {
      if (old_ctrl[i] != kEmpty) Place(old_slots[i]);
    }
    Release(old_block);
  }

  void* block_ = nullptr;
  uint8_t* ctrl_ = nullptr;
  Slot* slots_ = nullptr;
  size_t capacity_ = 0;  // 0 or a power of two
  size_t size_ = 0;
};

}  // namespace kvrouter
