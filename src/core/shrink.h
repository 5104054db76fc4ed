// Returning container capacity to the heap once most of it is unused, so that memory follows
// the live state down as well as up (workers and blocks churn; nothing may grow for good).
#pragma once

#include <cstddef>

namespace kvrouter {

// A vector holding at most half its capacity gives the rest back.
template <typename Vector>
void ShrinkIfSparse(Vector& v) {
  if (v.size() * 2 <= v.capacity() && v.capacity() > 0) v.shrink_to_fit();
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
