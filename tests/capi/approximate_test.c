/* Approximate mode (KVR_ROUTER_APPROXIMATE): no KV events; each admitted routing decision is
 * recorded in the index as if the chosen rank had cached the prompt. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>

#include "test_util.h"

#define BS 16
#define PROMPT_BLOCKS 8

typedef kvt_fixture fixture;

/* An approximate-mode router with workers 1..3 and a prompt of PROMPT_BLOCKS blocks. */
static int setup(void** state) {
  *state = kvt_fixture_new(BS, KVR_ROUTER_APPROXIMATE, 3, PROMPT_BLOCKS * BS, 4000);
  return 0;
}

static void admission_is_recorded(void** state) {
  fixture* f = (fixture*)*state;
  kvr_route_result first;
  kvr_route_result second;
  kvr_request_options opts = kvt_admit("first");
  kvr_overlap overlap;

  kvr_route_result_init(&first, sizeof first);
  KVT_OK(kvr_find_best_match(f->router, f->prompt, PROMPT_BLOCKS * BS, &opts, &first, NULL, 0, NULL,
                             ERRP));
  assert_int_equal(1, first.booked);
  assert_int_equal(0, first.device_overlap_blocks);

  /* The decision is in the index now. */
  assert_true(kvt_overlap_of(f->router, f->prompt, PROMPT_BLOCKS * BS, first.worker_id,
                             first.dp_rank, &overlap));
  assert_int_equal(PROMPT_BLOCKS, overlap.device_blocks);
  assert_int_equal(1, kvt_overlap_count(f->router, f->prompt, PROMPT_BLOCKS * BS));

  /* Once the first request is done, an identical one sees the overlap and follows it. */
  KVT_OK(kvr_router_mark_prefill_completed(f->router, "first", ERRP));
  KVT_OK(kvr_router_free_request(f->router, "first", ERRP));
  opts = kvt_admit("second");
  kvr_route_result_init(&second, sizeof second);
  KVT_OK(kvr_find_best_match(f->router, f->prompt, PROMPT_BLOCKS * BS, &opts, &second, NULL, 0,
                             NULL, ERRP));
  assert_int_equal(first.worker_id, second.worker_id);
  assert_int_equal(PROMPT_BLOCKS, second.device_overlap_blocks);
  assert_int_equal(PROMPT_BLOCKS * BS, second.cached_tokens);
}

static void preview_is_not_recorded(void** state) {
  fixture* f = (fixture*)*state;
  kvr_route_result result;
  kvr_route_result_init(&result, sizeof result);
  KVT_OK(kvr_find_best_match(f->router, f->prompt, PROMPT_BLOCKS * BS, NULL, &result, NULL, 0, NULL,
                             ERRP));
  assert_int_equal(0, result.booked);
  assert_int_equal(0, kvt_overlap_count(f->router, f->prompt, PROMPT_BLOCKS * BS));
  assert_int_equal(0, kvt_metrics(f->router).index_blocks);
}

static void events_are_refused(void** state) {
  fixture* f = (fixture*)*state;
  uint64_t hash = 1;
  kvr_removed_event removed;
  KVT_EXPECT_FAILS(KVR_FAILED_PRECONDITION,
                   kvt_store(f->router, 1, 0, KVR_TIER_DEVICE, f->prompt, 2, BS, 10, 0, 0, ERRP));
  kvr_removed_event_init(&removed, sizeof removed);
  removed.worker_id = 1;
  removed.block_hashes = &hash;
  removed.num_blocks = 1;
  KVT_EXPECT_FAILS(KVR_FAILED_PRECONDITION, kvr_router_apply_removed(f->router, &removed, ERRP));
  KVT_EXPECT_FAILS(KVR_FAILED_PRECONDITION, kvr_router_apply_cleared(f->router, 1, 0, 1, ERRP));
  assert_int_equal(0, kvt_overlap_count(f->router, f->prompt, PROMPT_BLOCKS * BS));
}

static void ttl_option_accepted(void** state) {
  kvr_router_options opts;
  kvr_router* router;
  (void)state;
  kvr_router_options_init(&opts, sizeof opts);
  opts.flags = KVR_ROUTER_APPROXIMATE;
  opts.approx_ttl_seconds = 0.5;
  opts.approx_max_blocks = 64;
  opts.approx_prune_target_ratio = 0.5;
  router = kvt_router_new_opts(&opts);
  kvr_router_free(router);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(admission_is_recorded, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(preview_is_not_recorded, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(events_are_refused, setup, kvt_teardown),
      cmocka_unit_test(ttl_option_accepted),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
