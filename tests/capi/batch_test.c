/* FlatBuffers event batches: the encoder (kvr_event_batch_*) and kvr_router_apply_event_batch.
 * Valid EventBatch buffers come from two independent sources: the library's own encoder, and
 * flatc, which compiles fixtures/event_batch_*.json against schema/kv_events.fbs at build time.
 * Malformed, random, empty and every truncation of a valid buffer must be refused with
 * KVR_INVALID_ARGUMENT with nothing applied (checked through overlap scores and metrics), and
 * counted in kvr_metrics.event_batches_rejected. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>

#include "test_util.h"

#define BS 4

typedef struct fixture {
  kvt_fixture fx; /* workers 7 and 8; the prompt: tokens 1..12 (3 blocks) */
  uint8_t* valid; /* event_batch_valid.bin */
  size_t valid_size;
  uint8_t* partial; /* event_batch_partial.bin */
  size_t partial_size;
} fixture;

static int setup(void** state) {
  fixture* f = (fixture*)calloc(1, sizeof(fixture));
  kvr_router_options opts = kvt_router_options(BS, 0);
  if (f == NULL) return -1;
  kvt_fixture_init(&f->fx, &opts, 0, 3 * BS, 1);
  kvt_add_worker(f->fx.router, 7);
  kvt_add_worker(f->fx.router, 8);
  f->valid = kvt_read_file(KVR_CAPI_DATA_DIR "/event_batch_valid.bin", &f->valid_size);
  f->partial = kvt_read_file(KVR_CAPI_DATA_DIR "/event_batch_partial.bin", &f->partial_size);
  *state = f;
  return 0;
}

static int teardown(void** state) {
  fixture* f = (fixture*)*state;
  kvt_fixture_release(&f->fx);
  free(f->valid);
  free(f->partial);
  free(f);
  return 0;
}

/* Nothing of any batch was applied. */
static void assert_untouched(kvr_router* router, const fixture* f) {
  kvr_metrics m = kvt_metrics(router);
  int kind;
  int outcome;
  assert_int_equal(0, kvt_overlap_count(router, f->fx.prompt, 3 * BS));
  assert_int_equal(0, m.index_blocks);
  for (kind = 0; kind < KVR_EVENT_KINDS; ++kind) {
    for (outcome = 0; outcome < KVR_EVENT_OUTCOMES; ++outcome) {
      assert_int_equal(0, m.events[kind][outcome]);
    }
  }
}

static void valid_batch_applies_every_event(void** state) {
  fixture* f = (fixture*)*state;
  kvr_overlap overlap;
  kvr_metrics m;
  assert_memory_equal("KVEB", f->valid + 4, 4);
  KVT_OK(kvr_router_apply_event_batch(f->fx.router, f->valid, f->valid_size, ERRP));
  /* Worker 7: blocks 1-2, then block 3 chained on engine hash 1002. */
  assert_true(kvt_overlap_of(f->fx.router, f->fx.prompt, 3 * BS, 7, 0, &overlap));
  assert_int_equal(3, overlap.device_blocks);
  /* Worker 8: block 1. */
  assert_true(kvt_overlap_of(f->fx.router, f->fx.prompt, 3 * BS, 8, 0, &overlap));
  assert_int_equal(1, overlap.device_blocks);
  /* Worker 10 stored its block on the host tier, then removed it. */
  assert_false(kvt_overlap_of(f->fx.router, f->fx.prompt, 3 * BS, 10, 0, NULL));
  m = kvt_metrics(f->fx.router);
  assert_int_equal(4, m.events[KVR_EVENT_STORED][KVR_EVENT_OK]);
  assert_int_equal(1, m.events[KVR_EVENT_REMOVED][KVR_EVENT_OK]);
  assert_int_equal(1, m.events[KVR_EVENT_CLEARED][KVR_EVENT_OK]);
  assert_int_equal(0, m.event_batches_rejected);
  assert_int_equal(4, m.index_blocks);
}

static void rejected_event_does_not_stop_the_others(void** state) {
  fixture* f = (fixture*)*state;
  kvr_error* err = NULL;
  kvr_metrics m;
  /* Event 0 has an unknown parent; event 1 is fine and is applied all the same. */
  assert_int_equal(KVR_NOT_FOUND,
                   kvr_router_apply_event_batch(f->fx.router, f->partial, f->partial_size, &err));
  kvt_expect_error(&err, KVR_NOT_FOUND);
  assert_false(kvt_overlap_of(f->fx.router, f->fx.prompt, 3 * BS, 7, 0, NULL));
  assert_true(kvt_overlap_of(f->fx.router, f->fx.prompt, 3 * BS, 8, 0, NULL));
  m = kvt_metrics(f->fx.router);
  assert_int_equal(1, m.events[KVR_EVENT_STORED][KVR_EVENT_PARENT_BLOCK_NOT_FOUND]);
  assert_int_equal(1, m.events[KVR_EVENT_STORED][KVR_EVENT_OK]);
  assert_int_equal(0, m.event_batches_rejected);
  /* err NULL works the same. */
  assert_int_equal(KVR_NOT_FOUND,
                   kvr_router_apply_event_batch(f->fx.router, f->partial, f->partial_size, NULL));
}

static void every_truncation_is_rejected(void** state) {
  fixture* f = (fixture*)*state;
  size_t n;
  for (n = 0; n < f->valid_size; ++n) {
    /* A heap copy of exactly n bytes, so that AddressSanitizer catches any read past it. */
    uint8_t* cut = (uint8_t*)malloc(n > 0 ? n : 1);
    kvr_error* err = NULL;
    kvr_status status;
    assert_non_null(cut);
    memcpy(cut, f->valid, n);
    status = kvr_router_apply_event_batch(f->fx.router, cut, n, n % 2 ? &err : NULL);
    if (status != KVR_INVALID_ARGUMENT) {
      fail_msg("truncation to %zu of %zu bytes: %s", n, f->valid_size, kvr_status_str(status));
    }
    if (n % 2) kvt_expect_error(&err, KVR_INVALID_ARGUMENT);
    free(cut);
  }
  assert_untouched(f->fx.router, f);
  assert_int_equal(f->valid_size, kvt_metrics(f->fx.router).event_batches_rejected);
  /* The whole buffer still applies. */
  KVT_OK(kvr_router_apply_event_batch(f->fx.router, f->valid, f->valid_size, ERRP));
  assert_true(kvt_overlap_of(f->fx.router, f->fx.prompt, 3 * BS, 7, 0, NULL));
}

static void malformed_buffers_are_rejected(void** state) {
  fixture* f = (fixture*)*state;
  uint8_t noise[1024];
  uint64_t seed = 0xC0FFEEull;
  uint8_t byte = 0;
  uint64_t rejected = 0;
  int round;

  /* Empty buffers. */
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_apply_event_batch(f->fx.router, &byte, 0, ERRP));
  rejected += 2;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_event_batch(f->fx.router, NULL, 0, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_apply_event_batch(f->fx.router, NULL, f->valid_size, ERRP));

  /* Random bytes, half of them with the right file identifier. */
  for (round = 0; round < 500; ++round) {
    size_t n = 1 + (size_t)(kvt_next_random(&seed) % sizeof noise);
    kvt_random_bytes(noise, n, &seed);
    if (round % 2 && n >= 8) memcpy(noise + 4, "KVEB", 4);
    assert_int_equal(KVR_INVALID_ARGUMENT,
                     kvr_router_apply_event_batch(f->fx.router, noise, n, NULL));
    ++rejected;
  }

  /* A valid buffer with the wrong file identifier (an IndexSnapshot's). */
  memcpy(noise, f->valid, f->valid_size);
  memcpy(noise + 4, "KVIS", 4);
  assert_int_equal(KVR_INVALID_ARGUMENT,
                   kvr_router_apply_event_batch(f->fx.router, noise, f->valid_size, NULL));
  ++rejected;

  /* A root offset pointing past the end. */
  memcpy(noise, f->valid, f->valid_size);
  noise[0] = 0xF0;
  noise[1] = 0xFF;
  noise[2] = 0xFF;
  noise[3] = 0x7F;
  assert_int_equal(KVR_INVALID_ARGUMENT,
                   kvr_router_apply_event_batch(f->fx.router, noise, f->valid_size, NULL));
  ++rejected;

  assert_untouched(f->fx.router, f);
  /* NULL data is refused before it is a buffer; every real buffer counts. */
  assert_true(kvt_metrics(f->fx.router).event_batches_rejected >= rejected);
}

static void flipped_bytes_never_crash(void** state) {
  fixture* f = (fixture*)*state;
  uint8_t* bytes = (uint8_t*)malloc(f->valid_size);
  size_t i;
  assert_non_null(bytes);
  /* Each byte inverted in turn, on a fresh router: a documented status, never a crash, an
   * out-of-bounds read or an internal error. */
  for (i = 0; i < f->valid_size; ++i) {
    kvr_router* router = kvt_router_new(BS, 0);
    kvr_status status;
    memcpy(bytes, f->valid, f->valid_size);
    bytes[i] ^= 0xFF;
    status = kvr_router_apply_event_batch(router, bytes, f->valid_size, NULL);
    assert_true(status != KVR_INTERNAL);
    assert_string_not_equal("KVR_UNKNOWN", kvr_status_str(status));
    if (status == KVR_INVALID_ARGUMENT && kvt_metrics(router).event_batches_rejected == 1) {
      /* Refused by the verifier: nothing applied. */
      assert_int_equal(0, kvt_metrics(router).index_blocks);
    }
    kvr_router_free(router);
  }
  free(bytes);
}

static void approximate_mode_refuses_batches(void** state) {
  fixture* f = (fixture*)*state;
  kvr_router* router = kvt_router_new(BS, KVR_ROUTER_APPROXIMATE);
  KVT_EXPECT_FAILS(KVR_FAILED_PRECONDITION,
                   kvr_router_apply_event_batch(router, f->valid, f->valid_size, ERRP));
  assert_int_equal(0, kvt_overlap_count(router, f->fx.prompt, 3 * BS));
  kvr_router_free(router);
}

/* The events of fixtures/event_batch_valid.json, built with the C encoder. */
static kvr_event_batch* build_valid_batch(void) {
  static const uint32_t tokens[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  uint64_t w7[2] = {1001, 1002};
  uint64_t w8[1] = {2001};
  uint64_t w7b[1] = {1003};
  uint64_t w10[1] = {4001};
  kvr_event_batch* batch = NULL;
  kvr_stored_event stored;
  kvr_removed_event removed;
  KVT_OK(kvr_event_batch_new(&batch, ERRP));
  assert_non_null(batch);
  assert_int_equal(0, kvr_event_batch_size(batch));

  kvr_stored_event_init(&stored, sizeof stored);
  stored.worker_id = 7;
  stored.event_id = 1;
  stored.block_hashes = w7;
  stored.num_blocks = 2;
  stored.token_ids = tokens;
  stored.num_tokens = 8;
  KVT_OK(kvr_event_batch_add_stored(batch, &stored, ERRP));
  stored.worker_id = 8;
  stored.block_hashes = w8;
  stored.num_blocks = 1;
  stored.num_tokens = 4;
  KVT_OK(kvr_event_batch_add_stored(batch, &stored, ERRP));
  stored.worker_id = 7;
  stored.event_id = 2;
  stored.flags = KVR_STORED_HAS_PARENT;
  stored.parent_hash = 1002;
  stored.block_hashes = w7b;
  stored.token_ids = tokens + 8;
  KVT_OK(kvr_event_batch_add_stored(batch, &stored, ERRP));
  kvr_stored_event_init(&stored, sizeof stored);
  stored.worker_id = 10;
  stored.event_id = 1;
  stored.tier = KVR_TIER_HOST_PINNED;
  stored.block_hashes = w10;
  stored.num_blocks = 1;
  stored.token_ids = tokens;
  stored.num_tokens = 4;
  KVT_OK(kvr_event_batch_add_stored(batch, &stored, ERRP));
  kvr_removed_event_init(&removed, sizeof removed);
  removed.worker_id = 10;
  removed.event_id = 2;
  removed.tier = KVR_TIER_HOST_PINNED;
  removed.block_hashes = w10;
  removed.num_blocks = 1;
  KVT_OK(kvr_event_batch_add_removed(batch, &removed, ERRP));
  KVT_OK(kvr_event_batch_add_cleared(batch, 11, 0, 1, ERRP));
  assert_int_equal(6, kvr_event_batch_size(batch));
  return batch;
}

static void encoder_round_trip(void** state) {
  fixture* f = (fixture*)*state;
  kvr_event_batch* batch = build_valid_batch();
  kvr_buffer* encoded = NULL;
  kvr_router* other = kvt_router_new(BS, 0);
  kvr_overlap a;
  kvr_overlap b;
  kvr_metrics ma;
  kvr_metrics mb;
  uint64_t worker;
  /* The inputs were borrowed: the batch holds its own copies (the arrays above are gone). */
  KVT_OK(kvr_event_batch_encode(batch, &encoded, ERRP));
  assert_non_null(encoded);
  assert_memory_equal("KVEB", kvr_buffer_data(encoded) + 4, 4);
  /* The batch keeps its events after encoding. */
  assert_int_equal(6, kvr_event_batch_size(batch));

  /* Applying the encoder's buffer and flatc's buffer gives the same index. */
  KVT_OK(kvr_router_apply_event_batch(f->fx.router, kvr_buffer_data(encoded),
                                      kvr_buffer_size(encoded), ERRP));
  KVT_OK(kvr_router_apply_event_batch(other, f->valid, f->valid_size, ERRP));
  for (worker = 7; worker <= 10; ++worker) {
    int has_a = kvt_overlap_of(f->fx.router, f->fx.prompt, 3 * BS, worker, 0, &a);
    int has_b = kvt_overlap_of(other, f->fx.prompt, 3 * BS, worker, 0, &b);
    assert_int_equal(has_a, has_b);
    if (has_a) assert_memory_equal(&a, &b, sizeof a);
  }
  ma = kvt_metrics(f->fx.router);
  mb = kvt_metrics(other);
  assert_memory_equal(ma.events, mb.events, sizeof ma.events);
  assert_int_equal(ma.index_blocks, mb.index_blocks);

  kvr_event_batch_clear(batch);
  assert_int_equal(0, kvr_event_batch_size(batch));
  kvr_buffer_free(encoded);
  encoded = NULL;
  /* An empty batch encodes to a valid buffer that applies nothing. */
  KVT_OK(kvr_event_batch_encode(batch, &encoded, ERRP));
  KVT_OK(kvr_router_apply_event_batch(other, kvr_buffer_data(encoded), kvr_buffer_size(encoded),
                                      ERRP));
  assert_int_equal(mb.index_blocks, kvt_metrics(other).index_blocks);
  kvr_buffer_free(encoded);
  kvr_event_batch_free(batch);
  kvr_router_free(other);
}

static void encoded_truncations_are_rejected(void** state) {
  fixture* f = (fixture*)*state;
  kvr_event_batch* batch = build_valid_batch();
  kvr_buffer* encoded = NULL;
  const uint8_t* data;
  size_t size;
  size_t n;
  KVT_OK(kvr_event_batch_encode(batch, &encoded, ERRP));
  data = kvr_buffer_data(encoded);
  size = kvr_buffer_size(encoded);
  for (n = 0; n < size; ++n) {
    uint8_t* cut = (uint8_t*)malloc(n > 0 ? n : 1);
    kvr_status status;
    assert_non_null(cut);
    memcpy(cut, data, n);
    status = kvr_router_apply_event_batch(f->fx.router, cut, n, NULL);
    if (status != KVR_INVALID_ARGUMENT) {
      fail_msg("truncation to %zu of %zu bytes: %s", n, size, kvr_status_str(status));
    }
    free(cut);
  }
  assert_untouched(f->fx.router, f);
  kvr_buffer_free(encoded);
  kvr_event_batch_free(batch);
}

static void encoder_errors(void** state) {
  kvr_event_batch* batch = NULL;
  kvr_stored_event stored;
  kvr_removed_event removed;
  kvr_buffer* encoded = NULL;
  uint64_t hash = 1;
  (void)state;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_event_batch_new(NULL, ERRP));
  KVT_OK(kvr_event_batch_new(&batch, ERRP));
  kvr_stored_event_init(&stored, sizeof stored);
  kvr_removed_event_init(&removed, sizeof removed);
  removed.block_hashes = &hash;
  removed.num_blocks = 1;
  /* NULL batch, NULL event, NULL out. */
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_event_batch_add_stored(NULL, &stored, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_event_batch_add_removed(NULL, &removed, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_event_batch_add_cleared(NULL, 1, 0, 0, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_event_batch_add_stored(batch, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_event_batch_add_removed(batch, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_event_batch_encode(NULL, &encoded, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_event_batch_encode(batch, NULL, ERRP));
  assert_null(encoded);
  /* Events are validated as kvr_router_apply_* validates them. */
  stored.struct_size = 0;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_event_batch_add_stored(batch, &stored, ERRP));
  kvr_stored_event_init(&stored, sizeof stored);
  stored.tier = 9;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_event_batch_add_stored(batch, &stored, ERRP));
  kvr_stored_event_init(&stored, sizeof stored);
  stored.num_blocks = 3; /* no block_hashes */
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_event_batch_add_stored(batch, &stored, ERRP));
  removed.tier = 9;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_event_batch_add_removed(batch, &removed, ERRP));
  assert_int_equal(0, kvr_event_batch_size(batch));
  assert_int_equal(0, kvr_event_batch_size(NULL));
  kvr_event_batch_clear(NULL);
  kvr_event_batch_free(NULL);
  kvr_event_batch_free(batch);
}

static void null_router(void** state) {
  fixture* f = (fixture*)*state;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvr_router_apply_event_batch(NULL, f->valid, f->valid_size, ERRP));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(valid_batch_applies_every_event, setup, teardown),
      cmocka_unit_test_setup_teardown(rejected_event_does_not_stop_the_others, setup, teardown),
      cmocka_unit_test_setup_teardown(every_truncation_is_rejected, setup, teardown),
      cmocka_unit_test_setup_teardown(malformed_buffers_are_rejected, setup, teardown),
      cmocka_unit_test_setup_teardown(flipped_bytes_never_crash, setup, teardown),
      cmocka_unit_test_setup_teardown(approximate_mode_refuses_batches, setup, teardown),
      cmocka_unit_test_setup_teardown(encoder_round_trip, setup, teardown),
      cmocka_unit_test_setup_teardown(encoded_truncations_are_rejected, setup, teardown),
      cmocka_unit_test(encoder_errors),
      cmocka_unit_test_setup_teardown(null_router, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
