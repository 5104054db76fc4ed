// An allocator that adds every byte it hands out to a counter, so a container family (the
// index's nodes, child maps, member lists, per-worker tables) can report exactly how much heap
// it owns. The counter is not atomic: the owner updates it under its own writer lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace kvrouter {

template <typename T>
class CountingAllocator {
 public:
  using value_type = T;

  explicit CountingAllocator(int64_t* counter) noexcept : counter_(counter) {}
  template <typename U>
  CountingAllocator(const CountingAllocator<U>& other) noexcept : counter_(other.counter()) {}

  T* allocate(size_t n) {
    *counter_ += static_cast<int64_t>(n * sizeof(T));
    return std::allocator<T>{}.allocate(n);
  }
  void deallocate(T* p, size_t n) noexcept {
    *counter_ -= static_cast<int64_t>(n * sizeof(T));
    std::allocator<T>{}.deallocate(p, n);
  }

  int64_t* counter() const noexcept { return counter_; }

  template <typename U>
  friend bool operator==(const CountingAllocator& a, const CountingAllocator<U>& b) noexcept {
    return a.counter() == b.counter();
  }

 private:
  int64_t* counter_;
};

}  // namespace kvrouter
