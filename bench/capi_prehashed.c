/* A preview through the C ABI from a prompt's tokens against the same preview from its local
 * hashes (KVR_REQUEST_PREHASHED), in one run, alternating: what a caller that already holds the
 * hashes (its tokenizer service's, or one hashing for several routers) saves, and what hashing
 * itself and then calling costs against handing over the tokens. 64 single-rank workers; each
 * prompt's first half cached on one of them. Per round and prompt length, the mean ns per call
 * of each form; prints one line per round.
 *   cc -O2 bench/capi_prehashed.c $(pkg-config --cflags --libs kvrouter) -o prehashed
 *   LD_LIBRARY_PATH=STAGE/lib ./prehashed [rounds] [calls per round] */
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "capi_bench.h"

enum { BS = 16, WORKERS = 64, PROMPTS = 16, MAX_TOKENS = 8192 };

static uint32_t prompts[PROMPTS][MAX_TOKENS];
static uint64_t hashes[PROMPTS][MAX_TOKENS / BS];

/* Mean ns per preview of `tokens` tokens: from the tokens (form 0), from hashes computed before
 * the timing (1), or hashed by the caller and then previewed (2). */
static double preview_ns(kvr_router* router, size_t tokens, int form, int calls) {
  kvr_request_options opts;
  kvr_route_signals signals;
  size_t blocks = 0;
  int i;
  double start;
  kvr_request_options_init(&opts, sizeof opts);
  kvr_route_signals_init(&signals, sizeof signals);
  if (form != 0) opts.flags = KVR_REQUEST_PREHASHED;
  start = now_ns();
  for (i = 0; i < calls; ++i) {
    const int p = i % PROMPTS;
    if (form == 0) {
      must(kvr_preview_route(router, prompts[p], tokens, NULL, NULL, &signals, NULL), "preview");
      continue;
    }
    if (form == 2) {
      must(kvr_compute_block_hashes(prompts[p], tokens, BS, NULL, hashes[p], MAX_TOKENS / BS,
                                    &blocks, NULL),
           "hash");
    }
    opts.local_hashes = hashes[p];
    opts.num_local_hashes = tokens / BS;
    must(kvr_preview_route(router, NULL, tokens, &opts, NULL, &signals, NULL), "preview hashed");
  }
  return (now_ns() - start) / calls;
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 10;
  const int calls = argc > 2 ? atoi(argv[2]) : 4000;
  const size_t lengths[] = {1024, MAX_TOKENS};
  kvr_router_options options;
  kvr_router* router = NULL;
  uint64_t seed = 12345;
  int p, w, r;
  size_t t, l;
  kvr_router_options_init(&options, sizeof options);
  options.block_size = BS;
  must(kvr_router_new(&options, &router, NULL), "router");
  for (w = 1; w <= WORKERS; ++w) {
    kvr_worker_config worker;
    kvr_worker_config_init(&worker, sizeof worker);
    worker.worker_id = (uint64_t)w;
    must(kvr_router_add_worker(router, &worker, NULL), "worker");
  }
  for (p = 0; p < PROMPTS; ++p) {
    size_t blocks = 0;
    kvr_stored_event stored;
    uint64_t engine_hashes[MAX_TOKENS / BS / 2];
    for (t = 0; t < MAX_TOKENS; ++t) {
      seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
      prompts[p][t] = (uint32_t)(seed >> 40);
    }
    must(kvr_compute_block_hashes(prompts[p], MAX_TOKENS, BS, NULL, hashes[p], MAX_TOKENS / BS,
                                  &blocks, NULL),
         "hash");
    for (t = 0; t < MAX_TOKENS / BS / 2; ++t) engine_hashes[t] = ((uint64_t)p << 32) + t;
    kvr_stored_event_init(&stored, sizeof stored);
    stored.worker_id = (uint64_t)(1 + p % WORKERS);
    stored.block_hashes = engine_hashes;
    stored.num_blocks = MAX_TOKENS / BS / 2;
    stored.token_ids = prompts[p];
    stored.num_tokens = MAX_TOKENS / 2;
    must(kvr_router_apply_stored(router, &stored, NULL), "store");
  }
  printf("round");
  for (l = 0; l < 2; ++l) {
    printf("  tokens/%zu  hashes/%zu  hash+hashes/%zu", lengths[l], lengths[l], lengths[l]);
  }
  printf("   (ns per preview)\n");
  for (r = 0; r < rounds; ++r) {
    printf("%5d", r);
    for (l = 0; l < 2; ++l) {
      const int n = lengths[l] == MAX_TOKENS ? calls / 4 : calls;
      const double tokens = preview_ns(router, lengths[l], 0, n);
      const double hashed = preview_ns(router, lengths[l], 1, n);
      const double both = preview_ns(router, lengths[l], 2, n);
      printf("  %12.0f %10.0f %16.0f", tokens, hashed, both);
    }
    printf("\n");
    fflush(stdout);
  }
  kvr_router_free(router);
  return 0;
}
