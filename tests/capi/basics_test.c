/* The library-wide pieces of the C ABI: version, status names, error objects, buffers, tiers
 * and the _init functions of every versioned struct. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
/* cmocka.h needs the three headers above first. */
#include <cmocka.h>

#include "test_util.h"

static void version_matches_header(void** state) {
  (void)state;
  assert_int_equal(KVR_VERSION_NUMBER, kvr_version());
  assert_int_equal(KVR_VERSION_MAJOR * 10000 + KVR_VERSION_MINOR * 100 + KVR_VERSION_PATCH,
                   kvr_version());
  assert_non_null(kvr_version_string());
  assert_string_equal(KVR_VERSION_STRING, kvr_version_string());
  /* A static string: the same pointer every time. */
  assert_ptr_equal(kvr_version_string(), kvr_version_string());
}

static void status_str_names_every_code(void** state) {
  static const struct {
    kvr_status status;
    const char* name;
  } kCodes[] = {
      {KVR_OK, "KVR_OK"},
      {KVR_CANCELLED, "KVR_CANCELLED"},
      {KVR_INVALID_ARGUMENT, "KVR_INVALID_ARGUMENT"},
      {KVR_DEADLINE_EXCEEDED, "KVR_DEADLINE_EXCEEDED"},
      {KVR_NOT_FOUND, "KVR_NOT_FOUND"},
      {KVR_ALREADY_EXISTS, "KVR_ALREADY_EXISTS"},
      {KVR_RESOURCE_EXHAUSTED, "KVR_RESOURCE_EXHAUSTED"},
      {KVR_FAILED_PRECONDITION, "KVR_FAILED_PRECONDITION"},
      {KVR_UNIMPLEMENTED, "KVR_UNIMPLEMENTED"},
      {KVR_INTERNAL, "KVR_INTERNAL"},
      {KVR_UNAVAILABLE, "KVR_UNAVAILABLE"},
      {KVR_BUFFER_TOO_SMALL, "KVR_BUFFER_TOO_SMALL"},
  };
  size_t i;
  (void)state;
  for (i = 0; i < sizeof kCodes / sizeof kCodes[0]; ++i) {
    const char* name = kvr_status_str(kCodes[i].status);
    assert_non_null(name);
    assert_string_equal(kCodes[i].name, name);
    assert_ptr_equal(name, kvr_status_str(kCodes[i].status)); /* static */
  }
}

static void status_str_unknown_code(void** state) {
  static const kvr_status kUnknown[] = {-1, 99, 101, 1000, 12345, INT32_MAX, INT32_MIN};
  size_t i;
  (void)state;
  for (i = 0; i < sizeof kUnknown / sizeof kUnknown[0]; ++i) {
    const char* name = kvr_status_str(kUnknown[i]);
    assert_non_null(name);
    assert_string_equal("KVR_UNKNOWN", name);
  }
}

static void error_object_carries_status_and_message(void** state) {
  kvr_router_options opts;
  kvr_router* router = (kvr_router*)(uintptr_t)0x1234;
  kvr_error* err = NULL;
  const char* message;
  (void)state;
  kvr_router_options_init(&opts, sizeof opts);
  opts.block_size = 0;
  assert_int_equal(KVR_INVALID_ARGUMENT, kvr_router_new(&opts, &router, &err));
  /* On failure the out parameter is left untouched. */
  assert_ptr_equal((kvr_router*)(uintptr_t)0x1234, router);
  assert_non_null(err);
  assert_int_equal(KVR_INVALID_ARGUMENT, kvr_error_status(err));
  message = kvr_error_message(err);
  assert_non_null(message);
  assert_true(strlen(message) > 0);
  /* The message is stable until the error is freed. */
  assert_ptr_equal(message, kvr_error_message(err));
  kvr_error_free(err);
}

static void error_objects_are_independent(void** state) {
  kvr_error* first = NULL;
  kvr_error* second = NULL;
  kvr_router* router = NULL;
  kvr_router_options opts;
  (void)state;
  kvr_router_options_init(&opts, sizeof opts);
  opts.block_size = 0;
  assert_int_equal(KVR_INVALID_ARGUMENT, kvr_router_new(&opts, &router, &first));
  kvr_router_options_init(&opts, sizeof opts);
  opts.temperature = -1.0;
  assert_int_equal(KVR_INVALID_ARGUMENT, kvr_router_new(&opts, &router, &second));
  assert_null(router);
  assert_non_null(first);
  assert_non_null(second);
  assert_ptr_not_equal(first, second);
  /* No thread-local "last error": the first object still says what went wrong first. */
  assert_non_null(strstr(kvr_error_message(first), "block"));
  assert_non_null(strstr(kvr_error_message(second), "temperature"));
  kvr_error_free(second);
  assert_non_null(strstr(kvr_error_message(first), "block"));
  kvr_error_free(first);
}

static void success_leaves_error_null(void** state) {
  kvr_router* router = NULL;
  kvr_error* err = NULL;
  (void)state;
  assert_int_equal(KVR_OK, kvr_router_new(NULL, &router, &err));
  assert_null(err);
  assert_non_null(router);
  kvr_router_free(router);
}

static void free_functions_accept_null(void** state) {
  (void)state;
  kvr_error_free(NULL);
  kvr_buffer_free(NULL);
  kvr_router_free(NULL);
}

static void tier_from_medium(void** state) {
  (void)state;
  assert_int_equal(KVR_TIER_DEVICE, kvr_tier_from_medium(NULL));
  assert_int_equal(KVR_TIER_DEVICE, kvr_tier_from_medium(""));
  assert_int_equal(KVR_TIER_DEVICE, kvr_tier_from_medium("GPU"));
  assert_int_equal(KVR_TIER_DEVICE, kvr_tier_from_medium("gpu"));
  assert_int_equal(KVR_TIER_DEVICE, kvr_tier_from_medium("DEVICE"));
  assert_int_equal(KVR_TIER_HOST_PINNED, kvr_tier_from_medium("CPU_PINNED"));
  assert_int_equal(KVR_TIER_HOST_PINNED, kvr_tier_from_medium("cpu_pinned"));
  assert_int_equal(KVR_TIER_HOST_PINNED, kvr_tier_from_medium("CPU_TIER1"));
  assert_int_equal(KVR_TIER_DISK, kvr_tier_from_medium("DISK"));
  assert_int_equal(KVR_TIER_DISK, kvr_tier_from_medium("Disk"));
  assert_int_equal(KVR_TIER_DISK, kvr_tier_from_medium("CPU_TIER2"));
  assert_int_equal(KVR_TIER_DISK, kvr_tier_from_medium("NVME"));
  assert_int_equal(KVR_TIER_EXTERNAL, kvr_tier_from_medium("EXTERNAL"));
  assert_int_equal(KVR_TIER_EXTERNAL, kvr_tier_from_medium("network"));
  assert_int_equal(KVR_TIER_EXTERNAL, kvr_tier_from_medium("REMOTE"));
  assert_int_equal(KVR_TIER_EXTERNAL, kvr_tier_from_medium("SHARED"));
  assert_int_equal(KVR_TIER_HOST_PINNED, kvr_tier_from_medium("CPU"));
  assert_int_equal(KVR_TIER_DISK, kvr_tier_from_medium("STORAGE"));
  assert_int_equal(KVR_TIER_EXTERNAL, kvr_tier_from_medium("SHARED_STORAGE"));
  assert_int_equal(KVR_TIER_DEVICE, kvr_tier_from_medium("no-such-medium"));
}

static void init_functions_set_struct_size_and_defaults(void** state) {
  kvr_router_options router;
  kvr_worker_config worker;
  kvr_hash_options hash;
  kvr_stored_event stored;
  kvr_removed_event removed;
  kvr_request_options request;
  kvr_route_result result;
  kvr_metrics metrics;
  (void)state;

  memset(&router, 0xAB, sizeof router);
  kvr_router_options_init(&router, sizeof router);
  assert_int_equal(sizeof router, router.struct_size);
  assert_int_equal(16, router.block_size);
  assert_int_equal(0, router.flags);
  assert_int_equal(KVR_QUEUE_FCFS, router.queue_policy);
  assert_true(router.overlap_score_credit == 1.0);
  assert_true(router.prefill_load_scale == 1.0);
  assert_true(router.host_cache_hit_weight == 0.75);
  assert_true(router.disk_cache_hit_weight == 0.25);
  assert_true(router.temperature == 0.0);
  assert_true(router.queue_threshold < 0); /* never queue */
  assert_true(router.approx_ttl_seconds == 120.0);
  assert_int_equal((uint64_t)1 << 20, router.approx_max_blocks);
  assert_true(router.approx_prune_target_ratio == 0.8);
  assert_true(router.request_expiry_seconds == 300.0);
  assert_int_equal(0, router.random_seed);

  memset(&worker, 0xAB, sizeof worker);
  kvr_worker_config_init(&worker, sizeof worker);
  assert_int_equal(sizeof worker, worker.struct_size);
  assert_int_equal(0, worker.block_size);
  assert_int_equal(0, worker.dp_start);
  assert_int_equal(1, worker.dp_size);
  assert_int_equal(0, worker.total_kv_blocks);
  assert_int_equal(0, worker.max_num_batched_tokens);

  memset(&hash, 0xAB, sizeof hash);
  kvr_hash_options_init(&hash, sizeof hash);
  assert_int_equal(sizeof hash, hash.struct_size);
  assert_int_equal(0, hash.flags);
  assert_null(hash.lora_name);
  assert_null(hash.cache_namespace);
  assert_null(hash.mm_hashes);
  assert_null(hash.mm_counts);
  assert_int_equal(0, hash.mm_num_blocks);

  memset(&stored, 0xAB, sizeof stored);
  kvr_stored_event_init(&stored, sizeof stored);
  assert_int_equal(sizeof stored, stored.struct_size);
  assert_int_equal(KVR_TIER_DEVICE, stored.tier);
  assert_int_equal(0, stored.flags);
  assert_int_equal(0, stored.num_blocks);
  assert_null(stored.block_hashes);
  assert_null(stored.local_hashes);
  assert_null(stored.token_ids);
  assert_null(stored.lora_name);
  assert_null(stored.mm_counts);

  memset(&removed, 0xAB, sizeof removed);
  kvr_removed_event_init(&removed, sizeof removed);
  assert_int_equal(sizeof removed, removed.struct_size);
  assert_int_equal(KVR_TIER_DEVICE, removed.tier);
  assert_int_equal(0, removed.num_blocks);
  assert_null(removed.block_hashes);

  memset(&request, 0xAB, sizeof request);
  kvr_request_options_init(&request, sizeof request);
  assert_int_equal(sizeof request, request.struct_size);
  assert_int_equal(0, request.flags);
  assert_null(request.request_id);
  assert_null(request.lora_name);
  assert_null(request.cache_namespace);
  assert_null(request.allowed_worker_ids);
  assert_int_equal(0, request.num_allowed_worker_ids);
  assert_true(isnan(request.overlap_score_credit));
  assert_true(isnan(request.prefill_load_scale));
  assert_true(isnan(request.host_cache_hit_weight));
  assert_true(isnan(request.disk_cache_hit_weight));
  assert_true(isnan(request.temperature));
  assert_int_equal(-1, request.assume_kv_reuse);
  assert_int_equal(-1, request.track_prefill_tokens);
  assert_true(request.priority_jump == 0.0);
  assert_int_equal(0, request.expected_output_tokens);
  assert_int_equal(-1, request.queue_timeout_ms);

  memset(&result, 0xAB, sizeof result);
  kvr_route_result_init(&result, sizeof result);
  assert_int_equal(sizeof result, result.struct_size);

  memset(&metrics, 0xAB, sizeof metrics);
  kvr_metrics_init(&metrics, sizeof metrics);
  assert_int_equal(sizeof metrics, metrics.struct_size);
}

/* Every _init, the same contract: NULL or a size too small for struct_size is refused with
 * nothing written; its own size gives KVR_OK and struct_size == size; a newer caller's larger
 * struct gets its unknown tail zero-filled; nothing is ever written past `size`. */
#define KVT_EVERY_INIT(X)                                                                         \
  X(kvr_hash_options, kvr_hash_options_init)                                                      \
  X(kvr_router_options, kvr_router_options_init)                                                  \
  X(kvr_worker_config, kvr_worker_config_init)                                                    \
  X(kvr_stored_event, kvr_stored_event_init) X(kvr_removed_event, kvr_removed_event_init)         \
      X(kvr_request_options, kvr_request_options_init) X(kvr_route_result, kvr_route_result_init) \
          X(kvr_metrics, kvr_metrics_init) X(kvr_routing_hints, kvr_routing_hints_init)           \
              X(kvr_route_signals, kvr_route_signals_init)                                        \
                  X(kvr_disagg_options, kvr_disagg_options_init)                                  \
                      X(kvr_prefill_result, kvr_prefill_result_init)                              \
                          X(kvr_ingest_options, kvr_ingest_options_init)                          \
                              X(kvr_engine_worker, kvr_engine_worker_init)                        \
                                  X(kvr_ingest_stats, kvr_ingest_stats_init)

enum { kGuard = 32 };

static void check_sized_init(const char* name, size_t size,
                             kvr_status (*init)(void* p, size_t size)) {
  unsigned char buf[1024 + 2 * kGuard];
  unsigned char* p = buf + kGuard;
  size_t i;
  uint32_t recorded;
  assert_true(size + 16 + 2 * kGuard <= sizeof buf);
  fprintf(stderr, "  %s (%zu bytes)\n", name, size);

  assert_int_equal(KVR_INVALID_ARGUMENT, init(NULL, size));
  memset(buf, 0xAB, sizeof buf);
  assert_int_equal(KVR_INVALID_ARGUMENT, init(p, 3));
  for (i = 0; i < sizeof buf; ++i) assert_int_equal(0xAB, buf[i]);

  memset(buf, 0xAB, sizeof buf);
  assert_int_equal(KVR_OK, init(p, size));
  memcpy(&recorded, p, sizeof recorded);
  assert_int_equal(size, recorded);
  for (i = 0; i < kGuard; ++i) assert_int_equal(0xAB, buf[i]);
  for (i = size; i < sizeof buf - kGuard; ++i) assert_int_equal(0xAB, p[i]);

  memset(buf, 0xAB, sizeof buf);
  assert_int_equal(KVR_OK, init(p, size + 16));
  memcpy(&recorded, p, sizeof recorded);
  assert_int_equal(size + 16, recorded);
  for (i = size; i < size + 16; ++i) assert_int_equal(0, p[i]);
  for (i = size + 16; i < sizeof buf - kGuard; ++i) assert_int_equal(0xAB, p[i]);
}

/* Each _init behind one signature, so that one check covers them all. */
#define KVT_ERASED_INIT_(type, init) \
  static kvr_status erased_##init(void* p, size_t size) { return init((type*)p, size); }
KVT_EVERY_INIT(KVT_ERASED_INIT_)
#undef KVT_ERASED_INIT_

static void init_functions_are_sized(void** state) {
  (void)state;
#define KVT_CHECK_INIT_(type, init) check_sized_init(#type, sizeof(type), erased_##init);
  KVT_EVERY_INIT(KVT_CHECK_INIT_)
#undef KVT_CHECK_INIT_
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(version_matches_header),
      cmocka_unit_test(status_str_names_every_code),
      cmocka_unit_test(status_str_unknown_code),
      cmocka_unit_test(error_object_carries_status_and_message),
      cmocka_unit_test(error_objects_are_independent),
      cmocka_unit_test(success_leaves_error_null),
      cmocka_unit_test(free_functions_accept_null),
      cmocka_unit_test(tier_from_medium),
      cmocka_unit_test(init_functions_set_struct_size_and_defaults),
      cmocka_unit_test(init_functions_are_sized),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
