/* Helpers shared by the cmocka suites of the C ABI. Every test links only libkvrouter.so and
 * sees nothing but include/kvrouter.h. Include after <setjmp.h>, <stdarg.h>, <stddef.h> and
 * <cmocka.h>. */
#ifndef KVR_TESTS_CAPI_TEST_UTIL_H
#define KVR_TESTS_CAPI_TEST_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"

/* Asserts that `err` holds a well-formed error object with status `want` and a non-empty
 * message, then frees it and resets the pointer. */
static inline void kvt_expect_error_(kvr_error** err, kvr_status want, const char* file, int line) {
  const char* message;
  if (*err == NULL) {
    fprintf(stderr, "%s:%d: expected an error object with status %s, got none\n", file, line,
            kvr_status_str(want));
  }
  assert_non_null(*err);
  assert_int_equal(want, kvr_error_status(*err));
  message = kvr_error_message(*err);
  assert_non_null(message);
  assert_true(strlen(message) > 0);
  kvr_error_free(*err);
  *err = NULL;
}
#define kvt_expect_error(err, want) kvt_expect_error_((err), (want), __FILE__, __LINE__)

/* `call` is evaluated twice: first with the identifier ERRP == NULL (the caller wants no
 * details), then with ERRP pointing at a NULL kvr_error* (it must then receive an error object
 * with the same status). Both must return `want`. */
#define KVT_EXPECT_FAILS(want, call)     \
  do {                                   \
    kvr_error* kvt_err_ = NULL;          \
    kvr_error** ERRP = NULL;             \
    assert_int_equal((want), (call));    \
    ERRP = &kvt_err_;                    \
    assert_int_equal((want), (call));    \
    kvt_expect_error(&kvt_err_, (want)); \
  } while (0)

/* As KVT_EXPECT_FAILS, and the error's message contains `text`. */
#define KVT_EXPECT_FAILS_SAYING(want, text, call)                                            \
  do {                                                                                       \
    kvr_error* kvt_err_ = NULL;                                                              \
    kvr_error** ERRP = &kvt_err_;                                                            \
    assert_int_equal((want), (call));                                                        \
    assert_non_null(kvt_err_);                                                               \
    if (strstr(kvr_error_message(kvt_err_), (text)) == NULL) {                               \
      fprintf(stderr, "%s:%d: the message \"%s\" does not say \"%s\"\n", __FILE__, __LINE__, \
              kvr_error_message(kvt_err_), (text));                                          \
    }                                                                                        \
    assert_non_null(strstr(kvr_error_message(kvt_err_), (text)));                            \
    kvr_error_free(kvt_err_);                                                                \
    ERRP = NULL;                                                                             \
    assert_int_equal((want), (call));                                                        \
  } while (0)

/* The size of a struct up to and including `field`: the layout of a caller whose header
 * ended there. */
#define KVT_LAYOUT_END(type, field) (offsetof(type, field) + sizeof(((type*)0)->field))

/* Asserts a call succeeds without producing an error object. */
#define KVT_OK(call)                                                                         \
  do {                                                                                       \
    kvr_error* kvt_ok_err_ = NULL;                                                           \
    kvr_error** ERRP = &kvt_ok_err_;                                                         \
    kvr_status kvt_ok_status_ = (call);                                                      \
    if (kvt_ok_status_ != KVR_OK) {                                                          \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, kvr_status_str(kvt_ok_status_), \
              kvt_ok_err_ ? kvr_error_message(kvt_ok_err_) : "(none)");                      \
    }                                                                                        \
    assert_int_equal(KVR_OK, kvt_ok_status_);                                                \
    assert_null(kvt_ok_err_);                                                                \
    (void)ERRP;                                                                              \
  } while (0)

/* tokens[i] = first + i. */
static inline void kvt_fill_tokens(uint32_t* tokens, size_t n, uint32_t first) {
  size_t i;
  for (i = 0; i < n; ++i) tokens[i] = first + (uint32_t)i;
}

static inline kvr_router* kvt_router_new_opts(const kvr_router_options* opts) {
  kvr_router* router = NULL;
  KVT_OK(kvr_router_new(opts, &router, ERRP));
  assert_non_null(router);
  return router;
}

/* Router options with the given block size and flags, every other setting at its default (the
 * random seed fixed, so tie-breaks are reproducible). */
static inline kvr_router_options kvt_router_options(uint32_t block_size, uint32_t flags) {
  kvr_router_options opts;
  kvr_router_options_init(&opts, sizeof opts);
  opts.block_size = block_size;
  opts.flags = flags;
  opts.random_seed = 42;
  return opts;
}

/* A router with kvt_router_options(block_size, flags). */
static inline kvr_router* kvt_router_new(uint32_t block_size, uint32_t flags) {
  kvr_router_options opts = kvt_router_options(block_size, flags);
  return kvt_router_new_opts(&opts);
}

static inline void kvt_add_worker_full(kvr_router* router, uint64_t worker_id, uint32_t dp_size,
                                       uint64_t max_num_batched_tokens) {
  kvr_worker_config config;
  kvr_worker_config_init(&config, sizeof config);
  config.worker_id = worker_id;
  config.dp_size = dp_size;
  config.max_num_batched_tokens = max_num_batched_tokens;
  KVT_OK(kvr_router_add_worker(router, &config, ERRP));
}

static inline void kvt_add_worker(kvr_router* router, uint64_t worker_id) {
  kvt_add_worker_full(router, worker_id, 1, 0);
}

/* The fixture the suites share: a router, its workers, and a prompt. A suite whose fixture is
 * exactly this says `typedef kvt_fixture fixture;` and uses kvt_teardown; one that needs more
 * (an ingest handle, files) keeps a struct of its own with a kvt_fixture in it, filled by
 * kvt_fixture_init and emptied by kvt_fixture_release. */
typedef struct kvt_fixture {
  kvr_router* router;
  uint32_t* prompt; /* prompt_tokens tokens: first_token, first_token + 1, ... (NULL if none) */
  size_t prompt_tokens;
} kvt_fixture;

/* A router made with `opts`, workers 1..num_workers (one rank each, no batch budget; a suite
 * adds others itself), and the prompt. */
static inline void kvt_fixture_init(kvt_fixture* f, const kvr_router_options* opts,
                                    uint64_t num_workers, size_t prompt_tokens,
                                    uint32_t first_token) {
  uint64_t id;
  memset(f, 0, sizeof *f);
  f->router = kvt_router_new_opts(opts);
  for (id = 1; id <= num_workers; ++id) kvt_add_worker(f->router, id);
  if (prompt_tokens > 0) {
    f->prompt = (uint32_t*)calloc(prompt_tokens, sizeof(uint32_t));
    assert_non_null(f->prompt);
    kvt_fill_tokens(f->prompt, prompt_tokens, first_token);
  }
  f->prompt_tokens = prompt_tokens;
}

static inline void kvt_fixture_release(kvt_fixture* f) {
  kvr_router_free(f->router);
  free(f->prompt);
  memset(f, 0, sizeof *f);
}

/* A fixture on the heap, with a router of kvt_router_options(block_size, flags), for `*state`. */
static inline kvt_fixture* kvt_fixture_new(uint32_t block_size, uint32_t flags,
                                           uint64_t num_workers, size_t prompt_tokens,
                                           uint32_t first_token) {
  kvr_router_options opts = kvt_router_options(block_size, flags);
  kvt_fixture* f = (kvt_fixture*)malloc(sizeof(kvt_fixture));
  assert_non_null(f);
  kvt_fixture_init(f, &opts, num_workers, prompt_tokens, first_token);
  return f;
}

/* The cmocka teardown of a suite whose `*state` is a kvt_fixture from kvt_fixture_new. */
static inline int kvt_teardown(void** state) {
  kvt_fixture* f = (kvt_fixture*)*state;
  kvt_fixture_release(f);
  free(f);
  return 0;
}

/* Applies a device-tier Stored event for `num_blocks` blocks of `tokens` (block_size tokens
 * each) on (worker, rank); engine block hashes are first_hash, first_hash + 1, ... */
static inline kvr_status kvt_store(kvr_router* router, uint64_t worker_id, uint32_t dp_rank,
                                   uint32_t tier, const uint32_t* tokens, size_t num_blocks,
                                   uint32_t block_size, uint64_t first_hash, int has_parent,
                                   uint64_t parent_hash, kvr_error** err) {
  kvr_stored_event event;
  uint64_t* hashes = (uint64_t*)calloc(num_blocks + 1, sizeof(uint64_t));
  kvr_status status;
  size_t i;
  assert_non_null(hashes);
  for (i = 0; i < num_blocks; ++i) hashes[i] = first_hash + i;
  kvr_stored_event_init(&event, sizeof event);
  event.worker_id = worker_id;
  event.dp_rank = dp_rank;
  event.tier = tier;
  event.event_id = first_hash;
  if (has_parent) {
    event.flags |= KVR_STORED_HAS_PARENT;
    event.parent_hash = parent_hash;
  }
  event.block_hashes = hashes;
  event.num_blocks = num_blocks;
  event.token_ids = tokens;
  event.num_tokens = num_blocks * block_size;
  status = kvr_router_apply_stored(router, &event, err);
  free(hashes);
  return status;
}

static inline kvr_metrics kvt_metrics(kvr_router* router) {
  kvr_metrics metrics;
  kvr_metrics_init(&metrics, sizeof metrics);
  KVT_OK(kvr_router_get_metrics(router, &metrics, ERRP));
  return metrics;
}

/* The overlap of (worker, rank) for a prompt: 1 and *out filled if the rank holds its first
 * block, else 0. */
static inline int kvt_overlap_of(kvr_router* router, const uint32_t* tokens, size_t n,
                                 uint64_t worker_id, uint32_t dp_rank, kvr_overlap* out) {
  kvr_overlap scores[32];
  size_t len = 0;
  size_t i;
  KVT_OK(kvr_router_overlap_scores(router, tokens, n, NULL, scores, 32, &len, ERRP));
  assert_true(len <= 32);
  for (i = 0; i < len; ++i) {
    if (scores[i].worker_id == worker_id && scores[i].dp_rank == dp_rank) {
      if (out) *out = scores[i];
      return 1;
    }
  }
  return 0;
}

/* The number of ranks that hold at least the first block of a prompt. */
static inline size_t kvt_overlap_count(kvr_router* router, const uint32_t* tokens, size_t n) {
  kvr_overlap scores[32];
  size_t len = 0;
  KVT_OK(kvr_router_overlap_scores(router, tokens, n, NULL, scores, 32, &len, ERRP));
  return len;
}

/* The potential load of (worker, rank); fails the test if the rank is not listed. */
static inline kvr_potential_load kvt_load_of(kvr_router* router, const uint32_t* tokens, size_t n,
                                             uint64_t worker_id, uint32_t dp_rank) {
  kvr_potential_load loads[32];
  size_t len = 0;
  size_t i;
  memset(loads, 0, sizeof loads);
  KVT_OK(kvr_router_potential_loads(router, tokens, n, NULL, loads, 32, &len, ERRP));
  for (i = 0; i < len; ++i) {
    if (loads[i].worker_id == worker_id && loads[i].dp_rank == dp_rank) return loads[i];
  }
  fail_msg("rank %llu/%u missing from the potential loads", (unsigned long long)worker_id,
           (unsigned)dp_rank);
  return loads[0];
}

/* A request-options struct with KVR_REQUEST_ADMIT and the given id. */
static inline kvr_request_options kvt_admit(const char* request_id) {
  kvr_request_options opts;
  kvr_request_options_init(&opts, sizeof opts);
  opts.flags = KVR_REQUEST_ADMIT;
  opts.request_id = request_id;
  return opts;
}

/* Deterministic pseudo-random bytes (xorshift64*). */
static inline uint64_t kvt_next_random(uint64_t* state) {
  uint64_t x = *state;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *state = x;
  return x * 2685821657736338717ull;
}

static inline void kvt_random_bytes(uint8_t* out, size_t n, uint64_t* state) {
  size_t i;
  for (i = 0; i < n; ++i) out[i] = (uint8_t)(kvt_next_random(state) >> 56);
}

/* Reads a whole file (the build's flatc-compiled test inputs). Caller frees. */
static inline uint8_t* kvt_read_file(const char* path, size_t* size) {
  FILE* f = fopen(path, "rb");
  long n;
  uint8_t* data;
  if (f == NULL) fail_msg("cannot open %s", path);
  assert_int_equal(0, fseek(f, 0, SEEK_END));
  n = ftell(f);
  assert_true(n > 0);
  assert_int_equal(0, fseek(f, 0, SEEK_SET));
  data = (uint8_t*)malloc((size_t)n);
  assert_non_null(data);
  assert_int_equal((size_t)n, fread(data, 1, (size_t)n, f));
  fclose(f);
  *size = (size_t)n;
  return data;
}

/* A batch with one stored event: `num_blocks` blocks of `block_size` tokens from `tokens` on
 * `worker_id`, engine hashes first_hash, first_hash + 1, ... (at most 16 blocks). */
static inline kvr_event_batch* kvt_stored_batch(uint64_t worker_id, const uint32_t* tokens,
                                                size_t num_blocks, uint32_t block_size,
                                                uint64_t first_hash) {
  kvr_event_batch* batch = NULL;
  kvr_stored_event event;
  uint64_t hashes[16];
  size_t i;
  assert_true(num_blocks <= 16);
  for (i = 0; i < num_blocks; ++i) hashes[i] = first_hash + i;
  KVT_OK(kvr_event_batch_new(&batch, ERRP));
  kvr_stored_event_init(&event, sizeof event);
  event.worker_id = worker_id;
  event.event_id = first_hash;
  event.block_hashes = hashes;
  event.num_blocks = num_blocks;
  event.token_ids = tokens;
  event.num_tokens = num_blocks * block_size;
  KVT_OK(kvr_event_batch_add_stored(batch, &event, ERRP));
  return batch;
}

#endif /* KVR_TESTS_CAPI_TEST_UTIL_H */
