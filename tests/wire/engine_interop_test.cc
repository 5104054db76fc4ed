// What the real engines publish, and what their own prefix caches then hit, against what the
// index answers (issue 13). The payloads are built here the way the engines' msgspec encoders
// lay them out (array_like events, smallest integer forms, float64 timestamps), from the
// layouts in their sources:
// - vLLM 0.32/0.33 (vllm/distributed/kv_events.py): BlockStored = [tag, block_hashes,
//   parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
//   group_idx, ...]; the offloading connector's copies are [tag, hashes, nil, [], 0 or the
//   block size, nil, "CPU", nil]; extra_keys per block = (lora name, (mm identifier, offset)...,
//   cache salt on a request's first block only, prompt-embedding digests).
// - SGLang (python/sglang/srt/disaggregation/kv_events.py, mem_cache radix/recorder):
//   BlockStored = [tag, hashes, parent, token_ids, block_size, lora_id, medium]; a salted one
//   (BlockStoredWithMetadata) appends {"cache_salt": salt}; EAGLE's bigram keys publish
//   token_ids as [[t0, t1], [t1, t2], ...] with block_size = pairs per page.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "core/hashing.h"
#include "core/radix_index.h"
#include "wire/engine_events.h"

namespace kvrouter {
namespace {

// ---- A minimal msgpack writer (the forms msgspec emits) -----------------------------------

class Pack {
 public:
  Pack& Array(uint32_t n) { return Header(n, 0x90, 0xdc, 0xdd, 15); }
  Pack& Map(uint32_t n) { return Header(n, 0x80, 0xde, 0xdf, 15); }
  Pack& Nil() { return Byte(0xc0); }
  Pack& Float(double v) {
    uint64_t bits;
    std::memcpy(&bits, &v, 8);
    Byte(0xcb);
    return Be(bits, 8);
  }
  Pack& Uint(uint64_t v) {
    if (v < 128) return Byte(static_cast<uint8_t>(v));
    if (v <= 0xff) return Byte(0xcc).Be(v, 1);
    if (v <= 0xffff) return Byte(0xcd).Be(v, 2);
    if (v <= 0xffffffff) return Byte(0xce).Be(v, 4);
    return Byte(0xcf).Be(v, 8);
  }
  Pack& Int(int64_t v) {
    if (v >= 0) return Uint(static_cast<uint64_t>(v));
    if (v >= -32) return Byte(static_cast<uint8_t>(v));
    return Byte(0xd3).Be(static_cast<uint64_t>(v), 8);
  }
  Pack& Str(const std::string& s) {
    if (s.size() < 32) {
      Byte(static_cast<uint8_t>(0xa0 | s.size()));
    } else {
      Byte(0xd9).Be(s.size(), 1);
    }
    bytes_.insert(bytes_.end(), s.begin(), s.end());
    return *this;
  }
  Pack& Uints(const std::vector<uint64_t>& v) {
    Array(static_cast<uint32_t>(v.size()));
    for (uint64_t x : v) Uint(x);
    return *this;
  }
  Pack& Tokens(const std::vector<uint32_t>& v) {
    Array(static_cast<uint32_t>(v.size()));
    for (uint32_t x : v) Uint(x);
    return *this;
  }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  Pack& Byte(uint8_t b) {
    bytes_.push_back(b);
    return *this;
  }
  Pack& Be(uint64_t v, int n) {
    for (int i = n - 1; i >= 0; --i) bytes_.push_back(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  Pack& Header(uint32_t n, uint8_t fix, uint8_t b16, uint8_t b32, uint32_t fix_max) {
    if (n <= fix_max) return Byte(static_cast<uint8_t>(fix | n));
    if (n <= 0xffff) return Byte(b16).Be(n, 2);
    return Byte(b32).Be(n, 4);
  }
  std::vector<uint8_t> bytes_;
};

std::vector<uint32_t> Iota(uint32_t first, uint32_t count) {
  std::vector<uint32_t> out(count);
  for (uint32_t i = 0; i < count; ++i) out[i] = first + i;
  return out;
}

// An outer batch [ts, events, dp_rank 0] around `n` events written by `events`.
template <typename F>
std::vector<uint8_t> Batch(uint32_t n, F events) {
  Pack p;
  p.Array(3).Float(1750000000.25).Array(n);
  events(p);
  p.Uint(0);
  return p.bytes();
}

// vLLM 0.32/0.33 BlockStored through group_idx; `extra_keys` writes the extra_keys field.
template <typename F>
void VllmStored(Pack& p, const std::vector<uint64_t>& hashes, std::optional<uint64_t> parent,
                const std::vector<uint32_t>& tokens, uint32_t block_size, const std::string& medium,
                std::optional<std::string> lora_name, F extra_keys) {
  p.Array(10).Str("BlockStored").Uints(hashes);
  parent ? p.Uint(*parent) : p.Nil();
  p.Tokens(tokens).Uint(block_size).Nil().Str(medium);
  lora_name ? p.Str(*lora_name) : p.Nil();
  extra_keys(p);
  p.Uint(0);  // group_idx
}
void NoExtraKeys(Pack& p) { p.Nil(); }

void VllmRemoved(Pack& p, const std::vector<uint64_t>& hashes, const std::string& medium) {
  p.Array(4).Str("BlockRemoved").Uints(hashes).Str(medium).Uint(0);
}

// Decodes, converts and applies one payload as worker 1's rank 0 (router block size 16).
void Ingest(RadixIndex& index, const std::vector<uint8_t>& payload, SaltedBlocks* salted = nullptr,
            bool eagle = false) {
  auto batch = DecodeEnginePayload(payload);
  ASSERT_TRUE(batch.ok()) << batch.status();
  const ConvertedBatch converted = ToKvEvents(*batch, 1, 0, 16, eagle, 1, salted);
  ASSERT_TRUE(converted.block_size_mismatches.empty());
  for (const KvEvent& e : converted.events) {
    const ApplyResult r = index.Apply(e);
    ASSERT_TRUE(r.ok()) << r.message;
  }
}

constexpr WorkerKey kWorker{1, 0};

// Per tier, how much of the prompt worker 1 holds: {device, host, disk, external}; all zero if
// it is not reported.
std::vector<uint32_t> Held(const RadixIndex& index, const std::vector<uint32_t>& prompt,
                           const BlockHashOptions& options = {}) {
  const auto matches = index.FindMatches(ComputeLocalBlockHashes(prompt, 16, options));
  for (const WorkerMatch& m : matches) {
    if (m.worker == kWorker) {
      return {m.device_blocks, m.host_hits, m.disk_hits, m.external_hits};
    }
  }
  return {0, 0, 0, 0};
}
const std::vector<uint32_t> kNone = {0, 0, 0, 0};

// ---- (a) Offloaded media and per-tier membership ------------------------------------------

// vLLM with the offloading connector: blocks stored on the GPU, copied to the CPU (a store
// that names the copies by hash, with no tokens and block size 0), evicted from the CPU. The
// GPU still holds them, and so must the index.
TEST(VllmOffload, ACopyRemovedFromTheCpuStaysOnTheDevice) {
  RadixIndex index;
  const auto prompt = Iota(1001, 32);
  Ingest(index, Batch(1, [&](Pack& p) {
           VllmStored(p, {7001, 7002}, std::nullopt, prompt, 16, "GPU", std::nullopt, NoExtraKeys);
         }));
  EXPECT_EQ(Held(index, prompt), (std::vector<uint32_t>{2, 0, 0, 0}));

  Ingest(index, Batch(1, [&](Pack& p) {
           p.Array(8).Str("BlockStored").Uints({7001, 7002}).Nil().Array(0).Uint(0).Nil();
           p.Str("CPU").Nil();
         }));
  Ingest(index, Batch(1, [&](Pack& p) { VllmRemoved(p, {7001, 7002}, "CPU"); }));
  EXPECT_EQ(Held(index, prompt), (std::vector<uint32_t>{2, 0, 0, 0}));

  // Copied again (this time with the block size set), then evicted from the GPU: the CPU
  // copies remain, on the host tier.
  Ingest(index, Batch(1, [&](Pack& p) {
           p.Array(8).Str("BlockStored").Uints({7001, 7002}).Nil().Array(0).Uint(16).Nil();
           p.Str("CPU").Nil();
         }));
  Ingest(index, Batch(1, [&](Pack& p) { VllmRemoved(p, {7002}, "GPU"); }));
  EXPECT_EQ(Held(index, prompt), (std::vector<uint32_t>{1, 1, 0, 0}));
  Ingest(index, Batch(1, [&](Pack& p) { VllmRemoved(p, {7001}, "GPU"); }));
  EXPECT_EQ(Held(index, prompt), (std::vector<uint32_t>{0, 2, 0, 0}));
}

// Self-describing copies (tokens and parent given) and vLLM's storage tier: each medium lands
// on its own tier, and a removal names one.
TEST(VllmOffload, CpuAndStorageMediaAreLowerTiers) {
  RadixIndex index;
  const auto prompt = Iota(1, 48);
  Ingest(
      index, Batch(3, [&](Pack& p) {
        VllmStored(p, {11, 12}, std::nullopt, Iota(1, 32), 16, "GPU", std::nullopt, NoExtraKeys);
        VllmStored(p, {11, 12, 13}, std::nullopt, prompt, 16, "CPU", std::nullopt, NoExtraKeys);
        VllmStored(p, {11, 12, 13}, std::nullopt, prompt, 16, "STORAGE", std::nullopt, NoExtraKeys);
      }));
  EXPECT_EQ(Held(index, prompt), (std::vector<uint32_t>{2, 1, 0, 0}));
  Ingest(index, Batch(1, [&](Pack& p) { VllmRemoved(p, {13}, "CPU"); }));
  EXPECT_EQ(Held(index, prompt), (std::vector<uint32_t>{2, 0, 1, 0}));
  Ingest(index, Batch(1, [&](Pack& p) { VllmRemoved(p, {11, 12}, "GPU"); }));
  EXPECT_EQ(Held(index, prompt), (std::vector<uint32_t>{0, 2, 1, 0}));
}

// ---- (b) Cache salts and multimodal extra keys partition the index ------------------------

// vLLM puts the salt in the first block's extra keys only; a later store continuing the same
// request carries none. The engine's hashes are salted all along the chain, so the whole
// sequence, continuation included, is a salted one: an unsalted prompt must not match it.
TEST(VllmSalt, SaltedSequencesMatchOnlySaltedPrompts) {
  RadixIndex index;
  SaltedBlocks salted;
  const auto prompt = Iota(1, 48);
  Ingest(index,
         Batch(1,
               [&](Pack& p) {
                 VllmStored(p, {21, 22}, std::nullopt, Iota(1, 32), 16, "GPU", std::nullopt,
                            [](Pack& q) { q.Array(2).Array(1).Str("tenant-a").Nil(); });
               }),
         &salted);
  Ingest(index,
         Batch(1,
               [&](Pack& p) {
                 VllmStored(p, {23}, 22, Iota(33, 16), 16, "GPU", std::nullopt, NoExtraKeys);
               }),
         &salted);
  EXPECT_EQ(Held(index, prompt), kNone);
  EXPECT_EQ(Held(index, prompt, {.cache_namespace = "tenant-b"}), kNone);
  EXPECT_EQ(Held(index, prompt, {.cache_namespace = "tenant-a"}),
            (std::vector<uint32_t>{3, 0, 0, 0}));

  // With a LoRA adapter its name comes first in the tuple; a salt may even equal it.
  Ingest(index,
         Batch(1,
               [&](Pack& p) {
                 VllmStored(p, {31}, std::nullopt, Iota(1, 16), 16, "GPU", "sql",
                            [](Pack& q) { q.Array(1).Array(2).Str("sql").Str("sql"); });
               }),
         &salted);
  EXPECT_EQ(Held(index, Iota(1, 16), {.lora_name = "sql"}), kNone);
  EXPECT_EQ(Held(index, Iota(1, 16), {.lora_name = "sql", .cache_namespace = "sql"}),
            (std::vector<uint32_t>{1, 0, 0, 0}));
}

// vLLM 0.19+ names a block's multimodal items as [identifier, offset]; the identifier enters
// that block's hash (and, through the chain, every later one's). A prompt matches only with
// the same item, given as Dynamo's routing hash of the identifier.
TEST(VllmMultimodal, ExtraKeysPartitionBlocksByTheirItems) {
  RadixIndex index;
  const std::string image(64, 'a');  // vLLM's own identifiers are sha256 hex digests
  Ingest(index, Batch(1, [&](Pack& p) {
           VllmStored(p, {41, 42}, std::nullopt, Iota(1, 32), 16, "GPU", std::nullopt,
                      [&](Pack& q) { q.Array(2).Array(1).Array(2).Str(image).Uint(3).Nil(); });
         }));
  const auto prompt = Iota(1, 32);
  EXPECT_EQ(Held(index, prompt), kNone);
  const std::vector<std::vector<uint64_t>> mm = {{0xaaaaaaaaaaaaaaaau}};
  EXPECT_EQ(MmHashOfIdentifier(image).value_or(0), 0xaaaaaaaaaaaaaaaau);
  EXPECT_EQ(Held(index, prompt, {.block_mm_hashes = mm}), (std::vector<uint32_t>{2, 0, 0, 0}));
  // Opaque identifiers (external renderers) hash with XXH3-64.
  const std::string opaque = "renderer-image-0";
  EXPECT_EQ(MmHashOfIdentifier(opaque).value_or(0),
            HashBytes({reinterpret_cast<const uint8_t*>(opaque.data()), opaque.size()}, 0));
}

// SGLang keys its radix tree by (salt, tokens) and publishes every page of a salted request
// with {"cache_salt": salt}: after medium up to 0.5.x, after the whole vLLM-shaped tuple (and
// tagged in extra_keys too) later.
TEST(SglangSalt, SaltedPagesMatchOnlySaltedPrompts) {
  RadixIndex index;
  Ingest(index, Batch(2, [&](Pack& p) {
           p.Array(8).Str("BlockStored").Array(1).Int(-5).Nil().Tokens(Iota(1, 16)).Uint(16);
           p.Nil().Str("GPU").Map(1).Str("cache_salt").Str("tenant-a");
           p.Array(15).Str("BlockStored").Array(1).Int(-6).Int(-5).Tokens(Iota(17, 16)).Uint(16);
           p.Nil().Str("GPU").Nil().Array(1).Array(1).Str("dynamo-cache-salt:tenant-a");
           for (int i = 0; i < 5; ++i) p.Nil();
           p.Map(1).Str("cache_salt").Str("tenant-a");
         }));
  const auto prompt = Iota(1, 32);
  EXPECT_EQ(Held(index, prompt), kNone);
  EXPECT_EQ(Held(index, prompt, {.cache_namespace = "tenant-a"}),
            (std::vector<uint32_t>{2, 0, 0, 0}));
}

// ---- (c) SGLang EAGLE bigram pages ---------------------------------------------------------

TEST(SglangEagle, BigramPagesAreEagleWindows) {
  RadixIndex index;
  const auto tokens = Iota(100, 33);  // two pages of 16 bigrams: 33 tokens
  Ingest(index, Batch(2, [&](Pack& p) {
           for (int page = 0; page < 2; ++page) {
             p.Array(7).Str("BlockStored").Array(1).Int(-50 - page);
             page == 0 ? p.Nil() : p.Int(-50);
             p.Array(16);
             for (int i = 0; i < 16; ++i) {
               p.Array(2).Uint(tokens[page * 16 + i]).Uint(tokens[page * 16 + i + 1]);
             }
             p.Uint(16).Nil().Str("GPU");
           }
         }));
  EXPECT_EQ(Held(index, tokens, {.eagle = true}), (std::vector<uint32_t>{2, 0, 0, 0}));
  EXPECT_EQ(Held(index, tokens), kNone);

  // Pairs that do not overlap are not bigram pages.
  Pack bad;
  bad.Array(3).Float(0).Array(1).Array(7).Str("BlockStored").Array(1).Uint(1).Nil();
  bad.Array(2).Array(2).Uint(1).Uint(2).Array(2).Uint(3).Uint(4).Uint(2).Nil().Str("GPU");
  bad.Uint(0);
  EXPECT_FALSE(DecodeEnginePayload(bad.bytes()).ok());
}

// ---- (d) Page size 1 -----------------------------------------------------------------------

TEST(SglangPageSize, TheRejectSaysHowToRunSglang) {
  auto batch = DecodeEnginePayload(Batch(1, [&](Pack& p) {
    p.Array(7).Str("BlockStored").Array(1).Uint(9).Nil().Tokens({5}).Uint(1).Nil().Str("GPU");
  }));
  ASSERT_TRUE(batch.ok());
  const ConvertedBatch c = ToKvEvents(*batch, 1, 0, 16, false, 1);
  EXPECT_TRUE(c.events.empty());
  ASSERT_EQ(1u, c.block_size_mismatches.size());
  EXPECT_NE(std::string::npos, c.block_size_mismatches[0].reason.find("--page-size 16"))
      << c.block_size_mismatches[0].reason;
}

}  // namespace
}  // namespace kvrouter
