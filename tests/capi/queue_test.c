/* The admission queue through the C ABI: with queue_threshold 0, an admitted request waits
 * while every eligible rank has prefill work in flight; queue_timeout_ms bounds the wait
 * (KVR_DEADLINE_EXCEEDED), marking prefill complete admits the waiter, and allowed_worker_ids
 * bypasses the queue. Timeouts are kept tiny. */
#define _POSIX_C_SOURCE 200809L /* pthreads, nanosleep */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>
#include <pthread.h>
#include <time.h>

#include "test_util.h"

#define BS 16
#define PROMPT_TOKENS (4 * BS)

typedef kvt_fixture fixture;

/* One worker with a tiny batch budget; the router queues as soon as every rank has any prefill
 * tokens in flight (threshold 0). Request "busy" occupies the worker. */
static int setup(void** state) {
  fixture* f = (fixture*)malloc(sizeof(fixture));
  kvr_router_options opts;
  kvr_request_options busy = kvt_admit("busy");
  kvr_route_result result;
  if (f == NULL) return -1;
  kvr_router_options_init(&opts, sizeof opts);
  opts.block_size = BS;
  opts.queue_threshold = 0;
  kvt_fixture_init(f, &opts, 0, PROMPT_TOKENS, 1);
  kvt_add_worker_full(f->router, 1, 1, 16);
  kvr_route_result_init(&result, sizeof result);
  KVT_OK(kvr_find_best_match(f->router, f->prompt, PROMPT_TOKENS, &busy, &result, NULL, 0, NULL,
                             ERRP));
  assert_int_equal(1, result.booked);
  assert_int_equal(0, result.queued);
  *state = f;
  return 0;
}

static double now_ms(void) {
  struct timespec ts;
  timespec_get(&ts, TIME_UTC);
  return (double)ts.tv_sec * 1000.0 + (double)ts.tv_nsec / 1e6;
}

static void busy_worker_times_out(void** state) {
  fixture* f = (fixture*)*state;
  kvr_request_options opts = kvt_admit("waiter");
  kvr_route_result result;
  kvr_error* err = NULL;
  double start;
  kvr_metrics m;
  opts.queue_timeout_ms = 50;
  kvr_route_result_init(&result, sizeof result);
  result.worker_id = 0xDEAD;
  start = now_ms();
  assert_int_equal(KVR_DEADLINE_EXCEEDED, kvr_find_best_match(f->router, f->prompt, PROMPT_TOKENS,
                                                              &opts, &result, NULL, 0, NULL, &err));
  assert_true(now_ms() - start >= 45.0);
  kvt_expect_error(&err, KVR_DEADLINE_EXCEEDED);
  assert_int_equal(0xDEAD, result.worker_id); /* untouched on failure */
  m = kvt_metrics(f->router);
  assert_int_equal(1, m.requests_active);
  assert_int_equal(0, m.queue_pending);
  assert_int_equal(0, m.queue_pending_tokens);
  /* err NULL: same outcome. */
  assert_int_equal(KVR_DEADLINE_EXCEEDED, kvr_find_best_match(f->router, f->prompt, PROMPT_TOKENS,
                                                              &opts, &result, NULL, 0, NULL, NULL));

  /* The timed-out id was never booked: once the worker's prefill is done it is admitted at
   * once under the same id. */
  KVT_OK(kvr_router_mark_prefill_completed(f->router, "busy", ERRP));
  kvr_route_result_init(&result, sizeof result);
  KVT_OK(kvr_find_best_match(f->router, f->prompt, PROMPT_TOKENS, &opts, &result, NULL, 0, NULL,
                             ERRP));
  assert_int_equal(1, result.booked);
  assert_int_equal(0, result.queued);
  assert_int_equal(2, kvt_metrics(f->router).requests_active);
}

static void preview_never_waits(void** state) {
  fixture* f = (fixture*)*state;
  kvr_route_result result;
  double start = now_ms();
  kvr_route_result_init(&result, sizeof result);
  KVT_OK(
      kvr_find_best_match(f->router, f->prompt, PROMPT_TOKENS, NULL, &result, NULL, 0, NULL, ERRP));
  assert_true(now_ms() - start < 1000.0);
  assert_int_equal(0, result.booked);
  assert_int_equal(0, result.queued);
}

static void allowed_workers_bypass_the_queue(void** state) {
  fixture* f = (fixture*)*state;
  uint64_t allowed[1] = {1};
  kvr_request_options opts = kvt_admit("external");
  kvr_route_result result;
  opts.allowed_worker_ids = allowed;
  opts.num_allowed_worker_ids = 1;
  opts.queue_timeout_ms = 50;
  kvr_route_result_init(&result, sizeof result);
  KVT_OK(kvr_find_best_match(f->router, f->prompt, PROMPT_TOKENS, &opts, &result, NULL, 0, NULL,
                             ERRP));
  assert_int_equal(1, result.booked);
  assert_int_equal(0, result.queued);
  assert_int_equal(1, result.worker_id);
}

typedef struct waiter {
  kvr_router* router;
  const uint32_t* prompt;
  kvr_route_result result;
  kvr_status status;
  int64_t timeout_ms; /* 0: 10 s */
} waiter;

static void* wait_for_admission(void* arg) {
  waiter* w = (waiter*)arg;
  kvr_request_options opts = kvt_admit("queued");
  opts.queue_timeout_ms = w->timeout_ms != 0 ? w->timeout_ms : 10000;
  kvr_route_result_init(&w->result, sizeof w->result);
  w->status = kvr_find_best_match(w->router, w->prompt, PROMPT_TOKENS, &opts, &w->result, NULL, 0,
                                  NULL, NULL);
  return NULL;
}

/* Starts a thread whose request "queued" (timeout `timeout_ms`, 0: 10 s) waits in f's queue, and
 * waits (up to 5 s) until it is there. */
static void start_waiter(fixture* f, waiter* w, pthread_t* thread, int64_t timeout_ms) {
  int spins;
  memset(w, 0, sizeof *w);
  w->router = f->router;
  w->prompt = f->prompt;
  w->status = -1;
  w->timeout_ms = timeout_ms;
  assert_int_equal(0, pthread_create(thread, NULL, wait_for_admission, w));
  for (spins = 0; spins < 5000; ++spins) {
    struct timespec ms = {0, 1000000};
    if (kvt_metrics(f->router).queue_pending == 1) break;
    nanosleep(&ms, NULL);
  }
  assert_int_equal(1, kvt_metrics(f->router).queue_pending);
}

static void waiter_admitted_when_prefill_completes(void** state) {
  fixture* f = (fixture*)*state;
  waiter w;
  pthread_t thread;
  kvr_metrics m;
  start_waiter(f, &w, &thread, 0);
  m = kvt_metrics(f->router);
  assert_int_equal(PROMPT_TOKENS, m.queue_pending_tokens);
  /* A second request under the waiting id is a duplicate. */
  {
    kvr_request_options dup = kvt_admit("queued");
    kvr_route_result result;
    dup.queue_timeout_ms = 1;
    kvr_route_result_init(&result, sizeof result);
    KVT_EXPECT_FAILS(KVR_ALREADY_EXISTS, kvr_find_best_match(f->router, f->prompt, PROMPT_TOKENS,
                                                             &dup, &result, NULL, 0, NULL, ERRP));
  }
  KVT_OK(kvr_router_mark_prefill_completed(f->router, "busy", ERRP));
  assert_int_equal(0, pthread_join(thread, NULL));
  assert_int_equal(KVR_OK, w.status);
  assert_int_equal(1, w.result.booked);
  assert_int_equal(1, w.result.queued);
  assert_int_equal(1, w.result.worker_id);
  m = kvt_metrics(f->router);
  assert_int_equal(0, m.queue_pending);
  assert_int_equal(2, m.requests_active);
}
static void free_cancels_a_waiting_request(void** state) {
  fixture* f = (fixture*)*state;
  waiter w;
  pthread_t thread;
  start_waiter(f, &w, &thread, 0);
  /* The request ended before it was admitted (e.g. the client went away): the waiting call
   * returns at once, unbooked. (The header does not name the status; the core says
   * KVR_CANCELLED.) */
  KVT_OK(kvr_router_free_request(f->router, "queued", ERRP));
  assert_int_equal(0, pthread_join(thread, NULL));
  assert_int_not_equal(KVR_OK, w.status);
  assert_int_equal(KVR_CANCELLED, w.status);
  assert_int_equal(0, kvt_metrics(f->router).queue_pending);
  assert_int_equal(1, kvt_metrics(f->router).requests_active);
}

/* A shutdown closes the queue: the waiting call returns KVR_CANCELLED (without a timeout it
 * would have waited for good, and freeing the router under it would be a use after free), a
 * later one that would wait too, at once; previews, a request admitted at once and frees go on.
 * Idempotent. */
static void closing_the_queue_cancels_its_waiters_for_good(void** state) {
  fixture* f = (fixture*)*state;
  waiter w;
  pthread_t thread;
  uint64_t cancelled = 99;
  kvr_request_options late = kvt_admit("late");
  kvr_request_options bypass = kvt_admit("bypass");
  const uint64_t worker[1] = {1};
  kvr_route_result result;
  start_waiter(f, &w, &thread, INT64_MAX);
  KVT_OK(kvr_router_close_queue(f->router, &cancelled, ERRP));
  assert_int_equal(1, cancelled);
  assert_int_equal(0, pthread_join(thread, NULL));
  assert_int_equal(KVR_CANCELLED, w.status);
  assert_int_equal(0, kvt_metrics(f->router).queue_pending);
  kvr_route_result_init(&result, sizeof result);
  KVT_EXPECT_FAILS_SAYING(KVR_CANCELLED, "the admission queue is closed",
                          kvr_find_best_match(f->router, f->prompt, PROMPT_TOKENS, &late, &result,
                                              NULL, 0, NULL, ERRP));
  KVT_OK(
      kvr_find_best_match(f->router, f->prompt, PROMPT_TOKENS, NULL, &result, NULL, 0, NULL, ERRP));
  bypass.allowed_worker_ids = worker; /* admitted at once: the queue does not apply */
  bypass.num_allowed_worker_ids = 1;
  KVT_OK(kvr_find_best_match(f->router, f->prompt, PROMPT_TOKENS, &bypass, &result, NULL, 0, NULL,
                             ERRP));
  assert_int_equal(1, result.booked);
  KVT_OK(kvr_router_free_request(f->router, "busy", ERRP));
  KVT_OK(kvr_router_close_queue(f->router, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_close_queue(NULL, NULL, ERRP));
}

/* A timeout longer than nanoseconds can count (INT64_MAX ms: meant as "never") waits: its
 * conversion overflowed to a negative wait, which timed out at once. */
static void a_timeout_past_any_clock_waits(void** state) {
  fixture* f = (fixture*)*state;
  waiter w;
  pthread_t thread;
  start_waiter(f, &w, &thread, INT64_MAX);
  KVT_OK(kvr_router_mark_prefill_completed(f->router, "busy", ERRP));
  assert_int_equal(0, pthread_join(thread, NULL));
  assert_int_equal(KVR_OK, w.status);
  assert_int_equal(1, w.result.booked);
  assert_int_equal(1, w.result.queued);
}

/* A request whose free was lost ("busy", never freed) holds the only worker until it expires;
 * kvr_router_expire_requests drops it once it has, and admits the request it kept waiting (no
 * routing call comes meanwhile to do it). */
static void expiring_a_lost_request_admits_its_waiter(void** state) {
  fixture* f = (fixture*)*state;
  waiter w;
  pthread_t thread;
  size_t expired = 99;
  KVT_OK(kvr_router_set_time(f->router, 0, ERRP));
  start_waiter(f, &w, &thread, 0);
  KVT_OK(kvr_router_expire_requests(f->router, &expired, ERRP));
  assert_int_equal(0, expired); /* "busy" is 300 s from its expiry */
  assert_int_equal(1, kvt_metrics(f->router).queue_pending);
  KVT_OK(kvr_router_set_time(f->router, 301000000000LL, ERRP));
  KVT_OK(kvr_router_expire_requests(f->router, &expired, ERRP));
  assert_int_equal(1, expired);
  assert_int_equal(0, pthread_join(thread, NULL));
  assert_int_equal(KVR_OK, w.status);
  assert_int_equal(1, w.result.booked);
  assert_int_equal(1, w.result.queued);
  assert_int_equal(1, kvt_metrics(f->router).requests_active); /* the waiter's */
  KVT_OK(kvr_router_expire_requests(f->router, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_expire_requests(NULL, NULL, ERRP));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(busy_worker_times_out, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(preview_never_waits, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(allowed_workers_bypass_the_queue, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(waiter_admitted_when_prefill_completes, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(free_cancels_a_waiting_request, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(a_timeout_past_any_clock_waits, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(expiring_a_lost_request_admits_its_waiter, setup,
                                      kvt_teardown),
      cmocka_unit_test_setup_teardown(closing_the_queue_cancels_its_waiters_for_good, setup,
                                      kvt_teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
