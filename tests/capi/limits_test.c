/* The C ABI's documented limits, each checked before anything is allocated, copied or hashed
 * (issue 19): dp_size, token counts against block counts and output buffers, struct sizes past
 * anything a header has, engine endpoints; and the message for an allowed set naming only
 * unknown workers. Several calls pass counts far beyond the buffers given: a library that read
 * or allocated by them would crash or run out of memory here. */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>

#include "test_util.h"

#define BS 16

static void dp_size_is_bounded(void** state) {
  kvr_router* router = kvt_router_new(BS, 0);
  kvr_worker_config config;
  (void)state;
  kvr_worker_config_init(&config, sizeof config);
  config.worker_id = 1;
  config.dp_size = UINT32_MAX; /* reserved 64 GiB before it was refused */
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "at most 1024 ranks",
                          kvr_router_add_worker(router, &config, ERRP));
  config.dp_size = 1025;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_add_worker(router, &config, ERRP));
  config.dp_size = 1024;
  KVT_OK(kvr_router_add_worker(router, &config, ERRP));
  config.dp_size = 1u << 24;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_update_worker(router, &config, ERRP));
  kvr_router_free(router);
}

static void more_tokens_than_blocks_take_is_refused_before_copying(void** state) {
  kvr_router* router = kvt_router_new(BS, 0);
  uint32_t tokens[2 * BS + 1];
  uint64_t engine[2] = {100, 101};
  kvr_stored_event event;
  kvr_metrics metrics;
  (void)state;
  kvt_fill_tokens(tokens, 2 * BS + 1, 1);
  kvr_stored_event_init(&event, sizeof event);
  event.worker_id = 1;
  event.block_hashes = engine;
  event.num_blocks = 1;
  event.token_ids = tokens;
  event.num_tokens = (size_t)1 << 31; /* far past the buffer: must not be read */
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "take at most 16",
                          kvr_router_apply_stored(router, &event, ERRP));
  event.num_tokens = BS + 1; /* one too many */
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_stored(router, &event, ERRP));
  metrics = kvt_metrics(router);
  assert_int_equal(0, metrics.index_blocks); /* nothing applied */
  /* With eagle, one look-ahead token more is the event's own. */
  event.flags = KVR_STORED_EAGLE;
  KVT_OK(kvr_router_apply_stored(router, &event, ERRP));
  /* Fewer tokens are as before: the complete blocks apply, the event is reported. */
  event.flags = 0;
  event.num_blocks = 2;
  event.num_tokens = BS + 5;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_stored(router, &event, ERRP));
  kvr_router_free(router);
}

static void a_short_hash_buffer_is_refused_before_hashing(void** state) {
  uint32_t tokens[BS];
  uint64_t out[1];
  size_t len = 0;
  (void)state;
  kvt_fill_tokens(tokens, BS, 1);
  /* 2^31 tokens claimed, 16 given: hashing them would read far past the buffer. */
  KVT_EXPECT_FAILS_SAYING(
      KVR_BUFFER_TOO_SMALL, "needs 134217728 entries",
      kvr_compute_block_hashes(tokens, (size_t)1 << 31, BS, NULL, out, 1, &len, ERRP));
  assert_int_equal((size_t)1 << 27, len);
  KVT_OK(kvr_compute_block_hashes(tokens, BS, BS, NULL, out, 1, &len, ERRP));
  assert_int_equal(1, len);
}

/* A struct_size far past any header's is refused without reading past the library's struct:
 * the struct here is exactly as large as this header's (a read past it is an overflow). */
static void a_huge_struct_size_is_refused_without_reading_past_the_struct(void** state) {
  kvr_router_options* options = (kvr_router_options*)malloc(sizeof *options);
  kvr_router* router = NULL;
  (void)state;
  assert_non_null(options);
  kvr_router_options_init(options, sizeof *options);
  options->struct_size = 1u << 20;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "struct_size is 1048576",
                          kvr_router_new(options, &router, ERRP));
  assert_null(router);
  free(options);
}

/* Counts no buffer can hold: their bytes would pass PTRDIFF_MAX, so the end pointer wraps. A
 * library that formed it took the wrapped (short) range for the whole and applied a one-block
 * event as 2^61 + 1 blocks, answering KVR_OK. */
static void counts_past_any_buffer_are_refused(void** state) {
  kvr_router* router = kvt_router_new(BS, 0);
  uint64_t engine[1] = {100};
  uint64_t local[1] = {7};
  kvr_stored_event stored;
  kvr_removed_event removed;
  (void)state;
  kvr_stored_event_init(&stored, sizeof stored);
  stored.worker_id = 1;
  stored.block_hashes = engine;
  stored.local_hashes = local;
  stored.num_blocks = ((size_t)1 << 61) + 1;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "more than any buffer holds",
                          kvr_router_apply_stored(router, &stored, ERRP));
  stored.num_blocks = SIZE_MAX;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_stored(router, &stored, ERRP));
  assert_int_equal(0, kvt_metrics(router).index_blocks);
  kvr_removed_event_init(&removed, sizeof removed);
  removed.worker_id = 1;
  removed.block_hashes = engine;
  removed.num_blocks = ((size_t)1 << 61) + 1;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "more than any buffer holds",
                          kvr_router_apply_removed(router, &removed, ERRP));
  kvr_router_free(router);
}

/* Multimodal counts that add up past any buffer (here to 2^64 + 1: the position wraps to the
 * first hash) are refused before any hash is read. */
static void multimodal_counts_that_wrap_are_refused(void** state) {
  uint32_t tokens[2 * BS];
  const uint64_t mm[2] = {1, 2};
  const size_t counts[2] = {SIZE_MAX, 2};
  uint64_t out[2];
  size_t len = 777;
  kvr_hash_options options;
  (void)state;
  kvt_fill_tokens(tokens, 2 * BS, 1);
  kvr_hash_options_init(&options, sizeof options);
  options.mm_hashes = mm;
  options.mm_counts = counts;
  options.mm_num_blocks = 2;
  KVT_EXPECT_FAILS_SAYING(
      KVR_INVALID_ARGUMENT, "mm_counts add up past any buffer",
      kvr_compute_block_hashes(tokens, 2 * BS, BS, &options, out, 2, &len, ERRP));
  assert_int_equal(777, len); /* an out parameter is not written on a failure */
  /* Nor when the hashes are missing. */
  options.mm_hashes = NULL;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_compute_block_hashes(tokens, 2 * BS, BS, &options, out, 2, &len, ERRP));
  assert_int_equal(777, len);
}

/* A short buffer for sequence hashes is refused before anything is hashed: here 2^40 hashes
 * are claimed and 4 given (hashing first would allocate 8 TiB or read past the input). */
static void a_short_sequence_hash_buffer_is_refused_before_hashing(void** state) {
  const uint64_t local[4] = {1, 2, 3, 4};
  uint64_t out[2];
  size_t len = 0;
  (void)state;
  KVT_EXPECT_FAILS_SAYING(KVR_BUFFER_TOO_SMALL, "sequence hashes",
                          kvr_compute_sequence_hashes(local, (size_t)1 << 40, out, 2, &len, ERRP));
  assert_int_equal((size_t)1 << 40, len);
  KVT_OK(kvr_compute_sequence_hashes(local, 2, out, 2, &len, ERRP));
  assert_int_equal(2, len);
}

/* Time set by hand stays within +-2^62 ns of the clock's origin: deadlines computed from it
 * (up to 2^62 ns ahead) must not overflow. Before, INT64_MIN as the first time, or INT64_MAX
 * after 0, overflowed a signed addition (undefined behaviour; in practice time went negative)
 * and was answered KVR_OK. */
static void a_time_past_the_clock_range_is_refused(void** state) {
  kvr_router* router = kvt_router_new(BS, 0);
  (void)state;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "2^62",
                          kvr_router_set_time(router, INT64_MIN, ERRP));
  KVT_OK(kvr_router_set_time(router, 0, ERRP));
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "2^62",
                          kvr_router_set_time(router, INT64_MAX, ERRP));
  /* Still driven from the last time accepted: an hour later is fine, an earlier time is not. */
  KVT_OK(kvr_router_set_time(router, 3600 * (int64_t)1000000000, ERRP));
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "earlier than the last time set",
                          kvr_router_set_time(router, 1, ERRP));
  kvr_router_free(router);
}

static void an_allowed_set_of_unknown_workers_says_so(void** state) {
  kvr_router* router = kvt_router_new(BS, 0);
  uint32_t tokens[2 * BS];
  const uint64_t unknown[1] = {999};
  kvr_request_options opts;
  kvr_route_result result;
  (void)state;
  kvt_add_worker(router, 1);
  kvt_fill_tokens(tokens, 2 * BS, 1);
  kvr_request_options_init(&opts, sizeof opts);
  opts.allowed_worker_ids = unknown;
  opts.num_allowed_worker_ids = 1;
  kvr_route_result_init(&result, sizeof result);
  KVT_EXPECT_FAILS_SAYING(
      KVR_UNAVAILABLE, "none of the allowed workers is registered",
      kvr_find_best_match(router, tokens, 2 * BS, &opts, &result, NULL, 0, NULL, ERRP));
  kvr_router_free(router);
}

/* The reserved fields of every input struct must be 0 (as _init leaves them): a later release
 * may give them a meaning, and a caller's garbage there would then be misread. They were
 * ignored. */
static void reserved_input_fields_must_be_zero(void** state) {
  kvr_router* router = kvt_router_new(BS, 0);
  kvr_router* refused = NULL;
  kvr_disagg* disagg = NULL;
  kvr_ingest* ingest = NULL;
  uint32_t tokens[BS];
  const uint64_t blocks[1] = {7};
  kvr_router_options router_options;
  kvr_request_options request;
  kvr_routing_hints hints;
  kvr_route_signals signals;
  kvr_removed_event removed;
  kvr_disagg_options disagg_options;
  kvr_ingest_options ingest_options;
  (void)state;
  kvt_add_worker(router, 1);
  kvt_fill_tokens(tokens, BS, 1);
  kvr_route_signals_init(&signals, sizeof signals);

  kvr_router_options_init(&router_options, sizeof router_options);
  router_options.block_size = BS;
  router_options.reserved2 = 1;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "kvr_router_options.reserved2 is reserved",
                          kvr_router_new(&router_options, &refused, ERRP));
  assert_null(refused);

  kvr_request_options_init(&request, sizeof request);
  kvr_routing_hints_init(&hints, sizeof hints);
  KVT_OK(kvr_preview_route(router, tokens, BS, &request, &hints, &signals, ERRP));
  request.reserved = 1;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "kvr_request_options.reserved is reserved",
                          kvr_preview_route(router, tokens, BS, &request, &hints, &signals, ERRP));
  request.reserved = 0;
  hints.reserved = 1;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "kvr_routing_hints.reserved is reserved",
                          kvr_preview_route(router, tokens, BS, &request, &hints, &signals, ERRP));

  kvr_removed_event_init(&removed, sizeof removed);
  removed.worker_id = 1;
  removed.block_hashes = blocks;
  removed.num_blocks = 1;
  removed.reserved = 1;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "kvr_removed_event.reserved is reserved",
                          kvr_router_apply_removed(router, &removed, ERRP));

  kvr_disagg_options_init(&disagg_options, sizeof disagg_options);
  disagg_options.reserved = 1;
  router_options.reserved2 = 0;
  KVT_EXPECT_FAILS_SAYING(
      KVR_INVALID_ARGUMENT, "kvr_disagg_options.reserved is reserved",
      kvr_disagg_new(&router_options, &router_options, &disagg_options, &disagg, ERRP));
  assert_null(disagg);

  kvr_ingest_options_init(&ingest_options, sizeof ingest_options);
  ingest_options.reserved = 1;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "kvr_ingest_options.reserved is reserved",
                          kvr_ingest_new(router, &ingest_options, &ingest, ERRP));
  assert_null(ingest);
  kvr_router_free(router);
}

/* A queue timeout below -1 (never) was "never" too, and a NaN decode-busy threshold "the signal
 * is unavailable": neither is a value the header names. */
static void values_outside_their_documented_range_are_refused(void** state) {
  kvr_router* router = kvt_router_new(BS, 0);
  kvr_disagg* disagg = NULL;
  uint32_t tokens[BS];
  kvr_router_options pool;
  kvr_request_options request;
  kvr_disagg_options disagg_options;
  kvr_route_result result;
  (void)state;
  kvt_add_worker(router, 1);
  kvt_fill_tokens(tokens, BS, 1);
  kvr_request_options_init(&request, sizeof request);
  kvr_route_result_init(&result, sizeof result);
  request.queue_timeout_ms = -2;
  KVT_EXPECT_FAILS_SAYING(
      KVR_INVALID_ARGUMENT, "queue_timeout_ms is -2",
      kvr_find_best_match(router, tokens, BS, &request, &result, NULL, 0, NULL, ERRP));
  request.queue_timeout_ms = -1;
  KVT_OK(kvr_find_best_match(router, tokens, BS, &request, &result, NULL, 0, NULL, ERRP));

  kvr_router_options_init(&pool, sizeof pool);
  pool.block_size = BS;
  kvr_disagg_options_init(&disagg_options, sizeof disagg_options);
  disagg_options.decode_busy_threshold = NAN;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "decode_busy_threshold is NaN",
                          kvr_disagg_new(&pool, &pool, &disagg_options, &disagg, ERRP));
  assert_null(disagg);
  disagg_options.decode_busy_threshold = -1;
  KVT_OK(kvr_disagg_new(&pool, &pool, &disagg_options, &disagg, ERRP));
  kvr_disagg_free(disagg);
  kvr_router_free(router);
}

/* Issue 19: port 99999 and a replay endpoint "garbage" were accepted. */
static void engine_endpoints_ports_and_ranks_are_checked(void** state) {
  kvr_router* router = kvt_router_new(BS, 0);
  kvr_ingest* ingest = NULL;
  kvr_engine_worker worker;
  (void)state;
  kvr_engine_worker_init(&worker, sizeof worker);
  worker.worker_id = 3;
  worker.endpoint = "tcp://127.0.0.1:99999";
  if (kvr_ingest_new(router, NULL, &ingest, NULL) != KVR_OK ||
      kvr_ingest_add_engine_worker(ingest, &worker, NULL, NULL) == KVR_UNIMPLEMENTED) {
    kvr_ingest_free(ingest); /* a build without ZMQ */
    kvr_router_free(router);
    skip();
  }
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "port in 1..65535",
                          kvr_ingest_add_engine_worker(ingest, &worker, NULL, ERRP));
  worker.endpoint = "tcp://127.0.0.1:65535";
  worker.dp_size = 2; /* rank 1 would be on port 65536 */
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "past 65535",
                          kvr_ingest_add_engine_worker(ingest, &worker, NULL, ERRP));
  worker.endpoint = "tcp://127.0.0.1:5557";
  worker.dp_size = 257;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "1..256",
                          kvr_ingest_add_engine_worker(ingest, &worker, NULL, ERRP));
  worker.dp_size = 1;
  worker.replay_endpoint = "garbage";
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "replay_endpoint 'garbage'",
                          kvr_ingest_add_engine_worker(ingest, &worker, NULL, ERRP));
  worker.replay_endpoint = "tcp://127.0.0.1:5558";
  KVT_OK(kvr_ingest_add_engine_worker(ingest, &worker, NULL, ERRP));
  kvr_ingest_free(ingest);
  kvr_router_free(router);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(dp_size_is_bounded),
      cmocka_unit_test(more_tokens_than_blocks_take_is_refused_before_copying),
      cmocka_unit_test(a_short_hash_buffer_is_refused_before_hashing),
      cmocka_unit_test(a_huge_struct_size_is_refused_without_reading_past_the_struct),
      cmocka_unit_test(counts_past_any_buffer_are_refused),
      cmocka_unit_test(multimodal_counts_that_wrap_are_refused),
      cmocka_unit_test(a_short_sequence_hash_buffer_is_refused_before_hashing),
      cmocka_unit_test(a_time_past_the_clock_range_is_refused),
      cmocka_unit_test(an_allowed_set_of_unknown_workers_says_so),
      cmocka_unit_test(engine_endpoints_ports_and_ranks_are_checked),
      cmocka_unit_test(reserved_input_fields_must_be_zero),
      cmocka_unit_test(values_outside_their_documented_range_are_refused),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
