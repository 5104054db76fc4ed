// The live counters of one ingest source (IngestStats is their copy), updated by the loop thread
// and read by any thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "core/clock.h"
#include "ingest/ingest_service.h"

namespace kvrouter {

inline void Bump(std::atomic<uint64_t>& c, uint64_t n = 1) {
  c.fetch_add(n, std::memory_order_relaxed);
}

struct SourceCounters {
  std::atomic<uint64_t> messages{0};
  std::atomic<uint64_t> events_applied{0};
  std::atomic<uint64_t> events_ignored{0};  // IngestStats::events_ignored
  std::atomic<uint64_t> rejected[kNumIngestRejects] = {};
  std::atomic<uint64_t> gaps{0};
  std::atomic<uint64_t> missed_messages{0};
  std::atomic<uint64_t> restarts{0};
  std::atomic<uint64_t> recoveries{0};
  std::atomic<uint64_t> connections{0};
  std::atomic<int64_t> state_unknown{0};
  std::atomic<uint64_t> lag_samples{0};
  std::atomic<uint64_t> lag_total_us{0};
  std::atomic<uint64_t> lag_max_us{0};
  std::atomic<uint64_t> lag_last_us{0};
  std::atomic<uint64_t> published{0};
  std::atomic<uint64_t> publish_failures{0};
  std::atomic<uint64_t> bookings_trimmed{0};  // IngestStats::bookings_trimmed
  std::atomic<uint64_t> stream_sequence{0};
  std::atomic<uint64_t> consumer_remakes{0};
  std::atomic<uint64_t> consumer_remake_failures{0};
  // Whether a JetStream relay republishes what this source applies: not what a JetStream
  // source consumed (it is in a stream already). Set before the source is shared.
  bool relayed = true;

  // A message published at `publish_time_ns` (Unix epoch; 0 = unknown) has just been applied.
  // A publisher whose clock runs ahead of ours shows a lag of 0, not a negative one.
  void RecordLag(uint64_t publish_time_ns) {
    if (publish_time_ns == 0) return;
    const uint64_t now = UnixNowNanos();
    const uint64_t lag_us = now > publish_time_ns ? (now - publish_time_ns) / 1000 : 0;
    Bump(lag_samples);
    Bump(lag_total_us, lag_us);
    lag_last_us.store(lag_us, std::memory_order_relaxed);
    uint64_t max = lag_max_us.load(std::memory_order_relaxed);
    while (lag_us > max && !lag_max_us.compare_exchange_weak(max, lag_us)) {
    }
  }

  void Reject(IngestReject reason, uint64_t n = 1) {
    rejected[static_cast<int>(reason)].fetch_add(n, std::memory_order_relaxed);
  }
  // A reject with its reason in words (what the decoder or the index said): the source's
  // IngestStats::last_reject until the next one.
  void Reject(IngestReject reason, std::string detail, uint64_t n = 1) {
    Reject(reason, n);
    static std::atomic<uint64_t> serials{0};
    std::lock_guard lock(detail_mutex_);
    last_reject_ = std::move(detail);
    last_reject_serial_ = serials.fetch_add(1, std::memory_order_relaxed) + 1;
  }

  // A sequence gap of `missed` messages.
  void Gap(uint64_t missed) {
    Bump(gaps);
    Bump(missed_messages, missed);
  }

  void AddTo(IngestStats& s) const {
    s.messages += messages.load();
    s.events_applied += events_applied.load();
    for (int i = 0; i < kNumIngestRejects; ++i) s.rejected[i] += rejected[i].load();
    s.gaps += gaps.load();
    s.missed_messages += missed_messages.load();
    s.restarts += restarts.load();
    s.recoveries += recoveries.load();
    s.connections += connections.load();
    s.state_unknown += static_cast<uint64_t>(std::max<int64_t>(0, state_unknown.load()));
    s.lag_samples += lag_samples.load();
    s.lag_total_us += lag_total_us.load();
    s.lag_max_us = std::max(s.lag_max_us, lag_max_us.load());
    s.lag_last_us = std::max(s.lag_last_us, lag_last_us.load());
    s.published += published.load();
    s.publish_failures += publish_failures.load();
    s.stream_sequence = std::max(s.stream_sequence, stream_sequence.load());
    s.consumer_remakes += consumer_remakes.load();
    s.consumer_remake_failures += consumer_remake_failures.load();
    s.events_ignored += events_ignored.load();
    s.bookings_trimmed += bookings_trimmed.load();
    std::lock_guard lock(detail_mutex_);
    if (last_reject_serial_ > s.last_reject_serial) {  // the most recent over the sources
      s.last_reject = last_reject_;
      s.last_reject_serial = last_reject_serial_;
    }
  }

 private:
  mutable std::mutex detail_mutex_;
  std::string last_reject_;
  uint64_t last_reject_serial_ = 0;  // process-wide order of the detailed rejects
};

}  // namespace kvrouter
