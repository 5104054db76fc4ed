// What a refused allocation leaves behind. The project's rule for resource exhaustion: a clear
// status, counted, and never a crash, a leak or corrupt state. Here: whatever allocation fails in
// the middle of an index update (a store that splits runs, grows member lists, child maps or a
// worker's table past the size from which it is mapped; a removal; a clear; a worker's removal),
// the index must be left as if the update had been applied whole or not at all, or (an event
// refused midway, RadixIndex::Apply) with the event's rank holding nothing; keep every
// structural invariant (RadixIndex::CheckInvariants, as tests/fuzz/index_model_fuzzer checks
// it), answer as an index built from the updates that took effect (digest, counts, matches, the
// dump), hold no memory that index would not, and take later events normally. A query that runs
// out of memory must change nothing; a routing decision that does must book whole or not at all.
//
// Each sweep refuses the 1st allocation, then the 2nd, ... (FailAllocationForTesting) until
// the operations make no more, each run from the start in a child process so that a crash is a
// finding like any other. Every allocation counts: the index's own (CountingAllocator) and the
// temporaries (this binary's operator new shares the count while a sweep runs). Replacing
// operator new is why this suite is a binary of its own: the others keep AddressSanitizer's
// checks of new against delete. KVR_ALLOCATION_FAILURE=n runs only the n-th of a sweep, in
// the test's own process (for a debugger: `catch throw` stops at the refusal).
//
// And the real limit: a child process that has used up its vm.max_map_count drives the index's
// growth through the C ABI; each event applies whole or is refused with a status, its rank then
// holding nothing (each is a new rank's first store), and the refused ones apply once mappings
// are free again.
//
// The commit that added this suite lists where each of these broke at first (195 of 208 index
// refusals left a half-applied update; queries and decisions crashed); the bookings' commit,
// what a routing decision left half-booked.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "core/active_sequences.h"
#include "core/approx_index.h"
#include "core/clock.h"
#include "core/counting_allocator.h"
#include "core/hashing.h"
#include "core/radix_index.h"
#include "core/router.h"
#include "in_child.h"
#include "kvrouter.h"
#include "refusing_operator_new.h"
#include "test_data.h"

// ---- operator new counts against FailAllocationForTesting during a sweep -----------------------

namespace {

// Set by the sweeps: the index's temporaries are refused in turn too. Off, operator new is
// malloc's (so that the allocator's own test counts its allocations alone).
std::atomic<bool> count_operator_new{false};

}  // namespace

bool RefuseThisAllocation() noexcept {
  return kvrouter::internal::allocation_failure_countdown.load(std::memory_order_relaxed) != 0 &&
         count_operator_new.load(std::memory_order_relaxed) &&
         kvrouter::CountAllocationForTesting();
}

namespace kvrouter {
namespace {

using testing::ClearedWorker;
using testing::MatchesToString;
using testing::RemovedBlocks;
using testing::Rng;
using testing::SlidingRemovedBlocks;
using testing::SlidingStoredBlocks;
using testing::StoredBlocks;

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAsan = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAsan = true;
#else
constexpr bool kAsan = false;
#endif
#else
constexpr bool kAsan = false;
#endif

// ---- The hook itself -------------------------------------------------------------------------

TEST(AllocationFailureTest, TheArmedAllocationAndOnlyItIsRefused) {
  int64_t bytes = 0;
  CountingAllocator<uint64_t> alloc(&bytes);
  const size_t small = 16, large = kMappedBytes / sizeof(uint64_t) + 1;
  ASSERT_TRUE(alloc.AllocatesZeroed(large));
  EXPECT_EQ(FailAllocationForTesting(3), 0u);  // nothing was armed
  uint64_t* a = alloc.allocate(small);
  uint64_t* b = alloc.allocate(large);
  const int64_t held = bytes;
  EXPECT_THROW(alloc.allocate(small), std::bad_alloc);  // the 3rd
  EXPECT_EQ(bytes, held);                               // counted nothing
  uint64_t* c = alloc.allocate(small);                  // only the 3rd
  EXPECT_EQ(FailAllocationForTesting(0), 0u);           // it happened
  // A growth counts, and a refused one leaves the array as it was.
  b[large - 1] = 42;
  FailAllocationForTesting(1);
  EXPECT_THROW(b = alloc.grow(b, large, 2 * large), std::bad_alloc);
  EXPECT_EQ(b[large - 1], 42u);
  EXPECT_EQ(bytes, held + static_cast<int64_t>(small * sizeof(uint64_t)));
  // Disarmed before it came: what was left of the count.
  FailAllocationForTesting(5);
  uint64_t* d = alloc.allocate(small);
  EXPECT_EQ(FailAllocationForTesting(0), 4u);
  for (uint64_t* p : {a, c, d}) alloc.deallocate(p, small);
  alloc.deallocate(b, large);
  EXPECT_EQ(bytes, 0);
}

// A small array the heap refuses (operator new throws) is not counted.
TEST(AllocationFailureTest, AnArrayTheHeapRefusesIsNotCounted) {
  int64_t bytes = 0;
  CountingAllocator<uint64_t> alloc(&bytes);
  count_operator_new = true;
  FailAllocationForTesting(2);  // the allocator's own count, then operator new's
  EXPECT_THROW(alloc.allocate(16), std::bad_alloc);
  const uint64_t left = FailAllocationForTesting(0);
  count_operator_new = false;
  EXPECT_EQ(left, 0u);
  EXPECT_EQ(bytes, 0);
}

// ---- A representative history --------------------------------------------------------------

// One step: an event, or the removal of a worker (every rank) when `event` is empty.
// One step: an event; or the removal of a worker (every rank) when `event` is empty; or, with a
// `tail_of` path, approximate mode's eviction of up to `tail_limit` of its deepest blocks.
struct Action {
  std::string what;
  std::optional<KvEvent> event;
  uint64_t removed_worker = 0;
  std::vector<uint64_t> tail_of;  // engine hashes, root first
  WorkerKey tail_worker{};
  size_t tail_limit = 0;
};

struct Prompt {
  std::vector<uint64_t> local;
  std::vector<uint64_t> seq;  // sequence hash of each block's prefix
};

Prompt MakePrompt(std::vector<uint64_t> local) {
  Prompt p{std::move(local), {}};
  p.seq = ComputeSequenceHashes(p.local);
  return p;
}

std::vector<uint64_t> Fresh(Rng& rng, size_t n) {
  std::vector<uint64_t> out(n);
  for (uint64_t& h : out) h = rng.Next();
  return out;
}

std::vector<uint64_t> Concat(std::vector<uint64_t> a, const std::vector<uint64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A worker's engine hash of a block: its own per worker, as engines' are.
uint64_t Engine(WorkerKey w, uint64_t seq) {
  uint64_t x = seq ^ (w.worker_id * 0x9e3779b97f4a7c15ull) ^ w.dp_rank;
  x = (x ^ (x >> 31)) * 0xbf58476d1ce4e5b9ull;
  return x ^ (x >> 29);
}

struct History {
  std::vector<Prompt> prompts;  // every prefix the actions store, for the lookups
  std::vector<Action> actions;
};

const WorkerKey kA{1, 0}, kB{2, 0}, kC{3, 0}, kD{4, 1};

// Blocks [from, to) of `p` stored by `w` on `tier`, after the block before `from` (the worker's
// own engine hash of it) unless `from` is 0.
Action Store(std::string what, WorkerKey w, const Prompt& p, size_t from, size_t to,
             Tier tier = Tier::kDevice) {
  std::vector<uint64_t> engine, local;
  for (size_t k = from; k < to; ++k) {
    engine.push_back(Engine(w, p.seq[k]));
    local.push_back(p.local[k]);
  }
  std::optional<uint64_t> parent;
  if (from > 0) parent = Engine(w, p.seq[from - 1]);
  return {std::move(what), StoredBlocks(w, parent, engine, local, tier), 0};
}

Action Remove(std::string what, WorkerKey w, const Prompt& p, size_t from, size_t to,
              Tier tier = Tier::kDevice) {
  std::vector<uint64_t> engine;
  for (size_t k = from; k < to; ++k) engine.push_back(Engine(w, p.seq[k]));
  return {std::move(what), RemovedBlocks(w, engine, tier), 0};
}

// Stores that split runs at either end, add a child beside another (a child map), extend a
// worker's own leaf, join runs others hold (member lists grow), copy blocks to lower tiers, reuse
// an engine hash for another prefix; a table that grows past the size from which it is mapped
// (and grows in place there) and shrinks back; removals from the middle of runs and of whole
// subtrees; errors (an unknown parent, an unknown removed block); a clear; a worker's removal and
// a new worker in its slot.
History MakeHistory() {
  Rng rng(0xa110c);
  History h;
  const Prompt p0 = MakePrompt(Fresh(rng, 40));
  const Prompt p1 = MakePrompt(Concat({p0.local.begin(), p0.local.begin() + 12}, Fresh(rng, 10)));
  const Prompt p2 = MakePrompt(Fresh(rng, 3000));
  const Prompt p3 = MakePrompt(Concat({p0.local.begin(), p0.local.begin() + 5}, Fresh(rng, 6)));
  const Prompt p4 = MakePrompt(Fresh(rng, 3));
  h.prompts = {p0, p1, p2, p3, p4};
  auto& a = h.actions;
  a.push_back(Store("A stores p0[0,20) from the root", kA, p0, 0, 20));
  a.push_back(Store("A extends its leaf with p0[20,40)", kA, p0, 20, 40));
  a.push_back(Store("B joins p0[0,10) (a split)", kB, p0, 0, 10));
  a.push_back(Store("B stores p1[10,22): joins 2 blocks, then a new child", kB, p1, 10, 22));
  a.push_back(Store("A stores p3[5,11) (a split, a new child)", kA, p3, 5, 11));
  a.push_back(Store("D joins p0[0,30) on the host tier", kD, p0, 0, 30, Tier::kHostPinned));
  a.push_back(Store("A copies p0[0,8) to the host tier", kA, p0, 0, 8, Tier::kHostPinned));
  {
    std::vector<uint64_t> engine;
    for (size_t k = 8; k < 12; ++k) engine.push_back(Engine(kA, p0.seq[k]));
    a.push_back({"A copies p0[8,12) to disk by engine hash alone",
                 StoredBlocks(kA, std::nullopt, engine, {}, Tier::kDisk), 0});
  }
  a.push_back(Store("C stores p2[0,1000)", kC, p2, 0, 1000));
  a.push_back(Store("C stores p2[1000,2000) (its table is mapped)", kC, p2, 1000, 2000));
  a.push_back(Store("C stores p2[2000,3000) (its table grows in place)", kC, p2, 2000, 3000));
  {
    // A's engine hash of p0[30] now names p4[0]: rekeyed.
    a.push_back({"A reuses an engine hash for another prefix",
                 StoredBlocks(kA, std::nullopt, {Engine(kA, p0.seq[30]), Engine(kA, p4.seq[1])},
                              {p4.local[0], p4.local[1]}),
                 0});
  }
  a.push_back(Remove("B removes p1[15,18) (the middle of a run)", kB, p1, 15, 18));
  a.push_back(Remove("C removes p2[1000,3000) (its table shrinks)", kC, p2, 1000, 3000));
  a.push_back(Remove("A removes p0[35,40) (a leaf goes)", kA, p0, 35, 40));
  {
    Action r =
        Remove("D removes p0[20,25) and an unknown block", kD, p0, 20, 25, Tier::kHostPinned);
    std::get<RemovedEvent>(r.event->data)
        .block_hashes.insert(std::get<RemovedEvent>(r.event->data).block_hashes.begin() + 2,
                             0xdeadbeefull);
    a.push_back(std::move(r));
  }
  a.push_back({"B is cleared", ClearedWorker(kB), 0});
  {
    Action s = Store("B stores under a parent it does not hold", kB, p0, 5, 8);
    std::get<StoredEvent>(s.event->data).parent_hash = 0xfeedull;
    a.push_back(std::move(s));
  }
  a.push_back({"A is removed", std::nullopt, kA.worker_id});
  a.push_back(Store("E stores p0[0,4) (a new worker)", WorkerKey{5, 0}, p0, 0, 4));
  a.push_back(Store("B stores p3[0,11)", kB, p3, 0, 11));
  {
    Action drop{"B drops the tail p3[2,11) of its path (three cuts: [5,11), [4,5), [2,4))"};
    for (size_t k = 0; k < 11; ++k) drop.tail_of.push_back(Engine(kB, p3.seq[k]));
    drop.tail_worker = kB;
    drop.tail_limit = 9;
    a.push_back(std::move(drop));
  }
  return h;
}

void Do(RadixIndex& index, const Action& action) {
  if (action.event) {
    index.Apply(*action.event);
  } else if (!action.tail_of.empty()) {
    (void)index.DropPathTail(action.tail_worker, action.tail_of, action.tail_limit,
                             [](uint64_t) { return false; });
  } else {
    index.RemoveWorker(action.removed_worker);
  }
}

// ---- What an index answers -----------------------------------------------------------------

struct Answers {
  uint64_t digest = 0;
  uint64_t cached_blocks = 0;
  uint64_t tree_blocks = 0;
  std::string matches;  // every prompt's (each prefix of p0, p1, p3, p4; p2 whole)
  std::string tree_sizes;
  std::string workers;  // the ranks it knows, holding blocks or not
  friend bool operator==(const Answers&, const Answers&) = default;
};

std::string ToString(const Answers& a) {
  return "digest " + std::to_string(a.digest) + ", " + std::to_string(a.cached_blocks) +
         " cached blocks, " + std::to_string(a.tree_blocks) + " tree blocks, tree sizes " +
         a.tree_sizes + ", workers " + a.workers + ", matches #" +
         std::to_string(std::hash<std::string>()(a.matches) % 10000);
}

Answers Observe(const RadixIndex& index, const History& h) {
  Answers a;
  a.digest = index.StateDigest();
  const IndexStats stats = index.Stats();
  a.cached_blocks = stats.cached_blocks;
  a.tree_blocks = stats.tree_blocks;
  for (const Prompt& p : h.prompts) {
    const size_t step = p.local.size() > 100 ? p.local.size() : 1;
    for (size_t len = step; len <= p.local.size(); len += step) {
      a.matches += MatchesToString(index.FindMatches(std::span(p.local).first(len))) + "|";
    }
  }
  for (WorkerKey w : {kA, kB, kC, kD, WorkerKey{5, 0}}) {
    a.tree_sizes += std::to_string(index.TreeSize(w)) + " ";
  }
  for (WorkerKey w : index.Workers()) {
    a.workers += std::to_string(w.worker_id) + "." + std::to_string(w.dp_rank) + " ";
  }
  return a;
}

// An index of the actions that took effect, in order.
std::unique_ptr<RadixIndex> Replay(const std::vector<Action>& took_effect) {
  auto index = std::make_unique<RadixIndex>();
  for (const Action& a : took_effect) Do(*index, a);
  return index;
}

// What an action the heap refused an allocation in may leave, as the action that would have
// had that effect: nothing, the whole action, or (an event refused midway) its rank holding
// nothing, as after a cleared event (RadixIndex::Apply).
struct Effect {
  std::string name;
  std::optional<Action> as;
};
std::vector<Effect> PossibleEffects(const Action& a) {
  std::vector<Effect> effects{{"before", std::nullopt}, {"after", a}};
  if (a.event) effects.push_back({"its rank cleared", Action{"", ClearedWorker(a.event->worker)}});
  if (!a.tail_of.empty()) {
    effects.push_back({"its rank cleared", Action{"", ClearedWorker(a.tail_worker)}});
  }
  return effects;
}

// "" when the index's dump rebuilds it, else what differs.
std::string CheckDump(const RadixIndex& index) {
  RadixIndex rebuilt;
  for (const KvEvent& e : index.DumpEvents()) {
    if (!rebuilt.Apply(e).ok()) return "an event of its dump is rejected";
  }
  if (rebuilt.StateDigest() != index.StateDigest()) return "its dump rebuilds another state";
  return "";
}

// Forgets every worker: what is left is the memory of an empty index, or more.
int64_t BytesWhenEmptied(RadixIndex& index) {
  for (WorkerKey w : index.Workers()) index.RemoveWorkerDpRank(w);
  return index.Stats().allocated_bytes;
}

// ---- Sweeps -----------------------------------------------------------------------------------

// What a child process reported of its run (InChild).
struct Outcome {
  bool fired = false;     // the refused allocation came during the operations
  bool reported = false;  // and the operation it came in returned (or threw)
  size_t op = 0;          // the operation it came in
  bool threw = false;     // which threw std::bad_alloc
  std::string problem;    // "" when everything held
};

void Report(int fd, const std::string& text) {
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

// Runs op(0), op(1), ... op(count - 1) with the n-th allocation from the first refused, telling
// `fd` which operation is running ("A<op>") and the one the refusal came in ("F<op> <threw>").
// Returns that operation, or `count` if the operations made fewer than n allocations.
template <typename Op>
size_t RunArmed(uint64_t n, size_t count, int fd, Op op) {
  count_operator_new = true;
  for (size_t i = 0; i < count; ++i) {
    Report(fd, "A" + std::to_string(i) + "\n");
    FailAllocationForTesting(n);
    bool threw = false;
    try {
      op(i);
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    n = FailAllocationForTesting(0);
    if (n == 0) {
      count_operator_new = false;
      Report(fd, "F" + std::to_string(i) + (threw ? " 1\n" : " 0\n"));
      return i;
    }
  }
  count_operator_new = false;
  return count;
}

// `body(fd)` in a child process, and what it reported to `fd`: the lines of RunArmed, then
// "P<problem>" if it found one (multi-line).
template <typename Body>
Outcome InChild(Body body) {
  const ChildRun child = RunInChild(body);
  const std::string& out = child.output;
  const int status = child.wait_status;
  Outcome run;
  const size_t problem = out.find("\nP") != std::string::npos ? out.find("\nP") + 1 : out.size();
  if (problem < out.size()) run.problem = out.substr(problem + 1);
  std::istringstream lines(out.substr(0, problem));
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    run.op = std::stoul(line.substr(1, line.find(' ') - 1));
    if (line[0] == 'F') {
      run.fired = run.reported = true;
      run.threw = line.back() == '1';
    }
  }
  const bool clean = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (!run.problem.empty() && !clean) run.problem += "; then ";
  if (WIFSIGNALED(status)) {
    run.problem += "crashed: " + std::string(strsignal(WTERMSIG(status)));
  } else if (!clean) {
    run.problem += "exited with " + std::to_string(WEXITSTATUS(status));
  }
  run.fired = run.fired || !clean;  // a crash in the armed operation
  return run;
}

// Refuses the 1st allocation, then the 2nd, ... each in a child running run(n, fd) from the
// start, until the n-th comes after the last of `ops`: each problem is a test failure.
template <typename RunN>
void Sweep(const std::vector<std::string>& ops, RunN run, size_t at_least) {
  if (const char* only = std::getenv("KVR_ALLOCATION_FAILURE")) {
    run(std::stoull(only), STDERR_FILENO);
    return;
  }
  size_t refused = 0;
  std::vector<std::string> problems;
  for (uint64_t n = 1;; ++n) {
    const Outcome o = InChild([&](int fd) { run(n, fd); });
    if (!o.fired) break;
    ++refused;
    if (o.problem.empty()) continue;
    const std::string how = !o.reported ? "which did not return"
                            : o.threw   ? "which threw std::bad_alloc"
                                        : "which did not throw";
    problems.push_back("allocation " + std::to_string(n) + " refused, in \"" + ops[o.op] + "\" (" +
                       how + "): " + o.problem);
  }
  std::printf("%zu allocations refused in turn; %zu left a problem\n", refused, problems.size());
  EXPECT_GE(refused, at_least);  // the sweep reached what it is about
  for (size_t i = 0; i < problems.size() && i < 40; ++i) ADD_FAILURE() << problems[i];
  EXPECT_TRUE(problems.empty()) << problems.size() << " of " << refused
                                << " refused allocations left a problem";
}

// ---- Index updates -----------------------------------------------------------------------------

// The history with its n-th allocation refused: after the update it came in, the index holds
// (see the file comment); at the end, it answers as one built from the updates that took effect.
void IndexRun(const History& h, uint64_t n, int fd) {
  const size_t mapped_before = MappedArrays();
  auto fail = [&](const std::string& problem) { Report(fd, "P" + problem); };
  {
    RadixIndex index;
    const size_t i = RunArmed(n, h.actions.size(), fd, [&](size_t k) { Do(index, h.actions[k]); });
    if (i == h.actions.size()) return;
    if (std::string broken = index.CheckInvariants(); !broken.empty()) {
      return fail("invariant broken: " + broken);
    }
    const Answers got = Observe(index, h);
    std::vector<Action> took_effect(h.actions.begin(), h.actions.begin() + i);
    std::string seen;
    const Effect* effect = nullptr;
    const std::vector<Effect> effects = PossibleEffects(h.actions[i]);
    for (const Effect& e : effects) {
      std::vector<Action> with = took_effect;
      if (e.as) with.push_back(*e.as);
      const Answers answers = Observe(*Replay(with), h);
      seen += "\n  " + e.name + ": " + ToString(answers);
      if (answers == got && effect == nullptr) effect = &e;
    }
    if (effect == nullptr) return fail("half applied:\n  got: " + ToString(got) + seen);
    // A rank cleared for a refusal is counted; an event applied whole is not.
    const bool changed = got != Observe(*Replay(took_effect), h);
    const uint64_t refused = index.Stats().refused_events;
    const uint64_t want_refused = effect->name == "after" ? 0 : 1;
    if (refused > 1 || (changed && refused != want_refused)) {
      return fail("refused_events " + std::to_string(index.Stats().refused_events) + " after " +
                  effect->name);
    }
    if (effect->as) took_effect.push_back(*effect->as);
    if (std::string dump = CheckDump(index); !dump.empty()) return fail(dump);
    for (size_t k = i + 1; k < h.actions.size(); ++k) {
      Do(index, h.actions[k]);
      took_effect.push_back(h.actions[k]);
    }
    if (std::string broken = index.CheckInvariants(); !broken.empty()) {
      return fail("at the end, invariant broken: " + broken);
    }
    auto reference = Replay(took_effect);
    const Answers end = Observe(index, h), want = Observe(*reference, h);
    if (end != want) {
      return fail("at the end:\n  got  " + ToString(end) + "\n  want " + ToString(want));
    }
    const int64_t bytes = BytesWhenEmptied(index), want_bytes = BytesWhenEmptied(*reference);
    if (bytes != want_bytes) {
      return fail("every worker removed, it holds " + std::to_string(bytes) +
                  " bytes, a reference " + std::to_string(want_bytes) + " (nodes " +
                  std::to_string(index.Stats().nodes) + ", tree blocks " +
                  std::to_string(index.Stats().tree_blocks) + ")");
    }
  }
  if (MappedArrays() != mapped_before) fail("mapped arrays left behind");
}

void SweepIndexUpdates() {
  const History h = MakeHistory();
  {
    RadixIndex index;  // the history itself, nothing refused
    for (const Action& a : h.actions) Do(index, a);
    ASSERT_EQ(index.CheckInvariants(), "");
  }
  std::vector<std::string> ops;
  for (const Action& a : h.actions) ops.push_back(a.what);
  Sweep(
      ops, [&](uint64_t n, int fd) { IndexRun(h, n, fd); }, 150);
}

TEST(AllocationFailureTest, AnIndexUpdateAppliesWholeOrNotAtAll) { SweepIndexUpdates(); }

// The same where the kernel refuses mappings (large arrays come from the heap instead).
TEST(AllocationFailureTest, AnIndexUpdateAppliesWholeOrNotAtAllWithoutMappings) {
  if (kAsan) GTEST_SKIP() << "nothing is mapped under AddressSanitizer";
  MappingsRefusedForTesting refused;
  SweepIndexUpdates();
}

// Two states the history above never builds, each found by a review. Every allocation of each
// history is refused in turn, as above.
// 1. A refused split leaves the rank's new entries in a node it is not yet a member of, whose
//    only child is the rank's: clearing the rank frees the child and then that node, which the
//    clear must not visit afterwards (it crashed).
History ClearingFreesANodeTheRankNamesButDoesNotHold() {
  const WorkerKey r{7, 0}, w{9, 0};
  History h;
  h.prompts = {MakePrompt({1, 2, 3, 4, 5, 6}), MakePrompt({1000})};
  h.actions = {
      {"W stores block 1000", StoredBlocks(w, std::nullopt, {9000}, {1000})},
      {"R stores 1..6",
       StoredBlocks(r, std::nullopt, {101, 102, 103, 104, 105, 106}, {1, 2, 3, 4, 5, 6})},
      {"W removes it (its node goes)", RemovedBlocks(w, {9000})},
      {"R removes 1..4 (their node is left holding nothing, over R's 5..6)",
       RemovedBlocks(r, {101, 102, 103, 104})},
      {"R stores 1..2 again under new hashes (joins that node: a split)",
       StoredBlocks(r, std::nullopt, {201, 202}, {1, 2})},
  };
  return h;
}

// 2. A removal naming the same blocks under two engine hashes: a split refused partway through
//    the second run must leave the rank's membership of the rest of the run to be cleared (it
//    stayed, naming no block).
History ARemovalOfBlocksHeldTwice() {
  const WorkerKey r{7, 0}, w{9, 0};
  History h;
  h.prompts = {MakePrompt({1, 2, 3, 4, 5, 6})};
  h.actions = {
      {"R stores 1..6",
       StoredBlocks(r, std::nullopt, {101, 102, 103, 104, 105, 106}, {1, 2, 3, 4, 5, 6})},
      {"W stores 1..6 (member lists on the heap)",
       StoredBlocks(w, std::nullopt, {901, 902, 903, 904, 905, 906}, {1, 2, 3, 4, 5, 6})},
      {"R stores 2..6 again under new hashes",
       StoredBlocks(r, 101, {202, 203, 204, 205, 206}, {2, 3, 4, 5, 6})},
      {"R removes 4, 5 under both hashes", RemovedBlocks(r, {104, 105, 204, 205})},
  };
  return h;
}

// 3. A hybrid model's ranks (core/sliding_windows.h): sliding-window stores placed by full
//    attention (two groups of one window, one of another), a removal, another rank's window, a
//    clear and a window again. A refused store forgets the rank's groups and clears the rank.
History SlidingWindowsOfHybridRanks() {
  const WorkerKey r{7, 0}, w{9, 0};
  History h;
  h.prompts = {MakePrompt({1, 2, 3, 4, 5, 6}), MakePrompt({1, 2, 7, 8})};
  h.actions = {
      {"R stores 1..6",
       StoredBlocks(r, std::nullopt, {101, 102, 103, 104, 105, 106}, {1, 2, 3, 4, 5, 6})},
      {"R stores 7, 8 after 2", StoredBlocks(r, 102, {107, 108}, {7, 8})},
      {"W stores 1..6",
       StoredBlocks(w, std::nullopt, {901, 902, 903, 904, 905, 906}, {1, 2, 3, 4, 5, 6})},
      {"R's group 0 (32 tokens) holds 3..6", SlidingStoredBlocks(r, 0, 32, {103, 104, 105, 106})},
      {"R's group 1 (32 tokens) holds 4..6 and 8",
       SlidingStoredBlocks(r, 1, 32, {104, 105, 106, 108})},
      {"R's group 2 (64 tokens) holds 1..6",
       SlidingStoredBlocks(r, 2, 64, {101, 102, 103, 104, 105, 106})},
      {"R's group 0 drops 5", SlidingRemovedBlocks(r, 0, {105})},
      {"W's group 0 holds 5, 6", SlidingStoredBlocks(w, 0, 32, {905, 906})},
      {"R is cleared", ClearedWorker(r)},
      {"R stores 1..4", StoredBlocks(r, std::nullopt, {101, 102, 103, 104}, {1, 2, 3, 4})},
      {"R's group 0 holds 3, 4", SlidingStoredBlocks(r, 0, 32, {103, 104})},
  };
  return h;
}

void SweepHistory(const History& h, size_t at_least) {
  std::vector<std::string> ops;
  for (const Action& a : h.actions) ops.push_back(a.what);
  Sweep(
      ops, [&](uint64_t n, int fd) { IndexRun(h, n, fd); }, at_least);
}

TEST(AllocationFailureTest, ClearingARankSkipsTheNodesItFreesOnTheWay) {
  SweepHistory(ClearingFreesANodeTheRankNamesButDoesNotHold(), 5);
}

TEST(AllocationFailureTest, ARefusedRemovalOfBlocksHeldTwiceLeavesNoMembership) {
  SweepHistory(ARemovalOfBlocksHeldTwice(), 5);
}

TEST(AllocationFailureTest, ARefusedSlidingWindowStoreLeavesItsRankHoldingNothing) {
  SweepHistory(SlidingWindowsOfHybridRanks(), 10);
}

// ---- Queries ---------------------------------------------------------------------------------

const std::vector<std::string> kQueries = {"FindMatches", "StateDigest", "DumpEvents",     "Stats",
                                           "Workers",     "PathTo",      "CheckInvariants"};

void Query(const RadixIndex& index, const History& h, size_t q) {
  switch (q) {
    case 0:
      for (const Prompt& p : h.prompts) (void)index.FindMatches(p.local);
      return;
    case 1:
      (void)index.StateDigest();
      return;
    case 2:
      (void)index.DumpEvents();
      return;
    case 3:
      (void)index.Stats();
      return;
    case 4:
      (void)index.Workers();
      return;
    case 5:
      (void)index.PathTo(kC, Engine(kC, h.prompts[2].seq[2000]));
      return;
    case 6:
      (void)index.CheckInvariants();
      return;
  }
}

// The queries with the n-th allocation refused: the one it comes in throws std::bad_alloc or
// answers, and the index is as it was.
void QueryRun(const History& h, uint64_t n, int fd) {
  RadixIndex index;
  for (const Action& a : h.actions) Do(index, a);
  const Answers before = Observe(index, h);
  if (RunArmed(n, kQueries.size(), fd, [&](size_t q) { Query(index, h, q); }) == kQueries.size()) {
    return;
  }
  if (std::string broken = index.CheckInvariants(); !broken.empty()) {
    return Report(fd, "Pinvariant broken: " + broken);
  }
  if (Observe(index, h) != before) Report(fd, "Pthe index changed");
}

TEST(AllocationFailureTest, AQueryThatRunsOutOfMemoryChangesNothing) {
  const History h = MakeHistory();
  Sweep(
      kQueries, [&](uint64_t n, int fd) { QueryRun(h, n, fd); }, 100);
}

// ---- Routing decisions and bookings ------------------------------------------------------------

// A router with three workers and some cached prefixes; the ops below book, plan, commit and
// free requests on it. With a queue threshold, a fourth worker of one rank, for requests pinned
// to it to wait for it.
struct RouterFixture {
  ManualClock clock;
  std::unique_ptr<Router> router;
  std::vector<uint32_t> prompt_a, prompt_b;

  explicit RouterFixture(std::optional<double> queue_threshold = std::nullopt) {
    RouterOptions options;
    options.block_size = 4;
    options.clock = &clock;
    options.random_seed = 7;
    options.queue_threshold = queue_threshold;
    router = std::move(Router::Create(options).value());
    for (uint64_t w = 1; w <= (queue_threshold ? 4 : 3); ++w) {
      if (!router
               ->AddWorker(WorkerConfig{
                   .worker_id = w, .dp_size = w == 4 ? 1u : 2u, .total_kv_blocks = 1000})
               .ok()) {
        std::abort();
      }
    }
    prompt_a = testing::BlockTokens(24, 4);
    prompt_b = testing::BlockTokens(40, 4, 1'000'000);
    const std::vector<uint64_t> local = ComputeLocalBlockHashes(prompt_a, 4, {});
    const std::vector<uint64_t> engine(local.begin(), local.begin() + 16);
    if (!router
             ->ApplyEvent(
                 StoredBlocks({2, 1}, std::nullopt, engine, {local.begin(), local.begin() + 16}))
             .ok()) {
      std::abort();
    }
  }
};

// The operations, in order; each may throw std::bad_alloc.
const std::vector<std::string> kRouterOps = {"book r1 (prompt a)",
                                             "plan p1 (prompt b)",
                                             "commit p1",
                                             "book r2 (prompt a)",
                                             "free r1",
                                             "free p1",
                                             "free r2"};

void RouterOp(RouterFixture& f, size_t op) {
  RouteOptions book;
  book.with_admission = true;
  switch (op) {
    case 0:
      book.request_id = "r1";
      (void)f.router->FindBestMatch(f.prompt_a, book);
      return;
    case 1: {
      RouteOptions plan;
      plan.request_id = "p1";
      (void)f.router->Plan(f.prompt_b, plan);
      return;
    }
    case 2:
      (void)f.router->Commit("p1");
      return;
    case 3:
      book.request_id = "r2";
      (void)f.router->FindBestMatch(f.prompt_a, book);
      return;
    case 4:
      f.router->Free("r1");
      return;
    case 5:
      f.router->Free("p1");
      return;
    case 6:
      f.router->Free("r2");
      return;
  }
}

// "" when the loads agree with the bookings: the ranks' active requests add up to the router's.
std::string CheckLoads(const Router& router) {
  uint64_t requests = 0;
  for (const WorkerLoad& load : router.Loads()) {
    requests += load.active_requests;
    if (load.active_requests == 0 && (load.active_blocks != 0 || load.active_prefill_tokens != 0)) {
      return "a rank without requests carries a load";
    }
  }
  if (requests != router.active_requests()) {
    return std::to_string(requests) + " requests on the ranks, " +
           std::to_string(router.active_requests()) + " active";
  }
  return "";
}

// Runs op(i) with the router's digest taken first, the armed refusal held meanwhile (the
// digest's own allocations are not the operation's). Records whether op(i) threw.
struct DigestedOp {
  uint64_t before = 0;
  bool threw = false;
  template <typename Op>
  void Run(const Router& router, Op op) {
    const uint64_t left = FailAllocationForTesting(0);
    before = router.StateDigest();
    FailAllocationForTesting(left);
    threw = false;
    try {
      op();
    } catch (const std::bad_alloc&) {
      threw = true;
      throw;
    }
  }
  // "" unless the operation threw and changed the router anyway.
  std::string Check(const Router& router) const {
    if (threw && router.StateDigest() != before) return "it threw, yet the state changed";
    return "";
  }
};

// The operations with the n-th allocation refused: the one it came in threw and changed
// nothing, or completed; the ranks' loads agree with the bookings; once every request is freed
// the router is as it was before them, and the operations run again from there leave it so too.
void RouterRun(uint64_t n, int fd) {
  RouterFixture f;
  const uint64_t initial = f.router->StateDigest();
  auto fail = [&](const std::string& problem) { Report(fd, "P" + problem); };
  DigestedOp armed;
  if (RunArmed(n, kRouterOps.size(), fd, [&](size_t op) {
        armed.Run(*f.router, [&] { RouterOp(f, op); });
      }) == kRouterOps.size()) {
    return;
  }
  if (std::string changed = armed.Check(*f.router); !changed.empty()) return fail(changed);
  if (std::string loads = CheckLoads(*f.router); !loads.empty()) return fail(loads);
  f.router->Free("r1");
  f.router->Abort("p1");
  f.router->Free("p1");
  f.router->Free("r2");
  if (std::string loads = CheckLoads(*f.router); !loads.empty()) return fail(loads);
  if (f.router->active_requests() != 0 || f.router->plan_count() != 0) {
    return fail("requests or plans left after freeing them all");
  }
  if (f.router->StateDigest() != initial) return fail("freed, the state is not the initial one");
  for (size_t op = 0; op < kRouterOps.size(); ++op) RouterOp(f, op);
  if (f.router->StateDigest() != initial) return fail("the operations again leave a state");
}

TEST(AllocationFailureTest, ARoutingDecisionBooksWholeOrNotAtAll) {
  Sweep(kRouterOps, RouterRun, 30);
}

// The same through what else a booking touches: session bindings (a dispatch binds, a plan
// uses the binding, its commit rebinds), the admission queue (a request pinned to a busy rank
// waits; the rank's completed prefill admits it, in that call's drain), an abort.
const std::vector<std::string> kSessionQueueOps = {"book s1 (session A, hard)",
                                                   "plan s2 (session A, soft)",
                                                   "commit s2",
                                                   "book w1 (pinned to worker 4)",
                                                   "submit w2 (pinned to worker 4: it waits)",
                                                   "prefill of w1 done (admits w2)",
                                                   "abort s2",
                                                   "free s1",
                                                   "free w1",
                                                   "free w2",
                                                   "close session A"};

struct SessionQueueFixture : RouterFixture {
  SessionQueueFixture() : RouterFixture(/*queue_threshold=*/0.0) {}
  // w2's answer, once its callback ran; whether it was submitted (queued or answered).
  std::optional<absl::StatusOr<RouteDecision>> w2_result;
  bool w2_submitted = false;
};

void SessionQueueOp(SessionQueueFixture& f, size_t op) {
  static constexpr uint64_t kFirstThree[] = {1, 2, 3};
  RouteOptions o;
  o.with_admission = true;
  o.session_ttl_seconds = 60;
  switch (op) {
    case 0:
      o.request_id = "s1";
      o.session_id = "A";
      o.allowed_worker_ids = kFirstThree;  // worker 4 stays free for the queue
      (void)f.router->FindBestMatch(f.prompt_a, o);
      return;
    case 1:
      o.request_id = "s2";
      o.session_id = "A";
      o.session_mode = SessionMode::kSoft;
      o.allowed_worker_ids = kFirstThree;
      (void)f.router->Plan(f.prompt_b, o);
      return;
    case 2:
      (void)f.router->Commit("s2");
      return;
    case 3:
      o.request_id = "w1";
      o.pin = WorkerPin{.worker_id = 4};
      (void)f.router->FindBestMatch(f.prompt_b, o);
      return;
    case 4:
      o.request_id = "w2";
      o.pin = WorkerPin{.worker_id = 4};
      // Set first: a FindBestMatchAsync that throws has still submitted w2, whose callback
      // must then have run (its only answer).
      f.w2_submitted = true;
      f.router->FindBestMatchAsync(f.prompt_a, o, [&f](absl::StatusOr<RouteDecision> result) {
        f.w2_result = std::move(result);
      });
      return;
    case 5:
      f.router->MarkPrefillCompleted("w1");
      return;
    case 6:
      f.router->Abort("s2");
      return;
    case 7:
      f.router->Free("s1");
      return;
    case 8:
      f.router->Free("w1");
      return;
    case 9:
      f.router->Free("w2");
      return;
    case 10:
      f.router->CloseSession("A");
      return;
  }
}

void SessionQueueRun(uint64_t n, int fd) {
  SessionQueueFixture f;
  const uint64_t initial = f.router->StateDigest();
  auto fail = [&](const std::string& problem) { Report(fd, "P" + problem); };
  DigestedOp armed;
  if (RunArmed(n, kSessionQueueOps.size(), fd, [&](size_t op) {
        armed.Run(*f.router, [&] { SessionQueueOp(f, op); });
      }) == kSessionQueueOps.size()) {
    return;
  }
  if (std::string changed = armed.Check(*f.router); !changed.empty()) return fail(changed);
  if (std::string loads = CheckLoads(*f.router); !loads.empty()) return fail(loads);
  if (f.w2_submitted && !f.w2_result && f.router->pending_count() != 1) {
    return fail("w2 is neither waiting nor answered");
  }
  for (const char* id : {"s1", "s2", "w1", "w2"}) f.router->Abort(id);
  f.router->CloseSession("A");
  if (std::string loads = CheckLoads(*f.router); !loads.empty()) return fail(loads);
  if (f.w2_submitted && !f.w2_result) return fail("w2's caller never heard");
  if (f.router->active_requests() != 0 || f.router->plan_count() != 0 ||
      f.router->pending_count() != 0 || f.router->session_count() != 0) {
    return fail("requests, plans, waiting requests or sessions left after freeing them all");
  }
  if (f.router->StateDigest() != initial) return fail("freed, the state is not the initial one");
  f.w2_result.reset();
  for (size_t op = 0; op < kSessionQueueOps.size(); ++op) SessionQueueOp(f, op);
  if (!f.w2_result || !f.w2_result->ok() || !(*f.w2_result)->queued) {
    return fail("the operations again: w2 was not admitted from the queue");
  }
  if (f.router->StateDigest() != initial) return fail("the operations again leave a state");
}

TEST(AllocationFailureTest, ABookingWithSessionsAndTheQueueIsWholeOrNotAtAll) {
  Sweep(kSessionQueueOps, SessionQueueRun, 60);
}

// Workers joining, changing and leaving the router: the registry and the load tracker's ranks
// must agree after any refusal (a rank booked on that no worker registers, or a registered
// rank nothing can be booked on, would be either a wrong route or a crash in AlignToRanks).
const std::vector<std::string> kWorkerOps = {"add worker 5 (ranks 0 to 3)",
                                             "book b1 on worker 5 rank 1",
                                             "update worker 5 to ranks 2 to 5 (rank 1 and b1 go)",
                                             "add worker 6 (ranks 0 and 1)",
                                             "update worker 6's batch size",
                                             "remove worker 5",
                                             "remove worker 2 (it holds blocks)"};

void WorkerOp(RouterFixture& f, size_t op) {
  switch (op) {
    case 0:
      (void)f.router->AddWorker(WorkerConfig{.worker_id = 5, .dp_size = 4});
      return;
    case 1:
      (void)f.router->AddRequest("b1", f.prompt_a, WorkerKey{.worker_id = 5, .dp_rank = 1});
      return;
    case 2:
      (void)f.router->UpdateWorker(WorkerConfig{.worker_id = 5, .dp_start = 2, .dp_size = 4});
      return;
    case 3:
      (void)f.router->AddWorker(WorkerConfig{.worker_id = 6, .dp_size = 2});
      return;
    case 4:
      (void)f.router->UpdateWorker(
          WorkerConfig{.worker_id = 6, .dp_size = 2, .max_num_batched_tokens = 4096});
      return;
    case 5:
      (void)f.router->RemoveWorker(5);
      return;
    case 6:
      (void)f.router->RemoveWorker(2);
      return;
  }
}

// "" when the registered workers' ranks are exactly the ranks loads are tracked for.
std::string CheckRanksRegistered(const Router& router) {
  std::vector<std::pair<uint64_t, uint32_t>> registered, tracked;
  for (const WorkerConfig& config : router.Workers()) {
    for (const WorkerKey& rank : RanksOf(config))
      registered.emplace_back(rank.worker_id, rank.dp_rank);
  }
  for (const WorkerLoad& load : router.Loads()) {
    tracked.emplace_back(load.worker.worker_id, load.worker.dp_rank);
  }
  std::sort(registered.begin(), registered.end());
  std::sort(tracked.begin(), tracked.end());
  if (registered != tracked) {
    return std::to_string(registered.size()) + " ranks registered, loads tracked for " +
           std::to_string(tracked.size()) + " (or other) ranks";
  }
  return "";
}

// The operations with the n-th allocation refused: the one it came in threw and changed
// nothing, or completed; the registry and the ranks agree; then the refused operation and the
// rest, run again, end where a run without refusals ends.
void WorkerRun(uint64_t n, int fd) {
  RouterFixture f;
  auto fail = [&](const std::string& problem) { Report(fd, "P" + problem); };
  DigestedOp armed;
  const size_t refused = RunArmed(
      n, kWorkerOps.size(), fd, [&](size_t op) { armed.Run(*f.router, [&] { WorkerOp(f, op); }); });
  if (refused == kWorkerOps.size()) return;
  if (std::string changed = armed.Check(*f.router); !changed.empty()) return fail(changed);
  if (std::string ranks = CheckRanksRegistered(*f.router); !ranks.empty()) return fail(ranks);
  if (std::string loads = CheckLoads(*f.router); !loads.empty()) return fail(loads);
  for (size_t op = refused; op < kWorkerOps.size(); ++op) WorkerOp(f, op);
  RouterFixture unrefused;
  for (size_t op = 0; op < kWorkerOps.size(); ++op) WorkerOp(unrefused, op);
  if (f.router->StateDigest() != unrefused.router->StateDigest() ||
      f.router->Workers() != unrefused.router->Workers()) {
    return fail("the operations run again end elsewhere than a run without refusals");
  }
}

TEST(AllocationFailureTest, WorkersJoinChangeAndLeaveWholeOrNotAtAll) {
  Sweep(kWorkerOps, WorkerRun, 10);
}

// ---- Ranks joining and leaving the load tracker ---------------------------------------------

// A decision joins the index's matches to the ranks with ActiveSequences::AlignToRanks, which
// trusts the slot table and the positions numbered from it. A rank's removal whose allocation is
// refused must leave the two consistent (the rank removed or still there), never a free slot
// numbered as if every slot were in use: AlignToRanks would then write past its output.
const std::vector<std::string> kRankOps = {"remove rank 1",
                                           "remove rank 3",
                                           "add rank 4 (a free slot)",
                                           "remove rank 2",
                                           "add rank 5 (a free slot)",
                                           "add ranks 6 to 12 (new slots)",
                                           "remove ranks 4, 6 and 8 and add 13 and 14 (an update)"};

WorkerKey Rank(uint64_t worker_id) { return WorkerKey{.worker_id = worker_id}; }

void RankOp(ActiveSequences& active, size_t op) {
  constexpr uint64_t kWorkerOf[] = {1, 3, 4, 2, 5};
  if (op < std::size(kWorkerOf)) {
    const WorkerKey rank = Rank(kWorkerOf[op]);
    (op == 2 || op == 4) ? active.AddWorker(rank) : static_cast<void>(active.RemoveWorker(rank));
  } else if (op == 5) {
    std::vector<WorkerKey> added;
    for (uint64_t w = 6; w <= 12; ++w) added.push_back(Rank(w));
    active.ChangeRanks({}, added);
  } else {
    const WorkerKey removed[] = {Rank(4), Rank(6), Rank(8)};
    const WorkerKey added[] = {Rank(13), Rank(14)};
    active.ChangeRanks(removed, added);
  }
}

// "" when AlignToRanks puts every registered rank's item at that rank's place in Loads().
std::string CheckAligned(const ActiveSequences& active) {
  std::vector<WorkerKey> items;
  for (uint64_t w = 1; w <= 15; ++w) items.push_back(WorkerKey{.worker_id = w});
  std::vector<const WorkerKey*> aligned;
  aligned.reserve(items.size());  // room for a write past the end: seen below, not a crash
  active.AlignToRanks(
      std::span<const WorkerKey>(items), [](const WorkerKey& k) { return k; }, aligned);
  const std::vector<WorkerLoad> loads = active.Loads();
  if (aligned.size() != loads.size() || active.num_workers() != loads.size()) {
    return "aligned " + std::to_string(aligned.size()) + " items to " +
           std::to_string(loads.size()) + " ranks (" + std::to_string(active.num_workers()) +
           " registered)";
  }
  for (size_t i = 0; i < loads.size(); ++i) {
    if (aligned[i] == nullptr || *aligned[i] != loads[i].worker) {
      return "rank " + std::to_string(loads[i].worker.worker_id) + " at place " +
             std::to_string(i) + " got " +
             (aligned[i] ? "rank " + std::to_string(aligned[i]->worker_id) : "no item");
    }
  }
  return "";
}

// The ranks of `active`, by worker id.
std::vector<uint64_t> RankIds(const ActiveSequences& active) {
  std::vector<uint64_t> ids;
  for (const WorkerLoad& load : active.Loads()) ids.push_back(load.worker.worker_id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

void RankRun(uint64_t n, int fd) {
  ManualClock clock;
  ActiveSequences active(clock), expected(clock);
  for (uint64_t w = 1; w <= 3; ++w) {
    active.AddWorker(Rank(w));
    expected.AddWorker(Rank(w));
  }
  auto fail = [&](const std::string& problem) { Report(fd, "P" + problem); };
  const size_t refused = RunArmed(n, kRankOps.size(), fd, [&](size_t op) { RankOp(active, op); });
  if (refused == kRankOps.size()) return;
  // Whole or not at all: the ranks as before the refused operation, or as after it (when the
  // refusal was of something optional, such as a shrink).
  for (size_t op = 0; op < refused; ++op) RankOp(expected, op);
  const std::vector<uint64_t> before = RankIds(expected);
  RankOp(expected, refused);
  const std::vector<uint64_t> got = RankIds(active);
  if (got != before && got != RankIds(expected)) {
    return fail("a refused change of ranks left part of it: " + kRankOps[refused]);
  }
  if (std::string problem = CheckAligned(active); !problem.empty()) return fail(problem);
  for (size_t op = 0; op < kRankOps.size(); ++op) RankOp(active, op);
  if (std::string problem = CheckAligned(active); !problem.empty()) {
    return fail("after the operations again, " + problem);
  }
}

TEST(AllocationFailureTest, RanksLeavingWhenTheHeapRefusesStayAlignedWithTheirMatches) {
  Sweep(kRankOps, RankRun, 2);
}

// ---- The real limit, through the C ABI ---------------------------------------------------------

// One store from the root per worker, of `blocks` blocks with random hashes.
struct RootStore {
  uint64_t worker_id;
  std::vector<uint64_t> engine, local;
};

// Whether the router's index holds all of the store (1), none of it (0), or part (-1).
int Held(kvr_router* router, const RootStore& s) {
  kvr_match m[4];
  size_t len = 0;
  if (kvr_router_find_matches(router, s.local.data(), s.local.size(), m, 4, &len, nullptr) !=
      KVR_OK) {
    _exit(30);
  }
  if (len == 0) return 0;
  const bool whole = len == 1 && m[0].worker_id == s.worker_id &&
                     m[0].device_blocks == s.local.size() && m[0].tree_size == s.local.size();
  return whole ? 1 : -1;
}

kvr_status ApplyStore(kvr_router* router, const RootStore& s) {
  kvr_stored_event e;
  kvr_stored_event_init(&e, sizeof e);
  e.worker_id = s.worker_id;
  e.block_hashes = s.engine.data();
  e.num_blocks = s.engine.size();
  e.local_hashes = s.local.data();
  return kvr_router_apply_stored(router, &e, nullptr);  // no error object: nothing to allocate
}

uint64_t IndexDigest(kvr_router* router) {
  uint64_t digest = 0;
  if (kvr_router_index_digest(router, &digest, nullptr) != KVR_OK) _exit(30);
  return digest;
}

// Exit codes of the child (RealLimitChild).
enum ChildExit : int {
  kAllApplied = 0,       // the C heap stood in for every refused mapping
  kSomeRefused = 10,     // some events were refused with KVR_RESOURCE_EXHAUSTED, the index intact
  kLimitUnreached = 20,  // could not use the mappings up
  kBadStatus = 21,       // an event ended with a status other than OK or RESOURCE_EXHAUSTED
  kHalfApplied = 22,     // the index holds part of a refused event (or lost an applied one)
  kNoRecovery = 23,      // with memory back, the refused events did not apply
  kMiscounted = 24,      // kvr_metrics' event counts disagree with the statuses
};

// The router's counts of stored events applied and refused for memory (kvr_metrics).
struct EventCounts {
  uint64_t applied = 0, refused_for_memory = 0;
};
EventCounts CountsOf(kvr_router* router) {
  kvr_metrics m;
  kvr_metrics_init(&m, sizeof m);
  if (kvr_router_get_metrics(router, &m, nullptr) != KVR_OK) _exit(30);
  return {m.events[KVR_EVENT_STORED][KVR_EVENT_OK], m.events_refused_for_memory};
}

// Uses up the process's mappings (vm.max_map_count) with its own, then has the router's index
// grow: each event applies whole (the C heap standing in for mappings) or is refused
// (KVR_RESOURCE_EXHAUSTED from the C ABI's guard: at the limit the kernel refuses the heap's growth
// too) leaving nothing behind; with the mappings given back, the refused ones apply.
int RealLimitChild(size_t max_map_count) {
  kvr_router* router = nullptr;
  kvr_router* reference = nullptr;
  if (kvr_router_new(nullptr, &router, nullptr) != KVR_OK ||
      kvr_router_new(nullptr, &reference, nullptr) != KVR_OK) {
    return 31;
  }
  // Workers whose tables are mapped (3,000 blocks: 48 KiB) or past glibc's own mmap threshold
  // (12,000: 192 KiB). Each worker's share of the digest, from a reference (digests of ranks
  // add up).
  Rng rng(0x11a17);
  std::vector<RootStore> stores;
  for (uint64_t w = 1; w <= 24; ++w) {
    RootStore s{w, Fresh(rng, w % 3 == 0 ? 12'000 : 3'000), {}};
    s.local = Fresh(rng, s.engine.size());
    stores.push_back(std::move(s));
  }
  std::vector<uint64_t> share;
  uint64_t total = 0;
  for (const RootStore& s : stores) {
    if (ApplyStore(reference, s) != KVR_OK) return 32;
    const uint64_t digest = IndexDigest(reference);
    share.push_back(digest - total);
    total = digest;
  }
  kvr_router_free(reference);
  // Use the mappings up: one region, every other page of it made inaccessible (a mapping each).
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t pages = max_map_count + 64;
  char* region = static_cast<char*>(
      mmap(nullptr, pages * page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  if (region == MAP_FAILED) return 33;
  bool limited = false;
  for (size_t i = 1; i < pages; i += 2) {
    if (mprotect(region + i * page, page, PROT_NONE) != 0) {
      limited = errno == ENOMEM;
      break;
    }
  }
  if (!limited) return kLimitUnreached;
  std::vector<kvr_status> status;
  for (const RootStore& s : stores) status.push_back(ApplyStore(router, s));
  // Mappings back.
  munmap(region, pages * page);
  // Each worker holds its whole store or none of it (a refused event may have applied whole
  // before its status was made), and the digest is that of the stores held.
  uint64_t held_digest = 0;
  std::vector<size_t> refused;
  bool consistent = true;
  for (size_t w = 0; w < stores.size(); ++w) {
    if (status[w] != KVR_OK && status[w] != KVR_RESOURCE_EXHAUSTED) {
      std::fprintf(stderr, "worker %zu: status %s\n", w, kvr_status_str(status[w]));
      return kBadStatus;
    }
    if (status[w] == KVR_RESOURCE_EXHAUSTED) refused.push_back(w);
    const int held = Held(router, stores[w]);
    if (held < 0 || (held == 0 && status[w] == KVR_OK)) {
      std::fprintf(stderr, "worker %zu (%s) holds part of its store\n", w,
                   kvr_status_str(status[w]));
      consistent = false;
    }
    if (held == 1) held_digest += share[w];
  }
  // kvr_metrics counts an event the index refused (before it changed anything, or midway) in
  // events_refused_for_memory, and one applied whole (whatever its status: the C ABI may be
  // refused its status after) as applied: never one event twice, never more refused than
  // statuses said so, and not one more once memory is back.
  const EventCounts at_limit = CountsOf(router);
  std::fprintf(stderr,
               "at the limit: %zu of %zu events refused, %llu of them by the index "
               "(kvr_metrics.events_refused_for_memory)\n",
               refused.size(), stores.size(),
               static_cast<unsigned long long>(at_limit.refused_for_memory));
  const uint64_t ok_statuses = stores.size() - refused.size();
  if (at_limit.refused_for_memory > refused.size() || at_limit.applied < ok_statuses ||
      at_limit.applied + at_limit.refused_for_memory > stores.size()) {
    std::fprintf(stderr, "kvr_metrics: %llu applied, %llu refused for memory\n",
                 static_cast<unsigned long long>(at_limit.applied),
                 static_cast<unsigned long long>(at_limit.refused_for_memory));
    return kMiscounted;
  }
  consistent = consistent && IndexDigest(router) == held_digest;
  if (!consistent) return kHalfApplied;
  for (size_t w : refused) {
    const kvr_status again = ApplyStore(router, stores[w]);
    if (again != KVR_OK) {
      std::fprintf(stderr, "worker %zu again: status %s\n", w, kvr_status_str(again));
      return kNoRecovery;
    }
  }
  if (IndexDigest(router) != total) return kNoRecovery;
  const EventCounts after = CountsOf(router);
  if (after.refused_for_memory != at_limit.refused_for_memory ||
      after.applied != at_limit.applied + refused.size()) {
    return kMiscounted;
  }
  kvr_router_free(router);
  return refused.empty() ? kAllApplied : kSomeRefused;
}

TEST(AllocationFailureTest, AtTheRealMappingLimitEventsApplyOrAreRefusedCleanly) {
  if (kAsan) GTEST_SKIP() << "AddressSanitizer's own allocator needs mappings";
  size_t max_map_count = 0;
  std::ifstream("/proc/sys/vm/max_map_count") >> max_map_count;
  if (max_map_count == 0 || max_map_count > 300'000) {
    GTEST_SKIP() << "vm.max_map_count unreadable or too large to use up quickly (" << max_map_count
                 << ")";
  }
  std::fflush(nullptr);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) _exit(RealLimitChild(max_map_count));
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died: " << strsignal(WTERMSIG(status));
  const int code = WEXITSTATUS(status);
  const char* meaning = code == kLimitUnreached ? "could not use the mappings up"
                        : code == kBadStatus    ? "an event ended with another status"
                        : code == kHalfApplied  ? "the index holds part of a refused event"
                        : code == kNoRecovery   ? "with mappings back, refused events did not apply"
                        : code == kMiscounted   ? "kvr_metrics miscounts the events"
                                                : "set-up failed";
  ASSERT_TRUE(code == kAllApplied || code == kSomeRefused)
      << "child exit " << code << ": " << meaning;
  std::printf("at the limit: %s\n", code == kAllApplied ? "every event applied (the heap stood in)"
                                                        : "some events refused cleanly");
}

// ---- Approximate mode --------------------------------------------------------------------------

// Approximate mode records each routing decision as stored blocks and expires them per
// decision (ApproxIndex). Whatever allocation is refused, every block the index holds must stay
// on the path of a live decision, or it would match forever: the key check is that once the
// clock passes every TTL, ExpireDue empties the index. A decision records whole, or throws with
// nothing recorded (its worker left holding nothing if the store was refused midway); expiry,
// pruning and removals never leave a block behind.
struct ApproxStep {
  enum Kind { kRecord, kFindMatches, kExpireDue, kRemoveWorker, kRemoveRank };
  std::string what;
  Kind kind;
  double at_seconds;  // the clock is set to this first
  WorkerKey worker{};
  size_t prompt = 0;  // in ApproxHistory::prompts (kRecord, kFindMatches)
};

struct ApproxHistory {
  std::vector<Prompt> prompts;
  std::vector<ApproxStep> steps;
};

constexpr WorkerKey kApproxA{1, 0}, kApproxB{2, 0}, kApproxC{3, 1};

ApproxIndexOptions ApproxOptions() {
  return ApproxIndexOptions{
      .block_size = 4, .ttl_seconds = 10, .max_blocks = 280, .prune_target_ratio = 0.75};
}

// Overlapping prompts on three workers; a branch every two blocks off one prompt, so that
// its path crosses more runs than the index drops in one call when it is taken apart; a prompt
// recorded again, superseding its earlier decision; expiry through FindMatches and ExpireDue; a
// decision over the budget (a prune); a rank's and a worker's removal.
ApproxHistory MakeApproxHistory() {
  Rng rng(0xa9910c);
  ApproxHistory h;
  auto& p = h.prompts;
  const Prompt p0 = MakePrompt(Fresh(rng, 80));
  p.push_back(p0);  // 0
  p.push_back(MakePrompt(Concat({p0.local.begin(), p0.local.begin() + 12}, Fresh(rng, 10))));
  p.push_back(MakePrompt(Fresh(rng, 20)));  // 2
  p.push_back(MakePrompt(Concat({p0.local.begin(), p0.local.begin() + 5}, Fresh(rng, 6))));
  p.push_back(MakePrompt(Fresh(rng, 50)));  // 4
  p.push_back(MakePrompt(Concat({p[2].local.begin(), p[2].local.begin() + 10}, Fresh(rng, 5))));
  p.push_back(MakePrompt(Fresh(rng, 8)));  // 6: the decision after the refusal
  const size_t first_branch = p.size();
  for (size_t at = 2; at <= 70; at += 2) {
    p.push_back(MakePrompt(Concat({p0.local.begin(), p0.local.begin() + at}, Fresh(rng, 2))));
  }
  using S = ApproxStep;
  auto& s = h.steps;
  s.push_back({"A records p0", S::kRecord, 0, kApproxA, 0});
  s.push_back({"B records p1 (p0's first 12 blocks, then its own)", S::kRecord, 0, kApproxB, 1});
  s.push_back({"A records p1 (stores the 10 blocks it lacks)", S::kRecord, 0, kApproxA, 1});
  for (size_t b = first_branch; b < p.size(); ++b) {
    s.push_back({"B records a branch off p0 after " + std::to_string(p[b].local.size() - 2) +
                     " blocks (a split)",
                 S::kRecord, 1, kApproxB, b});
  }
  s.push_back({"C records p2", S::kRecord, 2, kApproxC, 2});
  s.push_back({"A records p0 again (supersedes its first decision)", S::kRecord, 3, kApproxA, 0});
  s.push_back({"A records p3 (a branch off p0)", S::kRecord, 3, kApproxA, 3});
  s.push_back({"FindMatches past the first TTLs (expires A's and B's p1)", S::kFindMatches, 10.5,
               kApproxA, 0});
  s.push_back({"C records p5 (p2's first 10 blocks)", S::kRecord, 10.5, kApproxC, 5});
  s.push_back({"B records p4 (over the budget: a prune)", S::kRecord, 10.5, kApproxB, 4});
  s.push_back({"ExpireDue past the branches' TTL", S::kExpireDue, 11.5});
  s.push_back({"rank C is removed", S::kRemoveRank, 11.5, kApproxC});
  s.push_back({"A records p2 (C's prompt)", S::kRecord, 11.5, kApproxA, 2});
  s.push_back({"worker B is removed", S::kRemoveWorker, 12, kApproxB});
  s.push_back(
      {"ExpireDue past A's p0 (its path crosses the branches' splits)", S::kExpireDue, 13.5});
  s.push_back({"A records p1 again", S::kRecord, 13.5, kApproxA, 1});
  return h;
}

void DoApprox(ApproxIndex& approx, ManualClock& clock, const ApproxHistory& h, size_t k) {
  const ApproxStep& step = h.steps[k];
  clock.Set(SecondsToNanos(step.at_seconds));
  const Prompt& prompt = h.prompts[step.prompt];
  switch (step.kind) {
    case ApproxStep::kRecord:
      approx.RecordRoutingDecision(step.worker, prompt.local, prompt.seq);
      return;
    case ApproxStep::kFindMatches: {
      std::vector<WorkerMatch> out;
      approx.FindMatches(prompt.local, out);
      return;
    }
    case ApproxStep::kExpireDue:
      (void)approx.ExpireDue();
      return;
    case ApproxStep::kRemoveWorker:
      (void)approx.RemoveWorker(step.worker.worker_id);
      return;
    case ApproxStep::kRemoveRank:
      (void)approx.RemoveWorkerDpRank(step.worker);
      return;
  }
}

// What the index answers for every prompt, leaving out one worker if `except` is given (the
// index's own lookups: ApproxIndex::FindMatches would expire).
std::string ObserveApprox(const ApproxIndex& approx, const ApproxHistory& h,
                          std::optional<WorkerKey> except = std::nullopt) {
  std::string out;
  for (const Prompt& p : h.prompts) {
    std::vector<WorkerMatch> matches = approx.index().FindMatches(p.local);
    std::erase_if(matches, [&](const WorkerMatch& m) { return except && m.worker == *except; });
    out += MatchesToString(std::move(matches)) + "|";
  }
  return out;
}

// "" when the approximate index is consistent: its invariants (the radix index's among them)
// and its stats.
std::string CheckApprox(const ApproxIndex& approx) {
  if (std::string broken = approx.CheckInvariants(); !broken.empty()) return broken;
  const ApproxIndexStats stats = approx.Stats();
  if (stats.tracked_blocks != stats.index.cached_blocks ||
      stats.tracked_blocks != approx.index().CachedBlocks()) {
    return "Stats: " + std::to_string(stats.tracked_blocks) + " tracked blocks, the index " +
           std::to_string(stats.index.cached_blocks);
  }
  if (stats.tracked_blocks > 0 && stats.decisions == 0) return "Stats: blocks without decisions";
  return "";
}

// What the step the refusal came in may have left. A decision that returned is recorded whole
// (or, if a prune after it had a split refused, its worker holds nothing); one that threw
// recorded nothing (or left its worker holding nothing); a removal that threw changed nothing;
// expiry never throws.
std::string CheckStep(const ApproxIndex& approx, const ApproxHistory& h, const ApproxStep& step,
                      bool threw, const std::string& before, const std::string& before_except) {
  const auto cleared = [&] {
    return approx.index().TreeSize(step.worker) == 0 &&
           ObserveApprox(approx, h, step.worker) == before_except;
  };
  switch (step.kind) {
    case ApproxStep::kRecord: {
      if (threw) {
        if (ObserveApprox(approx, h) == before || cleared()) return "";
        return "a decision that threw changed the index";
      }
      const Prompt& p = h.prompts[step.prompt];
      for (const WorkerMatch& m : approx.index().FindMatches(p.local)) {
        if (m.worker == step.worker && m.device_blocks == p.local.size()) return "";
      }
      if (approx.index().TreeSize(step.worker) == 0) return "";
      return "a decision that returned is not recorded whole";
    }
    case ApproxStep::kRemoveWorker:
    case ApproxStep::kRemoveRank:
      if (threw && ObserveApprox(approx, h) != before) return "a removal that threw changed things";
      return "";
    case ApproxStep::kExpireDue:
      return threw ? "ExpireDue threw" : "";
    case ApproxStep::kFindMatches:
      return "";  // may throw from its lookup, which changes nothing
  }
  return "";
}

// The history with its n-th allocation refused: after the step it came in, the index is
// consistent and every block on a live decision's path; the rest of the history and a later
// decision run normally; past every TTL, ExpireDue empties the index.
void ApproxRun(const ApproxHistory& h, uint64_t n, int fd) {
  auto fail = [&](const std::string& problem) { Report(fd, "P" + problem); };
  ManualClock clock;
  ApproxIndex approx(ApproxOptions(), clock);
  std::string before, before_except;
  bool threw = false;
  const size_t i = RunArmed(n, h.steps.size(), fd, [&](size_t k) {
    const uint64_t left = FailAllocationForTesting(0);  // the observation's are not the step's
    before = ObserveApprox(approx, h);
    before_except = ObserveApprox(approx, h, h.steps[k].worker);
    FailAllocationForTesting(left);
    threw = false;
    try {
      DoApprox(approx, clock, h, k);
    } catch (const std::bad_alloc&) {
      threw = true;
      throw;
    }
  });
  if (i == h.steps.size()) return;
  if (std::string broken = CheckApprox(approx); !broken.empty()) return fail(broken);
  if (std::string wrong = CheckStep(approx, h, h.steps[i], threw, before, before_except);
      !wrong.empty()) {
    return fail(wrong);
  }
  for (size_t k = i + 1; k < h.steps.size(); ++k) DoApprox(approx, clock, h, k);
  if (std::string broken = CheckApprox(approx); !broken.empty())
    return fail("at the end, " + broken);
  // A later decision records normally.
  const Prompt& later = h.prompts[6];
  approx.RecordRoutingDecision(kApproxA, later.local, later.seq);
  bool recorded = false;
  for (const WorkerMatch& m : approx.index().FindMatches(later.local)) {
    recorded = recorded || (m.worker == kApproxA && m.device_blocks == later.local.size());
  }
  if (!recorded) return fail("a later decision is not recorded");
  // Past every TTL nothing is left: no block was left without a decision to expire it.
  clock.Advance(SecondsToNanos(ApproxOptions().ttl_seconds + 1));
  approx.ExpireDue();
  const ApproxIndexStats stats = approx.Stats();
  if (stats.tracked_blocks != 0 || stats.index.tree_blocks != 0 || stats.decisions != 0) {
    return fail("past every TTL, ExpireDue leaves " + std::to_string(stats.tracked_blocks) +
                " blocks (" + std::to_string(stats.index.tree_blocks) + " in the tree) and " +
                std::to_string(stats.decisions) + " decisions");
  }
  if (std::string broken = CheckApprox(approx); !broken.empty()) return fail("emptied, " + broken);
  for (WorkerKey w : approx.index().Workers()) approx.RemoveWorkerDpRank(w);
  if (const int64_t bytes = approx.Stats().index.allocated_bytes;
      bytes != RadixIndex().Stats().allocated_bytes) {
    return fail("every worker removed, the index holds " + std::to_string(bytes) + " bytes");
  }
}

TEST(AllocationFailureTest, ApproximateModeLeavesNoBlockWithoutADecision) {
  const ApproxHistory h = MakeApproxHistory();
  {
    ManualClock clock;  // the history itself, nothing refused
    ApproxIndex approx(ApproxOptions(), clock);
    for (size_t k = 0; k < h.steps.size(); ++k) {
      DoApprox(approx, clock, h, k);
      ASSERT_EQ(CheckApprox(approx), "") << "after " << h.steps[k].what;
    }
    EXPECT_GT(approx.Stats().pruned_blocks, 0u);
    EXPECT_GT(approx.Stats().expired_blocks, 0u);
  }
  std::vector<std::string> ops;
  for (const ApproxStep& step : h.steps) ops.push_back(step.what);
  Sweep(
      ops, [&](uint64_t n, int fd) { ApproxRun(h, n, fd); }, 500);
}

}  // namespace
}  // namespace kvrouter

// ---- Replica notifications lost for memory: the re-announce that repairs them ---------------
// A booking change the observer loses is repaired by announcing every booking again; that
// announcement copies ids (allocates) after the change it follows was committed, so it must
// never throw, and a refusal in it must leave the repair pending.
namespace kvrouter {
namespace {

struct SeenChange {
  SequenceChange::Kind kind;
  char id[64];
};

TEST(AllocationFailureTest, AReannounceRefusedAfterAFreeNeitherThrowsNorForgetsTheRepair) {
  RouterFixture f;
  std::vector<SeenChange> seen;
  seen.reserve(64);  // the observer allocates nothing
  int refuse = 0;
  f.router->SetSequenceObserver("a", [&](const SequenceChange& c) {
    if (refuse > 0) {
      --refuse;
      throw std::bad_alloc();
    }
    SeenChange s{c.kind, {}};
    std::memcpy(s.id, c.request_id.data(), std::min<size_t>(c.request_id.size(), 63));
    seen.push_back(s);
  });
  const std::string keep(40, 'k');  // longer than std::string's own buffer
  const std::string lost(40, 'l');
  ASSERT_TRUE(
      f.router->FindBestMatch(f.prompt_a, {.with_admission = true, .request_id = keep}).ok());
  refuse = 1;  // the observer loses this one: a re-announce is pending
  ASSERT_TRUE(
      f.router->FindBestMatch(f.prompt_b, {.with_admission = true, .request_id = lost}).ok());
  ASSERT_EQ(f.router->replica_stats().changes_unpublished, 1u);
  seen.clear();

  // Free `lost`: the Freed gets through, then the re-announce copies `keep`'s id (allocates).
  count_operator_new = true;
  FailAllocationForTesting(1);
  bool threw = false;
  bool freed = false;
  try {
    freed = f.router->Free(lost);
  } catch (const std::bad_alloc&) {
    threw = true;
  }
  FailAllocationForTesting(0);
  count_operator_new = false;
  EXPECT_FALSE(threw) << "Free threw std::bad_alloc although the booking was freed";
  EXPECT_FALSE(f.router->MarkPrefillCompleted(lost)) << "(the booking is gone either way)";
  (void)freed;
  // What the peer saw: Freed, Reset, and then?
  std::string kinds;
  for (const SeenChange& s : seen) kinds += std::to_string(static_cast<int>(s.kind)) + " ";
  // The next change that gets through must repair the peer's view (re-announce `keep`).
  seen.clear();
  ASSERT_TRUE(f.router->MarkPrefillCompleted(keep));
  bool reannounced = false;
  for (const SeenChange& s : seen) reannounced |= s.kind == SequenceChange::Kind::kReset;
  EXPECT_TRUE(reannounced) << "the peer saw [" << kinds
                           << "] (Reset without `keep`) and nothing repairs it any more";
}

TEST(AllocationFailureTest, AFarewellAfterALostNotificationIsTheLastWord) {
  RouterFixture f;
  std::vector<SequenceChange::Kind> seen;
  int refuse = 0;
  const uint64_t token = f.router->SetSequenceObserver("a", [&](const SequenceChange& c) {
    if (refuse > 0) {
      --refuse;
      throw std::bad_alloc();
    }
    seen.push_back(c.kind);
  });
  refuse = 1;
  ASSERT_TRUE(
      f.router->FindBestMatch(f.prompt_a, {.with_admission = true, .request_id = "r1"}).ok());
  seen.clear();
  ASSERT_TRUE(f.router->ClearSequenceObserver(token, /*farewell=*/true));
  // The farewell must be the last word: a Reset, nothing after it.
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.back(), SequenceChange::Kind::kReset)
      << seen.size()
      << " changes after the farewell's Reset re-booked this router's requests on "
         "every peer";
}

TEST(AllocationFailureTest, AReannounceRefusedAfterABookingDoesNotAnswerOutOfMemory) {
  RouterFixture f;
  std::vector<SeenChange> seen;
  seen.reserve(64);
  int refuse = 0;
  f.router->SetSequenceObserver("a", [&](const SequenceChange& c) {
    if (refuse > 0) {
      --refuse;
      throw std::bad_alloc();
    }
    seen.push_back(SeenChange{c.kind, {}});
  });
  const std::string keep(40, 'k');
  ASSERT_TRUE(
      f.router->FindBestMatch(f.prompt_a, {.with_admission = true, .request_id = keep}).ok());
  refuse = 1;
  ASSERT_TRUE(f.router->Free(keep));  // lost: a re-announce is pending
  ASSERT_TRUE(
      f.router->FindBestMatch(f.prompt_b, {.with_admission = true, .request_id = keep + "2"}).ok());
  // (that booking's Added got through and re-announced: pending again only after a new loss)
  refuse = 1;
  ASSERT_TRUE(f.router->Free(keep + "2"));
  ASSERT_TRUE(
      f.router->FindBestMatch(f.prompt_a, {.with_admission = true, .request_id = keep + "3"}).ok());
  refuse = 1;
  ASSERT_TRUE(f.router->MarkPrefillCompleted(keep + "3"));  // lost: pending, keep3 booked
  // Book r4 asynchronously with the n-th allocation refused: find the n at which the booking
  // is made and only the re-announce (copying keep3's id) is refused.
  for (uint64_t n = 1; n <= 200; ++n) {
    RouterFixture g;
    int refuse_g = 0;
    g.router->SetSequenceObserver("a", [&](const SequenceChange&) {
      if (refuse_g > 0) {
        --refuse_g;
        throw std::bad_alloc();
      }
    });
    ASSERT_TRUE(
        g.router->FindBestMatch(g.prompt_a, {.with_admission = true, .request_id = keep}).ok());
    refuse_g = 1;
    ASSERT_TRUE(g.router->MarkPrefillCompleted(keep));  // lost: pending
    std::optional<absl::Status> answer;
    count_operator_new = true;
    FailAllocationForTesting(n);
    g.router->FindBestMatchAsync(g.prompt_b, {.with_admission = true, .request_id = "r4"},
                                 [&](absl::StatusOr<RouteDecision> r) { answer = r.status(); });
    const bool refused = FailAllocationForTesting(0) == 0;
    count_operator_new = false;
    if (!refused) break;
    const bool booked = g.router->MarkPrefillCompleted("r4");  // true: r4 is booked
    if (answer && !answer->ok() && booked) {
      ADD_FAILURE() << "allocation " << n << " refused: r4 answered " << answer->ToString()
                    << " yet it is booked (load nobody will free until it expires)";
    }
  }
}

// ---- A replica's announcement applied while the heap refuses -----------------------------------
// b holds two of a's bookings, k1 and "gone" (its free was lost); a announces k1 and k2. With
// the n-th allocation refused in any step of the announcement, b ends (once the rest of it has
// come) holding nothing a did not
// announce, its loads agree with its bookings, and the next announcement, unrefused, leaves it
// exactly a's picture.
const std::vector<std::string> kAnnouncementOps = {"Reset announcing 2 bookings",
                                                   "Added k1 (held before)", "Added k2"};

struct AnnouncedBooking {
  std::string id;
  WorkerKey worker;
  std::vector<uint64_t> block_ids;
  SequenceChange Added() const {
    return {.kind = SequenceChange::Kind::kAdded,
            .request_id = id,
            .worker = worker,
            .block_ids = block_ids,
            .prefill_tokens = 4 * block_ids.size()};
  }
};

uint64_t RequestsOn(const Router& router, WorkerKey rank) {
  for (const WorkerLoad& load : router.Loads()) {
    if (load.worker == rank) return load.active_requests;
  }
  return 0;
}

void AnnouncementRun(uint64_t n, int fd) {
  RouterFixture f;
  auto fail = [&](const std::string& problem) { Report(fd, "P" + problem); };
  const AnnouncedBooking k1{"k1", {1, 0}, {1, 2}}, gone{"gone", {2, 1}, {5}},
      k2{"k2", {3, 0}, {7, 8, 9}};
  for (const AnnouncedBooking* held : {&k1, &gone}) {
    if (!f.router->ApplyReplicaChange("a", held->Added()).ok()) return fail("setup");
  }
  const SequenceChange reset{.kind = SequenceChange::Kind::kReset, .announced_bookings = 2};
  const std::vector<SequenceChange> announcement = {reset, k1.Added(), k2.Added()};
  bool escaped = false;  // a refusal inside the announcement thrown out of the call
  const size_t refused_in = RunArmed(n, announcement.size(), fd, [&](size_t op) {
    try {
      (void)f.router->ApplyReplicaChange("a", announcement[op]);
    } catch (const std::bad_alloc&) {
      escaped = op > 0;  // a booking announced again: its old copy may be gone already
      throw;
    }
  });
  if (refused_in == announcement.size()) return;
  if (escaped) return fail("a refusal for an announced booking was thrown out of the call");
  for (size_t op = refused_in + 1; op < announcement.size(); ++op) {  // the rest of it
    (void)f.router->ApplyReplicaChange("a", announcement[op]);
  }
  if (std::string loads = CheckLoads(*f.router); !loads.empty()) return fail(loads);
  if (RequestsOn(*f.router, gone.worker) != 0) {
    return fail("the booking a did not announce again is still held");
  }
  if (f.router->active_requests() > 2) return fail("more bookings than a announced");
  for (const SequenceChange& change : announcement) (void)f.router->ApplyReplicaChange("a", change);
  if (std::string loads = CheckLoads(*f.router); !loads.empty()) return fail(loads);
  if (f.router->active_requests() != 2 || RequestsOn(*f.router, k1.worker) != 1 ||
      RequestsOn(*f.router, k2.worker) != 1) {
    return fail("announced again, b does not hold exactly k1 and k2");
  }
}

TEST(AllocationFailureTest, AnAnnouncementOfAReplicasBookingsLeavesNothingStale) {
  Sweep(kAnnouncementOps, AnnouncementRun, 5);
}

}  // namespace
}  // namespace kvrouter
