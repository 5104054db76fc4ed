/* Staged routing through the C ABI: kvr_preview_route changes nothing (10,000 previews with
 * sessions and pins keep the state digest), plan / commit / abort and the plan deadline with no
 * booking leaked on any path, query-only routing, approximate-mode recording at commit, pins per
 * phase, allowed sets and session affinity. */
#define _POSIX_C_SOURCE 199309L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>
#include <time.h>

#include "test_util.h"

#define BS 16

static uint64_t digest(kvr_router* router) {
  uint64_t d = 0;
  KVT_OK(kvr_router_state_digest(router, &d, ERRP));
  return d;
}

static size_t active_requests(kvr_router* router) { return kvt_metrics(router).requests_active; }

/* Three workers (1, 2, 3), worker 3 with total_kv_blocks 4096; approximate if asked. */
static kvr_router* three_workers(uint32_t flags, double plan_deadline_seconds) {
  kvr_router_options opts;
  kvr_worker_config config;
  kvr_router* router;
  kvr_router_options_init(&opts, sizeof opts);
  opts.block_size = BS;
  opts.flags = flags;
  opts.random_seed = 5;
  router = kvt_router_new_opts(&opts);
  KVT_OK(kvr_router_set_plan_deadline(router, plan_deadline_seconds, ERRP));
  kvt_add_worker(router, 1);
  kvt_add_worker(router, 2);
  kvr_worker_config_init(&config, sizeof config);
  config.worker_id = 3;
  config.total_kv_blocks = 4096;
  KVT_OK(kvr_router_add_worker(router, &config, ERRP));
  return router;
}

static void preview_reports_signals_and_books_nothing(void** state) {
  kvr_router* router = three_workers(0, 30);
  uint32_t prompt[6 * BS];
  kvr_route_signals preview;
  kvr_routing_hints hints;
  (void)state;
  kvt_fill_tokens(prompt, 6 * BS, 10);
  KVT_OK(kvt_store(router, 3, 0, KVR_TIER_DEVICE, prompt, 4, BS, 100, 0, 0, ERRP));
  kvr_route_signals_init(&preview, sizeof preview);
  KVT_OK(kvr_preview_route(router, prompt, 6 * BS, NULL, NULL, &preview, ERRP));
  assert_int_equal(3, preview.worker_id);
  assert_int_equal(0, preview.dp_rank);
  assert_int_equal(4, preview.overlap_blocks);
  assert_int_equal(4 * BS, preview.cached_tokens);
  assert_int_equal(6, preview.potential_decode_blocks); /* no active blocks: all new */
  assert_int_equal(4096, preview.total_kv_blocks);
  assert_true(preview.cost >= 0);
  assert_int_equal(0, preview.booked);
  assert_int_equal(0, active_requests(router));
  /* A pin in the aggregated phase. */
  kvr_routing_hints_init(&hints, sizeof hints);
  hints.worker_id = 2;
  KVT_OK(kvr_preview_route(router, prompt, 6 * BS, NULL, &hints, &preview, ERRP));
  assert_int_equal(2, preview.worker_id);
  assert_int_equal(0, preview.overlap_blocks);
  kvr_router_free(router);
}

static void ten_thousand_previews_change_nothing(void** state) {
  kvr_router* router = three_workers(KVR_ROUTER_APPROXIMATE, 30);
  uint32_t prompt[8 * BS];
  kvr_request_options req = kvt_admit("committed");
  kvr_routing_hints hints;
  kvr_route_signals out;
  uint64_t before;
  int i;
  (void)state;
  kvt_fill_tokens(prompt, 8 * BS, 1);
  kvr_route_signals_init(&out, sizeof out);
  kvr_routing_hints_init(&hints, sizeof hints);
  hints.session_id = "s1";
  KVT_OK(kvr_plan_route(router, prompt, 8 * BS, &req, &hints, NULL, &out, ERRP));
  KVT_OK(kvr_commit_route(router, "committed", ERRP));
  req.request_id = "open";
  KVT_OK(kvr_plan_route(router, prompt, 4 * BS, &req, NULL, NULL, &out, ERRP));
  before = digest(router);
  for (i = 0; i < 10000; ++i) {
    kvr_routing_hints_init(&hints, sizeof hints);
    if (i % 3 == 1) hints.session_id = (i % 2) ? "s1" : "fresh";
    if (i % 3 == 2) hints.worker_id = (uint64_t)(1 + i % 3);
    hints.session_mode = (i % 4 < 2) ? KVR_SESSION_HARD : KVR_SESSION_SOFT;
    /* Admission asked for is ignored by a preview. */
    KVT_OK(kvr_preview_route(router, prompt, (size_t)(1 + i % 8) * BS, &req, &hints, &out, ERRP));
  }
  assert_true(digest(router) == before);
  kvr_router_free(router);
}

static void query_only_routing_writes_nothing(void** state) {
  kvr_router* router = three_workers(KVR_ROUTER_APPROXIMATE, 30);
  uint32_t prompt[4 * BS];
  kvr_route_result result;
  uint64_t before = digest(router);
  (void)state;
  kvt_fill_tokens(prompt, 4 * BS, 7);
  kvr_route_result_init(&result, sizeof result);
  KVT_OK(kvr_find_best_match(router, prompt, 4 * BS, NULL, &result, NULL, 0, NULL, ERRP));
  assert_true(digest(router) == before);
  assert_int_equal(0, kvt_metrics(router).index_blocks);
  kvr_router_free(router);
}

static void approximate_mode_records_at_commit(void** state) {
  kvr_router* router = three_workers(KVR_ROUTER_APPROXIMATE, 30);
  uint32_t prompt[4 * BS];
  kvr_request_options req = kvt_admit("r");
  kvr_route_signals plan;
  (void)state;
  kvt_fill_tokens(prompt, 4 * BS, 7);
  kvr_route_signals_init(&plan, sizeof plan);
  KVT_OK(kvr_plan_route(router, prompt, 4 * BS, &req, NULL, NULL, &plan, ERRP));
  assert_int_equal(1, plan.booked);
  assert_int_equal(0, kvt_metrics(router).index_blocks);
  KVT_OK(kvr_commit_route(router, "r", ERRP));
  assert_int_equal(4, kvt_metrics(router).index_blocks);
  kvr_router_free(router);
}

static void plan_keeps_the_previewed_worker(void** state) {
  kvr_router* router = three_workers(0, 30);
  uint32_t prompt[4 * BS];
  uint32_t other[40 * BS];
  kvr_request_options req = kvt_admit("r");
  kvr_request_options load = kvt_admit("load");
  kvr_route_signals preview, plan;
  (void)state;
  kvt_fill_tokens(prompt, 4 * BS, 7);
  kvt_fill_tokens(other, 40 * BS, 9000);
  kvr_route_signals_init(&preview, sizeof preview);
  kvr_route_signals_init(&plan, sizeof plan);
  KVT_OK(kvr_preview_route(router, prompt, 4 * BS, NULL, NULL, &preview, ERRP));
  /* The previewed rank gets busier meanwhile: the plan keeps it all the same. */
  KVT_OK(kvr_router_add_request(router, other, 40 * BS, preview.worker_id, 0, &load, ERRP));
  KVT_OK(kvr_plan_route(router, prompt, 4 * BS, &req, NULL, &preview, &plan, ERRP));
  assert_int_equal(preview.worker_id, plan.worker_id);
  assert_int_equal(0, plan.moved);
  kvr_router_free(router);
}

static void plan_moves_when_the_previewed_worker_is_gone(void** state) {
  kvr_router* router = three_workers(0, 30);
  uint32_t prompt[4 * BS];
  kvr_request_options req = kvt_admit("r");
  kvr_route_signals preview, plan;
  (void)state;
  kvt_fill_tokens(prompt, 4 * BS, 7);
  kvr_route_signals_init(&preview, sizeof preview);
  kvr_route_signals_init(&plan, sizeof plan);
  KVT_OK(kvr_preview_route(router, prompt, 4 * BS, NULL, NULL, &preview, ERRP));
  KVT_OK(kvr_router_remove_worker(router, preview.worker_id, ERRP));
  KVT_OK(kvr_plan_route(router, prompt, 4 * BS, &req, NULL, &preview, &plan, ERRP));
  assert_true(plan.worker_id != preview.worker_id);
  assert_int_equal(1, plan.moved);
  kvr_router_free(router);
}

/* Every path: commit + free, abort, free before commit, deadline, repeated steps. */
static void no_booking_leaks_on_any_path(void** state) {
  kvr_router* router = three_workers(0, 0.001);
  uint32_t prompt[4 * BS];
  kvr_request_options req = kvt_admit("r");
  kvr_route_signals plan, again;
  int freed = -1;
  size_t expired = 0;
  const struct timespec pause = {0, 5 * 1000 * 1000};
  const uint64_t empty = digest(router);
  (void)state;
  kvt_fill_tokens(prompt, 4 * BS, 7);
  kvr_route_signals_init(&plan, sizeof plan);
  kvr_route_signals_init(&again, sizeof again);

  /* The deadline: planned, never committed, dropped. */
  KVT_OK(kvr_plan_route(router, prompt, 4 * BS, &req, NULL, NULL, &plan, ERRP));
  assert_int_equal(1, active_requests(router));
  nanosleep(&pause, NULL);
  KVT_EXPECT_FAILS(KVR_NOT_FOUND, kvr_commit_route(router, "r", ERRP));
  assert_int_equal(0, active_requests(router));
  assert_true(digest(router) == empty);
  KVT_OK(kvr_plan_route(router, prompt, 4 * BS, &req, NULL, NULL, &plan, ERRP));
  nanosleep(&pause, NULL);
  KVT_OK(kvr_router_expire_plans(router, &expired, ERRP));
  assert_int_equal(1, expired);
  assert_true(digest(router) == empty);
  kvr_router_free(router);

  router = three_workers(0, 30);
  /* Plan, plan again (same plan), commit twice, free. */
  KVT_OK(kvr_plan_route(router, prompt, 4 * BS, &req, NULL, NULL, &plan, ERRP));
  KVT_OK(kvr_plan_route(router, prompt, 4 * BS, &req, NULL, NULL, &again, ERRP));
  assert_int_equal(plan.worker_id, again.worker_id);
  assert_int_equal(1, active_requests(router));
  KVT_OK(kvr_commit_route(router, "r", ERRP));
  KVT_OK(kvr_commit_route(router, "r", ERRP));
  KVT_OK(kvr_router_free_request(router, "r", ERRP));
  assert_true(digest(router) == empty || active_requests(router) == 0);
  assert_int_equal(0, active_requests(router));
  /* Plan, abort, abort again, commit is refused. */
  KVT_OK(kvr_plan_route(router, prompt, 4 * BS, &req, NULL, NULL, &plan, ERRP));
  KVT_OK(kvr_abort_route(router, "r", &freed, ERRP));
  assert_int_equal(1, freed);
  KVT_OK(kvr_abort_route(router, "r", &freed, ERRP));
  assert_int_equal(0, freed);
  KVT_EXPECT_FAILS(KVR_NOT_FOUND, kvr_commit_route(router, "r", ERRP));
  assert_int_equal(0, active_requests(router));
  /* Plan, free before commit: the plan goes too. */
  KVT_OK(kvr_plan_route(router, prompt, 4 * BS, &req, NULL, NULL, &plan, ERRP));
  KVT_OK(kvr_router_free_request(router, "r", ERRP));
  KVT_EXPECT_FAILS(KVR_NOT_FOUND, kvr_commit_route(router, "r", ERRP));
  /* Plan, worker removed, commit refused and the plan dropped. */
  KVT_OK(kvr_plan_route(router, prompt, 4 * BS, &req, NULL, NULL, &plan, ERRP));
  KVT_OK(kvr_router_remove_worker(router, plan.worker_id, ERRP));
  KVT_EXPECT_FAILS(KVR_FAILED_PRECONDITION, kvr_commit_route(router, "r", ERRP));
  assert_int_equal(0, active_requests(router));
  /* Planning again replaces the stale plan. */
  KVT_OK(kvr_plan_route(router, prompt, 4 * BS, &req, NULL, NULL, &plan, ERRP));
  KVT_OK(kvr_commit_route(router, "r", ERRP));
  KVT_OK(kvr_abort_route(router, "r", &freed, ERRP));
  assert_int_equal(1, freed);
  assert_int_equal(0, active_requests(router));
  /* Argument errors. */
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_set_plan_deadline(router, 0, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_commit_route(router, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_plan_route(router, prompt, 4 * BS, NULL, NULL, NULL, &plan, ERRP));
  kvr_router_free(router);
}

static void pins_and_allowed_sets(void** state) {
  kvr_router* router = three_workers(0, 30);
  uint32_t prompt[4 * BS];
  kvr_request_options req;
  kvr_routing_hints hints;
  kvr_route_signals out;
  const uint64_t allowed[] = {1, 2};
  (void)state;
  kvt_fill_tokens(prompt, 4 * BS, 7);
  kvt_add_worker_full(router, 7, 4, 0);
  kvr_route_signals_init(&out, sizeof out);
  kvr_request_options_init(&req, sizeof req);
  kvr_routing_hints_init(&hints, sizeof hints);
  /* Prefill phase: prefill_worker_id and prefill_dp_rank win over worker_id / dp_rank. */
  hints.phase = KVR_PHASE_PREFILL;
  hints.worker_id = 1;
  hints.prefill_worker_id = 7;
  hints.prefill_dp_rank = 2;
  KVT_OK(kvr_preview_route(router, prompt, 4 * BS, &req, &hints, &out, ERRP));
  assert_int_equal(7, out.worker_id);
  assert_int_equal(2, out.dp_rank);
  /* Decode phase: decode_worker_id with dp_rank. */
  hints.phase = KVR_PHASE_DECODE;
  hints.decode_worker_id = 7;
  hints.dp_rank = 3;
  KVT_OK(kvr_preview_route(router, prompt, 4 * BS, &req, &hints, &out, ERRP));
  assert_int_equal(7, out.worker_id);
  assert_int_equal(3, out.dp_rank);
  /* Aggregated: worker_id. */
  hints.phase = KVR_PHASE_AGGREGATED;
  hints.dp_rank = -1;
  KVT_OK(kvr_preview_route(router, prompt, 4 * BS, &req, &hints, &out, ERRP));
  assert_int_equal(1, out.worker_id);
  /* Allowed set: restricts candidates; a pin outside it is a clear error. */
  kvr_routing_hints_init(&hints, sizeof hints);
  req.allowed_worker_ids = allowed;
  req.num_allowed_worker_ids = 2;
  KVT_OK(kvr_preview_route(router, prompt, 4 * BS, &req, &hints, &out, ERRP));
  assert_true(out.worker_id == 1 || out.worker_id == 2);
  hints.worker_id = 3;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_preview_route(router, prompt, 4 * BS, &req, &hints, &out, ERRP));
  /* Unknown pinned worker or rank. */
  req.num_allowed_worker_ids = 0;
  hints.worker_id = 99;
  KVT_EXPECT_FAILS(KVR_NOT_FOUND,
                   kvr_preview_route(router, prompt, 4 * BS, &req, &hints, &out, ERRP));
  hints.worker_id = 7;
  hints.dp_rank = 9;
  KVT_EXPECT_FAILS(KVR_NOT_FOUND,
                   kvr_preview_route(router, prompt, 4 * BS, &req, &hints, &out, ERRP));
  hints.phase = 7;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_preview_route(router, prompt, 4 * BS, &req, &hints, &out, ERRP));
  kvr_router_free(router);
}

static void allowed_set_bypasses_the_queue(void** state) {
  kvr_router_options opts;
  kvr_router* router;
  uint32_t prompt[4 * BS];
  kvr_request_options busy = kvt_admit("busy");
  kvr_request_options req = kvt_admit("r");
  kvr_route_signals out;
  const uint64_t allowed[] = {1};
  (void)state;
  kvr_router_options_init(&opts, sizeof opts);
  opts.block_size = BS;
  opts.queue_threshold = 0.0;
  router = kvt_router_new_opts(&opts);
  kvt_add_worker(router, 1);
  kvt_fill_tokens(prompt, 4 * BS, 7);
  kvr_route_signals_init(&out, sizeof out);
  KVT_OK(kvr_plan_route(router, prompt, 4 * BS, &busy, NULL, NULL, &out, ERRP));
  /* Every rank is over the threshold now; only the allowed set lets this through at once. */
  req.allowed_worker_ids = allowed;
  req.num_allowed_worker_ids = 1;
  KVT_OK(kvr_plan_route(router, prompt, 4 * BS, &req, NULL, NULL, &out, ERRP));
  assert_int_equal(0, out.queued);
  assert_int_equal(2, active_requests(router));
  kvr_router_free(router);
}

static void sessions_bind_at_commit_and_pin(void** state) {
  kvr_router* router = three_workers(0, 30);
  uint32_t prompt[4 * BS];
  uint32_t other[4 * BS];
  kvr_request_options req = kvt_admit("a");
  kvr_routing_hints hints;
  kvr_route_signals first, next;
  uint64_t worker = 0;
  uint32_t rank = 9;
  size_t reclaimed = 0;
  (void)state;
  kvt_fill_tokens(prompt, 4 * BS, 7);
  kvt_fill_tokens(other, 4 * BS, 5000);
  kvr_route_signals_init(&first, sizeof first);
  kvr_route_signals_init(&next, sizeof next);
  kvr_routing_hints_init(&hints, sizeof hints);
  hints.session_id = "s";
  KVT_OK(kvr_plan_route(router, prompt, 4 * BS, &req, &hints, NULL, &first, ERRP));
  KVT_EXPECT_FAILS(KVR_NOT_FOUND, kvr_router_session_binding(router, "s", &worker, &rank, ERRP));
  KVT_OK(kvr_commit_route(router, "a", ERRP));
  KVT_OK(kvr_router_session_binding(router, "s", &worker, &rank, ERRP));
  assert_int_equal(first.worker_id, worker);
  assert_int_equal(0, rank);
  /* Hard mode: the next request goes there whatever its cost. */
  req.request_id = "b";
  KVT_OK(kvr_plan_route(router, other, 4 * BS, &req, &hints, NULL, &next, ERRP));
  assert_int_equal(first.worker_id, next.worker_id);
  KVT_OK(kvr_commit_route(router, "b", ERRP));
  /* The bound worker goes away: the binding is dropped, selection runs again, rebound. */
  KVT_OK(kvr_router_remove_worker(router, worker, ERRP));
  req.request_id = "c";
  KVT_OK(kvr_plan_route(router, other, 4 * BS, &req, &hints, NULL, &next, ERRP));
  assert_true(next.worker_id != worker);
  KVT_OK(kvr_commit_route(router, "c", ERRP));
  KVT_OK(kvr_router_session_binding(router, "s", &worker, &rank, ERRP));
  assert_int_equal(next.worker_id, worker);
  /* Soft mode with a pin elsewhere: rebound on dispatch. */
  hints.session_mode = KVR_SESSION_SOFT;
  hints.worker_id = (worker == 1) ? 2 : 1;
  req.request_id = "d";
  KVT_OK(kvr_plan_route(router, other, 4 * BS, &req, &hints, NULL, &next, ERRP));
  KVT_OK(kvr_commit_route(router, "d", ERRP));
  KVT_OK(kvr_router_session_binding(router, "s", &worker, &rank, ERRP));
  assert_int_equal(hints.worker_id, worker);
  KVT_OK(kvr_router_close_session(router, "s", ERRP));
  KVT_EXPECT_FAILS(KVR_NOT_FOUND, kvr_router_session_binding(router, "s", NULL, NULL, ERRP));
  KVT_OK(kvr_router_reclaim_sessions(router, &reclaimed, ERRP));
  assert_int_equal(0, reclaimed);
  kvr_router_free(router);
}

static void session_ttl_expires(void** state) {
  kvr_router* router = three_workers(0, 30);
  uint32_t prompt[4 * BS];
  kvr_request_options req = kvt_admit("a");
  kvr_routing_hints hints;
  kvr_route_signals out;
  size_t reclaimed = 0;
  const struct timespec pause = {0, 5 * 1000 * 1000};
  (void)state;
  kvt_fill_tokens(prompt, 4 * BS, 7);
  kvr_route_signals_init(&out, sizeof out);
  kvr_routing_hints_init(&hints, sizeof hints);
  hints.session_id = "s";
  hints.session_ttl_seconds = 0.001;
  KVT_OK(kvr_plan_route(router, prompt, 4 * BS, &req, &hints, NULL, &out, ERRP));
  KVT_OK(kvr_commit_route(router, "a", ERRP));
  nanosleep(&pause, NULL);
  KVT_EXPECT_FAILS(KVR_NOT_FOUND, kvr_router_session_binding(router, "s", NULL, NULL, ERRP));
  KVT_OK(kvr_router_reclaim_sessions(router, &reclaimed, ERRP));
  assert_int_equal(1, reclaimed);
  hints.session_ttl_seconds = 0;
  req.request_id = "b";
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_plan_route(router, prompt, 4 * BS, &req, &hints, NULL, &out, ERRP));
  kvr_router_free(router);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(preview_reports_signals_and_books_nothing),
      cmocka_unit_test(ten_thousand_previews_change_nothing),
      cmocka_unit_test(query_only_routing_writes_nothing),
      cmocka_unit_test(approximate_mode_records_at_commit),
      cmocka_unit_test(plan_keeps_the_previewed_worker),
      cmocka_unit_test(plan_moves_when_the_previewed_worker_is_gone),
      cmocka_unit_test(no_booking_leaks_on_any_path),
      cmocka_unit_test(pins_and_allowed_sets),
      cmocka_unit_test(allowed_set_bypasses_the_queue),
      cmocka_unit_test(sessions_bind_at_commit_and_pin),
      cmocka_unit_test(session_ttl_expires),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
