// The request ids the daemon booked, with their decisions, so that a repeated route or plan
// gets the first answer back instead of booking twice (docs/kvrouterd.md, "Idempotence").
// Bounded: entries age out as the router drops their requests (a plan after the plan
// deadline unless committed, a booking after request_expiry_seconds), and past the capacity
// the oldest are forgotten first, so clients that never free cannot grow it without limit.
// Thread-safe: routing calls run on the thread pool.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvrouterd {

class BookingTable {
 public:
  using Clock = std::chrono::steady_clock;

  explicit BookingTable(size_t capacity) : capacity_(capacity == 0 ? 1 : capacity) {}

  // Claims `id` for a new booking: nullopt if the caller is to book it (then Complete or Fail
  // must follow), else the live booking's decision. Waits while another thread books the
  // same id, so that concurrent retries also book once.
  std::optional<nlohmann::json> Claim(const std::string& id, Clock::time_point now);
  // The booking succeeded: `decision` is answered to repeats until `expires`.
  void Complete(const std::string& id, nlohmann::json decision, uint64_t worker_id,
                Clock::time_point expires);
  // The booking failed: the id is free again.
  void Fail(const std::string& id);
  // A plan was committed: its entry now lives until `expires`.
  void Extend(const std::string& id, Clock::time_point expires);
  // The request was freed or aborted. True if the id was booked here.
  bool Drop(const std::string& id);
  // The worker was removed with its requests.
  void DropWorker(uint64_t worker_id);
  // The ids being booked now (waiting in the admission queue, perhaps).
  std::vector<std::string> PendingIds() const;
  size_t size() const;

 private:
  struct Entry {
    nlohmann::json decision;
    uint64_t worker_id = 0;
    Clock::time_point expires{};
    bool pending = true;
    uint64_t sequence = 0;  // matches order_ while this entry is the one queued there
  };
  void EvictLocked(Clock::time_point now);

  const size_t capacity_;
  mutable std::mutex mutex_;
  std::condition_variable settled_;  // a pending entry completed or failed
  std::unordered_map<std::string, Entry> entries_;
  std::deque<std::pair<uint64_t, std::string>> order_;  // insertion order, stale pairs skipped
  uint64_t next_sequence_ = 0;
};

}  // namespace kvrouterd
