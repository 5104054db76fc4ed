// Time as the core sees it. The core never reads the system clock directly: every component
// that ages state (approximate-mode TTLs, request expiry, queue arrival order) takes a Clock,
// so tests and the trace simulator advance time by hand and replay exactly.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>

namespace kvrouter {

// Monotonic nanoseconds since an arbitrary origin.
using Nanos = int64_t;
inline constexpr Nanos kNanosPerSecond = 1'000'000'000;

// The longest duration a conversion gives, about 146 years: any "never" a caller passes in
// seconds (1e10, DBL_MAX) becomes this, not an out-of-range conversion (undefined; on x86-64 it
// gave INT64_MIN, so a timeout meant to be endless expired everything at once), and a time plus
// one such duration cannot overflow.
inline constexpr Nanos kLongestNanos = Nanos{1} << 62;

// Saturating at +-kLongestNanos; NaN gives 0.
inline constexpr Nanos SecondsToNanos(double seconds) {
  const double nanos = seconds * static_cast<double>(kNanosPerSecond);
  if (!(nanos == nanos)) return 0;
  if (nanos >= static_cast<double>(kLongestNanos)) return kLongestNanos;
  if (nanos <= -static_cast<double>(kLongestNanos)) return -kLongestNanos;
  return static_cast<Nanos>(nanos);
}
inline constexpr Nanos MillisToNanos(uint64_t millis) {
  return static_cast<Nanos>(millis) * 1'000'000;
}

// Wall-clock nanoseconds since the Unix epoch. Only for timestamps that cross machines (a
// publisher's publish time, the lag measured from it); never for ageing state.
inline uint64_t UnixNowNanos() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

class Clock {
 public:
  virtual ~Clock() = default;
  virtual Nanos Now() const = 0;
};

// The process's monotonic clock. Thread-safe.
class SteadyClock final : public Clock {
 public:
  Nanos Now() const override {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  static SteadyClock& Instance() {
    static SteadyClock clock;
    return clock;
  }
};

// A clock that moves only when told to. Thread-safe.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(Nanos start = 0) : now_(start) {}
  Nanos Now() const override { return now_.load(std::memory_order_acquire); }
  void Advance(Nanos delta) { now_.fetch_add(delta, std::memory_order_acq_rel); }
  void AdvanceSeconds(double seconds) { Advance(SecondsToNanos(seconds)); }
  void Set(Nanos now) { now_.store(now, std::memory_order_release); }

 private:
  std::atomic<Nanos> now_;
};

// The process's steady clock until the first Set, then time set by hand (a simulation's). The
// first Set picks an offset so that time continues from the steady clock's reading; later Sets
// move it by their differences, never backwards. Thread-safe.
class HandDrivenClock final : public Clock {
 public:
  Nanos Now() const override {
    if (!driven_.load(std::memory_order_acquire)) return SteadyClock::Instance().Now();
    return now_.load(std::memory_order_acquire);
  }
  enum class SetOutcome {
    kSet,
    kEarlier,  // than the last time set: nothing changes
    // The time, or its offset from the times set, would reach +-kLongestNanos (a deadline up
    // to kLongestNanos past it would overflow).
    kOutOfRange,
  };
  SetOutcome Set(Nanos t) {
    std::lock_guard lock(mutex_);
    Nanos offset = offset_;
    if (!driven_.load(std::memory_order_relaxed)) {
      if (__builtin_sub_overflow(SteadyClock::Instance().Now(), t, &offset) ||
          !WithinRange(offset)) {
        return SetOutcome::kOutOfRange;
      }
    } else if (t < last_set_) {
      return SetOutcome::kEarlier;
    }
    Nanos now = 0;
    if (__builtin_add_overflow(t, offset, &now) || !WithinRange(now)) {
      return SetOutcome::kOutOfRange;
    }
    offset_ = offset;
    last_set_ = t;
    now_.store(now, std::memory_order_release);
    driven_.store(true, std::memory_order_release);
    return SetOutcome::kSet;
  }

 private:
  static bool WithinRange(Nanos n) { return n < kLongestNanos && n > -kLongestNanos; }

  std::mutex mutex_;  // orders Sets
  Nanos offset_ = 0;
  Nanos last_set_ = 0;
  std::atomic<Nanos> now_{0};
  std::atomic<bool> driven_{false};
};

}  // namespace kvrouter
