/* Routing through the C ABI: kvr_find_best_match (preview and admission, the candidate cost
 * breakdown, per-request options), kvr_router_overlap_scores and kvr_router_potential_loads
 * (with their buffer rules), and kvr_request_options / kvr_route_result versioning. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>

#include "test_util.h"

#define BS 16
#define NUM_WORKERS 4
#define SYSTEM_BLOCKS 32 /* a 512-token system prompt */
#define CACHING_WORKER 3

typedef kvt_fixture fixture;

#define REQUEST_TOKENS (SYSTEM_BLOCKS * BS + 3 * BS)

/* Four single-rank workers (ids 1..4). The prompt is a request: a system prompt of
 * SYSTEM_BLOCKS blocks, which worker 3 caches whole, then 3 blocks of question. */
static int setup(void** state) {
  fixture* f = kvt_fixture_new(BS, 0, NUM_WORKERS, REQUEST_TOKENS, 10000);
  kvt_fill_tokens(f->prompt + SYSTEM_BLOCKS * BS, 3 * BS, 90000);
  KVT_OK(kvt_store(f->router, CACHING_WORKER, 0, KVR_TIER_DEVICE, f->prompt, SYSTEM_BLOCKS, BS,
                   1000, 0, 0, ERRP));
  *state = f;
  return 0;
}

static void check_candidates(const kvr_candidate* c, size_t n, const kvr_route_result* result) {
  size_t i;
  size_t chosen = 0;
  double probabilities = 0;
  for (i = 0; i < n; ++i) {
    /* cost = prefill_load_scale·max(0, raw_prefill_blocks − credit) + decode_blocks
     * + request_cost, with the default prefill_load_scale 1 (and no request weight, no decay). */
    assert_true(fabs(c[i].cost -
                     (c[i].prefill_cost + (double)c[i].decode_blocks + c[i].request_cost)) < 1e-9);
    assert_true(c[i].credit_decay == 1.0);
    assert_true(c[i].request_cost == 0.0);
    assert_true(fabs(c[i].prefill_cost - fmax(0.0, c[i].raw_prefill_blocks - c[i].credit)) < 1e-9);
    assert_true(c[i].probability >= 0 && c[i].probability <= 1);
    probabilities += c[i].probability;
    assert_int_equal(c[i].cached_tokens, (uint64_t)llround(c[i].effective_overlap_blocks * BS));
    if (c[i].chosen) {
      ++chosen;
      assert_int_equal(result->worker_id, c[i].worker_id);
      assert_int_equal(result->dp_rank, c[i].dp_rank);
      assert_true(c[i].cost == result->cost);
      assert_int_equal(result->device_overlap_blocks, c[i].device_blocks);
      assert_int_equal(result->cached_tokens, c[i].cached_tokens);
    } else {
      assert_int_equal(0, c[i].chosen);
    }
  }
  assert_int_equal(1, chosen);
  assert_true(fabs(probabilities - 1.0) < 1e-6);
}

static void shared_prefix_lands_on_caching_worker(void** state) {
  fixture* f = (fixture*)*state;
  kvr_route_result result;
  kvr_candidate candidates[8];
  size_t n = 0;
  size_t i;
  kvr_route_result_init(&result, sizeof result);
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, NULL, &result, candidates, 8, &n,
                             ERRP));
  assert_int_equal(CACHING_WORKER, result.worker_id);
  assert_int_equal(0, result.dp_rank);
  assert_int_equal(SYSTEM_BLOCKS + 3, result.prompt_blocks);
  assert_int_equal(REQUEST_TOKENS, result.prompt_tokens);
  assert_int_equal(SYSTEM_BLOCKS, result.device_overlap_blocks);
  assert_true(result.effective_overlap_blocks == SYSTEM_BLOCKS);
  assert_int_equal(SYSTEM_BLOCKS * BS, result.cached_tokens);
  assert_int_equal(0, result.booked);
  assert_int_equal(0, result.queued);

  assert_int_equal(NUM_WORKERS, n);
  check_candidates(candidates, n, &result);
  for (i = 0; i < n; ++i) {
    if (candidates[i].worker_id == CACHING_WORKER) {
      assert_int_equal(SYSTEM_BLOCKS, candidates[i].device_blocks);
      assert_true(candidates[i].credit >= SYSTEM_BLOCKS - 1e-9);
    } else {
      assert_int_equal(0, candidates[i].device_blocks);
      assert_true(candidates[i].cost > result.cost);
    }
  }
}

static void preview_changes_nothing(void** state) {
  fixture* f = (fixture*)*state;
  kvr_route_result result;
  kvr_potential_load before[8];
  kvr_potential_load after[8];
  size_t len_before = 0;
  size_t len_after = 0;
  kvr_request_options opts;
  int i;
  KVT_OK(kvr_router_potential_loads(f->router, f->prompt, REQUEST_TOKENS, NULL, before, 8,
                                    &len_before, ERRP));
  kvr_request_options_init(&opts, sizeof opts);
  opts.request_id = "preview"; /* an id without KVR_REQUEST_ADMIT books nothing */
  for (i = 0; i < 5; ++i) {
    kvr_route_result_init(&result, sizeof result);
    KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, i % 2 ? &opts : NULL, &result,
                               NULL, 0, NULL, ERRP));
    assert_int_equal(0, result.booked);
  }
  assert_int_equal(0, kvt_metrics(f->router).requests_active);
  KVT_OK(kvr_router_potential_loads(f->router, f->prompt, REQUEST_TOKENS, NULL, after, 8,
                                    &len_after, ERRP));
  assert_int_equal(len_before, len_after);
  assert_memory_equal(before, after, len_before * sizeof(kvr_potential_load));
  /* "preview" was never booked: admitting it now works. */
  opts = kvt_admit("preview");
  kvr_route_result_init(&result, sizeof result);
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts, &result, NULL, 0, NULL,
                             ERRP));
  assert_int_equal(1, result.booked);
}

static void admission_raises_load_and_lifecycle_brings_it_back(void** state) {
  fixture* f = (fixture*)*state;
  kvr_route_result result;
  kvr_request_options opts = kvt_admit("req-1");
  kvr_potential_load idle;
  kvr_potential_load load;
  kvr_metrics metrics;
  uint64_t decisions = kvt_metrics(f->router).decisions;

  idle = kvt_load_of(f->router, f->prompt, REQUEST_TOKENS, CACHING_WORKER, 0);
  assert_int_equal(0, idle.active_requests);
  assert_int_equal(0, idle.active_prefill_tokens);
  assert_int_equal(0, idle.active_blocks);

  kvr_route_result_init(&result, sizeof result);
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts, &result, NULL, 0, NULL,
                             ERRP));
  assert_int_equal(CACHING_WORKER, result.worker_id);
  assert_int_equal(1, result.booked);
  assert_int_equal(0, result.queued);
  metrics = kvt_metrics(f->router);
  assert_int_equal(1, metrics.requests_active);
  assert_int_equal(decisions + 1, metrics.decisions);

  load = kvt_load_of(f->router, f->prompt, REQUEST_TOKENS, CACHING_WORKER, 0);
  assert_int_equal(1, load.active_requests);
  /* The uncached part of the prompt is being prefilled. */
  assert_int_equal(REQUEST_TOKENS - SYSTEM_BLOCKS * BS, load.active_prefill_tokens);
  assert_int_equal(SYSTEM_BLOCKS + 3, load.active_blocks);
  assert_true(load.potential_prefill_tokens > idle.potential_prefill_tokens);

  KVT_OK(kvr_router_mark_prefill_completed(f->router, "req-1", ERRP));
  load = kvt_load_of(f->router, f->prompt, REQUEST_TOKENS, CACHING_WORKER, 0);
  assert_int_equal(1, load.active_requests);
  assert_int_equal(0, load.active_prefill_tokens);
  assert_int_equal(SYSTEM_BLOCKS + 3, load.active_blocks);
  /* Idempotent. */
  KVT_OK(kvr_router_mark_prefill_completed(f->router, "req-1", ERRP));

  KVT_OK(kvr_router_free_request(f->router, "req-1", ERRP));
  load = kvt_load_of(f->router, f->prompt, REQUEST_TOKENS, CACHING_WORKER, 0);
  assert_memory_equal(&idle, &load, sizeof load);
  assert_int_equal(0, kvt_metrics(f->router).requests_active);
  KVT_OK(kvr_router_free_request(f->router, "req-1", ERRP));
}

static void distinct_requests_spread(void** state) {
  fixture* f = (fixture*)*state;
  uint32_t prompt[4 * BS];
  char id[32];
  int used[NUM_WORKERS + 1] = {0};
  int i;
  for (i = 0; i < NUM_WORKERS; ++i) {
    kvr_request_options opts;
    kvr_route_result result;
    kvt_fill_tokens(prompt, 4 * BS, 200000 + 1000 * (uint32_t)i);
    snprintf(id, sizeof id, "spread-%d", i);
    opts = kvt_admit(id);
    kvr_route_result_init(&result, sizeof result);
    KVT_OK(kvr_find_best_match(f->router, prompt, 4 * BS, &opts, &result, NULL, 0, NULL, ERRP));
    assert_true(result.worker_id >= 1 && result.worker_id <= NUM_WORKERS);
    assert_int_equal(0, result.device_overlap_blocks);
    ++used[result.worker_id];
  }
  /* Equal, uncached requests: each booking makes its worker costlier, so the four land on
   * four different workers. */
  for (i = 1; i <= NUM_WORKERS; ++i) assert_int_equal(1, used[i]);
  assert_int_equal(NUM_WORKERS, kvt_metrics(f->router).requests_active);
}

static void candidates_buffer_truncates(void** state) {
  fixture* f = (fixture*)*state;
  kvr_route_result result;
  kvr_candidate candidates[3];
  size_t n = 0;
  memset(candidates, 0xAB, sizeof candidates);
  kvr_route_result_init(&result, sizeof result);
  /* Room for one: the decision is made all the same, and the total is reported. */
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, NULL, &result, candidates, 1, &n,
                             ERRP));
  assert_int_equal(NUM_WORKERS, n);
  assert_int_equal(CACHING_WORKER, result.worker_id);
  {
    uint8_t sentinel[sizeof(kvr_candidate)];
    memset(sentinel, 0xAB, sizeof sentinel);
    assert_memory_equal(sentinel, &candidates[1], sizeof(kvr_candidate));
  }
  /* No buffer at all, and no count wanted. */
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, NULL, &result, NULL, 0, NULL,
                             ERRP));
  assert_int_equal(CACHING_WORKER, result.worker_id);
  /* A NULL buffer with room claimed is an error. */
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS,
                                                             NULL, &result, NULL, 4, &n, ERRP));
}

static void allowed_workers(void** state) {
  fixture* f = (fixture*)*state;
  kvr_route_result result;
  kvr_candidate candidates[8];
  size_t n = 0;
  size_t i;
  uint64_t allowed[2] = {1, 2};
  uint64_t nobody[1] = {4242};
  kvr_request_options opts;
  kvr_request_options_init(&opts, sizeof opts);
  opts.allowed_worker_ids = allowed;
  opts.num_allowed_worker_ids = 2;
  kvr_route_result_init(&result, sizeof result);
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts, &result, candidates, 8,
                             &n, ERRP));
  assert_int_equal(2, n);
  assert_true(result.worker_id == 1 || result.worker_id == 2);
  for (i = 0; i < n; ++i) assert_true(candidates[i].worker_id == 1 || candidates[i].worker_id == 2);

  opts.allowed_worker_ids = nobody;
  opts.num_allowed_worker_ids = 1;
  KVT_EXPECT_FAILS(KVR_UNAVAILABLE, kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts,
                                                        &result, NULL, 0, NULL, ERRP));
  opts.allowed_worker_ids = NULL;
  opts.num_allowed_worker_ids = 2;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS,
                                                             &opts, &result, NULL, 0, NULL, ERRP));
}

/* An empty allow-list allows every worker, unless KVR_REQUEST_ALLOW_LIST says it is a list: then
 * none (a tenant filtered down to no worker is not routed on anyone's), whether the pointer is
 * NULL or not, and nothing is booked. */
static void an_empty_allow_list_allows_no_worker(void** state) {
  fixture* f = (fixture*)*state;
  kvr_route_result result;
  kvr_request_options opts;
  kvr_potential_load loads[8];
  size_t n = 99;
  uint64_t spare[1] = {1};
  kvr_request_options_init(&opts, sizeof opts);
  kvr_route_result_init(&result, sizeof result);
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts, &result, NULL, 0, NULL,
                             ERRP));
  opts.flags = KVR_REQUEST_ALLOW_LIST;
  KVT_EXPECT_FAILS_SAYING(KVR_UNAVAILABLE, "no worker is allowed",
                          kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts, &result,
                                              NULL, 0, NULL, ERRP));
  opts.allowed_worker_ids = spare;
  opts.flags = KVR_REQUEST_ALLOW_LIST | KVR_REQUEST_ADMIT;
  opts.request_id = "tenant-without-workers";
  KVT_EXPECT_FAILS(KVR_UNAVAILABLE, kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts,
                                                        &result, NULL, 0, NULL, ERRP));
  assert_int_equal(0, kvt_metrics(f->router).requests_active);
  /* A query over no worker answers nothing. */
  KVT_OK(
      kvr_router_potential_loads(f->router, f->prompt, REQUEST_TOKENS, &opts, loads, 8, &n, ERRP));
  assert_int_equal(0, n);
  /* With one worker in it, the list is an ordinary restriction. */
  opts.num_allowed_worker_ids = 1;
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts, &result, NULL, 0, NULL,
                             ERRP));
  assert_int_equal(1, result.worker_id);
}

static void no_workers_is_unavailable(void** state) {
  kvr_router* router = kvt_router_new(BS, 0);
  uint32_t tokens[32];
  kvr_route_result result;
  (void)state;
  kvt_fill_tokens(tokens, 32, 1);
  kvr_route_result_init(&result, sizeof result);
  result.worker_id = 0xDEAD;
  KVT_EXPECT_FAILS(KVR_UNAVAILABLE,
                   kvr_find_best_match(router, tokens, 32, NULL, &result, NULL, 0, NULL, ERRP));
  /* On failure the result is left untouched. */
  assert_int_equal(0xDEAD, result.worker_id);
  assert_int_equal(0, kvt_metrics(router).decisions);
  kvr_router_free(router);
}

static void admission_needs_request_id(void** state) {
  fixture* f = (fixture*)*state;
  kvr_route_result result;
  kvr_request_options opts = kvt_admit(NULL);
  kvr_route_result_init(&result, sizeof result);
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS,
                                                             &opts, &result, NULL, 0, NULL, ERRP));
  opts.request_id = "";
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS,
                                                             &opts, &result, NULL, 0, NULL, ERRP));
  assert_int_equal(0, kvt_metrics(f->router).requests_active);
}

static void duplicate_request_id(void** state) {
  fixture* f = (fixture*)*state;
  kvr_route_result result;
  kvr_request_options opts = kvt_admit("dup");
  kvr_route_result_init(&result, sizeof result);
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts, &result, NULL, 0, NULL,
                             ERRP));
  KVT_EXPECT_FAILS(KVR_ALREADY_EXISTS, kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS,
                                                           &opts, &result, NULL, 0, NULL, ERRP));
  /* A chosen-elsewhere booking under the same id is refused too. */
  KVT_EXPECT_FAILS(KVR_ALREADY_EXISTS,
                   kvr_router_add_request(f->router, f->prompt, REQUEST_TOKENS, 1, 0, &opts, ERRP));
  assert_int_equal(1, kvt_metrics(f->router).requests_active);
  /* Once freed, the id may be used again. */
  KVT_OK(kvr_router_free_request(f->router, "dup", ERRP));
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts, &result, NULL, 0, NULL,
                             ERRP));
}

static void request_ids_are_copied(void** state) {
  fixture* f = (fixture*)*state;
  kvr_route_result result;
  char id[16] = "copied-id";
  kvr_request_options opts = kvt_admit(id);
  kvr_route_result_init(&result, sizeof result);
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts, &result, NULL, 0, NULL,
                             ERRP));
  /* The caller's buffer is reused: the router kept its own copy of the id. */
  memset(id, 'x', sizeof id - 1);
  KVT_OK(kvr_router_free_request(f->router, "copied-id", ERRP));
  assert_int_equal(0, kvt_metrics(f->router).requests_active);
}

static void per_request_overrides(void** state) {
  fixture* f = (fixture*)*state;
  kvr_route_result result;
  kvr_candidate candidates[8];
  size_t n = 0;
  size_t i;
  kvr_request_options opts;
  /* Without KV credit the cached prompt is worth nothing: every candidate's credit is 0. */
  kvr_request_options_init(&opts, sizeof opts);
  opts.overlap_score_credit = 0;
  kvr_route_result_init(&result, sizeof result);
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts, &result, candidates, 8,
                             &n, ERRP));
  for (i = 0; i < n; ++i) assert_true(candidates[i].credit == 0);

  /* prefill_load_scale 0: only decode blocks count. */
  kvr_request_options_init(&opts, sizeof opts);
  opts.prefill_load_scale = 0;
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts, &result, candidates, 8,
                             &n, ERRP));
  for (i = 0; i < n; ++i) {
    assert_true(candidates[i].prefill_cost == 0);
    assert_true(candidates[i].cost == (double)candidates[i].decode_blocks);
  }

  /* A high temperature gives every worker a chance. */
  kvr_request_options_init(&opts, sizeof opts);
  opts.temperature = 100.0;
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts, &result, candidates, 8,
                             &n, ERRP));
  for (i = 0; i < n; ++i) assert_true(candidates[i].probability > 0);

  /* An invalid override is refused. */
  kvr_request_options_init(&opts, sizeof opts);
  opts.temperature = -1;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS,
                                                             &opts, &result, NULL, 0, NULL, ERRP));
  kvr_request_options_init(&opts, sizeof opts);
  opts.host_cache_hit_weight = 3;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS,
                                                             &opts, &result, NULL, 0, NULL, ERRP));

  /* Prefill tracking off: admitted requests add no prefill tokens. */
  kvr_request_options_init(&opts, sizeof opts);
  opts.flags = KVR_REQUEST_ADMIT;
  opts.request_id = "untracked";
  opts.track_prefill_tokens = 0;
  opts.assume_kv_reuse = 1;
  opts.expected_output_tokens = 100;
  opts.priority_jump = 1;
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts, &result, NULL, 0, NULL,
                             ERRP));
  assert_int_equal(
      0,
      kvt_load_of(f->router, f->prompt, REQUEST_TOKENS, result.worker_id, 0).active_prefill_tokens);
}

/* Dynamo's newer cost knobs through the options and per request: the request weight charges
 * each active request, the decay shrinks the credit of a rank with a longer prefill queue. */
static void newer_cost_knobs(void** state) {
  kvr_router_options opts;
  kvr_router* router;
  kvr_request_options ro;
  kvr_route_result result;
  kvr_candidate c[2];
  size_t n = 0;
  uint32_t tokens[4 * BS];
  (void)state;
  kvr_router_options_init(&opts, sizeof opts);
  assert_true(opts.overlap_score_credit_decay == 0.0);
  assert_true(opts.decode_active_request_weight == 0.0);
  opts.decode_active_request_weight = 2.5;
  router = kvt_router_new_opts(&opts);
  kvt_add_worker(router, 1);
  kvt_add_worker(router, 2);
  kvt_fill_tokens(tokens, 4 * BS, 5);
  kvr_request_options_init(&ro, sizeof ro);
  ro.request_id = "a";
  KVT_OK(kvr_router_add_request(router, tokens, BS, 1, 0, &ro, ERRP));
  ro.request_id = "b";
  kvt_fill_tokens(tokens, 4 * BS, 500);
  KVT_OK(kvr_router_add_request(router, tokens, BS, 1, 0, &ro, ERRP));
  kvr_request_options_init(&ro, sizeof ro);
  kvr_route_result_init(&result, sizeof result);
  kvt_fill_tokens(tokens, 4 * BS, 9000);
  KVT_OK(kvr_find_best_match(router, tokens, 4 * BS, &ro, &result, c, 2, &n, ERRP));
  assert_int_equal(2, n);
  assert_int_equal(1, c[0].worker_id);
  assert_int_equal(2, c[0].active_requests);
  assert_true(c[0].request_cost == 5.0);
  assert_true(fabs(c[0].cost - (c[0].prefill_cost + (double)c[0].decode_blocks + 5.0)) < 1e-9);
  /* Per request: NaN keeps the router's weight, a value replaces it. */
  ro.decode_active_request_weight = 0.0;
  KVT_OK(kvr_find_best_match(router, tokens, 4 * BS, &ro, &result, c, 2, &n, ERRP));
  assert_true(c[0].request_cost == 0.0);
  ro.decode_active_request_weight = -1.0;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_find_best_match(router, tokens, 4 * BS, &ro, &result, c, 2, &n, ERRP));
  kvr_router_free(router);

  /* A caller built against 0.1's first options struct (no knobs): garbage beyond it is not read. */
  kvr_router_options_init(&opts, sizeof opts);
  opts.overlap_score_credit_decay = -7;
  opts.struct_size = (uint32_t)offsetof(kvr_router_options, overlap_score_credit_decay);
  router = kvt_router_new_opts(&opts);
  kvr_router_free(router);
  opts.struct_size = (uint32_t)sizeof opts;
  router = NULL;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_new(&opts, &router, ERRP));
}

/* Output tracking: a request's generated tokens become blocks on its rank. */
static void output_blocks_are_tracked(void** state) {
  kvr_router_options opts;
  kvr_router* router;
  kvr_request_options ro;
  kvr_potential_load load;
  uint32_t tokens[2 * BS];
  (void)state;
  kvr_router_options_init(&opts, sizeof opts);
  opts.flags = KVR_ROUTER_TRACK_OUTPUT_BLOCKS;
  router = kvt_router_new_opts(&opts);
  kvt_add_worker(router, 1);
  kvt_fill_tokens(tokens, 2 * BS, 1);
  kvr_request_options_init(&ro, sizeof ro);
  ro.request_id = "gen";
  KVT_OK(kvr_router_add_request(router, tokens, 2 * BS, 1, 0, &ro, ERRP));
  load = kvt_load_of(router, tokens, 0, 1, 0);
  assert_int_equal(2, load.active_blocks);
  KVT_OK(kvr_router_record_output(router, "gen", 3 * BS + 1, ERRP)); /* 4 more blocks */
  load = kvt_load_of(router, tokens, 0, 1, 0);
  assert_int_equal(6, load.active_blocks);
  KVT_OK(kvr_router_record_output(router, "unknown", 100, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_record_output(router, NULL, 1, ERRP));
  KVT_OK(kvr_router_free_request(router, "gen", ERRP));
  load = kvt_load_of(router, tokens, 0, 1, 0);
  assert_int_equal(0, load.active_blocks);
  kvr_router_free(router);

  router = kvt_router_new(BS, 0); /* not tracking */
  kvt_add_worker(router, 1);
  KVT_OK(kvr_router_add_request(router, tokens, 2 * BS, 1, 0, &ro, ERRP));
  KVT_EXPECT_FAILS(KVR_FAILED_PRECONDITION, kvr_router_record_output(router, "gen", 40, ERRP));
  kvr_router_free(router);
}

static void overlap_scores(void** state) {
  fixture* f = (fixture*)*state;
  kvr_overlap scores[4];
  size_t len = 0;
  uint32_t unknown[64];
  KVT_OK(
      kvr_router_overlap_scores(f->router, f->prompt, REQUEST_TOKENS, NULL, scores, 4, &len, ERRP));
  assert_int_equal(1, len);
  assert_int_equal(CACHING_WORKER, scores[0].worker_id);
  assert_int_equal(0, scores[0].dp_rank);
  assert_int_equal(SYSTEM_BLOCKS, scores[0].device_blocks);
  assert_int_equal(0, scores[0].host_blocks);
  assert_int_equal(0, scores[0].disk_blocks);
  assert_int_equal(0, scores[0].external_blocks);
  assert_true(scores[0].effective_overlap_blocks == SYSTEM_BLOCKS);
  assert_int_equal(SYSTEM_BLOCKS * BS, scores[0].cached_tokens);
  assert_int_equal(SYSTEM_BLOCKS, scores[0].tree_size);

  kvt_fill_tokens(unknown, 64, 777777);
  len = 99;
  KVT_OK(kvr_router_overlap_scores(f->router, unknown, 64, NULL, scores, 4, &len, ERRP));
  assert_int_equal(0, len);
  /* Empty prompt: nothing matches. */
  len = 99;
  KVT_OK(kvr_router_overlap_scores(f->router, NULL, 0, NULL, scores, 4, &len, ERRP));
  assert_int_equal(0, len);
}

/* A prompt hashed by the caller gets the same overlap as its tokens: the index is walked with
 * the same local hashes, none are computed. */
static void overlap_scores_of_hashes(void** state) {
  fixture* f = (fixture*)*state;
  uint64_t hashes[REQUEST_TOKENS / BS];
  kvr_overlap from_tokens[4];
  kvr_overlap from_hashes[4];
  kvr_request_options opts;
  size_t num_hashes = 0;
  size_t len = 0;
  size_t len_hashed = 0;
  KVT_OK(kvr_compute_block_hashes(f->prompt, REQUEST_TOKENS, BS, NULL, hashes, REQUEST_TOKENS / BS,
                                  &num_hashes, ERRP));
  KVT_OK(kvr_router_overlap_scores(f->router, f->prompt, REQUEST_TOKENS, NULL, from_tokens, 4, &len,
                                   ERRP));
  KVT_OK(kvr_router_overlap_scores_hashed(f->router, hashes, num_hashes, NULL, from_hashes, 4,
                                          &len_hashed, ERRP));
  assert_int_equal(1, len);
  assert_int_equal(len, len_hashed);
  assert_memory_equal(from_tokens, from_hashes, sizeof(kvr_overlap));
  /* A prefix of the hashes matches a prefix. */
  KVT_OK(kvr_router_overlap_scores_hashed(f->router, hashes, 2, NULL, from_hashes, 4, &len, ERRP));
  assert_int_equal(1, len);
  assert_int_equal(2, from_hashes[0].device_blocks);
  /* The tier weights of the options apply; nothing matches nothing; bad arguments refused. */
  kvr_request_options_init(&opts, sizeof opts);
  opts.host_cache_hit_weight = -1;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_overlap_scores_hashed(f->router, hashes, num_hashes, &opts,
                                                    from_hashes, 4, &len, ERRP));
  KVT_OK(kvr_router_overlap_scores_hashed(f->router, NULL, 0, NULL, from_hashes, 4, &len, ERRP));
  assert_int_equal(0, len);
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_overlap_scores_hashed(
                                             f->router, NULL, 3, NULL, from_hashes, 4, &len, ERRP));
  KVT_EXPECT_FAILS(
      KVR_BUFFER_TOO_SMALL,
      kvr_router_overlap_scores_hashed(f->router, hashes, num_hashes, NULL, NULL, 0, &len, ERRP));
  assert_int_equal(1, len);
}

/* KVR_REQUEST_PREHASHED: a prompt given as its local hashes (and its length) routes, previews,
 * plans, books and prices exactly as its tokens do; the counts must agree, and tokens beside the
 * hashes are refused. */
static void prehashed_prompts_route_as_their_tokens(void** state) {
  fixture* f = (fixture*)*state;
  enum { BLOCKS = REQUEST_TOKENS / BS, PROMPT = REQUEST_TOKENS + 5 }; /* a partial last block */
  uint32_t tokens[PROMPT];
  uint64_t hashes[BLOCKS];
  size_t num_hashes = 0;
  kvr_request_options hashed;
  kvr_request_options admit = kvt_admit("hashed-1");
  kvr_route_result from_tokens, from_hashes;
  kvr_candidate by_tokens[NUM_WORKERS], by_hashes[NUM_WORKERS];
  kvr_route_signals preview, plan;
  kvr_potential_load load;
  size_t n = 0;
  memcpy(tokens, f->prompt, sizeof(uint32_t) * REQUEST_TOKENS);
  kvt_fill_tokens(tokens + REQUEST_TOKENS, 5, 70000);
  KVT_OK(kvr_compute_block_hashes(tokens, PROMPT, BS, NULL, hashes, BLOCKS, &num_hashes, ERRP));
  assert_int_equal(BLOCKS, num_hashes);
  kvr_request_options_init(&hashed, sizeof hashed);
  hashed.flags = KVR_REQUEST_PREHASHED;
  hashed.local_hashes = hashes;
  hashed.num_local_hashes = num_hashes;

  kvr_route_result_init(&from_tokens, sizeof from_tokens);
  kvr_route_result_init(&from_hashes, sizeof from_hashes);
  KVT_OK(kvr_find_best_match(f->router, tokens, PROMPT, NULL, &from_tokens, by_tokens, NUM_WORKERS,
                             &n, ERRP));
  KVT_OK(kvr_find_best_match(f->router, NULL, PROMPT, &hashed, &from_hashes, by_hashes, NUM_WORKERS,
                             &n, ERRP));
  assert_memory_equal(&from_tokens, &from_hashes, sizeof from_tokens);
  assert_memory_equal(by_tokens, by_hashes, sizeof by_tokens);
  assert_int_equal(CACHING_WORKER, from_hashes.worker_id);
  assert_int_equal(PROMPT, from_hashes.prompt_tokens);
  assert_int_equal(BLOCKS, from_hashes.prompt_blocks);

  kvr_route_signals_init(&preview, sizeof preview);
  KVT_OK(kvr_preview_route(f->router, NULL, PROMPT, &hashed, NULL, &preview, ERRP));
  assert_int_equal(CACHING_WORKER, preview.worker_id);
  assert_int_equal(SYSTEM_BLOCKS, preview.overlap_blocks);

  /* Booked from its hashes, the request weighs on its rank as one booked from its tokens. */
  admit.flags |= KVR_REQUEST_PREHASHED;
  admit.local_hashes = hashes;
  admit.num_local_hashes = num_hashes;
  kvr_route_signals_init(&plan, sizeof plan);
  KVT_OK(kvr_plan_route(f->router, NULL, PROMPT, &admit, NULL, &preview, &plan, ERRP));
  assert_int_equal(CACHING_WORKER, plan.worker_id);
  assert_int_equal(1, plan.booked);
  KVT_OK(kvr_commit_route(f->router, "hashed-1", ERRP));
  load = kvt_load_of(f->router, tokens, PROMPT, CACHING_WORKER, 0);
  assert_int_equal(1, load.active_requests);
  assert_int_equal(PROMPT - SYSTEM_BLOCKS * BS, load.active_prefill_tokens);
  assert_int_equal(BLOCKS, load.active_blocks);
  admit.request_id = "hashed-2";
  KVT_OK(kvr_router_add_request(f->router, NULL, PROMPT, 1, 0, &admit, ERRP));
  assert_int_equal(1, kvt_load_of(f->router, tokens, PROMPT, 1, 0).active_requests);
  KVT_OK(kvr_router_free_request(f->router, "hashed-1", ERRP));
  KVT_OK(kvr_router_free_request(f->router, "hashed-2", ERRP));
  assert_int_equal(0, kvt_metrics(f->router).requests_active);

  /* A hash count that is not the prompt's complete blocks, tokens beside the hashes, and hashes
   * missing are refused, saying so. */
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "local hashes were given",
                          kvr_find_best_match(f->router, NULL, PROMPT + BS, &hashed, &from_hashes,
                                              NULL, 0, NULL, ERRP));
  KVT_EXPECT_FAILS_SAYING(
      KVR_INVALID_ARGUMENT, "tokens must be NULL",
      kvr_preview_route(f->router, tokens, PROMPT, &hashed, NULL, &preview, ERRP));
  hashed.local_hashes = NULL;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_find_best_match(f->router, NULL, PROMPT, &hashed,
                                                             &from_hashes, NULL, 0, NULL, ERRP));
  /* A prompt shorter than a block has no hash: none is needed. */
  hashed.num_local_hashes = 0;
  KVT_OK(kvr_find_best_match(f->router, NULL, BS - 1, &hashed, &from_hashes, NULL, 0, NULL, ERRP));
  assert_int_equal(BS - 1, from_hashes.prompt_tokens);
  assert_int_equal(0, from_hashes.prompt_blocks);
}

/* The walk alone: per rank the same tiers and tree size as the overlap rows, and the buffer
 * rules of every per-rank query. */
static void find_matches_is_the_walk_of_overlap_scores(void** state) {
  fixture* f = (fixture*)*state;
  uint64_t hashes[REQUEST_TOKENS / BS];
  kvr_overlap scores[4];
  kvr_match matches[4];
  kvr_match one[1];
  size_t num_hashes = 0, num_scores = 0, len = 0, i, j;
  /* Rank (1, 0) holds the first half of the system prompt on the device, rank (2, 0) all of it
   * on the host tier. */
  KVT_OK(kvt_store(f->router, 1, 0, KVR_TIER_DEVICE, f->prompt, SYSTEM_BLOCKS / 2, BS, 5000, 0, 0,
                   ERRP));
  KVT_OK(kvt_store(f->router, 2, 0, KVR_TIER_HOST_PINNED, f->prompt, SYSTEM_BLOCKS, BS, 6000, 0, 0,
                   ERRP));
  KVT_OK(kvr_compute_block_hashes(f->prompt, REQUEST_TOKENS, BS, NULL, hashes, REQUEST_TOKENS / BS,
                                  &num_hashes, ERRP));
  KVT_OK(kvr_router_overlap_scores_hashed(f->router, hashes, num_hashes, NULL, scores, 4,
                                          &num_scores, ERRP));
  memset(matches, 0xAB, sizeof matches);
  KVT_OK(kvr_router_find_matches(f->router, hashes, num_hashes, matches, 4, &len, ERRP));
  assert_int_equal(3, len);
  assert_int_equal(num_scores, len);
  for (i = 0; i < len; ++i) {
    const kvr_match* m = &matches[i];
    const kvr_overlap* o = NULL;
    for (j = 0; j < num_scores; ++j) {
      if (scores[j].worker_id == m->worker_id && scores[j].dp_rank == m->dp_rank) o = &scores[j];
    }
    assert_non_null(o);
    assert_int_equal(o->device_blocks, m->device_blocks);
    assert_int_equal(o->host_blocks, m->host_blocks);
    assert_int_equal(o->disk_blocks, m->disk_blocks);
    assert_int_equal(o->external_blocks, m->external_blocks);
    assert_int_equal(o->tree_size, m->tree_size);
    assert_int_equal(0, m->reserved0);
    if (m->worker_id == 1) assert_int_equal(SYSTEM_BLOCKS / 2, m->device_blocks);
    if (m->worker_id == 2) {
      assert_int_equal(0, m->device_blocks);
      assert_int_equal(SYSTEM_BLOCKS, m->host_blocks);
      assert_int_equal(SYSTEM_BLOCKS, m->tree_size);
    }
  }
  /* Too small: nothing written, the rows needed reported. */
  memset(one, 0xAB, sizeof one);
  KVT_EXPECT_FAILS(KVR_BUFFER_TOO_SMALL,
                   kvr_router_find_matches(f->router, hashes, num_hashes, one, 1, &len, ERRP));
  assert_int_equal(3, len);
  {
    uint8_t sentinel[sizeof one];
    memset(sentinel, 0xAB, sizeof sentinel);
    assert_memory_equal(sentinel, one, sizeof one);
  }
  /* Nothing matches nothing; NULL hashes, NULL len and NULL router are refused. */
  KVT_OK(kvr_router_find_matches(f->router, NULL, 0, matches, 4, &len, ERRP));
  assert_int_equal(0, len);
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_find_matches(f->router, NULL, 3, matches, 4, &len, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_find_matches(f->router, hashes, num_hashes, matches, 4, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_find_matches(NULL, hashes, num_hashes, matches, 4, &len, ERRP));
}

/* A stored event naming blocks by engine hash alone is a copy to its tier: the caching worker's
 * system prompt copied to host memory, then removed from the device, is still matched on the
 * host tier; a name the worker does not hold is reported, the others still copied. */
static void stored_event_without_tokens_copies_held_blocks(void** state) {
  fixture* f = (fixture*)*state;
  uint64_t engine[SYSTEM_BLOCKS + 1];
  uint64_t hashes[REQUEST_TOKENS / BS];
  kvr_stored_event copy;
  kvr_removed_event removal;
  kvr_match matches[NUM_WORKERS];
  size_t num_hashes = 0, len = 0, i;
  for (i = 0; i < SYSTEM_BLOCKS; ++i) engine[i] = 1000 + i; /* the fixture's engine hashes */
  engine[SYSTEM_BLOCKS] = 424242;                           /* never stored */
  kvr_stored_event_init(&copy, sizeof copy);
  copy.worker_id = CACHING_WORKER;
  copy.tier = KVR_TIER_HOST_PINNED;
  copy.block_hashes = engine;
  copy.num_blocks = SYSTEM_BLOCKS + 1;
  KVT_EXPECT_FAILS(KVR_NOT_FOUND, kvr_router_apply_stored(f->router, &copy, ERRP));
  kvr_removed_event_init(&removal, sizeof removal);
  removal.worker_id = CACHING_WORKER;
  removal.tier = KVR_TIER_DEVICE;
  removal.block_hashes = engine;
  removal.num_blocks = SYSTEM_BLOCKS;
  KVT_OK(kvr_router_apply_removed(f->router, &removal, ERRP));
  KVT_OK(kvr_compute_block_hashes(f->prompt, REQUEST_TOKENS, BS, NULL, hashes, REQUEST_TOKENS / BS,
                                  &num_hashes, ERRP));
  KVT_OK(kvr_router_find_matches(f->router, hashes, num_hashes, matches, NUM_WORKERS, &len, ERRP));
  assert_int_equal(1, len);
  assert_int_equal(CACHING_WORKER, matches[0].worker_id);
  assert_int_equal(0, matches[0].device_blocks);
  assert_int_equal(SYSTEM_BLOCKS, matches[0].host_blocks);
}

static void overlap_scores_buffer_too_small_then_retry(void** state) {
  fixture* f = (fixture*)*state;
  kvr_overlap one[1];
  kvr_overlap* retry;
  size_t len = 0;
  /* A second rank caches the first half of the system prompt. */
  KVT_OK(kvt_store(f->router, 1, 0, KVR_TIER_DEVICE, f->prompt, SYSTEM_BLOCKS / 2, BS, 5000, 0, 0,
                   ERRP));
  memset(one, 0xAB, sizeof one);
  KVT_EXPECT_FAILS(
      KVR_BUFFER_TOO_SMALL,
      kvr_router_overlap_scores(f->router, f->prompt, REQUEST_TOKENS, NULL, one, 1, &len, ERRP));
  assert_int_equal(2, len);
  {
    uint8_t sentinel[sizeof one];
    memset(sentinel, 0xAB, sizeof sentinel);
    assert_memory_equal(sentinel, one, sizeof one); /* untouched on failure */
  }
  retry = (kvr_overlap*)calloc(len, sizeof(kvr_overlap));
  assert_non_null(retry);
  KVT_OK(kvr_router_overlap_scores(f->router, f->prompt, REQUEST_TOKENS, NULL, retry, len, &len,
                                   ERRP));
  assert_int_equal(2, len);
  assert_true((retry[0].worker_id == 1 && retry[0].device_blocks == SYSTEM_BLOCKS / 2) ||
              (retry[1].worker_id == 1 && retry[1].device_blocks == SYSTEM_BLOCKS / 2));
  free(retry);
}

static void potential_loads_buffer_too_small_then_retry(void** state) {
  fixture* f = (fixture*)*state;
  kvr_potential_load two[2];
  kvr_potential_load* retry;
  size_t len = 0;
  size_t i;
  KVT_EXPECT_FAILS(
      KVR_BUFFER_TOO_SMALL,
      kvr_router_potential_loads(f->router, f->prompt, REQUEST_TOKENS, NULL, two, 2, &len, ERRP));
  assert_int_equal(NUM_WORKERS, len);
  retry = (kvr_potential_load*)calloc(len, sizeof(kvr_potential_load));
  assert_non_null(retry);
  KVT_OK(kvr_router_potential_loads(f->router, f->prompt, REQUEST_TOKENS, NULL, retry, len, &len,
                                    ERRP));
  assert_int_equal(NUM_WORKERS, len);
  for (i = 0; i < len; ++i) {
    const kvr_potential_load* l = &retry[i];
    assert_int_equal(0, l->active_requests);
    if (l->worker_id == CACHING_WORKER) {
      assert_int_equal(REQUEST_TOKENS - SYSTEM_BLOCKS * BS, l->potential_prefill_tokens);
    } else {
      assert_int_equal(REQUEST_TOKENS, l->potential_prefill_tokens);
    }
    assert_int_equal(SYSTEM_BLOCKS + 3, l->potential_decode_blocks);
  }
  free(retry);
}

static void request_options_struct_size_rules(void** state) {
  fixture* f = (fixture*)*state;
  kvr_route_result result;
  kvr_request_options opts;
  kvr_overlap scores[4];
  kvr_potential_load loads[4];
  size_t len = 0;
  struct {
    kvr_request_options base;
    uint64_t tail[2];
  } newer;
  kvr_request_options_init(&opts, sizeof opts);
  opts.struct_size = 0;
  kvr_route_result_init(&result, sizeof result);
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS,
                                                             &opts, &result, NULL, 0, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_overlap_scores(f->router, f->prompt, REQUEST_TOKENS, &opts, scores, 4,
                                             &len, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_potential_loads(f->router, f->prompt, REQUEST_TOKENS, &opts, loads, 4,
                                              &len, ERRP));

  /* Older caller: the first released layout ended with queue_timeout_ms; the newer overrides
   * past it are not read (a negative decay would be refused). */
  memset(&opts, 0xAB, sizeof opts);
  KVT_OK(kvr_request_options_init(&opts, KVT_LAYOUT_END(kvr_request_options, queue_timeout_ms)));
  opts.flags = KVR_REQUEST_ADMIT;
  opts.request_id = "older";
  opts.overlap_score_credit_decay = -3;
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts, &result, NULL, 0, NULL,
                             ERRP));
  assert_int_equal(1, result.booked);
  assert_int_equal(CACHING_WORKER, result.worker_id);

  /* Shorter than that: refused. */
  opts.request_id = "shorter";
  opts.struct_size = (uint32_t)offsetof(kvr_request_options, overlap_score_credit);
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "first released layout",
                          kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts, &result,
                                              NULL, 0, NULL, ERRP));

  /* Newer caller. */
  memset(&newer, 0xAB, sizeof newer);
  KVT_OK(kvr_request_options_init(&newer.base, sizeof newer));
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &newer.base, &result, NULL, 0,
                             NULL, ERRP));
  newer.tail[0] = 5;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &newer.base, &result,
                                       NULL, 0, NULL, ERRP));
}

/* A result struct is written no further than its struct_size: a newer caller's tail keeps
 * the zeros its _init wrote; a struct shorter than the first released layout is refused and
 * left untouched. */
static void route_result_struct_size_rules(void** state) {
  fixture* f = (fixture*)*state;
  kvr_route_result result;
  struct {
    kvr_route_result base;
    uint64_t tail[2];
  } newer;
  const size_t covered = offsetof(kvr_route_result, effective_overlap_blocks);
  uint8_t sentinel[sizeof(kvr_route_result)];
  memset(&newer, 0xAB, sizeof newer);
  KVT_OK(kvr_route_result_init(&newer.base, sizeof newer));
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, NULL, &newer.base, NULL, 0, NULL,
                             ERRP));
  assert_int_equal(sizeof newer, newer.base.struct_size);
  assert_int_equal(CACHING_WORKER, newer.base.worker_id);
  assert_int_equal(SYSTEM_BLOCKS, newer.base.device_overlap_blocks);
  assert_int_equal(0, newer.tail[0]);
  assert_int_equal(0, newer.tail[1]);

  memset(&result, 0xAB, sizeof result);
  memset(sentinel, 0xAB, sizeof sentinel);
  result.struct_size = (uint32_t)covered;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "first released layout",
                          kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, NULL, &result,
                                              NULL, 0, NULL, ERRP));
  assert_int_equal(covered, result.struct_size);
  assert_memory_equal(sentinel + sizeof(uint32_t), (uint8_t*)&result + sizeof(uint32_t),
                      sizeof result - sizeof(uint32_t));

  kvr_route_result_init(&result, sizeof result);
  result.struct_size = 0;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS,
                                                             NULL, &result, NULL, 0, NULL, ERRP));
}

/* A result struct that cannot take the result is refused before anything happens: an admitted
 * request is not booked (the caller would never learn where). */
static void refused_result_books_nothing(void** state) {
  fixture* f = (fixture*)*state;
  kvr_route_result result;
  kvr_request_options opts;
  kvr_request_options_init(&opts, sizeof opts);
  opts.flags = KVR_REQUEST_ADMIT;
  opts.request_id = "never-booked";
  kvr_route_result_init(&result, sizeof result);
  result.struct_size = 8;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS,
                                                             &opts, &result, NULL, 0, NULL, ERRP));
  assert_int_equal(0, kvt_metrics(f->router).requests_active);
  assert_int_equal(0, kvt_metrics(f->router).decisions);
  /* The id is free: booking it now works. */
  kvr_route_result_init(&result, sizeof result);
  KVT_OK(kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts, &result, NULL, 0, NULL,
                             ERRP));
  assert_int_equal(1, kvt_metrics(f->router).requests_active);
  /* An unknown request flag is refused, and books nothing either. */
  opts.request_id = "flagged";
  opts.flags = KVR_REQUEST_ADMIT | 0x10u;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "kvr_request_options.flags",
                          kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS, &opts, &result,
                                              NULL, 0, NULL, ERRP));
  assert_int_equal(1, kvt_metrics(f->router).requests_active);
}

/* KVR_COST_PREDICTED_TTFT through the C ABI, on a router whose clock the test drives with
 * kvr_router_set_time: every request takes 100 ms from booking to first token, so the prefill
 * rate is 560 tokens / 0.1 s = 5,600 tokens/s, and each candidate's cost is seconds. */
static void predicted_ttft_prices_seconds_at_the_learnt_rate(void** state) {
  fixture* f = (fixture*)*state;
  kvr_router_options options;
  kvr_router* router = NULL;
  kvr_request_options req;
  kvr_route_result result;
  kvr_candidate c[NUM_WORKERS];
  size_t n = 0;
  uint64_t id;
  int i;
  int64_t now = 5000000000;
  char name[32];
  uint32_t fresh[SYSTEM_BLOCKS * BS];   /* cached nowhere */
  uint32_t backlog[SYSTEM_BLOCKS * BS]; /* booked on worker 1 */
  const double rate = REQUEST_TOKENS / 0.1;
  kvt_fill_tokens(fresh, SYSTEM_BLOCKS * BS, 500000);
  kvt_fill_tokens(backlog, SYSTEM_BLOCKS * BS, 700000);
  KVT_OK(kvr_router_options_init(&options, sizeof options));
  assert_int_equal(KVR_COST_CREDIT, options.cost_function);
  assert_true(options.ttft_miss_weight == 3.0);
  assert_true(options.prefill_tokens_per_second == 0.0);
  options.block_size = BS;
  options.cost_function = KVR_COST_PREDICTED_TTFT;
  KVT_OK(kvr_router_new(&options, &router, ERRP));
  for (id = 1; id <= NUM_WORKERS; ++id) kvt_add_worker(router, id);
  KVT_OK(kvr_router_set_time(router, now, ERRP));
  for (i = 0; i < 4; ++i) {
    for (id = 1; id <= NUM_WORKERS; ++id) {
      snprintf(name, sizeof name, "warm-%d-%d", (int)id, i);
      req = kvt_admit(name);
      KVT_OK(kvr_router_add_request(router, f->prompt, REQUEST_TOKENS, id, 0, &req, ERRP));
      now += 100000000;
      KVT_OK(kvr_router_set_time(router, now, ERRP));
      KVT_OK(kvr_router_mark_prefill_completed(router, name, ERRP));
      KVT_OK(kvr_router_free_request(router, name, ERRP));
    }
  }
  req = kvt_admit("backlog");
  KVT_OK(kvr_router_add_request(router, backlog, SYSTEM_BLOCKS * BS, 1, 0, &req, ERRP));
  KVT_OK(kvr_request_options_init(&req, sizeof req));
  KVT_OK(kvr_route_result_init(&result, sizeof result));
  KVT_OK(kvr_find_best_match(router, fresh, SYSTEM_BLOCKS * BS, &req, &result, c, NUM_WORKERS, &n,
                             ERRP));
  assert_int_equal(NUM_WORKERS, n);
  assert_int_not_equal(1, result.worker_id);
  for (i = 0; i < (int)n; ++i) {
    /* (backlog + 512) / rate + 3 x 512 / rate: 0.457 s behind worker 1's backlog, 0.366 s. */
    const double backlog_tokens = c[i].worker_id == 1 ? SYSTEM_BLOCKS * BS : 0;
    const double expected = (backlog_tokens + 4.0 * SYSTEM_BLOCKS * BS) / rate;
    assert_true(fabs(c[i].cost - expected) < 1e-9);
  }
  /* The credit form, asked for this request only, prices blocks: 512 / 16 + 32 new = 64. */
  req.cost_function = KVR_COST_CREDIT;
  KVT_OK(
      kvr_find_best_match(router, fresh, SYSTEM_BLOCKS * BS, &req, &result, NULL, 0, NULL, ERRP));
  assert_true(result.cost == 64.0);
  /* Time never goes back; unknown cost functions are refused. */
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "earlier",
                          kvr_router_set_time(router, now - 1, ERRP));
  req.cost_function = 7;
  KVT_EXPECT_FAILS_SAYING(
      KVR_INVALID_ARGUMENT, "cost_function",
      kvr_find_best_match(router, fresh, SYSTEM_BLOCKS * BS, &req, &result, NULL, 0, NULL, ERRP));
  kvr_router_free(router);
  options.cost_function = 9;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "cost_function",
                          kvr_router_new(&options, &router, ERRP));
  options.cost_function = KVR_COST_PREDICTED_TTFT;
  options.flags |= KVR_ROUTER_NO_PREFILL_TRACKING;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "prefill tracking",
                          kvr_router_new(&options, &router, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_set_time(NULL, 0, ERRP));
}

static void null_arguments(void** state) {
  fixture* f = (fixture*)*state;
  kvr_route_result result;
  kvr_overlap scores[4];
  kvr_potential_load loads[4];
  size_t len;
  kvr_route_result_init(&result, sizeof result);
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_find_best_match(f->router, f->prompt, REQUEST_TOKENS,
                                                             NULL, NULL, NULL, 0, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_find_best_match(f->router, NULL, REQUEST_TOKENS, NULL,
                                                             &result, NULL, 0, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_overlap_scores(f->router, NULL, 5, NULL, scores, 4, &len, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_potential_loads(f->router, NULL, 5, NULL, loads, 4, &len, ERRP));
  KVT_EXPECT_FAILS(
      KVR_INVALID_ARGUMENT,
      kvr_router_potential_loads(f->router, f->prompt, REQUEST_TOKENS, NULL, NULL, 4, &len, ERRP));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(shared_prefix_lands_on_caching_worker, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(preview_changes_nothing, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(admission_raises_load_and_lifecycle_brings_it_back, setup,
                                      kvt_teardown),
      cmocka_unit_test_setup_teardown(distinct_requests_spread, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(candidates_buffer_truncates, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(allowed_workers, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(an_empty_allow_list_allows_no_worker, setup, kvt_teardown),
      cmocka_unit_test(no_workers_is_unavailable),
      cmocka_unit_test(newer_cost_knobs),
      cmocka_unit_test(output_blocks_are_tracked),
      cmocka_unit_test_setup_teardown(admission_needs_request_id, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(duplicate_request_id, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(request_ids_are_copied, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(per_request_overrides, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(overlap_scores, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(overlap_scores_of_hashes, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(prehashed_prompts_route_as_their_tokens, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(find_matches_is_the_walk_of_overlap_scores, setup,
                                      kvt_teardown),
      cmocka_unit_test_setup_teardown(stored_event_without_tokens_copies_held_blocks, setup,
                                      kvt_teardown),
      cmocka_unit_test_setup_teardown(overlap_scores_buffer_too_small_then_retry, setup,
                                      kvt_teardown),
      cmocka_unit_test_setup_teardown(potential_loads_buffer_too_small_then_retry, setup,
                                      kvt_teardown),
      cmocka_unit_test_setup_teardown(request_options_struct_size_rules, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(route_result_struct_size_rules, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(refused_result_books_nothing, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(predicted_ttft_prices_seconds_at_the_learnt_rate, setup,
                                      kvt_teardown),
      cmocka_unit_test_setup_teardown(null_arguments, setup, kvt_teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
