// Returning container capacity to the heap once most of it is unused, so that memory follows
// the live state down as well as up (workers and blocks churn; nothing may grow for good).
#pragma once

#include <algorithm>
#include <cstddef>
#include <new>

namespace kvrouter {

// A vector holding at most half its capacity gives the rest back (libstdc++'s shrink_to_fit
// keeps the array if the heap refuses the smaller one).
template <typename Vector>
void ShrinkIfSparse(Vector& v) {
  if (v.size() * 2 <= v.capacity() && v.capacity() > 0) v.shrink_to_fit();
}

// A vector that must keep room for `room` entries (so that a later push_back cannot fail)
// gives back most of the rest once it has more than twice that. Optional: if the heap refuses
// the smaller array, the vector keeps the one it has.
template <typename Vector>
void ShrinkKeepingRoomFor(size_t room, Vector& v) {
  if (v.capacity() <= 2 * room + 8) return;
  try {
    Vector smaller(v.get_allocator());
    smaller.reserve(std::max(room, v.size()));
    smaller.assign(v.begin(), v.end());
    v.swap(smaller);
  } catch (const std::bad_alloc&) {
  }
}

// A hash table: an empty one gives everything back, one below 1/8 occupancy shrinks to fit.
template <typename Table>
void ShrinkTableIfSparse(Table& t) {
  if (t.empty()) {
    if (t.capacity() > 0) t = Table(0, t.hash_function(), t.key_eq(), t.get_allocator());
  } else if (t.size() * 8 < t.capacity() && t.capacity() > 16) {
    t.rehash(0);
  }
}

}  // namespace kvrouter
