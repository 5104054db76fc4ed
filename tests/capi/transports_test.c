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

/* One call of a transport's function, its status and error: in a build with the transport
 * (`in_build`) it answers `when_in`; otherwise KVR_UNIMPLEMENTED, saying `option`. */
static void expect_transport(int in_build, kvr_status when_in, const char* option,
                             kvr_status status, kvr_error* err) {
  if (in_build) {
    assert_int_equal(when_in, status);
  } else {
    assert_int_equal(KVR_UNIMPLEMENTED, status);
    assert_non_null(err);
    if (strstr(kvr_error_message(err), option) == NULL) {
      fprintf(stderr, "the message \"%s\" does not say \"%s\"\n", kvr_error_message(err), option);
    }
    assert_non_null(strstr(kvr_error_message(err), option));
  }
  kvr_error_free(err);
}

#define KVT_EXPECT_TRANSPORT(in_build, when_in, option, call)                                     \
  do {                                                                                            \
    kvr_error* kvt_transport_err_ = NULL;                                                         \
    kvr_error** ERRP = &kvt_transport_err_;                                                       \
    kvr_status kvt_transport_status_ = (call);                                                    \
    expect_transport((in_build), (when_in), (option), kvt_transport_status_, kvt_transport_err_); \
  } while (0)

/* Arguments each transport refuses before it connects anywhere, so that a build with it
 * answers KVR_INVALID_ARGUMENT (or KVR_NOT_FOUND) and one without it KVR_UNIMPLEMENTED. */
static void each_transport_is_there_or_says_which_option_left_it_out(void** state) {
  (void)state;
  kvr_router* router = kvt_router_new(16, 0);
  kvr_ingest* ingest = ingest_or_null(router);
  kvr_engine_worker worker;
  KVT_OK(kvr_engine_worker_init(&worker, sizeof worker)); /* structs init in every build */
  worker.worker_id = 1;
  worker.endpoint = "";
  KVT_EXPECT_TRANSPORT(KVR_TEST_WITH_ZMQ, KVR_INVALID_ARGUMENT, "-DKVR_WITH_ZMQ=OFF",
                       kvr_ingest_add_engine_worker(ingest, &worker, NULL, ERRP));
  KVT_EXPECT_TRANSPORT(KVR_TEST_WITH_ZMQ, KVR_NOT_FOUND, "-DKVR_WITH_ZMQ=OFF",
                       kvr_ingest_remove_engine_worker(ingest, 1, 0, ERRP));
  KVT_EXPECT_TRANSPORT(KVR_TEST_WITH_NATS, KVR_INVALID_ARGUMENT, "-DKVR_WITH_NATS=OFF",
                       kvr_ingest_subscribe_nats(ingest, "", "kv", NULL, ERRP));
  KVT_EXPECT_TRANSPORT(KVR_TEST_WITH_NATS, KVR_INVALID_ARGUMENT, "-DKVR_WITH_NATS=OFF",
                       kvr_ingest_sync_replicas(ingest, "", "kv", "replica-a", NULL, ERRP));
  /* Left out, a transport's function says so whatever its arguments. */
  if (!KVR_TEST_WITH_ZMQ) {
    KVT_EXPECT_FAILS(KVR_UNIMPLEMENTED, kvr_ingest_add_engine_worker(NULL, NULL, NULL, ERRP));
  }
  if (!KVR_TEST_WITH_NATS) {
    KVT_EXPECT_FAILS(KVR_UNIMPLEMENTED, kvr_ingest_subscribe_nats(NULL, NULL, NULL, NULL, ERRP));
  }
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
      cmocka_unit_test(each_transport_is_there_or_says_which_option_left_it_out),
      cmocka_unit_test(the_publisher_is_in_every_build),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
