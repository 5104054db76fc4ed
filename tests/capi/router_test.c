/* Router creation and destruction, the versioned-options rules on kvr_router_options and
 * kvr_worker_config, and the worker registry: kvr_router_new / _free, kvr_router_add_worker,
 * kvr_router_update_worker, kvr_router_remove_worker. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>

#include "test_util.h"

/* A fresh router with block size 16 and no workers. */
static int setup_router(void** state) {
  *state = kvt_router_new(16, 0);
  return 0;
}

static int teardown_router(void** state) {
  kvr_router_free((kvr_router*)*state);
  return 0;
}

/* The number of complete blocks the router counts in a 64-token prompt: 64 / block_size. */
static uint32_t prompt_blocks_of_64(kvr_router* router) {
  uint32_t tokens[64];
  kvr_route_result result;
  kvt_fill_tokens(tokens, 64, 1);
  kvt_add_worker(router, 1);
  kvr_route_result_init(&result, sizeof result);
  KVT_OK(kvr_find_best_match(router, tokens, 64, NULL, &result, NULL, 0, NULL, ERRP));
  return result.prompt_blocks;
}

static void new_with_defaults(void** state) {
  kvr_router* router = NULL;
  kvr_metrics metrics;
  (void)state;
  KVT_OK(kvr_router_new(NULL, &router, ERRP));
  assert_non_null(router);
  metrics = kvt_metrics(router);
  assert_int_equal(0, metrics.workers);
  assert_int_equal(0, metrics.requests_active);
  /* The default block size is 16. */
  assert_int_equal(4, prompt_blocks_of_64(router));
  kvr_router_free(router);
}

static void new_with_options(void** state) {
  kvr_router_options opts;
  kvr_router* router;
  (void)state;
  kvr_router_options_init(&opts, sizeof opts);
  opts.block_size = 8;
  opts.queue_policy = KVR_QUEUE_WSPT;
  opts.queue_threshold = 2.0;
  opts.temperature = 0.5;
  opts.overlap_score_credit = 2.0;
  opts.prefill_load_scale = 0.5;
  opts.host_cache_hit_weight = 0.5;
  opts.disk_cache_hit_weight = 0.1;
  opts.approx_ttl_seconds = 10;
  opts.approx_max_blocks = 1000;
  opts.approx_prune_target_ratio = 0.5;
  opts.request_expiry_seconds = 30;
  opts.random_seed = 7;
  opts.flags = KVR_ROUTER_NO_KV_REUSE | KVR_ROUTER_NO_PREFILL_TRACKING | KVR_ROUTER_ENTROPY_SEED;
  router = kvt_router_new_opts(&opts);
  assert_int_equal(8, prompt_blocks_of_64(router));
  kvr_router_free(router);

  kvr_router_options_init(&opts, sizeof opts);
  opts.flags = KVR_ROUTER_APPROXIMATE | KVR_ROUTER_EAGLE;
  router = kvt_router_new_opts(&opts);
  kvr_router_free(router);
}

static void new_null_out(void** state) {
  (void)state;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_new(NULL, NULL, ERRP));
}

static void new_zero_block_size(void** state) {
  kvr_router_options opts;
  kvr_router* router = NULL;
  kvr_error* err = NULL;
  (void)state;
  kvr_router_options_init(&opts, sizeof opts);
  opts.block_size = 0;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_new(&opts, &router, ERRP));
  assert_null(router);
  /* The message names the bad setting. */
  assert_int_equal(KVR_INVALID_ARGUMENT, kvr_router_new(&opts, &router, &err));
  assert_non_null(strstr(kvr_error_message(err), "block_size"));
  kvr_error_free(err);
}

static void new_refuses_bad_settings(void** state) {
  kvr_router_options opts;
  kvr_router* router = NULL;
  kvr_error* err = NULL;
  (void)state;
  kvr_router_options_init(&opts, sizeof opts);
  opts.temperature = -1;
  assert_int_equal(KVR_INVALID_ARGUMENT, kvr_router_new(&opts, &router, &err));
  assert_non_null(strstr(kvr_error_message(err), "temperature"));
  kvr_error_free(err);
  err = NULL;

  kvr_router_options_init(&opts, sizeof opts);
  opts.host_cache_hit_weight = 2;
  assert_int_equal(KVR_INVALID_ARGUMENT, kvr_router_new(&opts, &router, &err));
  assert_non_null(strstr(kvr_error_message(err), "host_cache_hit_weight"));
  kvr_error_free(err);
  err = NULL;

  kvr_router_options_init(&opts, sizeof opts);
  opts.queue_policy = 99;
  assert_int_equal(KVR_INVALID_ARGUMENT, kvr_router_new(&opts, &router, &err));
  assert_non_null(strstr(kvr_error_message(err), "queue_policy"));
  kvr_error_free(err);
  err = NULL;

  kvr_router_options_init(&opts, sizeof opts);
  opts.approx_ttl_seconds = 0;
  assert_int_equal(KVR_INVALID_ARGUMENT, kvr_router_new(&opts, &router, &err));
  assert_non_null(strstr(kvr_error_message(err), "approx_ttl_seconds"));
  kvr_error_free(err);
  err = NULL;

  kvr_router_options_init(&opts, sizeof opts);
  opts.queue_threshold = NAN;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_new(&opts, &router, ERRP));
  kvr_router_options_init(&opts, sizeof opts);
  opts.overlap_score_credit = -0.5;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_new(&opts, &router, ERRP));
  kvr_router_options_init(&opts, sizeof opts);
  opts.approx_max_blocks = 0;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_new(&opts, &router, ERRP));
  kvr_router_options_init(&opts, sizeof opts);
  opts.approx_prune_target_ratio = 1.5;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_new(&opts, &router, ERRP));
  kvr_router_options_init(&opts, sizeof opts);
  opts.request_expiry_seconds = -1;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_new(&opts, &router, ERRP));
  kvr_router_options_init(&opts, sizeof opts);
  opts.index_shards = 0;
  assert_int_equal(KVR_INVALID_ARGUMENT, kvr_router_new(&opts, &router, &err));
  assert_non_null(strstr(kvr_error_message(err), "index_shards"));
  kvr_error_free(err);
  kvr_router_options_init(&opts, sizeof opts);
  opts.index_shards = 65;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_new(&opts, &router, ERRP));
  assert_null(router);
}

/* A router whose index splits the workers over several trees answers exactly as one with a
 * single tree: overlaps, worker removal, index metrics. */
static void index_shards_change_no_answer(void** state) {
  enum { kWorkers = 9 };
  kvr_router_options opts;
  kvr_router* routers[2];
  uint32_t stem[64], tokens[kWorkers][96];
  size_t r, w;
  (void)state;
  kvr_router_options_init(&opts, sizeof opts);
  assert_int_equal(1, opts.index_shards);
  routers[0] = kvt_router_new_opts(&opts);
  opts.index_shards = 4;
  routers[1] = kvt_router_new_opts(&opts);
  kvt_fill_tokens(stem, 64, 7);
  for (w = 0; w < kWorkers; ++w) {
    /* Every worker holds the 4-block stem, then 2 blocks of its own. */
    memcpy(tokens[w], stem, sizeof stem);
    kvt_fill_tokens(tokens[w] + 64, 32, (uint32_t)(100 + w));
  }
  for (r = 0; r < 2; ++r) {
    for (w = 0; w < kWorkers; ++w) {
      kvt_add_worker(routers[r], w + 1);
      KVT_OK(kvt_store(routers[r], w + 1, 0, KVR_TIER_DEVICE, tokens[w], 6, 16, 1000 * (w + 1), 0,
                       0, ERRP));
    }
    KVT_OK(kvr_router_remove_worker(routers[r], 4, ERRP));
  }
  for (w = 0; w < kWorkers; ++w) {
    kvr_overlap single, sharded;
    const int held = kvt_overlap_of(routers[0], tokens[w], 96, w + 1, 0, &single);
    assert_int_equal(held, kvt_overlap_of(routers[1], tokens[w], 96, w + 1, 0, &sharded));
    assert_int_equal(held, w + 1 != 4);
    if (held) {
      assert_int_equal(6, single.device_blocks);
      assert_int_equal(single.device_blocks, sharded.device_blocks);
      assert_int_equal(single.tree_size, sharded.tree_size);
    }
  }
  assert_int_equal(kvt_metrics(routers[0]).index_blocks, kvt_metrics(routers[1]).index_blocks);
  kvr_router_free(routers[0]);
  kvr_router_free(routers[1]);
}

static void options_struct_size_zero_refused(void** state) {
  kvr_router_options opts;
  kvr_router* router = NULL;
  (void)state;
  kvr_router_options_init(&opts, sizeof opts);
  opts.struct_size = 0;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_new(&opts, &router, ERRP));
  assert_null(router);
}

/* An older caller: the first released layout ended with random_seed. Its _init writes no
 * further, and the fields after it (Dynamo's newer cost knobs) take their defaults. */
static void options_from_older_caller(void** state) {
  const size_t first = KVT_LAYOUT_END(kvr_router_options, random_seed);
  kvr_router_options opts;
  kvr_router* router;
  (void)state;
  memset(&opts, 0xAB, sizeof opts);
  KVT_OK(kvr_router_options_init(&opts, first));
  assert_int_equal(first, opts.struct_size);
  assert_int_equal(16, opts.block_size);
  assert_true(((uint8_t*)&opts)[first] == 0xAB); /* nothing written past the size */
  opts.block_size = 4;                           /* covered: read */
  opts.overlap_score_credit_decay = -5;          /* beyond: ignored (would be refused) */
  opts.decode_active_request_weight = NAN;       /* beyond: ignored */
  router = kvt_router_new_opts(&opts);
  assert_int_equal(16, prompt_blocks_of_64(router));
  kvr_router_free(router);

  /* Shorter than the first released layout: _init refuses the size and so does every call. */
  memset(&opts, 0xAB, sizeof opts);
  assert_int_equal(KVR_INVALID_ARGUMENT,
                   kvr_router_options_init(&opts, offsetof(kvr_router_options, temperature)));
  assert_int_equal(offsetof(kvr_router_options, temperature), opts.struct_size);
  assert_true(((uint8_t*)&opts)[offsetof(kvr_router_options, temperature)] == 0xAB);
  router = NULL;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "first released layout",
                          kvr_router_new(&opts, &router, ERRP));
  assert_null(router);

  /* No struct, or a size that cannot even hold struct_size: refused, nothing written. */
  assert_int_equal(KVR_INVALID_ARGUMENT, kvr_router_options_init(NULL, sizeof opts));
  memset(&opts, 0xAB, sizeof opts);
  assert_int_equal(KVR_INVALID_ARGUMENT, kvr_router_options_init(&opts, 3));
  assert_int_equal(0xABABABABu, opts.struct_size);
}

/* Sizes no caller's struct can have are refused before anything is read: one that ends inside
 * a field (half the caller's double and half the default would be used), and one far larger
 * than any kvrouter's (garbage: the library must not scan the caller's memory for it). */
static void impossible_sizes_refused(void** state) {
  kvr_router_options opts;
  kvr_router* router = NULL;
  const size_t inside_a_field = KVT_LAYOUT_END(kvr_router_options, random_seed) + 4;
  (void)state;
  memset(&opts, 0xAB, sizeof opts);
  assert_int_equal(KVR_INVALID_ARGUMENT, kvr_router_options_init(&opts, inside_a_field));
  assert_int_equal(inside_a_field, opts.struct_size);
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "ends inside a field",
                          kvr_router_new(&opts, &router, ERRP));
  KVT_OK(kvr_router_options_init(&opts, sizeof opts));
  opts.struct_size = 1u << 20; /* a stack struct of 120 bytes: an over-read would be ASan's */
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "more than any kvrouter's",
                          kvr_router_new(&opts, &router, ERRP));
  assert_null(router);
}

/* A flag bit this library does not know is refused, not ignored: a newer caller asking for
 * behaviour this library lacks learns it at once. */
static void unknown_flags_refused(void** state) {
  kvr_router_options opts;
  kvr_router* router = NULL;
  (void)state;
  kvr_router_options_init(&opts, sizeof opts);
  opts.flags = KVR_ROUTER_APPROXIMATE | 0x80000000u;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "kvr_router_options.flags 0x80000001",
                          kvr_router_new(&opts, &router, ERRP));
  assert_null(router);
  opts.flags = 0;
  opts.queue_policy = 3;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "queue_policy 3",
                          kvr_router_new(&opts, &router, ERRP));
}

/* A newer caller's struct is larger: an all-zero unknown tail is accepted, any non-zero byte
 * in it is refused. */
static void options_from_newer_caller(void** state) {
  struct {
    kvr_router_options base;
    uint64_t tail[3];
  } newer;
  kvr_router* router = NULL;
  size_t i;
  (void)state;
  memset(&newer, 0xAB, sizeof newer);
  KVT_OK(kvr_router_options_init(&newer.base, sizeof newer));
  assert_int_equal(sizeof newer, newer.base.struct_size);
  for (i = 0; i < 3; ++i) assert_int_equal(0, newer.tail[i]); /* zero-filled by _init */
  newer.base.block_size = 8;
  router = kvt_router_new_opts(&newer.base);
  assert_int_equal(8, prompt_blocks_of_64(router));
  kvr_router_free(router);

  for (i = 0; i < 3; ++i) {
    router = NULL;
    memset(newer.tail, 0, sizeof newer.tail);
    newer.tail[i] = (uint64_t)1 << (i * 20);
    KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_new(&newer.base, &router, ERRP));
    assert_null(router);
  }
}

static void router_free_null(void** state) {
  (void)state;
  kvr_router_free(NULL);
}

/* ---- Workers --------------------------------------------------------------------------- */

static void add_update_remove_worker(void** state) {
  kvr_router* router = (kvr_router*)*state;
  kvr_worker_config config;
  uint32_t tokens[32];
  kvr_potential_load loads[8];
  size_t len = 0;
  kvt_fill_tokens(tokens, 32, 1);

  kvr_worker_config_init(&config, sizeof config);
  config.worker_id = 1;
  config.dp_start = 0;
  config.dp_size = 2;
  config.total_kv_blocks = 1000;
  config.max_num_batched_tokens = 8192;
  KVT_OK(kvr_router_add_worker(router, &config, ERRP));
  config.worker_id = 2;
  config.dp_size = 1;
  config.block_size = 16; /* explicit, equal to the router's */
  KVT_OK(kvr_router_add_worker(router, &config, ERRP));
  assert_int_equal(2, kvt_metrics(router).workers);
  KVT_OK(kvr_router_potential_loads(router, tokens, 32, NULL, loads, 8, &len, ERRP));
  assert_int_equal(3, len); /* ranks 1/0, 1/1, 2/0 */

  /* Worker 1 grows to ranks 4..6: ranks 0 and 1 disappear, 4, 5 and 6 appear. */
  kvr_worker_config_init(&config, sizeof config);
  config.worker_id = 1;
  config.dp_start = 4;
  config.dp_size = 3;
  KVT_OK(kvr_router_update_worker(router, &config, ERRP));
  KVT_OK(kvr_router_potential_loads(router, tokens, 32, NULL, loads, 8, &len, ERRP));
  assert_int_equal(4, len);
  (void)kvt_load_of(router, tokens, 32, 1, 4);
  (void)kvt_load_of(router, tokens, 32, 1, 6);

  KVT_OK(kvr_router_remove_worker(router, 1, ERRP));
  assert_int_equal(1, kvt_metrics(router).workers);
  KVT_OK(kvr_router_potential_loads(router, tokens, 32, NULL, loads, 8, &len, ERRP));
  assert_int_equal(1, len);
  assert_int_equal(2, loads[0].worker_id);
}

static void add_duplicate_worker(void** state) {
  kvr_router* router = (kvr_router*)*state;
  kvr_worker_config config;
  kvt_add_worker(router, 1);
  kvr_worker_config_init(&config, sizeof config);
  config.worker_id = 1;
  KVT_EXPECT_FAILS(KVR_ALREADY_EXISTS, kvr_router_add_worker(router, &config, ERRP));
  assert_int_equal(1, kvt_metrics(router).workers);
}

static void add_worker_bad_config(void** state) {
  kvr_router* router = (kvr_router*)*state;
  kvr_worker_config config;
  kvr_worker_config_init(&config, sizeof config);
  config.worker_id = 1;
  config.block_size = 32; /* the router uses 16 */
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_add_worker(router, &config, ERRP));
  kvr_worker_config_init(&config, sizeof config);
  config.worker_id = 1;
  config.dp_size = 0;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_add_worker(router, &config, ERRP));
  kvr_worker_config_init(&config, sizeof config);
  config.worker_id = 1;
  config.dp_start = UINT32_MAX;
  config.dp_size = 2;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_add_worker(router, &config, ERRP));
  assert_int_equal(0, kvt_metrics(router).workers);
}

static void unknown_worker(void** state) {
  kvr_router* router = (kvr_router*)*state;
  kvr_worker_config config;
  kvr_worker_config_init(&config, sizeof config);
  config.worker_id = 77;
  KVT_EXPECT_FAILS(KVR_NOT_FOUND, kvr_router_update_worker(router, &config, ERRP));
  KVT_EXPECT_FAILS(KVR_NOT_FOUND, kvr_router_remove_worker(router, 77, ERRP));
  kvt_add_worker(router, 1);
  KVT_OK(kvr_router_remove_worker(router, 1, ERRP));
  /* Removing twice: the second time it is unknown. */
  KVT_EXPECT_FAILS(KVR_NOT_FOUND, kvr_router_remove_worker(router, 1, ERRP));
}

static void worker_config_null_and_struct_size(void** state) {
  kvr_router* router = (kvr_router*)*state;
  kvr_worker_config config;
  struct {
    kvr_worker_config base;
    uint64_t tail[2];
  } newer;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_add_worker(router, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_update_worker(router, NULL, ERRP));

  kvr_worker_config_init(&config, sizeof config);
  config.worker_id = 1;
  config.struct_size = 0;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_add_worker(router, &config, ERRP));

  /* Shorter than the first released layout (which ended with max_num_batched_tokens): no
   * caller's, refused. */
  kvr_worker_config_init(&config, sizeof config);
  config.worker_id = 1;
  config.struct_size = (uint32_t)offsetof(kvr_worker_config, total_kv_blocks);
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "first released layout",
                          kvr_router_add_worker(router, &config, ERRP));
  KVT_OK(kvr_worker_config_init(&config, sizeof config));
  config.worker_id = 1;
  config.dp_size = 2;
  KVT_OK(kvr_router_add_worker(router, &config, ERRP));
  config.worker_id = 2;
  config.dp_size = 1;
  KVT_OK(kvr_router_add_worker(router, &config, ERRP));
  {
    uint32_t tokens[16];
    kvr_potential_load loads[8];
    size_t len = 0;
    kvt_fill_tokens(tokens, 16, 1);
    KVT_OK(kvr_router_potential_loads(router, tokens, 16, NULL, loads, 8, &len, ERRP));
    assert_int_equal(3, len); /* 1/0, 1/1, 2/0 */
  }

  memset(&newer, 0xAB, sizeof newer);
  KVT_OK(kvr_worker_config_init(&newer.base, sizeof newer));
  newer.base.worker_id = 3;
  KVT_OK(kvr_router_add_worker(router, &newer.base, ERRP));
  newer.base.worker_id = 4;
  newer.tail[0] = 1;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_add_worker(router, &newer.base, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_update_worker(router, &newer.base, ERRP));
  assert_int_equal(3, kvt_metrics(router).workers);
}

static void removed_ranks_lose_requests_and_index_entries(void** state) {
  kvr_router* router = (kvr_router*)*state;
  kvr_worker_config config;
  uint32_t tokens[32];
  kvr_request_options opts;
  kvt_fill_tokens(tokens, 32, 1);
  kvr_worker_config_init(&config, sizeof config);
  config.worker_id = 1;
  config.dp_size = 2;
  KVT_OK(kvr_router_add_worker(router, &config, ERRP));
  kvt_add_worker(router, 2);

  /* Rank 1/1 caches the prompt and serves a request; worker 2 serves another. */
  KVT_OK(kvt_store(router, 1, 1, KVR_TIER_DEVICE, tokens, 2, 16, 100, 0, 0, ERRP));
  assert_true(kvt_overlap_of(router, tokens, 32, 1, 1, NULL));
  opts = kvt_admit("on-rank-1");
  KVT_OK(kvr_router_add_request(router, tokens, 32, 1, 1, &opts, ERRP));
  opts = kvt_admit("on-worker-2");
  KVT_OK(kvr_router_add_request(router, tokens, 32, 2, 0, &opts, ERRP));
  assert_int_equal(2, kvt_metrics(router).requests_active);

  /* Shrinking worker 1 to rank 0 drops rank 1's request and index entries. */
  config.dp_size = 1;
  KVT_OK(kvr_router_update_worker(router, &config, ERRP));
  assert_int_equal(1, kvt_metrics(router).requests_active);
  assert_false(kvt_overlap_of(router, tokens, 32, 1, 1, NULL));

  /* Removing worker 2 drops its request. */
  KVT_OK(kvr_router_remove_worker(router, 2, ERRP));
  assert_int_equal(0, kvt_metrics(router).requests_active);
  /* Freeing a dropped request is no error. */
  KVT_OK(kvr_router_free_request(router, "on-worker-2", ERRP));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(new_with_defaults),
      cmocka_unit_test(new_with_options),
      cmocka_unit_test(new_null_out),
      cmocka_unit_test(new_zero_block_size),
      cmocka_unit_test(new_refuses_bad_settings),
      cmocka_unit_test(index_shards_change_no_answer),
      cmocka_unit_test(options_struct_size_zero_refused),
      cmocka_unit_test(options_from_older_caller),
      cmocka_unit_test(options_from_newer_caller),
      cmocka_unit_test(impossible_sizes_refused),
      cmocka_unit_test(unknown_flags_refused),
      cmocka_unit_test(router_free_null),
      cmocka_unit_test_setup_teardown(add_update_remove_worker, setup_router, teardown_router),
      cmocka_unit_test_setup_teardown(add_duplicate_worker, setup_router, teardown_router),
      cmocka_unit_test_setup_teardown(add_worker_bad_config, setup_router, teardown_router),
      cmocka_unit_test_setup_teardown(unknown_worker, setup_router, teardown_router),
      cmocka_unit_test_setup_teardown(worker_config_null_and_struct_size, setup_router,
                                      teardown_router),
      cmocka_unit_test_setup_teardown(removed_ranks_lose_requests_and_index_entries, setup_router,
                                      teardown_router),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
