/* What the C ABI says of a transport this build left out (CMake options KVR_WITH_ZMQ and
 * KVR_WITH_NATS): its functions still exist and return KVR_UNIMPLEMENTED with a message naming
 * the option, whatever their arguments; those of a transport the build has do not. The build
 * passes KVR_TEST_WITH_ZMQ and KVR_TEST_WITH_NATS (0 or 1). Routing works either way. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>

#include "test_util.h"

#define KVT_WITH_LOOP (KVR_TEST_WITH_ZMQ || KVR_TEST_WITH_NATS)

/* The ingest object of this build, or NULL when it has no ingest loop (then asserted). */
static kvr_ingest* ingest_or_null(kvr_router* router) {
  kvr_ingest* ingest = NULL;
#if KVT_WITH_LOOP
  KVT_OK(kvr_ingest_new(router, NULL, &ingest, ERRP));
#else
  KVT_EXPECT_FAILS_SAYING(KVR_UNIMPLEMENTED, "-DKVR_WITH_NATS=OFF",
                          kvr_ingest_new(router, NULL, &ingest, ERRP));
  assert_null(ingest);
#endif
  return ingest;
}

static void the_ingest_loop_comes_with_either_transport(void** state) {
  (void)state;
  kvr_router* router = kvt_router_new(16, 0);
  kvr_ingest* ingest = ingest_or_null(router);
#if !KVT_WITH_LOOP
  /* Every function of the ingest object says why, even given no object. */
  uint64_t id = 0;
  kvr_ingest_stats stats;
  KVT_OK(kvr_ingest_stats_init(&stats, sizeof stats));
  KVT_EXPECT_FAILS(KVR_UNIMPLEMENTED, kvr_ingest_start(NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_UNIMPLEMENTED, kvr_ingest_stop(NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_UNIMPLEMENTED,
                   kvr_ingest_listen(NULL, "tcp://127.0.0.1:0", &id, NULL, 0, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_UNIMPLEMENTED, kvr_ingest_source_endpoint(NULL, 1, NULL, 0, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_UNIMPLEMENTED, kvr_ingest_get_stats(NULL, 0, &stats, ERRP));
  kvr_ingest_free(NULL);
#endif
  kvr_ingest_free(ingest);
  kvr_router_free(router);
}

static void engine_workers_need_zmq(void** state) {
  (void)state;
  kvr_router* router = kvt_router_new(16, 0);
  kvr_ingest* ingest = ingest_or_null(router);
  kvr_engine_worker worker;
  KVT_OK(kvr_engine_worker_init(&worker, sizeof worker)); /* structs init in every build */
  worker.worker_id = 1;
  worker.endpoint = ""; /* refused before anything connects, where ZMQ is in */
#if KVR_TEST_WITH_ZMQ
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_ingest_add_engine_worker(ingest, &worker, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_NOT_FOUND, kvr_ingest_remove_engine_worker(ingest, 1, 0, ERRP));
#else
  KVT_EXPECT_FAILS_SAYING(KVR_UNIMPLEMENTED, "-DKVR_WITH_ZMQ=OFF",
                          kvr_ingest_add_engine_worker(ingest, &worker, NULL, ERRP));
  KVT_EXPECT_FAILS_SAYING(KVR_UNIMPLEMENTED, "-DKVR_WITH_ZMQ=OFF",
                          kvr_ingest_remove_engine_worker(ingest, 1, 0, ERRP));
  KVT_EXPECT_FAILS(KVR_UNIMPLEMENTED, kvr_ingest_add_engine_worker(NULL, NULL, NULL, ERRP));
#endif
  kvr_ingest_free(ingest);
  kvr_router_free(router);
}

static void nats_needs_nats(void** state) {
  (void)state;
  kvr_router* router = kvt_router_new(16, 0);
  kvr_ingest* ingest = ingest_or_null(router);
#if KVR_TEST_WITH_NATS
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_ingest_subscribe_nats(ingest, "", "kv", NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_ingest_sync_replicas(ingest, "", "kv", "replica-a", NULL, ERRP));
#else
  KVT_EXPECT_FAILS_SAYING(KVR_UNIMPLEMENTED, "-DKVR_WITH_NATS=OFF",
                          kvr_ingest_subscribe_nats(ingest, "", "kv", NULL, ERRP));
  KVT_EXPECT_FAILS_SAYING(KVR_UNIMPLEMENTED, "-DKVR_WITH_NATS=OFF",
                          kvr_ingest_sync_replicas(ingest, "", "kv", "replica-a", NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_UNIMPLEMENTED, kvr_ingest_subscribe_nats(NULL, NULL, NULL, NULL, ERRP));
#endif
  kvr_ingest_free(ingest);
  kvr_router_free(router);
}

/* The publisher is a plain socket client: in every build. Nothing listens on port 1. */
static void the_publisher_is_in_every_build(void** state) {
  (void)state;
  kvr_publisher* publisher = NULL;
  KVT_EXPECT_FAILS(KVR_UNAVAILABLE, kvr_publisher_connect("tcp://127.0.0.1:1", &publisher, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_publisher_connect("ipc:///tmp/x", &publisher, ERRP));
  assert_null(publisher);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(the_ingest_loop_comes_with_either_transport),
      cmocka_unit_test(engine_workers_need_zmq),
      cmocka_unit_test(nats_needs_nats),
      cmocka_unit_test(the_publisher_is_in_every_build),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
