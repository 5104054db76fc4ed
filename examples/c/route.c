/* route.c: a tiny C gateway using kvrouter through its C ABI only.
 *
 * It registers four workers, tells the router that worker 3 has cached a long system prompt
 * (a KV "stored" event carrying the prompt's token ids, as an engine would publish it), routes
 * a few requests, and walks them through their lifecycle: prefill completed, then freed.
 * A request that starts with the system prompt must land on worker 3; requests with unrelated
 * prompts spread over the other workers. Exits non-zero on a wrong decision.
 *
 * Build: cc -std=c11 route.c -lkvrouter (the build tree does it: target example_route). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrouter.h"

#define BLOCK_SIZE 16
#define NUM_WORKERS 4
#define CACHING_WORKER 3
#define SYSTEM_PROMPT_TOKENS (64 * BLOCK_SIZE) /* a 1,024-token system prompt */
#define QUESTION_TOKENS 40

/* Prints the failure and its message, frees the error, and returns 1. */
static int report(const char* what, kvr_status status, kvr_error* err) {
  fprintf(stderr, "%s failed: %s: %s\n", what, kvr_status_str(status),
          err != NULL ? kvr_error_message(err) : "(no details)");
  kvr_error_free(err);
  return 1;
}

#define CHECK(what, call)                                      \
  do {                                                         \
    kvr_error* err_ = NULL;                                    \
    kvr_error** ERR = &err_;                                   \
    kvr_status status_ = (call);                               \
    if (status_ != KVR_OK) return report(what, status_, err_); \
  } while (0)

/* A made-up tokenizer: token ids first, first + 1, ... */
static void fill(uint32_t* tokens, size_t n, uint32_t first) {
  size_t i;
  for (i = 0; i < n; ++i) tokens[i] = first + (uint32_t)i;
}

/* Routes one request with admission (it is booked on the chosen worker) and prints the
 * decision with every candidate's cost. */
static int route(kvr_router* router, const char* id, const uint32_t* tokens, size_t n,
                 kvr_route_result* result) {
  kvr_request_options opts;
  kvr_candidate candidates[NUM_WORKERS];
  size_t num_candidates = 0;
  size_t i;
  kvr_request_options_init(&opts, sizeof opts);
  opts.flags = KVR_REQUEST_ADMIT;
  opts.request_id = id;
  kvr_route_result_init(result, sizeof *result);
  CHECK("kvr_find_best_match", kvr_find_best_match(router, tokens, n, &opts, result, candidates,
                                                   NUM_WORKERS, &num_candidates, ERR));
  printf(
      "request %-10s %4zu tokens -> worker %llu (rank %u): %u of %u blocks cached, "
      "cost %.2f\n",
      id, n, (unsigned long long)result->worker_id, (unsigned)result->dp_rank,
      (unsigned)result->device_overlap_blocks, (unsigned)result->prompt_blocks, result->cost);
  for (i = 0; i < num_candidates && i < NUM_WORKERS; ++i) {
    const kvr_candidate* c = &candidates[i];
    printf(
        "    %s worker %llu: overlap %2u blocks, prefill cost %6.2f + decode blocks %3llu "
        "= %6.2f\n",
        c->chosen ? "*" : " ", (unsigned long long)c->worker_id, (unsigned)c->device_blocks,
        c->prefill_cost, (unsigned long long)c->decode_blocks, c->cost);
  }
  return 0;
}

/* 7. A pin sends a request to the worker it names; a session's later turns follow its first
 *    turn (hard affinity) even when the prompt is cached on another worker. */
static int pins_and_sessions(kvr_router* router, const uint32_t* prompt, size_t n,
                             const uint32_t* cached_prompt, size_t cached_n) {
  kvr_request_options req;
  kvr_routing_hints hints;
  kvr_route_signals preview, turn1, turn2;
  int failures = 0;
  kvr_request_options_init(&req, sizeof req);
  kvr_routing_hints_init(&hints, sizeof hints);
  hints.worker_id = 1;
  kvr_route_signals_init(&preview, sizeof preview);
  CHECK("kvr_preview_route (pinned)",
        kvr_preview_route(router, prompt, n, &req, &hints, &preview, ERR));
  printf("\npinned to worker 1 -> worker %llu\n", (unsigned long long)preview.worker_id);
  if (preview.worker_id != 1) {
    printf("  => WRONG: the pin was not followed\n");
    ++failures;
  }

  kvr_routing_hints_init(&hints, sizeof hints);
  hints.session_id = "chat-7";
  hints.worker_id = 2; /* turn 1 is pinned, so the session binds to worker 2 */
  req.request_id = "chat-7-turn-1";
  kvr_route_signals_init(&turn1, sizeof turn1);
  CHECK("kvr_plan_route (turn 1)",
        kvr_plan_route(router, prompt, n, &req, &hints, NULL, &turn1, ERR));
  CHECK("kvr_commit_route (turn 1)", kvr_commit_route(router, "chat-7-turn-1", ERR));
  CHECK("kvr_router_free_request", kvr_router_free_request(router, "chat-7-turn-1", ERR));
  /* Turn 2 sends the cached system prompt, which alone would pull it to the caching worker. */
  hints.worker_id = KVR_WORKER_NONE;
  req.request_id = "chat-7-turn-2";
  kvr_route_signals_init(&turn2, sizeof turn2);
  CHECK("kvr_plan_route (turn 2)",
        kvr_plan_route(router, cached_prompt, cached_n, &req, &hints, NULL, &turn2, ERR));
  CHECK("kvr_commit_route (turn 2)", kvr_commit_route(router, "chat-7-turn-2", ERR));
  CHECK("kvr_router_free_request", kvr_router_free_request(router, "chat-7-turn-2", ERR));
  printf("session chat-7: turn 1 -> worker %llu, turn 2 -> worker %llu\n",
         (unsigned long long)turn1.worker_id, (unsigned long long)turn2.worker_id);
  if (turn1.worker_id != 2 || turn2.worker_id != turn1.worker_id) {
    printf("  => WRONG: the session did not stay on its worker\n");
    ++failures;
  }
  return failures;
}

/* 8. Disaggregated serving: a prefill pool (workers 10, 11) and a decode pool (20, 21). The
 *    prefill is booked on a prefill worker with a bootstrap room for the KV transfer; the
 *    decode is then balanced on decode load alone. */
static int disaggregated(const uint32_t* prompt, size_t n) {
  kvr_router_options pool;
  kvr_disagg* disagg = NULL;
  kvr_worker_config worker;
  kvr_request_options req;
  kvr_prefill_result prefill;
  kvr_route_signals decode;
  uint64_t id;
  int failures = 0;
  kvr_router_options_init(&pool, sizeof pool);
  pool.block_size = BLOCK_SIZE;
  CHECK("kvr_disagg_new", kvr_disagg_new(&pool, &pool, NULL, &disagg, ERR));
  for (id = 10; id <= 11; ++id) {
    kvr_worker_config_init(&worker, sizeof worker);
    worker.worker_id = id;
    CHECK("kvr_router_add_worker (prefill)",
          kvr_router_add_worker(kvr_disagg_prefill_router(disagg), &worker, ERR));
    worker.worker_id = id + 10;
    CHECK("kvr_router_add_worker (decode)",
          kvr_router_add_worker(kvr_disagg_decode_router(disagg), &worker, ERR));
  }
  kvr_request_options_init(&req, sizeof req);
  req.request_id = "disagg-1";
  kvr_prefill_result_init(&prefill, sizeof prefill);
  CHECK("kvr_disagg_route_prefill",
        kvr_disagg_route_prefill(disagg, prompt, n, &req, NULL, &prefill, ERR));
  kvr_route_signals_init(&decode, sizeof decode);
  CHECK("kvr_disagg_route_decode",
        kvr_disagg_route_decode(disagg, prompt, n, &req, NULL, (int)prefill.remote, &decode, ERR));
  printf("\ndisaggregated: prefill on worker %llu (bootstrap room %lld), decode on worker %llu\n",
         (unsigned long long)prefill.worker_id, (long long)prefill.bootstrap_room,
         (unsigned long long)decode.worker_id);
  if (!prefill.remote || prefill.worker_id < 10 || prefill.worker_id > 11 ||
      decode.worker_id < 20 || decode.worker_id > 21) {
    printf("  => WRONG: prefill and decode should run in their own pools\n");
    ++failures;
  }
  CHECK("kvr_router_free_request (prefill)",
        kvr_router_free_request(kvr_disagg_prefill_router(disagg), "disagg-1", ERR));
  CHECK("kvr_router_free_request (decode)",
        kvr_router_free_request(kvr_disagg_decode_router(disagg), "disagg-1", ERR));
  kvr_disagg_free(disagg);
  return failures;
}

int main(void) {
  static uint32_t system_prompt[SYSTEM_PROMPT_TOKENS];
  static uint32_t with_system[SYSTEM_PROMPT_TOKENS + QUESTION_TOKENS];
  static uint32_t other[3][8 * BLOCK_SIZE];
  static uint64_t block_hashes[SYSTEM_PROMPT_TOKENS / BLOCK_SIZE];
  const char* other_ids[3] = {"chat-a", "chat-b", "chat-c"};
  kvr_router_options options;
  kvr_router* router = NULL;
  kvr_worker_config worker;
  kvr_stored_event stored;
  kvr_route_result result;
  kvr_metrics metrics;
  int used[NUM_WORKERS + 1] = {0};
  int failures = 0;
  uint64_t id;
  size_t i;

  printf("kvrouter %s (header %s)\n", kvr_version_string(), KVR_VERSION_STRING);

  /* 1. A router with 16-token blocks and otherwise Dynamo's defaults. */
  kvr_router_options_init(&options, sizeof options);
  options.block_size = BLOCK_SIZE;
  CHECK("kvr_router_new", kvr_router_new(&options, &router, ERR));

  /* 2. Four workers, one data-parallel rank each. */
  for (id = 1; id <= NUM_WORKERS; ++id) {
    kvr_worker_config_init(&worker, sizeof worker);
    worker.worker_id = id;
    worker.total_kv_blocks = 8192;
    worker.max_num_batched_tokens = 8192;
    CHECK("kvr_router_add_worker", kvr_router_add_worker(router, &worker, ERR));
  }
  printf("registered %d workers\n", NUM_WORKERS);

  /* 3. Worker 3's engine reports that it cached the system prompt: one stored event with the
   *    engine's own block hashes and the tokens of every block. */
  fill(system_prompt, SYSTEM_PROMPT_TOKENS, 1000);
  for (i = 0; i < SYSTEM_PROMPT_TOKENS / BLOCK_SIZE; ++i) block_hashes[i] = 0xC0DE0000u + i;
  kvr_stored_event_init(&stored, sizeof stored);
  stored.worker_id = CACHING_WORKER;
  stored.event_id = 1;
  stored.tier = kvr_tier_from_medium("GPU");
  stored.block_hashes = block_hashes;
  stored.num_blocks = SYSTEM_PROMPT_TOKENS / BLOCK_SIZE;
  stored.token_ids = system_prompt;
  stored.num_tokens = SYSTEM_PROMPT_TOKENS;
  CHECK("kvr_router_apply_stored", kvr_router_apply_stored(router, &stored, ERR));
  printf("worker %d cached a %d-token system prompt (%d blocks)\n\n", CACHING_WORKER,
         SYSTEM_PROMPT_TOKENS, SYSTEM_PROMPT_TOKENS / BLOCK_SIZE);

  /* 4. A request that starts with the system prompt, then three unrelated ones. */
  memcpy(with_system, system_prompt, sizeof system_prompt);
  fill(with_system + SYSTEM_PROMPT_TOKENS, QUESTION_TOKENS, 50000);
  if (route(router, "agent-1", with_system, SYSTEM_PROMPT_TOKENS + QUESTION_TOKENS, &result)) {
    return 1;
  }
  if (result.worker_id == CACHING_WORKER) {
    printf(
        "  => shared-prefix request went to worker %llu, the worker that cached the prompt: "
        "OK\n\n",
        (unsigned long long)result.worker_id);
  } else {
    printf("  => WRONG: shared-prefix request went to worker %llu, not to worker %d\n\n",
           (unsigned long long)result.worker_id, CACHING_WORKER);
    ++failures;
  }
  ++used[result.worker_id];

  for (i = 0; i < 3; ++i) {
    fill(other[i], 8 * BLOCK_SIZE, 100000 + 10000 * (uint32_t)i);
    if (route(router, other_ids[i], other[i], 8 * BLOCK_SIZE, &result)) return 1;
    if (result.worker_id >= 1 && result.worker_id <= NUM_WORKERS) ++used[result.worker_id];
  }
  /* Each booking makes its worker busier, so the four requests use four workers. */
  for (id = 1; id <= NUM_WORKERS; ++id) {
    if (used[id] != 1) {
      printf("  => WRONG: worker %llu got %d requests; expected the load to spread\n",
             (unsigned long long)id, used[id]);
      ++failures;
    }
  }
  if (failures == 0) printf("  => the unrelated requests spread over the other workers: OK\n");

  /* 5. Lifecycle: prefill finished (first token out), then each request ends. */
  kvr_metrics_init(&metrics, sizeof metrics);
  CHECK("kvr_router_get_metrics", kvr_router_get_metrics(router, &metrics, ERR));
  printf("\nactive requests: %llu\n", (unsigned long long)metrics.requests_active);
  CHECK("kvr_router_mark_prefill_completed",
        kvr_router_mark_prefill_completed(router, "agent-1", ERR));
  printf("agent-1: prefill completed\n");
  CHECK("kvr_router_free_request", kvr_router_free_request(router, "agent-1", ERR));
  printf("agent-1: freed\n");
  for (i = 0; i < 3; ++i) {
    CHECK("kvr_router_mark_prefill_completed",
          kvr_router_mark_prefill_completed(router, other_ids[i], ERR));
    CHECK("kvr_router_free_request", kvr_router_free_request(router, other_ids[i], ERR));
    printf("%s: prefill completed, freed\n", other_ids[i]);
  }
  CHECK("kvr_router_get_metrics", kvr_router_get_metrics(router, &metrics, ERR));
  printf("active requests: %llu, routing decisions: %llu, KV events applied: %llu\n",
         (unsigned long long)metrics.requests_active, (unsigned long long)metrics.decisions,
         (unsigned long long)metrics.events[KVR_EVENT_STORED][KVR_EVENT_OK]);
  if (metrics.requests_active != 0) {
    printf("  => WRONG: requests still active after being freed\n");
    ++failures;
  }

  /* 6. Staged routing, as a gateway that decides in steps: preview (changes nothing), plan
   *    from the preview (books it), commit once dispatched, free when it ends. */
  {
    kvr_request_options staged;
    kvr_route_signals preview, plan;
    kvr_request_options_init(&staged, sizeof staged);
    staged.request_id = "agent-2";
    kvr_route_signals_init(&preview, sizeof preview);
    kvr_route_signals_init(&plan, sizeof plan);
    CHECK("kvr_preview_route",
          kvr_preview_route(router, with_system, SYSTEM_PROMPT_TOKENS + QUESTION_TOKENS, &staged,
                            NULL, &preview, ERR));
    printf("\npreview agent-2 -> worker %llu: %llu cached tokens, %llu/%llu KV blocks, cost %.2f\n",
           (unsigned long long)preview.worker_id, (unsigned long long)preview.cached_tokens,
           (unsigned long long)preview.potential_decode_blocks,
           (unsigned long long)preview.total_kv_blocks, preview.cost);
    CHECK("kvr_plan_route",
          kvr_plan_route(router, with_system, SYSTEM_PROMPT_TOKENS + QUESTION_TOKENS, &staged, NULL,
                         &preview, &plan, ERR));
    CHECK("kvr_commit_route", kvr_commit_route(router, "agent-2", ERR));
    printf("planned on worker %llu%s, committed\n", (unsigned long long)plan.worker_id,
           plan.moved ? " (moved from the preview)" : "");
    if (plan.worker_id != CACHING_WORKER) {
      printf("  => WRONG: the staged request left the worker that cached its prompt\n");
      ++failures;
    }
    CHECK("kvr_router_free_request", kvr_router_free_request(router, "agent-2", ERR));
  }

  failures += pins_and_sessions(router, other[0], 8 * BLOCK_SIZE, with_system,
                                SYSTEM_PROMPT_TOKENS + QUESTION_TOKENS);
  failures += disaggregated(other[1], 8 * BLOCK_SIZE);

  kvr_router_free(router);
  printf("%s\n", failures == 0 ? "all decisions as expected" : "some decisions were WRONG");
  return failures == 0 ? 0 : 1;
}
