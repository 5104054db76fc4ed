#include "core/active_sequences.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <new>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"

namespace kvrouter {
namespace {

// Hash tables keep their capacity after erasures; past this size, a table less than 1/8 full
// is shrunk so memory follows the live requests (and the factor of 8 keeps a table that hovers
// around one size from being resized back and forth).
constexpr size_t kMinCapacityToShrink = 1024;

}  // namespace

void ComputeTrackingIdsInto(std::span<const uint64_t> local_hashes, std::vector<uint64_t>& out) {
  // Local hashes are XXH3 outputs, already uniform, so the chain only has to make each identity
  // depend on every block before it: rotate, xor, multiply by an odd constant (as rustc's
  // FxHash does), about 5 cycles per block where a full mixer would take 15 on this serial
  // dependency chain. The rotation brings high bits back down so they feed later products.
  constexpr uint64_t kMultiplier = 0x517cc1b727220a95ULL;
  out.resize(local_hashes.size());
  uint64_t previous = 0x9e3779b97f4a7c15ULL;  // any fixed start
  for (size_t i = 0; i < local_hashes.size(); ++i) {
    previous = (((previous << 5) | (previous >> 59)) ^ local_hashes[i]) * kMultiplier;
    out[i] = previous;
  }
}

absl::Status UnknownRankError(WorkerKey worker) {
  return absl::NotFoundError(
      absl::StrCat("unknown worker ", worker.worker_id, " dp_rank ", worker.dp_rank));
}

ActiveSequences::ActiveSequences(const Clock& clock, ActiveSequencesOptions options)
    : clock_(clock),
      expiry_(SecondsToNanos(options.expiry_seconds)),
      expiry_check_interval_(
          SecondsToNanos(std::min(options.expiry_check_seconds, options.expiry_seconds))),
      last_expiry_check_(clock.Now()),
      prefill_rate_(options.prefill_tokens_per_second),
      root_(std::make_unique<Run>()) {}

ActiveSequences::~ActiveSequences() {
  requests_.ForEach([](std::string_view, Record* record) { delete record; });
}

namespace {

// Room for `n` elements, growing geometrically so that ranks added one at a time do not copy
// the vector each time.
template <typename Vector>
void ReserveGrowing(Vector& v, size_t n) {
  if (n > v.capacity()) v.reserve(std::max({n, 2 * v.capacity(), size_t{4}}));
}

}  // namespace

void ActiveSequences::AddWorker(WorkerKey worker) { ChangeRanks({}, std::span(&worker, 1)); }

size_t ActiveSequences::RemoveWorker(WorkerKey worker) {
  return ChangeRanks(std::span(&worker, 1), {});
}

size_t ActiveSequences::ChangeRanks(std::span<const WorkerKey> removed,
                                    std::span<const WorkerKey> added) {
  // Room for everything first, for as many ranks as could be new: once a slot is freed or
  // taken, a refused allocation would leave it neither in use nor free, or numbered as if
  // every slot were in use (AlignToRanks would then write past its output).
  slot_of_.Reserve(slot_of_.size() + added.size());
  ReserveGrowing(slots_, slots_.size() + added.size());
  ReserveGrowing(free_slots_, free_slots_.size() + removed.size());
  ReserveGrowing(position_of_slot_, slots_.size() + added.size());
  size_t dropped = 0;
  for (const WorkerKey& worker : removed) dropped += DropRank(worker);
  for (const WorkerKey& worker : added) TakeSlot(worker);
  NumberPositions();
  if (!removed.empty()) MaybeShrinkTables();
  return dropped;
}

void ActiveSequences::TakeSlot(WorkerKey worker) {
  if (slot_of_.Contains(worker)) return;
  uint32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    slot = static_cast<uint32_t>(slots_.size());
    slots_.emplace_back();
  }
  slots_[slot] = Slot{.worker = worker, .in_use = true};
  Changed(slots_[slot]);  // a rank taking a dropped one's slot is not that rank
  slot_of_.Set(worker, slot);
}

size_t ActiveSequences::DropRank(WorkerKey worker) {
  const uint32_t* found = slot_of_.Find(worker);
  if (found == nullptr) return 0;
  const uint32_t slot = *found;
  const size_t dropped = requests_.EraseIf([&](std::string_view, Record* record) {
    if (record->slot != slot) return false;
    ReleaseRecord(*record);
    delete record;
    return true;
  });
  // Every run a rank holds is covered by one of its requests, so none should be left; sweep
  // anyway so a reused slot number can never inherit a stale holder.
  if (slots_[slot].active_blocks != 0) SweepSlot(slot);
  slots_[slot] = Slot{};
  free_slots_.push_back(slot);
  slot_of_.Erase(worker);
  return dropped;
}

void ActiveSequences::NumberPositions() {
  // Allocates nothing: ChangeRanks reserved a position per slot it could leave.
  position_of_slot_.clear();
  if (free_slots_.empty()) return;
  position_of_slot_.resize(slots_.size());
  uint32_t next = 0;
  for (size_t slot = 0; slot < slots_.size(); ++slot) {
    position_of_slot_[slot] = slots_[slot].in_use ? next++ : UINT32_MAX;
  }
}

bool ActiveSequences::HasWorker(WorkerKey worker) const { return slot_of_.Contains(worker); }

absl::Status ActiveSequences::AddRequest(const SequenceRequest& request) {
  if (request.request_id.empty()) {
    return absl::InvalidArgumentError("request id must not be empty");
  }
  if (requests_.Contains(request.request_id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("request id '", request.request_id, "' is already active"));
  }
  const uint32_t* found = slot_of_.Find(request.worker);
  if (found == nullptr) {
    return UnknownRankError(request.worker);
  }
  const uint32_t slot = *found;
  // A booking learnt after the fact: what its rank had queued then is unknown, and today's
  // queue is not it.
  const bool booked_now = request.booked_ago <= 0;
  const Nanos booked_ago = std::min(request.booked_ago, kLongestNanos);  // no overflow below
  // What can be refused first (the record with its id and ids, room in the table); then the
  // blocks, which book all or nothing; then nothing allocates.
  auto record = std::make_unique<Record>(Record{
      .id = request.request_id,
      .slot = slot,
      .block_ids = {request.block_ids.begin(), request.block_ids.end()},
      .prefill_tokens = request.prefill_tokens,
      .work_ahead = booked_now ? slots_[slot].active_prefill_tokens + request.prefill_tokens : 0,
      .started_at = clock_.Now() - (booked_now ? 0 : booked_ago),
      .expected_output_tokens = request.expected_output_tokens,
      .prompt_tokens = request.prompt_tokens});
  requests_.Reserve(requests_.size() + 1);
  BookBlocks(record->block_ids, slot);
  requests_.Set(record->id, record.get());
  Slot& s = slots_[slot];
  s.active_prefill_tokens += record->prefill_tokens;
  ++s.active_requests;
  Changed(s);
  oldest_started_at_ = std::min(oldest_started_at_, record->started_at);
  record.release();  // owned by requests_
  return absl::OkStatus();
}

bool ActiveSequences::MarkPrefillCompleted(std::string_view request_id) {
  Record* const* found = requests_.Find(request_id);
  if (found == nullptr || (*found)->prefill_tokens == 0) return false;
  Record& record = **found;
  Slot& s = slots_[record.slot];
  s.active_prefill_tokens -= record.prefill_tokens;
  record.prefill_tokens = 0;
  Changed(s);
  const Nanos waited = clock_.Now() - record.started_at;
  prefill_rate_.Add(static_cast<double>(record.work_ahead),
                    static_cast<double>(waited) / kNanosPerSecond);
  return true;
}

bool ActiveSequences::SetOutputTokens(std::string_view request_id, uint64_t output_tokens,
                                      uint32_t block_size) {
  Record* const* found = requests_.Find(request_id);
  if (found == nullptr || block_size == 0) return false;
  Record& record = **found;
  // Clamped so that no sum below can wrap (a caller passing UINT64_MAX for "unknown").
  const uint64_t limit = std::numeric_limits<uint64_t>::max() - record.prompt_tokens - block_size;
  output_tokens = std::min(output_tokens, limit);
  const auto blocks_of = [&](uint64_t tokens) { return (tokens + block_size - 1) / block_size; };
  const uint64_t output_blocks =
      blocks_of(record.prompt_tokens + output_tokens) - blocks_of(record.prompt_tokens);
  if (output_blocks == record.output_blocks) return false;
  Slot& s = slots_[record.slot];
  s.output_blocks = s.output_blocks - record.output_blocks + output_blocks;
  record.output_blocks = output_blocks;
  Changed(s);
  return true;
}

bool ActiveSequences::Free(std::string_view request_id) {
  const std::optional<Record*> record = requests_.Take(request_id);
  if (!record) return false;
  ReleaseRecord(**record);
  delete *record;
  MaybeShrinkTables();
  return true;
}

void ActiveSequences::ReleaseRecord(const Record& record) {
  ReleaseBlocks(record.block_ids, record.slot);
  Slot& s = slots_[record.slot];
  s.active_prefill_tokens -= record.prefill_tokens;
  s.output_blocks -= record.output_blocks;
  --s.active_requests;
  Changed(s);
}

size_t ActiveSequences::ExpireStale() {
  const Nanos now = clock_.Now();
  last_expiry_check_ = now;
  // Nothing can be due before the oldest request is: no scan (a caller's timer may ask every
  // second of a router holding 100,000 requests).
  if (requests_.empty() || now - oldest_started_at_ <= expiry_) return 0;
  Nanos oldest = std::numeric_limits<Nanos>::max();
  const size_t expired = requests_.EraseIf([&](std::string_view, Record* record) {
    if (now - record->started_at <= expiry_) {
      oldest = std::min(oldest, record->started_at);
      return false;
    }
    ReleaseRecord(*record);
    delete record;
    return true;
  });
  oldest_started_at_ = oldest;  // of those left: exact until the next add
  if (expired > 0) MaybeShrinkTables();
  return expired;
}

size_t ActiveSequences::MaybeExpire() {
  return clock_.Now() - last_expiry_check_ >= expiry_check_interval_ ? ExpireStale() : 0;
}

size_t ActiveSequences::CountRequests(absl::FunctionRef<bool(std::string_view)> pred) const {
  size_t n = 0;
  requests_.ForEach([&](std::string_view id, const Record*) { n += pred(id) ? 1 : 0; });
  return n;
}

size_t ActiveSequences::FreeIf(absl::FunctionRef<bool(std::string_view)> pred) {
  const size_t freed = requests_.EraseIf([&](std::string_view id, Record* record) {
    if (!pred(id)) return false;
    ReleaseRecord(*record);
    delete record;
    return true;
  });
  if (freed > 0) MaybeShrinkTables();
  return freed;
}

void ActiveSequences::ForEachRequest(absl::FunctionRef<bool(std::string_view)> pred,
                                     absl::FunctionRef<void(const SequenceRequest&)> visit) const {
  const Nanos now = clock_.Now();
  requests_.ForEach([&](std::string_view id, const Record* record) {
    if (!pred(id)) return;
    visit(SequenceRequest{.request_id = record->id,
                          .worker = slots_[record->slot].worker,
                          .block_ids = record->block_ids,
                          .prefill_tokens = record->prefill_tokens,
                          .expected_output_tokens = record->expected_output_tokens,
                          .prompt_tokens = record->prompt_tokens,
                          .booked_ago = now - record->started_at});
  });
}

bool ActiveSequences::HasRequest(std::string_view request_id) const {
  return requests_.Contains(request_id);
}

std::optional<WorkerKey> ActiveSequences::WorkerOf(std::string_view request_id) const {
  Record* const* found = requests_.Find(request_id);
  if (found == nullptr) return std::nullopt;
  return slots_[(*found)->slot].worker;
}

WorkerLoad ActiveSequences::LoadOf(const Slot& s) const {
  WorkerLoad load;
  LoadInto(s, prefill_rate_.tokens_per_second(), load);
  return load;
}

void ActiveSequences::LoadInto(const Slot& s, double prefill_tokens_per_second, WorkerLoad& out) {
  out.worker = s.worker;
  out.active_blocks = s.active_blocks + s.output_blocks;
  out.active_prefill_tokens = s.active_prefill_tokens;
  out.active_requests = s.active_requests;
  out.prefill_tokens_per_second = prefill_tokens_per_second;
}

WorkerLoad ActiveSequences::Load(WorkerKey worker) const {
  const uint32_t* found = slot_of_.Find(worker);
  if (found == nullptr) return WorkerLoad{.worker = worker};
  return LoadOf(slots_[*found]);
}

std::vector<WorkerLoad> ActiveSequences::Loads() const {
  std::vector<WorkerLoad> out;
  out.reserve(slot_of_.size());
  for (const Slot& s : slots_) {
    if (s.in_use) out.push_back(LoadOf(s));
  }
  return out;
}

void ActiveSequences::LoadsWithPrompt(const PotentialLoadQuery& query,
                                      std::vector<LoadWithPrompt>& out) const {
  out.clear();
  out.reserve(slot_of_.size());
  std::vector<uint32_t> depth;
  if (!query.random_identities) HeldDepthPerSlot(query.block_ids, depth);
  const size_t prompt_blocks = query.random_identities ? query.num_blocks : query.block_ids.size();
  // Written in place: a load built apart and copied in stalled on store forwarding, a tenth of
  // a 1,000-rank decision.
  const double rate = prefill_rate_.tokens_per_second();
  for (uint32_t slot = 0; slot < slots_.size(); ++slot) {
    const Slot& s = slots_[slot];
    if (!s.in_use) continue;
    LoadWithPrompt& load = out.emplace_back();
    LoadInto(s, rate, load.current);
    load.new_blocks = prompt_blocks - (depth.empty() ? 0 : depth[slot]);
    load.version = s.version;
  }
}

bool ActiveSequences::LoadUnchanged(WorkerKey worker, uint64_t version) const {
  const uint32_t* slot = slot_of_.Find(worker);
  return slot != nullptr && slots_[*slot].version == version;
}

void ActiveSequences::PotentialLoads(
    const PotentialLoadQuery& query,
    absl::FunctionRef<uint64_t(size_t position, WorkerKey worker)> cached_tokens,
    std::vector<PotentialLoad>& out) const {
  std::vector<LoadWithPrompt> loads;
  LoadsWithPrompt(query, loads);
  out.clear();
  out.reserve(loads.size());
  for (const LoadWithPrompt& load : loads) {
    uint64_t uncached = 0;
    if (query.track_prefill_tokens) {
      const uint64_t cached = cached_tokens(out.size(), load.current.worker);
      uncached = query.prompt_tokens - std::min(cached, query.prompt_tokens);
    }
    out.push_back(
        PotentialLoad{.current = load.current,
                      .new_blocks = load.new_blocks,
                      .potential_prefill_tokens = load.current.active_prefill_tokens + uncached,
                      .potential_decode_blocks = load.current.active_blocks + load.new_blocks});
  }
}

size_t ActiveSequences::TotalActiveBlocks() const {
  size_t total = 0;
  for (const Slot& s : slots_) total += s.active_blocks;
  return total;
}

template <typename OnStep>
ActiveSequences::Step ActiveSequences::Descend(std::span<const uint64_t> chain,
                                               OnStep on_step) const {
  Step last{.run = nullptr, .matched = 0, .depth = 0};
  const Run* run = root_.get();
  size_t depth = 0;
  while (depth < chain.size()) {
    Run* const* child = child_of_.Find(Edge{run, chain[depth]});
    if (child == nullptr) return last;
    Run* next = *child;
    // Compared id by id: the router's own chains are sequence hashes, where equal ids at one
    // depth mean equal prefixes and the last id alone would tell, but another replica's chains
    // are only what its messages say, and one id may follow two different prefixes there.
    // Matching the whole run is the common case: std::equal of ids is a memcmp.
    const size_t limit = std::min(next->ids.size(), chain.size() - depth);
    const auto chain_part = chain.subspan(depth, limit);
    size_t matched = limit;
    if (!std::equal(chain_part.begin(), chain_part.end(), next->ids.begin())) {
      matched = static_cast<size_t>(
          std::mismatch(chain_part.begin(), chain_part.end(), next->ids.begin()).first -
          chain_part.begin());
    }
    depth += matched;
    last = Step{.run = next, .matched = matched, .depth = depth};
    on_step(last);
    if (matched < next->ids.size()) return last;
    run = next;
  }
  return last;
}

void ActiveSequences::Walk(std::span<const uint64_t> chain, Path& path) const {
  path.clear();
  Descend(chain, [&path](const Step& step) { path.push_back(step); });
}

void ActiveSequences::HeldDepthPerSlot(std::span<const uint64_t> chain,
                                       std::vector<uint32_t>& depth) const {
  depth.assign(slots_.size(), 0);
  Path path;
  Walk(chain, path);
  // A run's holders hold every run above it, so the deepest run a slot holds gives its depth.
  for (const Step& step : path) {
    for (const Holder& h : step.run->holders) depth[h.slot] = static_cast<uint32_t>(step.depth);
  }
}

void ActiveSequences::BookBlocks(std::span<const uint64_t> chain, uint32_t slot) {
  if (chain.empty()) return;
  Path path;
  Walk(chain, path);
  Run* end = root_.get();
  size_t depth = 0;
  // The chain ends or leaves the trie inside this run: it is split there, so that a run is
  // always covered entirely or not at all by each request.
  Run* split = nullptr;
  if (!path.empty()) {
    const Step& last = path.back();
    if (last.matched < last.run->ids.size()) split = last.run;
    end = last.run;
    depth = last.depth;
  }
  const bool extend = depth < chain.size();

  // Everything the booking needs is allocated first: new runs, room in the lists and tables
  // they join, room for this rank among each run's holders. A refused allocation here leaves
  // the trie as it was; nothing below this block allocates.
  std::unique_ptr<Run> upper;
  if (split != nullptr) {
    upper = std::make_unique<Run>();
    const auto keep = static_cast<ptrdiff_t>(path.back().matched);
    upper->ids.assign(split->ids.begin(), split->ids.begin() + keep);
    upper->holders = split->holders;
    upper->children.reserve(extend ? 2 : 1);
  }
  std::unique_ptr<Run> added;
  if (extend) {
    added = std::make_unique<Run>();
    added->ids.assign(chain.begin() + static_cast<ptrdiff_t>(depth), chain.end());
    if (split == nullptr && end->children.size() == end->children.capacity()) {
      end->children.reserve(std::max<size_t>(4, 2 * end->children.capacity()));
    }
  }
  child_of_.Reserve(child_of_.size() + (split != nullptr ? 1 : 0) + (extend ? 1 : 0));
  // This rank's holder in each run of the path (the split run's upper part in its place), or
  // null where it is new and room is made for it: each run's holders are scanned once.
  absl::InlinedVector<Holder*, 8> held;
  held.reserve(path.size());
  for (const Step& step : path) {
    Run* run = step.run == split ? upper.get() : step.run;
    Holder* holder = FindHolder(run, slot);
    if (holder == nullptr) run->holders.reserve(run->holders.size() + 1);
    held.push_back(holder);
  }

  if (split != nullptr) {
    end = Split(split, path.back().matched, std::move(upper));
    path.back().run = end;
  }
  for (size_t i = 0; i < path.size(); ++i) AddHolder(path[i].run, slot, held[i]);
  if (extend) AddHolder(AddRun(end, std::move(added)), slot, nullptr);
}

void ActiveSequences::ReleaseBlocks(std::span<const uint64_t> chain, uint32_t slot) {
  if (chain.empty()) return;
  // Up from the chain's last run by parent links: no path to allocate.
  Run* const last = Descend(chain, [](const Step&) {}).run;
  if (last == nullptr) return;
  Run* const root = root_.get();
  for (Run* run = last; run != root; run = run->parent) RemoveHolder(run, slot);
  // Runs no request covers any more go, deepest first.
  Run* run = last;
  while (run != root && run->holders.empty() && run->children.empty()) {
    Run* parent = run->parent;
    DeleteRun(run);
    run = parent;
  }
  // This request may have been the reason a run was split: join what no longer differs.
  // Deepest first, because merging a run into its parent destroys it.
  while (run != root) {
    Run* parent = run->parent;
    MergeSingleChild(run);
    run = parent;
  }
}

ActiveSequences::Run* ActiveSequences::Split(Run* run, size_t keep, std::unique_ptr<Run> upper) {
  // The upper part takes the run's place under its parent (the same first id: its entry in
  // child_of_ is rewritten, not added); the run itself becomes the lower part (its children
  // stay keyed by it). Both keep the same holders: every request covering the run covers both
  // parts.
  Run* parent = run->parent;
  upper->parent = parent;
  Run* up = upper.get();
  auto& owned = parent->children[PlaceAmongSiblings(run)];
  std::unique_ptr<Run> lower = std::move(owned);
  owned = std::move(upper);
  child_of_.Set(Edge{parent, up->ids[0]}, up);
  lower->ids.erase(lower->ids.begin(), lower->ids.begin() + static_cast<ptrdiff_t>(keep));
  lower->parent = up;
  child_of_.Set(Edge{up, lower->ids[0]}, lower.get());
  up->children.push_back(std::move(lower));
  return up;
}

ActiveSequences::Run* ActiveSequences::AddRun(Run* parent, std::unique_ptr<Run> run) {
  run->parent = parent;
  Run* added = run.get();
  child_of_.Set(Edge{parent, added->ids[0]}, added);
  parent->children.push_back(std::move(run));
  stored_blocks_ += added->ids.size();
  return added;
}

void ActiveSequences::DeleteRun(Run* run) {
  Run* parent = run->parent;
  child_of_.Erase(Edge{parent, run->ids[0]});
  stored_blocks_ -= run->ids.size();
  auto& owned = parent->children[PlaceAmongSiblings(run)];
  owned = std::move(parent->children.back());
  parent->children.pop_back();  // destroys `run`
}

void ActiveSequences::MergeSingleChild(Run* run) {
  const auto same_holders = [](const Run& a, const Run& b) {
    if (a.holders.size() != b.holders.size()) return false;
    return std::all_of(a.holders.begin(), a.holders.end(), [&b](const Holder& h) {
      return std::any_of(b.holders.begin(), b.holders.end(), [&h](const Holder& x) {
        return x.slot == h.slot && x.requests == h.requests;
      });
    });
  };
  // Equal holders mean no request ends between the two runs and nothing branches off: they are
  // one run again. Each holder's block count is unchanged.
  while (run != root_.get() && run->children.size() == 1 && same_holders(*run, *run->children[0])) {
    // Room for the child's ids first. Refused, the two runs stay apart: the trie allows that
    // (merging only saves memory), and a release must not fail.
    try {
      run->ids.reserve(run->ids.size() + run->children[0]->ids.size());
    } catch (const std::bad_alloc&) {
      return;
    }
    std::unique_ptr<Run> child = std::move(run->children[0]);
    child_of_.Erase(Edge{run, child->ids[0]});
    run->ids.insert(run->ids.end(), child->ids.begin(), child->ids.end());
    // Each new edge follows an erased one, so child_of_ does not grow.
    for (auto& grandchild : child->children) {
      child_of_.Erase(Edge{child.get(), grandchild->ids[0]});
      child_of_.Set(Edge{run, grandchild->ids[0]}, grandchild.get());
      grandchild->parent = run;
    }
    run->children = std::move(child->children);
  }
}

ActiveSequences::Holder* ActiveSequences::FindHolder(Run* run, uint32_t slot) {
  for (Holder& h : run->holders) {
    if (h.slot == slot) return &h;
  }
  return nullptr;
}

void ActiveSequences::AddHolder(Run* run, uint32_t slot, Holder* held) {
  if (held != nullptr) {
    ++held->requests;
    return;
  }
  run->holders.push_back(Holder{.slot = slot, .requests = 1});
  slots_[slot].active_blocks += run->ids.size();
}

void ActiveSequences::RemoveHolder(Run* run, uint32_t slot) {
  for (Holder& h : run->holders) {
    if (h.slot != slot) continue;
    if (--h.requests == 0) {
      slots_[slot].active_blocks -= run->ids.size();
      h = run->holders.back();
      run->holders.pop_back();
    }
    return;
  }
}

void ActiveSequences::SweepSlot(uint32_t slot) {
  // Every run after its subtree (children last to first), without a stack: a rank's removal
  // must not allocate. A run is found again from its parent by its place among the siblings;
  // a deleted run's place is taken by the last sibling, which was already visited.
  Run* const root = root_.get();
  const auto deepest_last = [](Run* run) {
    while (!run->children.empty()) run = run->children.back().get();
    return run;
  };
  Run* run = deepest_last(root);
  while (run != root) {
    Run* const parent = run->parent;
    const size_t place = PlaceAmongSiblings(run);
    auto& holders = run->holders;
    holders.erase(std::remove_if(holders.begin(), holders.end(),
                                 [slot](const Holder& h) { return h.slot == slot; }),
                  holders.end());
    if (run->holders.empty() && run->children.empty()) DeleteRun(run);
    run = place > 0 ? deepest_last(parent->children[place - 1].get()) : parent;
  }
  slots_[slot].active_blocks = 0;
}

size_t ActiveSequences::PlaceAmongSiblings(const Run* run) {
  const auto& siblings = run->parent->children;
  return static_cast<size_t>(
      std::find_if(siblings.begin(), siblings.end(),
                   [run](const std::unique_ptr<Run>& c) { return c.get() == run; }) -
      siblings.begin());
}

void ActiveSequences::MaybeShrinkTables() {
  // Neither throws: a refused allocation keeps the larger table.
  child_of_.ShrinkIfMostlyEmpty(kMinCapacityToShrink);
  requests_.ShrinkIfMostlyEmpty(kMinCapacityToShrink);
}

uint64_t ActiveSequences::StateDigest() const {
  // Sums of per-item hashes, so the hash tables' iteration order does not matter.
  uint64_t requests = 0;
  requests_.ForEach([&](std::string_view, const Record* r) {
    requests +=
        absl::HashOf(r->id, slots_[r->slot].worker, r->block_ids, r->prefill_tokens, r->started_at,
                     r->expected_output_tokens, r->prompt_tokens, r->output_blocks);
  });
  uint64_t ranks = 0;
  slot_of_.ForEach([&](WorkerKey worker, uint32_t slot) {
    const Slot& s = slots_[slot];
    ranks += absl::HashOf(worker, s.active_blocks, s.active_prefill_tokens, s.active_requests,
                          s.output_blocks);
  });
  return absl::HashOf(requests, ranks, requests_.size(), stored_blocks_);
}

}  // namespace kvrouter
