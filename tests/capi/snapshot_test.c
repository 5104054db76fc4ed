/* Index snapshots: kvr_router_snapshot (a library-owned kvr_buffer read with kvr_buffer_data /
 * kvr_buffer_size, released with kvr_buffer_free) and kvr_router_restore, including malformed
 * and truncated buffers (rejected with KVR_INVALID_ARGUMENT, nothing applied). The valid
 * IndexSnapshot inputs come from kvr_router_snapshot itself. Also kvr_router_index_digest, by
 * which replicas compare their indexes: equal after a restore, blind to bookings, and fixed for
 * a fixed index. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>

#include "test_util.h"

#define BS 4

typedef struct fixture {
  kvr_router* source; /* known content */
  kvr_buffer* snapshot;
  uint32_t a[8 * BS];
  uint32_t b[4 * BS];
} fixture;

static kvr_router* empty_router(void) {
  kvr_router* router = kvt_router_new(BS, 0);
  kvt_add_worker(router, 1);
  kvt_add_worker(router, 2);
  return router;
}

/* Worker 1 caches prompt a (8 blocks, in two chained events), rank 2/0 caches its first 3
 * blocks on the device and prompt b on the host tier. */
static int setup(void** state) {
  fixture* f = (fixture*)calloc(1, sizeof(fixture));
  if (f == NULL) return -1;
  kvt_fill_tokens(f->a, 8 * BS, 100);
  kvt_fill_tokens(f->b, 4 * BS, 900);
  f->source = empty_router();
  KVT_OK(kvt_store(f->source, 1, 0, KVR_TIER_DEVICE, f->a, 5, BS, 10, 0, 0, ERRP));
  KVT_OK(kvt_store(f->source, 1, 0, KVR_TIER_DEVICE, f->a + 5 * BS, 3, BS, 15, 1, 14, ERRP));
  KVT_OK(kvt_store(f->source, 2, 0, KVR_TIER_DEVICE, f->a, 3, BS, 20, 0, 0, ERRP));
  KVT_OK(kvt_store(f->source, 2, 0, KVR_TIER_HOST_PINNED, f->b, 4, BS, 30, 0, 0, ERRP));
  KVT_OK(kvr_router_snapshot(f->source, &f->snapshot, ERRP));
  assert_non_null(f->snapshot);
  *state = f;
  return 0;
}

static int teardown(void** state) {
  fixture* f = (fixture*)*state;
  kvr_buffer_free(f->snapshot);
  kvr_router_free(f->source);
  free(f);
  return 0;
}

/* Both routers see the same overlaps for prompts a and b. */
static void assert_same_index(kvr_router* x, kvr_router* y, const fixture* f) {
  kvr_overlap ox;
  kvr_overlap oy;
  int has_x;
  int has_y;
  uint64_t worker;
  for (worker = 1; worker <= 2; ++worker) {
    has_x = kvt_overlap_of(x, f->a, 8 * BS, worker, 0, &ox);
    has_y = kvt_overlap_of(y, f->a, 8 * BS, worker, 0, &oy);
    assert_int_equal(has_x, has_y);
    if (has_x) assert_memory_equal(&ox, &oy, sizeof ox);
    has_x = kvt_overlap_of(x, f->b, 4 * BS, worker, 0, &ox);
    has_y = kvt_overlap_of(y, f->b, 4 * BS, worker, 0, &oy);
    assert_int_equal(has_x, has_y);
    if (has_x) assert_memory_equal(&ox, &oy, sizeof ox);
  }
  assert_int_equal(kvt_metrics(x).index_blocks, kvt_metrics(y).index_blocks);
}

/* Nothing was applied: the index is still empty. */
static void assert_empty_index(kvr_router* router, const fixture* f) {
  assert_int_equal(0, kvt_overlap_count(router, f->a, 8 * BS));
  assert_int_equal(0, kvt_overlap_count(router, f->b, 4 * BS));
  assert_int_equal(0, kvt_metrics(router).index_blocks);
}

static void snapshot_and_restore(void** state) {
  fixture* f = (fixture*)*state;
  kvr_router* copy = empty_router();
  kvr_overlap overlap;
  const uint8_t* data = kvr_buffer_data(f->snapshot);
  size_t size = kvr_buffer_size(f->snapshot);
  assert_non_null(data);
  assert_true(size > 8);
  /* FlatBuffers file identifier of an IndexSnapshot. */
  assert_memory_equal("KVIS", data + 4, 4);
  /* The data pointer is stable for the buffer's life. */
  assert_ptr_equal(data, kvr_buffer_data(f->snapshot));

  KVT_OK(kvr_router_restore(copy, data, size, ERRP));
  assert_same_index(f->source, copy, f);
  assert_true(kvt_overlap_of(copy, f->a, 8 * BS, 1, 0, &overlap));
  assert_int_equal(8, overlap.device_blocks);
  assert_true(kvt_overlap_of(copy, f->b, 4 * BS, 2, 0, &overlap));
  assert_int_equal(4, overlap.host_blocks);
  assert_int_equal(15, kvt_metrics(copy).index_blocks);

  /* The restored index keeps working: engine hashes still find parents and removals. */
  {
    uint64_t hashes[1] = {17};
    kvr_removed_event removed;
    kvr_removed_event_init(&removed, sizeof removed);
    removed.worker_id = 1;
    removed.block_hashes = hashes;
    removed.num_blocks = 1;
    KVT_OK(kvr_router_apply_removed(copy, &removed, ERRP));
    assert_true(kvt_overlap_of(copy, f->a, 8 * BS, 1, 0, &overlap));
    assert_int_equal(7, overlap.device_blocks);
  }
  kvr_router_free(copy);
}

static void snapshot_of_empty_router_restores_to_empty(void** state) {
  fixture* f = (fixture*)*state;
  kvr_router* empty = empty_router();
  kvr_router* copy = empty_router();
  kvr_buffer* buffer = NULL;
  KVT_OK(kvr_router_snapshot(empty, &buffer, ERRP));
  assert_non_null(buffer);
  assert_true(kvr_buffer_size(buffer) > 0);
  KVT_OK(kvr_router_restore(copy, kvr_buffer_data(buffer), kvr_buffer_size(buffer), ERRP));
  assert_empty_index(copy, f);
  kvr_buffer_free(buffer);
  kvr_router_free(empty);
  kvr_router_free(copy);
}

static void restore_buffer_is_borrowed(void** state) {
  fixture* f = (fixture*)*state;
  kvr_router* copy = empty_router();
  size_t size = kvr_buffer_size(f->snapshot);
  uint8_t* mine = (uint8_t*)malloc(size);
  assert_non_null(mine);
  memcpy(mine, kvr_buffer_data(f->snapshot), size);
  KVT_OK(kvr_router_restore(copy, mine, size, ERRP));
  /* The router copied what it keeps: scribbling on (and freeing) the input changes nothing. */
  memset(mine, 0xFF, size);
  free(mine);
  assert_same_index(f->source, copy, f);
  kvr_router_free(copy);
}

static void restore_into_non_empty_index(void** state) {
  fixture* f = (fixture*)*state;
  kvr_router* busy = empty_router();
  KVT_OK(kvt_store(busy, 1, 0, KVR_TIER_DEVICE, f->b, 1, BS, 5, 0, 0, ERRP));
  KVT_EXPECT_FAILS(KVR_FAILED_PRECONDITION, kvr_router_restore(busy, kvr_buffer_data(f->snapshot),
                                                               kvr_buffer_size(f->snapshot), ERRP));
  assert_int_equal(1, kvt_metrics(busy).index_blocks);
  assert_int_equal(0, kvt_overlap_count(busy, f->a, 8 * BS));
  kvr_router_free(busy);
}

static void restore_other_block_size(void** state) {
  fixture* f = (fixture*)*state;
  kvr_router* other = kvt_router_new(2 * BS, 0);
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_restore(other, kvr_buffer_data(f->snapshot),
                                                            kvr_buffer_size(f->snapshot), ERRP));
  assert_int_equal(0, kvt_metrics(other).index_blocks);
  kvr_router_free(other);
}

static void restore_every_truncation(void** state) {
  fixture* f = (fixture*)*state;
  kvr_router* copy = empty_router();
  const uint8_t* data = kvr_buffer_data(f->snapshot);
  size_t size = kvr_buffer_size(f->snapshot);
  size_t n;
  for (n = 0; n < size; ++n) {
    /* A heap copy of exactly n bytes, so that AddressSanitizer catches any read past it. */
    uint8_t* cut = (uint8_t*)malloc(n > 0 ? n : 1);
    kvr_error* err = NULL;
    kvr_status status;
    assert_non_null(cut);
    memcpy(cut, data, n);
    status = kvr_router_restore(copy, cut, n, n % 2 ? &err : NULL);
    if (status != KVR_INVALID_ARGUMENT) {
      fail_msg("truncation to %zu of %zu bytes: %s", n, size, kvr_status_str(status));
    }
    if (n % 2) kvt_expect_error(&err, KVR_INVALID_ARGUMENT);
    free(cut);
  }
  assert_empty_index(copy, f);
  /* After all that the full buffer still restores. */
  KVT_OK(kvr_router_restore(copy, data, size, ERRP));
  assert_same_index(f->source, copy, f);
  kvr_router_free(copy);
}

static void restore_malformed(void** state) {
  fixture* f = (fixture*)*state;
  kvr_router* copy = empty_router();
  const uint8_t* data = kvr_buffer_data(f->snapshot);
  size_t size = kvr_buffer_size(f->snapshot);
  uint8_t noise[512];
  uint64_t seed = 0x9E3779B97F4A7C15ull;
  int round;
  uint8_t byte = 0;

  /* Empty, NULL. */
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_restore(copy, &byte, 0, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_restore(copy, NULL, 0, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_restore(copy, NULL, size, ERRP));

  /* Random bytes, with and without the right file identifier. */
  for (round = 0; round < 200; ++round) {
    size_t n = 1 + (size_t)(kvt_next_random(&seed) % sizeof noise);
    kvt_random_bytes(noise, n, &seed);
    if (round % 2 && n >= 8) memcpy(noise + 4, "KVIS", 4);
    assert_int_equal(KVR_INVALID_ARGUMENT, kvr_router_restore(copy, noise, n, NULL));
  }
  /* An event batch is not a snapshot. */
  memcpy(noise, data, size < sizeof noise ? size : sizeof noise);
  if (size <= sizeof noise) {
    memcpy(noise + 4, "KVEB", 4);
    assert_int_equal(KVR_INVALID_ARGUMENT, kvr_router_restore(copy, noise, size, NULL));
  }
  assert_empty_index(copy, f);
  kvr_router_free(copy);
}

static void restore_flipped_bytes_never_crash(void** state) {
  fixture* f = (fixture*)*state;
  const uint8_t* data = kvr_buffer_data(f->snapshot);
  size_t size = kvr_buffer_size(f->snapshot);
  uint8_t* copy_bytes = (uint8_t*)malloc(size);
  size_t i;
  assert_non_null(copy_bytes);
  /* Each byte inverted in turn: the buffer may still verify (an inverted token id is just
   * another valid snapshot) or not; either way the call returns a documented status and
   * never crashes, reads out of bounds or fails internally. A buffer refused by the verifier
   * changes nothing. */
  for (i = 0; i < size; ++i) {
    kvr_router* copy = empty_router();
    kvr_status status;
    memcpy(copy_bytes, data, size);
    copy_bytes[i] ^= 0xFF;
    status = kvr_router_restore(copy, copy_bytes, size, NULL);
    assert_true(status != KVR_INTERNAL);
    assert_string_not_equal("KVR_UNKNOWN", kvr_status_str(status));
    kvr_router_free(copy);
  }
  free(copy_bytes);
}

static void future_format_version_refused(void** state) {
  fixture* f = (fixture*)*state;
  kvr_router* copy = empty_router();
  size_t size = 0;
  uint8_t* future = kvt_read_file(KVR_CAPI_DATA_DIR "/snapshot_future_version.bin", &size);
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_restore(copy, future, size, ERRP));
  assert_empty_index(copy, f);
  free(future);
  kvr_router_free(copy);
}

static void snapshot_null_arguments(void** state) {
  fixture* f = (fixture*)*state;
  kvr_buffer* buffer = NULL;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_snapshot(f->source, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_snapshot(NULL, &buffer, ERRP));
  assert_null(buffer);
  kvr_buffer_free(NULL);
}

static uint64_t index_digest(kvr_router* router) {
  uint64_t digest = 0;
  KVT_OK(kvr_router_index_digest(router, &digest, ERRP));
  return digest;
}

static uint64_t state_digest(kvr_router* router) {
  uint64_t digest = 0;
  KVT_OK(kvr_router_state_digest(router, &digest, ERRP));
  return digest;
}

/* Replicas compare index digests: a restored snapshot has the source's, another block set
 * has another. */
static void index_digest_of_a_restored_snapshot(void** state) {
  fixture* f = (fixture*)*state;
  kvr_router* copy = empty_router();
  uint64_t hashes[1] = {17}; /* the last block of prompt a on worker 1 */
  kvr_removed_event removed;
  assert_int_not_equal(index_digest(f->source), index_digest(copy));
  KVT_OK(
      kvr_router_restore(copy, kvr_buffer_data(f->snapshot), kvr_buffer_size(f->snapshot), ERRP));
  assert_int_equal(index_digest(f->source), index_digest(copy));

  kvr_removed_event_init(&removed, sizeof removed);
  removed.worker_id = 1;
  removed.block_hashes = hashes;
  removed.num_blocks = 1;
  KVT_OK(kvr_router_apply_removed(copy, &removed, ERRP));
  assert_int_not_equal(index_digest(f->source), index_digest(copy));
  kvr_router_free(copy);
}

/* A booking is routing state but not the index: the state digest moves, the index digest
 * stays. */
static void index_digest_ignores_bookings(void** state) {
  fixture* f = (fixture*)*state;
  const uint64_t index_before = index_digest(f->source);
  const uint64_t state_before = state_digest(f->source);
  kvr_request_options admit = kvt_admit("booked");
  kvr_route_result result;
  kvr_route_result_init(&result, sizeof result);
  KVT_OK(kvr_find_best_match(f->source, f->a, 8 * BS, &admit, &result, NULL, 0, NULL, ERRP));
  assert_int_not_equal(state_before, state_digest(f->source));
  assert_int_equal(index_before, index_digest(f->source));
}

/* The digest is defined independently of the process (unlike the state digest), so a fixed
 * index has a fixed digest. The constant was worked out by hand from the definition in
 * RadixIndex::StateDigest (splitmix64 over the rank, the engine hashes, the tier bits and the
 * path of local hashes, from kvr_compute_block_hashes), not read off the library. It changes
 * only with a documented change of the digest's definition (or of local block hashing) in
 * docs/api-stability.md. */
static void index_digest_of_a_fixed_index(void** state) {
  kvr_router* router = kvt_router_new(BS, 0);
  uint32_t tokens[2 * BS];
  (void)state;
  kvt_add_worker(router, 1);
  kvt_fill_tokens(tokens, 2 * BS, 0);
  /* Worker 1, rank 0, device tier: blocks 0-3 and 4-7 with engine hashes 10 and 11. */
  KVT_OK(kvt_store(router, 1, 0, KVR_TIER_DEVICE, tokens, 2, BS, 10, 0, 0, ERRP));
  assert_int_equal(UINT64_C(0x4f6fc79668578e72), index_digest(router));
  kvr_router_free(router);
}

static void index_digest_null_arguments(void** state) {
  fixture* f = (fixture*)*state;
  uint64_t digest = 0;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_index_digest(NULL, &digest, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_index_digest(f->source, NULL, ERRP));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(snapshot_and_restore, setup, teardown),
      cmocka_unit_test_setup_teardown(snapshot_of_empty_router_restores_to_empty, setup, teardown),
      cmocka_unit_test_setup_teardown(restore_buffer_is_borrowed, setup, teardown),
      cmocka_unit_test_setup_teardown(restore_into_non_empty_index, setup, teardown),
      cmocka_unit_test_setup_teardown(restore_other_block_size, setup, teardown),
      cmocka_unit_test_setup_teardown(restore_every_truncation, setup, teardown),
      cmocka_unit_test_setup_teardown(restore_malformed, setup, teardown),
      cmocka_unit_test_setup_teardown(restore_flipped_bytes_never_crash, setup, teardown),
      cmocka_unit_test_setup_teardown(future_format_version_refused, setup, teardown),
      cmocka_unit_test_setup_teardown(snapshot_null_arguments, setup, teardown),
      cmocka_unit_test_setup_teardown(index_digest_of_a_restored_snapshot, setup, teardown),
      cmocka_unit_test_setup_teardown(index_digest_ignores_bookings, setup, teardown),
      cmocka_unit_test(index_digest_of_a_fixed_index),
      cmocka_unit_test_setup_teardown(index_digest_null_arguments, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
