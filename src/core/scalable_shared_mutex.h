// A reader-writer lock whose readers scale with cores: a reader announces itself in one of 64
// cache-line slots (picked per thread), never in a line that every reader writes, so lookups on
// different cores do not contend (std::shared_mutex's reader count is one such line: two
// readers alone move it between cores on every lock and unlock). A writer excludes the other
// writers with a mutex, raises a flag, and waits for the slots to drain; readers that find the
// flag raised queue on the writers' mutex, so neither side starves. Writers pay for the scan
// (64 loads), which suits the index: lookups far outnumber write-lock acquisitions.
//
// Satisfies SharedLockable and Lockable (std::shared_lock, std::unique_lock), provided a
// thread unlocks what it locked (the slot is the thread's). Not recursive.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>

namespace kvrouter {

class ScalableSharedMutex {
 public:
  ScalableSharedMutex() = default;
  ScalableSharedMutex(const ScalableSharedMutex&) = delete;
  ScalableSharedMutex& operator=(const ScalableSharedMutex&) = delete;

  void lock_shared() {
    std::atomic<uint32_t>& readers = slots_[ThreadSlot()].readers;
    // seq_cst on both sides (the increment here, the flag in lock()): either this reader sees
    // the writer's flag, or the writer sees this reader's count.
    readers.fetch_add(1, std::memory_order_seq_cst);
    if (!writing_.load(std::memory_order_seq_cst)) return;
    readers.fetch_sub(1, std::memory_order_release);
    // A writer is in: wait for it on the writers' mutex, which also keeps the next writer out
    // until this reader is counted.
    LockWriters();
    readers.fetch_add(1, std::memory_order_seq_cst);
    writers_.unlock();
  }

  void unlock_shared() { slots_[ThreadSlot()].readers.fetch_sub(1, std::memory_order_release); }

  void lock() {
    LockWriters();
    writing_.store(true, std::memory_order_seq_cst);
    for (Slot& slot : slots_) {
      while (slot.readers.load(std::memory_order_acquire) != 0) std::this_thread::yield();
    }
  }

  void unlock() {
    writing_.store(false, std::memory_order_release);
    writers_.unlock();
  }

 private:
  static constexpr size_t kSlots = 64;
  // Tries to take the writers' mutex this many times, a pause apart (about ten microseconds in
  // all), before sleeping on it: an event holds it for a few microseconds, and a thread put to
  // sleep and woken for each one spends longer in the scheduler than in the event (two threads
  // applying events to one tree ran at half the rate of one without the spinning).
  static constexpr int kSpins = 512;

  void LockWriters() {
    for (int i = 0; i < kSpins; ++i) {
      if (writers_.try_lock()) return;
      Pause();
    }
    writers_.lock();
  }

  static void Pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#else
    std::this_thread::yield();
#endif
  }

  struct alignas(64) Slot {
    std::atomic<uint32_t> readers{0};
  };

  // Threads take slots in turn as they first lock, so up to 64 threads never share one.
  static size_t ThreadSlot() {
    static std::atomic<size_t> next{0};
    thread_local const size_t slot = next.fetch_add(1, std::memory_order_relaxed) % kSlots;
    return slot;
  }

  Slot slots_[kSlots];
  alignas(64) std::atomic<bool> writing_{false};
  std::mutex writers_;
};

}  // namespace kvrouter
