// The one source of randomness of the core (tie-breaks, softmax draws, random block identities).
// Injectable so that tests and the trace simulator replay exactly: a SeededRandomSource with the
// same seed gives the same sequence on every platform (std::mt19937_64 is fully specified).
//
// Thread-safety: none. The Router draws only under its admission gate.
#pragma once

#include <cstdint>
#include <random>

namespace kvrouter {

class RandomSource {
 public:
  virtual ~RandomSource() = default;
  virtual uint64_t NextU64() = 0;

  // Uniform in [0, 1), from the top 53 bits.
  double NextUnit() { return static_cast<double>(NextU64() >> 11) * 0x1.0p-53; }

  // Uniform in [0, n) for n > 0 (rejection sampling, so no modulo bias).
  uint64_t NextBelow(uint64_t n) {
    if (n <= 1) return 0;
    const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do {
      x = NextU64();
    } while (x >= limit);
    return x % n;
  }
};

class SeededRandomSource final : public RandomSource {
 public:
  explicit SeededRandomSource(uint64_t seed) : engine_(seed) {}
  uint64_t NextU64() override { return engine_(); }

 private:
  std::mt19937_64 engine_;
};

// 64 bits from the system's entropy source (std::random_device), for a seed that differs on
// every call: RouterOptions::seed_from_entropy, the bootstrap rooms of a DisaggRouter.
inline uint64_t EntropySeed() {
  std::random_device entropy;
  return (static_cast<uint64_t>(entropy()) << 32) ^ entropy();
}

}  // namespace kvrouter
