// What a refused allocation on the ingest loop leaves behind. The loop runs inside libuv's
// callbacks (and libnats' threads hand it messages): a std::bad_alloc that unwound into them
// would leave libuv mid-poll or end the process (std::terminate). Here an engine publishes over
// ZMQ on 127.0.0.1 while the n-th allocation of the loop thread is refused, for n = 1, 2, ...
// (FailAllocationForTesting, each run in a child process so that a crash is a finding like any
// other): the process must survive, the loop go on taking messages, what was lost be counted
// (a gap, the rank cleared and flagged unknown), and the engine's next clear make the rank
// known again, with what it stores after it in the index.
//
// Counted: the index's own allocations and operator new on the loop thread (named
// kIngestThreadName), except inside libzmq (InsideZmq), which no caller can make safe. This binary
// replaces operator new, so it is a binary of its own (the others keep AddressSanitizer's checks of
// new against delete).
#include <dlfcn.h>
#include <execinfo.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <new>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "core/counting_allocator.h"
#include "core/router.h"
#include "in_child.h"
#include "ingest/ingest_service.h"
#include "refusing_operator_new.h"
#include "wire/flatbuffers_codec.h"
#include "wire/framing.h"

// ---- operator new counts against FailAllocationForTesting on the loop thread ---------------

namespace {

std::atomic<bool> count_loop_allocations{false};

// backtrace() (InsideZmq) loads its unwinder on first use: done before any sweep is armed.
const int kBacktraceReady = [] {
  void* frame[1];
  return backtrace(frame, 1);
}();

bool OnLoopThread() {
  thread_local int on_loop = -1;  // unknown until first asked (the name is set at its start)
  if (on_loop < 0) {
    char name[16] = {};
    pthread_getname_np(pthread_self(), name, sizeof(name));
    on_loop = std::strcmp(name, kvrouter::kIngestThreadName) == 0 ? 1 : 0;
  }
  return on_loop == 1;
}

// Whether libzmq is on the stack: it is not exception-safe (a refusal inside zmq_connect, in a
// std::string it builds, leaves a socket the context never lets go of), nor meant to be (its
// own allocations abort when refused, alloc_assert). Its frames are in its own library even
// when the allocation is made by std::string code emitted into this binary.
bool InsideZmq() {
  void* frames[32];
  const int depth = backtrace(frames, 32);
  for (int i = 1; i < depth; ++i) {
    Dl_info info;
    if (dladdr(frames[i], &info) != 0 && info.dli_fname != nullptr &&
        std::strstr(info.dli_fname, "libzmq") != nullptr) {
      return true;
    }
  }
  return false;
}

}  // namespace

bool RefuseThisAllocation() noexcept {
  return kvrouter::internal::allocation_failure_countdown.load(std::memory_order_relaxed) != 0 &&
         count_loop_allocations.load(std::memory_order_relaxed) && OnLoopThread() && !InsideZmq() &&
         kvrouter::CountAllocationForTesting();
}

namespace kvrouter {
namespace {

constexpr auto kWait = std::chrono::seconds(5);

std::vector<uint8_t> VllmPayload(const std::string& name) {
  std::ifstream in(std::string(KVR_DATA_DIR) + "/vectors/vllm_kv_events_vectors.json");
  const nlohmann::json vectors = nlohmann::json::parse(in);
  for (const nlohmann::json& v : vectors.at("vectors")) {
    if (v.at("name").get<std::string>() != name) continue;
    const std::string hex = v.at("zmq_frames").at("payload_hex").get<std::string>();
    std::vector<uint8_t> out;
    for (size_t i = 0; i + 1 < hex.size(); i += 2) {
      out.push_back(static_cast<uint8_t>(std::stoul(hex.substr(i, 2), nullptr, 16)));
    }
    return out;
  }
  std::abort();
}

// The prompt whose first two blocks "array_store_dp_medium" stores (and the third
// "array_store_continuation"), as in engine_ingest_test.cc.
std::vector<uint32_t> Prompt() {
  std::vector<uint32_t> tokens;
  for (uint32_t t = 1001; t <= 1048; ++t) tokens.push_back(t);
  return tokens;
}

// The prompt's blocks worker 5 (rank 0) holds on the device tier, as the router matches them.
uint32_t DeviceBlocksOfWorker5(Router& router) {
  const absl::StatusOr<std::vector<OverlapScore>> scores = router.OverlapScores(Prompt());
  if (!scores.ok()) return 0u;
  for (const OverlapScore& s : *scores) {
    if (s.worker == WorkerKey{.worker_id = 5}) return s.overlap.device_blocks;
  }
  return 0u;
}

// One engine message: [topic, 8-byte big-endian sequence, payload].
void SendEngineMessage(void* engine, uint64_t seq, const std::vector<uint8_t>& payload) {
  uint8_t seq_bytes[8];
  for (int i = 0; i < 8; ++i) seq_bytes[i] = static_cast<uint8_t>(seq >> (56 - 8 * i));
  zmq_send(engine, "kv-events", 9, ZMQ_SNDMORE);
  zmq_send(engine, seq_bytes, 8, ZMQ_SNDMORE);
  zmq_send(engine, payload.data(), payload.size(), 0);
}

// An engine's XPUB socket bound to a free port on 127.0.0.1 (null if it cannot be), and where.
void* BindEngine(void* context, std::string& endpoint) {
  void* engine = zmq_socket(context, ZMQ_XPUB);
  const int linger = 0;
  zmq_setsockopt(engine, ZMQ_LINGER, &linger, sizeof(linger));
  if (zmq_bind(engine, "tcp://127.0.0.1:*") != 0) return nullptr;
  char bound[256] = {};
  size_t size = sizeof(bound);
  zmq_getsockopt(engine, ZMQ_LAST_ENDPOINT, bound, &size);
  endpoint = bound;
  return engine;
}

// One run, in a child: "" or the problem it found; `refused` says whether the refusal came.
std::string EngineRun(uint64_t n, bool& refused) {
  void* context = zmq_ctx_new();
  std::string endpoint;
  void* engine = BindEngine(context, endpoint);
  if (engine == nullptr) return "cannot bind the engine";
  auto send = [&](uint64_t seq, const std::string& vector) {
    const std::vector<uint8_t> payload = VllmPayload(vector);
    SendEngineMessage(engine, seq, payload);
  };

  std::unique_ptr<Router> router = *Router::Create(RouterOptions{.block_size = 16});
  std::unique_ptr<IngestService> ingest = *IngestService::Create(router.get(), {});
  if (!ingest->Start().ok()) return "the ingest did not start";
  const absl::StatusOr<uint64_t> source = ingest->AddEngineWorker(
      EngineWorker{.endpoint = endpoint, .worker_id = 5, .topic = "kv-events"});
  if (!source.ok()) return "cannot subscribe: " + source.status().ToString();
  zmq_pollitem_t item{engine, 0, ZMQ_POLLIN, 0};
  char subscription[64];
  if (zmq_poll(&item, 1, 5000) != 1 ||
      zmq_recv(engine, subscription, sizeof(subscription), 0) < 1) {
    return "no subscriber";
  }
  // Until the source has taken `messages` (handled, or lost and counted as missed).
  auto wait_for = [&](uint64_t messages) -> absl::StatusOr<IngestStats> {
    const auto deadline = std::chrono::steady_clock::now() + kWait;
    for (;;) {
      absl::StatusOr<IngestStats> stats = ingest->Stats(*source);
      if (!stats.ok()) return stats.status();
      if (stats->messages + stats->missed_messages >= messages) return stats;
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError("the loop stopped taking messages");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  };
  // Whether `done()` held within kWait.
  auto within_wait = [](auto done) {
    const auto deadline = std::chrono::steady_clock::now() + kWait;
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) return absl::DeadlineExceededError("");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return absl::OkStatus();
  };
  auto device_blocks = [&] { return DeviceBlocksOfWorker5(*router); };

  count_loop_allocations = true;
  FailAllocationForTesting(n);
  send(0, "array_store_dp_medium");
  send(1, "array_store_continuation");
  absl::StatusOr<IngestStats> armed = wait_for(2);
  refused = FailAllocationForTesting(0) == 0;
  count_loop_allocations = false;
  if (!armed.ok()) return std::string(armed.status().message());
  if (!refused && (armed->missed_messages != 0 || device_blocks() != 3)) {
    return "no refusal, yet the two stores did not both apply (" + std::to_string(armed->messages) +
           " messages, " + std::to_string(armed->events_applied) + " events, " +
           std::to_string(armed->missed_messages) + " missed, " + std::to_string(device_blocks()) +
           " blocks)";
  }
  // Whatever the refusal hit (reading, decoding, applying, counting), a message's effect on the
  // rank is unknown: the rank is flagged, before the engine's clear. (A refusal while decoding
  // was taken for bad input, and the message lost unflagged.)
  if (refused) {
    const absl::Status flagged = within_wait([&] {
      const absl::StatusOr<IngestStats> stats = ingest->Stats(*source);
      return stats.ok() && stats->state_unknown == 1;
    });
    if (!flagged.ok()) {
      const IngestStats stats = ingest->Stats(*source).value_or(IngestStats{});
      return "refused, yet the rank is not flagged (" + std::to_string(stats.gaps) + " gaps, " +
             std::to_string(stats.rejected[static_cast<int>(IngestReject::kBadMsgpack)]) +
             " bad msgpack, last reject '" + stats.last_reject + "', " +
             std::to_string(device_blocks()) + " blocks)";
    }
  }
  // The engine clears its cache and stores again: its rank is known, and holds what it stored.
  send(2, "array_all_cleared");
  send(3, "array_store_dp_medium");
  // (Waited for by what it must lead to: a lost message may be counted as missed and then as
  // taken too, so counts cannot tell when the last one was handled.)
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  for (;;) {
    absl::StatusOr<IngestStats> after = ingest->Stats(*source);
    if (!after.ok()) return "after the refusal, " + after.status().ToString();
    const uint32_t blocks = device_blocks();
    if (after->state_unknown == 0 && blocks == 2) break;
    if (std::chrono::steady_clock::now() > deadline) {
      return "after the engine's clear and a store of 2 blocks, the rank holds " +
             std::to_string(blocks) + (after->state_unknown != 0 ? " and is still flagged" : "") +
             " (" + std::to_string(after->messages) + " messages, " +
             std::to_string(after->missed_messages) + " missed)";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ingest.reset();
  zmq_close(engine);
  zmq_ctx_term(context);
  return "";
}

// The outcome of run n in a child: 0 (fine, refused), 1 (fine, nothing left to refuse), or a
// problem (its text, or how the child died: a hang ends in SIGALRM).
struct Outcome {
  int code = 0;
  std::string problem;
};

using RunFn = std::string (*)(uint64_t n, bool& refused);

Outcome InChild(uint64_t n, RunFn run) {
  const ChildRun child = RunInChild([&](int fd) {
    alarm(30);
    bool refused = false;
    const std::string problem = run(n, refused);
    if (!problem.empty()) {
      (void)!write(fd, problem.data(), problem.size());
      _exit(2);
    }
    _exit(refused ? 0 : 1);
  });
  if (WIFSIGNALED(child.wait_status)) {
    return {2, "died of signal " + std::to_string(WTERMSIG(child.wait_status))};
  }
  const int code = WEXITSTATUS(child.wait_status);
  return {code, code == 2 ? child.output : ""};
}

// Runs `run` with n = 1, 2, ... until a run makes fewer than n allocations; how many were
// refused. Each problem is a test failure.
uint64_t Sweep(const char* what, RunFn run) {
  // KVR_ALLOCATION_FAILURE=n runs only the n-th, in the test's own process (for a debugger).
  if (const char* only = std::getenv("KVR_ALLOCATION_FAILURE")) {
    bool refused = false;
    const std::string problem = run(std::strtoull(only, nullptr, 10), refused);
    EXPECT_EQ(problem, "");
    return refused ? 1 : 0;
  }
  constexpr uint64_t kMostRuns = 2000;
  uint64_t refused = 0;
  std::vector<std::string> problems;
  for (uint64_t n = 1; n <= kMostRuns; ++n) {
    const Outcome outcome = InChild(n, run);
    if (outcome.code == 1) break;  // the run made fewer than n allocations
    ++refused;
    if (outcome.code != 0) {
      problems.push_back("allocation " + std::to_string(n) + " refused: " + outcome.problem);
    }
  }
  std::printf("%llu allocations of %s refused in turn; %zu left a problem\n",
              static_cast<unsigned long long>(refused), what, problems.size());
  for (const std::string& p : problems) ADD_FAILURE() << p;
  EXPECT_LT(refused, kMostRuns);
  return refused;
}

TEST(IngestAllocationFailureTest, TheLoopSurvivesEveryRefusalAndTheEnginesClearRestoresTrust) {
  // At least decoding and applying were reached, not only the wakeup.
  EXPECT_GE(Sweep("the loop", EngineRun), 20u);
}

// vLLM's replay socket (a ROUTER bound on 127.0.0.1), served by a thread of its own from the
// engine's whole history: every request for a start sequence gets each message from there on,
// then the end marker -1.
class ReplayServer {
 public:
  explicit ReplayServer(void* context) {
    socket_ = zmq_socket(context, ZMQ_ROUTER);
    const int linger = 0;
    zmq_setsockopt(socket_, ZMQ_LINGER, &linger, sizeof(linger));
    if (zmq_bind(socket_, "tcp://127.0.0.1:*") != 0) return;
    char bound[256] = {};
    size_t size = sizeof(bound);
    zmq_getsockopt(socket_, ZMQ_LAST_ENDPOINT, bound, &size);
    endpoint_ = bound;
    thread_ = std::thread([this] { Serve(); });
  }
  ~ReplayServer() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    zmq_close(socket_);
  }
  const std::string& endpoint() const { return endpoint_; }  // empty: it could not bind
  // The engine published message `seq` (whether or not it reached anybody).
  void Published(uint64_t seq, std::vector<uint8_t> payload) {
    std::lock_guard lock(mutex_);
    history_.emplace_back(seq, std::move(payload));
  }

 private:
  static std::string Sequence(uint64_t seq) {
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(seq >> (56 - 8 * i));
    return bytes;
  }
  void Send(const std::vector<std::string>& parts) {
    for (size_t i = 0; i < parts.size(); ++i) {
      zmq_send(socket_, parts[i].data(), parts[i].size(), i + 1 < parts.size() ? ZMQ_SNDMORE : 0);
    }
  }
  void Serve() {
    while (!stop_) {
      zmq_pollitem_t item{socket_, 0, ZMQ_POLLIN, 0};
      if (zmq_poll(&item, 1, 20) != 1) continue;
      std::vector<std::string> parts;
      for (int more = 1; more;) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        zmq_msg_recv(&msg, socket_, 0);
        parts.emplace_back(static_cast<char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
        more = zmq_msg_more(&msg);
        zmq_msg_close(&msg);
      }
      if (parts.size() != 3 || parts[2].size() != 8) continue;
      uint64_t start = 0;
      for (unsigned char c : parts[2]) start = (start << 8) | c;
      std::vector<std::pair<uint64_t, std::vector<uint8_t>>> history;
      {
        std::lock_guard lock(mutex_);
        history = history_;
      }
      for (const auto& [seq, payload] : history) {
        if (seq >= start) {
          Send({parts[0], "", Sequence(seq), std::string(payload.begin(), payload.end())});
        }
      }
      Send({parts[0], "", Sequence(UINT64_MAX), ""});
    }
  }

  void* socket_ = nullptr;
  std::string endpoint_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex mutex_;
  std::vector<std::pair<uint64_t, std::vector<uint8_t>>> history_;  // guarded by mutex_
};

// A worker with a replay endpoint loses a message: the gap is repaired by a replay while the
// loop's n-th allocation is refused (opening the replay, holding the live messages, reading the
// reply, handling the held messages after it). Whatever the refusal hit, the replay must end
// (a replay left in flight for good holds every later live message), leave no socket behind
// (the ZMQ context would never terminate: the ingest could not be freed) and hand on the held
// messages in order: the engine's next clear makes the rank known again, with what it stores.
std::string ReplayRun(uint64_t n, bool& refused) {
  void* context = zmq_ctx_new();
  std::string endpoint;
  void* engine = BindEngine(context, endpoint);
  if (engine == nullptr) return "cannot bind the engine";
  auto replay = std::make_unique<ReplayServer>(context);
  if (replay->endpoint().empty()) return "cannot bind the replay socket";
  // `reaches`: published and heard; else published and lost on the way.
  auto publish = [&](uint64_t seq, const std::string& vector, bool reaches = true) {
    const std::vector<uint8_t> payload = VllmPayload(vector);
    replay->Published(seq, payload);
    if (!reaches) return;
    SendEngineMessage(engine, seq, payload);
  };

  std::unique_ptr<Router> router = *Router::Create(RouterOptions{.block_size = 16});
  std::unique_ptr<IngestService> ingest =
      *IngestService::Create(router.get(), {.replay_timeout_ms = 1000});
  if (!ingest->Start().ok()) return "the ingest did not start";
  const absl::StatusOr<uint64_t> source =
      ingest->AddEngineWorker(EngineWorker{.endpoint = endpoint,
                                           .worker_id = 5,
                                           .topic = "kv-events",
                                           .replay_endpoint = replay->endpoint()});
  if (!source.ok()) return "cannot subscribe: " + source.status().ToString();
  zmq_pollitem_t item{engine, 0, ZMQ_POLLIN, 0};
  char subscription[64];
  if (zmq_poll(&item, 1, 5000) != 1 ||
      zmq_recv(engine, subscription, sizeof(subscription), 0) < 1) {
    return "no subscriber";
  }
  auto device_blocks = [&] { return DeviceBlocksOfWorker5(*router); };

  count_loop_allocations = true;
  FailAllocationForTesting(n);
  publish(0, "array_store_dp_medium");                        // blocks 1 and 2
  publish(1, "array_store_continuation", /*reaches=*/false);  // block 3, lost
  publish(2, "array_remove_full_schema");                     // block 3 removed: a gap, replayed
  publish(3, "array_store_continuation");  // held with 2 (several held: handed on in order)
  publish(4, "array_remove_full_schema");
  // Until the refusal, or the replay done (0, the replayed 1, the held 2-4) when none came.
  const auto armed_deadline = std::chrono::steady_clock::now() + kWait;
  bool repaired = false;
  while (internal::allocation_failure_countdown.load() != 0 && !repaired &&
         std::chrono::steady_clock::now() < armed_deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const absl::StatusOr<IngestStats> stats = ingest->Stats(*source);
    repaired = stats.ok() && stats->messages >= 5 && stats->recoveries >= 1;
  }
  refused = FailAllocationForTesting(0) == 0;
  count_loop_allocations = false;
  if (!refused && !repaired) return "no refusal, yet the replay did not repair the gap";
  if (!refused && (device_blocks() != 2 || ingest->Stats(*source)->state_unknown != 0)) {
    return "no refusal, yet the replay left " + std::to_string(device_blocks()) + " blocks";
  }
  // The engine clears its cache, and stores three blocks in two messages, the first lost: a
  // replay repairs it. Held messages a refusal left behind would be handed on after this
  // replay, out of order, where their numbers going back look like a restart.
  publish(5, "array_all_cleared");
  publish(6, "array_store_dp_medium", /*reaches=*/false);
  publish(7, "array_store_continuation");
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  for (;;) {
    absl::StatusOr<IngestStats> after = ingest->Stats(*source);
    if (!after.ok()) return "after the refusal, " + after.status().ToString();
    const uint32_t blocks = device_blocks();
    // Each of the 8 messages handled, or counted as lost (a replay may count one twice). Not
    // the gaps: a replay still under way from a refusal before can bring message 6 itself.
    const bool all_handled = after->messages + after->missed_messages >= 8;
    if (after->state_unknown == 0 && blocks == 3 && all_handled) {
      if (after->restarts != 0) {
        return "messages were handed on out of order (" + std::to_string(after->restarts) +
               " restarts)";
      }
      break;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return "after the engine's clear and a store of 3 blocks, the rank holds " +
             std::to_string(blocks) + (after->state_unknown != 0 ? " and is still flagged" : "") +
             " (" + std::to_string(after->messages) + " messages, " +
             std::to_string(after->missed_messages) + " missed, " +
             std::to_string(after->recoveries) + " recoveries, " + std::to_string(after->gaps) +
             " gaps)";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ingest.reset();  // a replay socket left open would hang this in zmq_ctx_term (SIGALRM)
  replay.reset();
  zmq_close(engine);
  zmq_ctx_term(context);
  return "";
}

TEST(IngestAllocationFailureTest, AReplayEndsAndHandsOnItsHeldMessagesWhateverIsRefused) {
  EXPECT_GE(Sweep("a gap's replay", ReplayRun), 20u);
}

// A socket connected to the Unix socket at `path`, or -1.
int ConnectUnix(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) return fd;
  close(fd);
  return -1;
}

// A listener whose Listen was refused (on the loop: its bound name, its source) must not be
// left listening: nobody could close it, and the ingest could not stop (libuv would keep
// running for it). Connecting after the answer shows whether anything listens.
std::string ListenRun(uint64_t n, bool& refused) {
  std::unique_ptr<Router> router = *Router::Create(RouterOptions{.block_size = 16});
  std::unique_ptr<IngestService> ingest = *IngestService::Create(router.get(), {});
  if (!ingest->Start().ok()) return "the ingest did not start";
  const std::string path = "/tmp/kvr-listen-refused-" + std::to_string(getpid()) + ".sock";
  unlink(path.c_str());
  std::string bound;
  count_loop_allocations = true;
  FailAllocationForTesting(n);
  const absl::StatusOr<uint64_t> id = ingest->Listen("unix://" + path, &bound);
  refused = FailAllocationForTesting(0) == 0;
  count_loop_allocations = false;
  const int fd = ConnectUnix(path);
  const bool connected = fd >= 0;
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the loop accepts, if it listens
  if (connected) close(fd);
  std::string problem;
  if (!id.ok() && connected) {
    problem = "Listen answered " + id.status().ToString() + ", yet the path accepts connections";
  }
  ingest.reset();  // a listener left behind would hang this (SIGALRM)
  unlink(path.c_str());
  return problem;
}

TEST(IngestAllocationFailureTest, ARefusedListenLeavesNothingListening) {
  Sweep("Listen", ListenRun);
}

// A connection the heap refuses memory to (or its frame, or the frame's events) is lost and
// counted, and the listener goes on: a later publisher's frame applies. libuv listens again
// only once a connection is accepted, so one left unaccepted would stall the listener for good.
// `at_once`: two publishers connect before the loop starts, so that libuv hands both over in
// one go and the second arrives while the first, turned away, is still closing.
std::string StreamRun(uint64_t n, bool& refused, bool at_once) {
  std::unique_ptr<Router> router = *Router::Create(RouterOptions{.block_size = 16});
  std::unique_ptr<IngestService> ingest = *IngestService::Create(router.get(), {});
  const std::string path = "/tmp/kvr-stream-refused-" + std::to_string(getpid()) + ".sock";
  unlink(path.c_str());
  const absl::StatusOr<uint64_t> source = ingest->Listen("unix://" + path, nullptr);
  if (!source.ok()) return "cannot listen: " + source.status().ToString();
  // A publisher storing the prompt's 3 blocks on `worker_id`, then gone.
  auto publish = [&](uint64_t worker_id) {
    StoredEvent stored{.block_hashes = {1, 2, 3}, .token_ids = Prompt()};
    const KvEvent event{.worker = {.worker_id = worker_id}, .data = std::move(stored)};
    const std::vector<uint8_t> frame = *FrameBatch(EncodeEventBatch(std::span(&event, 1)));
    const int fd = ConnectUnix(path);
    if (fd < 0) return false;
    (void)!send(fd, frame.data(), frame.size(), MSG_NOSIGNAL);  // a turned-away one may fail
    close(fd);
    return true;
  };
  auto missing = [&](std::initializer_list<uint64_t> workers) {
    uint64_t count = workers.size();
    const absl::StatusOr<std::vector<OverlapScore>> scores = router->OverlapScores(Prompt());
    for (const OverlapScore& s : scores.ok() ? *scores : std::vector<OverlapScore>{}) {
      for (const uint64_t w : workers) {
        if (s.worker == WorkerKey{.worker_id = w} && s.overlap.device_blocks == 3) --count;
      }
    }
    return count;
  };
  auto losses_counted = [](const IngestStats& stats) {
    uint64_t losses = stats.gaps;
    for (const uint64_t r : stats.rejected) losses += r;
    return losses;
  };
  // Whether `done()` held within kWait.
  auto within_wait = [](auto done) {
    const auto deadline = std::chrono::steady_clock::now() + kWait;
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
  };
  // Every publisher's frame applied, or each one missing counted as lost.
  auto accounted_for = [&](std::initializer_list<uint64_t> workers) {
    return within_wait([&] {
      const absl::StatusOr<IngestStats> stats = ingest->Stats(*source);
      return stats.ok() && missing(workers) <= losses_counted(*stats);
    });
  };

  bool connected = !at_once || (publish(5) && publish(7));
  count_loop_allocations = true;
  FailAllocationForTesting(n);
  if (!ingest->Start().ok()) return "the ingest did not start";
  if (!at_once) connected = publish(5);
  const bool first_accounted_for =
      connected && (at_once ? accounted_for({5, 7}) : accounted_for({5}));
  refused = FailAllocationForTesting(0) == 0;
  count_loop_allocations = false;
  std::string problem;
  if (!connected) {
    problem = "a publisher could not connect";
  } else if (!first_accounted_for) {
    problem = "a publisher's frame was neither applied nor counted as lost";
  } else if (!publish(9) || !within_wait([&] { return missing({9}) == 0; })) {
    problem = "the listener stopped taking connections (the last publisher's blocks are missing)";
  }
  ingest.reset();  // a handle left open would hang this (SIGALRM)
  unlink(path.c_str());
  return problem;
}

TEST(IngestAllocationFailureTest, ARefusedConnectionIsTurnedAwayAndTheListenerGoesOn) {
  const RunFn one = [](uint64_t n, bool& refused) { return StreamRun(n, refused, false); };
  EXPECT_GE(Sweep("a stream connection", one), 3u);  // the connection, its list node, ...
  const RunFn two = [](uint64_t n, bool& refused) { return StreamRun(n, refused, true); };
  EXPECT_GE(Sweep("two stream connections at once", two), 6u);
}

// The same for an engine worker's subscription: a refused AddEngineWorker leaves no socket
// polled for it (its events would apply for a worker the caller was told failed), and the
// same worker can be added once memory is back.
std::string AddEngineRun(uint64_t n, bool& refused) {
  void* context = zmq_ctx_new();
  std::string endpoint;
  void* engine = BindEngine(context, endpoint);
  if (engine == nullptr) return "cannot bind the engine";
  std::unique_ptr<Router> router = *Router::Create(RouterOptions{.block_size = 16});
  std::unique_ptr<IngestService> ingest = *IngestService::Create(router.get(), {});
  if (!ingest->Start().ok()) return "the ingest did not start";
  const EngineWorker worker{.endpoint = endpoint, .worker_id = 5, .dp_size = 2, .topic = ""};
  count_loop_allocations = true;
  FailAllocationForTesting(n);
  const absl::StatusOr<uint64_t> first = ingest->AddEngineWorker(worker);
  refused = FailAllocationForTesting(0) == 0;
  count_loop_allocations = false;
  std::string problem;
  if (!first.ok()) {
    const absl::StatusOr<uint64_t> again = ingest->AddEngineWorker(worker);
    if (!again.ok())
      problem = "refused once, the worker cannot be added: " + again.status().ToString();
  }
  ingest.reset();  // a subscription left polling would hang this (SIGALRM)
  zmq_close(engine);
  zmq_ctx_term(context);
  return problem;
}

TEST(IngestAllocationFailureTest, ARefusedEngineWorkerLeavesNothingSubscribed) {
  Sweep("AddEngineWorker", AddEngineRun);
}

}  // namespace
}  // namespace kvrouter
