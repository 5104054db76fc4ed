/* A program built against an installed kvrouter (a staging prefix, or the Debian packages), by
 * scripts/test-packaging.sh: once through pkg-config, once through CMake's find_package. It
 * routes one request through the C ABI and exits non-zero, saying what went wrong, unless the
 * header and the library agree on the version and the worker that cached the prompt wins.
 * Compiled with -DKVR_CONSUMER_ROUTING_ONLY (scripts/test-routing-only.sh), it also checks that
 * the library it loaded has no transport: the ingest functions return KVR_UNIMPLEMENTED and
 * say which build options left them out. */
#include <kvrouter.h>
#include <stdio.h>
#include <string.h>

static int failures = 0;

static void check(int ok, const char* what) {
  if (!ok) {
    fprintf(stderr, "consumer: FAILED: %s\n", what);
    ++failures;
  }
}

static int check_status(kvr_status status, kvr_error* err, const char* what) {
  if (status == KVR_OK) return 1;
  fprintf(stderr, "consumer: FAILED: %s: %s: %s\n", what, kvr_status_str(status),
          err != NULL ? kvr_error_message(err) : "(no details)");
  kvr_error_free(err);
  ++failures;
  return 0;
}

int main(void) {
  enum { kBlockSize = 16, kPromptTokens = 48, kCachedBlocks = 2 };
  kvr_router_options options;
  kvr_router* router = NULL;
  kvr_error* err = NULL;

  /* The header this program was compiled with and the library it loaded are the same release. */
  check(kvr_version() == KVR_VERSION_NUMBER, "kvr_version() differs from KVR_VERSION_NUMBER");

  kvr_router_options_init(&options, sizeof options);
  options.block_size = kBlockSize;
  if (!check_status(kvr_router_new(&options, &router, &err), err, "kvr_router_new")) return 1;

  for (uint64_t id = 1; id <= 2; ++id) {
    kvr_worker_config worker;
    kvr_worker_config_init(&worker, sizeof worker);
    worker.worker_id = id;
    err = NULL;
    check_status(kvr_router_add_worker(router, &worker, &err), err, "kvr_router_add_worker");
  }

  /* Worker 2's engine reports the prompt's first two blocks as stored. */
  uint32_t prompt[kPromptTokens];
  for (uint32_t i = 0; i < kPromptTokens; ++i) prompt[i] = 7000 + i;
  uint64_t engine_hashes[kCachedBlocks] = {0xB1, 0xB2};
  kvr_stored_event stored;
  kvr_stored_event_init(&stored, sizeof stored);
  stored.worker_id = 2;
  stored.block_hashes = engine_hashes;
  stored.num_blocks = kCachedBlocks;
  stored.token_ids = prompt;
  stored.num_tokens = kCachedBlocks * kBlockSize;
  err = NULL;
  check_status(kvr_router_apply_stored(router, &stored, &err), err, "kvr_router_apply_stored");

  /* Route and admit: worker 2 holds two of the prompt's three blocks, so it must win. */
  kvr_request_options request;
  kvr_request_options_init(&request, sizeof request);
  request.flags = KVR_REQUEST_ADMIT;
  request.request_id = "package-consumer-1";
  kvr_route_result result;
  kvr_route_result_init(&result, sizeof result);
  err = NULL;
  if (check_status(kvr_find_best_match(router, prompt, kPromptTokens, &request, &result, NULL, 0,
                                       NULL, &err),
                   err, "kvr_find_best_match")) {
    check(result.worker_id == 2, "the request did not go to worker 2, which cached the prompt");
    check(result.prompt_blocks == kPromptTokens / kBlockSize, "wrong prompt_blocks");
    check(result.device_overlap_blocks == kCachedBlocks, "wrong device_overlap_blocks");
    check(result.cached_tokens == kCachedBlocks * kBlockSize, "wrong cached_tokens");
    check(result.booked == 1, "the admitted request was not booked");
    err = NULL;
    check_status(kvr_router_free_request(router, "package-consumer-1", &err), err,
                 "kvr_router_free_request");
  }
#ifdef KVR_CONSUMER_ROUTING_ONLY
  {
    kvr_ingest* ingest = NULL;
    kvr_engine_worker worker;
    const char* message;
    err = NULL;
    check(kvr_ingest_new(router, NULL, &ingest, &err) == KVR_UNIMPLEMENTED,
          "kvr_ingest_new did not return KVR_UNIMPLEMENTED");
    message = err != NULL ? kvr_error_message(err) : "";
    check(strstr(message, "-DKVR_WITH_ZMQ=OFF") != NULL && strstr(message, "-DKVR_WITH_NATS=OFF"),
          "kvr_ingest_new's message does not name both options");
    printf("consumer: kvr_ingest_new: %s: %s\n", kvr_status_str(KVR_UNIMPLEMENTED), message);
    kvr_error_free(err);
    check(ingest == NULL, "kvr_ingest_new made an ingest object");
    err = NULL;
    check(kvr_ingest_subscribe_nats(NULL, "nats://127.0.0.1:4222", "kv", NULL, &err) ==
                  KVR_UNIMPLEMENTED &&
              err != NULL && strstr(kvr_error_message(err), "-DKVR_WITH_NATS=OFF") != NULL,
          "kvr_ingest_subscribe_nats is not KVR_UNIMPLEMENTED naming KVR_WITH_NATS");
    kvr_error_free(err);
    kvr_engine_worker_init(&worker, sizeof worker);
    worker.endpoint = "tcp://127.0.0.1:5557";
    err = NULL;
    check(kvr_ingest_add_engine_worker(NULL, &worker, NULL, &err) == KVR_UNIMPLEMENTED &&
              err != NULL && strstr(kvr_error_message(err), "-DKVR_WITH_ZMQ=OFF") != NULL,
          "kvr_ingest_add_engine_worker is not KVR_UNIMPLEMENTED naming KVR_WITH_ZMQ");
    kvr_error_free(err);
  }
#endif
  kvr_router_free(router);

  if (failures != 0) {
    fprintf(stderr, "consumer: %d check(s) FAILED\n", failures);
    return 1;
  }
  printf("consumer: kvrouter %s routed to worker %llu with %llu tokens cached: OK\n",
         kvr_version_string(), (unsigned long long)result.worker_id,
         (unsigned long long)result.cached_tokens);
  return 0;
}
