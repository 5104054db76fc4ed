/* KV event ingestion over kvrouter's native stream: an ingest object with its loop thread,
 * TCP and Unix-socket listeners on 127.0.0.1 / a temporary directory, kvr_publisher_* sending
 * FlatBuffers batches, events reaching the router while it routes, bad frames rejected and
 * counted without disturbing other connections, and the lifecycle rules. */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <arpa/inet.h>
#include <cmocka.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "test_util.h"

#define BS 16
#define WAIT_MS 10000 /* bound on every wait for the loop thread */

typedef struct fixture {
  kvt_fixture fx; /* workers 1 and 2, no prompt */
  kvr_ingest* ingest;
  char dir[64];
} fixture;

static int setup(void** state) {
  fixture* f = (fixture*)calloc(1, sizeof(fixture));
  kvr_router_options opts = kvt_router_options(BS, 0);
  if (f == NULL) return -1;
  kvt_fixture_init(&f->fx, &opts, 2, 0, 0);
  KVT_OK(kvr_ingest_new(f->fx.router, NULL, &f->ingest, ERRP));
  KVT_OK(kvr_ingest_start(f->ingest, ERRP));
  strcpy(f->dir, "/tmp/kvr_ingest_XXXXXX");
  assert_non_null(mkdtemp(f->dir));
  *state = f;
  return 0;
}

static int teardown(void** state) {
  fixture* f = (fixture*)*state;
  kvr_ingest_free(f->ingest);
  kvt_fixture_release(&f->fx);
  {
    char path[128];
    snprintf(path, sizeof path, "%s/events.sock", f->dir);
    unlink(path);
    rmdir(f->dir);
  }
  free(f);
  return 0;
}

static void sleep_ms(long ms) {
  struct timespec ts;
  ts.tv_sec = ms / 1000;
  ts.tv_nsec = (ms % 1000) * 1000000L;
  nanosleep(&ts, NULL);
}

static kvr_ingest_stats stats_of(kvr_ingest* ingest, uint64_t source) {
  kvr_ingest_stats stats;
  kvr_ingest_stats_init(&stats, sizeof stats);
  KVT_OK(kvr_ingest_get_stats(ingest, source, &stats, ERRP));
  return stats;
}

/* Polls until the source has seen `messages` messages (bounded by WAIT_MS). */
static kvr_ingest_stats wait_messages(kvr_ingest* ingest, uint64_t source, uint64_t messages) {
  int waited;
  kvr_ingest_stats stats = stats_of(ingest, source);
  for (waited = 0; stats.messages < messages && waited < WAIT_MS; ++waited) {
    sleep_ms(1);
    stats = stats_of(ingest, source);
  }
  assert_true(stats.messages >= messages);
  return stats;
}

/* A batch with one stored event: `num_blocks` blocks of `tokens` on `worker_id`. */
static kvr_event_batch* stored_batch(uint64_t worker_id, const uint32_t* tokens, size_t num_blocks,
                                     uint64_t first_hash) {
  return kvt_stored_batch(worker_id, tokens, num_blocks, BS, first_hash);
}

static uint64_t listen_on(fixture* f, const char* endpoint, char* bound, size_t cap) {
  uint64_t source = 0;
  size_t len = 0;
  KVT_OK(kvr_ingest_listen(f->ingest, endpoint, &source, bound, cap, &len, ERRP));
  assert_true(source != 0);
  assert_int_equal(strlen(bound) + 1, len);
  return source;
}

/* Publishes 4 blocks for worker_id through `endpoint` and checks they reach the router. */
static void publish_and_check(fixture* f, const char* endpoint, uint64_t source,
                              uint64_t worker_id) {
  uint32_t tokens[4 * BS];
  kvr_publisher* publisher = NULL;
  kvr_event_batch* batch;
  kvr_overlap overlap;
  kvr_ingest_stats stats;
  kvt_fill_tokens(tokens, 4 * BS, 500 + (uint32_t)worker_id * 1000);
  KVT_OK(kvr_publisher_connect(endpoint, &publisher, ERRP));
  batch = stored_batch(worker_id, tokens, 4, 100);
  KVT_OK(kvr_publisher_send(publisher, batch, ERRP));
  stats = wait_messages(f->ingest, source, 1);
  assert_int_equal(1, stats.events_applied);
  assert_int_equal(1, stats.connections);
  assert_true(kvt_overlap_of(f->fx.router, tokens, 4 * BS, worker_id, 0, &overlap));
  assert_int_equal(4, overlap.device_blocks);
  kvr_event_batch_free(batch);
  kvr_publisher_free(publisher);
}

static void tcp_events_reach_the_router(void** state) {
  fixture* f = (fixture*)*state;
  char bound[128];
  const uint64_t source = listen_on(f, "tcp://127.0.0.1:0", bound, sizeof bound);
  assert_true(strncmp(bound, "tcp://127.0.0.1:", 16) == 0);
  assert_true(strcmp(bound, "tcp://127.0.0.1:0") != 0); /* the real port */
  publish_and_check(f, bound, source, 1);
}

/* A bound endpoint that does not fit: the listener is open all the same, and its endpoint is
 * read back by source id (listening again would open a second listener). */
static void short_buffer_then_endpoint_by_source(void** state) {
  fixture* f = (fixture*)*state;
  char small[4];
  char bound[128];
  size_t len = 0;
  uint64_t source = 0;
  kvr_error* err = NULL;
  assert_int_equal(KVR_BUFFER_TOO_SMALL, kvr_ingest_listen(f->ingest, "tcp://127.0.0.1:0", &source,
                                                           small, sizeof small, &len, &err));
  kvr_error_free(err);
  assert_true(source != 0);
  assert_true(len > sizeof small);
  KVT_EXPECT_FAILS(KVR_BUFFER_TOO_SMALL,
                   kvr_ingest_source_endpoint(f->ingest, source, small, sizeof small, &len, ERRP));
  KVT_OK(kvr_ingest_source_endpoint(f->ingest, source, bound, sizeof bound, &len, ERRP));
  assert_int_equal(strlen(bound) + 1, len);
  assert_true(strncmp(bound, "tcp://127.0.0.1:", 16) == 0);
  publish_and_check(f, bound, source, 1); /* the one listener takes the events */
  KVT_EXPECT_FAILS(KVR_NOT_FOUND,
                   kvr_ingest_source_endpoint(f->ingest, 999, bound, sizeof bound, &len, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_ingest_source_endpoint(f->ingest, source, bound, sizeof bound, NULL, ERRP));
}

static void unix_socket_events_reach_the_router(void** state) {
  fixture* f = (fixture*)*state;
  char endpoint[128];
  char bound[128];
  uint64_t source;
  snprintf(endpoint, sizeof endpoint, "unix://%s/events.sock", f->dir);
  source = listen_on(f, endpoint, bound, sizeof bound);
  assert_string_equal(endpoint, bound);
  publish_and_check(f, bound, source, 2);
}

/* A raw TCP connection to the listener, for bytes no publisher would send. */
static int raw_connect(const char* bound) {
  struct sockaddr_in addr;
  const char* port = strrchr(bound, ':') + 1;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  memset(&addr, 0, sizeof addr);
  addr.sin_family = AF_INET;
  addr.sin_port = htons((uint16_t)atoi(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(0, connect(fd, (struct sockaddr*)&addr, sizeof addr));
  return fd;
}

/* The ingest's Prometheus text has this listener's series with the counters above: three
 * messages, one event applied, one reject per reason seen, two connections. */
static void expect_in_prometheus_text(kvr_ingest* ingest, uint64_t source, const char* bound) {
  char labels[256];
  char line[512];
  size_t len = 0;
  char* text;
  KVT_EXPECT_FAILS(KVR_BUFFER_TOO_SMALL,
                   kvr_ingest_metrics_prometheus(ingest, NULL, 0, &len, ERRP));
  text = (char*)malloc(len);
  assert_non_null(text);
  KVT_OK(kvr_ingest_metrics_prometheus(ingest, text, len, &len, ERRP));
  assert_int_equal(len - 1, strlen(text));
  snprintf(labels, sizeof labels, "source_id=\"%llu\",kind=\"listener\",endpoint=\"%s\"",
           (unsigned long long)source, bound);
  snprintf(line, sizeof line, "\nkvrouter_ingest_messages_total{%s} 3\n", labels);
  assert_non_null(strstr(text, line));
  snprintf(line, sizeof line, "\nkvrouter_ingest_events_applied_total{%s} 1\n", labels);
  assert_non_null(strstr(text, line));
  snprintf(line, sizeof line, "\nkvrouter_ingest_connections_total{%s} 2\n", labels);
  assert_non_null(strstr(text, line));
  snprintf(line, sizeof line, "\nkvrouter_ingest_rejected_total{%s,reason=\"frame_too_large\"} 1\n",
           labels);
  assert_non_null(strstr(text, line));
  snprintf(line, sizeof line, "\nkvrouter_ingest_rejected_total{%s,reason=\"index\"} 1\n", labels);
  assert_non_null(strstr(text, line));
  snprintf(line, sizeof line, "\nkvrouter_ingest_rejected_total{%s,reason=\"stale_sequence\"} 0\n",
           labels);
  assert_non_null(strstr(text, line));
  assert_non_null(strstr(text, "# TYPE kvrouter_ingest_lag_seconds summary\n"));
  assert_non_null(strstr(text, "# TYPE kvrouter_ingest_state_unknown_ranks gauge\n"));
  assert_non_null(strstr(text, "# TYPE kvrouter_ingest_stream_sequence gauge\n"));
  snprintf(line, sizeof line, "\nkvrouter_ingest_consumer_remakes_total{%s} 0\n", labels);
  assert_non_null(strstr(text, line));
  snprintf(line, sizeof line, "\nkvrouter_ingest_consumer_remake_failures_total{%s} 0\n", labels);
  assert_non_null(strstr(text, line));
  snprintf(line, sizeof line, "\nkvrouter_ingest_events_ignored_total{%s} 0\n", labels);
  assert_non_null(strstr(text, line));
  snprintf(line, sizeof line, "\nkvrouter_ingest_bookings_trimmed_total{%s} 0\n", labels);
  assert_non_null(strstr(text, line));
  free(text);
  /* Buffer rules as the router's text. */
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_ingest_metrics_prometheus(NULL, NULL, 0, &len, ERRP));
}

static void bad_frames_are_rejected_and_counted(void** state) {
  fixture* f = (fixture*)*state;
  char bound[128];
  const uint64_t source = listen_on(f, "tcp://127.0.0.1:0", bound, sizeof bound);
  const uint8_t absurd[8] = {0xff, 0xff, 0xff, 0x7f, 1, 2, 3, 4}; /* a 2 GiB frame */
  const char garbage[] = "this is not a flatbuffer at all";
  uint32_t tokens[2 * BS];
  char byte;
  kvr_publisher* good = NULL;
  kvr_event_batch* batch;
  kvr_ingest_stats stats;
  kvr_overlap overlap;
  int fd;

  /* A well-behaved connection opened first stays up through the others' failures. */
  KVT_OK(kvr_publisher_connect(bound, &good, ERRP));

  /* An absurd length: counted, and the listener closes that connection (EOF on our side). */
  fd = raw_connect(bound);
  assert_int_equal(sizeof absurd, send(fd, absurd, sizeof absurd, 0));
  assert_int_equal(0, recv(fd, &byte, 1, 0)); /* blocks until the server closes */
  close(fd);
  stats = stats_of(f->ingest, source);
  assert_int_equal(1, stats.rejected[KVR_INGEST_REJECT_FRAME_TOO_LARGE]);

  /* Well-framed garbage: rejected alone; the same connection's next batch applies. */
  KVT_OK(kvr_publisher_send_encoded(good, garbage, sizeof garbage, ERRP));
  kvt_fill_tokens(tokens, 2 * BS, 7000);
  batch = stored_batch(1, tokens, 2, 900);
  KVT_OK(kvr_publisher_send(good, batch, ERRP));
  stats = wait_messages(f->ingest, source, 2);
  assert_int_equal(1, stats.rejected[KVR_INGEST_REJECT_BAD_FLATBUFFERS]);
  assert_int_equal(1, stats.events_applied);
  assert_int_equal(2, stats.connections);
  assert_true(kvt_overlap_of(f->fx.router, tokens, 2 * BS, 1, 0, &overlap));
  assert_int_equal(2, overlap.device_blocks);

  /* An event the index refuses (unknown parent) is counted per reason. */
  {
    kvr_event_batch* orphan = NULL;
    kvr_stored_event event;
    uint64_t hash = 5555;
    KVT_OK(kvr_event_batch_new(&orphan, ERRP));
    kvr_stored_event_init(&event, sizeof event);
    event.worker_id = 1;
    event.flags = KVR_STORED_HAS_PARENT;
    event.parent_hash = 424242;
    event.block_hashes = &hash;
    event.num_blocks = 1;
    event.token_ids = tokens;
    event.num_tokens = BS;
    KVT_OK(kvr_event_batch_add_stored(orphan, &event, ERRP));
    KVT_OK(kvr_publisher_send(good, orphan, ERRP));
    stats = wait_messages(f->ingest, source, 3);
    assert_int_equal(1, stats.rejected[KVR_INGEST_REJECT_INDEX]);
    /* The most recent reject's reason, in the index's words (for source 0 too). */
    assert_non_null(strstr(stats.last_reject, "parent block 424242 not found"));
    assert_string_equal(stats.last_reject, stats_of(f->ingest, 0).last_reject);
    kvr_event_batch_free(orphan);
  }
  /* The totals (source 0) include this source. */
  assert_true(stats_of(f->ingest, 0).rejected[KVR_INGEST_REJECT_FRAME_TOO_LARGE] >= 1);
  expect_in_prometheus_text(f->ingest, source, bound);
  kvr_event_batch_free(batch);
  kvr_publisher_free(good);
}

/* Events apply on the loop thread while this thread routes. */
static void events_apply_while_routing(void** state) {
  fixture* f = (fixture*)*state;
  char bound[128];
  const uint64_t source = listen_on(f, "tcp://127.0.0.1:0", bound, sizeof bound);
  enum { kBatches = 200 };
  static uint32_t tokens[kBatches][BS];
  kvr_publisher* publisher = NULL;
  kvr_route_result result;
  kvr_ingest_stats stats;
  int i;
  int waited = 0;
  KVT_OK(kvr_publisher_connect(bound, &publisher, ERRP));
  for (i = 0; i < kBatches; ++i) {
    kvr_event_batch* batch;
    kvt_fill_tokens(tokens[i], BS, 100000 + (uint32_t)i * BS);
    batch = stored_batch(2, tokens[i], 1, 10000 + (uint64_t)i);
    KVT_OK(kvr_publisher_send(publisher, batch, ERRP));
    kvr_event_batch_free(batch);
  }
  do {
    kvr_route_result_init(&result, sizeof result);
    KVT_OK(kvr_find_best_match(f->fx.router, tokens[kBatches - 1], BS, NULL, &result, NULL, 0, NULL,
                               ERRP));
    stats = stats_of(f->ingest, source);
    if (stats.messages < kBatches) sleep_ms(1);
  } while (stats.messages < kBatches && ++waited < WAIT_MS);
  assert_int_equal(kBatches, stats.events_applied);
  /* Once applied, the last prompt goes to the worker that cached it. */
  kvr_route_result_init(&result, sizeof result);
  KVT_OK(kvr_find_best_match(f->fx.router, tokens[kBatches - 1], BS, NULL, &result, NULL, 0, NULL,
                             ERRP));
  assert_int_equal(2, result.worker_id);
  assert_int_equal(1, result.device_overlap_blocks);
  kvr_publisher_free(publisher);
}

static uint64_t unix_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Sends `batch` stamped `publish_time_ns` (or, when `stamp` is 0, with the default stamp) and
 * returns the source's stats once it is handled. */
static kvr_ingest_stats send_stamped(fixture* f, kvr_publisher* publisher, uint64_t source,
                                     kvr_event_batch* batch, int stamp, uint64_t publish_time_ns) {
  const uint64_t before = stats_of(f->ingest, source).messages;
  if (stamp) KVT_OK(kvr_event_batch_set_publish_time(batch, publish_time_ns, ERRP));
  KVT_OK(kvr_publisher_send(publisher, batch, ERRP));
  return wait_messages(f->ingest, source, before + 1);
}

/* Lag runs from a batch's publish time to its events applied: a batch published 3 s ago shows
 * at least 3 s; an unstamped one is not measured; one from a clock ahead of ours shows 0. */
static void lag_is_measured_from_publish_time(void** state) {
  fixture* f = (fixture*)*state;
  char bound[128];
  const uint64_t source = listen_on(f, "tcp://127.0.0.1:0", bound, sizeof bound);
  const uint64_t three_seconds_us = 3000000u;
  uint32_t tokens[BS];
  kvr_publisher* publisher = NULL;
  kvr_event_batch* batch;
  kvr_ingest_stats stats;
  kvt_fill_tokens(tokens, BS, 7);
  KVT_OK(kvr_publisher_connect(bound, &publisher, ERRP));
  batch = stored_batch(1, tokens, 1, 300);

  stats = send_stamped(f, publisher, source, batch, 1, unix_now_ns() - three_seconds_us * 1000u);
  assert_int_equal(1, stats.lag_samples);
  assert_true(stats.lag_last_us >= three_seconds_us);
  assert_int_equal(stats.lag_last_us, stats.lag_max_us);
  assert_int_equal(stats.lag_last_us, stats.lag_total_us);

  stats = send_stamped(f, publisher, source, batch, 1, 0); /* unstamped */
  assert_int_equal(1, stats.lag_samples);

  stats = send_stamped(f, publisher, source, batch, 1, unix_now_ns() + 3600u * 1000000000u);
  assert_int_equal(2, stats.lag_samples);
  assert_int_equal(0, stats.lag_last_us);
  assert_true(stats.lag_max_us >= three_seconds_us);

  kvr_event_batch_clear(batch); /* drops the explicit stamp: stamped at sending again */
  stats = send_stamped(f, publisher, source, batch, 0, 0);
  assert_int_equal(3, stats.lag_samples);
  assert_true(stats.lag_last_us < three_seconds_us);
  assert_true(stats.lag_max_us >= three_seconds_us); /* the maximum stays */

  stats = stats_of(f->ingest, 0); /* the sum over sources agrees with the only source */
  assert_int_equal(3, stats.lag_samples);
  assert_true(stats.lag_max_us >= three_seconds_us);
  assert_int_equal(KVR_INVALID_ARGUMENT, kvr_event_batch_set_publish_time(NULL, 1, NULL));
  kvr_event_batch_free(batch);
  kvr_publisher_free(publisher);
}

static void lifecycle_rules(void** state) {
  fixture* f = (fixture*)*state;
  kvr_ingest* idle = NULL;
  kvr_ingest_options opts;
  kvr_publisher* publisher = NULL;
  char bound[128];
  kvr_ingest_stats stats;
  (void)f;
  KVT_EXPECT_FAILS(KVR_FAILED_PRECONDITION, kvr_ingest_start(f->ingest, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_ingest_new(NULL, NULL, &idle, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_ingest_start(NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_ingest_listen(f->ingest, "http://x:1", NULL, NULL, 0, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_ingest_listen(f->ingest, "tcp://127.0.0.1", NULL, NULL, 0, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_UNAVAILABLE, kvr_ingest_listen(f->ingest, "unix:///nonexistent/dir/s", NULL,
                                                      NULL, 0, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_BUFFER_TOO_SMALL,
                   kvr_ingest_listen(f->ingest, "tcp://127.0.0.1:0", NULL, bound, 4, NULL, ERRP));
  kvr_ingest_stats_init(&stats, sizeof stats);
  KVT_EXPECT_FAILS(KVR_NOT_FOUND, kvr_ingest_get_stats(f->ingest, 9999, &stats, ERRP));
  KVT_EXPECT_FAILS(KVR_UNAVAILABLE,
                   kvr_publisher_connect("unix:///nonexistent/s", &publisher, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_publisher_connect("ftp://x", &publisher, ERRP));

  /* Sources may be added before start; an ingest never started frees cleanly. */
  KVT_OK(kvr_ingest_new(f->fx.router, NULL, &idle, ERRP));
  KVT_OK(kvr_ingest_listen(idle, "tcp://127.0.0.1:0", NULL, bound, sizeof bound, NULL, ERRP));
  kvr_ingest_free(idle);

  /* A newer caller's options with unknown non-zero fields are refused. */
  kvr_ingest_options_init(&opts, sizeof opts);
  opts.max_frame_bytes = 0;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_ingest_new(f->fx.router, &opts, &idle, ERRP));

  /* Stop is final and idempotent. */
  KVT_OK(kvr_ingest_stop(f->ingest, ERRP));
  KVT_OK(kvr_ingest_stop(f->ingest, ERRP));
  KVT_EXPECT_FAILS(KVR_FAILED_PRECONDITION, kvr_ingest_start(f->ingest, ERRP));
  KVT_EXPECT_FAILS(KVR_FAILED_PRECONDITION,
                   kvr_ingest_listen(f->ingest, "tcp://127.0.0.1:0", NULL, NULL, 0, NULL, ERRP));
  kvr_ingest_free(NULL);
  kvr_publisher_free(NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(tcp_events_reach_the_router, setup, teardown),
      cmocka_unit_test_setup_teardown(unix_socket_events_reach_the_router, setup, teardown),
      cmocka_unit_test_setup_teardown(short_buffer_then_endpoint_by_source, setup, teardown),
      cmocka_unit_test_setup_teardown(bad_frames_are_rejected_and_counted, setup, teardown),
      cmocka_unit_test_setup_teardown(events_apply_while_routing, setup, teardown),
      cmocka_unit_test_setup_teardown(lag_is_measured_from_publish_time, setup, teardown),
      cmocka_unit_test_setup_teardown(lifecycle_rules, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
