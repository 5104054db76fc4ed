// Who hears of a router's own booking changes, for router replicas
// (shared/reference/dynamo-router.md §7.5): the observer Router::SetSequenceObserver installs,
// the token that names it, and the replica id this router publishes as. Bookings of other
// replicas (IsReplicaRequestId) are never passed on: only their origin changes them.
//
// Thread-safety: none. The Router serialises every call under its admission gate.
#pragma once

#include <cstdint>
#include <functional>
#include <new>
#include <string>
#include <string_view>
#include <utility>

#include "core/active_sequences.h"

namespace kvrouter {

using SequenceObserver = std::function<void(const SequenceChange&)>;

// What an observer throws when its transport refused the change (a NATS client's buffer full
// while reconnecting, a closed connection): the change is lost to the other replicas, as one
// refused memory, and every booking is announced again once a later change gets through.
struct ChangeNotPublished {};

// Request ids starting with this byte are reserved: they name bookings of replicas.
inline constexpr char kReplicaRequestIdMark = '\x1e';
inline bool IsReplicaRequestId(std::string_view request_id) {
  return !request_id.empty() && request_id.front() == kReplicaRequestIdMark;
}

class BookingObserver {
 public:
  // Installs `observer` as `replica_id` and returns a token naming it (unique in the process,
  // never 0). An empty observer stops notifying and returns 0; the replica id stays, so this
  // router's own changes echoed back later are still recognised (IsOwnOrigin).
  uint64_t Set(std::string replica_id, SequenceObserver observer);
  // Stops the observer `token` names if it is still the current one; whether it did.
  bool Clear(uint64_t token);
  bool IsCurrent(uint64_t token) const { return token != 0 && token == token_; }
  bool active() const { return static_cast<bool>(observer_); }
  bool IsOwnOrigin(std::string_view origin) const { return origin == replica_id_; }
  // Tells the observer, if any, unless the change is to a replica's booking. False when the
  // observer ran out of memory (std::bad_alloc, e.g. encoding the change) or its transport
  // refused the change (ChangeNotPublished): the change is lost to the other replicas, and the
  // caller must not fail for it, since what it reports has already happened.
  // Every change notified carries the interval of the last heartbeat (see Promise).
  bool Notify(const SequenceChange& change) const {
    if (!observer_ || (NamesARequest(change.kind) && IsReplicaRequestId(change.request_id))) {
      return true;
    }
    SequenceChange stamped = change;  // views: nothing is copied but the fields
    stamped.heartbeat_interval_ms = promised_interval_ms_;
    const RunningMark running(this);
    try {
      observer_(stamped);
    } catch (const std::bad_alloc&) {
      return false;
    } catch (const ChangeNotPublished&) {
      return false;
    }
    return true;
  }
  // Whether this thread is inside this observer, however deeply (a call it makes into this
  // router would wait for the lock the observer runs under: the C ABI refuses such calls).
  bool RunningOnThisThread() const {
    for (const RunningMark* mark = innermost_; mark != nullptr; mark = mark->outer) {
      if (mark->observer == this) return true;
    }
    return false;
  }
  // This router promises a heartbeat every `interval_ms` from now on: every change the
  // current observer is told carries the interval, so that a peer that missed the heartbeats
  // (it joined later, or this router died before its next) still knows to expire it.
  void Promise(uint32_t interval_ms) { promised_interval_ms_ = interval_ms; }
  // The interval of the current observer's last heartbeat (0: none, or a farewell).
  uint32_t promised_interval_ms() const { return promised_interval_ms_; }

 private:
  // Marks this thread as inside `observer` until the end of the scope. Observers nest (a bus
  // delivering synchronously: router A's observer applies the change to router B, whose
  // observer answers A), so the marks form a chain on the thread's stack, every one of them
  // holding its router's lock.
  struct RunningMark {
    explicit RunningMark(const BookingObserver* running)
        : observer(running), outer(std::exchange(innermost_, this)) {}
    ~RunningMark() { innermost_ = outer; }
    RunningMark(const RunningMark&) = delete;
    RunningMark& operator=(const RunningMark&) = delete;

    const BookingObserver* const observer;
    const RunningMark* const outer;
  };
  static inline thread_local const RunningMark* innermost_ = nullptr;

  std::string replica_id_;
  SequenceObserver observer_;
  uint64_t token_ = 0;                 // of the current observer; 0 = none
  uint32_t promised_interval_ms_ = 0;  // of the current observer's last heartbeat; 0 = none
};

}  // namespace kvrouter
