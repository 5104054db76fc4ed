// Makes the connections of NATS remakes (NatsSubscriptions::RemakeConnection), each attempt on
// a thread of its own: a server that does not answer holds that attempt for libnats' connect
// timeout per server of the url, not the ingest loop and not another source's attempt (a
// single helper thread made them one after another: a silent multi-server url held every other
// source's remake behind it).
//
// Each job is given the place its connection is to be polled at. The loop closing abandons the
// places of the attempts under way (their jobs then discard what they make, the loop no longer
// taking it), and no job starts after that. A source has at most one attempt under way, so the
// threads are at most the sources making their connection again, plus those finished since the
// last Add (the next Add joins them, or the destructor). Not capped: one server error closing
// many sources' connections starts as many connects at once (each connection has libnats'
// own threads besides).
#pragma once

#include <cstddef>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <thread>

#include "ingest/nats_loop_place.h"

namespace kvrouter {

struct IngestLoop;

class RemakeConnector {
 public:
  // Given a place (null if the heap refused it). Must not throw.
  using Job = std::function<void(std::shared_ptr<NatsLoopPlace> place)>;

  explicit RemakeConnector(IngestLoop& loop) : loop_(loop) {}
  ~RemakeConnector();  // after Stop: joins every attempt's thread
  RemakeConnector(const RemakeConnector&) = delete;
  RemakeConnector& operator=(const RemakeConnector&) = delete;

  // Loop thread: starts `job` on a thread of its own. Throws std::bad_alloc (nothing started
  // then; a thread refused is a refusal like any other).
  void Add(Job job);
  // Loop thread: the loop took `place` (a job's connection): closing no longer abandons it.
  void Taken(const std::shared_ptr<NatsLoopPlace>& place);
  // Loop thread (closing): no job starts from now on, and those under way are not polled.
  void Stop();
  // Threads not joined yet: the attempts under way and those finished since the last Add.
  size_t Threads() const;

 private:
  struct Attempt {
    std::shared_ptr<NatsLoopPlace> place;  // until taken or finished: what Stop abandons
    std::thread thread;
    bool finished = false;
  };
  void Run(Attempt& attempt, Job job);
  void JoinFinishedLocked();

  IngestLoop& loop_;
  mutable std::mutex mutex_;
  std::list<Attempt> attempts_;  // guarded by mutex_ (a list: each thread keeps its element)
  bool stopping_ = false;        // guarded by mutex_
};

}  // namespace kvrouter
