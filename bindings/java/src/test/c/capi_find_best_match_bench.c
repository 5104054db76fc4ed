/* capi_find_best_match_bench.c: kvr_find_best_match timed from C, on the index and queries the
 * Java benchmark wrote with --dump DIR, so the Java binding's cost over the C ABI can be read
 * off the same machine at the same time:
 *
 *   java -cp target/classes:target/test-classes io.kvrouter.bench.FindBestMatchBenchmark \
 *       --dump target/bench
 *   cc -O2 -std=c11 src/test/c/capi_find_best_match_bench.c \
 *       $(pkg-config --cflags --libs kvrouter) -o target/capi_bench
 *   target/capi_bench target/bench 20000 5 [restore]
 *
 * The index is built by replaying the same stored events through kvr_router_apply_stored (or,
 * with "restore", loaded from the snapshot). Same loop as the Java side: admitted find (timed),
 * free (timed apart), then previews. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvrouter.h"

#define TOKENS 8192

static long long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void* read_file(const char* dir, const char* name, size_t* size) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE* f = fopen(path, "rb");
  if (f == NULL) {
    perror(path);
    exit(1);
  }
  fseek(f, 0, SEEK_END);
  *size = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  void* data = malloc(*size);
  if (data == NULL || fread(data, 1, *size, f) != *size) exit(1);
  fclose(f);
  return data;
}

static int cmp(const void* a, const void* b) {
  long long x = *(const long long*)a, y = *(const long long*)b;
  return (x > y) - (x < y);
}

static double pct(long long* v, size_t n, double p) {
  qsort(v, n, sizeof *v, cmp);
  size_t i = (size_t)(n * p);
  return v[i < n ? i : n - 1] / 1e3;
}

int main(int argc, char** argv) {
  if (argc < 2) return fprintf(stderr, "usage: %s DIR [iterations] [repetitions]\n", argv[0]), 2;
  const long iterations = argc > 2 ? atol(argv[2]) : 20000;
  const int repetitions = argc > 3 ? atoi(argv[3]) : 5;
  const int restore = argc > 4 && strcmp(argv[4], "restore") == 0;
  size_t queries_size;
  uint32_t* queries = read_file(argv[1], "queries.u32", &queries_size);
  const size_t nq = queries_size / (TOKENS * 4);

  kvr_router_options o;
  kvr_router_options_init(&o, sizeof o);
  o.block_size = 16;
  o.random_seed = 1;
  kvr_router* router = NULL;
  if (kvr_router_new(&o, &router, NULL) != KVR_OK) return 1;
  for (uint64_t w = 0; w < 64; ++w) {
    kvr_worker_config c;
    kvr_worker_config_init(&c, sizeof c);
    c.worker_id = w;
    c.max_num_batched_tokens = 16384;
    kvr_router_add_worker(router, &c, NULL);
  }
  long long t_load = now_ns();
  if (restore) {
    size_t snapshot_size;
    void* snapshot = read_file(argv[1], "index.snapshot", &snapshot_size);
    if (kvr_router_restore(router, snapshot, snapshot_size, NULL) != KVR_OK) return 1;
    free(snapshot);
  } else {
    size_t events_size;
    uint64_t* e = read_file(argv[1], "events.u64", &events_size);
    const uint64_t* end = e + events_size / 8;
    for (const uint64_t* p = e; p < end;) {
      kvr_stored_event ev;
      kvr_stored_event_init(&ev, sizeof ev);
      ev.worker_id = p[0];
      ev.flags = p[1] ? KVR_STORED_HAS_PARENT : 0;
      ev.parent_hash = p[2];
      ev.num_blocks = (size_t)p[3];
      ev.block_hashes = p + 4;
      ev.local_hashes = p + 4 + ev.num_blocks;
      if (kvr_router_apply_stored(router, &ev, NULL) != KVR_OK) return 1;
      p += 4 + 2 * ev.num_blocks;
    }
    free(e);
  }
  kvr_metrics m;
  kvr_metrics_init(&m, sizeof m);
  kvr_router_get_metrics(router, &m, NULL);
  printf("index %s: %llu blocks, %llu nodes in %.1f s\n", restore ? "restored" : "replayed",
         (unsigned long long)m.index_blocks, (unsigned long long)m.index_nodes,
         (now_ns() - t_load) / 1e9);
  printf("C ABI: %zu queries, %ld iterations x %d repetitions\n", nq, iterations, repetitions);

  long long* find = malloc(sizeof(long long) * (size_t)iterations);
  long long* freed = malloc(sizeof(long long) * (size_t)iterations);
  char ids[4096][24];
  for (int i = 0; i < 4096; ++i) snprintf(ids[i], sizeof ids[i], "request-%d", i);
  uint32_t* prompt = malloc(TOKENS * 4);
  for (int rep = 0; rep < repetitions; ++rep) {
    for (long i = -iterations / 10; i < iterations; ++i) {
      long k = ((i % 4096) + 4096) % 4096;
      memcpy(prompt, queries + (size_t)(((i % (long)nq) + (long)nq) % (long)nq) * TOKENS,
             TOKENS * 4);
      kvr_request_options req;
      kvr_request_options_init(&req, sizeof req);
      req.flags = KVR_REQUEST_ADMIT;
      req.request_id = ids[k];
      kvr_route_result r;
      kvr_route_result_init(&r, sizeof r);
      long long t0 = now_ns();
      if (kvr_find_best_match(router, prompt, TOKENS, &req, &r, NULL, 0, NULL, NULL) != KVR_OK) {
        return 1;
      }
      long long t1 = now_ns();
      kvr_router_free_request(router, ids[k], NULL);
      long long t2 = now_ns();
      if (i >= 0) {
        find[i] = t1 - t0;
        freed[i] = t2 - t1;
      }
    }
    double a50 = pct(find, (size_t)iterations, 0.5), a99 = pct(find, (size_t)iterations, 0.99);
    double f50 = pct(freed, (size_t)iterations, 0.5);
    for (long i = -iterations / 10; i < iterations; ++i) {
      memcpy(prompt, queries + (size_t)(((i % (long)nq) + (long)nq) % (long)nq) * TOKENS,
             TOKENS * 4);
      kvr_route_result r;
      kvr_route_result_init(&r, sizeof r);
      long long t0 = now_ns();
      kvr_find_best_match(router, prompt, TOKENS, NULL, &r, NULL, 0, NULL, NULL);
      long long t1 = now_ns();
      if (i >= 0) find[i] = t1 - t0;
    }
    printf(
        "rep %d: find_best_match+admit p50 %.2f us p99 %.2f us | free p50 %.2f us | preview "
        "p50 %.2f us p99 %.2f us\n",
        rep + 1, a50, a99, f50, pct(find, (size_t)iterations, 0.5),
        pct(find, (size_t)iterations, 0.99));
  }
  kvr_router_free(router);
  return 0;
}
