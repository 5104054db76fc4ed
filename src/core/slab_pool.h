// A pool of fixed-size, trivially copyable records addressed by 32-bit ids, allocated in
// chunks. Compared with one heap allocation per record it saves the allocator's per-block
// header and halves the size of every link (4-byte ids instead of 8-byte pointers), which is
// what keeps the index near its memory budget. A chunk is returned to the heap as soon as it is
// empty, and the bookkeeping vectors shrink with it, so memory follows the live record count
// exactly under churn. Not thread-safe: the owner synchronises.
#pragma once

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/counting_allocator.h"
#include "core/shrink.h"

namespace kvrouter {

template <typename T>
class SlabPool {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) >= sizeof(uint32_t));

 public:
  static constexpr uint32_t kChunkBits = 10;
  static constexpr uint32_t kChunkSize = 1u << kChunkBits;
  static constexpr uint32_t kNone = ~0u;

  explicit SlabPool(int64_t* byte_counter)
      : counter_(byte_counter),
        chunks_(CountingAllocator<Chunk*>(byte_counter)),
        with_space_(CountingAllocator<uint32_t>(byte_counter)),
        vacant_(CountingAllocator<uint32_t>(byte_counter)) {}
  ~SlabPool() {
    for (Chunk* c : chunks_) DeleteChunk(c);
  }
  SlabPool(const SlabPool&) = delete;
  SlabPool& operator=(const SlabPool&) = delete;

  T& operator[](uint32_t id) { return chunks_[id >> kChunkBits]->slots[id & (kChunkSize - 1)]; }
  const T& operator[](uint32_t id) const {
    return chunks_[id >> kChunkBits]->slots[id & (kChunkSize - 1)];
  }

  uint64_t live() const { return live_; }

  // Returns the id of an uninitialised slot.
  uint32_t Allocate() {
    const uint32_t c = ChunkWithSpace();
    Chunk& chunk = *chunks_[c];
    uint32_t slot;
    if (chunk.free_head != kNone) {
      slot = chunk.free_head;
      std::memcpy(&chunk.free_head, static_cast<const void*>(&chunk.slots[slot]), sizeof(uint32_t));
    } else {
      slot = chunk.bump++;
    }
    ++chunk.live;
    ++live_;
    if (!HasSpace(chunk)) {
      with_space_.pop_back();  // ChunkWithSpace left `c` on top
      chunk.listed = false;
    }
    return (c << kChunkBits) | slot;
  }

  void Free(uint32_t id) {
    const uint32_t c = id >> kChunkBits, slot = id & (kChunkSize - 1);
    Chunk& chunk = *chunks_[c];
    // A free slot's first bytes link to the next free slot of its chunk.
    std::memcpy(static_cast<void*>(&chunk.slots[slot]), &chunk.free_head, sizeof(uint32_t));
    chunk.free_head = slot;
    --chunk.live;
    --live_;
    if (!chunk.listed) {
      chunk.listed = true;
      with_space_.push_back(c);
    }
    if (chunk.live == 0) ReleaseChunk(c);
  }

 private:
  struct Chunk {
    T slots[kChunkSize];
    uint32_t free_head = kNone;
    uint32_t bump = 0;
    uint32_t live = 0;
    bool listed = false;  // present in with_space_
  };

  static bool HasSpace(const Chunk& c) { return c.free_head != kNone || c.bump < kChunkSize; }

  // Index of a chunk with a free slot, left on top of with_space_; creates one if needed.
  // Everything is allocated before anything changes, so a refusal (std::bad_alloc) leaves the
  // pool as it was; and with_space_ and vacant_ keep room for every chunk, so Free never
  // allocates.
  uint32_t ChunkWithSpace() {
    if (!with_space_.empty()) return with_space_.back();
    const size_t chunks = chunks_.size() + (vacant_.empty() ? 1 : 0);
    ReserveGeometrically(chunks, chunks_);
    ReserveGeometrically(chunks, with_space_);
    ReserveGeometrically(chunks, vacant_);
    CountingAllocator<Chunk> alloc(counter_);
    Chunk* chunk = new (alloc.allocate(1)) Chunk;  // default-init: slots stay uninitialised
    uint32_t c;
    if (!vacant_.empty()) {
      c = vacant_.back();
      vacant_.pop_back();
    } else {
      c = static_cast<uint32_t>(chunks_.size());
      chunks_.push_back(nullptr);
    }
    chunks_[c] = chunk;
    chunks_[c]->listed = true;
    with_space_.push_back(c);
    return c;
  }

  template <typename Vector>
  static void ReserveGeometrically(size_t n, Vector& v) {
    if (v.capacity() < n) v.reserve(std::max(n, 2 * v.capacity()));
  }

  void ReleaseChunk(uint32_t c) {
    for (size_t i = 0; i < with_space_.size(); ++i) {
      if (with_space_[i] == c) {
        with_space_[i] = with_space_.back();
        with_space_.pop_back();
        break;
      }
    }
    DeleteChunk(chunks_[c]);
    chunks_[c] = nullptr;
    vacant_.push_back(c);
    while (!chunks_.empty() && chunks_.back() == nullptr) chunks_.pop_back();
    std::erase_if(vacant_, [&](uint32_t i) { return i >= chunks_.size(); });
    ShrinkIfSparse(chunks_);
    ShrinkKeepingRoomFor(chunks_.size(), vacant_);
    ShrinkKeepingRoomFor(chunks_.size(), with_space_);
  }

  void DeleteChunk(Chunk* c) {
    if (c == nullptr) return;
    c->~Chunk();
    CountingAllocator<Chunk>(counter_).deallocate(c, 1);
  }

  int64_t* counter_;
  std::vector<Chunk*, CountingAllocator<Chunk*>> chunks_;
  std::vector<uint32_t, CountingAllocator<uint32_t>> with_space_;  // chunks with a free slot
  std::vector<uint32_t, CountingAllocator<uint32_t>> vacant_;      // released chunk indices
  uint64_t live_ = 0;
};

}  // namespace kvrouter
