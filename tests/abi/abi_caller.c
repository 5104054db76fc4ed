/* The ABI compatibility caller (tests/abi/README.md, docs/abi-tests.md).
 *
 * This one source is compiled once per frozen release header (tests/abi/headers/RELEASE/) into
 * its own executable, and linked against today's libkvrouter. It is a program written against
 * that release: every struct it passes or receives has that release's layout. It checks that
 * the library never touches a byte outside the caller's struct, reads only what the caller's
 * struct_size covers (an older caller's missing fields take the library's defaults) and still
 * does the right thing with what it reads.
 *
 * Every struct and every result array is allocated by NEW / NEW_ARRAY, and every case runs in
 * two passes:
 * - guards: 256 guard bytes on each side of every allocation, checked (and restored) after every
 *   library call, so a write past a struct is reported with the call that made it and how far
 *   it went, even in a build without sanitizers;
 * - exact: every allocation is exactly the size of the struct, so that under AddressSanitizer
 *   any read or write past it is reported where it happens (the guards cannot see reads).
 *
 * Usage: abi_caller_RELEASE [--pass guards|exact] [CASE...]  (no CASE: every case). Prints one
 * line per case and pass ("ok NAME [guards]", "FAIL NAME [exact]", "skip NAME: why"); exits 1
 * if any case failed.
 *
 * C99 on purpose: the oldest dialect the header promises. */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The frozen release's version header comes first: it decides how the header is included. */
#include "kvrouter_version.h"

#if defined(KVR_ABI_EXPECT_VERSION) && KVR_VERSION_NUMBER != KVR_ABI_EXPECT_VERSION
#error "the frozen kvrouter_version.h found first is not the one this build asked for"
#endif

/* The versioned structs: each has a kvr_X_init in every release. */
#define KVR_ABI_STRUCTS(X) \
  X(kvr_hash_options)      \
  X(kvr_router_options)    \
  X(kvr_worker_config)     \
  X(kvr_stored_event)      \
  X(kvr_removed_event)     \
  X(kvr_request_options)   \
  X(kvr_route_result)      \
  X(kvr_metrics)           \
  X(kvr_routing_hints)     \
  X(kvr_route_signals)     \
  X(kvr_disagg_options)    \
  X(kvr_prefill_result)    \
  X(kvr_ingest_options)    \
  X(kvr_engine_worker)     \
  X(kvr_ingest_stats)

/* The versioned structs a release added: from 0.2.0 on, each has its sized kvr_X_init. */
#if KVR_VERSION_NUMBER >= 200
#define KVR_ABI_STRUCTS_SINCE_0_2(X) X(kvr_jetstream_source)
#else
#define KVR_ABI_STRUCTS_SINCE_0_2(X)
#endif

#if KVR_VERSION_MAJOR == 0 && KVR_VERSION_MINOR < 2
/* A 0.1 header declares `void kvr_X_init(kvr_X *)`, which no 0.2 library exports: the library
 * cannot know how large a 0.1 binary's struct is, hence the SONAME bump to 0.2 (0.1 binaries
 * are not helped by anything here). What this caller is instead: a program with the 0.1
 * header's struct layouts using 0.2's calling convention, i.e. source written against the old
 * header whose init calls pass `sizeof` as 0.2 asks. That is exactly the caller the issue
 * describes (its struct shorter than the library's), and the only one 0.2 can serve.
 *
 * The old declarations are renamed out of the way while the header is included, then the sized
 * 0.2 signature is declared for the old struct types. The preprocessor cannot generate
 * #define lines, so both lists are written out; they must name the same 15 functions. */
#define kvr_hash_options_init kvr_abi_unsized_hash_options_init
#define kvr_router_options_init kvr_abi_unsized_router_options_init
#define kvr_worker_config_init kvr_abi_unsized_worker_config_init
#define kvr_stored_event_init kvr_abi_unsized_stored_event_init
#define kvr_removed_event_init kvr_abi_unsized_removed_event_init
#define kvr_request_options_init kvr_abi_unsized_request_options_init
#define kvr_route_result_init kvr_abi_unsized_route_result_init
#define kvr_metrics_init kvr_abi_unsized_metrics_init
#define kvr_routing_hints_init kvr_abi_unsized_routing_hints_init
#define kvr_route_signals_init kvr_abi_unsized_route_signals_init
#define kvr_disagg_options_init kvr_abi_unsized_disagg_options_init
#define kvr_prefill_result_init kvr_abi_unsized_prefill_result_init
#define kvr_ingest_options_init kvr_abi_unsized_ingest_options_init
#define kvr_engine_worker_init kvr_abi_unsized_engine_worker_init
#define kvr_ingest_stats_init kvr_abi_unsized_ingest_stats_init
#endif

#include "kvrouter.h"

#if KVR_VERSION_MAJOR == 0 && KVR_VERSION_MINOR < 2
#undef kvr_hash_options_init
#undef kvr_router_options_init
#undef kvr_worker_config_init
#undef kvr_stored_event_init
#undef kvr_removed_event_init
#undef kvr_request_options_init
#undef kvr_route_result_init
#undef kvr_metrics_init
#undef kvr_routing_hints_init
#undef kvr_route_signals_init
#undef kvr_disagg_options_init
#undef kvr_prefill_result_init
#undef kvr_ingest_options_init
#undef kvr_engine_worker_init
#undef kvr_ingest_stats_init
#define KVR_ABI_SIZED_INIT_(T) kvr_status T##_init(T*, size_t);
KVR_ABI_STRUCTS(KVR_ABI_SIZED_INIT_)
#undef KVR_ABI_SIZED_INIT_
#endif

/* The cost knobs of 5c4c366 (overlap_score_credit_decay, decode_active_request_weight in the
 * router and request options) came with this flag; headers without it lack those fields. */
#if KVR_VERSION_NUMBER >= 200 || defined(KVR_ROUTER_TRACK_OUTPUT_BLOCKS)
#define KVR_ABI_HAS_COST_KNOBS 1
#else
#define KVR_ABI_HAS_COST_KNOBS 0
#endif

#ifndef KVR_ABI_HEADER
#define KVR_ABI_HEADER "(unnamed)"
#endif

/* ---- Allocations with guards ------------------------------------------------------------- */

/* Guards wider than any struct: even a library that writes its whole struct over a 4-byte one
 * (the too-short _init probe) stays inside them, so the report is exact and the heap intact. */
enum { GUARD_BYTES = 256, MAX_BLOCKS = 256 };
/* The guard pattern. Read as a double it is negative (about -2.5e-127), which the library
 * refuses for every option: a library reading past an options struct then fails the call
 * instead of passing silently. */
#define GUARD_BYTE 0xA5
/* What a struct holds before its _init: the caller's uninitialised memory. */
#define FRESH_BYTE 0x5A

typedef struct abi_block {
  unsigned char* base; /* what malloc returned */
  unsigned char* p;    /* the struct or array handed to the library */
  size_t size;
  const char* what;
} abi_block;

static abi_block g_blocks[MAX_BLOCKS];
static size_t g_num_blocks;
static int g_guarded = 1; /* the pass: 1 guards, 0 exact */
static int g_failures;    /* in the running case and pass */
static kvr_error* g_err;  /* every fallible call's error object */
#define ERR (&g_err)

static void abi_fail(const char* file, int line, const char* format, ...) {
  va_list args;
  fprintf(stdout, "  %s:%d: ", file, line);
  va_start(args, format);
  vfprintf(stdout, format, args);
  va_end(args);
  fputc('\n', stdout);
  fflush(stdout);
  ++g_failures;
}

static void* abi_new(size_t size, const char* what) {
  abi_block* block;
  if (g_num_blocks == MAX_BLOCKS) {
    fprintf(stderr, "abi_caller: more than %d live allocations\n", MAX_BLOCKS);
    abort();
  }
  block = &g_blocks[g_num_blocks++];
  block->size = size;
  block->what = what;
  block->base = (unsigned char*)malloc(g_guarded ? size + 2 * GUARD_BYTES : size);
  if (block->base == NULL) abort();
  block->p = g_guarded ? block->base + GUARD_BYTES : block->base;
  if (g_guarded) {
    memset(block->base, GUARD_BYTE, GUARD_BYTES);
    memset(block->p + size, GUARD_BYTE, GUARD_BYTES);
  }
  memset(block->p, FRESH_BYTE, size);
  return block->p;
}
#define NEW(T) ((T*)abi_new(sizeof(T), #T))
#define NEW_ARRAY(T, n) ((T*)abi_new(sizeof(T) * (n), #T "[]"))

/* How many bytes of a guard differ from the pattern, counted from the struct outwards (the
 * size of the overrun); restores the guard so that the next check reports new damage only. */
static size_t damaged_extent(unsigned char* guard, int after_struct) {
  size_t extent = 0;
  size_t i;
  for (i = 0; i < GUARD_BYTES; ++i) {
    const size_t from_struct = after_struct ? i + 1 : GUARD_BYTES - i;
    if (guard[i] != GUARD_BYTE && from_struct > extent) extent = from_struct;
  }
  memset(guard, GUARD_BYTE, GUARD_BYTES);
  return extent;
}

/* After every library call: has it written outside any struct the caller holds? */
static void abi_check_guards(const char* call, const char* file, int line) {
  size_t i;
  if (!g_guarded) return;
  for (i = 0; i < g_num_blocks; ++i) {
    const abi_block* b = &g_blocks[i];
    const size_t before = damaged_extent(b->base, 0);
    const size_t after = damaged_extent(b->p + b->size, 1);
    if (after > 0) {
      abi_fail(file, line, "%s wrote %zu bytes past the end of the caller's %s (%zu bytes)", call,
               after, b->what, b->size);
    }
    if (before > 0) {
      abi_fail(file, line, "%s wrote %zu bytes before the start of the caller's %s (%zu bytes)",
               call, before, b->what, b->size);
    }
  }
}

static void abi_free_all(void) {
  size_t i;
  abi_check_guards("the case", __FILE__, __LINE__);
  for (i = 0; i < g_num_blocks; ++i) free(g_blocks[i].base);
  g_num_blocks = 0;
}

/* ---- Expectations ------------------------------------------------------------------------ */

static int abi_expect_status(kvr_status want, kvr_status got, const char* call, const char* file,
                             int line) {
  if (got != want) {
    abi_fail(file, line, "%s returned %s (%d), not %s: %s", call, kvr_status_str(got), (int)got,
             kvr_status_str(want), g_err != NULL ? kvr_error_message(g_err) : "(no message)");
  }
  kvr_error_free(g_err);
  g_err = NULL;
  abi_check_guards(call, file, line);
  return got == want;
}
/* Runs `call` (which may pass ERR), expects `want`, then checks every guard. */
#define CALL(want, call) abi_expect_status((want), (call), #call, __FILE__, __LINE__)
#define OK(call) CALL(KVR_OK, call)

static int abi_expect_u64(uint64_t want, uint64_t got, const char* what, const char* file,
                          int line) {
  if (want == got) return 1;
  abi_fail(file, line, "%s is %llu, not %llu", what, (unsigned long long)got,
           (unsigned long long)want);
  return 0;
}
#define EXPECT_U64(want, got) \
  abi_expect_u64((uint64_t)(want), (uint64_t)(got), #got, __FILE__, __LINE__)

/* Exact: the library's defaults and copies are exact values (NaN equals NaN here). */
static int abi_expect_double(double want, double got, const char* what, const char* file,
                             int line) {
  if (want == got || (isnan(want) && isnan(got))) return 1;
  abi_fail(file, line, "%s is %.17g, not %.17g", what, got, want);
  return 0;
}
#define EXPECT_DOUBLE(want, got) abi_expect_double((want), (got), #got, __FILE__, __LINE__)

#define EXPECT(cond) ((cond) ? 1 : (abi_fail(__FILE__, __LINE__, "expected %s", #cond), 0))

/* Every byte after struct_size is zero (a struct whose defaults are all zero). */
static int all_zero_after_size(const void* p, size_t size) {
  const unsigned char* bytes = (const unsigned char*)p;
  size_t i;
  for (i = sizeof(uint32_t); i < size; ++i) {
    if (bytes[i] != 0) return 0;
  }
  return 1;
}

/* ---- Shared steps ------------------------------------------------------------------------ */

enum { BS = 16 }; /* the block size of every router here */

static void fill_tokens(uint32_t* tokens, size_t n, uint32_t first) {
  size_t i;
  for (i = 0; i < n; ++i) tokens[i] = first + (uint32_t)i;
}

/* A router from options initialised at this header's size, all defaults but the seed. */
static kvr_router* new_router(void) {
  kvr_router_options* options = NEW(kvr_router_options);
  kvr_router* router = NULL;
  OK(kvr_router_options_init(options, sizeof *options));
  options->random_seed = 7;
  /* A refusal is reported; the case goes on with a default router to report what else fails. */
  if (!OK(kvr_router_new(options, &router, ERR))) OK(kvr_router_new(NULL, &router, ERR));
  if (router == NULL) abort(); /* nothing further can run */
  return router;
}

static void add_worker(kvr_router* router, uint64_t worker_id, uint32_t dp_size,
                       uint64_t total_kv_blocks) {
  kvr_worker_config* config = NEW(kvr_worker_config);
  OK(kvr_worker_config_init(config, sizeof *config));
  config->worker_id = worker_id;
  config->dp_size = dp_size;
  config->total_kv_blocks = total_kv_blocks;
  OK(kvr_router_add_worker(router, config, ERR));
}

/* A stored event: rank 0 of `worker_id` caches the first `blocks` blocks of `tokens`, with
 * engine hashes first_hash, first_hash + 1, ... */
static kvr_stored_event* stored_event(uint64_t worker_id, const uint32_t* tokens, size_t blocks,
                                      uint64_t first_hash) {
  kvr_stored_event* event = NEW(kvr_stored_event);
  uint64_t* hashes = NEW_ARRAY(uint64_t, blocks);
  size_t i;
  for (i = 0; i < blocks; ++i) hashes[i] = first_hash + i;
  OK(kvr_stored_event_init(event, sizeof *event));
  event->worker_id = worker_id;
  event->event_id = first_hash;
  event->block_hashes = hashes;
  event->num_blocks = blocks;
  event->token_ids = tokens;
  event->num_tokens = blocks * BS;
  return event;
}

static kvr_removed_event* removed_event(uint64_t worker_id, uint64_t engine_hash) {
  kvr_removed_event* event = NEW(kvr_removed_event);
  uint64_t* hashes = NEW_ARRAY(uint64_t, 1);
  hashes[0] = engine_hash;
  OK(kvr_removed_event_init(event, sizeof *event));
  event->worker_id = worker_id;
  event->event_id = engine_hash;
  event->block_hashes = hashes;
  event->num_blocks = 1;
  return event;
}

static kvr_metrics* get_metrics(kvr_router* router) {
  kvr_metrics* metrics = NEW(kvr_metrics);
  OK(kvr_metrics_init(metrics, sizeof *metrics));
  metrics->decisions = 12345; /* the call must write it */
#if KVR_VERSION_NUMBER >= 200
  metrics->events_refused_for_memory = 12345; /* and the last fields, 0 without a refusal */
  metrics->replica_changes_unpublished = 12345;
  metrics->decisions_priced_again = 12345; /* 0: one caller at a time */
#endif
  OK(kvr_router_get_metrics(router, metrics, ERR));
  EXPECT_U64(sizeof *metrics, metrics->struct_size);
#if KVR_VERSION_NUMBER >= 200
  EXPECT_U64(0, metrics->events_refused_for_memory);
  EXPECT_U64(0, metrics->replica_changes_unpublished);
  EXPECT_U64(0, metrics->decisions_priced_again);
#endif
  return metrics;
}

/* ---- Every _init: defaults, written within the caller's size -------------------------------
 * Each struct's fields are checked by name, so a field that moved in the library's header (a
 * layout an older caller no longer matches) shows up as a wrong default here. Fields a later
 * header added are checked only where this header has them. */

static void defaults_kvr_hash_options(const kvr_hash_options* o) {
  EXPECT(all_zero_after_size(o, sizeof *o)); /* no flags, LoRA, namespace or multimodal */
}

static void defaults_kvr_router_options(const kvr_router_options* o) {
  EXPECT_U64(16, o->block_size);
  EXPECT_U64(0, o->flags);
  EXPECT_U64(KVR_QUEUE_FCFS, o->queue_policy);
  EXPECT_DOUBLE(1.0, o->overlap_score_credit);
  EXPECT_DOUBLE(1.0, o->prefill_load_scale);
  EXPECT_DOUBLE(0.75, o->host_cache_hit_weight);
  EXPECT_DOUBLE(0.25, o->disk_cache_hit_weight);
  EXPECT_DOUBLE(0.0, o->temperature);
  EXPECT(o->queue_threshold < 0); /* never queue */
  EXPECT_DOUBLE(120.0, o->approx_ttl_seconds);
  EXPECT_U64((uint64_t)1 << 20, o->approx_max_blocks);
  EXPECT_DOUBLE(0.8, o->approx_prune_target_ratio);
  EXPECT_DOUBLE(300.0, o->request_expiry_seconds);
  EXPECT_U64(0, o->random_seed);
#if KVR_ABI_HAS_COST_KNOBS
  EXPECT_DOUBLE(0.0, o->overlap_score_credit_decay);
  EXPECT_DOUBLE(0.0, o->decode_active_request_weight);
#endif
}

static void defaults_kvr_worker_config(const kvr_worker_config* o) {
  EXPECT_U64(0, o->block_size); /* the router's */
  EXPECT_U64(0, o->worker_id);
  EXPECT_U64(0, o->dp_start);
  EXPECT_U64(1, o->dp_size);
  EXPECT_U64(0, o->total_kv_blocks);
  EXPECT_U64(0, o->max_num_batched_tokens);
}

static void defaults_kvr_stored_event(const kvr_stored_event* o) {
  EXPECT(all_zero_after_size(o, sizeof *o));
}

static void defaults_kvr_removed_event(const kvr_removed_event* o) {
  EXPECT(all_zero_after_size(o, sizeof *o));
}

static void defaults_kvr_request_options(const kvr_request_options* o) {
  EXPECT_U64(0, o->flags);
  EXPECT(o->request_id == NULL && o->lora_name == NULL && o->cache_namespace == NULL);
  EXPECT(o->mm_hashes == NULL && o->mm_counts == NULL && o->mm_num_blocks == 0);
  EXPECT(o->allowed_worker_ids == NULL && o->num_allowed_worker_ids == 0);
  /* NaN: the router's setting */
  EXPECT(isnan(o->overlap_score_credit) && isnan(o->prefill_load_scale));
  EXPECT(isnan(o->host_cache_hit_weight) && isnan(o->disk_cache_hit_weight));
  EXPECT(isnan(o->temperature));
  EXPECT_U64(-1, o->assume_kv_reuse);
  EXPECT_U64(-1, o->track_prefill_tokens);
  EXPECT_DOUBLE(0.0, o->priority_jump);
  EXPECT_U64(0, o->expected_output_tokens);
  EXPECT_U64(-1, o->queue_timeout_ms);
#if KVR_ABI_HAS_COST_KNOBS
  EXPECT(isnan(o->overlap_score_credit_decay) && isnan(o->decode_active_request_weight));
#endif
#ifdef KVR_REQUEST_PREHASHED
  EXPECT(o->local_hashes == NULL && o->num_local_hashes == 0);
#endif
}

static void defaults_kvr_route_result(const kvr_route_result* o) {
  EXPECT(all_zero_after_size(o, sizeof *o));
}

static void defaults_kvr_metrics(const kvr_metrics* o) {
  EXPECT(all_zero_after_size(o, sizeof *o));
}

static void defaults_kvr_routing_hints(const kvr_routing_hints* o) {
  EXPECT_U64(KVR_PHASE_AGGREGATED, o->phase);
  EXPECT_U64(KVR_WORKER_NONE, o->worker_id);
  EXPECT_U64(KVR_WORKER_NONE, o->prefill_worker_id);
  EXPECT_U64(KVR_WORKER_NONE, o->decode_worker_id);
  EXPECT_U64(-1, o->dp_rank);
  EXPECT_U64(-1, o->prefill_dp_rank);
  EXPECT(o->session_id == NULL);
  EXPECT_U64(KVR_SESSION_HARD, o->session_mode);
  EXPECT_DOUBLE(300.0, o->session_ttl_seconds);
}

static void defaults_kvr_route_signals(const kvr_route_signals* o) {
  EXPECT(all_zero_after_size(o, sizeof *o));
}

static void defaults_kvr_disagg_options(const kvr_disagg_options* o) {
  EXPECT_U64(KVR_DISAGG_ALWAYS, o->policy);
  EXPECT_U64(0, o->enforce);
  EXPECT_U64(512, o->max_local_prefill_tokens);
  EXPECT_DOUBLE(1.0, o->max_local_prefill_ratio);
  EXPECT_DOUBLE(1.0, o->prefill_busy_threshold);
  EXPECT(o->decode_busy_threshold < 0); /* unavailable: never prefill locally */
}

static void defaults_kvr_prefill_result(const kvr_prefill_result* o) {
  EXPECT_U64(0, o->remote);
  EXPECT_U64(0, o->worker_id);
  EXPECT_U64(-1, o->bootstrap_room); /* not remote */
  EXPECT_U64(0, o->cached_tokens);
}

static void defaults_kvr_ingest_options(const kvr_ingest_options* o) {
  EXPECT_U64(64u << 20, o->max_frame_bytes);
  EXPECT_U64(2000, o->replay_timeout_ms);
#if KVR_VERSION_NUMBER >= 200
  EXPECT_U64(1000, o->replica_heartbeat_ms);
  EXPECT_U64(10000, o->replica_timeout_ms);
#endif
}

#if KVR_VERSION_NUMBER >= 200
static void defaults_kvr_jetstream_source(const kvr_jetstream_source* o) {
  EXPECT_U64(0, o->flags);
  EXPECT(o->url == NULL && o->stream == NULL && o->subject == NULL && o->durable == NULL);
  EXPECT_U64(0, o->start_sequence);
  EXPECT(o->max_age_seconds == 3600.0);
  EXPECT(o->max_bytes == (int64_t)1 << 30);
}
#endif

static void defaults_kvr_engine_worker(const kvr_engine_worker* o) {
  EXPECT_U64(KVR_ENGINE_VLLM, o->engine);
  EXPECT(o->endpoint == NULL && o->topic == NULL && o->replay_endpoint == NULL);
  EXPECT_U64(0, o->worker_id);
  EXPECT_U64(0, o->dp_start);
  EXPECT_U64(1, o->dp_size);
  EXPECT_U64(0, o->block_size);
  EXPECT_U64(0, o->flags);
}

static void defaults_kvr_ingest_stats(const kvr_ingest_stats* o) {
  EXPECT(all_zero_after_size(o, sizeof *o));
}

/* One struct's _init, at this header's size: OK, never past the size, every byte of it
 * written (the same result over zeros and over ones), struct_size recorded, the defaults. Then
 * the two refusals: a size below any released layout and NULL. */
static void check_init(const char* type, size_t size, kvr_status (*init)(void*, size_t),
                       void (*defaults)(const void*)) {
  unsigned char* over_zeros = (unsigned char*)abi_new(size, type);
  unsigned char* over_ones = (unsigned char*)abi_new(size, type);
  unsigned char* too_short = (unsigned char*)abi_new(sizeof(uint32_t), type);
  char call[96];
  uint32_t recorded;
  snprintf(call, sizeof call, "%s_init(p, %zu)", type, size);
  memset(over_zeros, 0x00, size);
  abi_expect_status(KVR_OK, init(over_zeros, size), call, __FILE__, __LINE__);
  memset(over_ones, 0xFF, size);
  abi_expect_status(KVR_OK, init(over_ones, size), call, __FILE__, __LINE__);
  memcpy(&recorded, over_zeros, sizeof recorded);
  EXPECT_U64(size, recorded);
  if (memcmp(over_zeros, over_ones, size) != 0) {
    abi_fail(__FILE__, __LINE__, "%s left some of the caller's bytes as they were", call);
  }
  defaults(over_zeros);

  snprintf(call, sizeof call, "%s_init(p, 4)", type);
  abi_expect_status(KVR_INVALID_ARGUMENT, init(too_short, sizeof(uint32_t)), call, __FILE__,
                    __LINE__);
  memcpy(&recorded, too_short, sizeof recorded);
  EXPECT_U64(sizeof(uint32_t), recorded); /* so that every call refuses it with a message */
  snprintf(call, sizeof call, "%s_init(NULL, %zu)", type, size);
  abi_expect_status(KVR_INVALID_ARGUMENT, init(NULL, size), call, __FILE__, __LINE__);
}

/* Per struct: an init and a defaults check taking void*, and the case. */
#define KVR_ABI_INIT_CASE_(T)                                                            \
  static kvr_status abi_init_##T(void* p, size_t size) { return T##_init((T*)p, size); } \
  static void abi_defaults_##T(const void* p) { defaults_##T((const T*)p); }             \
  static void case_init_##T(void) { check_init(#T, sizeof(T), abi_init_##T, abi_defaults_##T); }
KVR_ABI_STRUCTS(KVR_ABI_INIT_CASE_)
KVR_ABI_STRUCTS_SINCE_0_2(KVR_ABI_INIT_CASE_)
#undef KVR_ABI_INIT_CASE_

/* ---- The reproductions ------------------------------------------------------------- */

/* The header before 5c4c366: kvr_router_options was 104 bytes. At 2ad83cb the library's
 * kvr_router_options_init wrote its own 120 bytes, 16 past the caller's struct, and recorded
 * struct_size 120; kvr_router_new then read the caller's neighbouring bytes (here the guards,
 * restored after the first report as the caller's other variables would be) as
 * overlap_score_credit_decay and decode_active_request_weight, and refused them. Today: 104
 * recorded, 104 read, the missing knobs at the library's defaults. */
static void router_options_104_bytes_not_overrun(void) {
  kvr_router_options* options = NEW(kvr_router_options);
  kvr_worker_config* worker = NEW(kvr_worker_config);
  kvr_request_options* request = NEW(kvr_request_options);
  kvr_route_result* result = NEW(kvr_route_result);
  kvr_router* router = NULL;
  uint32_t tokens[2 * BS];
  EXPECT_U64(104, sizeof *options);
  OK(kvr_router_options_init(options, sizeof *options));
  EXPECT_U64(104, options->struct_size);
  options->random_seed = 11;
  if (!OK(kvr_router_new(options, &router, ERR))) return;
  /* and the router works */
  OK(kvr_worker_config_init(worker, sizeof *worker));
  worker->worker_id = 5;
  OK(kvr_router_add_worker(router, worker, ERR));
  OK(kvr_request_options_init(request, sizeof *request));
  OK(kvr_route_result_init(result, sizeof *result));
  fill_tokens(tokens, 2 * BS, 100);
  OK(kvr_find_best_match(router, tokens, 2 * BS, request, result, NULL, 0, NULL, ERR));
  EXPECT_U64(5, result->worker_id);
  kvr_router_free(router);
}

/* The header before 701568e: kvr_metrics was 200 bytes. At 2ad83cb kvr_metrics_init wrote
 * 224, and recorded 224, so every kvr_router_get_metrics wrote 24 bytes past the caller's
 * struct too. Today both stay within 200 and the counters the struct has are right. The router
 * and the requests use default options (NULL): this case is about kvr_metrics alone. */
static void metrics_200_bytes_not_overrun(void) {
  kvr_router* router = NULL;
  kvr_route_result* result = NEW(kvr_route_result);
  kvr_metrics* metrics = NEW(kvr_metrics);
  uint32_t tokens[3 * BS];
  if (!OK(kvr_router_new(NULL, &router, ERR))) return;
  fill_tokens(tokens, 3 * BS, 200);
  add_worker(router, 1, 1, 0);
  add_worker(router, 2, 1, 0);
  OK(kvr_router_apply_stored(router, stored_event(2, tokens, 2, 500), ERR));
  OK(kvr_route_result_init(result, sizeof *result));
  OK(kvr_find_best_match(router, tokens, 3 * BS, NULL, result, NULL, 0, NULL, ERR));
  EXPECT_U64(2, result->worker_id);

  OK(kvr_metrics_init(metrics, sizeof *metrics));
  EXPECT_U64(200, metrics->struct_size);
  OK(kvr_router_get_metrics(router, metrics, ERR));
  EXPECT_U64(200, metrics->struct_size);
  EXPECT_U64(1, metrics->events[KVR_EVENT_STORED][KVR_EVENT_OK]);
  EXPECT_U64(1, metrics->decisions);
  EXPECT_U64(2, metrics->workers);
  EXPECT_U64(2, metrics->index_blocks);
  EXPECT(metrics->index_bytes > 0);
  /* "every kvr_router_get_metrics": a second one, after a second decision */
  OK(kvr_find_best_match(router, tokens, 3 * BS, NULL, result, NULL, 0, NULL, ERR));
  OK(kvr_router_get_metrics(router, metrics, ERR));
  EXPECT_U64(2, metrics->decisions);
  kvr_router_free(router);
}

/* ---- Every call that reads an options struct or writes a result struct ---------------------- */

static void block_hashes_with_hash_options(void) {
  uint32_t tokens[4 * BS];
  uint64_t* plain = NEW_ARRAY(uint64_t, 4);
  uint64_t* defaults = NEW_ARRAY(uint64_t, 4);
  uint64_t* lora = NEW_ARRAY(uint64_t, 4);
  kvr_hash_options* options = NEW(kvr_hash_options);
  size_t len = 0;
  size_t i;
  fill_tokens(tokens, 4 * BS, 300);
  OK(kvr_compute_block_hashes(tokens, 4 * BS, BS, NULL, plain, 4, &len, ERR));
  EXPECT_U64(4, len);
  OK(kvr_hash_options_init(options, sizeof *options));
  OK(kvr_compute_block_hashes(tokens, 4 * BS, BS, options, defaults, 4, &len, ERR));
  EXPECT(memcmp(plain, defaults, 4 * sizeof *plain) == 0);
  options->lora_name = "abi-lora";
  OK(kvr_compute_block_hashes(tokens, 4 * BS, BS, options, lora, 4, &len, ERR));
  for (i = 0; i < 4; ++i) EXPECT(lora[i] != plain[i]);
}

/* Router, workers, events, routing, per-rank queries, metrics: the caching worker wins and the
 * metrics count what happened. */
static void route_after_stored_and_removed_events(void) {
  kvr_router* router = new_router();
  kvr_worker_config* two = NEW(kvr_worker_config);
  kvr_request_options* admit = NEW(kvr_request_options);
  kvr_request_options* look = NEW(kvr_request_options);
  kvr_route_result* result = NEW(kvr_route_result);
  kvr_candidate* candidates = NEW_ARRAY(kvr_candidate, 8);
  kvr_overlap* overlaps = NEW_ARRAY(kvr_overlap, 4);
  kvr_potential_load* loads = NEW_ARRAY(kvr_potential_load, 4);
  kvr_metrics* metrics;
  uint32_t tokens[3 * BS];
  size_t n = 0;
  size_t i;
  size_t chosen = 0;
  fill_tokens(tokens, 3 * BS, 1000);

  add_worker(router, 1, 1, 0);
  OK(kvr_worker_config_init(two, sizeof *two));
  two->worker_id = 2;
  OK(kvr_router_add_worker(router, two, ERR));
  two->dp_size = 2;
  two->total_kv_blocks = 4096;
  OK(kvr_router_update_worker(router, two, ERR));
  OK(kvr_router_apply_stored(router, stored_event(1, tokens, 2, 101), ERR));

  OK(kvr_request_options_init(admit, sizeof *admit));
  admit->flags = KVR_REQUEST_ADMIT;
  admit->request_id = "abi-route";
  OK(kvr_route_result_init(result, sizeof *result));
  result->worker_id = 999; /* the call must write it */
  OK(kvr_find_best_match(router, tokens, 3 * BS, admit, result, candidates, 8, &n, ERR));
  EXPECT_U64(sizeof *result, result->struct_size);
  EXPECT_U64(1, result->worker_id);
  EXPECT_U64(0, result->dp_rank);
  EXPECT_U64(3, result->prompt_blocks);
  EXPECT_U64(2, result->device_overlap_blocks);
  EXPECT_DOUBLE(2.0, result->effective_overlap_blocks);
  EXPECT_U64(2 * BS, result->cached_tokens);
  EXPECT_U64(3 * BS, result->prompt_tokens);
  EXPECT_U64(1, result->booked);
  EXPECT_U64(0, result->queued);
  EXPECT_U64(3, n); /* worker 1 rank 0, worker 2 ranks 0 and 1 */
  for (i = 0; i < n && i < 8; ++i) {
    if (!candidates[i].chosen) continue;
    ++chosen;
    EXPECT_U64(1, candidates[i].worker_id);
    EXPECT_U64(2, candidates[i].device_blocks);
    EXPECT_DOUBLE(result->cost, candidates[i].cost);
  }
  EXPECT_U64(1, chosen);

  OK(kvr_request_options_init(look, sizeof *look));
  OK(kvr_router_overlap_scores(router, tokens, 3 * BS, look, overlaps, 4, &n, ERR));
  EXPECT_U64(1, n);
  EXPECT_U64(1, overlaps[0].worker_id);
  EXPECT_U64(2, overlaps[0].device_blocks);
  OK(kvr_router_potential_loads(router, tokens, 3 * BS, look, loads, 4, &n, ERR));
  EXPECT_U64(3, n);

  /* Worker 1 evicts its second block; an unknown block is refused and counted. */
  OK(kvr_router_apply_removed(router, removed_event(1, 102), ERR));
  CALL(KVR_NOT_FOUND, kvr_router_apply_removed(router, removed_event(1, 999), ERR));
  OK(kvr_router_overlap_scores(router, tokens, 3 * BS, look, overlaps, 4, &n, ERR));
  EXPECT_U64(1, n);
  EXPECT_U64(1, overlaps[0].device_blocks);

  metrics = get_metrics(router);
  EXPECT_U64(1, metrics->events[KVR_EVENT_STORED][KVR_EVENT_OK]);
  EXPECT_U64(1, metrics->events[KVR_EVENT_REMOVED][KVR_EVENT_OK]);
  EXPECT_U64(1, metrics->events[KVR_EVENT_REMOVED][KVR_EVENT_BLOCK_NOT_FOUND]);
  EXPECT_U64(1, metrics->decisions);
  EXPECT_U64(1, metrics->requests_active);
  EXPECT_U64(2, metrics->workers);
  EXPECT_U64(1, metrics->index_blocks);

  OK(kvr_router_mark_prefill_completed(router, "abi-route", ERR));
  OK(kvr_router_free_request(router, "abi-route", ERR));
  OK(kvr_router_remove_worker(router, 2, ERR));
  metrics = get_metrics(router);
  EXPECT_U64(0, metrics->requests_active);
  EXPECT_U64(1, metrics->workers);
  kvr_router_free(router);
}

/* The fields this header lacks take the library's defaults: no credit decay and no per-request
 * weight unless the caller's layout has them and sets them. Worker 1 caches the prompt and has
 * a long prefill queued; decay would shrink its credit below its cached blocks. */
static void missing_fields_take_the_library_defaults(void) {
  kvr_router* router = new_router();
  kvr_request_options* backlog = NEW(kvr_request_options);
  kvr_request_options* look = NEW(kvr_request_options);
  kvr_route_result* result = NEW(kvr_route_result);
  kvr_candidate* candidates = NEW_ARRAY(kvr_candidate, 4);
  uint32_t long_prompt[40 * BS];
  uint32_t tokens[5 * BS];
  size_t n = 0;
  size_t i;
  fill_tokens(long_prompt, 40 * BS, 50000);
  fill_tokens(tokens, 5 * BS, 2000);
  add_worker(router, 1, 1, 0);
  add_worker(router, 2, 1, 0);
  OK(kvr_router_apply_stored(router, stored_event(1, tokens, 4, 700), ERR));
  OK(kvr_request_options_init(backlog, sizeof *backlog));
  backlog->request_id = "abi-backlog";
  OK(kvr_router_add_request(router, long_prompt, 40 * BS, 1, 0, backlog, ERR));

  OK(kvr_request_options_init(look, sizeof *look));
  OK(kvr_route_result_init(result, sizeof *result));
  OK(kvr_find_best_match(router, tokens, 5 * BS, look, result, candidates, 4, &n, ERR));
  EXPECT_U64(2, n);
  for (i = 0; i < n && i < 4; ++i) {
    const kvr_candidate* c = &candidates[i];
    EXPECT_DOUBLE((double)c->device_blocks, c->credit); /* credit 1.0 per block, no decay */
    EXPECT(fabs(c->cost - (c->prefill_cost + (double)c->decode_blocks)) < 1e-9); /* no weight */
    if (c->worker_id == 1) EXPECT_U64(4, c->device_blocks);
  }
#if KVR_ABI_HAS_COST_KNOBS
  /* This header has the knobs: a request that sets decay gets a smaller credit on worker 1,
   * so the library reads the field where this header put it. */
  look->overlap_score_credit_decay = 1.0;
  OK(kvr_find_best_match(router, tokens, 5 * BS, look, result, candidates, 4, &n, ERR));
  for (i = 0; i < n && i < 4; ++i) {
    if (candidates[i].worker_id == 1) EXPECT(candidates[i].credit < 4.0);
  }
#endif
  OK(kvr_router_free_request(router, "abi-backlog", ERR));
  kvr_router_free(router);
}

static void event_batch_of_stored_and_removed(void) {
  kvr_router* router = new_router();
  kvr_event_batch* batch = NULL;
  kvr_buffer* encoded = NULL;
  kvr_metrics* metrics;
  uint32_t tokens[2 * BS];
  fill_tokens(tokens, 2 * BS, 3000);
  if (!OK(kvr_event_batch_new(&batch, ERR))) return;
  OK(kvr_event_batch_add_stored(batch, stored_event(1, tokens, 2, 801), ERR));
  OK(kvr_event_batch_add_removed(batch, removed_event(1, 802), ERR));
  OK(kvr_event_batch_add_cleared(batch, 2, 0, 900, ERR));
  EXPECT_U64(3, kvr_event_batch_size(batch));
  OK(kvr_event_batch_encode(batch, &encoded, ERR));
  OK(kvr_router_apply_event_batch(router, kvr_buffer_data(encoded), kvr_buffer_size(encoded), ERR));
  metrics = get_metrics(router);
  EXPECT_U64(1, metrics->events[KVR_EVENT_STORED][KVR_EVENT_OK]);
  EXPECT_U64(1, metrics->events[KVR_EVENT_REMOVED][KVR_EVENT_OK]);
  EXPECT_U64(1, metrics->events[KVR_EVENT_CLEARED][KVR_EVENT_OK]);
  EXPECT_U64(1, metrics->index_blocks);
  kvr_buffer_free(encoded);
  kvr_event_batch_free(batch);
  kvr_router_free(router);
}

/* Preview and plan with routing hints; a session binds where the plan went; a pin wins. */
static void preview_plan_commit_with_hints(void) {
  kvr_router* router = new_router();
  kvr_request_options* request = NEW(kvr_request_options);
  kvr_routing_hints* hints = NEW(kvr_routing_hints);
  kvr_routing_hints* pinned = NEW(kvr_routing_hints);
  kvr_route_signals* preview = NEW(kvr_route_signals);
  kvr_route_signals* plan = NEW(kvr_route_signals);
  kvr_metrics* metrics;
  uint32_t tokens[3 * BS];
  uint64_t bound_worker = 0;
  uint32_t bound_rank = 9;
  fill_tokens(tokens, 3 * BS, 4000);
  add_worker(router, 1, 1, 0);
  add_worker(router, 2, 1, 500);
  OK(kvr_router_apply_stored(router, stored_event(2, tokens, 2, 301), ERR));

  OK(kvr_request_options_init(request, sizeof *request));
  OK(kvr_routing_hints_init(hints, sizeof *hints));
  hints->session_id = "abi-session";
  OK(kvr_route_signals_init(preview, sizeof *preview));
  preview->booked = 7; /* the call must write it */
  OK(kvr_preview_route(router, tokens, 3 * BS, request, hints, preview, ERR));
  EXPECT_U64(sizeof *preview, preview->struct_size);
  EXPECT_U64(2, preview->worker_id);
  EXPECT_U64(2, preview->overlap_blocks);
  EXPECT_U64(3, preview->prompt_blocks);
  EXPECT_U64(2 * BS, preview->cached_tokens);
  EXPECT_U64(500, preview->total_kv_blocks);
  EXPECT_U64(3 * BS, preview->prompt_tokens);
  EXPECT_U64(0, preview->booked);

  request->request_id = "abi-plan";
  OK(kvr_route_signals_init(plan, sizeof *plan));
  OK(kvr_plan_route(router, tokens, 3 * BS, request, hints, preview, plan, ERR));
  EXPECT_U64(2, plan->worker_id);
  EXPECT_U64(1, plan->booked);
  EXPECT_U64(0, plan->moved);
  OK(kvr_commit_route(router, "abi-plan", ERR));
  OK(kvr_router_session_binding(router, "abi-session", &bound_worker, &bound_rank, ERR));
  EXPECT_U64(2, bound_worker);
  EXPECT_U64(0, bound_rank);

  OK(kvr_routing_hints_init(pinned, sizeof *pinned));
  pinned->worker_id = 1;
  request->request_id = NULL;
  OK(kvr_preview_route(router, tokens, 3 * BS, request, pinned, preview, ERR));
  EXPECT_U64(1, preview->worker_id);

  metrics = get_metrics(router);
  EXPECT_U64(1, metrics->decisions); /* the plan; previews are not decisions */
  EXPECT_U64(1, metrics->requests_active);
  OK(kvr_router_free_request(router, "abi-plan", ERR));
  kvr_router_free(router);
}

static void disagg_prefill_and_decode(void) {
  kvr_router_options* prefill_options = NEW(kvr_router_options);
  kvr_router_options* decode_options = NEW(kvr_router_options);
  kvr_disagg_options* options = NEW(kvr_disagg_options);
  kvr_request_options* request = NEW(kvr_request_options);
  kvr_routing_hints* hints = NEW(kvr_routing_hints);
  kvr_prefill_result* prefill = NEW(kvr_prefill_result);
  kvr_route_signals* decode = NEW(kvr_route_signals);
  kvr_disagg* disagg = NULL;
  kvr_disagg* no_prefill_pool = NULL;
  uint32_t tokens[3 * BS];
  int busy = -1;
  fill_tokens(tokens, 3 * BS, 5000);
  OK(kvr_router_options_init(prefill_options, sizeof *prefill_options));
  OK(kvr_router_options_init(decode_options, sizeof *decode_options));
  OK(kvr_disagg_options_init(options, sizeof *options));
  if (!OK(kvr_disagg_new(prefill_options, decode_options, options, &disagg, ERR))) return;
  add_worker(kvr_disagg_prefill_router(disagg), 11, 1, 0);
  add_worker(kvr_disagg_decode_router(disagg), 21, 1, 1000);

  OK(kvr_request_options_init(request, sizeof *request));
  request->request_id = "abi-disagg";
  OK(kvr_routing_hints_init(hints, sizeof *hints));
  OK(kvr_prefill_result_init(prefill, sizeof *prefill));
  OK(kvr_disagg_route_prefill(disagg, tokens, 3 * BS, request, hints, prefill, ERR));
  EXPECT_U64(sizeof *prefill, prefill->struct_size);
  EXPECT_U64(1, prefill->remote);
  EXPECT_U64(KVR_PREFILL_REMOTE, prefill->reason);
  EXPECT_U64(11, prefill->worker_id);
  EXPECT(prefill->bootstrap_room >= 0);
  OK(kvr_disagg_prefill_worker_busy(disagg, tokens, 3 * BS, request, 1.0, &busy, ERR));
  EXPECT_U64(0, busy);
  OK(kvr_route_signals_init(decode, sizeof *decode));
  OK(kvr_disagg_route_decode(disagg, tokens, 3 * BS, request, hints, 1, decode, ERR));
  EXPECT_U64(21, decode->worker_id);
  EXPECT_U64(1, decode->booked);
  EXPECT_U64(1000, decode->total_kv_blocks);
  EXPECT_U64(3 * BS, decode->prompt_tokens);
  OK(kvr_router_free_request(kvr_disagg_prefill_router(disagg), "abi-disagg", ERR));
  OK(kvr_router_free_request(kvr_disagg_decode_router(disagg), "abi-disagg", ERR));

  /* No prefill worker: aggregated on decode, and the result's fields say so. */
  if (OK(kvr_disagg_new(prefill_options, decode_options, options, &no_prefill_pool, ERR))) {
    prefill->bootstrap_room = 77; /* the call must write it */
    OK(kvr_disagg_route_prefill(no_prefill_pool, tokens, 3 * BS, request, hints, prefill, ERR));
    EXPECT_U64(0, prefill->remote);
    EXPECT_U64(KVR_PREFILL_NO_PREFILL_WORKERS, prefill->reason);
    EXPECT_U64(-1, prefill->bootstrap_room);
  }
  kvr_disagg_free(no_prefill_pool);
  kvr_disagg_free(disagg);
}

/* Ingest: options, an engine worker whose endpoint need not exist (ZMQ connects in the
 * background; nothing listens on port 1), and a native stream over a Unix socket whose one
 * stored event reaches the router and the stats. */
static void ingest_options_engine_worker_and_stats(void) {
  kvr_router* router = new_router();
  kvr_ingest_options* options = NEW(kvr_ingest_options);
  kvr_engine_worker* engine = NEW(kvr_engine_worker);
  kvr_ingest_stats* stats = NEW(kvr_ingest_stats);
  kvr_request_options* request = NEW(kvr_request_options);
  kvr_route_result* result = NEW(kvr_route_result);
  kvr_ingest* ingest = NULL;
  kvr_publisher* publisher = NULL;
  kvr_event_batch* batch = NULL;
  uint64_t engine_source = 0;
  uint64_t stream_source = 0;
  uint32_t tokens[3 * BS];
  char dir[] = "/tmp/kvr-abi-XXXXXX";
  char endpoint[80];
  char socket_path[64];
  const int made_dir = mkdtemp(dir) != NULL;
  int waited_ms;
  fill_tokens(tokens, 3 * BS, 6000);
  add_worker(router, 9, 1, 0);

  OK(kvr_ingest_options_init(options, sizeof *options));
  options->replay_timeout_ms = 1500;
  if (!OK(kvr_ingest_new(router, options, &ingest, ERR))) return;
  OK(kvr_engine_worker_init(engine, sizeof *engine));
  engine->endpoint = "tcp://127.0.0.1:1";
  engine->worker_id = 8;
  engine->topic = "kv";
  OK(kvr_ingest_add_engine_worker(ingest, engine, &engine_source, ERR));
  OK(kvr_ingest_stats_init(stats, sizeof *stats));
  stats->messages = 99; /* the call must write it */
  OK(kvr_ingest_get_stats(ingest, engine_source, stats, ERR));
  EXPECT_U64(sizeof *stats, stats->struct_size);
  EXPECT_U64(0, stats->messages);

  if (!made_dir) {
    abi_fail(__FILE__, __LINE__, "mkdtemp failed");
  } else {
    snprintf(socket_path, sizeof socket_path, "%s/events.sock", dir);
    snprintf(endpoint, sizeof endpoint, "unix://%s", socket_path);
    OK(kvr_ingest_listen(ingest, endpoint, &stream_source, NULL, 0, NULL, ERR));
    OK(kvr_ingest_start(ingest, ERR));
    OK(kvr_event_batch_new(&batch, ERR));
    OK(kvr_event_batch_add_stored(batch, stored_event(9, tokens, 2, 601), ERR));
    if (OK(kvr_publisher_connect(endpoint, &publisher, ERR))) {
      OK(kvr_publisher_send(publisher, batch, ERR));
    }
    /* The loop thread applies it: wait for the counter (20 s at most, for sanitizers). */
    for (waited_ms = 0; waited_ms < 20000; waited_ms += 10) {
      const struct timespec ten_ms = {0, 10 * 1000 * 1000};
      OK(kvr_ingest_get_stats(ingest, stream_source, stats, ERR));
      if (stats->events_applied >= 1) break;
      nanosleep(&ten_ms, NULL);
    }
    EXPECT_U64(1, stats->messages);
    EXPECT_U64(1, stats->events_applied);
    EXPECT_U64(1, stats->connections);
    OK(kvr_ingest_get_stats(ingest, 0, stats, ERR));
    EXPECT(stats->messages >= 1 && stats->events_applied >= 1);

    OK(kvr_request_options_init(request, sizeof *request));
    OK(kvr_route_result_init(result, sizeof *result));
    OK(kvr_find_best_match(router, tokens, 3 * BS, request, result, NULL, 0, NULL, ERR));
    EXPECT_U64(9, result->worker_id);
    EXPECT_U64(2, result->device_overlap_blocks);
    kvr_publisher_free(publisher);
    kvr_event_batch_free(batch);
  }
  OK(kvr_ingest_remove_engine_worker(ingest, 8, 1, ERR));
  OK(kvr_ingest_stop(ingest, ERR));
  kvr_ingest_free(ingest);
  kvr_router_free(router);
  if (made_dir) {
    unlink(socket_path);
    rmdir(dir);
  }
}

/* ---- The header being edited: each versioned struct ends on its last field -------------------
 * Only for the live include/kvrouter.h (KVR_ABI_LIVE_HEADER): a frozen header never changes.
 * Fields are only ever appended and a struct's size must name one layout, so no struct may end
 * in padding: a u32 appended after a u32 that ended on an 8-byte boundary would otherwise
 * leave sizeof unchanged, and the library could not tell the two layouts apart. When you
 * append a field, name it here; the check fails until you do. */
#ifdef KVR_ABI_LIVE_HEADER
#define KVR_ABI_LAST_FIELDS(X)                 \
  X(kvr_hash_options, mm_num_blocks)           \
  X(kvr_router_options, ttft_miss_weight)      \
  X(kvr_worker_config, max_num_batched_tokens) \
  X(kvr_stored_event, reserved1)               \
  X(kvr_removed_event, reserved1)              \
  X(kvr_request_options, num_local_hashes)     \
  X(kvr_route_result, queued)                  \
  X(kvr_metrics, index_sliding_blocks)         \
  X(kvr_routing_hints, session_ttl_seconds)    \
  X(kvr_route_signals, reserved)               \
  X(kvr_disagg_options, decode_busy_threshold) \
  X(kvr_prefill_result, cached_tokens)         \
  X(kvr_ingest_options, replica_timeout_ms)    \
  X(kvr_jetstream_source, max_bytes)           \
  X(kvr_engine_worker, replay_endpoint)        \
  X(kvr_ingest_stats, bookings_trimmed)        \
  X(kvr_candidate, reserved)                   \
  X(kvr_overlap, reserved)                     \
  X(kvr_potential_load, reserved)

static void versioned_structs_end_without_padding(void) {
#define KVR_ABI_CHECK_END_(T, last)                                                      \
  if (sizeof(T) != offsetof(T, last) + sizeof(((T*)0)->last)) {                          \
    abi_fail(__FILE__, __LINE__,                                                         \
             "%s is %zu bytes but its field %s ends at %zu: name its new last field in " \
             "KVR_ABI_LAST_FIELDS, and pad it so that the struct ends on it",            \
             #T, sizeof(T), #last, offsetof(T, last) + sizeof(((T*)0)->last));           \
  }
  KVR_ABI_LAST_FIELDS(KVR_ABI_CHECK_END_)
#undef KVR_ABI_CHECK_END_
}
#endif

/* ---- Running ------------------------------------------------------------------------------- */

typedef struct abi_case {
  const char* name;
  void (*run)(void);
  int applies;        /* to this header's layouts */
  const char* unless; /* why not, when it does not */
} abi_case;

static const abi_case kCases[] = {
#define KVR_ABI_INIT_ENTRY_(T) {"init." #T, case_init_##T, 1, NULL},
    KVR_ABI_STRUCTS(KVR_ABI_INIT_ENTRY_) KVR_ABI_STRUCTS_SINCE_0_2(KVR_ABI_INIT_ENTRY_)
#undef KVR_ABI_INIT_ENTRY_
        {"router_options_104_bytes_not_overrun", router_options_104_bytes_not_overrun,
         sizeof(kvr_router_options) == 104, "this header's kvr_router_options is not 104 bytes"},
    {"metrics_200_bytes_not_overrun", metrics_200_bytes_not_overrun, sizeof(kvr_metrics) == 200,
     "this header's kvr_metrics is not 200 bytes"},
    {"block_hashes_with_hash_options", block_hashes_with_hash_options, 1, NULL},
    {"route_after_stored_and_removed_events", route_after_stored_and_removed_events, 1, NULL},
    {"missing_fields_take_the_library_defaults", missing_fields_take_the_library_defaults, 1, NULL},
    {"event_batch_of_stored_and_removed", event_batch_of_stored_and_removed, 1, NULL},
    {"preview_plan_commit_with_hints", preview_plan_commit_with_hints, 1, NULL},
    {"disagg_prefill_and_decode", disagg_prefill_and_decode, 1, NULL},
    {"ingest_options_engine_worker_and_stats", ingest_options_engine_worker_and_stats, 1, NULL},
#ifdef KVR_ABI_LIVE_HEADER
    {"versioned_structs_end_without_padding", versioned_structs_end_without_padding, 1, NULL},
#endif
};
enum { NUM_CASES = sizeof kCases / sizeof kCases[0] };

static int selected(const char* name, int argc, char** argv, int first_name) {
  int i;
  if (first_name >= argc) return 1;
  for (i = first_name; i < argc; ++i) {
    if (strcmp(argv[i], name) == 0) return 1;
  }
  return 0;
}

int main(int argc, char** argv) {
  static const char* const kPassNames[] = {"exact", "guards"}; /* by g_guarded */
  int passes[2] = {1, 0}; /* guards first: it names the call that overran */
  int num_passes = 2;
  int first_name = 1;
  int failed = 0, passed = 0, skipped = 0;
  int p;
  size_t c;
  setvbuf(stdout, NULL, _IOLBF, 0); /* every line out before a sanitizer aborts the run */
  if (argc > 2 && strcmp(argv[1], "--pass") == 0) {
    num_passes = 1;
    passes[0] = strcmp(argv[2], "exact") == 0 ? 0 : 1;
    first_name = 3;
  }
  printf("abi caller: header %s (%s, %s), library %s\n", KVR_ABI_HEADER, KVR_VERSION_STRING,
         KVR_ABI_HAS_COST_KNOBS ? "with the cost knobs" : "before the cost knobs",
         kvr_version_string());
  for (p = 0; p < num_passes; ++p) {
    g_guarded = passes[p];
    for (c = 0; c < NUM_CASES; ++c) {
      const abi_case* k = &kCases[c];
      if (!selected(k->name, argc, argv, first_name)) continue;
      if (!k->applies) {
        if (p == 0) printf("skip %s: %s\n", k->name, k->unless);
        skipped += p == 0;
        continue;
      }
      g_failures = 0;
      k->run();
      abi_free_all();
      printf("%s %s [%s]\n", g_failures == 0 ? "ok" : "FAIL", k->name, kPassNames[g_guarded]);
      fflush(stdout);
      if (g_failures == 0) {
        ++passed;
      } else {
        ++failed;
      }
    }
  }
  printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  return failed == 0 && passed > 0 ? 0 : 1;
}
