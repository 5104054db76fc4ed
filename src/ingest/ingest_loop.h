// What every ingest source shares (internal to src/ingest): the libuv loop and its thread,
// commands run where the loop's state may be touched, the router that events are applied to,
// and the registry of sources with their counters. The sources are units of their own:
// stream_listener (native stream), engine_subscription (vLLM/SGLang over ZMQ),
// nats_subscription (NATS subjects, with replica_sync); ingest_service.cc composes them.
#pragma once

#include <uv.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/router.h"
#include "ingest/ingest_service.h"
#include "ingest/source_counters.h"

namespace kvrouter {

// Closes a heap-allocated libuv handle and deletes its owner once libuv is done with it.
template <typename Owner>
void CloseAndDelete(uv_handle_t* handle, Owner* owner) {
  handle->data = owner;
  if (uv_is_closing(handle)) return;
  uv_close(handle, [](uv_handle_t* h) { delete static_cast<Owner*>(h->data); });
}

// Runs `work` where a C library (libuv, libnats) called into the ingest. A std::bad_alloc must
// not unwind into its frames: libuv's loop would be left inside its poll, and on libnats'
// threads it ends in std::terminate. When the heap refused `work`, runs `lost`, which counts
// what the refusal cost (a message lost, a rank cleared and flagged where the index can no
// longer be trusted), contained too. Whether `work` completed.
template <typename Work, typename Lost>
bool ContainRefusal(Work&& work, Lost&& lost) noexcept {
  try {
    work();
    return true;
  } catch (const std::bad_alloc&) {
    try {
      lost();
    } catch (const std::bad_alloc&) {  // the count above it is all there is
    }
    return false;
  }
}

// Told of every change an ingest source made to the index, in the order applied (a JetStream
// relay republishes them: jetstream_relay.h). Loop thread; must not block.
class IndexChangeTap {
 public:
  virtual ~IndexChangeTap() = default;
  virtual void Changed(const KvEvent& event) = 0;
};

struct IngestLoop {
  Router* router = nullptr;
  // Loop-thread state: the relay, if one was started (owned by its transport's unit).
  IndexChangeTap* tap = nullptr;
  IngestOptions options;
  uv_loop_t loop{};
  uv_async_t wake{};

  // Commands for the loop thread.
  std::mutex command_mutex;
  std::deque<std::function<void()>> commands;
  // Loop thread: the commands being run, swapped out of `commands`. A member, so that taking
  // them allocates nothing (a deque's default constructor does).
  std::deque<std::function<void()>> commands_running;
  bool running = false;
  bool stopped = false;
  std::thread thread;
  // Before Start, commands run on their callers' threads: one at a time (callers may be on
  // several threads), and never while Start hands the loop to its thread or Stop closes it.
  // Taken before command_mutex. Recursive: a command may run another (a router callback).
  std::recursive_mutex before_start_mutex;
  std::mutex join_mutex;  // Stop's callers, one at a time, join `thread`

  // The registry of sources, under stats_mutex: every live source and the most recently removed
  // ones (their counters and endpoint still readable), by id. Older removed sources are
  // forgotten, their counters folded into `forgotten_totals`: workers that come and go do not
  // grow it without limit, and the totals (source 0) still count everything.
  static constexpr size_t kRemovedSourcesKept = 1024;
  struct SourceRecord {
    IngestSourceKind kind = IngestSourceKind::kListener;
    std::string endpoint;  // as Endpoint() reports it
    std::shared_ptr<SourceCounters> counters;
  };
  mutable std::mutex stats_mutex;
  std::map<uint64_t, SourceRecord> sources;
  std::deque<uint64_t> removed_sources;  // still in `sources`, oldest first
  IngestStats forgotten_totals;
  uint64_t next_source_id = 1;

  // Loop-thread state (or caller-thread state before Start).
  uint64_t next_event_id = 1;

  // A new source id for `endpoint` (what Endpoint(id) reports), with its counters.
  std::shared_ptr<SourceCounters> NewSource(uint64_t& id, IngestSourceKind kind,
                                            std::string endpoint,
                                            std::shared_ptr<SourceCounters> live = nullptr);
  // The source was removed: still listed until kRemovedSourcesKept newer ones were.
  void RetireSource(uint64_t id);

  // Runs `command` where loop state may be touched: inline before Start (one caller at a
  // time), on the loop after.
  absl::Status Run(std::function<absl::Status()> command);
  static absl::Status StoppedStatus();
  // Hands `task` to the loop from any thread (a transport's own thread); dropped, returning
  // false, once the service is stopped (the loop is closing).
  bool Post(std::function<void()> task);
  // The loop thread's side of Run and Post.
  void RunCommands();

  // Applies router events, counting each outcome on `source`; the tap hears those applied.
  void Apply(std::span<const KvEvent> events, SourceCounters& source);
  absl::StatusOr<ApplyResult> ApplyOne(const KvEvent& event, SourceCounters& source);
  // Drops everything the index holds for one rank, for `source`.
  void ClearRank(WorkerKey rank, const SourceCounters& source);
  void RefusedForMemory(WorkerKey rank, SourceCounters& source);

 private:
  void Tap(const KvEvent& event, const SourceCounters& source) {
    if (tap != nullptr && source.relayed) tap->Changed(event);
  }
};

}  // namespace kvrouter
