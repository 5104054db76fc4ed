/* Metrics through the C ABI: kvr_metrics_init, kvr_router_get_metrics (counters and gauges,
 * struct versioning) and kvr_router_metrics_prometheus (text format, buffer rules). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>

#include "test_util.h"

#define BS 16

typedef kvt_fixture fixture;

/* Two workers; worker 1 caches the prompt; one decision booked, one rejected event. */
static int setup(void** state) {
  fixture* f = kvt_fixture_new(BS, 0, 2, 4 * BS, 1);
  kvr_request_options opts = kvt_admit("m-1");
  kvr_route_result result;
  uint64_t missing = 12345;
  kvr_removed_event removed;
  KVT_OK(kvt_store(f->router, 1, 0, KVR_TIER_DEVICE, f->prompt, 4, BS, 100, 0, 0, ERRP));
  kvr_removed_event_init(&removed, sizeof removed);
  removed.worker_id = 2;
  removed.block_hashes = &missing;
  removed.num_blocks = 1;
  if (kvr_router_apply_removed(f->router, &removed, NULL) != KVR_NOT_FOUND) return -1;
  kvr_route_result_init(&result, sizeof result);
  KVT_OK(kvr_find_best_match(f->router, f->prompt, 4 * BS, &opts, &result, NULL, 0, NULL, ERRP));
  *state = f;
  return 0;
}

static void counters(void** state) {
  fixture* f = (fixture*)*state;
  kvr_metrics m = kvt_metrics(f->router);
  assert_int_equal(sizeof m, m.struct_size);
  assert_int_equal(1, m.events[KVR_EVENT_STORED][KVR_EVENT_OK]);
  assert_int_equal(1, m.events[KVR_EVENT_REMOVED][KVR_EVENT_BLOCK_NOT_FOUND]);
  assert_int_equal(0, m.events[KVR_EVENT_REMOVED][KVR_EVENT_OK]);
  assert_int_equal(0, m.events[KVR_EVENT_CLEARED][KVR_EVENT_OK]);
  assert_int_equal(0, m.event_batches_rejected);
  assert_int_equal(1, m.decisions);
  assert_int_equal(1, m.requests_active);
  assert_int_equal(0, m.queue_pending);
  assert_int_equal(0, m.queue_pending_tokens);
  assert_int_equal(2, m.workers);
  assert_int_equal(4, m.index_blocks);
  assert_true(m.index_nodes >= 2); /* the root and at least one run */
  assert_true(m.index_bytes > 0);
  /* Nothing was refused memory: no event, no replica change (there is no publisher). */
  assert_int_equal(0, m.events_refused_for_memory);
  assert_int_equal(0, m.replica_changes_unpublished);
  /* One caller at a time: no decision collided with another
   * (tests/capi_internal makes one). */
  assert_int_equal(0, m.decisions_priced_again);

  KVT_OK(kvr_router_free_request(f->router, "m-1", ERRP));
  KVT_OK(kvr_router_apply_cleared(f->router, 1, 0, 2, ERRP));
  m = kvt_metrics(f->router);
  assert_int_equal(0, m.requests_active);
  assert_int_equal(1, m.events[KVR_EVENT_CLEARED][KVR_EVENT_OK]);
  assert_int_equal(0, m.index_blocks);
}

/* The decision-latency histogram (0.2): the setup's one decision, then previews and a failed
 * call; on the real clock, so only its shape and counts are known. */
static void decision_latency_histogram(void** state) {
  fixture* f = (fixture*)*state;
  kvr_route_result result;
  kvr_route_signals signals;
  kvr_request_options again = kvt_admit("m-1");
  kvr_metrics m = kvt_metrics(f->router);
  int i;
  assert_int_equal(1, m.decision_latency_count);
  assert_int_equal(500, m.decision_latency_bounds_ns[0]);
  for (i = 1; i < KVR_DECISION_LATENCY_BUCKETS; ++i) {
    assert_true(m.decision_latency_bounds_ns[i] > m.decision_latency_bounds_ns[i - 1]);
    assert_true(m.decision_latency_le[i] >= m.decision_latency_le[i - 1]);
  }
  assert_true(m.decision_latency_le[KVR_DECISION_LATENCY_BUCKETS - 1] <= 1);
  assert_true(m.decision_latency_sum_ns > 0 || m.decision_latency_le[0] == 1);

  kvr_route_result_init(&result, sizeof result);
  kvr_route_signals_init(&signals, sizeof signals);
  for (i = 0; i < 16; ++i) {
    KVT_OK(kvr_preview_route(f->router, f->prompt, 4 * BS, NULL, NULL, &signals, ERRP));
  }
  KVT_EXPECT_FAILS(KVR_ALREADY_EXISTS, kvr_find_best_match(f->router, f->prompt, 4 * BS, &again,
                                                           &result, NULL, 0, NULL, ERRP));
  m = kvt_metrics(f->router);
  /* One call in 16 is timed, the first included: the setup's decision and the 16th preview;
   * a failure is not. */
  assert_int_equal(2, m.decision_latency_count);
  assert_int_equal(1, m.decisions);
}

static void get_metrics_null_and_struct_size(void** state) {
  fixture* f = (fixture*)*state;
  kvr_metrics m;
  /* The first released layout (0.1.0's) ended with index_bytes. */
  const size_t covered = KVT_LAYOUT_END(kvr_metrics, index_bytes);
  uint8_t sentinel[sizeof(kvr_metrics)];
  struct {
    kvr_metrics base;
    uint64_t tail[2];
  } newer;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_get_metrics(f->router, NULL, ERRP));

  kvr_metrics_init(&m, sizeof m);
  m.struct_size = 0;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_get_metrics(f->router, &m, ERRP));

  /* An older caller's struct (the first released layout, without the replica counters) is
   * written no further. */
  memset(&m, 0xAB, sizeof m);
  memset(sentinel, 0xAB, sizeof sentinel);
  KVT_OK(kvr_metrics_init(&m, covered));
  assert_int_equal(covered, m.struct_size);
  KVT_OK(kvr_router_get_metrics(f->router, &m, ERRP));
  assert_int_equal(covered, m.struct_size);
  assert_int_equal(1, m.events[KVR_EVENT_STORED][KVR_EVENT_OK]);
  assert_int_equal(2, m.workers);
  assert_memory_equal(sentinel + covered, (uint8_t*)&m + covered, sizeof m - covered);

  /* The layout before the refusal counters (0.2.0's, ending at replicas_expired): the counters
   * up to there are written, the two it lacks are not. */
  memset(&m, 0xAB, sizeof m);
  KVT_OK(kvr_metrics_init(&m, KVT_LAYOUT_END(kvr_metrics, replicas_expired)));
  KVT_OK(kvr_router_get_metrics(f->router, &m, ERRP));
  assert_int_equal(480, m.struct_size);
  assert_int_equal(2, m.workers);
  assert_int_equal(0, m.replicas_expired);
  assert_int_equal(0xABABABABABABABABull, m.events_refused_for_memory);
  assert_int_equal(0xABABABABABABABABull, m.replica_changes_unpublished);
  assert_int_equal(0xABABABABABABABABull, m.decisions_priced_again);

  /* The layout before decisions_priced_again (ending at replica_changes_unpublished). */
  memset(&m, 0xAB, sizeof m);
  KVT_OK(kvr_metrics_init(&m, KVT_LAYOUT_END(kvr_metrics, replica_changes_unpublished)));
  KVT_OK(kvr_router_get_metrics(f->router, &m, ERRP));
  assert_int_equal(496, m.struct_size);
  assert_int_equal(0, m.replica_changes_unpublished);
  assert_int_equal(0xABABABABABABABABull, m.decisions_priced_again);

  /* Shorter than that: refused, nothing written. */
  memset(&m, 0xAB, sizeof m);
  m.struct_size = (uint32_t)offsetof(kvr_metrics, decisions);
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "first released layout",
                          kvr_router_get_metrics(f->router, &m, ERRP));
  assert_true(((uint8_t*)&m)[offsetof(kvr_metrics, events)] == 0xAB);

  /* A newer caller's larger struct: the known part is filled, the tail keeps _init's zeros. */
  memset(&newer, 0xAB, sizeof newer);
  KVT_OK(kvr_metrics_init(&newer.base, sizeof newer));
  KVT_OK(kvr_router_get_metrics(f->router, &newer.base, ERRP));
  assert_int_equal(sizeof newer, newer.base.struct_size);
  assert_int_equal(2, newer.base.workers);
  assert_int_equal(0, newer.tail[0]);
  assert_int_equal(0, newer.tail[1]);
}

static char* prometheus(kvr_router* router) {
  size_t len = 0;
  char* text;
  KVT_EXPECT_FAILS(KVR_BUFFER_TOO_SMALL,
                   kvr_router_metrics_prometheus(router, NULL, 0, &len, ERRP));
  assert_true(len > 1);
  text = (char*)malloc(len);
  assert_non_null(text);
  KVT_OK(kvr_router_metrics_prometheus(router, text, len, &len, ERRP));
  return text;
}

static void prometheus_text(void** state) {
  fixture* f = (fixture*)*state;
  size_t len = 0;
  char* text;
  KVT_EXPECT_FAILS(KVR_BUFFER_TOO_SMALL,
                   kvr_router_metrics_prometheus(f->router, NULL, 0, &len, ERRP));
  text = (char*)malloc(len + 16);
  assert_non_null(text);
  memset(text, 'Z', len + 16);
  KVT_OK(kvr_router_metrics_prometheus(f->router, text, len + 16, &len, ERRP));
  /* NUL-terminated, and *len counts the NUL. */
  assert_int_equal('\0', text[len - 1]);
  assert_int_equal(len - 1, strlen(text));
  assert_int_equal('Z', text[len]); /* nothing written past it */
  /* Text exposition format: HELP/TYPE lines, one sample per line, ending with a newline. */
  assert_int_equal('\n', text[len - 2]);
  assert_non_null(strstr(text, "# HELP "));
  assert_non_null(strstr(text, "# TYPE "));
  assert_non_null(strstr(text, " counter\n"));
  assert_non_null(strstr(text, " gauge\n"));
  /* The counters of kvr_metrics, with their values. */
  assert_non_null(strstr(text, "\nkvrouter_decisions_total 1\n"));
  assert_non_null(strstr(text, "\nkvrouter_requests_active 1\n"));
  assert_non_null(strstr(text, "\nkvrouter_workers 2\n"));
  assert_non_null(strstr(text, "\nkvrouter_event_batches_rejected_total 0\n"));
  assert_non_null(strstr(text, "\nkvrouter_queue_pending_requests 0\n"));
  assert_non_null(strstr(text, "\nkvrouter_index_blocks 4\n"));
  assert_non_null(strstr(text, "kvrouter_kv_events_total{"));
  assert_non_null(strstr(text, "# TYPE kvrouter_events_refused_for_memory_total counter\n"));
  assert_non_null(strstr(text, "\nkvrouter_events_refused_for_memory_total 0\n"));
  assert_non_null(strstr(text, "# TYPE kvrouter_replica_changes_unpublished_total counter\n"));
  assert_non_null(strstr(text, "\nkvrouter_replica_changes_unpublished_total 0\n"));
  assert_non_null(strstr(text, "# TYPE kvrouter_decisions_priced_again_total counter\n"));
  assert_non_null(strstr(text, "\nkvrouter_decisions_priced_again_total 0\n"));
  /* The decision-latency histogram: buckets in seconds, +Inf, sum and count. */
  assert_non_null(strstr(text, "# TYPE kvrouter_decision_duration_seconds histogram\n"));
  assert_non_null(strstr(text, "\nkvrouter_decision_duration_seconds_bucket{le=\"5e-07\"} "));
  assert_non_null(strstr(text, "\nkvrouter_decision_duration_seconds_bucket{le=\"0.01\"} "));
  assert_non_null(strstr(text, "\nkvrouter_decision_duration_seconds_bucket{le=\"+Inf\"} 1\n"));
  assert_non_null(strstr(text, "\nkvrouter_decision_duration_seconds_count 1\n"));
  assert_non_null(strstr(text, "\nkvrouter_decision_duration_seconds_sum "));
  free(text);

  /* The text follows the router's state. */
  KVT_OK(kvr_router_free_request(f->router, "m-1", ERRP));
  text = prometheus(f->router);
  assert_non_null(strstr(text, "\nkvrouter_requests_active 0\n"));
  free(text);
}

static void prometheus_buffer_too_small_then_retry(void** state) {
  fixture* f = (fixture*)*state;
  char small[8];
  size_t len = 0;
  char* text;
  memset(small, 'Z', sizeof small);
  KVT_EXPECT_FAILS(KVR_BUFFER_TOO_SMALL,
                   kvr_router_metrics_prometheus(f->router, small, sizeof small, &len, ERRP));
  assert_true(len > sizeof small);
  {
    char sentinel[sizeof small];
    memset(sentinel, 'Z', sizeof sentinel);
    assert_memory_equal(sentinel, small, sizeof small); /* untouched on failure */
  }
  text = (char*)malloc(len);
  assert_non_null(text);
  KVT_OK(kvr_router_metrics_prometheus(f->router, text, len, &len, ERRP));
  assert_int_equal(len - 1, strlen(text));
  /* One byte short (no room for the NUL) is too small. */
  KVT_EXPECT_FAILS(KVR_BUFFER_TOO_SMALL,
                   kvr_router_metrics_prometheus(f->router, text, len - 1, &len, ERRP));
  free(text);
}

static void prometheus_null_arguments(void** state) {
  fixture* f = (fixture*)*state;
  char buf[16];
  (void)buf; /* (NULL len with a buffer: errors_test.c.) */
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_metrics_prometheus(f->router, NULL, 1 << 20, NULL, ERRP));
}

/* A hybrid model's sliding-window events (fixtures/event_batch_sliding.json, a FlatBuffers batch
 * as any publisher may send): worker 7's window (32 tokens: the two blocks before a hit point)
 * holds blocks 2 and 3 of its 4-block prompt, then loses block 3; a store naming a block worker 7
 * does not hold is rejected, the rest applied. Worker 8 is full attention only. */
static void sliding_windows(void** state) {
  (void)state;
  kvr_router* router = kvt_router_new(BS, 0);
  size_t size = 0;
  uint8_t* batch = kvt_read_file(KVR_CAPI_DATA_DIR "/event_batch_sliding.bin", &size);
  kvr_error* err = NULL;
  assert_non_null(batch);
  assert_int_equal(KVR_NOT_FOUND, kvr_router_apply_event_batch(router, batch, size, &err));
  assert_non_null(strstr(kvr_error_message(err), "sliding-window blocks of group 0"));
  kvr_error_free(err);
  free(batch);
  kvr_metrics m = kvt_metrics(router);
  assert_int_equal(2, m.sliding_events_applied);
  assert_int_equal(1, m.sliding_events_rejected);
  assert_int_equal(1, m.index_sliding_blocks);
  assert_int_equal(8, m.index_blocks);

  /* A prompt sharing the first three blocks: worker 7's window holds block 2 but not block 1,
   * nor block 0, so its engine would compute it all; worker 8 has three blocks cached. */
  uint32_t tokens[4 * BS];
  for (uint32_t i = 0; i < 4 * BS; ++i) tokens[i] = i < 3 * BS ? i + 1 : 999;
  uint64_t hashes[4];
  size_t len = 0;
  KVT_OK(kvr_compute_block_hashes(tokens, 4 * BS, BS, NULL, hashes, 4, &len, ERRP));
  kvr_match matches[4];
  KVT_OK(kvr_router_find_matches(router, hashes, 4, matches, 4, &len, ERRP));
  assert_int_equal(1, len);
  assert_int_equal(8, matches[0].worker_id);
  assert_int_equal(3, matches[0].device_blocks);

  char text[16384];
  KVT_OK(kvr_router_metrics_prometheus(router, text, sizeof text, &len, ERRP));
  assert_non_null(strstr(text, "\nkvrouter_sliding_window_events_applied_total 2\n"));
  assert_non_null(strstr(text, "\nkvrouter_sliding_window_events_rejected_total 1\n"));
  assert_non_null(strstr(text, "\nkvrouter_index_sliding_blocks 1\n"));
  kvr_router_free(router);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(sliding_windows),
      cmocka_unit_test_setup_teardown(counters, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(decision_latency_histogram, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(get_metrics_null_and_struct_size, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(prometheus_text, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(prometheus_buffer_too_small_then_retry, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(prometheus_null_arguments, setup, kvt_teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
