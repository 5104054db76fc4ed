/* Engine workers (vLLM / SGLang ZMQ publishers) registered with an ingest object through the C
 * ABI: registration and deregistration at runtime, the block size rule with its message,
 * argument checks, and the per-source counters. (The ZMQ traffic itself is tested end to end
 * in tests/ingest/engine_ingest_test.cc, which can run a ZMQ publisher.) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>

#include "test_util.h"

typedef struct fixture {
  kvt_fixture fx; /* no workers, no prompt */
  kvr_ingest* ingest;
} fixture;

static int setup(void** state) {
  fixture* f = (fixture*)calloc(1, sizeof(fixture));
  kvr_router_options opts = kvt_router_options(16, 0);
  if (f == NULL) return -1;
  kvt_fixture_init(&f->fx, &opts, 0, 0, 0);
  KVT_OK(kvr_ingest_new(f->fx.router, NULL, &f->ingest, ERRP));
  KVT_OK(kvr_ingest_start(f->ingest, ERRP));
  *state = f;
  return 0;
}

static int teardown(void** state) {
  fixture* f = (fixture*)*state;
  kvr_ingest_free(f->ingest);
  kvt_fixture_release(&f->fx);
  free(f);
  return 0;
}

static kvr_engine_worker worker_at(const char* endpoint, uint64_t worker_id) {
  kvr_engine_worker worker;
  kvr_engine_worker_init(&worker, sizeof worker);
  worker.endpoint = endpoint;
  worker.worker_id = worker_id;
  return worker;
}

static void register_and_deregister_at_runtime(void** state) {
  fixture* f = (fixture*)*state;
  kvr_engine_worker worker = worker_at("tcp://127.0.0.1:5557", 1);
  kvr_ingest_stats stats;
  uint64_t source = 0;
  worker.dp_size = 2;
  worker.topic = "kv-events";
  worker.engine = KVR_ENGINE_SGLANG;
  KVT_OK(kvr_ingest_add_engine_worker(f->ingest, &worker, &source, ERRP));
  assert_true(source != 0);
  KVT_EXPECT_FAILS(KVR_ALREADY_EXISTS,
                   kvr_ingest_add_engine_worker(f->ingest, &worker, NULL, ERRP));
  kvr_ingest_stats_init(&stats, sizeof stats);
  KVT_OK(kvr_ingest_get_stats(f->ingest, source, &stats, ERRP));
  assert_int_equal(0, stats.messages);
  assert_int_equal(0, stats.state_unknown);
  KVT_OK(kvr_ingest_remove_engine_worker(f->ingest, 1, 1, ERRP));
  KVT_EXPECT_FAILS(KVR_NOT_FOUND, kvr_ingest_remove_engine_worker(f->ingest, 1, 0, ERRP));
  /* Its counters stay readable after it left. */
  KVT_OK(kvr_ingest_get_stats(f->ingest, source, &stats, ERRP));
  KVT_OK(kvr_ingest_add_engine_worker(f->ingest, &worker, NULL, ERRP));
}

static void block_size_mismatch_is_refused_with_a_clear_error(void** state) {
  fixture* f = (fixture*)*state;
  kvr_engine_worker worker = worker_at("tcp://127.0.0.1:5557", 2);
  kvr_error* err = NULL;
  worker.block_size = 32;
  assert_int_equal(KVR_INVALID_ARGUMENT,
                   kvr_ingest_add_engine_worker(f->ingest, &worker, NULL, &err));
  assert_non_null(strstr(kvr_error_message(err), "block size 32"));
  assert_non_null(strstr(kvr_error_message(err), "router's block size is 16"));
  kvr_error_free(err);
  worker.block_size = 16; /* equal is fine, as is 0 (the router's) */
  KVT_OK(kvr_ingest_add_engine_worker(f->ingest, &worker, NULL, ERRP));
}

static void bad_arguments(void** state) {
  fixture* f = (fixture*)*state;
  kvr_engine_worker worker = worker_at(NULL, 3);
  kvr_ingest_stats stats;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_ingest_add_engine_worker(f->ingest, &worker, NULL, ERRP));
  worker.endpoint = "not-a-zmq-endpoint";
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_ingest_add_engine_worker(f->ingest, &worker, NULL, ERRP));
  worker.endpoint = "tcp://127.0.0.1:5557";
  worker.dp_size = 0;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_ingest_add_engine_worker(f->ingest, &worker, NULL, ERRP));
  worker.dp_size = 1;
  worker.engine = 7;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_ingest_add_engine_worker(f->ingest, &worker, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_ingest_add_engine_worker(f->ingest, NULL, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_ingest_add_engine_worker(NULL, &worker, NULL, ERRP));
  kvr_ingest_stats_init(&stats, sizeof stats);
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_ingest_get_stats(f->ingest, 0, NULL, ERRP));
  /* The totals always exist. */
  KVT_OK(kvr_ingest_get_stats(f->ingest, 0, &stats, ERRP));
  assert_int_equal(sizeof(kvr_ingest_stats), stats.struct_size);
  /* A flag other than KVR_STORED_EAGLE means nothing for an engine worker: refused. */
  kvr_engine_worker_init(&worker, sizeof worker);
  worker.endpoint = "tcp://127.0.0.1:1";
  worker.worker_id = 77;
  worker.flags = KVR_STORED_HAS_PARENT;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "kvr_engine_worker.flags",
                          kvr_ingest_add_engine_worker(f->ingest, &worker, NULL, ERRP));
}

/* The first released kvr_ingest_stats (0.1.0's, ending at `connections`, before the lag and
 * replica counters) is written no further. */
static void stats_of_the_first_layout(void** state) {
  fixture* f = (fixture*)*state;
  const size_t first = KVT_LAYOUT_END(kvr_ingest_stats, connections);
  kvr_ingest_stats stats;
  size_t i;
  memset(&stats, 0xAB, sizeof stats);
  KVT_OK(kvr_ingest_stats_init(&stats, first));
  KVT_OK(kvr_ingest_get_stats(f->ingest, 0, &stats, ERRP));
  assert_int_equal(first, stats.struct_size);
  assert_int_equal(0, stats.messages);
  for (i = first; i < sizeof stats; ++i) assert_int_equal(0xAB, ((uint8_t*)&stats)[i]);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(register_and_deregister_at_runtime, setup, teardown),
      cmocka_unit_test_setup_teardown(block_size_mismatch_is_refused_with_a_clear_error, setup,
                                      teardown),
      cmocka_unit_test_setup_teardown(bad_arguments, setup, teardown),
      cmocka_unit_test_setup_teardown(stats_of_the_first_layout, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
