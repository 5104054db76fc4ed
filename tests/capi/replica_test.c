/* Router replica sync through the C ABI, over a bus of the caller's own: router `a` publishes
 * its booking changes through kvr_router_set_replica_publisher into a queue, and the test
 * carries them to router `b` with kvr_router_apply_replica_event. (Over NATS:
 * ingest_nats_test.c.) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>

#include "test_util.h"

#define BS 16
#define MAX_MESSAGES 16

/* The bus: copies of what `a` published, in order. */
typedef struct bus {
  uint8_t* messages[MAX_MESSAGES];
  size_t sizes[MAX_MESSAGES];
  size_t count;
} bus;

static void publish_to_bus(void* user_data, const void* data, size_t size) {
  bus* b = (bus*)user_data;
  assert_true(b->count < MAX_MESSAGES);
  b->messages[b->count] = (uint8_t*)malloc(size);
  memcpy(b->messages[b->count], data, size);
  b->sizes[b->count++] = size;
}

/* Applies every message on the bus to `router` and empties the bus. */
static void deliver(bus* b, kvr_router* router) {
  size_t i;
  for (i = 0; i < b->count; ++i) {
    KVT_OK(kvr_router_apply_replica_event(router, b->messages[i], b->sizes[i], ERRP));
    free(b->messages[i]);
  }
  b->count = 0;
}

typedef struct fixture {
  kvr_router* a;
  kvr_router* b;
  bus bus;
} fixture;

static int setup(void** state) {
  fixture* f = (fixture*)calloc(1, sizeof(fixture));
  if (f == NULL) return -1;
  f->a = kvt_router_new(BS, 0);
  f->b = kvt_router_new(BS, 0);
  kvt_add_worker(f->a, 1);
  kvt_add_worker(f->a, 2);
  kvt_add_worker(f->b, 1);
  kvt_add_worker(f->b, 2);
  KVT_OK(kvr_router_set_replica_publisher(f->a, "gateway-a", publish_to_bus, &f->bus, ERRP));
  assert_int_equal(2, f->bus.count); /* joining: Reset, then SyncRequest (no bookings yet) */
  deliver(&f->bus, f->b);
  *state = f;
  return 0;
}

static int teardown(void** state) {
  fixture* f = (fixture*)*state;
  size_t i;
  for (i = 0; i < f->bus.count; ++i) free(f->bus.messages[i]);
  kvr_router_free(f->a);
  kvr_router_free(f->b);
  free(f);
  return 0;
}

/* Books `id` on `worker_id` with a prompt of `blocks` blocks starting at token `first`. */
static void book(kvr_router* router, const char* id, uint64_t worker_id, size_t blocks,
                 uint32_t first) {
  uint32_t tokens[8 * BS];
  kvr_request_options options;
  assert_true(blocks <= 8);
  kvt_fill_tokens(tokens, blocks * BS, first);
  kvr_request_options_init(&options, sizeof options);
  options.request_id = id;
  KVT_OK(kvr_router_add_request(router, tokens, blocks * BS, worker_id, 0, &options, ERRP));
}

static void a_booking_is_load_on_the_other_replica(void** state) {
  fixture* f = (fixture*)*state;
  kvr_metrics metrics;
  book(f->a, "r1", 1, 4, 0);
  assert_int_equal(1, f->bus.count);
  deliver(&f->bus, f->b);
  metrics = kvt_metrics(f->b);
  assert_int_equal(1, metrics.requests_active);
  assert_int_equal(1, metrics.replica_requests_active);
  assert_int_equal(3, metrics.replica_changes_applied); /* + the Reset and SyncRequest */

  /* Prefill completed, then freed: both follow. */
  KVT_OK(kvr_router_mark_prefill_completed(f->a, "r1", ERRP));
  KVT_OK(kvr_router_free_request(f->a, "r1", ERRP));
  assert_int_equal(2, f->bus.count);
  deliver(&f->bus, f->b);
  metrics = kvt_metrics(f->b);
  assert_int_equal(0, metrics.requests_active);
  assert_int_equal(5, metrics.replica_changes_applied);
}

static void bad_changes_are_rejected_and_counted(void** state) {
  fixture* f = (fixture*)*state;
  const uint8_t garbage[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  kvr_router* c = kvt_router_new(BS, 0); /* knows only worker 2 */
  kvr_metrics metrics;
  kvt_add_worker(c, 2);
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_apply_replica_event(f->b, garbage, sizeof garbage, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_replica_event(f->b, NULL, 4, ERRP));
  book(f->a, "r1", 1, 2, 0);
  /* An unknown worker rank: refused, nothing booked. */
  KVT_EXPECT_FAILS(KVR_NOT_FOUND,
                   kvr_router_apply_replica_event(c, f->bus.messages[0], f->bus.sizes[0], ERRP));
  assert_int_equal(0, kvt_metrics(c).requests_active);
  /* The same booking twice: the second is refused. */
  KVT_OK(kvr_router_apply_replica_event(f->b, f->bus.messages[0], f->bus.sizes[0], ERRP));
  KVT_EXPECT_FAILS(KVR_ALREADY_EXISTS,
                   kvr_router_apply_replica_event(f->b, f->bus.messages[0], f->bus.sizes[0], ERRP));
  metrics = kvt_metrics(f->b);
  assert_int_equal(1, metrics.requests_active);
  assert_int_equal(3, metrics.replica_changes_applied);
  /* garbage and the duplicate, each tried twice by KVT_EXPECT_FAILS (a NULL pointer is a
   * caller bug, refused before any message is looked at) */
  assert_int_equal(4, metrics.replica_changes_rejected);
  assert_int_equal(2, kvt_metrics(c).replica_changes_rejected);
  /* Its own changes echoed back to `a` are ignored. */
  KVT_OK(kvr_router_apply_replica_event(f->a, f->bus.messages[0], f->bus.sizes[0], ERRP));
  assert_int_equal(1, kvt_metrics(f->a).requests_active);
  kvr_router_free(c);
}

static void reserved_ids_and_stopping(void** state) {
  fixture* f = (fixture*)*state;
  const char reserved[] = {0x1e, 'x', 0};
  uint32_t tokens[BS];
  kvr_request_options options;
  kvt_fill_tokens(tokens, BS, 0);
  kvr_request_options_init(&options, sizeof options);
  options.request_id = reserved;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_add_request(f->a, tokens, BS, 1, 0, &options, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_set_replica_publisher(f->a, "", publish_to_bus, &f->bus, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_set_replica_publisher(NULL, "x", publish_to_bus, &f->bus, ERRP));
  {
    /* Ids past their limits (a request id of 1,024 bytes, a replica id of 256): refused. */
    char long_id[1026];
    memset(long_id, 'r', sizeof long_id - 1);
    long_id[sizeof long_id - 1] = '\0';
    options.request_id = long_id;
    KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "at most 1024",
                            kvr_router_add_request(f->a, tokens, BS, 1, 0, &options, ERRP));
    long_id[257] = '\0';
    KVT_EXPECT_FAILS_SAYING(
        KVR_INVALID_ARGUMENT, "at most 256",
        kvr_router_set_replica_publisher(f->a, long_id, publish_to_bus, &f->bus, ERRP));
  }
  /* NULL stops publishing, after a farewell (a Reset: the peers drop what they hold from it). */
  KVT_OK(kvr_router_set_replica_publisher(f->a, NULL, NULL, NULL, ERRP));
  assert_int_equal(1, f->bus.count);
  book(f->a, "after", 1, 1, 0);
  assert_int_equal(1, f->bus.count);
}

/* A replica that sent heartbeats and falls silent loses its bookings at its peers, on the
 * peer's clock (driven by hand here); before its first heartbeat it is never expired. */
static void a_silent_replica_is_expired_once_it_sent_heartbeats(void** state) {
  fixture* f = (fixture*)*state;
  size_t expired = 99;
  kvr_metrics metrics;
  char text[16384];
  size_t len = 0;
  KVT_OK(kvr_router_set_time(f->b, 0, ERRP));
  book(f->a, "r1", 1, 2, 0);
  deliver(&f->bus, f->b);
  KVT_OK(kvr_router_set_time(f->b, 60000000000LL, ERRP)); /* 60 s: no heartbeat yet */
  KVT_OK(kvr_router_expire_replicas(f->b, 10.0, &expired, ERRP));
  assert_int_equal(0, expired);

  KVT_OK(kvr_router_replica_heartbeat(f->a, 1000, ERRP));
  assert_int_equal(1, f->bus.count);
  deliver(&f->bus, f->b);
  metrics = kvt_metrics(f->b);
  assert_int_equal(1, metrics.replicas_live);
  assert_int_equal(1, metrics.replica_requests_active);
  KVT_OK(kvr_router_set_time(f->b, 71000000000LL, ERRP)); /* 11 s of silence */
  /* A timeout past int64 nanoseconds ("never") keeps it: it used to convert to INT64_MIN, which
   * left only three heartbeat intervals (3 s) as the timeout. */
  KVT_OK(kvr_router_expire_replicas(f->b, 1e10, &expired, ERRP));
  assert_int_equal(0, expired);
  KVT_OK(kvr_router_expire_replicas(f->b, 1.7e308, &expired, ERRP));
  assert_int_equal(0, expired);
  KVT_OK(kvr_router_expire_replicas(f->b, 10.0, &expired, ERRP));
  assert_int_equal(1, expired);
  metrics = kvt_metrics(f->b);
  assert_int_equal(0, metrics.replicas_live);
  assert_int_equal(1, metrics.replicas_expired);
  assert_int_equal(0, metrics.requests_active);
  KVT_OK(kvr_router_metrics_prometheus(f->b, text, sizeof text, &len, ERRP));
  assert_non_null(strstr(text, "\nkvrouter_replicas_expired_total 1\n"));
  assert_non_null(strstr(text, "\nkvrouter_replicas_live 0\n"));

  /* Bad arguments, and a router with no publisher to send through. */
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_replica_heartbeat(f->a, 0, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_replica_heartbeat(f->a, 3600001, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_replica_heartbeat(NULL, 1000, ERRP));
  KVT_EXPECT_FAILS(KVR_FAILED_PRECONDITION, kvr_router_replica_heartbeat(f->b, 1000, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_expire_replicas(f->b, 0.0, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_expire_replicas(f->b, -1.0, NULL, ERRP));
  KVT_OK(kvr_router_expire_replicas(f->b, 10.0, NULL, ERRP));
}

/* b never hears a's heartbeat, only a booking published after it, which carries the interval:
 * b still expires a when it falls silent. Heard again, a is asked (b publishes a SyncRequest
 * naming it) and announces its booking with its next heartbeat. */
static void a_replica_whose_heartbeat_was_missed_is_expired_and_asked_again(void** state) {
  fixture* f = (fixture*)*state;
  bus from_b = {{NULL}, {0}, 0};
  size_t expired = 99, i;
  KVT_OK(kvr_router_set_time(f->b, 0, ERRP));
  KVT_OK(kvr_router_replica_heartbeat(f->a, 1000, ERRP));
  for (i = 0; i < f->bus.count; ++i) free(f->bus.messages[i]);
  f->bus.count = 0; /* the heartbeat is lost */
  book(f->a, "r1", 1, 2, 0);
  deliver(&f->bus, f->b);
  assert_int_equal(1, kvt_metrics(f->b).replicas_live);
  KVT_OK(kvr_router_set_time(f->b, 11000000000LL, ERRP));
  KVT_OK(kvr_router_expire_replicas(f->b, 10.0, &expired, ERRP));
  assert_int_equal(1, expired);
  assert_int_equal(0, kvt_metrics(f->b).replica_requests_active);

  KVT_OK(kvr_router_set_replica_publisher(f->b, "gateway-b", publish_to_bus, &from_b, ERRP));
  for (i = 0; i < from_b.count; ++i) free(from_b.messages[i]);
  from_b.count = 0; /* b's own joining announcement */
  KVT_OK(kvr_router_replica_heartbeat(f->a, 1000, ERRP));
  deliver(&f->bus, f->b);
  assert_int_equal(1, from_b.count); /* the request naming a */
  deliver(&from_b, f->a);
  assert_int_equal(0, f->bus.count); /* answered with the next heartbeat, not at once */
  KVT_OK(kvr_router_replica_heartbeat(f->a, 1000, ERRP));
  assert_int_equal(3, f->bus.count); /* Heartbeat, Reset, Added r1 */
  deliver(&f->bus, f->b);
  assert_int_equal(1, kvt_metrics(f->b).replica_requests_active);
  KVT_OK(kvr_router_set_replica_publisher(f->b, "gateway-b", NULL, NULL, ERRP));
  for (i = 0; i < from_b.count; ++i) free(from_b.messages[i]);
}

/* A publisher that calls into routers: its own (refused, as it runs under that router's lock: the
 * call would wait for ever) and another one (served). */
typedef struct reentrant_publisher {
  kvr_router* own;
  kvr_router* other;
  kvr_ingest* own_ingest; /* an ingest of `own`: its replica sync would install a publisher */
  size_t calls;
  kvr_status own_metrics, own_close_queue, other_metrics, own_sync;
  char own_message[256];
} reentrant_publisher;

static void publish_reentrantly(void* user_data, const void* data, size_t size) {
  reentrant_publisher* p = (reentrant_publisher*)user_data;
  kvr_metrics metrics;
  kvr_error* err = NULL;
  (void)data;
  (void)size;
  p->calls++;
  kvr_metrics_init(&metrics, sizeof metrics);
  p->own_metrics = kvr_router_get_metrics(p->own, &metrics, &err);
  if (err != NULL) {
    snprintf(p->own_message, sizeof p->own_message, "%s", kvr_error_message(err));
    kvr_error_free(err);
    err = NULL;
  }
  p->own_close_queue = kvr_router_close_queue(p->own, NULL, NULL);
  p->other_metrics = kvr_router_get_metrics(p->other, &metrics, NULL);
  /* Refused before it connects (nothing listens there: it would say KVR_UNAVAILABLE). */
  if (p->own_ingest != NULL) {
    p->own_sync = kvr_ingest_sync_replicas(p->own_ingest, "nats://127.0.0.1:1", "replicas",
                                           "gateway-a", NULL, NULL);
  }
}

static void a_publisher_calling_into_its_own_router_is_refused(void** state) {
  fixture* f = (fixture*)*state;
  reentrant_publisher p;
  memset(&p, 0, sizeof p);
  p.own = f->a;
  p.other = f->b;
#if KVR_TEST_WITH_NATS
  KVT_OK(kvr_ingest_new(f->a, NULL, &p.own_ingest, ERRP));
#endif
  KVT_OK(kvr_router_set_replica_publisher(f->a, "gateway-a", publish_reentrantly, &p, ERRP));
  assert_true(p.calls >= 2); /* the farewell went to the bus; the join came here */
  assert_int_equal(KVR_FAILED_PRECONDITION, p.own_metrics);
  assert_non_null(strstr(p.own_message, "own replica publisher"));
  assert_int_equal(KVR_FAILED_PRECONDITION, p.own_close_queue);
  assert_int_equal(KVR_OK, p.other_metrics);
#if KVR_TEST_WITH_NATS
  assert_int_equal(KVR_FAILED_PRECONDITION, p.own_sync);
#endif

  /* A booking publishes from the caller's thread: refused there too, and the booking stands. */
  p.calls = 0;
  book(f->a, "r1", 1, 2, 0);
  assert_int_equal(1, p.calls);
  assert_int_equal(KVR_FAILED_PRECONDITION, p.own_metrics);
  assert_int_equal(1, kvt_metrics(f->a).requests_active); /* outside the publisher: served */
  KVT_OK(kvr_router_set_replica_publisher(f->a, "gateway-a", NULL, NULL, ERRP));
  kvr_ingest_free(p.own_ingest);
}

/* A bus delivering synchronously: each router's publisher applies its change to the other at
 * once. Router a's join reaches b, whose answer comes back to a inside a's own publisher: that
 * call into a is refused (it would wait for ever for the lock a's publisher runs under), the
 * rest is delivered. */
typedef struct sync_bus_end {
  kvr_router* to;
  size_t delivered;
  size_t refused;
} sync_bus_end;

static void deliver_at_once(void* user_data, const void* data, size_t size) {
  sync_bus_end* end = (sync_bus_end*)user_data;
  const kvr_status status = kvr_router_apply_replica_event(end->to, data, size, NULL);
  if (status == KVR_OK) end->delivered++;
  if (status == KVR_FAILED_PRECONDITION) end->refused++;
}

static void a_synchronous_bus_between_two_routers_is_refused_not_deadlocked(void** state) {
  fixture* f = (fixture*)*state;
  sync_bus_end to_a = {NULL, 0, 0}, to_b = {NULL, 0, 0};
  to_a.to = f->a;
  to_b.to = f->b;
  KVT_OK(kvr_router_set_replica_publisher(f->a, "gateway-a", NULL, NULL, ERRP));
  KVT_OK(kvr_router_set_replica_publisher(f->b, "gateway-b", deliver_at_once, &to_a, ERRP));
  assert_true(to_a.delivered >= 2); /* b's join, applied by a (which has no publisher) */
  KVT_OK(kvr_router_set_replica_publisher(f->a, "gateway-a", deliver_at_once, &to_b, ERRP));
  assert_true(to_b.delivered >= 2); /* a's Reset and SyncRequest reached b ... */
  assert_true(to_a.refused >= 1);   /* ... whose answer, inside a's publisher, could not */
  KVT_OK(kvr_router_set_replica_publisher(f->b, "gateway-b", NULL, NULL, ERRP));
  KVT_OK(kvr_router_set_replica_publisher(f->a, "gateway-a", NULL, NULL, ERRP));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(a_booking_is_load_on_the_other_replica, setup, teardown),
      cmocka_unit_test_setup_teardown(bad_changes_are_rejected_and_counted, setup, teardown),
      cmocka_unit_test_setup_teardown(reserved_ids_and_stopping, setup, teardown),
      cmocka_unit_test_setup_teardown(a_silent_replica_is_expired_once_it_sent_heartbeats, setup,
                                      teardown),
      cmocka_unit_test_setup_teardown(
          a_replica_whose_heartbeat_was_missed_is_expired_and_asked_again, setup, teardown),
      cmocka_unit_test_setup_teardown(a_publisher_calling_into_its_own_router_is_refused, setup,
                                      teardown),
      cmocka_unit_test_setup_teardown(
          a_synchronous_bus_between_two_routers_is_refused_not_deadlocked, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
