// A hash map from 64-bit keys to 56-bit non-zero values, for the index's per-worker tables
// (engine block hash -> where the block is): bucketized cuckoo hashing. Every key may live in
// one of two buckets of four 16-byte slots (one cache line each), so a lookup reads at most two
// lines, both known up front and prefetchable, and an insert or an erase moves nothing in the
// common case (an insert into two full buckets usually moves one entry to its other bucket).
// A value of 0 marks an empty slot, so there is no control byte, and the bucket count is any
// integer, so growing by 1.5x keeps the load between 0.6 and 0.9 (0.74 on average over sizes).
// Against absl's flat_hash_map (load between 0.44 and 0.875 across doublings, plus a control
// byte per slot) that is about a fifth less memory per entry, and these tables are most of
// the index's memory. (Robin Hood probing at that load moved tens of entries per insert and
// erase.)
//
// Not thread-safe: the index synchronises. Memory is counted through CountingAllocator. A refused
// allocation (std::bad_alloc) leaves the table as it was; an erase never throws.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <utility>

#include "core/counting_allocator.h"
#include "core/prefetch.h"

namespace kvrouter {

class PositionTable {
 public:
  static constexpr uint64_t kValueMask = (uint64_t{1} << 56) - 1;
  // Tables are mapped from 32 KiB (8 pages), not from kMappedBytes as the index's other arrays:
  // a table grows by 1.5x step by step, and each step's old array left in the C heap is a
  // hole that no later, larger step fits. With many workers most steps are below 128 KiB (at
  // 1,000 workers on the Mooncake trace, tables of about 8,700 entries): the holes were 88 MiB
  // resident beside a 228 MiB index. Mapping also grows a table in place (Stretch). Below
  // 32 KiB a table is at most a few pages, where whole pages would waste more than holes do (with
  // 64 KiB pages, as on some arm64 and ppc64le kernels, a table just past 32 KiB wastes up to
  // half its mapping).
  static constexpr size_t kMapFromBytes = size_t{32} << 10;

  explicit PositionTable(int64_t* byte_counter) : alloc_(byte_counter) {}
  ~PositionTable() { Release(); }
  PositionTable(const PositionTable&) = delete;
  PositionTable& operator=(const PositionTable&) = delete;
  PositionTable(PositionTable&& other) noexcept { Take(other); }
  PositionTable& operator=(PositionTable&& other) noexcept {
    if (this != &other) {
      Release();
      Take(other);
    }
    return *this;
  }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  size_t capacity() const { return num_buckets_ * kWays; }

  // The value under `key`, or 0.
  uint64_t Get(uint64_t key) const {
    const Slot* s = FindSlot(key);
    return s ? s->value : 0;
  }
  bool Contains(uint64_t key) const { return FindSlot(key) != nullptr; }

  // Starts loading the two buckets `key` may be in, so that a later lookup of it does not wait
  // for memory: a run of blocks prefetches all its keys, and their misses overlap.
  void Prefetch(uint64_t key) const {
    if (num_buckets_ == 0) return;
    const uint64_t h = Mix(key);
    PrefetchLine(&buckets_[First(h)]);
    PrefetchLine(&buckets_[Second(h)]);
  }

  // Rewrites the value under `key` (present); `value` non-zero, at most 56 bits.
  void Update(uint64_t key, uint64_t value) { const_cast<Slot*>(FindSlot(key))->value = value; }

  // Inserts unless `key` is present; returns whether it inserted. One pass over the key's two
  // buckets finds it or a free slot; only two full buckets take the slow path. If the table
  // must grow and the heap refuses, std::bad_alloc leaves the table as it was (so do Set and
  // Exchange): a caller that allocates first and then inserts can undo what it did before.
  bool TryInsert(uint64_t key, uint64_t value) {
    return Upsert(key, value, /*overwrite=*/false) == 0;
  }

  // Inserts or overwrites.
  void Set(uint64_t key, uint64_t value) { Exchange(key, value); }

  // Inserts or overwrites, in one pass over the key's buckets; returns the value it replaced,
  // or 0 if it inserted.
  uint64_t Exchange(uint64_t key, uint64_t value) { return Upsert(key, value, /*overwrite=*/true); }

  // Removes `key`; returns whether it was there.
  bool Erase(uint64_t key) {
    Slot* s = const_cast<Slot*>(FindSlot(key));
    if (s == nullptr) return false;
    *s = Slot{0, 0};
    --size_;
    if (size_ == 0) {
      Release();
    } else if (size_ * 10 < capacity() * 4 && num_buckets_ > 2) {
      // Back to a load of about 0.8. Shrinking is optional: if the heap refuses the smaller
      // array the table stays as large as it was, so an erase never fails.
      try {
        Rehash(BucketsFor(size_ + size_ / 4 + 1));
      } catch (const std::bad_alloc&) {
      }
    }
    return true;
  }

  // Every (key, value), in no particular order.
  template <typename F>
  void ForEach(F&& f) const {
    for (size_t b = 0; b < num_buckets_; ++b) {
      for (const Slot& s : buckets_[b].slots) {
        if (s.value != 0) f(s.key, s.value);
      }
    }
  }

  void Clear() { Release(); }

 private:
  static constexpr int kWays = 4;
  static constexpr int kMaxKicks = 256;  // an insert that needs more grows the table instead

  struct Slot {
    uint64_t key;
    uint64_t value;  // 0: empty
  };
  struct alignas(64) Bucket {
    Slot slots[kWays];
  };

  static uint64_t Mix(uint64_t x) {  // splitmix64's finaliser: engine hashes may be sequential
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  }
  // The key's two buckets, from the two halves of its mixed hash by a multiply-shift range
  // reduction (so any bucket count works).
  size_t First(uint64_t h) const { return FirstOf(h, num_buckets_); }
  static size_t FirstOf(uint64_t h, size_t num_buckets) {
    return static_cast<size_t>(((h & 0xffffffffu) * num_buckets) >> 32);
  }
  size_t Second(uint64_t h) const {
    const size_t b = static_cast<size_t>(((h >> 32) * num_buckets_) >> 32);
    return b == First(h) ? (b + 1 == num_buckets_ ? 0 : b + 1) : b;
  }
  static size_t BucketsFor(size_t slots) {
    return std::max<size_t>(2, (slots + kWays - 1) / kWays);
  }

  const Slot* FindSlot(uint64_t key) const {
    if (size_ == 0) return nullptr;
    const uint64_t h = Mix(key);
    for (size_t b : {First(h), Second(h)}) {
      for (const Slot& s : buckets_[b].slots) {
        if (s.key == key && s.value != 0) return &s;
      }
    }
    return nullptr;
  }

  // The value under `key` (overwritten with `value` if `overwrite`), or 0 after inserting it.
  uint64_t Upsert(uint64_t key, uint64_t value, bool overwrite) {
    if ((size_ + 1) * 10 > capacity() * 9) Grow();  // before the scan: growing moves slots
    const uint64_t h = Mix(key);
    Slot* free = nullptr;
    for (size_t b : {First(h), Second(h)}) {
      for (Slot& s : buckets_[b].slots) {
        if (s.value == 0) {
          if (free == nullptr) free = &s;
        } else if (s.key == key) {
          return overwrite ? std::exchange(s.value, value) : s.value;
        }
      }
    }
    if (free != nullptr) {
      *free = Slot{key, value};
    } else {
      Displace(key, value);  // may grow, and throw with nothing changed
    }
    ++size_;
    return 0;
  }

  // Places an absent key when both its buckets are full.
  [[gnu::noinline]] void Displace(uint64_t key, uint64_t value) { Insert(Slot{key, value}); }

  // A free slot in bucket `b`, or null.
  Slot* FreeSlotIn(size_t b) {
    for (Slot& s : buckets_[b].slots) {
      if (s.value == 0) return &s;
    }
    return nullptr;
  }

  // The bucket other than `b` that a key (mixed hash `h`, in bucket `b`) may live in.
  size_t OtherBucket(uint64_t h, size_t b) const {
    const size_t first = First(h);
    return first == b ? Second(h) : first;
  }

  // Places `carry` (absent) in one of its buckets, `preferred` (0: first, 1: second) tried first.
  void Insert(Slot carry, int preferred = 0) {
    const uint64_t h = Mix(carry.key);
    const size_t buckets[2] = {First(h), Second(h)};
    for (size_t b : {buckets[preferred], buckets[1 - preferred]}) {
      if (Slot* free = FreeSlotIn(b)) {
        *free = carry;
        return;
      }
    }
    if (Slot* freed = MoveAResidentAside(buckets[0], buckets[1])) {
      *freed = carry;
      return;
    }
    Walk(carry, buckets[0]);
  }

  // Both buckets full: frees a slot in one of them by moving one of their eight residents to
  // its other bucket, if one of those has room; null if none has. The eight other buckets are
  // loaded at once (prefetched), so this costs one memory round trip, where a walk of moves one
  // resident at a time pays one per move. Filling 64 tables with random keys, one of the eight
  // had room for 92 % of the inserts that found both buckets full; without this, loading the
  // Mooncake trace took 1.3-1.4x as long.
  Slot* MoveAResidentAside(size_t first, size_t second) {
    size_t others[2 * kWays];
    for (int i = 0; i < 2 * kWays; ++i) {
      const size_t b = i < kWays ? first : second;
      others[i] = OtherBucket(Mix(buckets_[b].slots[i % kWays].key), b);
      PrefetchLine(&buckets_[others[i]]);
    }
    for (int i = 0; i < 2 * kWays; ++i) {
      Slot* room = FreeSlotIn(others[i]);
      if (room == nullptr) continue;
      Slot& resident = buckets_[i < kWays ? first : second].slots[i % kWays];
      *room = resident;
      return &resident;
    }
    return nullptr;
  }

  // Places `carry` by a random walk: it takes a resident's slot in one of its buckets, the
  // resident goes to its other bucket (never back where it came from), and so on; the table
  // grows when the walk gets long. `into` is the bucket `carry` takes a slot in first. The
  // victim's way varies with the carried key and the step, so the walk seldom retraces itself
  // (more than eight keys sharing two buckets always would: kMaxKicks bounds it).
  //
  // A walk that fails is undone before the table grows (every resident back in its slot, the
  // carried entry the one that came in), so a growth the heap refuses loses nothing. Inside a
  // growth (placing the old entries again) there is nothing to undo to: Rehash keeps its old
  // array until it has placed everything, and returns to it if anything throws.
  void Walk(Slot carry, size_t into) {
    Slot* kicked[kMaxKicks];
    uint64_t h = Mix(carry.key);
    for (int kick = 0; kick < kMaxKicks; ++kick) {
      kicked[kick] = &buckets_[into].slots[((h >> 58) + static_cast<uint64_t>(kick)) % kWays];
      std::swap(*kicked[kick], carry);
      h = Mix(carry.key);
      into = OtherBucket(h, into);
      if (Slot* free = FreeSlotIn(into)) {
        *free = carry;
        return;
      }
    }
    if (!placing_again_) {
      for (int kick = kMaxKicks; kick-- > 0;) std::swap(*kicked[kick], carry);
    }
    Grow();
    Insert(carry);
  }

  // By 1.5x: each growth places every entry again, so a table that grows by a factor g has
  // placed each entry about 1 / (g - 1) times more on its way to any size (4 times at 1.25x, which
  // was half of loading the Mooncake trace), while its average load is 0.9 (1 - 1/g) / ln g
  // (0.81 at 1.25x, 0.74 at 1.5x, 0.65 at 2x). BENCHMARKS.md, "The per-worker tables".
  void Grow() { Rehash(std::max<size_t>(2, num_buckets_ + num_buckets_ / 2 + 1)); }

  // Places every entry again in a new array of `num_buckets`. The old array is kept until all
  // are placed: if the heap refuses the new array, or a larger one a walk may need on the way
  // (a growth within this one), the table is left on the old array, as it was.
  void Rehash(size_t num_buckets) {
    if (num_buckets > num_buckets_ && alloc_.AllocatesZeroed(num_buckets_)) {
      return Stretch(num_buckets);
    }
    Bucket* old = buckets_;
    const size_t old_buckets = num_buckets_;
    Bucket* fresh = alloc_.allocate(num_buckets);
    if (alloc_.AllocatesZeroed(num_buckets)) {
      alloc_.populate(fresh, 0, num_buckets);  // every page is written: BENCHMARKS.md
    } else {
      std::memset(static_cast<void*>(fresh), 0, num_buckets * sizeof(Bucket));
    }
    buckets_ = fresh;
    num_buckets_ = num_buckets;
    const bool outermost = !placing_again_;
    placing_again_ = true;
    try {
      for (size_t b = 0; b < old_buckets; ++b) {
        for (const Slot& s : old[b].slots) {
          if (s.value != 0) Insert(s, ChoiceIn(s.key, b, old_buckets));
        }
      }
    } catch (...) {
      alloc_.deallocate(buckets_, num_buckets_);  // `fresh`, or the array a growth within made
      buckets_ = old;
      num_buckets_ = old_buckets;
      placing_again_ = !outermost;
      throw;
    }
    placing_again_ = !outermost;
    if (old != nullptr) alloc_.deallocate(old, old_buckets);
  }

  // Grows a mapped table in place. The kernel moves its pages to a larger mapping (in a plain
  // build: counting_allocator.h), so only the added pages are new: a new array would fault every
  // page in again (page faults were a third of loading the Mooncake trace, BENCHMARKS.md "Resident
  // memory"). Then every entry is placed again under the new bucket count, the highest buckets
  // first: with more buckets a key's first bucket is never lower, so entries mostly land in buckets
  // already done. Placing one may move others (each then sits in one of its buckets under the new
  // count) or grow the table again; either way an entry met again is just placed once more, so the
  // walk goes by index, not by reference. The walk goes down, which hardware prefetchers follow
  // less well than the old path's walk up into a new array: it prefetches the first buckets of a
  // bucket kAhead below (without, growing 1,000 tables to 20 K entries took 1.25x the old path;
  // with, 1.0-1.05x). An entry tries the same one of its two buckets as before (ChoiceIn):
  // placing every entry first-bucket-first made loading the trace 1.1-1.25x slower.
  // A refused growth leaves the table as it was. What is not failure-safe: a walk that fails
  // while the entries are placed again here (eight keys sharing both their buckets under the
  // larger count as well) grows once more from inside, and if the kernel refuses that growth
  // the entry the walk carried is lost, as there is no old array to go back to.
  // Such a failing walk was never seen on real or random keys (TryInsert's callers fall back
  // to the copying path only under sanitizers or without mappings).
  void Stretch(size_t num_buckets) {
    constexpr size_t kAhead = 8;
    const size_t old_buckets = num_buckets_;
    buckets_ = alloc_.grow(buckets_, old_buckets, num_buckets);
    alloc_.populate(buckets_, old_buckets, num_buckets);
    num_buckets_ = num_buckets;
    for (size_t b = std::min(old_buckets, num_buckets_); b-- > 0;) {
      if (b >= kAhead) {
        for (const Slot& s : buckets_[b - kAhead].slots) {
          if (s.value != 0) PrefetchLine(&buckets_[First(Mix(s.key))]);
        }
      }
      for (int way = 0; way < kWays; ++way) {
        const Slot slot = std::exchange(buckets_[b].slots[way], Slot{0, 0});
        if (slot.value != 0) Insert(slot, ChoiceIn(slot.key, b, old_buckets));
      }
    }
  }

  // Which of its two buckets (0: first, 1: second) an entry found in bucket `b` of a table of
  // `num_buckets` buckets sits in. Placed again under a new count, the entry tries the same one
  // first: both bucket numbers scale with the count (but for a second bucket moved off its
  // first), so a sweep over the old buckets in order fills the new ones in order too, where its
  // other bucket is anywhere in the table.
  static int ChoiceIn(uint64_t key, size_t b, size_t num_buckets) {
    return FirstOf(Mix(key), num_buckets) == b ? 0 : 1;
  }

  void Release() {
    if (buckets_ != nullptr) alloc_.deallocate(buckets_, num_buckets_);
    buckets_ = nullptr;
    num_buckets_ = size_ = 0;
  }

  void Take(PositionTable& other) {
    alloc_ = other.alloc_;
    buckets_ = other.buckets_;
    num_buckets_ = other.num_buckets_;
    size_ = other.size_;
    other.buckets_ = nullptr;
    other.num_buckets_ = other.size_ = 0;
  }

  CountingAllocator<Bucket, kMapFromBytes> alloc_{nullptr};
  Bucket* buckets_ = nullptr;
  size_t num_buckets_ = 0;
  size_t size_ = 0;
  bool placing_again_ = false;  // a growth is placing the entries again (Walk, Rehash)
};

}  // namespace kvrouter
