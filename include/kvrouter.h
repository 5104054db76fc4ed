/* kvrouter: a KV-cache-aware LLM request router, as a stable C ABI.
 *
 * A gateway creates a router, registers its workers, feeds it the KV events its engines publish
 * (or lets it run in approximate mode without events), and asks it, per request, which worker
 * and data-parallel rank should serve a prompt: kvr_find_best_match. It then tells the router
 * when the request's prefill finished and when it ended, so the router's view of every worker's
 * load stays true.
 *
 * Conventions (they hold for every function below):
 * - Fallible functions return a kvr_status (KVR_OK == 0) and take an optional last argument
 *   `kvr_error **err`: pass NULL to ignore details, or the address of a NULL kvr_error* to get
 *   a caller-owned error object on failure (free it with kvr_error_free; an error already
 *   held there is freed and replaced; if the heap refuses the new one, *err is left NULL and
 *   the status alone tells). On failure, out parameters are left untouched unless stated
 *   otherwise. There is no thread-local state.
 * - Options and result structs begin with `uint32_t struct_size`. Initialise one with its _init
 *   function and the size of the struct as the caller compiled it, before filling fields:
 *       kvr_router_options options;
 *       kvr_router_options_init(&options, sizeof options);
 *   _init writes the defaults no further than `size` bytes, zero-fills whatever a newer header
 *   added past the fields this library knows, and records `size` in struct_size. The library
 *   then reads only the fields a caller's struct_size covers (an older caller gets defaults for
 *   the rest), writes results no further than it, and refuses a larger struct whose unknown
 *   tail is not all zero, or an input struct whose `reserved` fields are not 0. A size no
 *   header's struct has (below the struct's first released layout, ending inside a field, or
 *   over 4 KiB beyond this library's struct) is refused:
 *   KVR_INVALID_ARGUMENT from _init and from every call given it. Fields are only ever
 *   appended, and a struct has no padding, so each size names one layout. The rules, and how
 *   the ABI tests hold the library to them, are in docs/api-stability.md.
 * - Documents named here (README.md, the docs/ pages, the schema/ files) are installed with this
 *   header: under share/doc/kvrouter/ and share/kvrouter/schema/ of the install prefix.
 * - Array-element structs (kvr_candidate, kvr_overlap, kvr_potential_load) have a fixed layout
 *   forever, with reserved fields for growth.
 * - Enumerated values have a typedef'd integer type (kvr_tier, ...) and their constants come
 *   from one X-macro list per enumeration (KVR_TIER_MAP, ...): X(NAME, VALUE, DESCRIPTION).
 *   Values never change meaning; new ones are added at the end. Flags (KVR_ROUTER_*, ...) are
 *   unsigned macros, combined with |. A value or flag bit this library does not know is
 *   refused (KVR_INVALID_ARGUMENT), as a newer caller's unknown fields are.
 * - Inputs (token arrays, strings, buffers) are borrowed only for the duration of the call;
 *   the library copies what it keeps. An array given with a count no buffer can hold (its bytes
 *   past PTRDIFF_MAX) is KVR_INVALID_ARGUMENT. Array results go into caller buffers (`out` may
 *   be NULL only with `cap` 0; `len` is required): `*len` is set to the count written, or,
 *   when `cap` is too small, to the count needed, with KVR_BUFFER_TOO_SMALL.
 * - Every _free function accepts NULL. Nothing returned is to be passed to free().
 * - Every entry point catches every C++ exception: running out of memory returns
 *   KVR_RESOURCE_EXHAUSTED ("out of memory"; what the call had changed is undone, or, for a KV
 *   event refused midway, its rank is left holding nothing), any other KVR_INTERNAL with its
 *   message.
 * - Thread-safety is stated per function: "concurrent" = any thread, any time, concurrently
 *   with any other call on the same handle; "none" = no other call on that handle may run
 *   concurrently (the _free functions, and an event batch's or a publisher's calls, each for
 *   its own handle).
 */
#ifndef KVROUTER_H
#define KVROUTER_H

#include <stddef.h>
#include <stdint.h>

#include "kvrouter_version.h"

#if defined(_WIN32) && defined(KVR_BUILDING_LIBRARY)
#define KVR_API __declspec(dllexport)
#elif defined(_WIN32) && !defined(KVR_STATIC)
#define KVR_API __declspec(dllimport)
#elif defined(__GNUC__) && __GNUC__ >= 4
#define KVR_API __attribute__((visibility("default")))
#else
#define KVR_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Version ------------------------------------------------------------------------------ */

/* The library's version as KVR_VERSION_NUMBER computes it (major*10000 + minor*100 + patch).
 * Compare with KVR_VERSION_NUMBER to detect a header/library mismatch.
 * @thread_safety concurrent */
KVR_API uint32_t kvr_version(void);

/* The library's version as "MAJOR.MINOR.PATCH"; a static string, never NULL.
 * @thread_safety concurrent */
KVR_API const char *kvr_version_string(void);

/* ---- Status and errors ------------------------------------------------------------------- */

/* A status code: an int32_t, not an enum type, so that adding codes never changes the ABI.
 * Codes below 100 are absl::StatusCode's numbers and never change meaning. */
typedef int32_t kvr_status;
#define KVR_STATUS_MAP(X)                                                                     \
  X(OK, 0, "success")                                                                         \
  X(CANCELLED, 1, "cancelled: the request was freed while it waited in the admission queue")  \
  X(INVALID_ARGUMENT, 3, "an argument or a struct field is invalid; the message names it")    \
  X(DEADLINE_EXCEEDED, 4, "a wait timed out: the request's queue timeout passed")             \
  X(NOT_FOUND, 5, "an unknown worker, rank, request, plan, session, source or block")         \
  X(ALREADY_EXISTS, 6, "a worker, request id, subscription or booking that exists already")   \
  X(RESOURCE_EXHAUSTED, 8, "a limit of the library was reached")                              \
  X(FAILED_PRECONDITION, 9, "the call does not fit the object's state or mode")               \
  X(UNIMPLEMENTED, 12, "a feature this build of the library does not have")                   \
  X(INTERNAL, 13, "a bug or an unexpected failure inside the library; the message says what") \
  X(UNAVAILABLE, 14, "no eligible worker, or a server or endpoint that cannot be reached")    \
  X(BUFFER_TOO_SMALL, 100, "a caller buffer was too small; *len says how many are needed")
enum kvr_status_code {
#define KVR_STATUS_ENUM_(name, value, description) KVR_##name = value,
  KVR_STATUS_MAP(KVR_STATUS_ENUM_)
#undef KVR_STATUS_ENUM_
};

/* The status's name ("KVR_NOT_FOUND", ...); a static string, never NULL ("KVR_UNKNOWN" for a
 * code this library does not know). @thread_safety concurrent */
KVR_API const char *kvr_status_str(kvr_status status);

/* A failure's status and message, owned by the caller. */
typedef struct kvr_error kvr_error;

/* The error's status; KVR_OK for NULL. @thread_safety concurrent (an error is immutable) */
KVR_API kvr_status kvr_error_status(const kvr_error *error);
/* The message; valid until kvr_error_free. Never NULL ("" for a NULL error).
 * @thread_safety concurrent */
KVR_API const char *kvr_error_message(const kvr_error *error);
/* Accepts NULL. @thread_safety none (for this error) */
KVR_API void kvr_error_free(kvr_error *error);

/* ---- Library-owned byte buffers ----------------------------------------------------------- */

typedef struct kvr_buffer kvr_buffer;
/* The bytes, valid until kvr_buffer_free (NULL for a NULL buffer), and their count (0 for a
 * NULL buffer). @thread_safety concurrent */
KVR_API const uint8_t *kvr_buffer_data(const kvr_buffer *buffer);
KVR_API size_t kvr_buffer_size(const kvr_buffer *buffer);
/* Accepts NULL. @thread_safety none (for this buffer) */
KVR_API void kvr_buffer_free(kvr_buffer *buffer);

/* ---- Storage tiers ------------------------------------------------------------------------ */

/* Where a cached block lives. A prompt's hit counts fully on the device and is weighted by
 * host_cache_hit_weight on host memory and disk_cache_hit_weight on disk and external storage. */
typedef uint32_t kvr_tier;
#define KVR_TIER_MAP(X)                                           \
  X(DEVICE, 0, "GPU memory (an engine's KV cache)")               \
  X(HOST_PINNED, 1, "host memory of the worker (CPU offloading)") \
  X(DISK, 2, "local disk of the worker")                          \
  X(EXTERNAL, 3, "storage shared beyond the worker (remote or network)")
enum kvr_tier_value {
#define KVR_TIER_ENUM_(name, value, description) KVR_TIER_##name = value,
  KVR_TIER_MAP(KVR_TIER_ENUM_)
#undef KVR_TIER_ENUM_
};

/* Maps an engine's "medium" string (case-insensitive) to a tier: GPU, DEVICE -> device; CPU,
 * CPU_PINNED, CPU_TIER1 -> host; CPU_TIER2, DISK, NVME, STORAGE -> disk; EXTERNAL, NETWORK,
 * REMOTE, SHARED, SHARED_STORAGE -> external (docs/ingest.md: which engine sends which). NULL or
 * unknown mediums are the device, as in Dynamo. @thread_safety concurrent */
KVR_API kvr_tier kvr_tier_from_medium(const char *medium);

/* ---- Block hashing (Dynamo-compatible, bit for bit) ---------------------------------------- */

/* kvr_hash_options.flags */
#define KVR_HASH_EAGLE 0x1u /* window of block_size + 1 tokens, stride block_size */

/* What changes a prompt's block hashes besides its tokens. Multimodal hashes are given as one
 * flat array plus a count per block: block i owns the next mm_counts[i] values of mm_hashes,
 * so mm_hashes must hold the sum of mm_counts values (the library reads that many; it cannot
 * check the array's length). */
typedef struct kvr_hash_options {
  uint32_t struct_size;
  uint32_t flags;              /* KVR_HASH_* */
  const char *lora_name;       /* NULL or "" = base model */
  const char *cache_namespace; /* NULL or "" = none */
  const uint64_t *mm_hashes;
  const size_t *mm_counts; /* NULL = no multimodal content */
  size_t mm_num_blocks;    /* entries in mm_counts */
} kvr_hash_options;

/* Every _init function works alike (see the conventions at the top): it writes the defaults
 * into the first `size` bytes of the struct (pass sizeof of the struct as compiled), zero-fills
 * any tail this library does not know and sets struct_size = size. KVR_INVALID_ARGUMENT, with
 * nothing written, for a NULL struct, a size below 4 (no room for struct_size) or above
 * UINT32_MAX; KVR_INVALID_ARGUMENT for a size no header's struct has (see the conventions): the
 * struct is then zero-filled up to `size` and struct_size records it, so that every call given
 * the struct refuses it with a message. Defaults here: no LoRA, no namespace, no multimodal,
 * not eagle. @thread_safety concurrent */
KVR_API kvr_status kvr_hash_options_init(kvr_hash_options *options, size_t size);

/* Local hashes of every complete block of `tokens`. opts may be NULL. block_size 0 is
 * KVR_INVALID_ARGUMENT. Needs floor(num_tokens / block_size) entries (one token fewer with
 * eagle): a shorter buffer is KVR_BUFFER_TOO_SMALL, with `*len` set, before anything is hashed.
 * @thread_safety concurrent */
KVR_API kvr_status kvr_compute_block_hashes(const uint32_t *tokens, size_t num_tokens,
                                            uint32_t block_size, const kvr_hash_options *opts,
                                            uint64_t *out, size_t cap, size_t *len,
                                            kvr_error **err);

/* Chained sequence hashes of local block hashes (one per input).
 * @thread_safety concurrent */
KVR_API kvr_status kvr_compute_sequence_hashes(const uint64_t *local_hashes, size_t num_hashes,
                                               uint64_t *out, size_t cap, size_t *len,
                                               kvr_error **err);

/* ---- Router ------------------------------------------------------------------------------- */

typedef struct kvr_router kvr_router;

/* kvr_router_options.flags; 0 = Dynamo's defaults */
#define KVR_ROUTER_APPROXIMATE 0x1u         /* no KV events: record routing decisions instead */
#define KVR_ROUTER_NO_KV_REUSE 0x2u         /* assume_kv_reuse = false */
#define KVR_ROUTER_NO_PREFILL_TRACKING 0x4u /* track_prefill_tokens = false */
#define KVR_ROUTER_EAGLE 0x8u               /* the model uses eagle block windows */
#define KVR_ROUTER_ENTROPY_SEED 0x10u /* seed the random source from the OS, not random_seed */
/* kvr_router_record_output grows a request's blocks as it generates (Dynamo's
 * router_track_output_blocks) */
#define KVR_ROUTER_TRACK_OUTPUT_BLOCKS 0x20u

/* The order in which the admission queue admits waiting requests. */
typedef uint32_t kvr_queue_policy;
#define KVR_QUEUE_POLICY_MAP(X)          \
  X(FCFS, 0, "first come, first served") \
  X(LCFS, 1, "last come, first served")  \
  X(WSPT, 2, "weighted shortest processing time: short prompts and priority first")
enum kvr_queue_policy_value {
#define KVR_QUEUE_POLICY_ENUM_(name, value, description) KVR_QUEUE_##name = value,
  KVR_QUEUE_POLICY_MAP(KVR_QUEUE_POLICY_ENUM_)
#undef KVR_QUEUE_POLICY_ENUM_
};

/* How the router prices a candidate rank (kvr_router_options.cost_function). */
typedef uint32_t kvr_cost_function;
#define KVR_COST_FUNCTION_MAP(X)                                                          \
  X(CREDIT, 0, "Dynamo's credit form: prefill blocks less the cache credit, plus decode blocks") \
  X(PREDICTED_TTFT, 1, "seconds to the first token: prefill backlog and uncached tokens / rate")
enum kvr_cost_function_value {
#define KVR_COST_FUNCTION_ENUM_(name, value, description) KVR_COST_##name = value,
  KVR_COST_FUNCTION_MAP(KVR_COST_FUNCTION_ENUM_)
#undef KVR_COST_FUNCTION_ENUM_
};

/* Every router-wide setting (Dynamo's KvRouterConfig). */
typedef struct kvr_router_options {
  uint32_t struct_size;
  uint32_t block_size;              /* tokens per KV block; default 16; every worker must match */
  uint32_t flags;                   /* KVR_ROUTER_*; 0 = Dynamo's defaults */
  kvr_queue_policy queue_policy;    /* KVR_QUEUE_*; default FCFS */
  double overlap_score_credit;      /* default 1.0 */
  double prefill_load_scale;        /* default 1.0 */
  double host_cache_hit_weight;     /* default 0.75 */
  double disk_cache_hit_weight;     /* default 0.25 (disk and external tiers) */
  double temperature;               /* default 0: argmin with random tie-break */
  double queue_threshold;           /* queue when every rank's prefill tokens exceed threshold ×
                                       max_num_batched_tokens; negative = never queue (default) */
  double approx_ttl_seconds;        /* approximate mode block TTL; default 120 */
  uint64_t approx_max_blocks;       /* approximate mode budget; default 2^20 */
  double approx_prune_target_ratio; /* prune to this fraction of the budget; default 0.8 */
  double request_expiry_seconds;    /* a booked request older than this is dropped; 300 */
  uint64_t random_seed;             /* default 0; ignored with KVR_ROUTER_ENTROPY_SEED */
  /* Dynamo's newer cost (default 0 = off). The decay discounts a device hit on a rank whose
   * prefill queue exceeds the shortest one's: credit × 1 / (1 + decay × excess prefill blocks /
   * prompt blocks). The weight adds weight × active requests to each rank's cost. */
  double overlap_score_credit_decay;
  double decode_active_request_weight;
  /* Trees the KV index splits the workers over, 1..64; default 1. Worker w's ranks are in
   * tree w mod index_shards, and events of workers in different trees apply in parallel (one
   * writer lock per tree): an application applying events from N threads sets N (or a
   * multiple) and gives thread t the workers with w mod N = t. Every lookup walks every tree
   * (on the Mooncake trace 2 trees cost 1.4x a lookup, 4 cost 2.3x). Lookups never contend
   * with each other whatever the count. */
  uint32_t index_shards;
  uint32_t reserved;
  /* KVR_COST_*; default KVR_COST_CREDIT (Dynamo's). KVR_COST_PREDICTED_TTFT prices each rank
   * as the seconds until this prompt's first token: (its prefill tokens in flight + the
   * prompt's uncached tokens) / the prefill rate, learnt from the time between booking and
   * kvr_router_mark_prefill_completed of every request (one rate for the fleet: per-rank rates
   * measured worse, docs/replay.md), plus ttft_miss_weight × the uncached tokens' own time: the
   * delay a miss adds for the requests that will queue behind it. The credit-form weights do
   * not apply; it needs prefill tracking. */
  kvr_cost_function cost_function;
  uint32_t reserved2;
  /* KVR_COST_PREDICTED_TTFT: the prefill rate (prompt tokens per second) assumed before the
   * first completion; default 0 = unknown (every rank equally fast until one completes). */
  double prefill_tokens_per_second;
  double ttft_miss_weight; /* KVR_COST_PREDICTED_TTFT: default 3; finite, >= 0 */
} kvr_router_options;

/* Sized initialisation with every default (as kvr_hash_options_init).
 * @thread_safety concurrent */
KVR_API kvr_status kvr_router_options_init(kvr_router_options *options, size_t size);

/* Creates a router. opts NULL = every default. KVR_INVALID_ARGUMENT names the bad setting.
 * @thread_safety concurrent */
KVR_API kvr_status kvr_router_new(const kvr_router_options *opts, kvr_router **out,
                                  kvr_error **err);

/* Destroys the router. Accepts NULL. No other call on it may be in progress.
 * @thread_safety none */
KVR_API void kvr_router_free(kvr_router *router);

/* Drives the router's clock by hand from now on, for simulations and tests in which time passes
 * at their own pace: everything the router times (request expiry, plan deadlines, session
 * bindings, approximate-mode TTLs, queue order, the prefill rates of KVR_COST_PREDICTED_TTFT)
 * then sees `now_ns` (nanoseconds from any origin) plus a fixed offset chosen at the first call,
 * so that the router's time continues from where it was: only differences matter. Until the
 * first call the router reads the process's monotonic clock. KVR_INVALID_ARGUMENT if `now_ns`
 * is earlier than the last time set, or would take the router's time, or its offset from the
 * times set, past +-2^62 ns (146 years; its deadlines must not overflow).
 * @thread_safety concurrent */
KVR_API kvr_status kvr_router_set_time(kvr_router *router, int64_t now_ns, kvr_error **err);

/* ---- Workers ------------------------------------------------------------------------------ */

typedef struct kvr_worker_config {
  uint32_t struct_size;
  uint32_t block_size; /* 0 = the router's; otherwise must equal it */
  uint64_t worker_id;
  uint32_t dp_start;               /* first data-parallel rank; default 0 */
  uint32_t dp_size;                /* number of ranks, 1..1024; default 1 */
  uint64_t total_kv_blocks;        /* 0 = not reported */
  uint64_t max_num_batched_tokens; /* 0 = not reported (queue uses 10,000,000) */
} kvr_worker_config;

/* Sized initialisation (as kvr_hash_options_init). @thread_safety concurrent */
KVR_API kvr_status kvr_worker_config_init(kvr_worker_config *config, size_t size);

/* KVR_ALREADY_EXISTS for a registered id; KVR_INVALID_ARGUMENT for a block size mismatch or a
 * bad rank range. May admit queued requests. @thread_safety concurrent */
KVR_API kvr_status kvr_router_add_worker(kvr_router *router, const kvr_worker_config *config,
                                         kvr_error **err);
/* KVR_NOT_FOUND for an unknown id. Ranks that disappear lose their requests and index entries.
 * @thread_safety concurrent */
KVR_API kvr_status kvr_router_update_worker(kvr_router *router, const kvr_worker_config *config,
                                            kvr_error **err);
/* Drops the worker's ranks, active requests and index entries; the NATS and JetStream sources
 * of the router's ingest objects no longer count its ranks in state_unknown until it is added
 * back (since 0.2.2; so does an update to fewer ranks, for the ranks dropped). KVR_NOT_FOUND for
 * an unknown id (index entries of it, from events, go all the same). @thread_safety concurrent */
KVR_API kvr_status kvr_router_remove_worker(kvr_router *router, uint64_t worker_id,
                                            kvr_error **err);

/* ---- KV events ---------------------------------------------------------------------------- */

/* kvr_stored_event.flags (KVR_STORED_EAGLE also in kvr_engine_worker.flags) */
#define KVR_STORED_HAS_PARENT 0x1u /* parent_hash is set */
#define KVR_STORED_EAGLE 0x2u      /* token_ids use eagle windows */

/* Blocks newly cached by one worker rank, consecutive along one sequence. Each block has the
 * engine's own hash and either a precomputed local hash or its tokens: token_ids holds every
 * block's tokens concatenated (block_size per block, plus one look-ahead token with eagle).
 * An event with neither (no local hashes, no tokens, no parent) is a copy: each named block
 * the rank already holds is added on `tier` (vLLM's offloading connector reports copies so);
 * names it does not hold are skipped, KVR_NOT_FOUND if any was.
 *
 * With sliding_window_tokens > 0 it is a hybrid model's sliding-window store instead
 * (docs/ingest.md, "Sliding windows"): the blocks KV-cache group `sliding_group` (the engine's
 * group index; its window is sliding_window_tokens) now holds, by engine hash, each one the rank
 * holds in full attention under that hash (the others are skipped, KVR_NOT_FOUND). A prefix is
 * then cached on the rank only where its sliding-window groups also hold the blocks before the
 * prefix's end that their windows need, as the engine counts it. Such a store names blocks only
 * (at least one): no parent flag, local hashes, tokens, LoRA, namespace nor multimodal hashes,
 * on the device tier, sliding_group >= 0 (KVR_INVALID_ARGUMENT otherwise). Its first store makes
 * the group known to the rank (from then on a prefix its window does not hold is not cached
 * there; a clear forgets the rank's groups); a store with another window than the group's
 * drops the group's blocks; a rank has at most 64 groups (KVR_INVALID_ARGUMENT past them). */
typedef struct kvr_stored_event {
  uint32_t struct_size;
  uint32_t dp_rank;
  uint64_t worker_id;
  uint64_t event_id;
  kvr_tier tier;  /* KVR_TIER_* */
  uint32_t flags; /* KVR_STORED_* */
  uint64_t parent_hash;
  const uint64_t *block_hashes;
  size_t num_blocks;
  const uint64_t *local_hashes; /* NULL, or num_blocks values: then token_ids is not read */
  const uint32_t *token_ids;
  size_t num_tokens;
  const char *lora_name;
  const char *cache_namespace;
  const uint64_t *mm_hashes; /* per-block multimodal hashes as in kvr_hash_options */
  const size_t *mm_counts;   /* NULL, or num_blocks counts */
  /* Appended in 0.2.0: a sliding-window store (above) when sliding_window_tokens > 0; a
   * sliding_group without a window is KVR_INVALID_ARGUMENT; reserved1 must be 0. */
  int64_t sliding_group;
  uint32_t sliding_window_tokens;
  uint32_t reserved1;
} kvr_stored_event;

#define KVR_REMOVED_SLIDING 0x1u /* the blocks left sliding-window group `sliding_group` */

/* Blocks a worker rank evicted, by engine hash. With KVR_REMOVED_SLIDING in flags (appended in
 * 0.2.0), the blocks KV-cache group `sliding_group`'s sliding window evicted (device tier,
 * sliding_group >= 0): the rank's full-attention blocks stay (a hybrid model's window lets go of
 * a block long before full attention does). reserved1 must be 0. */
typedef struct kvr_removed_event {
  uint32_t struct_size;
  uint32_t dp_rank;
  uint64_t worker_id;
  uint64_t event_id;
  kvr_tier tier;
  uint32_t reserved;
  const uint64_t *block_hashes;
  size_t num_blocks;
  int64_t sliding_group; /* Appended in 0.2.0; set only with KVR_REMOVED_SLIDING */
  uint32_t flags;        /* Appended in 0.2.0: KVR_REMOVED_* */
  uint32_t reserved1;
} kvr_removed_event;

/* Sized initialisation (as kvr_hash_options_init). @thread_safety concurrent */
KVR_API kvr_status kvr_stored_event_init(kvr_stored_event *event, size_t size);
KVR_API kvr_status kvr_removed_event_init(kvr_removed_event *event, size_t size);

/* Apply one event. A rejected part is reported (KVR_NOT_FOUND: unknown parent or block;
 * KVR_INVALID_ARGUMENT: broken sequence or incomplete block) and counted in the metrics, while
 * the part Dynamo applies despite it is applied. More tokens than the event's blocks take
 * (num_blocks * block_size, plus one with eagle) is KVR_INVALID_ARGUMENT before anything is
 * copied or hashed, and nothing is applied. KVR_FAILED_PRECONDITION in approximate mode.
 * Events for workers not registered are indexed all the same (the index keys on what engines
 * say). @thread_safety concurrent */
KVR_API kvr_status kvr_router_apply_stored(kvr_router *router, const kvr_stored_event *event,
                                           kvr_error **err);
KVR_API kvr_status kvr_router_apply_removed(kvr_router *router, const kvr_removed_event *event,
                                            kvr_error **err);
/* The rank (worker_id, dp_rank) lost every block: each data-parallel rank of an engine has a
 * cache of its own, so the worker's other ranks keep theirs (as in Dynamo 1.6.1; before 0.2.0 a
 * clear was worker-wide). The rank becomes known to the index if it was not. To forget every
 * rank of a worker, kvr_router_remove_worker. @thread_safety concurrent */
KVR_API kvr_status kvr_router_apply_cleared(kvr_router *router, uint64_t worker_id,
                                            uint32_t dp_rank, uint64_t event_id, kvr_error **err);

/* Applies a FlatBuffers EventBatch (schema/kv_events.fbs). The buffer must pass the FlatBuffers
 * verifier first, or nothing is applied (KVR_INVALID_ARGUMENT). Events rejected by the index
 * do not stop the others; the first rejection's status and message are returned.
 * KVR_FAILED_PRECONDITION in approximate mode. @thread_safety concurrent */
KVR_API kvr_status kvr_router_apply_event_batch(kvr_router *router, const void *data, size_t size,
                                                kvr_error **err);

/* ---- Router replicas ------------------------------------------------------------------------
 * Several routers (e.g. one embedded in each gateway replica) that route to the same workers
 * must each see the others' requests as load. Each publishes the changes to its own bookings
 * (booked, prefill completed, freed) and applies the others'. kvr_ingest_sync_replicas does
 * both over NATS; these two let a caller carry the messages over a bus of its own. The KV
 * index needs no sync: every replica ingests the workers' events itself. */

/* Receives one encoded change (a FlatBuffers SequenceChange, schema/replica_events.fbs) to send
 * to every other replica. `data` is valid only during the call. It runs on the thread that
 * made the change (an announcement of every booking that falls due, on the thread of the call that
 * makes it: kvr_router_replica_heartbeat, kvr_router_expire_replicas,
 * kvr_router_apply_replica_event), under the router's internal lock, in the order of the changes:
 * it must be quick (queue or hand the bytes to an asynchronous client) and must not call into any
 * router (a bus delivering synchronously to another router could deadlock when that router's own
 * changes come back). A call into its own router, which would wait for ever for that lock, fails
 * with KVR_FAILED_PRECONDITION (since 0.2.1; kvr_disagg_* calls too, for either pool's
 * publisher, kvr_ingest_sync_replicas on an ingest of that router, and calls made from a
 * publisher nested in it, as a bus delivering synchronously to another router nests them). That thread may be one the library owns: a replica's free applied on an
 * ingest loop can admit a request waiting here, whose booking is then published from the loop. */
typedef void (*kvr_replica_publish_fn)(void *user_data, const void *data, size_t size);

/* Publishes this router's booking changes through `publish` under the name `replica_id`, which
 * must be unique among the live replicas, contain no byte 0x1F and be at most 256 bytes long
 * (since 0.2.0) (KVR_INVALID_ARGUMENT).
 * `publish` first receives a Reset, an Added change for every booking the router holds, and a
 * SyncRequest: peers drop whatever they held from this replica id (a restarted replica's stale
 * bookings) and answer with their own bookings: at once, or with their next heartbeat if they beat
 * every 2 s or less, have beaten within that interval and announced their bookings within it
 * (replicas joining together, as after a NATS server restart, then share one announcement: since
 * 0.2.0), so a joining replica converges within one of its peers' heartbeat intervals.
 * `publish` NULL stops publishing. A callback replaced (or stopped by NULL) first receives a
 * farewell, a Reset promising no heartbeat: its peers drop the bookings they hold under its
 * replica id, which nothing would free once it is gone; once this returns, the previous callback
 * is not running and will not run again. Not every change is published: expiry and worker removal are not, as
 * every replica does those itself. Request ids starting with byte 0x1E are reserved for
 * replicas' bookings (KVR_INVALID_ARGUMENT). @thread_safety concurrent */
KVR_API kvr_status kvr_router_set_replica_publisher(kvr_router *router, const char *replica_id,
                                                    kvr_replica_publish_fn publish, void *user_data,
                                                    kvr_error **err);

/* Applies one change another replica published: its bookings count as load here (under names
 * of their own: they never collide with local request ids) and its frees and prefill
 * completions may admit requests waiting here. A Reset replaces every booking held from its
 * origin by those announced after it (kept until they have come, since 0.2.0: docs/replicas.md);
 * a SyncRequest makes this router publish (if it has a publisher) a Reset and its own
 * bookings: at once; or with its next change or heartbeat if the request names this router (see
 * kvr_router_expire_replicas); or, if it names none (a replica joined) while this router beats
 * every 2 s or less, has beaten within its interval and announced its bookings within it, with its
 * next heartbeat (one announcement answers the joins of an interval; should no heartbeat come, this
 * router's first change, change applied here or kvr_router_expire_replicas call past one and a half
 * intervals on the router's clock makes it, on that call's thread); one naming another replica is
 * ignored. Changes from this
 * router's own replica id are ignored (buses that echo). KVR_INVALID_ARGUMENT for bytes that are not a SequenceChange,
 * an origin longer than 256 bytes (since 0.2.0), or a booking of more than 2^32 prefill
 * tokens; a heartbeat interval over one hour counts as one
 * hour. KVR_NOT_FOUND for a worker rank this router does not know, KVR_ALREADY_EXISTS for a booking
 * applied twice; nothing changes then. @thread_safety concurrent */
KVR_API kvr_status kvr_router_apply_replica_event(kvr_router *router, const void *data, size_t size,
                                                  kvr_error **err);

/* Replica liveness (since 0.2.0). A replica that dies for good stops freeing its bookings;
 * heartbeats let its peers notice. This publishes a Heartbeat through the router's replica
 * publisher (after an announcement of every booking if one is due: the repair of a lost change, or
 * the answer to joins; see kvr_router_apply_replica_event), promising the next within `interval_ms`
 * (1..3,600,000); every change the same publisher is given afterwards carries the interval too.
 * Once a peer has heard a heartbeat or such a change from a replica, kvr_router_expire_replicas
 * there drops that replica's bookings when it falls silent (also one that died before its second
 * heartbeat, or whose heartbeats that peer missed). KVR_FAILED_PRECONDITION if the router has no
 * replica publisher. kvr_ingest_sync_replicas calls both on a timer, its first heartbeat at once
 * (kvr_ingest_options.replica_heartbeat_ms). @thread_safety concurrent */
KVR_API kvr_status kvr_router_replica_heartbeat(kvr_router *router, uint32_t interval_ms,
                                                kvr_error **err);

/* Drops the bookings held from every replica that has sent a heartbeat (or a change carrying
 * its interval: kvr_router_replica_heartbeat) and from which nothing (no change of any kind)
 * has been heard for longer than `timeout_seconds` on the router's clock, or than three of its
 * own heartbeat intervals if that is longer; they may admit waiting requests. A dropped
 * replica heard again (it was cut off or stalled, not dead) is asked, if this router has a
 * replica publisher, to announce its bookings again (a SyncRequest naming it; again after
 * three of its heartbeat intervals, at least 1 s, until it does; the 1,024 replicas expired
 * last are remembered for it), and they count here again; one that restarts announces them
 * itself. A replica whose
 * kvr_ingest_sync_replicas stops says farewell (a Reset promising no heartbeat): it is not
 * tracked after it, nor counted as expired (unless the farewell is lost). Replicas that never sent a heartbeat keep
 * their bookings until request_expiry_seconds. `expired` (may be NULL) gets how many replicas
 * were dropped (counted in kvr_metrics.replicas_expired). It may publish, through the
 * router's replica publisher, an answer to joins past its due time (see
 * kvr_router_apply_replica_event): a caller beating by hand calls this on a timer too.
 * KVR_INVALID_ARGUMENT unless `timeout_seconds` is finite and > 0. @thread_safety concurrent */
KVR_API kvr_status kvr_router_expire_replicas(kvr_router *router, double timeout_seconds,
                                              size_t *expired, kvr_error **err);

/* ---- Encoding event batches (for publishers in any language) ------------------------------ */

/* Collects events and encodes them as one FlatBuffers EventBatch, the format that
 * kvr_router_apply_event_batch and kvrouter's event listeners take. */
typedef struct kvr_event_batch kvr_event_batch;

/* @thread_safety concurrent */
KVR_API kvr_status kvr_event_batch_new(kvr_event_batch **out, kvr_error **err);
/* Accepts NULL. @thread_safety none (for this batch) */
KVR_API void kvr_event_batch_free(kvr_event_batch *batch);
/* Appends a copy of the event. Checked here: pointers, tier, multimodal counts; a batch knows
 * no block size, so token counts are checked when the batch is applied (each event then as
 * kvr_router_apply_stored checks it). @thread_safety none (for this batch) */
KVR_API kvr_status kvr_event_batch_add_stored(kvr_event_batch *batch, const kvr_stored_event *event,
                                              kvr_error **err);
KVR_API kvr_status kvr_event_batch_add_removed(kvr_event_batch *batch,
                                               const kvr_removed_event *event, kvr_error **err);
KVR_API kvr_status kvr_event_batch_add_cleared(kvr_event_batch *batch, uint64_t worker_id,
                                               uint32_t dp_rank, uint64_t event_id,
                                               kvr_error **err);
/* Events added so far (0 for NULL). @thread_safety none (for this batch) */
KVR_API size_t kvr_event_batch_size(const kvr_event_batch *batch);
/* The batch's publication time, in nanoseconds since the Unix epoch: ingest measures its lag
 * (publication to events applied) from it. Until this is called, a batch is stamped with the
 * wall clock when it is encoded or sent; `unix_ns` 0 leaves it unstamped (no lag measured).
 * @thread_safety none (for this batch) */
KVR_API kvr_status kvr_event_batch_set_publish_time(kvr_event_batch *batch, uint64_t unix_ns,
                                                    kvr_error **err);
/* Encodes the events added so far into a new buffer; the batch keeps them (call
 * kvr_event_batch_clear to start over). KVR_RESOURCE_EXHAUSTED if the encoding would pass 64
 * MiB, the most a decoder takes (a stream frame, kvr_router_apply_event_batch; since 0.2.0).
 * @thread_safety none (for this batch) */
KVR_API kvr_status kvr_event_batch_encode(const kvr_event_batch *batch, kvr_buffer **out,
                                          kvr_error **err);
/* Drops the events and any publish time set. @thread_safety none (for this batch) */
KVR_API void kvr_event_batch_clear(kvr_event_batch *batch);

/* ---- Routing ------------------------------------------------------------------------------ */

/* kvr_request_options.flags. Without KVR_REQUEST_ADMIT a routing call changes nothing; with it
 * the request is booked (after waiting in the queue if the router queues). */
#define KVR_REQUEST_ADMIT 0x1u /* book the request under request_id */
/* The prompt is given hashed, by local_hashes; the call hashes no token. Since 0.2.0. */
#define KVR_REQUEST_PREHASHED 0x2u
/* allowed_worker_ids is an allow-list even when num_allowed_worker_ids is 0: then no worker is
 * allowed, and a call that picks one is KVR_UNAVAILABLE (a pin, being outside the list,
 * KVR_INVALID_ARGUMENT); kvr_router_potential_loads answers no row. Without this flag an empty
 * list allows every worker. (A gateway that filtered a tenant's workers down to none must not
 * route on anyone's.) A non-empty list means the same with or without it. Since 0.2.0. */
#define KVR_REQUEST_ALLOW_LIST 0x4u

/* Per-request options. Doubles left NaN and tri-states left -1 keep the router's setting. */
typedef struct kvr_request_options {
  uint32_t struct_size;
  uint32_t flags;         /* KVR_REQUEST_* */
  const char *request_id; /* required with KVR_REQUEST_ADMIT and for kvr_router_add_request;
                           * a booking's at most 1,024 bytes (since 0.2.0) */
  const char *lora_name;
  const char *cache_namespace;
  const uint64_t *mm_hashes; /* per-block multimodal hashes as in kvr_hash_options */
  const size_t *mm_counts;
  size_t mm_num_blocks;
  const uint64_t *allowed_worker_ids; /* restrict candidates (and bypass the queue); an empty
                                       * list restricts only with KVR_REQUEST_ALLOW_LIST */
  size_t num_allowed_worker_ids;
  double overlap_score_credit;
  double prefill_load_scale;
  double host_cache_hit_weight;
  double disk_cache_hit_weight;
  double temperature;
  int32_t assume_kv_reuse;      /* -1 router's, 0 no, 1 yes */
  int32_t track_prefill_tokens; /* -1 router's, 0 no, 1 yes */
  double priority_jump;         /* queue priority boost; default 0 */
  uint32_t expected_output_tokens;
  uint32_t reserved;
  int64_t queue_timeout_ms; /* give up waiting in the queue after this long; -1 = never; below
                             * -1 is KVR_INVALID_ARGUMENT */
  double overlap_score_credit_decay; /* NaN (default) = the router's */
  double decode_active_request_weight; /* NaN (default) = the router's */
  int32_t cost_function;               /* -1 (default) = the router's; else KVR_COST_* */
  uint32_t reserved2;
  double ttft_miss_weight; /* NaN (default) = the router's */
  /* With KVR_REQUEST_PREHASHED (since 0.2.0): the prompt's local hashes, one per complete
   * block (kvr_compute_block_hashes with the router's block size, and the LoRA name, cache
   * namespace, eagle windows and multimodal hashes of the prompt, so lora_name,
   * cache_namespace and mm_* are not used). Every call taking `tokens, num_tokens` and these
   * options (routing, previews, plans, kvr_router_add_request, the per-rank queries, the
   * disaggregated calls) then takes `tokens` NULL and `num_tokens` the prompt's length in
   * tokens; KVR_INVALID_ARGUMENT unless num_local_hashes is the complete blocks of num_tokens.
   * A gateway that hashes prompts itself (or once for several routers) routes without sending
   * its tokens. May be NULL with num_local_hashes 0. */
  const uint64_t *local_hashes;
  size_t num_local_hashes;
} kvr_request_options;

/* Sized initialisation (as kvr_hash_options_init); defaults: NaN overrides, -1 tri-states,
 * no timeout. @thread_safety concurrent */
KVR_API kvr_status kvr_request_options_init(kvr_request_options *options, size_t size);

/* The decision for one request. */
typedef struct kvr_route_result {
  uint32_t struct_size;
  uint32_t dp_rank;
  uint64_t worker_id;
  uint32_t prompt_blocks;          /* complete blocks in the prompt */
  uint32_t device_overlap_blocks;  /* leading blocks cached on the chosen rank's device */
  double effective_overlap_blocks; /* device + tier-weighted lower-tier hits */
  uint64_t cached_tokens;          /* round(effective_overlap_blocks × block_size) */
  uint64_t prompt_tokens;
  double cost;     /* the chosen rank's cost */
  uint32_t booked; /* 1 if the request is now active on the chosen rank */
  uint32_t queued; /* 1 if it waited in the admission queue first */
} kvr_route_result;

/* Sized initialisation (as kvr_hash_options_init). @thread_safety concurrent */
KVR_API kvr_status kvr_route_result_init(kvr_route_result *result, size_t size);

/* One candidate rank with every term of its cost (the credit form, as in README.md):
 * cost = prefill_load_scale·max(0, raw_prefill_blocks − credit) + decode_blocks. */
typedef struct kvr_candidate {
  uint64_t worker_id;
  uint32_t dp_rank;
  uint32_t device_blocks;
  uint32_t host_blocks;
  uint32_t disk_blocks;
  uint32_t external_blocks;
  uint32_t chosen; /* 1 for the rank picked */
  double effective_overlap_blocks;
  uint64_t cached_tokens;
  uint64_t active_prefill_tokens;
  uint64_t active_blocks;
  uint64_t new_blocks;
  double raw_prefill_blocks;
  double credit;
  double prefill_cost;
  uint64_t decode_blocks;
  double cost;
  double probability;  /* chance this rank had of being picked */
  double credit_decay; /* the factor the device credit was multiplied by (1 = no decay) */
  uint64_t active_requests;
  double request_cost; /* decode_active_request_weight × active_requests (in cost) */
  uint64_t reserved;
} kvr_candidate;

/* Picks the worker rank for a prompt. Without KVR_REQUEST_ADMIT it is a preview: nothing
 * changes. With it the request is booked on the chosen rank under opts->request_id, after
 * waiting in the admission queue if the router queues (the calling thread blocks; see
 * queue_timeout_ms). `candidates` (may be NULL with cap 0) receives up to `cap` candidates
 * with their cost breakdown and `*num_candidates` (may be NULL) the total: a decision is never
 * refused for lack of room, the list is truncated instead. Errors: KVR_INVALID_ARGUMENT,
 * KVR_ALREADY_EXISTS (request id active or waiting), KVR_UNAVAILABLE (no eligible worker),
 * KVR_DEADLINE_EXCEEDED (queue timeout), KVR_CANCELLED (freed while waiting in the queue, or the
 * queue closed: kvr_router_close_queue). @thread_safety concurrent */
KVR_API kvr_status kvr_find_best_match(kvr_router *router, const uint32_t *tokens,
                                       size_t num_tokens, const kvr_request_options *opts,
                                       kvr_route_result *out, kvr_candidate *candidates, size_t cap,
                                       size_t *num_candidates, kvr_error **err);

/* What one rank holds of a prompt's prefix, per tier. */
typedef struct kvr_overlap {
  uint64_t worker_id;
  uint32_t dp_rank;
  uint32_t device_blocks;
  uint32_t host_blocks;
  uint32_t disk_blocks;
  uint32_t external_blocks;
  uint32_t reserved0;
  double effective_overlap_blocks;
  uint64_t cached_tokens;
  uint64_t tree_size; /* blocks the rank holds in the index */
  uint64_t reserved[2];
} kvr_overlap;

/* Per rank holding at least the prompt's first block, in no particular order. Of opts, only
 * what hashes the prompt and the cost overrides are used (the tier weights of
 * effective_overlap_blocks; an invalid override is KVR_INVALID_ARGUMENT): the index's view, as
 * Dynamo's find_matches, with no allow-list and no pin. @thread_safety concurrent */
KVR_API kvr_status kvr_router_overlap_scores(kvr_router *router, const uint32_t *tokens,
                                             size_t num_tokens, const kvr_request_options *opts,
                                             kvr_overlap *out, size_t cap, size_t *len,
                                             kvr_error **err);
/* As kvr_router_overlap_scores, for a prompt already hashed: `local_hashes` are its blocks'
 * local hashes (kvr_compute_block_hashes; what engines' KV events and Dynamo's find_matches
 * take), so no token is hashed here. Of opts (may be NULL) only the cost overrides apply (the
 * tier weights of effective_overlap_blocks): LoRA, namespace and multimodal content are in the
 * hashes already. Since 0.2.0. @thread_safety concurrent */
KVR_API kvr_status kvr_router_overlap_scores_hashed(kvr_router *router,
                                                    const uint64_t *local_hashes, size_t num_hashes,
                                                    const kvr_request_options *opts,
                                                    kvr_overlap *out, size_t cap, size_t *len,
                                                    kvr_error **err);

/* One rank's match of a hashed prompt: the leading blocks it holds, per tier, each tier
 * continuing where the previous one stops (device_blocks is Dynamo's find_matches depth). */
typedef struct kvr_match {
  uint64_t worker_id;
  uint32_t dp_rank;
  uint32_t device_blocks;
  uint32_t host_blocks;
  uint32_t disk_blocks;
  uint32_t external_blocks;
  uint32_t reserved0;
  uint64_t tree_size; /* blocks the rank holds in the index */
} kvr_match;

/* The index walk alone, Dynamo's find_matches contract: per rank holding at least the first of
 * `local_hashes` (kvr_compute_block_hashes), in no particular order, with none of the cost
 * model's figures (for those, kvr_router_overlap_scores_hashed). The lean call for a caller
 * that scores ranks itself; a 40-byte row per rank. KVR_BUFFER_TOO_SMALL (nothing written,
 * *len the rows needed) when cap is short. A rank of a hybrid model is limited by its
 * sliding-window groups from the whole match on (the calls given tokens start where the engine
 * may resume: docs/ingest.md, "Sliding windows"). Since 0.2.0. @thread_safety concurrent */
KVR_API kvr_status kvr_router_find_matches(kvr_router *router, const uint64_t *local_hashes,
                                           size_t num_hashes, kvr_match *out, size_t cap,
                                           size_t *len, kvr_error **err);

/* The load each registered rank would carry with this prompt. */
typedef struct kvr_potential_load {
  uint64_t worker_id;
  uint32_t dp_rank;
  uint32_t reserved0;
  uint64_t potential_prefill_tokens;
  uint64_t potential_decode_blocks;
  uint64_t active_prefill_tokens;
  uint64_t active_blocks;
  uint64_t active_requests;
  uint64_t reserved[2];
} kvr_potential_load;

/* @thread_safety concurrent */
KVR_API kvr_status kvr_router_potential_loads(kvr_router *router, const uint32_t *tokens,
                                              size_t num_tokens, const kvr_request_options *opts,
                                              kvr_potential_load *out, size_t cap, size_t *len,
                                              kvr_error **err);

/* ---- Request lifecycle -------------------------------------------------------------------- */

/* Books a request on a rank chosen elsewhere (opts->request_id required). KVR_NOT_FOUND for an
 * unregistered rank, KVR_ALREADY_EXISTS for an active id. @thread_safety concurrent */
KVR_API kvr_status kvr_router_add_request(kvr_router *router, const uint32_t *tokens,
                                          size_t num_tokens, uint64_t worker_id, uint32_t dp_rank,
                                          const kvr_request_options *opts, kvr_error **err);

/* The request produced its first token. Idempotent: an unknown id is no error. The time since
 * it was booked calibrates its rank's prefill rate (KVR_COST_PREDICTED_TTFT): call it when the
 * first token reaches the gateway. May admit queued requests. @thread_safety concurrent */
KVR_API kvr_status kvr_router_mark_prefill_completed(kvr_router *router, const char *request_id,
                                                     kvr_error **err);

/* The request has generated `output_tokens` tokens so far (cumulative; call as the stream
 * goes, e.g. every block's worth). Its rank then holds one more, unshared, block each time
 * prompt + output crosses a block boundary, until the request is freed, so long generations
 * weigh on their rank's cost (not published to router replicas, as in
 * Dynamo). KVR_FAILED_PRECONDITION unless the router was created with
 * KVR_ROUTER_TRACK_OUTPUT_BLOCKS; an unknown id is no error. @thread_safety concurrent */
KVR_API kvr_status kvr_router_record_output(kvr_router *router, const char *request_id,
                                            uint64_t output_tokens, kvr_error **err);

/* The request ended (finished, cancelled or failed). Idempotent: an unknown id is no error.
 * May admit queued requests. @thread_safety concurrent */
KVR_API kvr_status kvr_router_free_request(kvr_router *router, const char *request_id,
                                           kvr_error **err);

/* For a shutdown: every request waiting in the admission queue is cancelled (its routing call
 * returns KVR_CANCELLED), and from now on a request that would wait is KVR_CANCELLED at once;
 * one admitted at once is still routed and booked, and frees work as before. A caller blocked
 * in the queue is thus woken before its router is freed (no call may be in progress then).
 * Final (the queue stays closed); idempotent. `*cancelled` (may be NULL): how many were
 * waiting. Not from a replica publisher (it takes the router's lock, which the publisher runs
 * under: KVR_FAILED_PRECONDITION). Since 0.2.0. @thread_safety concurrent */
KVR_API kvr_status kvr_router_close_queue(kvr_router *router, uint64_t *cancelled,
                                          kvr_error **err);
/* Drops every request booked longer than request_expiry_seconds ago (its free was lost: a
 * crashed client, a missed event) and every plan past its deadline, then admits the waiting
 * requests that now fit. `*expired` (may be NULL): how many requests were dropped. The router
 * has no timer thread: a routing call that books does this at most once per
 * min(30 s, request_expiry_seconds), and nothing does while no call comes, so with a queue
 * threshold a lost request can keep the queue waiting until one does: call this periodically
 * (every second, say). Since 0.2.1. @thread_safety concurrent */
KVR_API kvr_status kvr_router_expire_requests(kvr_router *router, size_t *expired,
                                              kvr_error **err);

/* ---- Index snapshot ----------------------------------------------------------------------- */

/* The whole KV index as a FlatBuffers IndexSnapshot (schema/index_snapshot.fbs), for a warm
 * restart or a new replica. KVR_RESOURCE_EXHAUSTED if it would pass 1 GiB, the most
 * kvr_router_restore takes (since 0.2.0; before, a larger one was written and refused there,
 * and past 2 GiB it would have been corrupt). @thread_safety concurrent */
KVR_API kvr_status kvr_router_snapshot(kvr_router *router, kvr_buffer **out, kvr_error **err);

/* Loads a snapshot into a router whose index is empty (else KVR_FAILED_PRECONDITION, as in
 * approximate mode, whose index comes from its own decisions). The buffer is verified first;
 * a bad one, or one of another block size, changes nothing (KVR_INVALID_ARGUMENT). Events of a
 * verified snapshot that the index refuses are counted in the message (KVR_INVALID_ARGUMENT)
 * and the others applied. Of two restores at once, one loads its snapshot and the other finds
 * the index not empty; events applied meanwhile (an ingest already started) are kept, mixed
 * with the snapshot's: restore before starting the ingest. @thread_safety concurrent */
KVR_API kvr_status kvr_router_restore(kvr_router *router, const void *data, size_t size,
                                      kvr_error **err);

/* ---- Metrics ------------------------------------------------------------------------------ */

/* The kinds of KV event, and what became of one: the two indices of kvr_metrics.events. */
typedef uint32_t kvr_event_kind;
#define KVR_EVENT_KIND_MAP(X)                          \
  X(STORED, 0, "blocks newly cached by a worker rank") \
  X(REMOVED, 1, "blocks a worker rank evicted")        \
  X(CLEARED, 2, "a worker dropped every block")
enum kvr_event_kind_value {
#define KVR_EVENT_KIND_ENUM_(name, value, description) KVR_EVENT_##name = value,
  KVR_EVENT_KIND_MAP(KVR_EVENT_KIND_ENUM_)
#undef KVR_EVENT_KIND_ENUM_
      KVR_EVENT_KINDS = 3 /* the first dimension of kvr_metrics.events, fixed forever */
};
typedef uint32_t kvr_event_outcome;
#define KVR_EVENT_OUTCOME_MAP(X)                                                              \
  X(OK, 0, "applied")                                                                         \
  X(PARENT_BLOCK_NOT_FOUND, 1, "a stored event's parent is unknown: the event is dropped")    \
  X(BLOCK_NOT_FOUND, 2, "a removed block is unknown: the event's other blocks are removed")   \
  X(INVALID_BLOCK_SEQUENCE, 3, "a stored block repeats an earlier hash: the rest is dropped") \
  X(INVALID_BLOCK, 4, "a stored block's tokens do not make a complete block")
enum kvr_event_outcome_value {
#define KVR_EVENT_OUTCOME_ENUM_(name, value, description) KVR_EVENT_##name = value,
  KVR_EVENT_OUTCOME_MAP(KVR_EVENT_OUTCOME_ENUM_)
#undef KVR_EVENT_OUTCOME_ENUM_
      KVR_EVENT_OUTCOMES = 5 /* the second dimension of kvr_metrics.events, fixed forever */
};

/* The number of buckets of kvr_metrics' decision-latency histogram, fixed forever. */
#define KVR_DECISION_LATENCY_BUCKETS 14

typedef struct kvr_metrics {
  uint32_t struct_size;
  uint32_t reserved0;
  /* events[kind][outcome]: applied (KVR_EVENT_OK) or rejected per reason */
  uint64_t events[KVR_EVENT_KINDS][KVR_EVENT_OUTCOMES];
  uint64_t event_batches_rejected; /* buffers that failed verification */
  uint64_t decisions; /* routing calls that picked a worker: kvr_find_best_match (admitted or
                        * not), its async form and plans (a plan asked for again counts
                        * again); not previews */
  uint64_t requests_active;
  uint64_t queue_pending;
  uint64_t queue_pending_tokens;
  uint64_t workers;
  uint64_t index_nodes;  /* tree nodes: runs of blocks held alike (path compression) */
  uint64_t index_blocks; /* cached (block, rank) entries */
  int64_t index_bytes;
  /* Other replicas' booking changes (kvr_router_apply_replica_event, kvr_ingest_sync_replicas):
   * applied, and rejected (undecodable, unknown worker rank, duplicate booking) */
  uint64_t replica_changes_applied;
  uint64_t replica_changes_rejected;
  uint64_t replica_requests_active; /* of requests_active, those booked by other replicas */
  /* Appended in 0.2.0: how long routing calls took to decide, as a Prometheus histogram, on
   * the router's clock from the call's start (hashing included) to its decision, over a
   * sample of the calls (the first, then one in 16: timing every call would cost 5-8 % of
   * it): routing and plans answered without waiting in the admission queue, and previews;
   * calls that failed are not measured. decision_latency_le[i] counts the sampled calls that
   * took at most decision_latency_bounds_ns[i] (cumulative; the bounds rise and are the
   * library's to choose), decision_latency_count every sampled call (the +Inf bucket). */
  uint64_t decision_latency_bounds_ns[KVR_DECISION_LATENCY_BUCKETS];
  uint64_t decision_latency_le[KVR_DECISION_LATENCY_BUCKETS];
  uint64_t decision_latency_count;
  uint64_t decision_latency_sum_ns;
  /* Appended in 0.2.0: replica liveness (kvr_router_replica_heartbeat). Replicas heard sending
   * heartbeats and not expired, and replicas whose bookings kvr_router_expire_replicas dropped
   * because they fell silent. */
  uint64_t replicas_live;
  uint64_t replicas_expired;
  /* Appended in 0.2.0: what the heap refused. KV events the index could not apply for want of
   * memory, refused before they changed anything or midway (their rank then left holding
   * nothing; kvr_router_apply_* returned KVR_RESOURCE_EXHAUSTED, an ingest source flags the
   * rank state_unknown); 0 in approximate mode, which takes no events. And this router's own
   * booking changes its replica publisher lost for want of memory, or (kvr_ingest_sync_replicas)
   * that the NATS client refused to send (the booking stands; each loss is repaired by
   * announcing every booking again once a later change or heartbeat gets through). */
  uint64_t events_refused_for_memory;
  uint64_t replica_changes_unpublished;
  /* Appended in 0.2.0: routing decisions decided a second time. A decision prices its
   * candidates outside the router's lock and books under it; when another call changed what
   * it priced meanwhile (the chosen rank's load, the queue, the session's binding, the request
   * id's use), it decides again under the lock. Of `decisions` and previews. Such a change
   * comes from another thread: another routing call, a release (kvr_router_free_request,
   * prefill completion), another replica's booking; 0 while nothing else calls the router.
   * What concurrent callers cost each other. */
  uint64_t decisions_priced_again;
  /* Appended in 0.2.0: hybrid models' sliding-window KV-cache groups (docs/ingest.md, "Sliding
   * windows"). Their events applied, and rejected (a stored block the rank does not hold in full
   * attention, a removed block the group lacks, a window of 0, a tier other than the device),
   * and the (group, block) entries held over every rank; 0 for models without such groups. */
  uint64_t sliding_events_applied;
  uint64_t sliding_events_rejected;
  uint64_t index_sliding_blocks;
} kvr_metrics;

/* Sized initialisation (as kvr_hash_options_init). @thread_safety concurrent */
KVR_API kvr_status kvr_metrics_init(kvr_metrics *metrics, size_t size);
KVR_API kvr_status kvr_router_get_metrics(kvr_router *router, kvr_metrics *out, kvr_error **err);

/* The metrics in Prometheus text exposition format, NUL-terminated: kvr_metrics' counters
 * (kvrouter_*), the decision-latency histogram (kvrouter_decision_duration_seconds) and each
 * rank's load. `*len` is set to the bytes needed including the NUL (also with
 * KVR_BUFFER_TOO_SMALL). @thread_safety concurrent */
KVR_API kvr_status kvr_router_metrics_prometheus(kvr_router *router, char *buf, size_t cap,
                                                 size_t *len, kvr_error **err);

/* ---- Staged routing: preview, plan, commit; pins; sessions ----------------------------------- */
/* A gateway decides in stages: kvr_preview_route looks (no admission, nothing booked, nothing
 * recorded, no session binding made or refreshed; this is also query-only routing),
 * kvr_plan_route books the request as a plan (selection re-run with admission, keeping the
 * previewed rank while it is still a candidate), kvr_commit_route says it was dispatched
 * (approximate mode records the decision and the session is bound here, and only here),
 * kvr_abort_route frees it when dispatch failed or the client gave up. A plan neither
 * committed nor aborted within the plan deadline (kvr_router_set_plan_deadline) is dropped
 * with its booking: there is no timer thread; a commit checks its own plan, plan / commit /
 * admitted routing sweep all plans at most once a second (or once per deadline, when the
 * deadline is shorter), and kvr_router_expire_plans sweeps
 * now. After a commit the request is freed as usual with kvr_router_free_request. */
/* The phase a request is routed for, which selects the pins of kvr_routing_hints. */
typedef uint32_t kvr_phase;
#define KVR_PHASE_MAP(X)                                  \
  X(AGGREGATED, 0, "prefill and decode on one worker")    \
  X(PREFILL, 1, "the prefill of a disaggregated request") \
  X(DECODE, 2, "the decode of a disaggregated request")
enum kvr_phase_value {
#define KVR_PHASE_ENUM_(name, value, description) KVR_PHASE_##name = value,
  KVR_PHASE_MAP(KVR_PHASE_ENUM_)
#undef KVR_PHASE_ENUM_
};
#define KVR_WORKER_NONE UINT64_MAX /* no pin */
/* How a session's binding steers its next requests. */
typedef uint32_t kvr_session_mode;
#define KVR_SESSION_MODE_MAP(X)                                            \
  X(HARD, 0, "the bound rank is the exact target (rebound if it is gone)") \
  X(SOFT, 1, "the bound rank is preferred while eligible; rebound where it is dispatched")
enum kvr_session_mode_value {
#define KVR_SESSION_MODE_ENUM_(name, value, description) KVR_SESSION_##name = value,
  KVR_SESSION_MODE_MAP(KVR_SESSION_MODE_ENUM_)
#undef KVR_SESSION_MODE_ENUM_
};
/* Where a request may or should run. Pins by phase, as Dynamo's RoutingHints:
 * aggregated: worker_id / dp_rank; prefill: prefill_worker_id (else worker_id) with
 * prefill_dp_rank (else dp_rank); decode: decode_worker_id (else worker_id) with dp_rank.
 * A pin without a rank takes the best of the worker's ranks. A pin outside
 * kvr_request_options.allowed_worker_ids is KVR_INVALID_ARGUMENT; an unregistered pinned worker
 * or rank KVR_NOT_FOUND. */
typedef struct kvr_routing_hints {
  uint32_t struct_size;
  kvr_phase phase;               /* KVR_PHASE_*; default aggregated */
  uint64_t worker_id;            /* KVR_WORKER_NONE (default) = no pin */
  uint64_t prefill_worker_id;    /* KVR_WORKER_NONE (default) */
  uint64_t decode_worker_id;     /* KVR_WORKER_NONE (default) */
  int32_t dp_rank;               /* -1 (default) = any rank of the pinned worker */
  int32_t prefill_dp_rank;       /* -1 (default) */
  const char *session_id;        /* NULL or "" = no session affinity */
  kvr_session_mode session_mode; /* KVR_SESSION_*; default hard */
  uint32_t reserved;
  double session_ttl_seconds; /* sliding TTL of the binding; default 300 */
} kvr_routing_hints;
/* Sized initialisation (as kvr_hash_options_init). @thread_safety concurrent */
KVR_API kvr_status kvr_routing_hints_init(kvr_routing_hints *hints, size_t size);
/* The signals of a preview or a plan. */
typedef struct kvr_route_signals {
  uint32_t struct_size;
  uint32_t dp_rank;
  uint64_t worker_id;
  uint32_t overlap_blocks; /* leading prompt blocks cached on the rank's device */
  uint32_t prompt_blocks;
  uint64_t cached_tokens;           /* round(effective overlap × block_size) */
  uint64_t potential_decode_blocks; /* the rank's active blocks + the prompt's new ones */
  uint64_t total_kv_blocks;         /* the worker's KV capacity; 0 = not reported */
  double cost;                      /* the rank's cost (as kvr_candidate.cost) */
  uint64_t prompt_tokens;
  uint32_t booked; /* 1 for a plan */
  uint32_t moved;  /* plan: 1 if the previewed (or soft-session) rank was no longer eligible */
  uint32_t queued; /* plan: 1 if it waited in the admission queue */
  uint32_t reserved;
} kvr_route_signals;
/* Sized initialisation (as kvr_hash_options_init). @thread_safety concurrent */
KVR_API kvr_status kvr_route_signals_init(kvr_route_signals *signals, size_t size);
/* What routing would pick, changing nothing (no admission or queue, no booking, no
 * approximate-mode record, no session binding created or refreshed). opts and hints may be
 * NULL; KVR_REQUEST_ADMIT is ignored. Errors as kvr_find_best_match, plus the pin errors.
 * @thread_safety concurrent */
KVR_API kvr_status kvr_preview_route(kvr_router *router, const uint32_t *tokens, size_t num_tokens,
                                     const kvr_request_options *opts,
                                     const kvr_routing_hints *hints, kvr_route_signals *out,
                                     kvr_error **err);
/* Books the request (opts->request_id required) as a plan, keeping `previewed` (may be NULL)'s
 * rank while it is still a candidate. Waits in the admission queue like kvr_find_best_match.
 * Idempotent: planning an id with a live plan returns that plan. KVR_ALREADY_EXISTS for an id
 * already active without a plan. @thread_safety concurrent */
KVR_API kvr_status kvr_plan_route(kvr_router *router, const uint32_t *tokens, size_t num_tokens,
                                  const kvr_request_options *opts, const kvr_routing_hints *hints,
                                  const kvr_route_signals *previewed, kvr_route_signals *out,
                                  kvr_error **err);
/* The plan was dispatched. Idempotent: an active request without a plan (committed already,
 * or booked without one: admitted, added) is KVR_OK, and nothing is done. KVR_NOT_FOUND: no
 * such request (never planned, aborted, freed or past its plan's deadline);
 * KVR_FAILED_PRECONDITION: its worker was removed (plan again). @thread_safety concurrent */
KVR_API kvr_status kvr_commit_route(kvr_router *router, const char *request_id, kvr_error **err);
/* Frees the plan, its booking or its queue place. Idempotent: unknown ids are no error.
 * `freed` (may be NULL) is set to 1 if anything was freed. @thread_safety concurrent */
KVR_API kvr_status kvr_abort_route(kvr_router *router, const char *request_id, int *freed,
                                   kvr_error **err);
/* How long a plan may wait for kvr_commit_route or kvr_abort_route before it is dropped with
 * its booking (default 30 s; applies to plans made afterwards). KVR_INVALID_ARGUMENT unless
 * finite and > 0. @thread_safety concurrent */
KVR_API kvr_status kvr_router_set_plan_deadline(kvr_router *router, double seconds,
                                                kvr_error **err);
/* Drops plans past their deadline now; `expired` (may be NULL) gets how many.
 * @thread_safety concurrent */
KVR_API kvr_status kvr_router_expire_plans(kvr_router *router, size_t *expired, kvr_error **err);
/* The rank a live session is bound to (does not refresh it). KVR_NOT_FOUND if unbound or
 * expired. @thread_safety concurrent */
KVR_API kvr_status kvr_router_session_binding(kvr_router *router, const char *session_id,
                                              uint64_t *worker_id, uint32_t *dp_rank,
                                              kvr_error **err);
/* Unbinds a session (no error if unbound). @thread_safety concurrent */
KVR_API kvr_status kvr_router_close_session(kvr_router *router, const char *session_id,
                                            kvr_error **err);
/* Drops expired bindings now; `reclaimed` (may be NULL) gets how many.
 * @thread_safety concurrent */
KVR_API kvr_status kvr_router_reclaim_sessions(kvr_router *router, size_t *reclaimed,
                                               kvr_error **err);
/* A digest of all routing state (index, active requests, queue, plans, sessions): equal
 * digests mean nothing changed. Stable within one process only. @thread_safety concurrent */
KVR_API kvr_status kvr_router_state_digest(kvr_router *router, uint64_t *out, kvr_error **err);
/* A digest of the KV index alone: which worker and rank holds which block, on which tier, under
 * which prefix (a rank holding nothing counts as one never heard of). Unlike
 * kvr_router_state_digest it is equal across processes and machines running the same library
 * version when their indexes hold the same blocks, so replicas can compare their views.
 * Bookings, the queue, plans and sessions do not enter it. With KVR_ROUTER_APPROXIMATE the index
 * is the routing decisions recorded when admitted or committed (until their TTL), so those do
 * change it. It may change between library versions. @thread_safety concurrent */
KVR_API kvr_status kvr_router_index_digest(kvr_router *router, uint64_t *out, kvr_error **err);
/* ---- Disaggregated prefill / decode --------------------------------------------------------- */
/* A prefill pool and a decode pool, each a full router (workers, events, request lifecycle
 * through the kvr_router_* functions on the handles below). */
typedef struct kvr_disagg kvr_disagg;
/* When a disaggregated request is prefilled on its decode worker instead of remotely. */
typedef uint32_t kvr_disagg_policy;
#define KVR_DISAGG_POLICY_MAP(X)                                               \
  X(ALWAYS, 0, "always prefill remotely (when prefill workers exist)")         \
  X(ISL_BOUNDING, 1, "prefill locally when the uncached prompt is short")      \
  X(PREFILL_LOAD, 2, "prefill locally when the chosen prefill worker is busy") \
  X(ISL_OR_LOAD, 3, "prefill locally when either condition holds")
enum kvr_disagg_policy_value {
#define KVR_DISAGG_POLICY_ENUM_(name, value, description) KVR_DISAGG_##name = value,
  KVR_DISAGG_POLICY_MAP(KVR_DISAGG_POLICY_ENUM_)
#undef KVR_DISAGG_POLICY_ENUM_
};
typedef struct kvr_disagg_options {
  uint32_t struct_size;
  kvr_disagg_policy policy; /* KVR_DISAGG_*; default always */
  uint32_t enforce;         /* 1: no prefill workers is KVR_FAILED_PRECONDITION, not aggregated */
  uint32_t reserved;
  /* isl_bounding: local when prompt − cached (on the decode worker) <= max_local_prefill_tokens
   * and (prompt − cached) / prompt <= max_local_prefill_ratio. Defaults 512 and 1.0. */
  uint64_t max_local_prefill_tokens;
  double max_local_prefill_ratio;
  /* prefill_load: busy when the chosen prefill rank's prefill tokens exceed this × its
   * max_num_batched_tokens. Default 1.0. */
  double prefill_busy_threshold;
  /* The decode-busy guard: never prefill locally on a decode rank whose decode blocks exceed
   * this fraction of its total_kv_blocks. Negative (default) or unknown capacity = the signal
   * is unavailable, so never prefill locally. NaN is KVR_INVALID_ARGUMENT. */
  double decode_busy_threshold;
} kvr_disagg_options;
/* Sized initialisation (as kvr_hash_options_init). @thread_safety concurrent */
KVR_API kvr_status kvr_disagg_options_init(kvr_disagg_options *options, size_t size);
/* prefill and decode: each pool's router options (NULL = defaults); opts may be NULL.
 * @thread_safety concurrent */
KVR_API kvr_status kvr_disagg_new(const kvr_router_options *prefill,
                                  const kvr_router_options *decode, const kvr_disagg_options *opts,
                                  kvr_disagg **out, kvr_error **err);
/* Accepts NULL. Frees both pools. @thread_safety none */
KVR_API void kvr_disagg_free(kvr_disagg *disagg);
/* The pools' routers, owned by the disagg object (never pass them to kvr_router_free).
 * @thread_safety concurrent */
KVR_API kvr_router *kvr_disagg_prefill_router(kvr_disagg *disagg);
KVR_API kvr_router *kvr_disagg_decode_router(kvr_disagg *disagg);
/* Why a prefill went where it went (kvr_prefill_result.reason). */
typedef uint32_t kvr_prefill_reason;
#define KVR_PREFILL_REASON_MAP(X)                                                 \
  X(REMOTE, 0, "booked on a prefill worker")                                      \
  X(NO_PREFILL_WORKERS, 1, "the prefill pool is empty: run aggregated on decode") \
  X(SHORT_ISL, 2, "policy: the uncached prompt is short")                         \
  X(WORKER_BUSY, 3, "policy: the prefill pool is busy")
enum kvr_prefill_reason_value {
#define KVR_PREFILL_REASON_ENUM_(name, value, description) KVR_PREFILL_##name = value,
  KVR_PREFILL_REASON_MAP(KVR_PREFILL_REASON_ENUM_)
#undef KVR_PREFILL_REASON_ENUM_
};
typedef struct kvr_prefill_result {
  uint32_t struct_size;
  uint32_t remote; /* 1: prefill on worker_id / dp_rank; 0: prefill on the decode worker */
  kvr_prefill_reason reason; /* KVR_PREFILL_* */
  uint32_t dp_rank;
  uint64_t worker_id;
  int64_t bootstrap_room; /* uniform in [0, INT64_MAX]; -1 when not remote */
  uint64_t cached_tokens;
} kvr_prefill_result;
/* Sized initialisation (as kvr_hash_options_init). @thread_safety concurrent */
KVR_API kvr_status kvr_prefill_result_init(kvr_prefill_result *result, size_t size);
/* Decides where the prompt is prefilled and, when remote, selects and books a prefill rank
 * under opts->request_id (free it on the prefill router when the prefill ends). Prefill pins
 * from hints apply. @thread_safety concurrent */
KVR_API kvr_status kvr_disagg_route_prefill(kvr_disagg *disagg, const uint32_t *tokens,
                                            size_t num_tokens, const kvr_request_options *opts,
                                            const kvr_routing_hints *hints, kvr_prefill_result *out,
                                            kvr_error **err);
/* Selects and books the decode rank (opts->request_id required). After a remote prefill
 * (remote_prefill 1) the decode overrides are forced: overlap credit 0, assume_kv_reuse and
 * track_prefill_tokens false, every other override kept. Decode pins from hints apply.
 * @thread_safety concurrent */
KVR_API kvr_status kvr_disagg_route_decode(kvr_disagg *disagg, const uint32_t *tokens,
                                           size_t num_tokens, const kvr_request_options *opts,
                                           const kvr_routing_hints *hints, int remote_prefill,
                                           kvr_route_signals *out, kvr_error **err);
/* Advisory: would the prefill rank chosen now (a preview) carry more than threshold ×
 * max_num_batched_tokens prefill tokens? A preview that finds no eligible rank counts as busy.
 * KVR_INVALID_ARGUMENT for a negative or NaN threshold. @thread_safety concurrent */
KVR_API kvr_status kvr_disagg_prefill_worker_busy(kvr_disagg *disagg, const uint32_t *tokens,
                                                  size_t num_tokens,
                                                  const kvr_request_options *opts, double threshold,
                                                  int *busy, kvr_error **err);

/* ---- KV event ingestion (docs/ingest.md) ----------------------------------------------------- */

/* An ingest object owns one event loop thread that receives KV events from every source and
 * applies them to a router, concurrently with routing calls. Sources: native stream listeners
 * (length-prefixed FlatBuffers EventBatches over TCP or a Unix socket), NATS subscriptions and
 * engine workers (vLLM or SGLang ZMQ publishers). Sources may be added before or after
 * kvr_ingest_start. */
typedef struct kvr_ingest kvr_ingest;

typedef struct kvr_ingest_options {
  uint32_t struct_size;
  uint32_t max_frame_bytes;   /* largest stream frame accepted; default (and maximum) 64 MiB */
  uint32_t replay_timeout_ms; /* a replay taking longer falls back to clearing; default 2000 */
  uint32_t reserved;
  /* Appended in 0.2.0: replica liveness for kvr_ingest_sync_replicas. Every
   * replica_heartbeat_ms the sync publishes a heartbeat (kvr_router_replica_heartbeat) and drops
   * the bookings of replicas silent for replica_timeout_ms (kvr_router_expire_replicas).
   * Defaults 1000 and 10000; replica_heartbeat_ms 0 = send none, replica_timeout_ms 0 = drop
   * none; at most 3,600,000 each. */
  uint32_t replica_heartbeat_ms;
  uint32_t replica_timeout_ms;
} kvr_ingest_options;

/* Sized initialisation (as kvr_hash_options_init). @thread_safety concurrent */
KVR_API kvr_status kvr_ingest_options_init(kvr_ingest_options *options, size_t size);

/* Creates a stopped ingest object feeding `router`, which must outlive it. opts may be NULL.
 * @thread_safety concurrent */
KVR_API kvr_status kvr_ingest_new(kvr_router *router, const kvr_ingest_options *opts,
                                  kvr_ingest **out, kvr_error **err);
/* Starts the loop thread. KVR_FAILED_PRECONDITION if started or stopped before.
 * @thread_safety concurrent */
KVR_API kvr_status kvr_ingest_start(kvr_ingest *ingest, kvr_error **err);
/* Closes every source and joins the loop thread. Final (no restart); idempotent. Waits first
 * for the calls that connect on their caller's thread (kvr_ingest_subscribe_nats,
 * kvr_ingest_subscribe_jetstream, kvr_ingest_relay_jetstream, kvr_ingest_sync_replicas) in
 * progress, each bounded by its connect and confirmation timeouts; those called after it are
 * KVR_FAILED_PRECONDITION. (Called from a callback on the ingest's own thread, it cannot wait
 * for them: there it must not overlap them.) @thread_safety concurrent (since 0.2.0; before,
 * not with those four) */
KVR_API kvr_status kvr_ingest_stop(kvr_ingest *ingest, kvr_error **err);
/* Stops if needed and destroys. Accepts NULL. @thread_safety none */
KVR_API void kvr_ingest_free(kvr_ingest *ingest);

/* Listens for native event streams on "tcp://HOST:PORT" (PORT 0 = a free port) or
 * "unix://PATH". `*source_id` (may be NULL) receives the source's id for kvr_ingest_get_stats;
 * `bound` (may be NULL with cap 0) the endpoint actually bound, NUL-terminated, with `*len`
 * (may be NULL) its size including the NUL. KVR_BUFFER_TOO_SMALL if cap is short: the listener
 * is open all the same and `*source_id` set, so do not listen again; read the endpoint with
 * kvr_ingest_source_endpoint. KVR_UNAVAILABLE if the address cannot be bound.
 * @thread_safety concurrent */
KVR_API kvr_status kvr_ingest_listen(kvr_ingest *ingest, const char *endpoint, uint64_t *source_id,
                                     char *bound, size_t cap, size_t *len, kvr_error **err);

/* The engine behind a ZMQ KV event publisher (both share one wire format). */
typedef uint32_t kvr_engine;
#define KVR_ENGINE_MAP(X) \
  X(VLLM, 0, "vLLM")      \
  X(SGLANG, 1, "SGLang")
enum kvr_engine_value {
#define KVR_ENGINE_ENUM_(name, value, description) KVR_ENGINE_##name = value,
  KVR_ENGINE_MAP(KVR_ENGINE_ENUM_)
#undef KVR_ENGINE_ENUM_
};

/* An engine worker publishing KV events over ZMQ PUB. */
typedef struct kvr_engine_worker {
  uint32_t struct_size;
  kvr_engine engine; /* KVR_ENGINE_*; both share the wire format, this is informational */
  /* "tcp://HOST:PORT" (rank dp_start + r on PORT + r: every rank's port in 1..65535) or
   * "ipc://PATH" (rank r at PATH_dp followed by r) */
  const char *endpoint;
  uint64_t worker_id;
  uint32_t dp_start;   /* default 0 */
  uint32_t dp_size;    /* 1..256 (a ZMQ socket each); default 1 */
  uint32_t block_size; /* 0 = the router's; anything else must equal it */
  uint32_t flags;      /* KVR_STORED_EAGLE: the model uses eagle block windows */
  const char *topic;   /* subscription prefix; NULL or "" = every message */
  /* vLLM's replay socket (--kv-events-config replay_endpoint; rank r as for endpoint), or
   * NULL: missed messages are then unrecoverable and the worker is cleared and flagged. A
   * reconnection to a rank's publisher (a restarted engine, or the network) is checked there
   * too, since a restarted engine may carry on the old one's numbers: the last message heard
   * must come back unchanged. Without a replay socket the rank is cleared and flagged (since
   * 0.2.0; state_unknown in kvr_ingest_stats) until the engine clears its cache. */
  const char *replay_endpoint;
} kvr_engine_worker;

/* Sized initialisation (as kvr_hash_options_init). @thread_safety concurrent */
KVR_API kvr_status kvr_engine_worker_init(kvr_engine_worker *worker, size_t size);
/* Subscribes to the worker's ranks (the router's own worker registry is separate: register it
 * there too for routing). KVR_INVALID_ARGUMENT for a block size other than the router's (the
 * message names both), an endpoint or replay endpoint that is not as above, or a dp_size
 * outside 1..256; KVR_RESOURCE_EXHAUSTED if ZMQ has no socket left (or libuv cannot poll one);
 * KVR_ALREADY_EXISTS for a worker id already subscribed. `*source_id` may be NULL.
 * @thread_safety concurrent */
KVR_API kvr_status kvr_ingest_add_engine_worker(kvr_ingest *ingest, const kvr_engine_worker *worker,
                                                uint64_t *source_id, kvr_error **err);
/* Unsubscribes; clear_index != 0 also drops the worker's entries from the index.
 * KVR_NOT_FOUND for an unknown id. @thread_safety concurrent */
KVR_API kvr_status kvr_ingest_remove_engine_worker(kvr_ingest *ingest, uint64_t worker_id,
                                                   int clear_index, kvr_error **err);

/* Subscribes to `subject` (NATS wildcards `*` and `>` allowed) on the NATS server at `url`
 * (e.g. "nats://127.0.0.1:4222"). Each message is one native EventBatch (the bytes of a stream
 * frame's payload, without the length prefix) or one message of Dynamo's KV event plane, as
 * Dynamo's KvEventPublisher publishes it on namespace.NS.component.C.endpoint.E.kv-events
 * (since 0.2.0; docs/ingest.md), told apart by content: a kvrouter gateway can route a Dynamo
 * fleet. Dynamo messages are numbered per publisher: a gap clears the ranks that publisher
 * spoke for (`gaps`, `missed_messages`, `recoveries`), an old number is STALE_SEQUENCE. Bad
 * messages are rejected and counted (KVR_INGEST_REJECT_BAD_FLATBUFFERS, or BAD_MSGPACK for
 * msgpack of another shape); `connections` counts (re)connections. The connection
 * retries forever when the server goes away and resubscribes when it is back (messages
 * published meanwhile are lost); one the NATS client gives up for good after a server's error
 * is made again, backing off to 30 s (`consumer_remakes`, `consumer_remake_failures`; since
 * 0.2.0: docs/ingest.md). After kvr_ingest_start, returns once the server has the
 * subscription; before, the subscription is sent when the loop starts. KVR_UNAVAILABLE if the
 * first connection fails. The connect runs on the caller's thread (since 0.2.0: a server that
 * does not answer holds the caller, up to 2 s per server of the url, while the ingest loop goes
 * on with the other sources). `*source_id` may be NULL. @thread_safety concurrent (with
 * kvr_ingest_stop since 0.2.0: it waits for this call; KVR_FAILED_PRECONDITION once it began) */
KVR_API kvr_status kvr_ingest_subscribe_nats(kvr_ingest *ingest, const char *url,
                                             const char *subject, uint64_t *source_id,
                                             kvr_error **err);

/* KV events from a NATS JetStream stream (since 0.2.0; docs/ingest.md): the messages
 * kvr_ingest_subscribe_nats takes (native EventBatches, Dynamo's event plane), kept by the
 * server until this router acknowledges each one after applying it, so that nothing is lost
 * while the router's ingest or the server is away. */
/* kvr_jetstream_source.flags */
#define KVR_JETSTREAM_RESUME 0x1u        /* an existing durable consumer keeps its position */
#define KVR_JETSTREAM_CREATE_STREAM 0x2u /* create the stream if absent, with the limits below */

typedef struct kvr_jetstream_source {
  uint32_t struct_size;
  uint32_t flags;      /* KVR_JETSTREAM_* */
  const char *url;     /* "nats://HOST:PORT" */
  const char *stream;  /* the stream's name (no spaces, '.', '*' or '>') */
  const char *subject; /* the subjects consumed (wildcards allowed); the stream's own subjects
                          when KVR_JETSTREAM_CREATE_STREAM creates it */
  /* The durable consumer's name, one per router (rules as the stream's); NULL or "" = an
   * ephemeral consumer, deleted when the source is removed. */
  const char *durable;
  /* The first stream sequence delivered; 0 (default) = the stream's first message. After
   * kvr_router_restore of a snapshot taken after kvr_ingest_stats.stream_sequence was N: N + 1
   * (events applied twice, in order, leave the index as it was). Without
   * KVR_JETSTREAM_RESUME, an existing durable consumer of that name is replaced. */
  uint64_t start_sequence;
  double max_age_seconds; /* KVR_JETSTREAM_CREATE_STREAM: default 3600; 0 = no limit */
  int64_t max_bytes;      /* KVR_JETSTREAM_CREATE_STREAM: default 1 GiB; -1 = no limit */
} kvr_jetstream_source;

/* Sized initialisation (as kvr_hash_options_init). @thread_safety concurrent */
KVR_API kvr_status kvr_jetstream_source_init(kvr_jetstream_source *source, size_t size);
/* Consumes `source`'s stream: each message is applied, then acknowledged (a message not
 * acknowledged, because the ingest stopped first, is delivered again). A message at or below
 * the last one applied (delivered again after later ones: a server restarted before it stored
 * the acknowledgement), unless stored after it (a stream that lost its tail numbers new
 * messages again), is acknowledged, not applied again, and counted as STALE_SEQUENCE.
 * Deliveries that never came (the consumer's delivery numbers skip them: lost as the
 * connection broke) are not a loss: nothing after them is applied until the source, on a
 * thread of its own, has made its consumer again from just after the last message applied, so
 * they come again, in order. Only if the stream no longer holds some of them (its limits
 * removed them), numbers messages anew (its server lost its tail: the consumer then starts by
 * the time the last message applied was stored), or the consumer cannot be made again for 10 s
 * (it is still retried), does that count in `gaps` and clear and flag every rank the source
 * fed (`state_unknown`), as for a NATS source's lost connection. The source's counters are those of
 * kvr_ingest_subscribe_nats, and `stream_sequence` the highest message applied.
 * The connection reconnects forever, and the consumer continues where it was. Connects and
 * sets up the consumer on the calling thread. KVR_INVALID_ARGUMENT for a missing url, stream
 * or subject, a bad name, unknown flags or bad limits; KVR_NOT_FOUND if the stream does not
 * exist (without KVR_JETSTREAM_CREATE_STREAM); KVR_UNAVAILABLE if the server cannot be reached
 * or refuses (the message says why). `*source_id` may be NULL.
 * @thread_safety as kvr_ingest_subscribe_nats */
KVR_API kvr_status kvr_ingest_subscribe_jetstream(kvr_ingest *ingest,
                                                  const kvr_jetstream_source *source,
                                                  uint64_t *source_id, kvr_error **err);

/* The JetStream relay (since 0.2.0; docs/ingest.md): republishes every change this ingest's
 * other sources make to the router's index (after their sequence checks, replays, restarts and
 * copies; not what a JetStream source consumed) into `target`'s stream as native EventBatches,
 * on subject `<subject>.<worker id>` (`subject` is a prefix: no wildcards), in order, each
 * message retried until the server acknowledges it. A router consuming the stream
 * (kvr_ingest_subscribe_jetstream on `<subject>.>`) then holds what this router's index holds
 * of those workers: this is how engines that publish over ZMQ (vLLM, SGLang) feed a durable
 * stream. KVR_JETSTREAM_CREATE_STREAM creates the stream on `<subject>.>` with the limits
 * given; `durable`, `start_sequence` and KVR_JETSTREAM_RESUME are a consumer's and must be
 * unset. Changes wait in a bounded queue while the server is away (64 MiB); past it the relay
 * resyncs once the server is back: a clear of every rank it relays, what the index holds of
 * them, then the changes since; what the index holds when the relay starts goes out first
 * that way. The stream must take those subjects (KVR_INVALID_ARGUMENT otherwise). One relay
 * per ingest object (KVR_FAILED_PRECONDITION for a second); it lasts until kvr_ingest_stop,
 * which waits up to 2 s for the queue (and for a connect under way: up to 2 s per server of
 * the url). The source's
 * counters: `messages` changes handed to the relay, `events_applied` those acknowledged,
 * `published` messages acknowledged, `publish_failures` attempts retried, `gaps` and
 * `missed_messages` queue overflows and the changes they dropped (sent again by the resync,
 * counted in `recoveries`), `state_unknown` 1 until then, `stream_sequence` the last message's
 * stream sequence, the lag from a change to its acknowledgement, `consumer_remakes` and
 * `consumer_remake_failures` a connection the NATS client gave up for good made again (and
 * the attempts that failed, backing off to 2 s; since 0.2.0). Errors as
 * kvr_ingest_subscribe_jetstream. `*source_id` may be NULL.
 * @thread_safety as kvr_ingest_subscribe_nats */
KVR_API kvr_status kvr_ingest_relay_jetstream(kvr_ingest *ingest,
                                              const kvr_jetstream_source *target,
                                              uint64_t *source_id, kvr_error **err);

/* Router replica sync over NATS: publishes the ingest's router's booking changes on `subject`
 * as `replica_id` (see kvr_router_set_replica_publisher for the id's rules) and applies the
 * changes the other replicas publish there. The source's counters: `messages` received,
 * `events_applied` (changes applied), `rejected` (BAD_FLATBUFFERS: not a change; INDEX: an
 * unknown worker rank or a duplicate booking), `published` and `publish_failures` (a change
 * too large for the server's messages even without its block ids, which only a server met on
 * a reconnection can cause, is dropped and counted there), `bookings_trimmed`. A booking
 * whose change is larger than the server's max_payload less 512 bytes goes with its leading
 * block ids (the limit read at every change, and 3,584 bytes while reconnecting, since
 * 0.2.0). Connection behaviour as kvr_ingest_subscribe_nats; while disconnected, the NATS
 * client buffers what is published, and once reconnected the sync joins again, as when it
 * started (its bookings announced, the peers asked for theirs; since 0.2.0), also once a
 * connection the client gave up is made again. A server whose
 * max_payload is under 4,096 bytes (too short for a change with the longest request id) is
 * refused at the start with KVR_FAILED_PRECONDITION (since 0.2.0). One sync per ingest object
 * (KVR_FAILED_PRECONDITION for a second). It replaces
 * the router's publisher (a kvr_router_set_replica_publisher callback, or another ingest
 * object's sync), which is not running once this returns; a later one replaces it in turn.
 * When the ingest stops, its sync stops publishing, unless it was replaced. KVR_UNAVAILABLE
 * if the server does not confirm the subscription: the sync is removed and the router is left
 * publishing nothing (a publisher it had replaced is not restored). Stopping, a sync that
 * still publishes for the router first publishes a Reset (since 0.2.0), so that the other
 * replicas drop this one's bookings at once rather than after their liveness timeout; the
 * stop waits up to 0.5 s for it to be written. And it drops the other replicas' bookings it
 * held (their frees would no longer reach it) and stops tracking them.
 * @thread_safety as kvr_ingest_subscribe_nats */
KVR_API kvr_status kvr_ingest_sync_replicas(kvr_ingest *ingest, const char *url,
                                            const char *subject, const char *replica_id,
                                            uint64_t *source_id, kvr_error **err);

/* Why ingestion rejected a message or an event: the index of kvr_ingest_stats.rejected. */
typedef uint32_t kvr_ingest_reject;
#define KVR_INGEST_REJECT_MAP(X)                                                          \
  X(FRAME_TOO_LARGE, 0, "a stream frame header over the limit: the connection is closed") \
  X(BAD_FLATBUFFERS, 1, "a frame that is not a valid EventBatch")                         \
  X(BAD_MSGPACK, 2, "an engine payload that does not decode")                             \
  X(BAD_MESSAGE, 3, "a ZMQ message that is not [topic, 8-byte sequence, payload]")        \
  X(BLOCK_SIZE, 4, "a stored event of another block size than the router's")              \
  X(INDEX, 5, "an event the index refused (unknown parent, ...)")                         \
  X(STALE_SEQUENCE, 6, "a sequence number already seen")
enum kvr_ingest_reject_value {
#define KVR_INGEST_REJECT_ENUM_(name, value, description) KVR_INGEST_REJECT_##name = value,
  KVR_INGEST_REJECT_MAP(KVR_INGEST_REJECT_ENUM_)
#undef KVR_INGEST_REJECT_ENUM_
      KVR_INGEST_REJECT_REASONS = 8 /* the length of kvr_ingest_stats.rejected, fixed forever */
};

/* Counters of one source, or of every source together. */
typedef struct kvr_ingest_stats {
  uint32_t struct_size;
  uint32_t state_unknown; /* ranks whose state was lost (gap) and not yet re-established, or
                          * whose engine connection dropped, until a message of the next
                          * connection is handled (since 0.2.0; docs/ingest.md) */
  uint64_t messages;      /* frames or ZMQ messages received */
  uint64_t events_applied;
  uint64_t rejected[KVR_INGEST_REJECT_REASONS]; /* messages or events, per KVR_INGEST_REJECT_* */
  uint64_t gaps;                                /* sequence jumps forward */
  uint64_t missed_messages;                     /* messages lost in those jumps */
  uint64_t restarts;                            /* publisher sequence resets to 0 */
  uint64_t recoveries;                          /* worker states cleared because they were lost */
  uint64_t connections; /* stream connections accepted; NATS connections and reconnections;
                         * engine workers: ZMQ handshakes with a rank's publisher, the first
                         * and every reconnection (counted since 0.2.0) */
  /* Lag: from a message's publication time (vLLM's batch `ts`, a native batch's publish time)
   * to its events being applied, in microseconds; messages without one are not measured. A
   * publisher clock ahead of this machine's counts as 0. For source 0: sums and the maxima. */
  uint64_t lag_samples;  /* messages measured */
  uint64_t lag_total_us; /* their lags summed (mean = lag_total_us / lag_samples) */
  uint64_t lag_max_us;   /* the largest */
  uint64_t lag_last_us;  /* the most recent message's */
  /* Replica sync (kvr_ingest_sync_replicas): changes published, and those the client refused */
  uint64_t published;
  uint64_t publish_failures;
  /* Appended in 0.2.0: the most recent reject's reason in words, NUL-terminated and cut to fit
   * (e.g. "event 1: unknown event tag 'SomethingNew'", "the connection closed inside a frame
   * (14 bytes of it received)"); empty when none was given. For source 0: the most recent over
   * every source. A caller whose struct ends before it does not get it. */
  char last_reject[128];
  /* Appended in 0.2.0: a JetStream source's last stream sequence applied (and acknowledged);
   * before its first message, where it starts after (start_sequence - 1, or a resumed durable
   * consumer's acknowledged floor); for source 0, the largest over the sources; 0 for other
   * sources. */
  uint64_t stream_sequence;
  /* Appended in 0.2.0: a JetStream source's consumer made again because deliveries were lost
   * on the way (a delivery number skipped: the lost ones and all after them come again, in
   * order, from the new consumer; docs/ingest.md), or after the NATS client gave its connection
   * up for good (the connection made again first), counted once the new consumer is in place;
   * and the attempts to make it that failed and were retried (the server unreachable, or
   * refusing). A core NATS or replica sync source's connection made again after the NATS client
   * gave it up for good (a server's error: docs/ingest.md), and the attempts that failed (since
   * 0.2.0); the same for a JetStream relay's connection. For source 0: sums; 0 for other
   * sources. */
  uint64_t consumer_remakes;
  uint64_t consumer_remake_failures;
  /* Appended in 0.2.0: engine events no router indexes, by design: those of a KV-cache group
   * neither full attention nor a sliding window whose size the engine said (a hybrid model's
   * Mamba or chunked local attention layers, which Dynamo's router leaves out too; sliding
   * windows limit a rank's hit, docs/ingest.md). Not rejects: the rest of their batch applies.
   * For source 0: sums. */
  uint64_t events_ignored;
  /* Appended in 0.2.0: replica sync's publications of a booking with only its leading block
   * ids, the transport's messages (the NATS server's max_payload) too short for them all (a
   * booking announced again counts again): peers count those bookings' prefix blocks only. */
  uint64_t bookings_trimmed;
} kvr_ingest_stats;

/* Where a source is, NUL-terminated: a listener's bound endpoint (with its real port), an
 * engine worker's endpoint, a NATS server's url (without user:password@); kept after the source
 * is removed, for the 1,024 most recently removed sources (older ones are forgotten, so that
 * workers coming and going do not grow memory without limit). An IPv6 listener reads
 * "tcp://[ADDR]:PORT", which kvr_ingest_listen takes too. `*len` (not NULL) is set to the bytes
 * needed including the NUL (also with KVR_BUFFER_TOO_SMALL). KVR_NOT_FOUND for an unknown or
 * forgotten id. @thread_safety concurrent */
KVR_API kvr_status kvr_ingest_source_endpoint(kvr_ingest *ingest, uint64_t source_id, char *buf,
                                              size_t cap, size_t *len, kvr_error **err);

/* Sized initialisation (as kvr_hash_options_init). @thread_safety concurrent */
KVR_API kvr_status kvr_ingest_stats_init(kvr_ingest_stats *stats, size_t size);
/* source_id 0 = the sum over every source ever added (forgotten ones included). KVR_NOT_FOUND
 * for an unknown id, or a removed source forgotten since (as kvr_ingest_source_endpoint).
 * @thread_safety concurrent */
KVR_API kvr_status kvr_ingest_get_stats(kvr_ingest *ingest, uint64_t source_id,
                                        kvr_ingest_stats *out, kvr_error **err);

/* Added in 0.2.0: every source's counters in Prometheus text exposition format, NUL-terminated
 * (kvrouter_ingest_*, one series per source labelled source_id, kind - listener, engine, nats,
 * replicas, jetstream or jetstream_relay - and endpoint; removed sources not yet forgotten included, as in
 * kvr_ingest_get_stats). The names
 * differ from kvr_router_metrics_prometheus's, so a /metrics page may serve both texts one
 * after the other. `*len` is set to the bytes needed including the NUL (also with
 * KVR_BUFFER_TOO_SMALL). @thread_safety concurrent */
KVR_API kvr_status kvr_ingest_metrics_prometheus(kvr_ingest *ingest, char *buf, size_t cap,
                                                 size_t *len, kvr_error **err);

/* ---- Publishing native event streams ------------------------------------------------------- */

/* A blocking client connection to a kvrouter stream listener, for engines in any language. */
typedef struct kvr_publisher kvr_publisher;

/* Connects to "tcp://HOST:PORT" or "unix://PATH". KVR_UNAVAILABLE if the connection fails.
 * @thread_safety concurrent */
KVR_API kvr_status kvr_publisher_connect(const char *endpoint, kvr_publisher **out,
                                         kvr_error **err);
/* Encodes the batch's events and sends them as one frame. KVR_UNAVAILABLE if the connection
 * is lost. @thread_safety none (for this publisher and this batch) */
KVR_API kvr_status kvr_publisher_send(kvr_publisher *publisher, const kvr_event_batch *batch,
                                      kvr_error **err);
/* Sends an already encoded EventBatch as one frame (the length header is added).
 * @thread_safety none (for this publisher) */
KVR_API kvr_status kvr_publisher_send_encoded(kvr_publisher *publisher, const void *data,
                                              size_t size, kvr_error **err);
/* Closes the connection. Accepts NULL. @thread_safety none */
KVR_API void kvr_publisher_free(kvr_publisher *publisher);

#ifdef __cplusplus
}
#endif

#endif /* KVROUTER_H */
