#include "ingest/ingest_loop.h"

#include <future>
#include <new>
#include <utility>

namespace kvrouter {

std::shared_ptr<SourceCounters> IngestLoop::NewSource(uint64_t& id, IngestSourceKind kind,
                                                      std::string endpoint,
                                                      std::shared_ptr<SourceCounters> live) {
  std::lock_guard lock(stats_mutex);
  id = next_source_id++;
  SourceRecord& record = sources[id];
  record.kind = kind;
  record.endpoint = std::move(endpoint);
  record.counters = live ? std::move(live) : std::make_shared<SourceCounters>();
  return record.counters;
}

void IngestLoop::RetireSource(uint64_t id) {
  std::lock_guard lock(stats_mutex);
  removed_sources.push_back(id);
  if (removed_sources.size() <= kRemovedSourcesKept) return;
  const uint64_t oldest = removed_sources.front();
  removed_sources.pop_front();
  auto it = sources.find(oldest);
  if (it == sources.end()) return;
  it->second.counters->AddTo(forgotten_totals);
  sources.erase(it);
}

absl::Status IngestLoop::StoppedStatus() {
  return absl::FailedPreconditionError("the ingest service is stopped");
}

absl::Status IngestLoop::Run(std::function<absl::Status()> command) {
  std::unique_lock lock(command_mutex);
  if (stopped) return StoppedStatus();
  // Already on the loop thread (a router callback run by an event this loop applied, e.g. a
  // request admitted by a replica's free): waiting for the loop would hang.
  if (running && std::this_thread::get_id() == thread.get_id()) {
    lock.unlock();
    return command();
  }
  if (!running) {
    lock.unlock();
    std::unique_lock before_start(before_start_mutex);
    lock.lock();
    if (stopped) return StoppedStatus();
    if (!running) {  // still not started: Start waits for this command
      lock.unlock();
      return command();
    }
    before_start.unlock();  // started meanwhile: the loop runs it
  }
  auto done = std::make_shared<std::promise<absl::Status>>();
  auto result = done->get_future();
  commands.push_back([command = std::move(command), done] {
    // A refused command still answers: its caller waits on the promise.
    absl::Status status;
    ContainRefusal([&] { status = command(); }, [&] { status = OutOfMemoryStatus(); });
    done->set_value(std::move(status));
  });
  uv_async_send(&wake);
  lock.unlock();
  return result.get();
}

bool IngestLoop::Post(std::function<void()> task) {
  std::lock_guard lock(command_mutex);
  if (stopped) return false;
  commands.push_back(std::move(task));
  uv_async_send(&wake);
  return true;
}

void IngestLoop::RunCommands() {
  {
    std::lock_guard lock(command_mutex);
    commands_running.swap(commands);
  }
  // A command that handles a message counts what a refusal lost itself; this only keeps the
  // refusal out of libuv and the other commands running.
  for (auto& command : commands_running) ContainRefusal(command, [] {});
  commands_running.clear();  // keeps a node: allocates nothing
}

void IngestLoop::Apply(std::span<const KvEvent> events, SourceCounters& source) {
  for (const KvEvent& event : events) (void)ApplyOne(event, source);
}

absl::StatusOr<ApplyResult> IngestLoop::ApplyOne(const KvEvent& event, SourceCounters& source) {
  try {
    absl::StatusOr<ApplyResult> result = router->ApplyEvent(event);
    // The tap hears what the index applied, even in part (a removal naming blocks the rank does
    // not hold removes the others): the same event does the same to an index in the same state.
    if (result.ok()) Tap(event, source);
    if (result.ok() && result->ok()) {
      Bump(source.events_applied);
    } else {
      source.Reject(IngestReject::kIndexRejected,
                    result.ok() ? result->message : std::string(result.status().message()));
    }
    return result;
  } catch (const std::bad_alloc&) {  // in the index, or in telling the tap or the counters
    RefusedForMemory(event.worker, source);
    return OutOfMemoryStatus();
  }
}

// The heap refused an allocation for an event: the index left the rank as it was, or (refused
// midway) holding nothing (RadixIndex::Apply). Either way the event is lost, so the rank is
// cleared (a clear of a known rank allocates nothing in the index) and the tap hears the clear;
// the source is told by the ResourceExhausted status (an engine source flags the rank unknown,
// as after a gap).
void IngestLoop::RefusedForMemory(WorkerKey rank, SourceCounters& source) {
  source.Reject(IngestReject::kIndexRejected, "out of memory");  // fits std::string's own buffer
  try {
    ClearRank(rank, source);
  } catch (const std::bad_alloc&) {  // an unknown rank (it holds nothing), or the tap's copy
  }
}

void IngestLoop::ClearRank(WorkerKey rank, const SourceCounters& source) {
  const KvEvent clear{.worker = rank, .event_id = next_event_id++, .data = ClearedEvent{}};
  (void)router->ApplyEvent(clear);
  Tap(clear, source);
}

}  // namespace kvrouter
