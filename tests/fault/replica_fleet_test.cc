// A fleet of router replicas under faults, with real processes on 127.0.0.1 (issue 18, point 4):
// three kvrouterd replicas consuming one JetStream stream (a durable consumer each) and sharing
// their bookings over NATS with heartbeats; a nats-server with JetStream on; three
// fault_publisher engines publishing native event batches into the stream, each retried until
// the server acknowledges it. Faults: a replica killed with SIGKILL and restarted warm from a
// peer, nats-server killed and restarted on the same store, a publisher paused. After each, every
// replica must hold exactly each engine's true blocks (its snapshot decoded with the public
// schema), the replicas' index digests must be equal, and the dead replica's bookings must be
// gone from its peers. Nothing asserts on elapsed time; each test prints a "[figures]" line
// (docs/replicas.md records them). Also: one daemon's /healthz while an engine's messages are
// lost.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "e2e_support.h"  // tests/service: kvrouterd as a child process, a small HTTP client
#include "fault_model.h"
#include "fault_support.h"
#include "nats_server.h"  // tests/ingest: a nats-server child on a free port

namespace kvr_fault {
namespace {

using Clock = std::chrono::steady_clock;
using kvrouter::FreePort;
using kvrouter::NatsServer;
using kvrouterd_test::DaemonProcess;
using kvrouterd_test::Http;
using kvrouterd_test::HttpAnswer;

constexpr int kReplicas = 3;
constexpr int kEngines = 3;  // workers 1..3, one publisher each
constexpr int kHeartbeatMs = 100;
constexpr int kReplicaTimeoutMs = 1000;
constexpr const char* kStream = "KV";

double MillisSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// The largest value of a Prometheus family's samples in `text` whose line contains `label`
// (0 if it has none).
double MetricMax(const std::string& text, const std::string& name, const std::string& label) {
  double best = 0;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind(name, 0) != 0 || line.size() <= name.size()) continue;
    const char next = line[name.size()];
    if ((next != ' ' && next != '{') || line.find(label) == std::string::npos) continue;
    best = std::max(best, std::stod(line.substr(line.rfind(' ') + 1)));
  }
  return best;
}

// One kvrouterd replica: its config file, its process, its HTTP port.
class Replica {
 public:
  Replica(std::string dir, int index) : dir_(std::move(dir)), index_(index) {}

  int Index() const { return index_; }  // 1-based
  std::string Name() const { return "replica-" + std::to_string(index_); }
  std::string Url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  bool Running() const { return process_ != nullptr; }

  // The settings every replica has, then `own`.
  void WriteConfigText(const std::string& own) const {
    std::ofstream config(ConfigPath());
    config << "listen = 127.0.0.1:0\n"
           << "port-file = " << PortFile() << "\n"
           << "block-size = " << kBlockSize << "\n"
           << "log-level = warn\n"
           << own;
  }

  void WriteConfig(const std::string& nats_url) const {
    std::ostringstream config;
    config << "jetstream-events = url=" << nats_url << ",stream=" << kStream
           << ",subject=kv.>,durable=" << Name() << ",create=true\n"
           << "replica-sync = " << nats_url << " kvrouter.replicas " << Name() << "\n"
           << "replica-heartbeat-ms = " << kHeartbeatMs << "\n"
           << "replica-timeout-ms = " << kReplicaTimeoutMs << "\n";
    for (int w = 1; w <= kEngines; ++w) config << "worker = id=" << w << "\n";
    WriteConfigText(config.str());
  }

  // Starts the daemon (warm from `peer` if given) and waits for its port.
  void Start(const std::string& peer = "") {
    std::filesystem::remove(PortFile());
    std::vector<std::string> args{"--config", ConfigPath()};
    if (!peer.empty()) args.insert(args.end(), {"--bootstrap-from", peer});
    process_ = std::make_unique<DaemonProcess>(KVRD_BINARY, args);
    ASSERT_GT(process_->pid(), 0);
    ASSERT_TRUE(WaitUntil([&] { return !kvrouterd_test::ReadFile(PortFile()).empty(); }))
        << Name() << " wrote no port file";
    port_ = std::stoi(kvrouterd_test::ReadFile(PortFile()));
  }

  void Kill() {
    process_->Signal(SIGKILL);
    process_->WaitExit();
    process_.reset();
  }

  // SIGTERM: it must exit 0.
  void Stop() {
    process_->Signal(SIGTERM);
    EXPECT_EQ(process_->WaitExit(), std::optional<int>(0)) << Name();
    process_.reset();
  }

  HttpAnswer Get(const std::string& path) const { return Http(port_, "GET", path); }
  HttpAnswer Post(const std::string& path, const std::string& body) const {
    return Http(port_, "POST", path, body);
  }
  HttpAnswer Delete(const std::string& path) const { return Http(port_, "DELETE", path); }
  double Metric(const std::string& name, const std::string& label = "") const {
    return MetricMax(Get("/metrics").body, name, label);
  }
  std::string IndexDigest() const {
    const auto body = nlohmann::json::parse(Get("/v1/digest").body, nullptr, false);
    return body.is_object() ? body.value("index_digest", "") : "";
  }

 private:
  std::string ConfigPath() const { return dir_ + "/" + Name() + ".conf"; }
  std::string PortFile() const { return dir_ + "/" + Name() + ".port"; }

  std::string dir_;
  int index_;
  int port_ = 0;
  std::unique_ptr<DaemonProcess> process_;
};

class ReplicaFleetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/kvr_fleet_XXXXXX";
    ASSERT_NE(nullptr, mkdtemp(dir));
    dir_ = dir;
    nats_port_ = FreePort();
    nats_ = std::make_unique<NatsServer>(nats_port_, dir_ + "/jetstream");
    ASSERT_TRUE(nats_->Start());
    for (int i = 0; i < kReplicas; ++i) {
      replicas_.push_back(std::make_unique<Replica>(dir_, i + 1));
      replicas_.back()->WriteConfig(nats_->url());
      replicas_.back()->Start();
    }
    for (int w = 1; w <= kEngines; ++w) {
      engines_.push_back(std::make_unique<Engine>(std::vector<std::string>{
          "--mode", "jetstream", "--endpoint", nats_->url(), "--subject",
          "kv.worker" + std::to_string(w), "--worker", std::to_string(w), "--generation",
          std::to_string(w), "--seed", std::to_string(7919 * w)}));
    }
  }

  void TearDown() override {
    for (auto& replica : replicas_) {
      if (replica->Running()) replica->Stop();
    }
    for (auto& engine : engines_) engine->Quit();
    nats_->Stop();
    std::filesystem::remove_all(dir_);
  }

  // Waits for every engine's publish reply (after starting `n` messages `pace_us` apart each,
  // if n > 0): the figures summed.
  Published FinishAll(uint64_t n = 0, uint64_t pace_us = 0) {
    if (n > 0) {
      for (auto& engine : engines_) engine->StartPublish(n, pace_us);
    }
    Published total;
    for (auto& engine : engines_) {
      const Published p = engine->FinishPublish();
      total.sent += p.sent;
      total.errors += p.errors;
      total.retries += p.retries;
    }
    published_ += total.sent;
    retries_ = total.retries;  // each engine counts over its life: the sum so far
    return total;
  }

  std::array<Hashes, kEngines + 1> Truth() {
    std::array<Hashes, kEngines + 1> truth;
    for (int w = 1; w <= kEngines; ++w) truth[w] = engines_[w - 1]->State();
    return truth;
  }

  // Whether `replica` holds exactly the engines' blocks.
  static bool HoldsExactly(const Replica& replica, const std::array<Hashes, kEngines + 1>& truth,
                           std::string* why) {
    const HttpAnswer snapshot = replica.Get("/v1/snapshot");
    if (snapshot.status != 200) {
      *why = replica.Name() + ": GET /v1/snapshot answered " + std::to_string(snapshot.status);
      return false;
    }
    const auto* data = reinterpret_cast<const uint8_t*>(snapshot.body.data());
    for (int w = 1; w <= kEngines; ++w) {
      const Hashes index = SnapshotBlocks(data, snapshot.body.size(), w);
      if (index != truth[w]) {
        *why = replica.Name() + ", worker " + std::to_string(w) + ": " +
               std::to_string(CountMissing(truth[w], index)) + " blocks missing, " +
               std::to_string(CountMissing(index, truth[w])) + " the engine does not hold";
        return false;
      }
    }
    return true;
  }

  // Waits until every running replica holds exactly the engines' true blocks, has applied the
  // whole stream, and all index digests agree: the milliseconds it took from `since`.
  double ExpectConverged(Clock::time_point since) {
    const auto truth = Truth();
    std::string why;
    const bool converged = WaitUntil([&] {
      std::string digest;
      for (const auto& replica : replicas_) {
        if (!replica->Running()) continue;
        const double position = replica->Metric("kvrouter_ingest_stream_sequence");
        if (position < static_cast<double>(published_)) {
          why = replica->Name() + " has applied the stream up to " + std::to_string(position) +
                " of " + std::to_string(published_);
          return false;
        }
        const std::string mine = replica->IndexDigest();
        if (mine.empty() || (!digest.empty() && mine != digest)) {
          why = "index digests differ: " + digest + " and " + mine + " (" + replica->Name() + ")";
          return false;
        }
        digest = mine;
      }
      for (const auto& replica : replicas_) {
        if (replica->Running() && !HoldsExactly(*replica, truth, &why)) return false;
      }
      return true;
    });
    EXPECT_TRUE(converged) << why;
    return MillisSince(since);
  }

  // The engines publish `n` messages each and every replica converges: the milliseconds that
  // took.
  double Warm(uint64_t n) {
    const auto start = Clock::now();
    FinishAll(n, 0);
    return ExpectConverged(start);
  }

  // The engines publish `n` messages each, `pace_us` apart, while `fault` runs; once it returns
  // (the fault over), every replica must converge with nothing lost: the milliseconds from the
  // fault's end (the engines' remaining publications included).
  double PublishThrough(uint64_t n, uint64_t pace_us, const std::function<void()>& fault) {
    for (auto& engine : engines_) engine->StartPublish(n, pace_us);
    fault();
    const auto over = Clock::now();
    EXPECT_EQ(FinishAll().errors, 0u);
    const double converged = ExpectConverged(over);
    EXPECT_EQ(Lost(), 0u);
    return converged;
  }

  // Waits until `holds` for every replica but `about`.
  void ExpectAtPeers(const Replica& about, const std::string& what,
                     const std::function<bool(const Replica&)>& holds) {
    for (const auto& peer : replicas_) {
      if (peer.get() == &about) continue;
      EXPECT_TRUE(WaitUntil([&] { return holds(*peer); }))
          << peer->Name() << " never " << what << "; its replica metrics:\n"
          << ReplicaMetrics(*peer);
    }
  }

  // The replica-sync lines of `replica`'s /metrics (what a failed wait shows).
  static std::string ReplicaMetrics(const Replica& replica) {
    std::istringstream lines(replica.Get("/metrics").body);
    std::string line, found;
    while (std::getline(lines, line)) {
      if (line.rfind("kvrouter_replica", 0) == 0) found += line + "\n";
    }
    return found;
  }

  // JetStream publications the engines repeated for want of an acknowledgement, so far.
  uint64_t TotalRetries() const { return retries_; }

  // Books `n` requests on `replica` (each routed and admitted, never freed).
  void Book(Replica& replica, int n) {
    for (int i = 0; i < n; ++i) {
      nlohmann::json body = {{"request_id", replica.Name() + "-" + std::to_string(i)},
                             {"token_ids", std::vector<uint32_t>(3 * kBlockSize, 7 + i)}};
      const HttpAnswer answer = replica.Post("/v1/route", body.dump());
      ASSERT_EQ(answer.status, 200) << answer.body;
    }
  }

  // Messages the engines had acknowledged that some replica has not applied: the stream lost
  // them (a replica behind was waited for by ExpectConverged).
  uint64_t Lost() {
    double position = static_cast<double>(published_);
    for (const auto& replica : replicas_) {
      position = std::min(position, replica->Metric("kvrouter_ingest_stream_sequence"));
    }
    return published_ - static_cast<uint64_t>(position);
  }

  static std::string Millis(double ms) { return std::to_string(static_cast<int>(ms)); }

  // One "[figures]" line: the scenario's own figures after the messages and the loss.
  void Report(const std::string& scenario, const std::string& own) {
    const std::string figures =
        "messages=" + std::to_string(published_) + " lost=" + std::to_string(Lost()) + " " + own;
    std::printf("[figures] %s: %s\n", scenario.c_str(), figures.c_str());
    std::fflush(stdout);
    RecordProperty("figures", figures);
  }

  std::string dir_;
  int nats_port_ = 0;
  std::unique_ptr<NatsServer> nats_;
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::vector<std::unique_ptr<Engine>> engines_;
  uint64_t published_ = 0;  // messages the server acknowledged: the stream's last sequence
  uint64_t retries_ = 0;
};

// A replica killed with SIGKILL while it holds bookings and the engines publish: its peers drop
// its bookings once its heartbeats stop for the timeout; restarted warm from a peer's snapshot,
// it consumes the stream from the peer's position and converges with the others.
TEST_F(ReplicaFleetTest, ReplicaKilledAndRestartedWarmConverges) {
  const double first = Warm(100);
  Replica& victim = *replicas_[2];
  constexpr int kBooked = 20;
  Book(victim, kBooked);
  ExpectAtPeers(victim, "heard the bookings", [&](const Replica& peer) {
    return peer.Metric("kvrouter_replica_requests_active") == kBooked;
  });

  double bookings_dropped = 0;
  // 150 messages 20 ms apart each: the engines still publish when the victim comes back.
  const double converged = PublishThrough(150, 20000, [&] {
    // (Counted from here: a peer that once missed a live replica's beats counted it already.)
    std::vector<double> expired_before;
    for (const auto& peer : replicas_) {
      expired_before.push_back(peer->Metric("kvrouter_replicas_expired_total"));
    }
    victim.Kill();
    const auto killed = Clock::now();
    ExpectAtPeers(victim, "dropped the dead replica's bookings", [&](const Replica& peer) {
      const double before = expired_before[peer.Index() - 1];
      return peer.Metric("kvrouter_replica_requests_active") == 0 &&
             peer.Metric("kvrouter_replicas_expired_total") > before;
    });
    bookings_dropped = MillisSince(killed);
    victim.Start(replicas_[0]->Url());
  });
  // It took the snapshot's blocks and only the messages after the peer's position.
  const auto after_restart =
      static_cast<uint64_t>(victim.Metric("kvrouter_ingest_messages_total", "kind=\"jetstream\""));
  EXPECT_LT(after_restart, published_);
  Report("replica killed and restarted warm",
         "first_convergence_ms=" + Millis(first) + " bookings_dropped_after_ms=" +
             Millis(bookings_dropped) + " (timeout " + std::to_string(kReplicaTimeoutMs) +
             ") messages_consumed_after_restart=" + std::to_string(after_restart) +
             " converged_after_restart_ms=" + Millis(converged));
}

// nats-server killed with SIGKILL and restarted on the same store while the engines publish:
// the engines retry until the stream has each message, the replicas' consumers resume, and
// nothing is lost. The outage outlasts the replicas' liveness timeout, so each expires the
// others and drops their bookings; once the server is back, each hears the others again and
// they announce their bookings again: the peers of the replica that booked hold them again.
TEST_F(ReplicaFleetTest, NatsServerRestartLosesNothing) {
  Warm(50);
  Replica& booker = *replicas_[0];
  constexpr int kBooked = 5;
  Book(booker, kBooked);
  const auto hold_the_bookings = [&](const Replica& peer) {
    return peer.Metric("kvrouter_replica_requests_active") == kBooked;
  };
  ExpectAtPeers(booker, "heard the bookings", hold_the_bookings);
  double outage = 0;
  const uint64_t retries_before = TotalRetries();
  const double converged = PublishThrough(200, 3000, [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    nats_->Stop();
    const auto down = Clock::now();
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    ASSERT_TRUE(nats_->Start());
    outage = MillisSince(down);
  });
  ExpectAtPeers(booker, "held the bookings again", hold_the_bookings);
  double expired = 0, redelivered = 0;
  for (const auto& replica : replicas_) {
    expired += replica->Metric("kvrouter_replicas_expired_total");
    // Messages the restarted server delivered again (their acknowledgements died with it):
    // dropped as stale, not applied twice.
    redelivered += replica->Metric("kvrouter_ingest_rejected_total", "stale_sequence");
  }
  Report("nats-server killed and restarted",
         "outage_ms=" + Millis(outage) +
             " publisher_retries=" + std::to_string(TotalRetries() - retries_before) +
             " converged_after_restart_ms=" + Millis(converged) +
             " replicas_expired=" + std::to_string(static_cast<int>(expired)) +
             " redeliveries_dropped=" + std::to_string(static_cast<int>(redelivered)) +
             " bookings_held_again=yes");
}

// A publisher stopped (SIGSTOP) mid-stream while the others go on, then continued: the replicas
// hold its blocks as of its pause meanwhile, and all converge once it resumes.
TEST_F(ReplicaFleetTest, PausedPublisherIsCaughtUpEverywhere) {
  Warm(50);
  const double converged = PublishThrough(150, 2000, [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const pid_t paused = engines_[1]->process().pid();
    kill(paused, SIGSTOP);
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    kill(paused, SIGCONT);
  });
  Report("publisher paused 1.5 s", "converged_after_resume_ms=" + Millis(converged));
}

// vLLM-style engines publishing over ZMQ (with replay endpoints) reach replicas that never
// subscribe to them: one kvrouterd subscribes and relays every change its index applies into
// the stream (--jetstream-relay), two others consume it. Faults: the relay killed with SIGKILL
// while the engines publish (their messages meanwhile reach nobody) and restarted: it hears
// each engine above its message 0, clears the rank and replays the engine's history, and
// relays that; nats-server killed and restarted while the engines publish: the relay retries
// until the stream has each change. After each, every replica holds exactly each engine's
// blocks.
class RelayFleetTest : public ::testing::Test {
 protected:
  static constexpr int kZmqEngines = 2;

  void SetUp() override {
    char dir[] = "/tmp/kvr_relay_XXXXXX";
    ASSERT_NE(nullptr, mkdtemp(dir));
    dir_ = dir;
    nats_ = std::make_unique<NatsServer>(FreePort(), dir_ + "/jetstream");
    ASSERT_TRUE(nats_->Start());
    std::ostringstream workers;
    for (int w = 1; w <= kZmqEngines; ++w) {
      const int port = FreePort(), replay = FreePort();
      engines_.push_back(std::make_unique<Engine>(std::vector<std::string>{
          "--mode", "zmq", "--endpoint", Tcp(port), "--replay", Tcp(replay), "--worker",
          std::to_string(w), "--generation", "1", "--seed", std::to_string(104729 * w)}));
      workers << "worker = id=" << w << ",engine=vllm,events=" << Tcp(port)
              << ",replay=" << Tcp(replay) << "\n";
    }
    relay_ = std::make_unique<Replica>(dir_, 0);
    relay_->WriteConfigText(workers.str() + "jetstream-relay = url=" + nats_->url() +
                            ",stream=" + kStream + ",subject=kv.relay,create=true\n");
    relay_->Start();
    for (int i = 1; i <= 2; ++i) {
      consumers_.push_back(std::make_unique<Replica>(dir_, i));
      std::ostringstream own;
      own << "jetstream-events = url=" << nats_->url() << ",stream=" << kStream
          << ",subject=kv.relay.>,durable=" << consumers_.back()->Name() << "\n";
      for (int w = 1; w <= kZmqEngines; ++w) own << "worker = id=" << w << "\n";
      consumers_.back()->WriteConfigText(own.str());
      consumers_.back()->Start();
    }
    for (auto& engine : engines_) engine->Do("wait-sub 10000");
  }

  void TearDown() override {
    for (auto& replica : consumers_) replica->Stop();
    if (relay_->Running()) relay_->Stop();
    for (auto& engine : engines_) engine->Quit();
    nats_->Stop();
    std::filesystem::remove_all(dir_);
  }

  // Every engine publishes `n` messages, `pace_us` apart, while `during` runs.
  void PublishThrough(uint64_t n, uint64_t pace_us, const std::function<void()>& during) {
    for (auto& engine : engines_) engine->StartPublish(n, pace_us);
    during();
    for (auto& engine : engines_) EXPECT_EQ(engine->FinishPublish().errors, 0u);
  }

  // Waits until the relay and every consumer hold exactly each engine's blocks: the
  // milliseconds from `since`.
  double ExpectEveryoneHoldsTheEngines(Clock::time_point since) {
    std::vector<Hashes> truth;
    for (auto& engine : engines_) truth.push_back(engine->State());
    std::string why;
    const bool converged = WaitUntil([&] {
      for (const Replica* replica : {relay_.get(), consumers_[0].get(), consumers_[1].get()}) {
        const HttpAnswer snapshot = replica->Get("/v1/snapshot");
        const auto* data = reinterpret_cast<const uint8_t*>(snapshot.body.data());
        for (int w = 1; w <= kZmqEngines; ++w) {
          const Hashes index = SnapshotBlocks(data, snapshot.body.size(), w);
          if (snapshot.status != 200 || index != truth[w - 1]) {
            why = replica->Name() + ", worker " + std::to_string(w) + ": " +
                  std::to_string(CountMissing(truth[w - 1], index)) + " blocks missing, " +
                  std::to_string(CountMissing(index, truth[w - 1])) + " the engine does not hold";
            return false;
          }
        }
      }
      return true;
    });
    EXPECT_TRUE(converged) << why;
    return MillisSince(since);
  }

  std::string dir_;
  std::unique_ptr<NatsServer> nats_;
  std::vector<std::unique_ptr<Engine>> engines_;
  std::unique_ptr<Replica> relay_;
  std::vector<std::unique_ptr<Replica>> consumers_;
};

TEST_F(RelayFleetTest, ZmqEnginesReachEveryReplicaThroughRelayKillsAndServerRestarts) {
  const auto start = Clock::now();
  PublishThrough(100, 0, [] {});
  const double first = ExpectEveryoneHoldsTheEngines(start);

  uint64_t unheard = 0;
  for (auto& engine : engines_) engine->StartPublish(60, 10000);
  relay_->Kill();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // messages reach nobody
  relay_->Start();
  for (auto& engine : engines_) unheard += engine->FinishPublish().unheard;
  const auto restarted = Clock::now();
  const double after_kill = ExpectEveryoneHoldsTheEngines(restarted);
  EXPECT_GT(unheard, 0u);  // the relay really missed messages: its replay brought them

  double outage = 0;
  PublishThrough(150, 3000, [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    nats_->Stop();
    const auto down = Clock::now();
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    ASSERT_TRUE(nats_->Start());
    outage = MillisSince(down);
  });
  const double after_nats = ExpectEveryoneHoldsTheEngines(Clock::now());
  const double failures =
      relay_->Metric("kvrouter_ingest_publish_failures_total", "kind=\"jetstream_relay\"");
  std::printf(
      "[figures] relay of zmq engines: first_convergence_ms=%d relay_killed_unheard=%lu "
      "converged_after_relay_restart_ms=%d nats_outage_ms=%d relay_publish_failures=%d "
      "converged_after_nats_restart_ms=%d\n",
      static_cast<int>(first), unheard, static_cast<int>(after_kill), static_cast<int>(outage),
      static_cast<int>(failures), static_cast<int>(after_nats));
  std::fflush(stdout);
}

// The daemon's /healthz body (a failure unless it answers 200).
nlohmann::json Health(const Replica& daemon) {
  const HttpAnswer answer = daemon.Get("/healthz");
  EXPECT_EQ(answer.status, 200) << answer.body;
  return nlohmann::json::parse(answer.body, nullptr, false);
}

// Whether /healthz comes to say `status` with `unknown` ranks of unknown state.
bool HealthBecomes(const Replica& daemon, const std::string& status, int unknown) {
  return WaitUntil([&] {
    const nlohmann::json body = Health(daemon);
    return body.is_object() && body.value("status", "") == status &&
           body.value("ranks_state_unknown", -1) == unknown;
  });
}

// Whether the daemon's ingest comes to count `n` messages.
bool MessagesReach(const Replica& daemon, double n) {
  return WaitUntil([&] { return daemon.Metric("kvrouter_ingest_messages_total") >= n; });
}

// One daemon, one vLLM-style engine without a replay socket: /healthz stays 200, says
// "degraded" with the count while the engine's rank is flagged after lost messages, and "ok"
// once the engine clears its cache.
TEST(DaemonHealthTest, LostEngineMessagesAreDegradedUntilTheEngineClears) {
  char dir[] = "/tmp/kvr_health_XXXXXX";
  ASSERT_NE(nullptr, mkdtemp(dir));
  const int port = FreePort();
  Engine engine({"--mode", "zmq", "--endpoint", Tcp(port), "--worker", "1", "--generation", "1",
                 "--seed", "7919"});
  Replica daemon(dir, 1);
  daemon.WriteConfigText("worker = id=1,engine=vllm,events=" + Tcp(port) + "\n");
  daemon.Start();
  engine.Do("wait-sub 10000");

  engine.Publish(20);
  ASSERT_TRUE(MessagesReach(daemon, 20));
  EXPECT_TRUE(HealthBecomes(daemon, "ok", 0)) << Health(daemon).dump();
  engine.Do("skip 3");
  engine.Publish(1);
  EXPECT_TRUE(HealthBecomes(daemon, "degraded", 1)) << Health(daemon).dump();
  EXPECT_EQ(Health(daemon)["workers"], 1);
  engine.Do("clear");
  EXPECT_TRUE(HealthBecomes(daemon, "ok", 0)) << Health(daemon).dump();

  daemon.Stop();
  engine.Quit();
  std::filesystem::remove_all(dir);
}

// A worker whose events come over NATS (Dynamo's event plane) and whose rank a gap flagged:
// removed, it no longer keeps the daemon "degraded" (it did until a restart, as its engine may
// never clear), even as its engine goes on publishing through another gap while it drains;
// added back still flagged, it counts again until its engine clears.
TEST(DaemonHealthTest, ARemovedNatsWorkerNoLongerCounts) {
  char dir[] = "/tmp/kvr_health_XXXXXX";
  ASSERT_NE(nullptr, mkdtemp(dir));
  NatsServer nats(FreePort());
  ASSERT_TRUE(nats.Start());
  Engine engine({"--mode", "nats", "--endpoint", nats.url(), "--subject", "kv.events.w1",
                 "--format", "dynamo", "--worker", "1", "--generation", "1", "--seed", "7919"});
  Replica daemon(dir, 1);
  daemon.WriteConfigText("nats-events = " + nats.url() + " kv.events.>\nworker = id=1\n");
  daemon.Start();

  engine.Publish(20);  // the daemon subscribed before it started listening: heard from 0
  ASSERT_TRUE(MessagesReach(daemon, 20));
  EXPECT_TRUE(HealthBecomes(daemon, "ok", 0)) << Health(daemon).dump();
  engine.Do("skip 3");
  engine.Publish(1);
  EXPECT_TRUE(HealthBecomes(daemon, "degraded", 1)) << Health(daemon).dump();
  EXPECT_EQ(daemon.Delete("/v1/workers/1").status, 200);
  EXPECT_TRUE(HealthBecomes(daemon, "ok", 0)) << Health(daemon).dump();
  engine.Publish(5);
  engine.Do("skip 2");
  engine.Publish(1);
  ASSERT_TRUE(MessagesReach(daemon, 27));
  EXPECT_EQ(Health(daemon).value("ranks_state_unknown", -1), 0) << Health(daemon).dump();
  EXPECT_EQ(daemon.Post("/v1/workers", R"({"worker_id": 1})").status, 201);
  EXPECT_TRUE(HealthBecomes(daemon, "degraded", 1)) << Health(daemon).dump();
  engine.Do("clear");
  EXPECT_TRUE(HealthBecomes(daemon, "ok", 0)) << Health(daemon).dump();

  daemon.Stop();
  engine.Quit();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvr_fault
