/* Disaggregated prefill / decode through the C ABI: remote prefill with a bootstrap room,
 * forced decode overrides, the empty prefill pool (aggregated, or an error when enforced),
 * prefill_worker_busy, and the conditional policies with their decode-busy guard. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>

#include "test_util.h"

#define BS 16

static kvr_disagg* make_disagg(const kvr_disagg_options* opts) {
  kvr_router_options pool;
  kvr_disagg* disagg = NULL;
  kvr_router_options_init(&pool, sizeof pool);
  pool.block_size = BS;
  pool.random_seed = 3;
  KVT_OK(kvr_disagg_new(&pool, &pool, opts, &disagg, ERRP));
  assert_non_null(disagg);
  return disagg;
}

static void add_pool_worker(kvr_router* pool, uint64_t id, uint64_t total_kv_blocks,
                            uint64_t max_batched) {
  kvr_worker_config config;
  kvr_worker_config_init(&config, sizeof config);
  config.worker_id = id;
  config.total_kv_blocks = total_kv_blocks;
  config.max_num_batched_tokens = max_batched;
  KVT_OK(kvr_router_add_worker(pool, &config, ERRP));
}

static void prefill_then_decode(void** state) {
  kvr_disagg* disagg = make_disagg(NULL);
  kvr_router* prefill = kvr_disagg_prefill_router(disagg);
  kvr_router* decode = kvr_disagg_decode_router(disagg);
  uint32_t prompt[8 * BS];
  kvr_request_options req = kvt_admit("r");
  kvr_prefill_result where;
  kvr_route_signals out;
  kvr_routing_hints hints;
  (void)state;
  kvt_fill_tokens(prompt, 8 * BS, 3);
  add_pool_worker(prefill, 10, 1000, 0);
  add_pool_worker(prefill, 11, 1000, 0);
  add_pool_worker(decode, 20, 1000, 0);
  add_pool_worker(decode, 21, 1000, 0);
  /* The decode worker 21 caches the prompt: with forced overrides that earns no credit. */
  KVT_OK(kvt_store(decode, 21, 0, KVR_TIER_DEVICE, prompt, 8, BS, 500, 0, 0, ERRP));
  kvr_prefill_result_init(&where, sizeof where);
  kvr_route_signals_init(&out, sizeof out);
  kvr_routing_hints_init(&hints, sizeof hints);
  hints.prefill_worker_id = 11;
  KVT_OK(kvr_disagg_route_prefill(disagg, prompt, 8 * BS, &req, &hints, &where, ERRP));
  assert_int_equal(1, where.remote);
  assert_int_equal(KVR_PREFILL_REMOTE, where.reason);
  assert_int_equal(11, where.worker_id);
  assert_true(where.bootstrap_room >= 0);
  assert_int_equal(1, kvt_metrics(prefill).requests_active);
  /* Decode with the decode pin. */
  hints.decode_worker_id = 20;
  KVT_OK(kvr_disagg_route_decode(disagg, prompt, 8 * BS, &req, &hints, 1, &out, ERRP));
  assert_int_equal(20, out.worker_id);
  assert_int_equal(1, kvt_metrics(decode).requests_active);
  KVT_OK(kvr_router_free_request(prefill, "r", ERRP));
  KVT_OK(kvr_router_free_request(decode, "r", ERRP));
  kvr_disagg_free(disagg);
}

/* Forced decode overrides: no prefill tracking (so nothing counts as prefill load) and no KV
 * reuse, while another override (temperature) is kept. */
static void decode_overrides_are_forced(void** state) {
  kvr_disagg* disagg = make_disagg(NULL);
  kvr_router* decode = kvr_disagg_decode_router(disagg);
  uint32_t prompt[8 * BS];
  kvr_request_options req = kvt_admit("r");
  kvr_route_signals out;
  kvr_potential_load load;
  (void)state;
  kvt_fill_tokens(prompt, 8 * BS, 3);
  add_pool_worker(kvr_disagg_prefill_router(disagg), 10, 1000, 0);
  add_pool_worker(decode, 20, 1000, 0);
  req.track_prefill_tokens = 1; /* the request asks for tracking; decode overrides it */
  req.temperature = 0.5;
  kvr_route_signals_init(&out, sizeof out);
  KVT_OK(kvr_disagg_route_decode(disagg, prompt, 8 * BS, &req, NULL, 1, &out, ERRP));
  load = kvt_load_of(decode, prompt, 8 * BS, 20, 0);
  assert_int_equal(0, load.active_prefill_tokens);
  assert_int_equal(8, load.active_blocks);
  /* Without remote prefill (aggregated), the request's own overrides apply. */
  req.request_id = "agg";
  KVT_OK(kvr_disagg_route_decode(disagg, prompt, 8 * BS, &req, NULL, 0, &out, ERRP));
  load = kvt_load_of(decode, prompt, 8 * BS, 20, 0);
  assert_int_equal(8 * BS, load.active_prefill_tokens);
  /* Shared prompt blocks: the remote-prefill booking used random identities. */
  assert_int_equal(16, load.active_blocks);
  kvr_disagg_free(disagg);
}

static void empty_prefill_pool(void** state) {
  kvr_disagg_options opts;
  kvr_disagg* disagg = make_disagg(NULL);
  uint32_t prompt[2 * BS];
  kvr_request_options req = kvt_admit("r");
  kvr_prefill_result where;
  (void)state;
  kvt_fill_tokens(prompt, 2 * BS, 3);
  add_pool_worker(kvr_disagg_decode_router(disagg), 20, 1000, 0);
  kvr_prefill_result_init(&where, sizeof where);
  KVT_OK(kvr_disagg_route_prefill(disagg, prompt, 2 * BS, &req, NULL, &where, ERRP));
  assert_int_equal(0, where.remote);
  assert_int_equal(KVR_PREFILL_NO_PREFILL_WORKERS, where.reason);
  assert_int_equal(-1, where.bootstrap_room);
  kvr_disagg_free(disagg);

  kvr_disagg_options_init(&opts, sizeof opts);
  opts.enforce = 1;
  disagg = make_disagg(&opts);
  KVT_EXPECT_FAILS(KVR_FAILED_PRECONDITION,
                   kvr_disagg_route_prefill(disagg, prompt, 2 * BS, &req, NULL, &where, ERRP));
  kvr_disagg_free(disagg);
}

static void prefill_worker_busy_is_advisory(void** state) {
  kvr_disagg* disagg = make_disagg(NULL);
  kvr_router* prefill = kvr_disagg_prefill_router(disagg);
  uint32_t prompt[8 * BS];
  int busy = -1;
  uint64_t before = 0, after = 0;
  (void)state;
  kvt_fill_tokens(prompt, 8 * BS, 3);
  /* No prefill worker: busy. */
  KVT_OK(kvr_disagg_prefill_worker_busy(disagg, prompt, 8 * BS, NULL, 1.0, &busy, ERRP));
  assert_int_equal(1, busy);
  add_pool_worker(prefill, 10, 1000, 4 * BS);
  KVT_OK(kvr_router_state_digest(prefill, &before, ERRP));
  /* 8 blocks of prompt against 4 blocks of batch: over threshold 1, under threshold 3. */
  KVT_OK(kvr_disagg_prefill_worker_busy(disagg, prompt, 8 * BS, NULL, 1.0, &busy, ERRP));
  assert_int_equal(1, busy);
  KVT_OK(kvr_disagg_prefill_worker_busy(disagg, prompt, 8 * BS, NULL, 3.0, &busy, ERRP));
  assert_int_equal(0, busy);
  KVT_OK(kvr_router_state_digest(prefill, &after, ERRP));
  assert_true(before == after);
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_disagg_prefill_worker_busy(disagg, prompt, 8 * BS, NULL, -1, &busy, ERRP));
  kvr_disagg_free(disagg);
}

static void conditional_policies_and_decode_guard(void** state) {
  kvr_disagg_options opts;
  kvr_disagg* disagg;
  uint32_t prompt[8 * BS];
  kvr_request_options req = kvt_admit("r");
  kvr_prefill_result where;
  (void)state;
  kvt_fill_tokens(prompt, 8 * BS, 3);
  kvr_prefill_result_init(&where, sizeof where);

  /* isl_bounding: 128 uncached tokens <= 512: local prefill, if the decode guard allows. */
  kvr_disagg_options_init(&opts, sizeof opts);
  opts.policy = KVR_DISAGG_ISL_BOUNDING;
  disagg = make_disagg(&opts);
  add_pool_worker(kvr_disagg_prefill_router(disagg), 10, 1000, 0);
  add_pool_worker(kvr_disagg_decode_router(disagg), 20, 1000, 0);
  /* Guard signal unavailable (no threshold): never bypass. */
  KVT_OK(kvr_disagg_route_prefill(disagg, prompt, 8 * BS, &req, NULL, &where, ERRP));
  assert_int_equal(1, where.remote);
  KVT_OK(kvr_router_free_request(kvr_disagg_prefill_router(disagg), "r", ERRP));
  kvr_disagg_free(disagg);

  opts.decode_busy_threshold = 0.5;
  disagg = make_disagg(&opts);
  add_pool_worker(kvr_disagg_prefill_router(disagg), 10, 1000, 0);
  add_pool_worker(kvr_disagg_decode_router(disagg), 20, 1000, 0);
  KVT_OK(kvr_disagg_route_prefill(disagg, prompt, 8 * BS, &req, NULL, &where, ERRP));
  assert_int_equal(0, where.remote);
  assert_int_equal(KVR_PREFILL_SHORT_ISL, where.reason);
  assert_int_equal(0, kvt_metrics(kvr_disagg_prefill_router(disagg)).requests_active);
  kvr_disagg_free(disagg);

  /* The decode worker is busy (capacity 10 blocks < 8 × 2): remote after all. */
  disagg = make_disagg(&opts);
  add_pool_worker(kvr_disagg_prefill_router(disagg), 10, 1000, 0);
  add_pool_worker(kvr_disagg_decode_router(disagg), 20, 10, 0);
  KVT_OK(kvr_disagg_route_prefill(disagg, prompt, 8 * BS, &req, NULL, &where, ERRP));
  assert_int_equal(1, where.remote);
  kvr_disagg_free(disagg);

  /* A prompt given hashed (KVR_REQUEST_PREHASHED) is as long as its tokens: 128 uncached
   * tokens > 16, remote; and routed as its tokens are. */
  opts.max_local_prefill_tokens = 16;
  disagg = make_disagg(&opts);
  add_pool_worker(kvr_disagg_prefill_router(disagg), 10, 1000, 0);
  add_pool_worker(kvr_disagg_decode_router(disagg), 20, 1000, 0);
  {
    uint64_t hashes[8];
    size_t num_hashes = 0;
    kvr_request_options hashed = kvt_admit("h");
    kvr_route_signals decode;
    KVT_OK(kvr_compute_block_hashes(prompt, 8 * BS, BS, NULL, hashes, 8, &num_hashes, ERRP));
    hashed.flags |= KVR_REQUEST_PREHASHED;
    hashed.local_hashes = hashes;
    hashed.num_local_hashes = num_hashes;
    KVT_OK(kvr_disagg_route_prefill(disagg, NULL, 8 * BS, &hashed, NULL, &where, ERRP));
    assert_int_equal(1, where.remote);
    assert_int_equal(10, where.worker_id);
    kvr_route_signals_init(&decode, sizeof decode);
    KVT_OK(kvr_disagg_route_decode(disagg, NULL, 8 * BS, &hashed, NULL, 1, &decode, ERRP));
    assert_int_equal(20, decode.worker_id);
    assert_int_equal(8 * BS, decode.prompt_tokens);
  }
  kvr_disagg_free(disagg);
  opts.max_local_prefill_tokens = 512;

  /* prefill_load: the prefill pool is busy (batch of 1 block), the prompt is long. */
  opts.policy = KVR_DISAGG_PREFILL_LOAD;
  disagg = make_disagg(&opts);
  add_pool_worker(kvr_disagg_prefill_router(disagg), 10, 1000, BS);
  add_pool_worker(kvr_disagg_decode_router(disagg), 20, 1000, 0);
  KVT_OK(kvr_disagg_route_prefill(disagg, prompt, 8 * BS, &req, NULL, &where, ERRP));
  assert_int_equal(0, where.remote);
  assert_int_equal(KVR_PREFILL_WORKER_BUSY, where.reason);
  kvr_disagg_free(disagg);

  /* isl_or_load with a long prompt and an idle prefill pool: remote. */
  opts.policy = KVR_DISAGG_ISL_OR_LOAD;
  opts.max_local_prefill_tokens = 16;
  disagg = make_disagg(&opts);
  add_pool_worker(kvr_disagg_prefill_router(disagg), 10, 1000, 0);
  add_pool_worker(kvr_disagg_decode_router(disagg), 20, 1000, 0);
  KVT_OK(kvr_disagg_route_prefill(disagg, prompt, 8 * BS, &req, NULL, &where, ERRP));
  assert_int_equal(1, where.remote);
  kvr_disagg_free(disagg);

  opts.policy = 9;
  {
    kvr_router_options pool;
    kvr_disagg* none = NULL;
    kvr_router_options_init(&pool, sizeof pool);
    KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_disagg_new(&pool, &pool, &opts, &none, ERRP));
    assert_null(none);
  }
  kvr_disagg_free(NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(prefill_then_decode),
      cmocka_unit_test(decode_overrides_are_forced),
      cmocka_unit_test(empty_prefill_pool),
      cmocka_unit_test(prefill_worker_busy_is_advisory),
      cmocka_unit_test(conditional_policies_and_decode_guard),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
