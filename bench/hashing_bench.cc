// Block hashing throughput for one long prompt (aim: >= 10 GB/s of token bytes).
//
// The prompt is 8,192 random tokens: at block size 16 that is 512 local hashes of 64 bytes
// each, the shape every stored event with token ids and every routing request pays for.
// Bytes processed = token bytes (4 per token), so Google Benchmark prints GB/s directly.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "core/hashing.h"

namespace kvrouter::bench {
namespace {

constexpr size_t kPromptTokens = 8192;

std::vector<uint32_t> RandomPrompt(size_t n) {
  std::mt19937 rng(42);  // fixed seed: the same prompt on every run
  std::vector<uint32_t> tokens(n);
  for (uint32_t& t : tokens) t = rng() % 152000;  // a Qwen-sized vocabulary
  return tokens;
}

void SetThroughput(benchmark::State& state, size_t tokens, uint32_t block_size) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * tokens * sizeof(uint32_t)));
  state.counters["blocks/s"] = benchmark::Counter(
      static_cast<double>(state.iterations() * (tokens / block_size)), benchmark::Counter::kIsRate);
}

// Local hashes only: what a stored event with token ids costs before the index is touched.
void BM_LocalBlockHashes(benchmark::State& state) {
  const auto block_size = static_cast<uint32_t>(state.range(0));
  const std::vector<uint32_t> prompt = RandomPrompt(kPromptTokens);
  std::vector<uint64_t> local;
  for (auto _ : state) {
    ComputeLocalBlockHashesInto(prompt, block_size, {}, local);
    benchmark::DoNotOptimize(local.data());
    benchmark::ClobberMemory();
  }
  SetThroughput(state, kPromptTokens, block_size);
}

// Local then sequence hashes: what a routing request costs (approximate mode needs both).
void BM_LocalAndSequenceHashes(benchmark::State& state) {
  const auto block_size = static_cast<uint32_t>(state.range(0));
  const std::vector<uint32_t> prompt = RandomPrompt(kPromptTokens);
  std::vector<uint64_t> local;
  std::vector<uint64_t> sequence;
  for (auto _ : state) {
    ComputeLocalBlockHashesInto(prompt, block_size, {}, local);
    ComputeSequenceHashesInto(local, sequence);
    benchmark::DoNotOptimize(sequence.data());
    benchmark::ClobberMemory();
  }
  SetThroughput(state, kPromptTokens, block_size);
}

// Sequence chaining alone (16 bytes hashed per block), to split the cost of the line above.
void BM_SequenceHashesOnly(benchmark::State& state) {
  const auto block_size = static_cast<uint32_t>(state.range(0));
  const std::vector<uint32_t> prompt = RandomPrompt(kPromptTokens);
  std::vector<uint64_t> local = ComputeLocalBlockHashes(prompt, block_size);
  std::vector<uint64_t> sequence;
  for (auto _ : state) {
    ComputeSequenceHashesInto(local, sequence);
    benchmark::DoNotOptimize(sequence.data());
    benchmark::ClobberMemory();
  }
  SetThroughput(state, kPromptTokens, block_size);
}

// 16 = vLLM's default block size (the aim is stated for it); 64 = Dynamo's published runs.
BENCHMARK(BM_LocalBlockHashes)->Arg(16)->Arg(64);
BENCHMARK(BM_LocalAndSequenceHashes)->Arg(16)->Arg(64);
BENCHMARK(BM_SequenceHashesOnly)->Arg(16);

}  // namespace
}  // namespace kvrouter::bench

BENCHMARK_MAIN();
