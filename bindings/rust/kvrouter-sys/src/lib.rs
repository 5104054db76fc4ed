//! Raw declarations of libkvrouter's C ABI, `include/kvrouter.h`, written by hand and checked
//! in: every function, struct and constant of the header, in its order. `kvr_status` is an
//! `i32`, as in C. The safe layer is the `kvrouter` crate.
//!
//! `tests/layout.rs` checks every struct's size, alignment and field offsets, every constant's
//! value, and every function's name and parameter types against the real header.
#![no_std]
#![allow(non_camel_case_types)]

use core::ffi::{c_char, c_int, c_void};
use core::marker::{PhantomData, PhantomPinned};

macro_rules! opaque {
    ($($(#[$doc:meta])* $name:ident;)*) => {$(
        $(#[$doc])*
        #[repr(C)]
        pub struct $name {
            _data: [u8; 0],
            _marker: PhantomData<(*mut u8, PhantomPinned)>,
        }
    )*};
}

// ---- Version --------------------------------------------------------------------------------

/// The header version these declarations mirror (`kvrouter_version.h`).
pub const KVR_VERSION_MAJOR: u32 = 0;
pub const KVR_VERSION_MINOR: u32 = 1;
pub const KVR_VERSION_PATCH: u32 = 0;
pub const KVR_VERSION_STRING: &str = "0.1.0";
pub const KVR_VERSION_NUMBER: u32 =
    KVR_VERSION_MAJOR * 10000 + KVR_VERSION_MINOR * 100 + KVR_VERSION_PATCH;

// ---- Status and errors ----------------------------------------------------------------------

pub type kvr_status = i32;
pub const KVR_OK: kvr_status = 0;
pub const KVR_CANCELLED: kvr_status = 1;
pub const KVR_INVALID_ARGUMENT: kvr_status = 3;
pub const KVR_DEADLINE_EXCEEDED: kvr_status = 4;
pub const KVR_NOT_FOUND: kvr_status = 5;
pub const KVR_ALREADY_EXISTS: kvr_status = 6;
pub const KVR_RESOURCE_EXHAUSTED: kvr_status = 8;
pub const KVR_FAILED_PRECONDITION: kvr_status = 9;
pub const KVR_UNIMPLEMENTED: kvr_status = 12;
pub const KVR_INTERNAL: kvr_status = 13;
pub const KVR_UNAVAILABLE: kvr_status = 14;
pub const KVR_BUFFER_TOO_SMALL: kvr_status = 100;

opaque! {
    /// A failure's status and message, owned by the caller.
    kvr_error;
    /// A library-owned byte buffer.
    kvr_buffer;
    kvr_router;
    kvr_event_batch;
    kvr_disagg;
    kvr_ingest;
    kvr_publisher;
}

// ---- Storage tiers --------------------------------------------------------------------------

pub const KVR_TIER_DEVICE: u32 = 0;
pub const KVR_TIER_HOST_PINNED: u32 = 1;
pub const KVR_TIER_DISK: u32 = 2;
pub const KVR_TIER_EXTERNAL: u32 = 3;

// ---- Block hashing --------------------------------------------------------------------------

pub const KVR_HASH_EAGLE: u32 = 0x1;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_hash_options {
    pub struct_size: u32,
    pub flags: u32,
    pub lora_name: *const c_char,
    pub cache_namespace: *const c_char,
    pub mm_hashes: *const u64,
    pub mm_counts: *const usize,
    pub mm_num_blocks: usize,
}

// ---- Router ---------------------------------------------------------------------------------

pub const KVR_ROUTER_APPROXIMATE: u32 = 0x1;
pub const KVR_ROUTER_NO_KV_REUSE: u32 = 0x2;
pub const KVR_ROUTER_NO_PREFILL_TRACKING: u32 = 0x4;
pub const KVR_ROUTER_EAGLE: u32 = 0x8;
pub const KVR_ROUTER_ENTROPY_SEED: u32 = 0x10;
/// `kvr_router_record_output` grows a request's blocks as it generates (Dynamo's
/// `router_track_output_blocks`).
pub const KVR_ROUTER_TRACK_OUTPUT_BLOCKS: u32 = 0x20;

pub const KVR_QUEUE_FCFS: u32 = 0;
pub const KVR_QUEUE_LCFS: u32 = 1;
pub const KVR_QUEUE_WSPT: u32 = 2;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_router_options {
    pub struct_size: u32,
    pub block_size: u32,
    pub flags: u32,
    pub queue_policy: u32,
    pub overlap_score_credit: f64,
    pub prefill_load_scale: f64,
    pub host_cache_hit_weight: f64,
    pub disk_cache_hit_weight: f64,
    pub temperature: f64,
    pub queue_threshold: f64,
    pub approx_ttl_seconds: f64,
    pub approx_max_blocks: u64,
    pub approx_prune_target_ratio: f64,
    pub request_expiry_seconds: f64,
    pub random_seed: u64,
    /// Appended in 0.1 (v2 of the struct): Dynamo's newer cost, 0 = off.
    pub overlap_score_credit_decay: f64,
    pub decode_active_request_weight: f64,
}

// ---- Workers --------------------------------------------------------------------------------

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_worker_config {
    pub struct_size: u32,
    pub block_size: u32,
    pub worker_id: u64,
    pub dp_start: u32,
    pub dp_size: u32,
    pub total_kv_blocks: u64,
    pub max_num_batched_tokens: u64,
}

// ---- KV events ------------------------------------------------------------------------------

pub const KVR_STORED_HAS_PARENT: u32 = 0x1;
pub const KVR_STORED_EAGLE: u32 = 0x2;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_stored_event {
    pub struct_size: u32,
    pub dp_rank: u32,
    pub worker_id: u64,
    pub event_id: u64,
    pub tier: u32,
    pub flags: u32,
    pub parent_hash: u64,
    pub block_hashes: *const u64,
    pub num_blocks: usize,
    pub local_hashes: *const u64,
    pub token_ids: *const u32,
    pub num_tokens: usize,
    pub lora_name: *const c_char,
    pub cache_namespace: *const c_char,
    pub mm_hashes: *const u64,
    pub mm_counts: *const usize,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_removed_event {
    pub struct_size: u32,
    pub dp_rank: u32,
    pub worker_id: u64,
    pub event_id: u64,
    pub tier: u32,
    pub reserved: u32,
    pub block_hashes: *const u64,
    pub num_blocks: usize,
}

// ---- Router replicas ------------------------------------------------------------------------

/// Receives one encoded change (a FlatBuffers `SequenceChange`) to send to the other replicas;
/// `data` is valid only during the call. Runs under the router's lock: it must be quick and
/// must not call into the router.
pub type kvr_replica_publish_fn =
    Option<unsafe extern "C" fn(user_data: *mut c_void, data: *const c_void, size: usize)>;

// ---- Routing --------------------------------------------------------------------------------

pub const KVR_REQUEST_ADMIT: u32 = 0x1;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_request_options {
    pub struct_size: u32,
    pub flags: u32,
    pub request_id: *const c_char,
    pub lora_name: *const c_char,
    pub cache_namespace: *const c_char,
    pub mm_hashes: *const u64,
    pub mm_counts: *const usize,
    pub mm_num_blocks: usize,
    pub allowed_worker_ids: *const u64,
    pub num_allowed_worker_ids: usize,
    pub overlap_score_credit: f64,
    pub prefill_load_scale: f64,
    pub host_cache_hit_weight: f64,
    pub disk_cache_hit_weight: f64,
    pub temperature: f64,
    pub assume_kv_reuse: i32,
    pub track_prefill_tokens: i32,
    pub priority_jump: f64,
    pub expected_output_tokens: u32,
    pub reserved: u32,
    pub queue_timeout_ms: i64,
    /// NaN (the default) = the router's.
    pub overlap_score_credit_decay: f64,
    /// NaN (the default) = the router's.
    pub decode_active_request_weight: f64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_route_result {
    pub struct_size: u32,
    pub dp_rank: u32,
    pub worker_id: u64,
    pub prompt_blocks: u32,
    pub device_overlap_blocks: u32,
    pub effective_overlap_blocks: f64,
    pub cached_tokens: u64,
    pub prompt_tokens: u64,
    pub cost: f64,
    pub booked: u32,
    pub queued: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_candidate {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub device_blocks: u32,
    pub host_blocks: u32,
    pub disk_blocks: u32,
    pub external_blocks: u32,
    pub chosen: u32,
    pub effective_overlap_blocks: f64,
    pub cached_tokens: u64,
    pub active_prefill_tokens: u64,
    pub active_blocks: u64,
    pub new_blocks: u64,
    pub raw_prefill_blocks: f64,
    pub credit: f64,
    pub prefill_cost: f64,
    pub decode_blocks: u64,
    pub cost: f64,
    pub probability: f64,
    /// The factor the device credit was multiplied by (1 = no decay).
    pub credit_decay: f64,
    pub active_requests: u64,
    /// `decode_active_request_weight × active_requests` (part of `cost`).
    pub request_cost: f64,
    pub reserved: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_overlap {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub device_blocks: u32,
    pub host_blocks: u32,
    pub disk_blocks: u32,
    pub external_blocks: u32,
    pub reserved0: u32,
    pub effective_overlap_blocks: f64,
    pub cached_tokens: u64,
    pub tree_size: u64,
    pub reserved: [u64; 2],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_potential_load {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub reserved0: u32,
    pub potential_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    pub active_prefill_tokens: u64,
    pub active_blocks: u64,
    pub active_requests: u64,
    pub reserved: [u64; 2],
}

// ---- Metrics --------------------------------------------------------------------------------

pub const KVR_EVENT_STORED: usize = 0;
pub const KVR_EVENT_REMOVED: usize = 1;
pub const KVR_EVENT_CLEARED: usize = 2;
pub const KVR_EVENT_KINDS: usize = 3;
pub const KVR_EVENT_OK: usize = 0;
pub const KVR_EVENT_PARENT_BLOCK_NOT_FOUND: usize = 1;
pub const KVR_EVENT_BLOCK_NOT_FOUND: usize = 2;
pub const KVR_EVENT_INVALID_BLOCK_SEQUENCE: usize = 3;
pub const KVR_EVENT_INVALID_BLOCK: usize = 4;
pub const KVR_EVENT_OUTCOMES: usize = 5;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_metrics {
    pub struct_size: u32,
    pub reserved0: u32,
    pub events: [[u64; KVR_EVENT_OUTCOMES]; KVR_EVENT_KINDS],
    pub event_batches_rejected: u64,
    pub decisions: u64,
    pub requests_active: u64,
    pub queue_pending: u64,
    pub queue_pending_tokens: u64,
    pub workers: u64,
    pub index_nodes: u64,
    pub index_blocks: u64,
    pub index_bytes: i64,
    pub replica_changes_applied: u64,
    pub replica_changes_rejected: u64,
    pub replica_requests_active: u64,
}

// ---- Staged routing -------------------------------------------------------------------------

pub const KVR_PHASE_AGGREGATED: u32 = 0;
pub const KVR_PHASE_PREFILL: u32 = 1;
pub const KVR_PHASE_DECODE: u32 = 2;
pub const KVR_WORKER_NONE: u64 = u64::MAX;
pub const KVR_SESSION_HARD: u32 = 0;
pub const KVR_SESSION_SOFT: u32 = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_routing_hints {
    pub struct_size: u32,
    pub phase: u32,
    pub worker_id: u64,
    pub prefill_worker_id: u64,
    pub decode_worker_id: u64,
    pub dp_rank: i32,
    pub prefill_dp_rank: i32,
    pub session_id: *const c_char,
    pub session_mode: u32,
    pub reserved: u32,
    pub session_ttl_seconds: f64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_route_signals {
    pub struct_size: u32,
    pub dp_rank: u32,
    pub worker_id: u64,
    pub overlap_blocks: u32,
    pub prompt_blocks: u32,
    pub cached_tokens: u64,
    pub potential_decode_blocks: u64,
    pub total_kv_blocks: u64,
    pub cost: f64,
    pub prompt_tokens: u64,
    pub booked: u32,
    pub moved: u32,
    pub queued: u32,
    pub reserved: u32,
}

// ---- Disaggregated prefill / decode ---------------------------------------------------------

pub const KVR_DISAGG_ALWAYS: u32 = 0;
pub const KVR_DISAGG_ISL_BOUNDING: u32 = 1;
pub const KVR_DISAGG_PREFILL_LOAD: u32 = 2;
pub const KVR_DISAGG_ISL_OR_LOAD: u32 = 3;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_disagg_options {
    pub struct_size: u32,
    pub policy: u32,
    pub enforce: u32,
    pub reserved: u32,
    pub max_local_prefill_tokens: u64,
    pub max_local_prefill_ratio: f64,
    pub prefill_busy_threshold: f64,
    pub decode_busy_threshold: f64,
}

pub const KVR_PREFILL_REMOTE: u32 = 0;
pub const KVR_PREFILL_NO_PREFILL_WORKERS: u32 = 1;
pub const KVR_PREFILL_SHORT_ISL: u32 = 2;
pub const KVR_PREFILL_WORKER_BUSY: u32 = 3;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_prefill_result {
    pub struct_size: u32,
    pub remote: u32,
    pub reason: u32,
    pub dp_rank: u32,
    pub worker_id: u64,
    pub bootstrap_room: i64,
    pub cached_tokens: u64,
}

// ---- KV event ingestion ---------------------------------------------------------------------

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_ingest_options {
    pub struct_size: u32,
    pub max_frame_bytes: u32,
    pub replay_timeout_ms: u32,
    pub reserved: u32,
}

pub const KVR_ENGINE_VLLM: u32 = 0;
pub const KVR_ENGINE_SGLANG: u32 = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_engine_worker {
    pub struct_size: u32,
    pub engine: u32,
    pub endpoint: *const c_char,
    pub worker_id: u64,
    pub dp_start: u32,
    pub dp_size: u32,
    pub block_size: u32,
    pub flags: u32,
    pub topic: *const c_char,
    pub replay_endpoint: *const c_char,
}

pub const KVR_INGEST_REJECT_FRAME_TOO_LARGE: usize = 0;
pub const KVR_INGEST_REJECT_BAD_FLATBUFFERS: usize = 1;
pub const KVR_INGEST_REJECT_BAD_MSGPACK: usize = 2;
pub const KVR_INGEST_REJECT_BAD_MESSAGE: usize = 3;
pub const KVR_INGEST_REJECT_BLOCK_SIZE: usize = 4;
pub const KVR_INGEST_REJECT_INDEX: usize = 5;
pub const KVR_INGEST_REJECT_STALE_SEQUENCE: usize = 6;
pub const KVR_INGEST_REJECT_REASONS: usize = 8;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvr_ingest_stats {
    pub struct_size: u32,
    pub state_unknown: u32,
    pub messages: u64,
    pub events_applied: u64,
    pub rejected: [u64; KVR_INGEST_REJECT_REASONS],
    pub gaps: u64,
    pub missed_messages: u64,
    pub restarts: u64,
    pub recoveries: u64,
    pub connections: u64,
    pub lag_samples: u64,
    pub lag_total_us: u64,
    pub lag_max_us: u64,
    pub lag_last_us: u64,
    pub published: u64,
    pub publish_failures: u64,
}

extern "C" {
    // ---- Version ----
    pub fn kvr_version() -> u32;
    pub fn kvr_version_string() -> *const c_char;

    // ---- Status and errors ----
    pub fn kvr_status_str(status: kvr_status) -> *const c_char;
    pub fn kvr_error_status(error: *const kvr_error) -> kvr_status;
    pub fn kvr_error_message(error: *const kvr_error) -> *const c_char;
    pub fn kvr_error_free(error: *mut kvr_error);

    // ---- Library-owned byte buffers ----
    pub fn kvr_buffer_data(buffer: *const kvr_buffer) -> *const u8;
    pub fn kvr_buffer_size(buffer: *const kvr_buffer) -> usize;
    pub fn kvr_buffer_free(buffer: *mut kvr_buffer);

    // ---- Storage tiers ----
    pub fn kvr_tier_from_medium(medium: *const c_char) -> u32;

    // ---- Block hashing ----
    pub fn kvr_hash_options_init(options: *mut kvr_hash_options);
    pub fn kvr_compute_block_hashes(
        tokens: *const u32,
        num_tokens: usize,
        block_size: u32,
        opts: *const kvr_hash_options,
        out: *mut u64,
        cap: usize,
        len: *mut usize,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_compute_sequence_hashes(
        local_hashes: *const u64,
        num_hashes: usize,
        out: *mut u64,
        cap: usize,
        len: *mut usize,
        err: *mut *mut kvr_error,
    ) -> kvr_status;

    // ---- Router ----
    pub fn kvr_router_options_init(options: *mut kvr_router_options);
    pub fn kvr_router_new(
        opts: *const kvr_router_options,
        out: *mut *mut kvr_router,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_free(router: *mut kvr_router);

    // ---- Workers ----
    pub fn kvr_worker_config_init(config: *mut kvr_worker_config);
    pub fn kvr_router_add_worker(
        router: *mut kvr_router,
        config: *const kvr_worker_config,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_update_worker(
        router: *mut kvr_router,
        config: *const kvr_worker_config,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_remove_worker(
        router: *mut kvr_router,
        worker_id: u64,
        err: *mut *mut kvr_error,
    ) -> kvr_status;

    // ---- KV events ----
    pub fn kvr_stored_event_init(event: *mut kvr_stored_event);
    pub fn kvr_removed_event_init(event: *mut kvr_removed_event);
    pub fn kvr_router_apply_stored(
        router: *mut kvr_router,
        event: *const kvr_stored_event,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_apply_removed(
        router: *mut kvr_router,
        event: *const kvr_removed_event,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_apply_cleared(
        router: *mut kvr_router,
        worker_id: u64,
        dp_rank: u32,
        event_id: u64,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_apply_event_batch(
        router: *mut kvr_router,
        data: *const c_void,
        size: usize,
        err: *mut *mut kvr_error,
    ) -> kvr_status;

    // ---- Router replicas ----
    pub fn kvr_router_set_replica_publisher(
        router: *mut kvr_router,
        replica_id: *const c_char,
        publish: kvr_replica_publish_fn,
        user_data: *mut c_void,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_apply_replica_event(
        router: *mut kvr_router,
        data: *const c_void,
        size: usize,
        err: *mut *mut kvr_error,
    ) -> kvr_status;

    // ---- Encoding event batches ----
    pub fn kvr_event_batch_new(
        out: *mut *mut kvr_event_batch,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_event_batch_free(batch: *mut kvr_event_batch);
    pub fn kvr_event_batch_add_stored(
        batch: *mut kvr_event_batch,
        event: *const kvr_stored_event,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_event_batch_add_removed(
        batch: *mut kvr_event_batch,
        event: *const kvr_removed_event,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_event_batch_add_cleared(
        batch: *mut kvr_event_batch,
        worker_id: u64,
        dp_rank: u32,
        event_id: u64,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_event_batch_size(batch: *const kvr_event_batch) -> usize;
    pub fn kvr_event_batch_set_publish_time(
        batch: *mut kvr_event_batch,
        unix_ns: u64,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_event_batch_encode(
        batch: *const kvr_event_batch,
        out: *mut *mut kvr_buffer,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_event_batch_clear(batch: *mut kvr_event_batch);

    // ---- Routing ----
    pub fn kvr_request_options_init(options: *mut kvr_request_options);
    pub fn kvr_route_result_init(result: *mut kvr_route_result);
    pub fn kvr_find_best_match(
        router: *mut kvr_router,
        tokens: *const u32,
        num_tokens: usize,
        opts: *const kvr_request_options,
        out: *mut kvr_route_result,
        candidates: *mut kvr_candidate,
        cap: usize,
        num_candidates: *mut usize,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_overlap_scores(
        router: *mut kvr_router,
        tokens: *const u32,
        num_tokens: usize,
        opts: *const kvr_request_options,
        out: *mut kvr_overlap,
        cap: usize,
        len: *mut usize,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_potential_loads(
        router: *mut kvr_router,
        tokens: *const u32,
        num_tokens: usize,
        opts: *const kvr_request_options,
        out: *mut kvr_potential_load,
        cap: usize,
        len: *mut usize,
        err: *mut *mut kvr_error,
    ) -> kvr_status;

    // ---- Request lifecycle ----
    pub fn kvr_router_add_request(
        router: *mut kvr_router,
        tokens: *const u32,
        num_tokens: usize,
        worker_id: u64,
        dp_rank: u32,
        opts: *const kvr_request_options,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_mark_prefill_completed(
        router: *mut kvr_router,
        request_id: *const c_char,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_record_output(
        router: *mut kvr_router,
        request_id: *const c_char,
        output_tokens: u64,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_free_request(
        router: *mut kvr_router,
        request_id: *const c_char,
        err: *mut *mut kvr_error,
    ) -> kvr_status;

    // ---- Index snapshot ----
    pub fn kvr_router_snapshot(
        router: *mut kvr_router,
        out: *mut *mut kvr_buffer,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_restore(
        router: *mut kvr_router,
        data: *const c_void,
        size: usize,
        err: *mut *mut kvr_error,
    ) -> kvr_status;

    // ---- Metrics ----
    pub fn kvr_metrics_init(metrics: *mut kvr_metrics);
    pub fn kvr_router_get_metrics(
        router: *mut kvr_router,
        out: *mut kvr_metrics,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_metrics_prometheus(
        router: *mut kvr_router,
        buf: *mut c_char,
        cap: usize,
        len: *mut usize,
        err: *mut *mut kvr_error,
    ) -> kvr_status;

    // ---- Staged routing ----
    pub fn kvr_routing_hints_init(hints: *mut kvr_routing_hints);
    pub fn kvr_route_signals_init(signals: *mut kvr_route_signals);
    pub fn kvr_preview_route(
        router: *mut kvr_router,
        tokens: *const u32,
        num_tokens: usize,
        opts: *const kvr_request_options,
        hints: *const kvr_routing_hints,
        out: *mut kvr_route_signals,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_plan_route(
        router: *mut kvr_router,
        tokens: *const u32,
        num_tokens: usize,
        opts: *const kvr_request_options,
        hints: *const kvr_routing_hints,
        previewed: *const kvr_route_signals,
        out: *mut kvr_route_signals,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_commit_route(
        router: *mut kvr_router,
        request_id: *const c_char,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_abort_route(
        router: *mut kvr_router,
        request_id: *const c_char,
        freed: *mut c_int,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_set_plan_deadline(
        router: *mut kvr_router,
        seconds: f64,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_expire_plans(
        router: *mut kvr_router,
        expired: *mut usize,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_session_binding(
        router: *mut kvr_router,
        session_id: *const c_char,
        worker_id: *mut u64,
        dp_rank: *mut u32,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_close_session(
        router: *mut kvr_router,
        session_id: *const c_char,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_reclaim_sessions(
        router: *mut kvr_router,
        reclaimed: *mut usize,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_router_state_digest(
        router: *mut kvr_router,
        out: *mut u64,
        err: *mut *mut kvr_error,
    ) -> kvr_status;

    // ---- Disaggregated prefill / decode ----
    pub fn kvr_disagg_options_init(options: *mut kvr_disagg_options);
    pub fn kvr_disagg_new(
        prefill: *const kvr_router_options,
        decode: *const kvr_router_options,
        opts: *const kvr_disagg_options,
        out: *mut *mut kvr_disagg,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_disagg_free(disagg: *mut kvr_disagg);
    pub fn kvr_disagg_prefill_router(disagg: *mut kvr_disagg) -> *mut kvr_router;
    pub fn kvr_disagg_decode_router(disagg: *mut kvr_disagg) -> *mut kvr_router;
    pub fn kvr_prefill_result_init(result: *mut kvr_prefill_result);
    pub fn kvr_disagg_route_prefill(
        disagg: *mut kvr_disagg,
        tokens: *const u32,
        num_tokens: usize,
        opts: *const kvr_request_options,
        hints: *const kvr_routing_hints,
        out: *mut kvr_prefill_result,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_disagg_route_decode(
        disagg: *mut kvr_disagg,
        tokens: *const u32,
        num_tokens: usize,
        opts: *const kvr_request_options,
        hints: *const kvr_routing_hints,
        remote_prefill: c_int,
        out: *mut kvr_route_signals,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_disagg_prefill_worker_busy(
        disagg: *mut kvr_disagg,
        tokens: *const u32,
        num_tokens: usize,
        opts: *const kvr_request_options,
        threshold: f64,
        busy: *mut c_int,
        err: *mut *mut kvr_error,
    ) -> kvr_status;

    // ---- KV event ingestion ----
    pub fn kvr_ingest_options_init(options: *mut kvr_ingest_options);
    pub fn kvr_ingest_new(
        router: *mut kvr_router,
        opts: *const kvr_ingest_options,
        out: *mut *mut kvr_ingest,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_ingest_start(ingest: *mut kvr_ingest, err: *mut *mut kvr_error) -> kvr_status;
    pub fn kvr_ingest_stop(ingest: *mut kvr_ingest, err: *mut *mut kvr_error) -> kvr_status;
    pub fn kvr_ingest_free(ingest: *mut kvr_ingest);
    pub fn kvr_ingest_listen(
        ingest: *mut kvr_ingest,
        endpoint: *const c_char,
        source_id: *mut u64,
        bound: *mut c_char,
        cap: usize,
        len: *mut usize,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_engine_worker_init(worker: *mut kvr_engine_worker);
    pub fn kvr_ingest_add_engine_worker(
        ingest: *mut kvr_ingest,
        worker: *const kvr_engine_worker,
        source_id: *mut u64,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_ingest_remove_engine_worker(
        ingest: *mut kvr_ingest,
        worker_id: u64,
        clear_index: c_int,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_ingest_subscribe_nats(
        ingest: *mut kvr_ingest,
        url: *const c_char,
        subject: *const c_char,
        source_id: *mut u64,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_ingest_sync_replicas(
        ingest: *mut kvr_ingest,
        url: *const c_char,
        subject: *const c_char,
        replica_id: *const c_char,
        source_id: *mut u64,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_ingest_source_endpoint(
        ingest: *mut kvr_ingest,
        source_id: u64,
        buf: *mut c_char,
        cap: usize,
        len: *mut usize,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_ingest_stats_init(stats: *mut kvr_ingest_stats);
    pub fn kvr_ingest_get_stats(
        ingest: *mut kvr_ingest,
        source_id: u64,
        out: *mut kvr_ingest_stats,
        err: *mut *mut kvr_error,
    ) -> kvr_status;

    // ---- Publishing native event streams ----
    pub fn kvr_publisher_connect(
        endpoint: *const c_char,
        out: *mut *mut kvr_publisher,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_publisher_send(
        publisher: *mut kvr_publisher,
        batch: *const kvr_event_batch,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_publisher_send_encoded(
        publisher: *mut kvr_publisher,
        data: *const c_void,
        size: usize,
        err: *mut *mut kvr_error,
    ) -> kvr_status;
    pub fn kvr_publisher_free(publisher: *mut kvr_publisher);
}
