/* "@thread_safety concurrent": one router handle used from several threads at once (routing
 * with admission, events, lifecycle, reads), through the C ABI. The totals must add up. */
#define _POSIX_C_SOURCE 200809L /* pthreads, nanosleep */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>
#include <pthread.h>

#include "test_util.h"

#define BS 16
#define THREADS 4
#define REQUESTS_PER_THREAD 200

typedef struct worker_thread {
  kvr_router* router;
  int index;
  int failures; /* cmocka asserts are not thread-safe: count, check on the main thread */
  int booked;
} worker_thread;

static void* run(void* arg) {
  worker_thread* t = (worker_thread*)arg;
  uint32_t tokens[8 * BS];
  uint64_t hashes[8];
  char id[64];
  int i;
  size_t k;
  for (i = 0; i < REQUESTS_PER_THREAD; ++i) {
    kvr_request_options opts;
    kvr_route_result result;
    kvr_stored_event stored;
    kvr_overlap overlaps[8];
    size_t len = 0;
    /* A handful of shared prefixes, so threads contend on the same index nodes. */
    kvt_fill_tokens(tokens, 8 * BS, 1000u * (uint32_t)(i % 5));
    for (k = 0; k < 8; ++k)
      hashes[k] = 100000u * (uint64_t)(t->index + 1) + 10u * (uint64_t)(i % 5) + k;
    kvr_stored_event_init(&stored, sizeof stored);
    stored.worker_id = (uint64_t)(t->index % 3) + 1;
    stored.block_hashes = hashes;
    stored.num_blocks = 8;
    stored.token_ids = tokens;
    stored.num_tokens = 8 * BS;
    if (kvr_router_apply_stored(t->router, &stored, NULL) != KVR_OK) ++t->failures;

    snprintf(id, sizeof id, "t%d-r%d", t->index, i);
    kvr_request_options_init(&opts, sizeof opts);
    opts.flags = KVR_REQUEST_ADMIT;
    opts.request_id = id;
    kvr_route_result_init(&result, sizeof result);
    if (kvr_find_best_match(t->router, tokens, 8 * BS, &opts, &result, NULL, 0, NULL, NULL) !=
        KVR_OK) {
      ++t->failures;
      continue;
    }
    if (result.booked) ++t->booked;
    if (kvr_router_overlap_scores(t->router, tokens, 8 * BS, NULL, overlaps, 8, &len, NULL) !=
        KVR_OK) {
      ++t->failures;
    }
    if (kvr_router_mark_prefill_completed(t->router, id, NULL) != KVR_OK) ++t->failures;
    if (kvr_router_free_request(t->router, id, NULL) != KVR_OK) ++t->failures;
  }
  return NULL;
}

static void many_threads_one_router(void** state) {
  kvr_router* router = kvt_router_new(BS, 0);
  worker_thread threads[THREADS];
  pthread_t handles[THREADS];
  kvr_metrics m;
  int i;
  (void)state;
  kvt_add_worker(router, 1);
  kvt_add_worker(router, 2);
  kvt_add_worker(router, 3);
  for (i = 0; i < THREADS; ++i) {
    threads[i].router = router;
    threads[i].index = i;
    threads[i].failures = 0;
    threads[i].booked = 0;
    assert_int_equal(0, pthread_create(&handles[i], NULL, run, &threads[i]));
  }
  for (i = 0; i < THREADS; ++i) assert_int_equal(0, pthread_join(handles[i], NULL));
  for (i = 0; i < THREADS; ++i) {
    assert_int_equal(0, threads[i].failures);
    assert_int_equal(REQUESTS_PER_THREAD, threads[i].booked);
  }
  m = kvt_metrics(router);
  assert_int_equal(0, m.requests_active);
  assert_int_equal(THREADS * REQUESTS_PER_THREAD, m.decisions);
  assert_int_equal(THREADS * REQUESTS_PER_THREAD, m.events[KVR_EVENT_STORED][KVR_EVENT_OK]);
  kvr_router_free(router);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(many_threads_one_router),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
