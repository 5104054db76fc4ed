/* Block hashing through the C ABI: kvr_compute_block_hashes and kvr_compute_sequence_hashes
 * reproduce the Dynamo-compatible vectors of data/vectors/dynamo_block_hash_vectors.json (hard
 * coded here, so that the test needs no JSON parser), and follow the buffer and error rules. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>

#include "test_util.h"

/* two_blocks_bs16: tokens 0..31, block size 16. */
static const uint64_t kTwoBlocksLocal[2] = {15310707395893867146ull, 15292316782987903195ull};
static const uint64_t kTwoBlocksSeq[2] = {15310707395893867146ull, 13769157705258532664ull};

static void compute(const uint32_t* tokens, size_t n, uint32_t block_size,
                    const kvr_hash_options* opts, uint64_t* out, size_t cap, size_t* len) {
  KVT_OK(kvr_compute_block_hashes(tokens, n, block_size, opts, out, cap, len, ERRP));
}

static void two_blocks_bs16(void** state) {
  uint32_t tokens[32];
  uint64_t local[4] = {0};
  uint64_t seq[4] = {0};
  size_t len = 99;
  (void)state;
  kvt_fill_tokens(tokens, 32, 0);
  compute(tokens, 16, 16, NULL, local, 4, &len);
  assert_int_equal(1, len);
  assert_int_equal(15310707395893867146ull, local[0]);

  compute(tokens, 32, 16, NULL, local, 4, &len);
  assert_int_equal(2, len);
  assert_int_equal(kTwoBlocksLocal[0], local[0]);
  assert_int_equal(kTwoBlocksLocal[1], local[1]);

  KVT_OK(kvr_compute_sequence_hashes(local, 2, seq, 4, &len, ERRP));
  assert_int_equal(2, len);
  assert_int_equal(kTwoBlocksSeq[0], seq[0]);
  assert_int_equal(kTwoBlocksSeq[1], seq[1]);
}

static void partial_tail_and_short_prompts(void** state) {
  uint32_t tokens[37];
  uint64_t local[4] = {0};
  size_t len = 99;
  (void)state;
  kvt_fill_tokens(tokens, 37, 0);
  compute(tokens, 37, 16, NULL, local, 4, &len);
  assert_int_equal(2, len);
  assert_int_equal(kTwoBlocksLocal[0], local[0]);
  assert_int_equal(kTwoBlocksLocal[1], local[1]);

  len = 99;
  compute(tokens, 5, 16, NULL, local, 4, &len);
  assert_int_equal(0, len);
  len = 99;
  compute(tokens, 0, 16, NULL, local, 4, &len);
  assert_int_equal(0, len);
}

static void lora_and_namespace(void** state) {
  uint32_t tokens[4] = {0, 1, 2, 3};
  uint64_t out[2] = {0};
  size_t len = 0;
  kvr_hash_options opts;
  (void)state;
  kvr_hash_options_init(&opts, sizeof opts);
  opts.lora_name = "adapter-a";
  compute(tokens, 4, 4, &opts, out, 2, &len);
  assert_int_equal(1, len);
  assert_int_equal(6665157333201000639ull, out[0]);

  /* An empty LoRA name is the base model, as is NULL or no options at all. */
  opts.lora_name = "";
  compute(tokens, 4, 4, &opts, out, 2, &len);
  assert_int_equal(9143094415614847814ull, out[0]);
  opts.lora_name = NULL;
  compute(tokens, 4, 4, &opts, out, 2, &len);
  assert_int_equal(9143094415614847814ull, out[0]);
  compute(tokens, 4, 4, NULL, out, 2, &len);
  assert_int_equal(9143094415614847814ull, out[0]);

  kvr_hash_options_init(&opts, sizeof opts);
  opts.cache_namespace = "tenant-1";
  compute(tokens, 4, 4, &opts, out, 2, &len);
  assert_int_equal(12244549381340615468ull, out[0]);
}

static void lora_and_namespace_together(void** state) {
  uint32_t tokens[32];
  uint64_t out[2] = {0};
  uint64_t seq[2] = {0};
  size_t len = 0;
  kvr_hash_options opts;
  (void)state;
  kvt_fill_tokens(tokens, 32, 100);
  kvr_hash_options_init(&opts, sizeof opts);
  opts.lora_name = "adapter-b";
  opts.cache_namespace = "tenant-2";
  compute(tokens, 32, 16, &opts, out, 2, &len);
  assert_int_equal(2, len);
  assert_int_equal(11802432356634032379ull, out[0]);
  assert_int_equal(5964709424852623607ull, out[1]);
  KVT_OK(kvr_compute_sequence_hashes(out, 2, seq, 2, &len, ERRP));
  assert_int_equal(11802432356634032379ull, seq[0]);
  assert_int_equal(11189218512316781659ull, seq[1]);
}

static void multimodal(void** state) {
  uint32_t tokens1[4] = {1, 2, 3, 4};
  uint64_t mm1[1] = {42};
  size_t counts1[2] = {1, 0};
  uint32_t tokens2[6] = {7, 8, 9, 10, 11, 12};
  uint64_t mm2[3] = {9, 3, 5}; /* block 0: {9, 3} (sorted by the library), block 1: {5} */
  size_t counts2[2] = {2, 1};
  uint64_t out[3] = {0};
  size_t len = 0;
  kvr_hash_options opts;
  (void)state;

  kvr_hash_options_init(&opts, sizeof opts);
  opts.mm_hashes = mm1;
  opts.mm_counts = counts1;
  opts.mm_num_blocks = 2;
  compute(tokens1, 4, 2, &opts, out, 3, &len);
  assert_int_equal(2, len);
  assert_int_equal(8042846820486697486ull, out[0]);
  assert_int_equal(2662118915037317746ull, out[1]);

  kvr_hash_options_init(&opts, sizeof opts);
  opts.mm_hashes = mm2;
  opts.mm_counts = counts2;
  opts.mm_num_blocks = 2;
  compute(tokens2, 6, 3, &opts, out, 3, &len);
  assert_int_equal(2, len);
  assert_int_equal(8964971868145781830ull, out[0]);
  assert_int_equal(10311331095896773576ull, out[1]);
}

static void eagle_windows(void** state) {
  uint32_t tokens[5] = {10, 11, 12, 13, 14};
  uint64_t out[3] = {0};
  uint64_t seq[3] = {0};
  size_t len = 0;
  kvr_hash_options opts;
  (void)state;
  kvr_hash_options_init(&opts, sizeof opts);
  opts.flags = KVR_HASH_EAGLE;
  /* Windows of block_size + 1 tokens: 5 tokens make 2 blocks of 2. */
  compute(tokens, 5, 2, &opts, out, 3, &len);
  assert_int_equal(2, len);
  assert_int_equal(5959138341449004422ull, out[0]);
  assert_int_equal(13917772031453556700ull, out[1]);
  KVT_OK(kvr_compute_sequence_hashes(out, 2, seq, 3, &len, ERRP));
  assert_int_equal(5959138341449004422ull, seq[0]);
  assert_int_equal(1054115500078300438ull, seq[1]);
  /* One token fewer: only one complete eagle window. */
  compute(tokens, 4, 2, &opts, out, 3, &len);
  assert_int_equal(1, len);
}

static void large_token_ids(void** state) {
  uint32_t tokens[32];
  uint64_t out[4] = {0};
  uint64_t seq[4] = {0};
  size_t len = 0;
  size_t i;
  (void)state;
  for (i = 0; i < 32; i += 4) {
    tokens[i] = 4294967295u;
    tokens[i + 1] = 0;
    tokens[i + 2] = 2147483648u;
    tokens[i + 3] = 1;
  }
  compute(tokens, 32, 8, NULL, out, 4, &len);
  assert_int_equal(4, len);
  for (i = 0; i < 4; ++i) assert_int_equal(6565018717400035788ull, out[i]);
  KVT_OK(kvr_compute_sequence_hashes(out, 4, seq, 4, &len, ERRP));
  assert_int_equal(6565018717400035788ull, seq[0]);
  assert_int_equal(11281331533533839711ull, seq[1]);
  assert_int_equal(16564334338260701127ull, seq[2]);
  assert_int_equal(13893058671646163016ull, seq[3]);
}

static void zero_block_size_is_invalid(void** state) {
  uint32_t tokens[16];
  uint64_t out[2] = {7, 7};
  size_t len = 99;
  (void)state;
  kvt_fill_tokens(tokens, 16, 0);
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_compute_block_hashes(tokens, 16, 0, NULL, out, 2, &len, ERRP));
  assert_int_equal(99, len);
  assert_int_equal(7, out[0]);
}

static void block_hashes_buffer_too_small_then_retry(void** state) {
  uint32_t tokens[64];
  uint64_t out[4] = {7, 7, 7, 7};
  uint64_t* retry;
  size_t len = 0;
  (void)state;
  kvt_fill_tokens(tokens, 64, 0);
  /* 64 tokens of 16: 4 blocks needed, room for 1. */
  KVT_EXPECT_FAILS(KVR_BUFFER_TOO_SMALL,
                   kvr_compute_block_hashes(tokens, 64, 16, NULL, out, 1, &len, ERRP));
  assert_int_equal(4, len);
  /* The buffer itself is an out parameter: untouched on failure. */
  assert_int_equal(7, out[0]);
  len = 0;
  KVT_EXPECT_FAILS(KVR_BUFFER_TOO_SMALL,
                   kvr_compute_block_hashes(tokens, 64, 16, NULL, out, 0, &len, ERRP));
  assert_int_equal(4, len);

  retry = (uint64_t*)calloc(len, sizeof(uint64_t));
  assert_non_null(retry);
  KVT_OK(kvr_compute_block_hashes(tokens, 64, 16, NULL, retry, len, &len, ERRP));
  assert_int_equal(4, len);
  assert_int_equal(kTwoBlocksLocal[0], retry[0]);
  assert_int_equal(kTwoBlocksLocal[1], retry[1]);
  free(retry);
}

static void sequence_hashes_buffer_too_small_then_retry(void** state) {
  uint64_t out[2] = {7, 7};
  size_t len = 0;
  (void)state;
  KVT_EXPECT_FAILS(KVR_BUFFER_TOO_SMALL,
                   kvr_compute_sequence_hashes(kTwoBlocksLocal, 2, out, 1, &len, ERRP));
  assert_int_equal(2, len);
  assert_int_equal(7, out[0]);
  KVT_OK(kvr_compute_sequence_hashes(kTwoBlocksLocal, 2, out, len, &len, ERRP));
  assert_int_equal(2, len);
  assert_int_equal(kTwoBlocksSeq[1], out[1]);
  /* No input, no output. */
  len = 99;
  KVT_OK(kvr_compute_sequence_hashes(kTwoBlocksLocal, 0, out, 2, &len, ERRP));
  assert_int_equal(0, len);
}

static void null_arguments(void** state) {
  uint32_t tokens[16];
  uint64_t out[2];
  size_t len = 0;
  (void)state;
  kvt_fill_tokens(tokens, 16, 0);
  /* (NULL len: errors_test.c.) */
  /* NULL inputs with a non-zero count. */
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_compute_block_hashes(NULL, 16, 16, NULL, out, 2, &len, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_compute_sequence_hashes(NULL, 2, out, 2, &len, ERRP));
  /* NULL output with room claimed for it. */
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_compute_block_hashes(tokens, 16, 16, NULL, NULL, 2, &len, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_compute_sequence_hashes(kTwoBlocksLocal, 2, NULL, 2, &len, ERRP));
}

static void hash_options_struct_size_rules(void** state) {
  uint32_t tokens[4] = {0, 1, 2, 3};
  uint64_t out[1] = {0};
  size_t len = 0;
  kvr_hash_options opts;
  struct {
    kvr_hash_options base;
    uint64_t tail[2];
  } newer;
  (void)state;

  /* struct_size 0 is refused. */
  kvr_hash_options_init(&opts, sizeof opts);
  opts.struct_size = 0;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_compute_block_hashes(tokens, 4, 4, &opts, out, 1, &len, ERRP));

  /* A struct shorter than the first released layout is refused, saying so: _init refuses the
   * size, and a struct that claims it is refused by every call. */
  memset(&opts, 0xAB, sizeof opts);
  assert_int_equal(KVR_INVALID_ARGUMENT,
                   kvr_hash_options_init(&opts, offsetof(kvr_hash_options, cache_namespace)));
  assert_int_equal(offsetof(kvr_hash_options, cache_namespace), opts.struct_size);
  assert_null(opts.lora_name);
  assert_true(*(const uint8_t*)&opts.cache_namespace == 0xAB); /* past the size: untouched */
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "first released layout",
                          kvr_compute_block_hashes(tokens, 4, 4, &opts, out, 1, &len, ERRP));

  /* A flag bit this library does not know is refused. */
  KVT_OK(kvr_hash_options_init(&opts, sizeof opts));
  opts.flags = KVR_HASH_EAGLE << 1;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "kvr_hash_options.flags 0x2",
                          kvr_compute_block_hashes(tokens, 4, 4, &opts, out, 1, &len, ERRP));

  /* A newer caller: a zero tail is accepted, a non-zero one refused. */
  memset(&newer, 0xAB, sizeof newer);
  KVT_OK(kvr_hash_options_init(&newer.base, sizeof newer));
  newer.base.cache_namespace = "tenant-1";
  compute(tokens, 4, 4, &newer.base, out, 1, &len);
  assert_int_equal(12244549381340615468ull, out[0]);
  newer.tail[1] = 1;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_compute_block_hashes(tokens, 4, 4, &newer.base, out, 1, &len, ERRP));
}

static void multimodal_counts_without_hashes(void** state) {
  uint32_t tokens[4] = {1, 2, 3, 4};
  size_t counts[2] = {1, 1}; /* two multimodal hashes announced, none given */
  uint64_t out[2];
  size_t len = 0;
  kvr_hash_options opts;
  (void)state;
  kvr_hash_options_init(&opts, sizeof opts);
  opts.mm_hashes = NULL;
  opts.mm_counts = counts;
  opts.mm_num_blocks = 2;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_compute_block_hashes(tokens, 4, 2, &opts, out, 2, &len, ERRP));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(two_blocks_bs16),
      cmocka_unit_test(partial_tail_and_short_prompts),
      cmocka_unit_test(lora_and_namespace),
      cmocka_unit_test(lora_and_namespace_together),
      cmocka_unit_test(multimodal),
      cmocka_unit_test(eagle_windows),
      cmocka_unit_test(large_token_ids),
      cmocka_unit_test(zero_block_size_is_invalid),
      cmocka_unit_test(block_hashes_buffer_too_small_then_retry),
      cmocka_unit_test(sequence_hashes_buffer_too_small_then_retry),
      cmocka_unit_test(null_arguments),
      cmocka_unit_test(hash_options_struct_size_rules),
      cmocka_unit_test(multimodal_counts_without_hashes),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
