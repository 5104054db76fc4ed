#include "ingest/remake_connector.h"

#include <new>
#include <utility>

#include "ingest/ingest_loop.h"

namespace kvrouter {

RemakeConnector::~RemakeConnector() {
  Stop();  // (done already by the loop's close: an attempt left polled would outlive its owner)
  std::list<Attempt> attempts;
  {
    std::lock_guard lock(mutex_);
    attempts.swap(attempts_);
  }
  for (Attempt& attempt : attempts) attempt.thread.join();
}

void RemakeConnector::Add(Job job) {
  std::lock_guard lock(mutex_);
  if (stopping_) return;
  JoinFinishedLocked();
  Attempt& attempt = attempts_.emplace_back();
  // Refused memory for the place, the job is given none (its attempt fails).
  ContainRefusal([&] { attempt.place = NatsLoopPlace::Make(loop_); }, [] {});
  try {
    attempt.thread = std::thread(
        [this, &attempt, job = std::move(job)]() mutable { Run(attempt, std::move(job)); });
  } catch (...) {
    attempts_.pop_back();
    throw std::bad_alloc();
  }
}

void RemakeConnector::Run(Attempt& attempt, Job job) {
  std::shared_ptr<NatsLoopPlace> place;
  {
    std::lock_guard lock(mutex_);  // (defensive: the thread's start orders Add's writes first)
    place = attempt.place;
  }
  job(std::move(place));  // must not throw
  job = nullptr;          // what it holds goes before the thread counts as finished
  std::lock_guard lock(mutex_);
  attempt.place.reset();  // if not taken already
  attempt.finished = true;
}

void RemakeConnector::JoinFinishedLocked() {
  for (auto it = attempts_.begin(); it != attempts_.end();) {
    if (!it->finished) {
      ++it;
      continue;
    }
    it->thread.join();  // it only returns now: it no longer needs mutex_
    it = attempts_.erase(it);
  }
}

void RemakeConnector::Taken(const std::shared_ptr<NatsLoopPlace>& place) {
  std::lock_guard lock(mutex_);
  for (Attempt& attempt : attempts_) {
    if (attempt.place == place) attempt.place.reset();
  }
}

void RemakeConnector::Stop() {
  std::lock_guard lock(mutex_);
  stopping_ = true;
  for (Attempt& attempt : attempts_) {
    if (attempt.place != nullptr) attempt.place->Abandon();
  }
}

size_t RemakeConnector::Threads() const {
  std::lock_guard lock(mutex_);
  return attempts_.size();
}

}  // namespace kvrouter
