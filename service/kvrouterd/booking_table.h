// The request ids the daemon booked, with their decisions, so that a repeated route or plan
// gets the first answer back instead of booking twice (docs/kvrouterd.md, "Idempotence").
// Bounded: entries age out as the router drops their requests (a plan after the plan
// deadline unless committed, a booking after request_expiry_seconds), and past the capacity
// the oldest are forgotten first, so clients that never free cannot grow it without limit.
// It also keeps a free or abort that comes while a call for the id still waits to book (for a
// routing thread, in the admission queue): that call then never books.
// Thread-safe: routing calls run on the thread pool.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvrouterd {

class BookingTable {
 public:
  using Clock = std::chrono::steady_clock;
  // The arrival of a call that no free or abort cancels (tests, direct callers).
  static constexpr uint64_t kNoArrival = UINT64_MAX;

  explicit BookingTable(size_t capacity) : capacity_(capacity == 0 ? 1 : capacity) {}

  // A routing call (route, plan) arrived and may wait (for a routing thread, for a retry of its
  // id, in the admission queue) before it books: its arrival number. A free or abort of an id
  // (Cancel) cancels the calls for that id that arrived before it: they never book. Depart
  // once the call is answered. The cancellations are kept while a call that arrived before
  // them is in flight, at most `capacity` of them (the oldest are forgotten first).
  uint64_t Arrive();
  void Depart(uint64_t arrival);

  enum class Outcome {
    kBook,       // the caller is to book the id: Complete or Fail must follow
    kReplay,     // the id is booked: `decision` is the first answer
    kCancelled,  // the id was freed or aborted after the call arrived: answer CANCELLED
    kTimedOut,   // another call still books the id at the wait's deadline
    kAbandoned,  // the wait's `abandoned` said so while another call booked the id
  };
  struct Claimed {
    Outcome outcome;
    nlohmann::json decision;  // with kReplay
  };
  // How long a claim waits for another call booking the same id (one waiting in the admission
  // queue may wait for good, holding this caller's routing thread all along).
  struct Wait {
    std::optional<Clock::time_point> deadline;  // none: as long as the other call books
    // Polled every kAbandonPoll while waiting (the client left, the daemon stops); called with
    // the table locked, so it must not call into the table.
    std::function<bool()> abandoned;
  };
  static constexpr std::chrono::milliseconds kAbandonPoll{50};
  // Claims `id` for a new booking by the call that arrived as `arrival`. Waits while another
  // thread books the same id, so that concurrent retries also book once, within `wait`.
  Claimed Claim(const std::string& id, Clock::time_point now, uint64_t arrival = kNoArrival,
                const Wait& wait = {});
  // The booking succeeded: `decision` is answered to repeats until `expires`. False if the id
  // was cancelled since the call arrived: nothing is recorded and the id stays claimed, so the
  // caller releases the booking it made in the router, then calls Fail.
  bool Complete(const std::string& id, nlohmann::json decision, uint64_t worker_id,
                uint32_t dp_rank, Clock::time_point expires, uint64_t arrival = kNoArrival);
  // The booking failed: the id is free again.
  void Fail(const std::string& id);
  // A plan was committed: its entry now lives `lifetime` from its booking (Complete).
  void Extend(const std::string& id, Clock::duration lifetime);
  // The request is being freed or aborted: forgets it, and cancels the calls for it that
  // arrived before now and have not booked yet (call this before the router's free, so that a
  // call booking meanwhile is caught by Complete). True if the id was booked here.
  bool Cancel(const std::string& id);
  // Whether `id` was freed or aborted since the call that arrived as `arrival` did.
  bool Cancelled(const std::string& id, uint64_t arrival) const;
  // Cancels the call booking `id` now, if one is (shutdown): true if one was. A booked id stays.
  bool CancelPending(const std::string& id);
  // The worker was removed with its requests.
  void DropWorker(uint64_t worker_id);
  // The worker's ranks are now dp_start .. dp_start + dp_size - 1: requests on other ranks
  // were dropped with their ranks.
  void DropRanksOutside(uint64_t worker_id, uint32_t dp_start, uint32_t dp_size);
  // The ids being booked now (waiting in the admission queue, perhaps).
  std::vector<std::string> PendingIds() const;
  size_t size() const;
  // Cancellations kept (for the tests of their bound).
  size_t cancellations() const;

 private:
  struct Entry {
    nlohmann::json decision;
    uint64_t worker_id = 0;
    uint32_t dp_rank = 0;
    Clock::time_point expires{};
    Clock::time_point booked{};  // when Complete recorded it
    bool pending = true;
    uint64_t sequence = 0;  // matches order_ while this entry is the one queued there
  };
  void EvictLocked(Clock::time_point now);
  bool CancelledLocked(const std::string& id, uint64_t arrival) const;
  void RecordCancellationLocked(const std::string& id);
  void PruneCancellationsLocked();

  const size_t capacity_;
  mutable std::mutex mutex_;
  std::condition_variable settled_;  // a pending entry completed or failed
  std::unordered_map<std::string, Entry> entries_;
  std::deque<std::pair<uint64_t, std::string>> order_;  // insertion order, stale pairs skipped
  uint64_t next_sequence_ = 0;
  // Calls in flight by arrival number, and the cancellations: id -> the arrival number before
  // which its calls are cancelled, with the same pairs in the order they were made.
  uint64_t next_arrival_ = 1;
  std::set<uint64_t> arrivals_;
  std::unordered_map<std::string, uint64_t> cancelled_;
  std::deque<std::pair<uint64_t, std::string>> cancel_order_;
};

}  // namespace kvrouterd
