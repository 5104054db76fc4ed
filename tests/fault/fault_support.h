// What the fault tests share (fault_test.cc: one router in the test's process;
// replica_fleet_test.cc: kvrouterd replicas as processes): waiting with a deadline, the
// fault_publisher child that plays an engine, and the blocks an index snapshot holds, decoded
// with the public schema as a user would.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "child_process.h"
#include "index_snapshot_generated.h"  // flatc of the installed schema, as a user compiles it

namespace kvr_fault {

using Hashes = std::set<uint64_t>;

inline constexpr auto kPatience = std::chrono::seconds(60);

// The tests write commands to their children; one that died must not kill them with SIGPIPE.
inline const bool kSigpipeIgnored = [] {
  signal(SIGPIPE, SIG_IGN);
  return true;
}();

inline bool WaitUntil(const std::function<bool()>& done,
                      std::chrono::milliseconds limit = kPatience) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

inline std::string Tcp(int port) { return "tcp://127.0.0.1:" + std::to_string(port); }

inline size_t CountMissing(const Hashes& from, const Hashes& in) {
  size_t n = 0;
  for (uint64_t h : from) n += in.count(h) == 0;
  return n;
}

inline bool IsSubset(const Hashes& small, const Hashes& big) {
  return CountMissing(small, big) == 0;
}

// The reply of "publish": how many were sent, sent to nobody, refused, and JetStream
// publications repeated for want of an acknowledgement (over the publisher's life).
struct Published {
  uint64_t sent = 0, unheard = 0, errors = 0, retries = 0;
};

inline Published ParsePublished(const std::string& reply) {
  Published p;
  std::sscanf(reply.c_str(), "ok sent=%lu unheard=%lu errors=%lu retries=%lu", &p.sent, &p.unheard,
              &p.errors, &p.retries);
  return p;
}

// A fault_publisher child.
class Engine {
 public:
  explicit Engine(const std::vector<std::string>& args) : process_(KVR_FAULT_PUBLISHER, args) {
    EXPECT_TRUE(process_.alive()) << "cannot start " << KVR_FAULT_PUBLISHER;
  }

  // Runs a command; a failure unless it answers "ok".
  std::string Do(const std::string& command) {
    const auto reply = process_.Command(command);
    EXPECT_TRUE(reply && reply->rfind("ok", 0) == 0)
        << "'" << command << "' answered: " << reply.value_or("(nothing)");
    return reply.value_or("");
  }
  Published Publish(uint64_t n, uint64_t pace_us = 0) {
    return ParsePublished(Do(PublishCommand(n, pace_us)));
  }
  // Publish without waiting: the engine publishes while the test does something else; then
  // FinishPublish waits for its reply.
  void StartPublish(uint64_t n, uint64_t pace_us) {
    EXPECT_TRUE(process_.Send(PublishCommand(n, pace_us)));
  }
  Published FinishPublish(std::chrono::milliseconds limit = std::chrono::minutes(3)) {
    const auto reply = process_.ReadLine(limit);
    EXPECT_TRUE(reply && reply->rfind("ok", 0) == 0) << reply.value_or("(no reply)");
    return ParsePublished(reply.value_or(""));
  }

  // The engine's true state: the hashes it holds.
  Hashes State() {
    std::istringstream in(Do("state"));
    std::string ok;
    size_t n = 0;
    in >> ok >> n;
    Hashes out;
    uint64_t h;
    while (in >> h) out.insert(h);
    EXPECT_EQ(n, out.size());
    return out;
  }

  ChildProcess& process() { return process_; }
  void Kill() { process_.Kill(); }
  // Exits by itself: its status must be 0 (under ASan, no leak either).
  void Quit() {
    Do("quit");
    EXPECT_EQ(0, process_.Wait());
  }

 private:
  static std::string PublishCommand(uint64_t n, uint64_t pace_us) {
    return "publish " + std::to_string(n) + " " + std::to_string(pace_us);
  }

  ChildProcess process_;
};

// The blocks an index snapshot (kvr_router_snapshot's bytes) holds for (worker, rank) on any
// tier, by engine hash: its stored, removed and cleared events replayed in order.
inline Hashes SnapshotBlocks(const uint8_t* data, size_t size, uint64_t worker, uint32_t rank = 0) {
  Hashes out;
  flatbuffers::Verifier verifier(data, size);
  EXPECT_TRUE(kvrouter::wire::VerifyIndexSnapshotBuffer(verifier));
  const auto* snapshot = kvrouter::wire::GetIndexSnapshot(data);
  if (snapshot->events() == nullptr) return out;
  for (const auto* e : *snapshot->events()) {
    if (e->worker_id() != worker || e->dp_rank() != rank) continue;
    switch (e->data_type()) {
      case kvrouter::wire::EventData::Stored:
        for (uint64_t h : *e->data_as_Stored()->block_hashes()) out.insert(h);
        break;
      case kvrouter::wire::EventData::Removed:
        for (uint64_t h : *e->data_as_Removed()->block_hashes()) out.erase(h);
        break;
      default:
        out.clear();
        break;
    }
  }
  return out;
}

}  // namespace kvr_fault
