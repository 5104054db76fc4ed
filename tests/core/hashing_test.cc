#include "core/hashing.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "test_data.h"

namespace kvrouter {
namespace {

uint64_t U64(const nlohmann::json& j) {
  return j.is_string() ? std::stoull(j.get<std::string>()) : j.get<uint64_t>();
}

std::vector<uint64_t> U64List(const nlohmann::json& j) {
  std::vector<uint64_t> out;
  for (const auto& v : j) out.push_back(U64(v));
  return out;
}

const nlohmann::json& Vectors() {
  static const nlohmann::json vectors =
      testing::LoadDataJson("vectors/dynamo_block_hash_vectors.json");
  return vectors;
}

class DynamoVectorTest : public ::testing::TestWithParam<size_t> {};

// Every vector in dynamo_block_hash_vectors.json, bit for bit: seed, local and sequence hashes.
TEST_P(DynamoVectorTest, MatchesLocalAndSequenceHashes) {
  const auto& v = Vectors()["vectors"][GetParam()];
  SCOPED_TRACE(v["name"].get<std::string>());
  const auto tokens = v["tokens"].get<std::vector<uint32_t>>();
  const std::string lora = v.value("lora", "");
  const std::string ns = v.value("ns", "");
  std::vector<std::vector<uint64_t>> mm;
  if (v.contains("mm")) {
    for (const auto& block : v["mm"]) {
      mm.push_back(block.is_null() ? std::vector<uint64_t>{} : U64List(block));
    }
  }
  BlockHashOptions options{.lora_name = lora,
                           .cache_namespace = ns,
                           .eagle = v.value("eagle", false),
                           .block_mm_hashes = mm};
  EXPECT_EQ(LocalHashSeed(lora, ns), U64(v["seed"]));
  const auto local = ComputeLocalBlockHashes(tokens, v["block_size"].get<uint32_t>(), options);
  EXPECT_EQ(local, U64List(v["local_hashes"]));
  EXPECT_EQ(ComputeSequenceHashes(local), U64List(v["sequence_hashes"]));
}

INSTANTIATE_TEST_SUITE_P(
    SharedVectors, DynamoVectorTest, ::testing::Range<size_t>(0, Vectors()["vectors"].size()),
    [](const auto& info) {
      return Vectors()["vectors"][info.param]["name"].template get<std::string>();
    });

TEST(HashingTest, UpstreamTestDataVector) {
  const std::string data = "test data";
  EXPECT_EQ(HashBytes({reinterpret_cast<const uint8_t*>(data.data()), data.size()}),
            13226331709069118873ull);
}

TEST(HashingTest, ReferenceVectorFromCheckSection) {
  const std::vector<uint32_t> tokens = {1, 2, 3, 4};
  EXPECT_EQ(ComputeLocalBlockHashes(tokens, 4), std::vector<uint64_t>{14643705804678351452ull});
}

TEST(HashingTest, ZeroBlockSizeYieldsNoBlocks) {
  const std::vector<uint32_t> tokens(64, 7);
  EXPECT_TRUE(ComputeLocalBlockHashes(tokens, 0).empty());
}

TEST(HashingTest, OnlyCompleteBlocksAreHashed) {
  const std::vector<uint32_t> tokens(33, 1);
  EXPECT_EQ(ComputeLocalBlockHashes(tokens, 16).size(), 2u);
  EXPECT_EQ(ComputeLocalBlockHashes(std::span(tokens).first(17), 16).size(), 1u);
}

TEST(HashingTest, EagleNeedsOneTokenOfLookAhead) {
  const std::vector<uint32_t> tokens(32, 1);
  // 32 tokens make two plain blocks but only one eagle block: the second lacks its look-ahead.
  EXPECT_EQ(ComputeLocalBlockHashes(tokens, 16, {.eagle = true}).size(), 1u);
  EXPECT_EQ(NumCompleteBlocks(33, 16, true), 2u);
  EXPECT_EQ(NumCompleteBlocks(0, 16, true), 0u);
}

TEST(HashingTest, MultimodalHashOrderDoesNotMatter) {
  const std::vector<uint32_t> tokens = {1, 2, 3, 4};
  const std::vector<std::vector<uint64_t>> a = {{3, 9}}, b = {{9, 3}};
  EXPECT_EQ(ComputeLocalBlockHashes(tokens, 4, {.block_mm_hashes = a}),
            ComputeLocalBlockHashes(tokens, 4, {.block_mm_hashes = b}));
  EXPECT_NE(ComputeLocalBlockHashes(tokens, 4, {.block_mm_hashes = a}),
            ComputeLocalBlockHashes(tokens, 4));
}

TEST(HashingTest, LoraChangesLocalButNotChainSeed) {
  const std::vector<uint32_t> tokens(32, 5);
  const auto base = ComputeLocalBlockHashes(tokens, 16);
  const auto lora = ComputeLocalBlockHashes(tokens, 16, {.lora_name = "a"});
  EXPECT_NE(base, lora);
  EXPECT_EQ(ComputeSequenceHashes(lora)[1], NextSequenceHash(lora[0], lora[1]));
}

}  // namespace
}  // namespace kvrouter
