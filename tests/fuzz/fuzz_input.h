// What the state-aware harnesses share: the input read as a stream of choices, and the switch
// that has them print what they do (KVR_FUZZ_VERBOSE=1, to replay a finding by hand).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>

namespace kvrouter::fuzz {

inline const bool kVerbose = std::getenv("KVR_FUZZ_VERBOSE") != nullptr;

// The input, read a byte at a time; zeros once it is used up.
class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool empty() const { return pos_ >= size_; }
  uint8_t Byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  size_t Pick(size_t n) { return Byte() % n; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace kvrouter::fuzz
