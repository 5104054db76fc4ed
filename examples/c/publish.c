/* publish.c: a custom engine publishing its KV events to kvrouter over the native stream.
 *
 * Usage: example_publish [tcp://HOST:PORT | unix://PATH]
 *
 * With an endpoint, it connects to a running kvrouter ingest listener, as an engine in another
 * process would, and publishes: worker 7 cached a 4-block prompt, then evicted its last block.
 * Without one, it is self-contained: it creates a router with an ingest listener on a free
 * 127.0.0.1 port, publishes to it, and checks that the router saw the events.
 * Exits non-zero on any failure.
 *
 * Build: cc -std=c11 publish.c -lkvrouter (the build tree does it: target example_publish). */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvrouter.h"

#define BLOCK_SIZE 16
#define NUM_BLOCKS 4
#define WORKER_ID 7

static int report(const char* what, kvr_status status, kvr_error* err) {
  fprintf(stderr, "%s failed: %s: %s\n", what, kvr_status_str(status),
          err != NULL ? kvr_error_message(err) : "(no details)");
  kvr_error_free(err);
  return 1;
}

#define CHECK(what, call)                                      \
  do {                                                         \
    kvr_error* err_ = NULL;                                    \
    kvr_status status_ = (call);                               \
    if (status_ != KVR_OK) return report(what, status_, err_); \
  } while (0)

/* The engine side: one batch with a stored event, one with a removal. */
static int publish(const char* endpoint, const uint32_t* tokens) {
  kvr_publisher* publisher = NULL;
  kvr_event_batch* batch = NULL;
  kvr_stored_event stored;
  kvr_removed_event removed;
  uint64_t hashes[NUM_BLOCKS] = {0xa1, 0xa2, 0xa3, 0xa4}; /* the engine's own block hashes */
  int rc = 0;

  CHECK("kvr_publisher_connect", kvr_publisher_connect(endpoint, &publisher, &err_));
  CHECK("kvr_event_batch_new", kvr_event_batch_new(&batch, &err_));

  kvr_stored_event_init(&stored, sizeof stored);
  stored.worker_id = WORKER_ID;
  stored.event_id = 1;
  stored.block_hashes = hashes;
  stored.num_blocks = NUM_BLOCKS;
  stored.token_ids = tokens; /* the router hashes the tokens itself */
  stored.num_tokens = NUM_BLOCKS * BLOCK_SIZE;
  CHECK("kvr_event_batch_add_stored", kvr_event_batch_add_stored(batch, &stored, &err_));
  CHECK("kvr_publisher_send", kvr_publisher_send(publisher, batch, &err_));

  kvr_event_batch_clear(batch);
  kvr_removed_event_init(&removed, sizeof removed);
  removed.worker_id = WORKER_ID;
  removed.event_id = 2;
  removed.block_hashes = &hashes[NUM_BLOCKS - 1];
  removed.num_blocks = 1;
  CHECK("kvr_event_batch_add_removed", kvr_event_batch_add_removed(batch, &removed, &err_));
  CHECK("kvr_publisher_send", kvr_publisher_send(publisher, batch, &err_));

  printf("published 2 batches to %s\n", endpoint);
  kvr_event_batch_free(batch);
  kvr_publisher_free(publisher);
  return rc;
}

static void sleep_ms(long ms) {
  struct timespec ts = {0, ms * 1000000L};
  nanosleep(&ts, NULL);
}

/* The router side, for the self-contained run. */
static int run_with_own_router(const uint32_t* tokens) {
  kvr_router* router = NULL;
  kvr_ingest* ingest = NULL;
  kvr_ingest_stats stats;
  kvr_overlap overlap[4];
  size_t len = 0;
  char endpoint[128];
  uint64_t source = 0;
  int waited;

  CHECK("kvr_router_new", kvr_router_new(NULL, &router, &err_));
  CHECK("kvr_ingest_new", kvr_ingest_new(router, NULL, &ingest, &err_));
  CHECK("kvr_ingest_listen", kvr_ingest_listen(ingest, "tcp://127.0.0.1:0", &source, endpoint,
                                               sizeof endpoint, NULL, &err_));
  CHECK("kvr_ingest_start", kvr_ingest_start(ingest, &err_));
  printf("router listening on %s\n", endpoint);
  if (publish(endpoint, tokens) != 0) return 1;

  kvr_ingest_stats_init(&stats, sizeof stats);
  for (waited = 0; waited < 10000; ++waited) { /* at most 10 s */
    CHECK("kvr_ingest_get_stats", kvr_ingest_get_stats(ingest, source, &stats, &err_));
    if (stats.messages >= 2) break;
    sleep_ms(1);
  }
  CHECK("kvr_router_overlap_scores",
        kvr_router_overlap_scores(router, tokens, NUM_BLOCKS * BLOCK_SIZE, NULL, overlap, 4, &len,
                                  &err_));
  printf("ingest: %llu messages, %llu events applied\n", (unsigned long long)stats.messages,
         (unsigned long long)stats.events_applied);
  if (len != 1 || overlap[0].worker_id != WORKER_ID || overlap[0].device_blocks != 3) {
    fprintf(stderr, "WRONG: expected worker %d to hold 3 blocks of the prompt\n", WORKER_ID);
    return 1;
  }
  printf("worker %llu holds %u blocks of the prompt: OK\n",
         (unsigned long long)overlap[0].worker_id, overlap[0].device_blocks);
  kvr_ingest_free(ingest);
  kvr_router_free(router);
  return 0;
}

int main(int argc, char** argv) {
  uint32_t tokens[NUM_BLOCKS * BLOCK_SIZE];
  size_t i;
  for (i = 0; i < NUM_BLOCKS * BLOCK_SIZE; ++i) tokens[i] = 1000 + (uint32_t)i;
  if (argc > 1) return publish(argv[1], tokens);
  return run_with_own_router(tokens);
}
