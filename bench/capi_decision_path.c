/* The decision path through the C ABI alone, to compare two builds of libkvrouter in one run:
 * build it once against either header (it uses nothing a 0.2.0 library lacks) and run it
 * alternately with LD_LIBRARY_PATH naming each library. 8 workers, 64 prompts of 64 tokens
 * (4 blocks) with some blocks cached; per round, the mean ns per preview and per admitted
 * kvr_find_best_match + kvr_router_free_request pair. Prints one line per round.
 *   cc -O2 bench/capi_decision_path.c $(pkg-config --cflags --libs kvrouter) -o decision_path
 *   LD_LIBRARY_PATH=STAGE/lib ./decision_path [rounds] [calls per round] */
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "capi_bench.h"

enum { BS = 16, WORKERS = 8, PROMPTS = 64, TOKENS = 64 };

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 20;
  const int calls = argc > 2 ? atoi(argv[2]) : 20000;
  static uint32_t prompts[PROMPTS][TOKENS];
  kvr_router_options options;
  kvr_router* router = NULL;
  kvr_route_result result;
  kvr_route_signals signals;
  kvr_request_options admit;
  char id[32];
  must(kvr_router_options_init(&options, sizeof options), "options");
  options.block_size = BS;
  must(kvr_router_new(&options, &router, NULL), "router");
  for (uint64_t w = 1; w <= WORKERS; ++w) {
    kvr_worker_config worker;
    must(kvr_worker_config_init(&worker, sizeof worker), "worker config");
    worker.worker_id = w;
    must(kvr_router_add_worker(router, &worker, NULL), "add worker");
  }
  for (int p = 0; p < PROMPTS; ++p) {
    for (int t = 0; t < TOKENS; ++t) prompts[p][t] = (uint32_t)(p % 16 * 1000 + t);
    if (p % 2 == 0) { /* half the prompts cached, two blocks deep, on one worker */
      kvr_stored_event stored;
      uint64_t hashes[2] = {(uint64_t)p * 10 + 1, (uint64_t)p * 10 + 2};
      must(kvr_stored_event_init(&stored, sizeof stored), "stored init");
      stored.worker_id = 1 + (uint64_t)p % WORKERS;
      stored.block_hashes = hashes;
      stored.num_blocks = 2;
      stored.token_ids = prompts[p];
      stored.num_tokens = 2 * BS;
      (void)kvr_router_apply_stored(router, &stored, NULL); /* repeats under another worker */
    }
  }
  must(kvr_route_result_init(&result, sizeof result), "result");
  must(kvr_route_signals_init(&signals, sizeof signals), "signals");
  must(kvr_request_options_init(&admit, sizeof admit), "request options");
  admit.flags = KVR_REQUEST_ADMIT;
  admit.request_id = id;
  for (int r = 0; r < rounds; ++r) {
    double start = now_ns();
    for (int i = 0; i < calls; ++i) {
      must(kvr_preview_route(router, prompts[i % PROMPTS], TOKENS, NULL, NULL, &signals, NULL),
           "preview");
    }
    const double preview = (now_ns() - start) / calls;
    start = now_ns();
    for (int i = 0; i < calls; ++i) {
      snprintf(id, sizeof id, "r-%d", i);
      must(kvr_find_best_match(router, prompts[i % PROMPTS], TOKENS, &admit, &result, NULL, 0, NULL,
                               NULL),
           "admit");
      must(kvr_router_free_request(router, id, NULL), "free");
    }
    const double pair = (now_ns() - start) / calls;
    printf("round %d preview_ns %.1f admit_free_ns %.1f\n", r, preview, pair);
  }
  kvr_router_free(router);
  return 0;
}
