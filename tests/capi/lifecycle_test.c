/* The request lifecycle: kvr_router_add_request (a worker chosen elsewhere),
 * kvr_router_mark_prefill_completed and kvr_router_free_request, with their error rules
 * (unknown rank, duplicate id, unknown ids being no error). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>

#include "test_util.h"

#define BS 16

typedef kvt_fixture fixture;

/* Worker 1 with ranks 0 and 1, worker 2 with rank 0, a prompt of 8 blocks; nothing cached. */
static int setup(void** state) {
  fixture* f = kvt_fixture_new(BS, 0, 0, 8 * BS, 300);
  kvt_add_worker_full(f->router, 1, 2, 0);
  kvt_add_worker(f->router, 2);
  *state = f;
  return 0;
}

static void add_request_books_the_given_rank(void** state) {
  fixture* f = (fixture*)*state;
  kvr_request_options opts = kvt_admit("pinned");
  kvr_potential_load load;
  KVT_OK(kvr_router_add_request(f->router, f->prompt, 8 * BS, 1, 1, &opts, ERRP));
  assert_int_equal(1, kvt_metrics(f->router).requests_active);
  load = kvt_load_of(f->router, f->prompt, 8 * BS, 1, 1);
  assert_int_equal(1, load.active_requests);
  assert_int_equal(8 * BS, load.active_prefill_tokens);
  assert_int_equal(8, load.active_blocks);
  /* The other ranks carry nothing. */
  assert_int_equal(0, kvt_load_of(f->router, f->prompt, 8 * BS, 1, 0).active_requests);
  assert_int_equal(0, kvt_load_of(f->router, f->prompt, 8 * BS, 2, 0).active_requests);

  /* The next request for the same prompt avoids the busy rank. */
  {
    kvr_route_result result;
    kvr_route_result_init(&result, sizeof result);
    KVT_OK(kvr_find_best_match(f->router, f->prompt, 8 * BS, NULL, &result, NULL, 0, NULL, ERRP));
    assert_false(result.worker_id == 1 && result.dp_rank == 1);
  }

  KVT_OK(kvr_router_mark_prefill_completed(f->router, "pinned", ERRP));
  load = kvt_load_of(f->router, f->prompt, 8 * BS, 1, 1);
  assert_int_equal(1, load.active_requests);
  assert_int_equal(0, load.active_prefill_tokens);
  KVT_OK(kvr_router_free_request(f->router, "pinned", ERRP));
  load = kvt_load_of(f->router, f->prompt, 8 * BS, 1, 1);
  assert_int_equal(0, load.active_requests);
  assert_int_equal(0, load.active_blocks);
  assert_int_equal(0, kvt_metrics(f->router).requests_active);
}

static void free_without_mark_prefill(void** state) {
  fixture* f = (fixture*)*state;
  kvr_request_options opts = kvt_admit("short");
  kvr_potential_load load;
  KVT_OK(kvr_router_add_request(f->router, f->prompt, 8 * BS, 2, 0, &opts, ERRP));
  KVT_OK(kvr_router_free_request(f->router, "short", ERRP));
  load = kvt_load_of(f->router, f->prompt, 8 * BS, 2, 0);
  assert_int_equal(0, load.active_requests);
  assert_int_equal(0, load.active_prefill_tokens);
  assert_int_equal(0, load.active_blocks);
}

static void shared_blocks_counted_once(void** state) {
  fixture* f = (fixture*)*state;
  kvr_request_options a = kvt_admit("a");
  kvr_request_options b = kvt_admit("b");
  KVT_OK(kvr_router_add_request(f->router, f->prompt, 8 * BS, 2, 0, &a, ERRP));
  KVT_OK(kvr_router_add_request(f->router, f->prompt, 8 * BS, 2, 0, &b, ERRP));
  assert_int_equal(2, kvt_load_of(f->router, f->prompt, 8 * BS, 2, 0).active_requests);
  assert_int_equal(8, kvt_load_of(f->router, f->prompt, 8 * BS, 2, 0).active_blocks);
  KVT_OK(kvr_router_free_request(f->router, "a", ERRP));
  assert_int_equal(8, kvt_load_of(f->router, f->prompt, 8 * BS, 2, 0).active_blocks);
  KVT_OK(kvr_router_free_request(f->router, "b", ERRP));
  assert_int_equal(0, kvt_load_of(f->router, f->prompt, 8 * BS, 2, 0).active_blocks);
}

static void add_request_unknown_worker_or_rank(void** state) {
  fixture* f = (fixture*)*state;
  kvr_request_options opts = kvt_admit("lost");
  KVT_EXPECT_FAILS(KVR_NOT_FOUND,
                   kvr_router_add_request(f->router, f->prompt, 8 * BS, 42, 0, &opts, ERRP));
  /* Worker 2 has rank 0 only. */
  KVT_EXPECT_FAILS(KVR_NOT_FOUND,
                   kvr_router_add_request(f->router, f->prompt, 8 * BS, 2, 1, &opts, ERRP));
  assert_int_equal(0, kvt_metrics(f->router).requests_active);
}

static void add_request_duplicate_id(void** state) {
  fixture* f = (fixture*)*state;
  kvr_request_options opts = kvt_admit("twice");
  KVT_OK(kvr_router_add_request(f->router, f->prompt, 8 * BS, 1, 0, &opts, ERRP));
  KVT_EXPECT_FAILS(KVR_ALREADY_EXISTS,
                   kvr_router_add_request(f->router, f->prompt, 8 * BS, 2, 0, &opts, ERRP));
  /* Also through admission. */
  {
    kvr_route_result result;
    kvr_route_result_init(&result, sizeof result);
    KVT_EXPECT_FAILS(KVR_ALREADY_EXISTS, kvr_find_best_match(f->router, f->prompt, 8 * BS, &opts,
                                                             &result, NULL, 0, NULL, ERRP));
  }
  assert_int_equal(1, kvt_metrics(f->router).requests_active);
  assert_int_equal(1, kvt_load_of(f->router, f->prompt, 8 * BS, 1, 0).active_requests);
  assert_int_equal(0, kvt_load_of(f->router, f->prompt, 8 * BS, 2, 0).active_requests);
}

static void add_request_needs_request_id(void** state) {
  fixture* f = (fixture*)*state;
  kvr_request_options opts;
  kvr_request_options_init(&opts, sizeof opts);
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_add_request(f->router, f->prompt, 8 * BS, 1, 0, &opts, ERRP));
  opts.request_id = "";
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_add_request(f->router, f->prompt, 8 * BS, 1, 0, &opts, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_add_request(f->router, f->prompt, 8 * BS, 1, 0, NULL, ERRP));
  opts.request_id = "r";
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_add_request(f->router, NULL, 8 * BS, 1, 0, &opts, ERRP));
  opts.struct_size = 0;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_add_request(f->router, f->prompt, 8 * BS, 1, 0, &opts, ERRP));
  assert_int_equal(0, kvt_metrics(f->router).requests_active);
}

static void unknown_ids_are_no_error(void** state) {
  fixture* f = (fixture*)*state;
  KVT_OK(kvr_router_mark_prefill_completed(f->router, "never-seen", ERRP));
  KVT_OK(kvr_router_free_request(f->router, "never-seen", ERRP));
  KVT_OK(kvr_router_mark_prefill_completed(f->router, "", ERRP));
  KVT_OK(kvr_router_free_request(f->router, "", ERRP));
  /* Twice in a row after a real request. */
  {
    kvr_request_options opts = kvt_admit("once");
    KVT_OK(kvr_router_add_request(f->router, f->prompt, 8 * BS, 1, 0, &opts, ERRP));
    KVT_OK(kvr_router_free_request(f->router, "once", ERRP));
    KVT_OK(kvr_router_free_request(f->router, "once", ERRP));
    KVT_OK(kvr_router_mark_prefill_completed(f->router, "once", ERRP));
  }
  assert_int_equal(0, kvt_metrics(f->router).requests_active);
}

static void null_request_id(void** state) {
  fixture* f = (fixture*)*state;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_mark_prefill_completed(f->router, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_free_request(f->router, NULL, ERRP));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(add_request_books_the_given_rank, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(free_without_mark_prefill, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(shared_blocks_counted_once, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(add_request_unknown_worker_or_rank, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(add_request_duplicate_id, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(add_request_needs_request_id, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(unknown_ids_are_no_error, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(null_request_id, setup, kvt_teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
