/* The error rules that hold for every entry point: a NULL router handle is KVR_INVALID_ARGUMENT
 * (never a crash), `err` may always be NULL, a requested error object carries the returned
 * status and a message, and NULL required out parameters are refused. Each call below is made
 * twice by KVT_EXPECT_FAILS: with err == NULL and with err pointing at a NULL kvr_error*. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>

#include "test_util.h"

/* A router with one worker (id 1) that caches one block of tokens 0..15. */
static int setup(void** state) {
  uint32_t tokens[16];
  kvr_router* router = kvt_router_new(16, 0);
  kvt_fill_tokens(tokens, 16, 0);
  kvt_add_worker(router, 1);
  KVT_OK(kvt_store(router, 1, 0, KVR_TIER_DEVICE, tokens, 1, 16, 1, 0, 0, ERRP));
  *state = router;
  return 0;
}

static int teardown(void** state) {
  kvr_router_free((kvr_router*)*state);
  return 0;
}

static void null_router_everywhere(void** state) {
  uint32_t tokens[16];
  uint64_t hashes[1] = {1};
  kvr_worker_config config;
  kvr_stored_event stored;
  kvr_removed_event removed;
  kvr_request_options opts = kvt_admit("r");
  kvr_route_result result;
  kvr_candidate candidates[2];
  kvr_overlap overlaps[2];
  kvr_potential_load loads[2];
  kvr_buffer* buffer = NULL;
  kvr_metrics metrics;
  char text[64];
  size_t len = 0;
  uint8_t bytes[16] = {0};
  (void)state;

  kvt_fill_tokens(tokens, 16, 0);
  kvr_worker_config_init(&config, sizeof config);
  config.worker_id = 1;
  kvr_stored_event_init(&stored, sizeof stored);
  stored.block_hashes = hashes;
  stored.num_blocks = 1;
  stored.token_ids = tokens;
  stored.num_tokens = 16;
  kvr_removed_event_init(&removed, sizeof removed);
  removed.block_hashes = hashes;
  removed.num_blocks = 1;
  kvr_route_result_init(&result, sizeof result);
  kvr_metrics_init(&metrics, sizeof metrics);

  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_add_worker(NULL, &config, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_update_worker(NULL, &config, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_remove_worker(NULL, 1, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_stored(NULL, &stored, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_removed(NULL, &removed, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_cleared(NULL, 1, 0, 0, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_apply_event_batch(NULL, bytes, sizeof bytes, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_find_best_match(NULL, tokens, 16, &opts, &result,
                                                             candidates, 2, &len, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_overlap_scores(NULL, tokens, 16, NULL, overlaps, 2, &len, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_potential_loads(NULL, tokens, 16, NULL, loads, 2, &len, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_add_request(NULL, tokens, 16, 1, 0, &opts, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_mark_prefill_completed(NULL, "r", ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_free_request(NULL, "r", ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_snapshot(NULL, &buffer, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_restore(NULL, bytes, sizeof bytes, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_get_metrics(NULL, &metrics, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_metrics_prometheus(NULL, text, sizeof text, &len, ERRP));
  assert_null(buffer);
}

static void null_out_parameters(void** state) {
  kvr_router* router = (kvr_router*)*state;
  uint32_t tokens[16];
  size_t len = 0;
  kvt_fill_tokens(tokens, 16, 0);
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_new(NULL, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_find_best_match(router, tokens, 16, NULL, NULL, NULL, 0, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_snapshot(router, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_get_metrics(router, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_compute_block_hashes(tokens, 16, 16, NULL, NULL, 1, &len, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_overlap_scores(router, tokens, 16, NULL, NULL, 1, &len, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_potential_loads(router, tokens, 16, NULL, NULL, 1, &len, ERRP));
}

/* `*len` is an out parameter every array-returning call needs: without it the caller cannot
 * know how many entries were written or are needed. */
static void null_len_refused(void** state) {
  kvr_router* router = (kvr_router*)*state;
  uint32_t tokens[16];
  uint64_t hashes[4];
  kvr_overlap overlaps[4];
  kvr_potential_load loads[4];
  char text[4096];
  kvt_fill_tokens(tokens, 16, 0);
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_compute_block_hashes(tokens, 16, 16, NULL, hashes, 4, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_compute_sequence_hashes(hashes, 1, hashes + 1, 3, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_overlap_scores(router, tokens, 16, NULL, overlaps, 4, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_potential_loads(router, tokens, 16, NULL, loads, 4, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_metrics_prometheus(router, text, sizeof text, NULL, ERRP));
}

/* Errors from every family carry a status from the header and a message. */
static void errors_carry_documented_statuses(void** state) {
  kvr_router* router = kvt_router_new(16, 0);
  uint32_t tokens[16];
  kvr_route_result result;
  kvr_error* err = NULL;
  (void)state;
  kvt_fill_tokens(tokens, 16, 0);
  kvr_route_result_init(&result, sizeof result);
  assert_int_equal(KVR_UNAVAILABLE,
                   kvr_find_best_match(router, tokens, 16, NULL, &result, NULL, 0, NULL, &err));
  assert_string_equal("KVR_UNAVAILABLE", kvr_status_str(kvr_error_status(err)));
  assert_true(strlen(kvr_error_message(err)) > 0);
  kvr_error_free(err);
  err = NULL;
  assert_int_equal(KVR_NOT_FOUND, kvr_router_remove_worker(router, 5, &err));
  assert_string_equal("KVR_NOT_FOUND", kvr_status_str(kvr_error_status(err)));
  kvr_error_free(err);
  kvr_router_free(router);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(null_router_everywhere),
      cmocka_unit_test_setup_teardown(null_out_parameters, setup, teardown),
      cmocka_unit_test_setup_teardown(null_len_refused, setup, teardown),
      cmocka_unit_test(errors_carry_documented_statuses),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
