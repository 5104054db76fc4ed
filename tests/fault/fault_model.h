// The fault tests' model of one engine rank's KV cache, shared by the publisher process
// (fault_publisher.cc, which keeps its true state with it and draws its next messages from it)
// and the tests (fault_test.cc, which rebuild a killed publisher's state from its journal).
//
// A cache is a forest of blocks named by engine hash, each with its parent. An engine stores a
// run of new blocks (a new prompt, or one continuing a block it holds) and evicts leaves, as a
// prefix cache does; a clear drops everything. Block contents (tokens) follow from the hash, and
// hashes from the engine process's generation and a counter, so a restarted engine (a new
// generation) never publishes a block of the old one.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace kvr_fault {

inline constexpr uint32_t kBlockSize = 16;

inline uint64_t Mix(uint64_t x) {  // SplitMix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The engine hash of generation `generation`'s n-th block (never 0).
inline uint64_t BlockHash(uint64_t generation, uint64_t n) {
  return Mix((generation << 40) ^ n) | 1;
}

// The block's tokens: kBlockSize ids in 1..50000, a function of its hash.
inline std::vector<uint32_t> BlockTokens(uint64_t hash) {
  std::vector<uint32_t> tokens(kBlockSize);
  for (uint32_t i = 0; i < kBlockSize; ++i) {
    tokens[i] = static_cast<uint32_t>(1 + Mix(hash + 0x1000 * (i + 1)) % 50000);
  }
  return tokens;
}

struct Event {
  enum class Kind : char { kStored = 'S', kRemoved = 'R', kCleared = 'C' };
  Kind kind = Kind::kCleared;
  uint64_t parent = 0;  // kStored: the held block the run continues; 0 = none
  std::vector<uint64_t> hashes;
};
using Message = std::vector<Event>;

// A message as one line of text: events separated by ';', "S:<parent>:<h>,<h>", "R:<h>,<h>",
// "C". The publisher's journal holds one per line after its sequence number.
inline std::string Encode(const Message& message) {
  std::string out;
  for (const Event& e : message) {
    if (!out.empty()) out += ';';
    out += static_cast<char>(e.kind);
    if (e.kind == Event::Kind::kStored) out += ":" + std::to_string(e.parent);
    if (e.kind != Event::Kind::kCleared) {
      out += ':';
      for (size_t i = 0; i < e.hashes.size(); ++i) {
        if (i > 0) out += ',';
        out += std::to_string(e.hashes[i]);
      }
    }
  }
  return out;
}

inline Message Decode(std::string_view text) {
  Message out;
  while (!text.empty()) {
    const size_t end = std::min(text.find(';'), text.size());
    std::string_view item = text.substr(0, end);
    text.remove_prefix(std::min(end + 1, text.size()));
    if (item.empty()) continue;
    Event e;
    e.kind = static_cast<Event::Kind>(item[0]);
    item.remove_prefix(std::min<size_t>(2, item.size()));
    auto number = [&] {
      size_t used = 0;
      const uint64_t v = std::stoull(std::string(item), &used);
      item.remove_prefix(std::min(used + 1, item.size()));
      return v;
    };
    if (e.kind == Event::Kind::kStored) e.parent = number();
    while (e.kind != Event::Kind::kCleared && !item.empty()) e.hashes.push_back(number());
    out.push_back(std::move(e));
  }
  return out;
}

class Cache {
 public:
  void Apply(const Event& e) {
    switch (e.kind) {
      case Event::Kind::kCleared:
        blocks_.clear();
        return;
      case Event::Kind::kStored: {
        uint64_t parent = e.parent;
        for (uint64_t h : e.hashes) {
          if (auto it = blocks_.find(parent); it != blocks_.end()) ++it->second.children;
          blocks_[h] = Block{parent, 0};
          parent = h;
        }
        return;
      }
      case Event::Kind::kRemoved:
        for (uint64_t h : e.hashes) {
          auto it = blocks_.find(h);
          if (it == blocks_.end()) continue;
          if (auto p = blocks_.find(it->second.parent); p != blocks_.end()) --p->second.children;
          blocks_.erase(it);
        }
        return;
    }
  }
  void Apply(const Message& message) {
    for (const Event& e : message) Apply(e);
  }

  std::set<uint64_t> Hashes() const {
    std::set<uint64_t> out;
    for (const auto& [h, b] : blocks_) out.insert(h);
    return out;
  }
  size_t size() const { return blocks_.size(); }

  // Every held block as stored events, parents first: the cache's whole state, for a
  // publisher that re-announces it after a clear.
  Message AsStores() const {
    Message out;
    std::map<uint64_t, std::vector<uint64_t>> children;
    for (const auto& [h, b] : blocks_) children[b.parent].push_back(h);
    std::vector<uint64_t> stack(children[0].rbegin(), children[0].rend());
    while (!stack.empty()) {
      const uint64_t h = stack.back();
      stack.pop_back();
      out.push_back(Event{Event::Kind::kStored, blocks_.at(h).parent, {h}});
      const auto& kids = children[h];
      stack.insert(stack.end(), kids.rbegin(), kids.rend());
    }
    return out;
  }

  // The engine's next message (1 to 3 events), drawn from `rng`; new blocks are numbered from
  // `counter` in `generation`. Applies nothing.
  Message Next(std::mt19937_64& rng, uint64_t generation, uint64_t& counter) const {
    Cache scratch = *this;
    Message out;
    const int events = 1 + static_cast<int>(rng() % 3);
    for (int i = 0; i < events; ++i) {
      std::vector<uint64_t> leaves;
      for (const auto& [h, b] : scratch.blocks_) {
        if (b.children == 0) leaves.push_back(h);
      }
      // Stores until the cache holds a few hundred blocks, evictions past that.
      const bool store = leaves.empty() || rng() % 100 < (scratch.size() > 300 ? 30u : 60u);
      Event e;
      if (store) {
        e.kind = Event::Kind::kStored;
        if (!scratch.blocks_.empty() && rng() % 2 == 0) {
          auto it = scratch.blocks_.begin();
          std::advance(it, static_cast<long>(rng() % scratch.blocks_.size()));
          e.parent = it->first;
        }
        const int n = 1 + static_cast<int>(rng() % 4);
        for (int b = 0; b < n; ++b) e.hashes.push_back(BlockHash(generation, counter++));
      } else {
        e.kind = Event::Kind::kRemoved;
        const int n = 1 + static_cast<int>(rng() % 3);
        for (int b = 0; b < n && !leaves.empty(); ++b) {
          const size_t pick = rng() % leaves.size();
          e.hashes.push_back(leaves[pick]);
          leaves.erase(leaves.begin() + static_cast<long>(pick));
        }
      }
      scratch.Apply(e);
      out.push_back(std::move(e));
    }
    return out;
  }

 private:
  struct Block {
    uint64_t parent = 0;
    uint32_t children = 0;
  };
  std::map<uint64_t, Block> blocks_;
};

}  // namespace kvr_fault
