/* KV event ingestion over NATS through the C ABI: a nats-server started on 127.0.0.1 (a free
 * port), native EventBatches published with the NATS C client on a wildcard subject, a garbage
 * message rejected and counted, and a server restart the subscription survives. */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <arpa/inet.h>
#include <cmocka.h>
#include <fcntl.h>
#include <nats/nats.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test_util.h"

#define BS 16
#define WAIT_MS 10000 /* bound on every wait */

static void sleep_ms(long ms) {
  struct timespec ts;
  ts.tv_sec = ms / 1000;
  ts.tv_nsec = (ms % 1000) * 1000000L;
  nanosleep(&ts, NULL);
}

/* Whether a TCP socket can bind 127.0.0.1:port now. */
static int bindable(int port) {
  struct sockaddr_in addr;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  int ok;
  memset(&addr, 0, sizeof addr);
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons((uint16_t)port);
  ok = bind(fd, (struct sockaddr*)&addr, sizeof addr) == 0;
  close(fd);
  return ok;
}

/* A port for a nats-server, below the kernel's ephemeral range (as tests/ingest/nats_server.h's
 * FreePort): a port the kernel picked for a bind to port 0 may be handed out again at once, as
 * the local port of a client's connection, and the server then cannot bind it. Each process
 * walks its own stretch from a start drawn from its pid, skipping ports bound now. */
static int free_port(void) {
  static int next = -1;
  int top = 32768, high = 60999, bottom, tries;
  FILE* range = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
  if (range != NULL) {
    if (fscanf(range, "%d %d", &top, &high) != 2) top = 32768;
    fclose(range);
  }
  bottom = top > 12000 ? top - 12000 : 1024;
  if (next < 0) next = bottom + (int)((long)getpid() * 997L % (top - bottom));
  for (tries = 0; tries < top - bottom; ++tries) {
    const int port = next;
    next = next + 1 < top ? next + 1 : bottom;
    if (bindable(port)) return port;
  }
  return -1;
}

static int accepts(int port) {
  struct sockaddr_in addr;
  int ok;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  memset(&addr, 0, sizeof addr);
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons((uint16_t)port);
  ok = connect(fd, (struct sockaddr*)&addr, sizeof addr) == 0;
  close(fd);
  return ok;
}

/* Starts nats-server on 127.0.0.1:port and waits (bounded) until it accepts connections;
 * `store_dir` not NULL: with JetStream, its streams kept there. */
static pid_t start_server_with(int port, const char* store_dir) {
  int waited;
  const pid_t pid = fork();
  if (pid == 0) {
    char port_text[16];
    const int devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, 1);
    dup2(devnull, 2);
    snprintf(port_text, sizeof port_text, "%d", port);
    if (store_dir == NULL) {
      execl("/usr/sbin/nats-server", "nats-server", "-a", "127.0.0.1", "-p", port_text,
            (char*)NULL);
    } else {
      execl("/usr/sbin/nats-server", "nats-server", "-a", "127.0.0.1", "-p", port_text, "-js",
            "-sd", store_dir, (char*)NULL);
    }
    _exit(127);
  }
  assert_true(pid > 0);
  for (waited = 0; waited < WAIT_MS; waited += 10) {
    if (accepts(port)) return pid;
    if (waitpid(pid, NULL, WNOHANG) == pid) fail_msg("nats-server exited");
    sleep_ms(10);
  }
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  fail_msg("nats-server did not accept connections in time");
  return -1;
}

static pid_t start_server(int port) { return start_server_with(port, NULL); }

static void stop_server(pid_t pid) {
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
}

static kvr_ingest_stats stats_of(kvr_ingest* ingest, uint64_t source) {
  kvr_ingest_stats stats;
  kvr_ingest_stats_init(&stats, sizeof stats);
  KVT_OK(kvr_ingest_get_stats(ingest, source, &stats, ERRP));
  return stats;
}

/* Publishes one stored event of `num_blocks` blocks of `tokens` on `subject`. */
static void publish_stored(natsConnection* nc, const char* subject, uint64_t worker_id,
                           const uint32_t* tokens, size_t num_blocks, uint64_t first_hash) {
  kvr_event_batch* batch = kvt_stored_batch(worker_id, tokens, num_blocks, BS, first_hash);
  kvr_buffer* encoded = NULL;
  KVT_OK(kvr_event_batch_encode(batch, &encoded, ERRP));
  assert_int_equal(NATS_OK, natsConnection_Publish(nc, subject, kvr_buffer_data(encoded),
                                                   (int)kvr_buffer_size(encoded)));
  assert_int_equal(NATS_OK, natsConnection_FlushTimeout(nc, 5000));
  kvr_buffer_free(encoded);
  kvr_event_batch_free(batch);
}

static uint32_t device_blocks(kvr_router* router, const uint32_t* tokens, size_t n,
                              uint64_t worker_id) {
  kvr_overlap overlap;
  if (!kvt_overlap_of(router, tokens, n, worker_id, 0, &overlap)) return 0;
  return overlap.device_blocks;
}

static void nats_batches_wildcards_garbage_and_restart(void** state) {
  const int port = free_port();
  char url[64];
  pid_t server;
  kvr_router* router = kvt_router_new(BS, 0);
  kvr_ingest* ingest = NULL;
  natsConnection* nc = NULL;
  uint64_t source = 0;
  uint32_t a[2 * BS], b[2 * BS], c[2 * BS];
  kvr_ingest_stats stats;
  int waited;
  uint64_t attempt;
  (void)state;
  assert_true(port > 0);
  snprintf(url, sizeof url, "nats://127.0.0.1:%d", port);
  server = start_server(port);
  kvt_add_worker(router, 1);
  kvt_add_worker(router, 2);
  KVT_OK(kvr_ingest_new(router, NULL, &ingest, ERRP));
  KVT_OK(kvr_ingest_start(ingest, ERRP));
  KVT_OK(kvr_ingest_subscribe_nats(ingest, url, "kv.*.events", &source, ERRP));
  assert_true(source != 0);
  assert_int_equal(NATS_OK, natsConnection_ConnectTo(&nc, url));

  kvt_fill_tokens(a, 2 * BS, 100);
  kvt_fill_tokens(b, 2 * BS, 900);
  publish_stored(nc, "kv.w1.events", 1, a, 2, 10);
  {
    const uint8_t garbage[] = {0xde, 0xad, 0xbe, 0xef, 1, 2, 3};
    assert_int_equal(NATS_OK,
                     natsConnection_Publish(nc, "kv.w2.events", garbage, (int)sizeof garbage));
  }
  publish_stored(nc, "kv.w2.events", 2, b, 2, 20);
  publish_stored(nc, "kv.w2.other", 2, a, 2, 30); /* not subscribed */
  stats = stats_of(ingest, source);
  for (waited = 0; stats.messages < 3 && waited < WAIT_MS; ++waited) {
    sleep_ms(1);
    stats = stats_of(ingest, source);
  }
  assert_int_equal(3, stats.messages);
  assert_int_equal(2, stats.events_applied);
  assert_int_equal(1, stats.rejected[KVR_INGEST_REJECT_BAD_FLATBUFFERS]);
  assert_int_equal(1, stats.connections);
  assert_int_equal(2, device_blocks(router, a, 2 * BS, 1));
  assert_int_equal(2, device_blocks(router, b, 2 * BS, 2));
  assert_int_equal(0, device_blocks(router, a, 2 * BS, 2));

  /* Restart the server on the same port: the subscription reconnects and resubscribes. Until
   * it has, messages are lost, so publish fresh batches until one arrives (bounded). */
  natsConnection_Destroy(nc);
  nc = NULL;
  stop_server(server);
  server = start_server(port);
  assert_int_equal(NATS_OK, natsConnection_ConnectTo(&nc, url));
  for (attempt = 0, waited = 0; stats.events_applied < 3 && waited < WAIT_MS; ++attempt) {
    int retry;
    kvt_fill_tokens(c, 2 * BS, 5000);
    publish_stored(nc, "kv.w1.events", 1, c, 2, 1000 + attempt * 10);
    for (retry = 0; retry < 200 && stats.events_applied < 3; ++retry, ++waited) {
      sleep_ms(1);
      stats = stats_of(ingest, source);
    }
  }
  assert_true(stats.events_applied >= 3);
  /* libnats may report the disconnection after messages published since were applied: the
   * first of those applied the loss (the ranks heard before were cleared and flagged), and the
   * late report clears nothing more. */
  assert_int_equal(2, stats.state_unknown);
  kvt_fill_tokens(c, 2 * BS, 7000);
  publish_stored(nc, "kv.w1.events", 1, c, 2, 2000);
  for (waited = 0; device_blocks(router, c, 2 * BS, 1) < 2 && waited < WAIT_MS; ++waited) {
    sleep_ms(1);
  }
  assert_int_equal(2, device_blocks(router, c, 2 * BS, 1));
  stats = stats_of(ingest, source);
  /* What was published during the outage is lost without a trace: the ranks heard before it
   * were cleared and stay flagged until their engines clear them. */
  assert_int_equal(0, device_blocks(router, a, 2 * BS, 1));
  assert_int_equal(0, device_blocks(router, b, 2 * BS, 2));
  assert_int_equal(2, stats.state_unknown);
  assert_true(stats.gaps >= 1);

  natsConnection_Destroy(nc);
  kvr_ingest_free(ingest);
  kvr_router_free(router);
  stop_server(server);
}

static void nats_bad_arguments(void** state) {
  kvr_router* router = kvt_router_new(BS, 0);
  kvr_ingest* ingest = NULL;
  char url[64];
  uint64_t source = 0;
  (void)state;
  KVT_OK(kvr_ingest_new(router, NULL, &ingest, ERRP));
  KVT_OK(kvr_ingest_start(ingest, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_ingest_subscribe_nats(ingest, NULL, "kv", &source, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_ingest_subscribe_nats(NULL, "nats://127.0.0.1:1", "kv", &source, ERRP));
  snprintf(url, sizeof url, "nats://127.0.0.1:%d", free_port()); /* nobody listens */
  KVT_EXPECT_FAILS(KVR_UNAVAILABLE, kvr_ingest_subscribe_nats(ingest, url, "kv", &source, ERRP));
  kvr_ingest_free(ingest);
  kvr_router_free(router);
}

/* A JetStream stream created by the source, a stored event published into it, applied and
 * acknowledged (stream_sequence); bad sources refused. */
static void jetstream_source(void** state) {
  const int port = free_port();
  char url[64], store[] = "/tmp/kvr-capi-js-XXXXXX", remove_store[64];
  pid_t server;
  kvr_router* router = kvt_router_new(BS, 0);
  kvr_ingest* ingest = NULL;
  natsConnection* nc = NULL;
  kvr_jetstream_source js;
  uint64_t source = 0;
  uint32_t tokens[2 * BS];
  kvr_ingest_stats stats;
  int waited;
  (void)state;
  assert_non_null(mkdtemp(store));
  snprintf(url, sizeof url, "nats://127.0.0.1:%d", port);
  server = start_server_with(port, store);
  kvt_add_worker(router, 1);
  KVT_OK(kvr_ingest_new(router, NULL, &ingest, ERRP));
  KVT_OK(kvr_ingest_start(ingest, ERRP));
  KVT_OK(kvr_jetstream_source_init(&js, sizeof js));
  js.url = url;
  js.stream = "KV";
  js.subject = "kv.>";
  js.durable = "gateway-1";
  KVT_EXPECT_FAILS(KVR_NOT_FOUND, kvr_ingest_subscribe_jetstream(ingest, &js, &source, ERRP));
  js.flags = 0x80;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_ingest_subscribe_jetstream(ingest, &js, &source, ERRP));
  js.flags = KVR_JETSTREAM_CREATE_STREAM;
  js.stream = NULL;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_ingest_subscribe_jetstream(ingest, &js, &source, ERRP));
  js.stream = "K.V";
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_ingest_subscribe_jetstream(ingest, &js, &source, ERRP));
  js.stream = "KV";
  KVT_OK(kvr_ingest_subscribe_jetstream(ingest, &js, &source, ERRP));

  assert_int_equal(NATS_OK, natsConnection_ConnectTo(&nc, url));
  kvt_fill_tokens(tokens, 2 * BS, 0);
  publish_stored(nc, "kv.w1", 1, tokens, 2, 500);
  stats = stats_of(ingest, source);
  for (waited = 0; stats.stream_sequence < 1 && waited < WAIT_MS; waited += 5) {
    sleep_ms(5);
    stats = stats_of(ingest, source);
  }
  assert_int_equal(1, stats.stream_sequence);
  assert_int_equal(0, stats.consumer_remakes); /* nothing was lost */
  assert_int_equal(0, stats.consumer_remake_failures);
  assert_int_equal(1, stats.events_applied);
  assert_int_equal(2, device_blocks(router, tokens, 2 * BS, 1));
  assert_int_equal(1, stats_of(ingest, 0).stream_sequence); /* the largest over sources */

  natsConnection_Destroy(nc);
  kvr_ingest_free(ingest);
  kvr_router_free(router);
  stop_server(server);
  snprintf(remove_store, sizeof remove_store, "rm -rf %s", store);
  assert_int_equal(0, system(remove_store));
}

/* The relay: what one router's ingest applies from a NATS subject, republished into a
 * JetStream stream that a second router consumes; a consumer's settings, a wildcard subject
 * and a second relay refused. */
static void jetstream_relay(void** state) {
  const int port = free_port();
  char url[64], store[] = "/tmp/kvr-capi-relay-XXXXXX", remove_store[64];
  pid_t server;
  kvr_router* relay = kvt_router_new(BS, 0);
  kvr_router* consumer = kvt_router_new(BS, 0);
  kvr_ingest *relay_ingest = NULL, *consumer_ingest = NULL;
  natsConnection* nc = NULL;
  kvr_jetstream_source js;
  uint64_t relayed = 0, consumed = 0;
  uint32_t tokens[2 * BS];
  int waited;
  (void)state;
  assert_non_null(mkdtemp(store));
  snprintf(url, sizeof url, "nats://127.0.0.1:%d", port);
  server = start_server_with(port, store);
  kvt_add_worker(relay, 1);
  kvt_add_worker(consumer, 1);
  KVT_OK(kvr_ingest_new(relay, NULL, &relay_ingest, ERRP));
  KVT_OK(kvr_ingest_start(relay_ingest, ERRP));
  KVT_OK(kvr_ingest_subscribe_nats(relay_ingest, url, "raw.>", NULL, ERRP));
  KVT_OK(kvr_jetstream_source_init(&js, sizeof js));
  js.url = url;
  js.stream = "KV";
  js.subject = "kv.relay";
  js.flags = KVR_JETSTREAM_CREATE_STREAM;
  js.durable = "gateway-1";
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_ingest_relay_jetstream(relay_ingest, &js, &relayed, ERRP));
  js.durable = NULL;
  js.subject = "kv.>";
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_ingest_relay_jetstream(relay_ingest, &js, &relayed, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_ingest_relay_jetstream(relay_ingest, NULL, &relayed, ERRP));
  js.subject = "kv.relay";
  KVT_OK(kvr_ingest_relay_jetstream(relay_ingest, &js, &relayed, ERRP));
  KVT_EXPECT_FAILS(KVR_FAILED_PRECONDITION,
                   kvr_ingest_relay_jetstream(relay_ingest, &js, NULL, ERRP));

  KVT_OK(kvr_ingest_new(consumer, NULL, &consumer_ingest, ERRP));
  KVT_OK(kvr_ingest_start(consumer_ingest, ERRP));
  js.subject = "kv.relay.>";
  js.flags = 0;
  js.durable = "gateway-2";
  KVT_OK(kvr_ingest_subscribe_jetstream(consumer_ingest, &js, &consumed, ERRP));

  assert_int_equal(NATS_OK, natsConnection_ConnectTo(&nc, url));
  kvt_fill_tokens(tokens, 2 * BS, 0);
  publish_stored(nc, "raw.w1", 1, tokens, 2, 500);
  /* The consumer may apply the message before the relay has read the server's
   * acknowledgement of it: both are waited for. */
  for (waited = 0; (stats_of(relay_ingest, relayed).events_applied < 1 ||
                    stats_of(consumer_ingest, consumed).stream_sequence < 1) &&
                   waited < WAIT_MS;
       waited += 5) {
    sleep_ms(5);
  }
  assert_int_equal(1, stats_of(relay_ingest, relayed).events_applied);
  assert_int_equal(1, stats_of(relay_ingest, relayed).stream_sequence);
  assert_int_equal(1, stats_of(consumer_ingest, consumed).stream_sequence);
  assert_int_equal(2, device_blocks(consumer, tokens, 2 * BS, 1));

  natsConnection_Destroy(nc);
  kvr_ingest_free(consumer_ingest);
  kvr_ingest_free(relay_ingest);
  kvr_router_free(consumer);
  kvr_router_free(relay);
  stop_server(server);
  snprintf(remove_store, sizeof remove_store, "rm -rf %s", store);
  assert_int_equal(0, system(remove_store));
}

/* A router replica with its ingest object syncing on "replicas" at `url`; without heartbeats
 * (the first would go out at once), so that the counts of messages below are exact. */
typedef struct replica {
  kvr_router* router;
  kvr_ingest* ingest;
  uint64_t source;
} replica;

static replica replica_new(const char* url, const char* id) {
  replica r;
  kvr_ingest_options options;
  KVT_OK(kvr_ingest_options_init(&options, sizeof options));
  options.replica_heartbeat_ms = 0;
  r.router = kvt_router_new(BS, 0);
  kvt_add_worker(r.router, 1);
  KVT_OK(kvr_ingest_new(r.router, &options, &r.ingest, ERRP));
  KVT_OK(kvr_ingest_start(r.ingest, ERRP));
  KVT_OK(kvr_ingest_sync_replicas(r.ingest, url, "replicas", id, &r.source, ERRP));
  return r;
}

static void replica_free(replica* r) {
  kvr_ingest_free(r->ingest); /* stops publishing before the router goes */
  kvr_router_free(r->router);
}

/* Polls (bounded) until `r`'s sync source has handled `n` messages; returns its stats. */
static kvr_ingest_stats wait_messages(replica* r, uint64_t n) {
  int waited;
  kvr_ingest_stats stats = stats_of(r->ingest, r->source);
  for (waited = 0; stats.messages < n && waited < WAIT_MS; ++waited) {
    sleep_ms(1);
    stats = stats_of(r->ingest, r->source);
  }
  assert_int_equal(n, stats.messages);
  return stats;
}

/* Polls (bounded) until `r` holds `n` bookings of other replicas. */
static void wait_replica_requests(replica* r, uint64_t n) {
  int waited;
  for (waited = 0; kvt_metrics(r->router).replica_requests_active != n && waited < WAIT_MS;
       ++waited) {
    sleep_ms(1);
  }
  assert_int_equal(n, kvt_metrics(r->router).replica_requests_active);
}

static void replicas_sync_bookings_over_nats(void** state) {
  const int port = free_port();
  char url[64];
  pid_t server;
  replica a, b;
  uint32_t tokens[2 * BS];
  kvr_request_options options;
  kvr_ingest_stats stats;
  (void)state;
  snprintf(url, sizeof url, "nats://127.0.0.1:%d", port);
  server = start_server(port);
  a = replica_new(url, "gateway-a");
  b = replica_new(url, "gateway-b");
  KVT_EXPECT_FAILS(KVR_FAILED_PRECONDITION,
                   kvr_ingest_sync_replicas(a.ingest, url, "other", "again", NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_ingest_sync_replicas(b.ingest, url, "replicas", NULL, NULL, ERRP));

  /* Joining, b published Reset and SyncRequest; a answers with its Reset (it books nothing
   * yet). Wait for that exchange so that the counts below are exact. */
  wait_messages(&a, 2);
  wait_messages(&b, 1);

  kvt_fill_tokens(tokens, 2 * BS, 0);
  kvr_request_options_init(&options, sizeof options);
  options.request_id = "r1";
  KVT_OK(kvr_router_add_request(a.router, tokens, 2 * BS, 1, 0, &options, ERRP));
  wait_replica_requests(&b, 1);
  KVT_OK(kvr_router_free_request(a.router, "r1", ERRP));
  wait_replica_requests(&b, 0);
  stats = stats_of(a.ingest, a.source);
  assert_int_equal(5, stats.published); /* Reset, SyncRequest, the answer, Added, Freed */
  assert_int_equal(0, stats.publish_failures);
  assert_int_equal(0, stats.bookings_trimmed); /* two blocks fit the server's messages */
  stats = wait_messages(&b, 3);
  assert_int_equal(3, stats.events_applied);
  assert_int_equal(2, kvt_metrics(a.router).replica_changes_applied); /* b's two; no echo */

  replica_free(&a);
  replica_free(&b);
  stop_server(server);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(nats_batches_wildcards_garbage_and_restart),
      cmocka_unit_test(nats_bad_arguments),
      cmocka_unit_test(jetstream_source),
      cmocka_unit_test(jetstream_relay),
      cmocka_unit_test(replicas_sync_bookings_over_nats),
  };
  const int failed = cmocka_run_group_tests(tests, NULL, NULL);
  /* libnats tears itself down at exit (atexit), and a thread of a connection destroyed just
   * before (the last test's) may still be ending then: seen to abort about once in 80 runs
   * under load, after every test had passed (nats.c fixed such races after Debian's 3.x).
   * Waiting for its threads first makes the exit quiet. */
  nats_CloseAndWait(5000);
  return failed;
}
