/* KV events given as C structs: kvr_router_apply_stored, kvr_router_apply_removed,
 * kvr_router_apply_cleared (with tiers and event ids), their rejections and the metrics that
 * count them, and the versioned-struct rules on kvr_stored_event / kvr_removed_event. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>

#include "test_util.h"

#define BS 16

typedef kvt_fixture fixture;

/* Workers 1 and 2 and a prompt of four blocks (64 tokens); nothing cached. */
static int setup(void** state) {
  *state = kvt_fixture_new(BS, 0, 2, 64, 1000);
  return 0;
}

static void stored_with_tokens(void** state) {
  fixture* f = (fixture*)*state;
  kvr_overlap overlap;
  kvr_metrics metrics;
  KVT_OK(kvt_store(f->router, 1, 0, KVR_TIER_DEVICE, f->prompt, 4, BS, 100, 0, 0, ERRP));
  assert_true(kvt_overlap_of(f->router, f->prompt, 64, 1, 0, &overlap));
  assert_int_equal(4, overlap.device_blocks);
  assert_int_equal(0, overlap.host_blocks);
  assert_true(overlap.effective_overlap_blocks == 4.0);
  assert_int_equal(64, overlap.cached_tokens);
  assert_int_equal(4, overlap.tree_size);
  assert_false(kvt_overlap_of(f->router, f->prompt, 64, 2, 0, NULL));
  metrics = kvt_metrics(f->router);
  assert_int_equal(1, metrics.events[KVR_EVENT_STORED][KVR_EVENT_OK]);
  assert_int_equal(4, metrics.index_blocks);
}

static void stored_with_parent_chain(void** state) {
  fixture* f = (fixture*)*state;
  kvr_overlap overlap;
  /* Blocks 0-1, then 2-3 as a continuation of block 1 (engine hash 101). */
  KVT_OK(kvt_store(f->router, 1, 0, KVR_TIER_DEVICE, f->prompt, 2, BS, 100, 0, 0, ERRP));
  KVT_OK(kvt_store(f->router, 1, 0, KVR_TIER_DEVICE, f->prompt + 2 * BS, 2, BS, 102, 1, 101, ERRP));
  assert_true(kvt_overlap_of(f->router, f->prompt, 64, 1, 0, &overlap));
  assert_int_equal(4, overlap.device_blocks);
  assert_int_equal(2, kvt_metrics(f->router).events[KVR_EVENT_STORED][KVR_EVENT_OK]);
}

static void stored_with_local_hashes(void** state) {
  fixture* f = (fixture*)*state;
  uint64_t local[4];
  uint64_t engine[4] = {500, 501, 502, 503};
  size_t len = 0;
  kvr_stored_event event;
  kvr_overlap overlap;
  KVT_OK(kvr_compute_block_hashes(f->prompt, 64, BS, NULL, local, 4, &len, ERRP));
  kvr_stored_event_init(&event, sizeof event);
  event.worker_id = 2;
  event.event_id = 9;
  event.block_hashes = engine;
  event.num_blocks = 4;
  event.local_hashes = local;
  event.token_ids = (const uint32_t*)(uintptr_t)8; /* not read when local_hashes is set */
  event.num_tokens = 3;
  KVT_OK(kvr_router_apply_stored(f->router, &event, ERRP));
  assert_true(kvt_overlap_of(f->router, f->prompt, 64, 2, 0, &overlap));
  assert_int_equal(4, overlap.device_blocks);
}

static void stored_with_lora_namespace_and_multimodal(void** state) {
  fixture* f = (fixture*)*state;
  uint64_t engine[2] = {700, 701};
  uint64_t mm[1] = {42};
  size_t counts[2] = {1, 0};
  kvr_stored_event event;
  kvr_request_options opts;
  kvr_overlap scores[4];
  size_t len = 0;
  kvr_stored_event_init(&event, sizeof event);
  event.worker_id = 1;
  event.block_hashes = engine;
  event.num_blocks = 2;
  event.token_ids = f->prompt;
  event.num_tokens = 2 * BS;
  event.lora_name = "adapter-a";
  event.cache_namespace = "tenant-1";
  event.mm_hashes = mm;
  event.mm_counts = counts;
  KVT_OK(kvr_router_apply_stored(f->router, &event, ERRP));

  /* The plain prompt does not match: its hashes differ. */
  assert_false(kvt_overlap_of(f->router, f->prompt, 64, 1, 0, NULL));
  /* The same LoRA, namespace and multimodal content match both blocks. */
  kvr_request_options_init(&opts, sizeof opts);
  opts.lora_name = "adapter-a";
  opts.cache_namespace = "tenant-1";
  opts.mm_hashes = mm;
  opts.mm_counts = counts;
  opts.mm_num_blocks = 2;
  KVT_OK(kvr_router_overlap_scores(f->router, f->prompt, 64, &opts, scores, 4, &len, ERRP));
  assert_int_equal(1, len);
  assert_int_equal(2, scores[0].device_blocks);
  /* Without the multimodal hash of block 0 nothing matches. */
  opts.mm_counts = NULL;
  opts.mm_num_blocks = 0;
  KVT_OK(kvr_router_overlap_scores(f->router, f->prompt, 64, &opts, scores, 4, &len, ERRP));
  assert_int_equal(0, len);
}

static void stored_eagle(void** state) {
  fixture* f = (fixture*)*state;
  uint64_t engine[2] = {800, 801};
  kvr_stored_event event;
  kvr_router* router;
  kvr_router_options ropts;
  kvr_overlap overlap;
  (void)f;
  /* An eagle router hashes prompts with eagle windows; the event carries one look-ahead token. */
  kvr_router_options_init(&ropts, sizeof ropts);
  ropts.block_size = BS;
  ropts.flags = KVR_ROUTER_EAGLE;
  router = kvt_router_new_opts(&ropts);
  kvr_stored_event_init(&event, sizeof event);
  event.worker_id = 1;
  event.flags = KVR_STORED_EAGLE;
  event.block_hashes = engine;
  event.num_blocks = 2;
  event.token_ids = f->prompt;
  event.num_tokens = 2 * BS + 1;
  KVT_OK(kvr_router_apply_stored(router, &event, ERRP));
  assert_true(kvt_overlap_of(router, f->prompt, 2 * BS + 1, 1, 0, &overlap));
  assert_int_equal(2, overlap.device_blocks);
  kvr_router_free(router);
}

static void lower_tiers(void** state) {
  fixture* f = (fixture*)*state;
  kvr_overlap overlap;
  /* Device holds blocks 0-1; host pinned memory holds all four (an offload copy). */
  KVT_OK(kvt_store(f->router, 1, 0, KVR_TIER_DEVICE, f->prompt, 2, BS, 100, 0, 0, ERRP));
  KVT_OK(kvt_store(f->router, 1, 0, KVR_TIER_HOST_PINNED, f->prompt, 4, BS, 100, 0, 0, ERRP));
  /* Disk holds all four on worker 2. */
  KVT_OK(kvt_store(f->router, 2, 0, KVR_TIER_DISK, f->prompt, 4, BS, 200, 0, 0, ERRP));

  assert_true(kvt_overlap_of(f->router, f->prompt, 64, 1, 0, &overlap));
  assert_int_equal(2, overlap.device_blocks);
  assert_int_equal(2, overlap.host_blocks);
  assert_true(fabs(overlap.effective_overlap_blocks - (2 + 0.75 * 2)) < 1e-9);
  assert_int_equal(56, overlap.cached_tokens);

  assert_true(kvt_overlap_of(f->router, f->prompt, 64, 2, 0, &overlap));
  assert_int_equal(0, overlap.device_blocks);
  assert_int_equal(4, overlap.disk_blocks);
  assert_true(fabs(overlap.effective_overlap_blocks - 0.25 * 4) < 1e-9);

  /* External tier is weighted like disk. */
  KVT_OK(kvt_store(f->router, 3, 0, KVR_TIER_EXTERNAL, f->prompt, 4, BS, 300, 0, 0, ERRP));
  assert_true(kvt_overlap_of(f->router, f->prompt, 64, 3, 0, &overlap));
  assert_int_equal(4, overlap.external_blocks);
  assert_true(fabs(overlap.effective_overlap_blocks - 0.25 * 4) < 1e-9);

  /* Removing the host copies leaves the device blocks. */
  {
    uint64_t hashes[4] = {100, 101, 102, 103};
    kvr_removed_event removed;
    kvr_removed_event_init(&removed, sizeof removed);
    removed.worker_id = 1;
    removed.tier = KVR_TIER_HOST_PINNED;
    removed.block_hashes = hashes;
    removed.num_blocks = 4;
    KVT_OK(kvr_router_apply_removed(f->router, &removed, ERRP));
  }
  assert_true(kvt_overlap_of(f->router, f->prompt, 64, 1, 0, &overlap));
  assert_int_equal(2, overlap.device_blocks);
  assert_int_equal(0, overlap.host_blocks);
}

static void bad_tier_refused(void** state) {
  fixture* f = (fixture*)*state;
  kvr_removed_event removed;
  uint64_t hash = 100;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT,
                   kvt_store(f->router, 1, 0, 4, f->prompt, 1, BS, 100, 0, 0, ERRP));
  kvr_removed_event_init(&removed, sizeof removed);
  removed.worker_id = 1;
  removed.tier = 17;
  removed.block_hashes = &hash;
  removed.num_blocks = 1;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_removed(f->router, &removed, ERRP));
  assert_int_equal(0, kvt_metrics(f->router).index_blocks);
}

static void removed_blocks(void** state) {
  fixture* f = (fixture*)*state;
  uint64_t hashes[2] = {102, 103};
  kvr_removed_event removed;
  kvr_overlap overlap;
  KVT_OK(kvt_store(f->router, 1, 0, KVR_TIER_DEVICE, f->prompt, 4, BS, 100, 0, 0, ERRP));
  kvr_removed_event_init(&removed, sizeof removed);
  removed.worker_id = 1;
  removed.event_id = 2;
  removed.block_hashes = hashes;
  removed.num_blocks = 2;
  KVT_OK(kvr_router_apply_removed(f->router, &removed, ERRP));
  assert_true(kvt_overlap_of(f->router, f->prompt, 64, 1, 0, &overlap));
  assert_int_equal(2, overlap.device_blocks);
  assert_int_equal(1, kvt_metrics(f->router).events[KVR_EVENT_REMOVED][KVR_EVENT_OK]);
  assert_int_equal(2, kvt_metrics(f->router).index_blocks);
}

static void removed_unknown_block(void** state) {
  fixture* f = (fixture*)*state;
  uint64_t hashes[2] = {101, 999};
  kvr_removed_event removed;
  kvr_overlap overlap;
  kvr_metrics metrics;
  KVT_OK(kvt_store(f->router, 1, 0, KVR_TIER_DEVICE, f->prompt, 4, BS, 100, 0, 0, ERRP));
  kvr_removed_event_init(&removed, sizeof removed);
  removed.worker_id = 1;
  removed.block_hashes = hashes;
  removed.num_blocks = 2;
  /* 999 is unknown: reported, while 101 is removed all the same. Evaluated twice (err NULL
   * and err set): the second time 101 is unknown too. */
  KVT_EXPECT_FAILS(KVR_NOT_FOUND, kvr_router_apply_removed(f->router, &removed, ERRP));
  assert_true(kvt_overlap_of(f->router, f->prompt, 64, 1, 0, &overlap));
  assert_int_equal(1, overlap.device_blocks);
  metrics = kvt_metrics(f->router);
  assert_int_equal(2, metrics.events[KVR_EVENT_REMOVED][KVR_EVENT_BLOCK_NOT_FOUND]);
  assert_int_equal(0, metrics.events[KVR_EVENT_REMOVED][KVR_EVENT_OK]);
}

static void stored_unknown_parent(void** state) {
  fixture* f = (fixture*)*state;
  kvr_metrics metrics;
  KVT_EXPECT_FAILS(KVR_NOT_FOUND, kvt_store(f->router, 1, 0, KVR_TIER_DEVICE, f->prompt + BS, 2, BS,
                                            101, 1, 4242, ERRP));
  /* The whole event is dropped. */
  metrics = kvt_metrics(f->router);
  assert_int_equal(0, metrics.index_blocks);
  assert_int_equal(2, metrics.events[KVR_EVENT_STORED][KVR_EVENT_PARENT_BLOCK_NOT_FOUND]);
  assert_int_equal(0, metrics.events[KVR_EVENT_STORED][KVR_EVENT_OK]);
}

static void stored_incomplete_block(void** state) {
  fixture* f = (fixture*)*state;
  uint64_t engine[2] = {100, 101};
  kvr_stored_event event;
  kvr_overlap overlap;
  kvr_metrics metrics;
  kvr_stored_event_init(&event, sizeof event);
  event.worker_id = 1;
  event.block_hashes = engine;
  event.num_blocks = 2;
  event.token_ids = f->prompt;
  event.num_tokens = BS + 5; /* the second block is incomplete */
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_stored(f->router, &event, ERRP));
  /* The complete first block is applied (as Dynamo does). */
  assert_true(kvt_overlap_of(f->router, f->prompt, 64, 1, 0, &overlap));
  assert_int_equal(1, overlap.device_blocks);
  metrics = kvt_metrics(f->router);
  assert_int_equal(2, metrics.events[KVR_EVENT_STORED][KVR_EVENT_INVALID_BLOCK]);
}

static void stored_invalid_sequence(void** state) {
  fixture* f = (fixture*)*state;
  uint64_t engine[2] = {100, 100}; /* the second block repeats the first one's hash */
  kvr_stored_event event;
  kvr_error* err = NULL;
  kvr_stored_event_init(&event, sizeof event);
  event.worker_id = 1;
  event.block_hashes = engine;
  event.num_blocks = 2;
  event.token_ids = f->prompt;
  event.num_tokens = 2 * BS;
  assert_int_equal(KVR_INVALID_ARGUMENT, kvr_router_apply_stored(f->router, &event, &err));
  kvt_expect_error(&err, KVR_INVALID_ARGUMENT);
  assert_int_equal(
      1, kvt_metrics(f->router).events[KVR_EVENT_STORED][KVR_EVENT_INVALID_BLOCK_SEQUENCE]);
}

static void cleared(void** state) {
  fixture* f = (fixture*)*state;
  kvr_worker_config config;
  uint32_t other[32];
  kvt_fill_tokens(other, 32, 5000);
  kvr_worker_config_init(&config, sizeof config);
  config.worker_id = 3;
  config.dp_size = 2;
  KVT_OK(kvr_router_add_worker(f->router, &config, ERRP));
  KVT_OK(kvt_store(f->router, 3, 0, KVR_TIER_DEVICE, f->prompt, 4, BS, 100, 0, 0, ERRP));
  KVT_OK(kvt_store(f->router, 3, 1, KVR_TIER_DEVICE, other, 2, BS, 200, 0, 0, ERRP));
  KVT_OK(kvt_store(f->router, 1, 0, KVR_TIER_DEVICE, f->prompt, 4, BS, 100, 0, 0, ERRP));
  assert_int_equal(10, kvt_metrics(f->router).index_blocks);

  /* Rank 0 of worker 3 loses every block; its rank 1 and worker 1 keep their own (each rank
   * has a cache of its own). */
  KVT_OK(kvr_router_apply_cleared(f->router, 3, 0, 77, ERRP));
  assert_false(kvt_overlap_of(f->router, f->prompt, 64, 3, 0, NULL));
  assert_true(kvt_overlap_of(f->router, other, 32, 3, 1, NULL));
  assert_true(kvt_overlap_of(f->router, f->prompt, 64, 1, 0, NULL));
  assert_int_equal(6, kvt_metrics(f->router).index_blocks);
  assert_int_equal(1, kvt_metrics(f->router).events[KVR_EVENT_CLEARED][KVR_EVENT_OK]);

  /* Clearing a worker that holds nothing (or is unknown) is fine. */
  KVT_OK(kvr_router_apply_cleared(f->router, 12345, 0, 1, ERRP));
}

static void events_for_unregistered_workers_are_indexed(void** state) {
  fixture* f = (fixture*)*state;
  kvr_overlap overlap;
  KVT_OK(kvt_store(f->router, 99, 3, KVR_TIER_DEVICE, f->prompt, 3, BS, 100, 0, 0, ERRP));
  assert_true(kvt_overlap_of(f->router, f->prompt, 64, 99, 3, &overlap));
  assert_int_equal(3, overlap.device_blocks);
}

static void removing_a_worker_drops_its_index_entries(void** state) {
  fixture* f = (fixture*)*state;
  KVT_OK(kvt_store(f->router, 2, 0, KVR_TIER_DEVICE, f->prompt, 4, BS, 100, 0, 0, ERRP));
  assert_true(kvt_overlap_of(f->router, f->prompt, 64, 2, 0, NULL));
  KVT_OK(kvr_router_remove_worker(f->router, 2, ERRP));
  assert_false(kvt_overlap_of(f->router, f->prompt, 64, 2, 0, NULL));
  assert_int_equal(0, kvt_metrics(f->router).index_blocks);
}

static void event_null_arguments(void** state) {
  fixture* f = (fixture*)*state;
  kvr_stored_event stored;
  kvr_removed_event removed;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_stored(f->router, NULL, ERRP));
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_removed(f->router, NULL, ERRP));
  kvr_stored_event_init(&stored, sizeof stored);
  stored.worker_id = 1;
  stored.num_blocks = 2; /* no block_hashes */
  stored.token_ids = f->prompt;
  stored.num_tokens = 2 * BS;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_stored(f->router, &stored, ERRP));
  kvr_removed_event_init(&removed, sizeof removed);
  removed.worker_id = 1;
  removed.num_blocks = 1; /* no block_hashes */
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_removed(f->router, &removed, ERRP));
  assert_int_equal(0, kvt_metrics(f->router).index_blocks);
}

static void event_struct_size_rules(void** state) {
  fixture* f = (fixture*)*state;
  uint64_t engine[1] = {100};
  kvr_stored_event stored;
  kvr_removed_event removed;
  struct {
    kvr_stored_event base;
    uint64_t tail[2];
  } newer;
  kvr_overlap overlap;

  kvr_stored_event_init(&stored, sizeof stored);
  stored.worker_id = 1;
  stored.block_hashes = engine;
  stored.num_blocks = 1;
  stored.token_ids = f->prompt;
  stored.num_tokens = BS;
  stored.struct_size = 0;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_stored(f->router, &stored, ERRP));
  kvr_removed_event_init(&removed, sizeof removed);
  removed.struct_size = 0;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_removed(f->router, &removed, ERRP));
  assert_int_equal(0, kvt_metrics(f->router).index_blocks);

  /* A struct shorter than the first released layout (which already ended with mm_counts) is
   * no caller's: refused, with a message that says so, and nothing is read past it. */
  stored.struct_size = (uint32_t)offsetof(kvr_stored_event, lora_name);
  stored.mm_counts = (const size_t*)(uintptr_t)8; /* never dereferenced */
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "first released layout",
                          kvr_router_apply_stored(f->router, &stored, ERRP));
  assert_false(kvt_overlap_of(f->router, f->prompt, 64, 1, 0, &overlap));

  /* A flag bit this library does not know is refused, and nothing is stored. */
  KVT_OK(kvr_stored_event_init(&stored, sizeof stored));
  stored.worker_id = 1;
  stored.block_hashes = engine;
  stored.num_blocks = 1;
  stored.token_ids = f->prompt;
  stored.num_tokens = BS;
  stored.flags = 0x8u;
  KVT_EXPECT_FAILS_SAYING(KVR_INVALID_ARGUMENT, "kvr_stored_event.flags 0x8",
                          kvr_router_apply_stored(f->router, &stored, ERRP));
  assert_false(kvt_overlap_of(f->router, f->prompt, 64, 1, 0, &overlap));

  /* Newer caller (its _init is given its own, larger size): zero tail accepted, non-zero tail
   * refused. */
  memset(&newer, 0xAB, sizeof newer);
  KVT_OK(kvr_stored_event_init(&newer.base, sizeof newer));
  assert_int_equal(sizeof newer, newer.base.struct_size);
  assert_int_equal(0, newer.tail[0]);
  assert_int_equal(0, newer.tail[1]);
  newer.base.worker_id = 2;
  newer.base.block_hashes = engine;
  newer.base.num_blocks = 1;
  newer.base.token_ids = f->prompt;
  newer.base.num_tokens = BS;
  KVT_OK(kvr_router_apply_stored(f->router, &newer.base, ERRP));
  assert_true(kvt_overlap_of(f->router, f->prompt, 64, 2, 0, NULL));
  newer.base.worker_id = 3;
  newer.tail[1] = 0x100;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_stored(f->router, &newer.base, ERRP));
  assert_false(kvt_overlap_of(f->router, f->prompt, 64, 3, 0, NULL));
}

/* A hybrid model's sliding-window group (kvr_stored_event.sliding_window_tokens > 0): worker 1
 * holds the prompt's four blocks in full attention, its window (32 tokens: the two blocks before
 * a hit point) blocks 2 and 3. The prompt plus a token is cached whole (blocks 2 and 3 before
 * block 4); its first three blocks and another are not (block 1 is missing before block 3), as
 * the engine counts them. */
static void sliding_window_stores_and_removals(void** state) {
  fixture* f = (fixture*)*state;
  uint64_t window[2] = {102, 103}; /* kvt_store's hashes from 100 */
  uint64_t unknown = 999;
  uint32_t longer[65], shorter[64];
  kvr_stored_event sliding;
  kvr_removed_event removed;
  kvr_overlap overlap;
  kvr_metrics metrics;
  kvr_event_batch* batch = NULL;
  kvr_buffer* encoded = NULL;
  memcpy(longer, f->prompt, sizeof shorter);
  longer[64] = 7;
  memcpy(shorter, f->prompt, sizeof shorter);
  for (int i = 48; i < 64; ++i) shorter[i] = 999;
  kvr_stored_event_init(&sliding, sizeof sliding);
  sliding.worker_id = 1;
  sliding.block_hashes = window;
  sliding.num_blocks = 2;
  sliding.sliding_group = 0;
  sliding.sliding_window_tokens = 2 * BS;
  KVT_OK(kvt_store(f->router, 1, 0, KVR_TIER_DEVICE, f->prompt, 4, BS, 100, 0, 0, ERRP));
  KVT_OK(kvr_router_apply_stored(f->router, &sliding, ERRP));
  assert_true(kvt_overlap_of(f->router, longer, 65, 1, 0, &overlap));
  assert_int_equal(4, overlap.device_blocks);
  assert_false(kvt_overlap_of(f->router, shorter, 64, 1, 0, NULL));

  /* A block full attention does not hold cannot be placed (applied twice: two rejects). */
  sliding.block_hashes = &unknown;
  sliding.num_blocks = 1;
  KVT_EXPECT_FAILS(KVR_NOT_FOUND, kvr_router_apply_stored(f->router, &sliding, ERRP));
  /* A sliding store names blocks only, on the device. */
  sliding.block_hashes = window;
  sliding.num_blocks = 2;
  sliding.token_ids = f->prompt;
  sliding.num_tokens = 2 * BS;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_stored(f->router, &sliding, ERRP));
  sliding.token_ids = NULL;
  sliding.num_tokens = 0;
  sliding.tier = KVR_TIER_HOST_PINNED;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_stored(f->router, &sliding, ERRP));
  sliding.tier = KVR_TIER_DEVICE;
  sliding.flags = KVR_STORED_HAS_PARENT;
  sliding.parent_hash = 101;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_stored(f->router, &sliding, ERRP));
  sliding.flags = 0;
  sliding.num_blocks = 0; /* it would only make the group known */
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_stored(f->router, &sliding, ERRP));
  sliding.num_blocks = 2;
  sliding.sliding_group = -1;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_stored(f->router, &sliding, ERRP));
  sliding.sliding_group = 0;
  sliding.reserved1 = 1;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_stored(f->router, &sliding, ERRP));
  sliding.reserved1 = 0;

  /* The window lets block 3 go: no hit left on worker 1; its full-attention blocks stay. */
  kvr_removed_event_init(&removed, sizeof removed);
  removed.worker_id = 1;
  removed.block_hashes = &window[1];
  removed.num_blocks = 1;
  removed.flags = KVR_REMOVED_SLIDING;
  removed.tier = KVR_TIER_HOST_PINNED; /* only the device's windows are tracked */
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_removed(f->router, &removed, ERRP));
  removed.tier = KVR_TIER_DEVICE;
  KVT_OK(kvr_router_apply_removed(f->router, &removed, ERRP));
  assert_false(kvt_overlap_of(f->router, longer, 65, 1, 0, NULL));
  removed.flags = 0x80; /* unknown */
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_removed(f->router, &removed, ERRP));
  removed.flags = 0; /* a group without the flag: not a full-attention removal either */
  removed.sliding_group = 3;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_removed(f->router, &removed, ERRP));
  sliding.sliding_window_tokens = 0; /* a group without its window */
  sliding.sliding_group = 3;
  KVT_EXPECT_FAILS(KVR_INVALID_ARGUMENT, kvr_router_apply_stored(f->router, &sliding, ERRP));
  sliding.sliding_window_tokens = 2 * BS;
  sliding.sliding_group = 0;
  metrics = kvt_metrics(f->router);
  assert_int_equal(4, metrics.index_blocks);
  assert_int_equal(1, metrics.index_sliding_blocks);
  assert_int_equal(2, metrics.sliding_events_applied);
  assert_int_equal(2, metrics.sliding_events_rejected);

  /* The same store through an event batch (FlatBuffers) brings the hit back. */
  KVT_OK(kvr_event_batch_new(&batch, ERRP));
  sliding.block_hashes = &window[1];
  sliding.num_blocks = 1;
  KVT_OK(kvr_event_batch_add_stored(batch, &sliding, ERRP));
  KVT_OK(kvr_event_batch_encode(batch, &encoded, ERRP));
  KVT_OK(kvr_router_apply_event_batch(f->router, kvr_buffer_data(encoded), kvr_buffer_size(encoded),
                                      ERRP));
  assert_true(kvt_overlap_of(f->router, longer, 65, 1, 0, &overlap));
  assert_int_equal(4, overlap.device_blocks);
  kvr_buffer_free(encoded);
  kvr_event_batch_free(batch);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(sliding_window_stores_and_removals, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(stored_with_tokens, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(stored_with_parent_chain, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(stored_with_local_hashes, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(stored_with_lora_namespace_and_multimodal, setup,
                                      kvt_teardown),
      cmocka_unit_test_setup_teardown(stored_eagle, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(lower_tiers, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(bad_tier_refused, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(removed_blocks, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(removed_unknown_block, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(stored_unknown_parent, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(stored_incomplete_block, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(stored_invalid_sequence, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(cleared, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(events_for_unregistered_workers_are_indexed, setup,
                                      kvt_teardown),
      cmocka_unit_test_setup_teardown(removing_a_worker_drops_its_index_entries, setup,
                                      kvt_teardown),
      cmocka_unit_test_setup_teardown(event_null_arguments, setup, kvt_teardown),
      cmocka_unit_test_setup_teardown(event_struct_size_rules, setup, kvt_teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
