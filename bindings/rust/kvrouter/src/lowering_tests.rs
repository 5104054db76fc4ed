//! The plumbing between the safe layer's plain structs and the C structs they are lowered to:
//! every setting reaches its C field, and the safe defaults are the library's.
//!
//! The raw structs are compared field by field, by their bytes. A field list here must cover
//! its struct completely (the generated structs have no padding, so the fields' sizes add up to
//! `size_of`): a field the header gains fails these tests until it is listed, and then until the
//! safe layer sets it.

use std::mem::size_of;
use std::time::Duration;

use kvrouter_sys as sys;

use crate::raw::init;
use crate::*;

/// A value's bytes (every generated struct field is plain data: integers, floats, pointers).
fn bytes_of<T: Copy>(value: &T) -> Vec<u8> {
    // SAFETY: a live, initialised T of size_of::<T>() bytes, with no padding (plain fields).
    unsafe { std::slice::from_raw_parts((value as *const T).cast::<u8>(), size_of::<T>()) }.to_vec()
}

/// `(field name, bytes)` for the listed fields of a raw struct, in order; panics unless the
/// fields cover the struct's every byte.
macro_rules! fields {
    ($value:expr, $t:ident { $($f:ident),* $(,)? }) => {{
        let value: &sys::$t = &$value;
        let fields: Vec<(&'static str, Vec<u8>)> = vec![$((stringify!($f), bytes_of(&value.$f))),*];
        let covered: usize = fields.iter().map(|(_, b)| b.len()).sum();
        assert_eq!(
            covered,
            size_of::<sys::$t>(),
            "{}: the field list misses a field of the generated struct",
            stringify!($t)
        );
        fields
    }};
}

macro_rules! router_options_fields {
    ($value:expr) => {
        fields!(
            $value,
            kvr_router_options {
                struct_size,
                block_size,
                flags,
                queue_policy,
                overlap_score_credit,
                prefill_load_scale,
                host_cache_hit_weight,
                disk_cache_hit_weight,
                temperature,
                queue_threshold,
                approx_ttl_seconds,
                approx_max_blocks,
                approx_prune_target_ratio,
                request_expiry_seconds,
                random_seed,
                overlap_score_credit_decay,
                decode_active_request_weight,
                index_shards,
                reserved,
                cost_function,
                reserved2,
                prefill_tokens_per_second,
                ttft_miss_weight,
            }
        )
    };
}

/// The library's own defaults, straight from `kvr_router_options_init` (not through
/// `raw::init`, which the safe layer uses).
fn library_router_defaults() -> sys::kvr_router_options {
    // SAFETY: all-zero bytes are a valid kvr_router_options; _init writes within its size.
    let mut raw: sys::kvr_router_options = unsafe { std::mem::zeroed() };
    let size = size_of::<sys::kvr_router_options>();
    // SAFETY: a writable struct of `size` bytes.
    let status = unsafe { sys::kvr_router_options_init(&mut raw, size) };
    assert_eq!(status, sys::KVR_OK);
    assert_eq!(raw.struct_size as usize, size);
    raw
}

/// Fields of `set` still equal to `default`'s, but for those named in `unset` (struct_size,
/// reserved fields).
fn left_at_default(
    set: &[(&'static str, Vec<u8>)],
    default: &[(&'static str, Vec<u8>)],
    unset: &[&str],
) -> Vec<&'static str> {
    set.iter()
        .zip(default)
        .filter(|((name, s), (_, d))| !unset.contains(name) && s == d)
        .map(|((name, _), _)| *name)
        .collect()
}

/// Every RouterOptions field away from its default (and every flag away from Dynamo's).
fn every_router_option_set() -> RouterOptions {
    RouterOptions {
        block_size: 32,
        approximate: true,
        assume_kv_reuse: false,
        track_prefill_tokens: false,
        eagle: true,
        entropy_seed: true,
        track_output_blocks: true,
        queue_policy: QueuePolicy::Wspt,
        overlap_score_credit: 0.5,
        prefill_load_scale: 2.0,
        host_cache_hit_weight: 0.625,
        disk_cache_hit_weight: 0.125,
        temperature: 0.7,
        queue_threshold: Some(1.5),
        approx_ttl_seconds: 60.0,
        approx_max_blocks: 4096,
        approx_prune_target_ratio: 0.5,
        request_expiry_seconds: 30.0,
        random_seed: 42,
        overlap_score_credit_decay: 0.3,
        decode_active_request_weight: 0.2,
        index_shards: 4,
        cost_function: CostFunction::PredictedTtft,
        prefill_tokens_per_second: 5000.0,
        ttft_miss_weight: 0.5,
    }
}

#[test]
fn router_option_defaults_are_the_librarys_field_by_field() {
    let library = library_router_defaults();
    let safe = RouterOptions::default().to_raw();
    let (library, safe) = (
        router_options_fields!(library),
        router_options_fields!(safe),
    );
    let differ: Vec<&str> = safe
        .iter()
        .zip(&library)
        .filter(|((_, s), (_, l))| s != l)
        .map(|((name, _), _)| *name)
        .collect();
    assert!(
        differ.is_empty(),
        "RouterOptions::default() differs in {differ:?}"
    );
    // And what the safe struct says (a few the README documents).
    let d = RouterOptions::default();
    assert_eq!((d.block_size, d.queue_threshold), (16, None));
    assert!(d.assume_kv_reuse && d.track_prefill_tokens && !d.approximate);
    assert_eq!(d.index_shards, 1);
    assert_eq!(d.cost_function, CostFunction::Credit);
    assert_eq!(
        (d.prefill_tokens_per_second, d.ttft_miss_weight),
        (0.0, 3.0)
    );
}

#[test]
fn every_router_option_reaches_the_c_struct() {
    let set = every_router_option_set();
    let raw = set.to_raw();
    assert_eq!(
        raw.struct_size as usize,
        size_of::<sys::kvr_router_options>()
    );
    // Nothing is lost on the way: the C struct reads back as the same options...
    assert_eq!(RouterOptions::from_raw(&raw), set);
    // ... and no C field is left at the library's default, so none is forgotten.
    let left = left_at_default(
        &router_options_fields!(raw),
        &router_options_fields!(library_router_defaults()),
        &["struct_size", "reserved", "reserved2"],
    );
    assert!(left.is_empty(), "fields to_raw() does not set: {left:?}");
    // Each flag on its own, on its own bit.
    let d = RouterOptions::default;
    let flags: [(RouterOptions, u32); 6] = [
        (
            RouterOptions {
                approximate: true,
                ..d()
            },
            sys::KVR_ROUTER_APPROXIMATE,
        ),
        (
            RouterOptions {
                assume_kv_reuse: false,
                ..d()
            },
            sys::KVR_ROUTER_NO_KV_REUSE,
        ),
        (
            RouterOptions {
                track_prefill_tokens: false,
                ..d()
            },
            sys::KVR_ROUTER_NO_PREFILL_TRACKING,
        ),
        (RouterOptions { eagle: true, ..d() }, sys::KVR_ROUTER_EAGLE),
        (
            RouterOptions {
                entropy_seed: true,
                ..d()
            },
            sys::KVR_ROUTER_ENTROPY_SEED,
        ),
        (
            RouterOptions {
                track_output_blocks: true,
                ..d()
            },
            sys::KVR_ROUTER_TRACK_OUTPUT_BLOCKS,
        ),
    ];
    for (options, flag) in flags {
        assert_eq!(options.to_raw().flags, flag, "{options:?}");
        assert_eq!(RouterOptions::from_raw(&options.to_raw()), options);
    }
    for (policy, raw) in [
        (QueuePolicy::Fcfs, sys::KVR_QUEUE_FCFS),
        (QueuePolicy::Lcfs, sys::KVR_QUEUE_LCFS),
        (QueuePolicy::Wspt, sys::KVR_QUEUE_WSPT),
    ] {
        let options = RouterOptions {
            queue_policy: policy,
            ..d()
        };
        assert_eq!(options.to_raw().queue_policy, raw);
    }
    for (cost, raw) in [
        (CostFunction::Credit, sys::KVR_COST_CREDIT),
        (CostFunction::PredictedTtft, sys::KVR_COST_PREDICTED_TTFT),
    ] {
        let options = RouterOptions {
            cost_function: cost,
            ..d()
        };
        assert_eq!(options.to_raw().cost_function, raw);
        assert_eq!(RouterOptions::from_raw(&options.to_raw()), options);
    }
    // The library takes every one of them, but for the predicted-TTFT cost, which needs the
    // prefill tracking `set` turns off.
    Router::new(&RouterOptions {
        cost_function: CostFunction::Credit,
        ..set.clone()
    })
    .unwrap();
    assert_eq!(Router::new(&set).unwrap_err().code(), Code::InvalidArgument);
}

#[test]
fn every_worker_and_request_setting_reaches_the_c_struct() {
    let worker = WorkerConfig {
        worker_id: 7,
        block_size: 32,
        dp_start: 2,
        dp_size: 3,
        total_kv_blocks: 1000,
        max_num_batched_tokens: 4096,
    };
    let default: sys::kvr_worker_config = init();
    macro_rules! worker_fields {
        ($v:expr) => {
            fields!(
                $v,
                kvr_worker_config {
                    struct_size,
                    block_size,
                    worker_id,
                    dp_start,
                    dp_size,
                    total_kv_blocks,
                    max_num_batched_tokens
                }
            )
        };
    }
    let left = left_at_default(
        &worker_fields!(worker.to_raw()),
        &worker_fields!(default),
        &["struct_size"],
    );
    assert!(left.is_empty(), "WorkerConfig leaves {left:?}");
    let new = WorkerConfig::new(7).to_raw();
    assert_eq!(
        bytes_of(&new),
        bytes_of(&sys::kvr_worker_config {
            worker_id: 7,
            ..default
        })
    );

    let (ids, mm_hashes, mm_counts) = ([1u64, 2], [9u64, 8, 7], [1usize, 2]);
    let local_hashes = [5u64, 6, 7];
    let request = RequestOptions {
        admit: true,
        request_id: Some("r"),
        lora_name: Some("lora"),
        cache_namespace: Some("ns"),
        multimodal: Some(Multimodal {
            hashes: &mm_hashes,
            counts: &mm_counts,
        }),
        allowed_worker_ids: Some(&ids),
        overlap_score_credit: Some(0.5),
        prefill_load_scale: Some(2.0),
        host_cache_hit_weight: Some(0.5),
        disk_cache_hit_weight: Some(0.125),
        temperature: Some(0.5),
        assume_kv_reuse: Some(false),
        track_prefill_tokens: Some(true),
        priority_jump: Some(3.0),
        expected_output_tokens: Some(100),
        queue_timeout: Some(Duration::from_millis(250)),
        overlap_score_credit_decay: Some(0.25),
        decode_active_request_weight: Some(0.75),
        cost_function: Some(CostFunction::PredictedTtft),
        ttft_miss_weight: Some(3.5),
        prehashed: Some(PrehashedPrompt {
            local_hashes: &local_hashes,
            num_tokens: 50,
        }),
    };
    let mut strs = crate::util::CStrs::new();
    let lowered = request.lower(&mut strs).unwrap();
    let default: sys::kvr_request_options = init();
    macro_rules! request_fields {
        ($v:expr) => {
            fields!(
                $v,
                kvr_request_options {
                    struct_size,
                    flags,
                    request_id,
                    lora_name,
                    cache_namespace,
                    mm_hashes,
                    mm_counts,
                    mm_num_blocks,
                    allowed_worker_ids,
                    num_allowed_worker_ids,
                    overlap_score_credit,
                    prefill_load_scale,
                    host_cache_hit_weight,
                    disk_cache_hit_weight,
                    temperature,
                    assume_kv_reuse,
                    track_prefill_tokens,
                    priority_jump,
                    expected_output_tokens,
                    reserved,
                    queue_timeout_ms,
                    overlap_score_credit_decay,
                    decode_active_request_weight,
                    cost_function,
                    reserved2,
                    ttft_miss_weight,
                    local_hashes,
                    num_local_hashes
                }
            )
        };
    }
    let left = left_at_default(
        &request_fields!(lowered),
        &request_fields!(default),
        &["struct_size", "reserved", "reserved2"],
    );
    assert!(left.is_empty(), "RequestOptions leaves {left:?}");
    let raw = &lowered;
    assert_eq!((raw.assume_kv_reuse, raw.track_prefill_tokens), (0, 1));
    assert_eq!((raw.queue_timeout_ms, raw.mm_num_blocks), (250, 2));
    assert_eq!(raw.decode_active_request_weight, 0.75);
    assert_eq!(
        (raw.cost_function, raw.ttft_miss_weight),
        (sys::KVR_COST_PREDICTED_TTFT as i32, 3.5)
    );
    // Each flag on its own bit (a non-empty allow-list needs none); the hashes as given (the
    // length in tokens is a call argument).
    assert_eq!(
        raw.flags,
        sys::KVR_REQUEST_ADMIT | sys::KVR_REQUEST_PREHASHED
    );
    assert_eq!(
        (raw.local_hashes, raw.num_local_hashes),
        (local_hashes.as_ptr(), 3)
    );
    assert_eq!(request.prompt(&[]).unwrap(), (std::ptr::null(), 50));
    let tokens = [1u32, 2];
    assert_eq!(
        request.prompt(&tokens).unwrap_err().code(),
        Code::InvalidArgument
    );
    assert_eq!(
        RequestOptions::default().prompt(&tokens).unwrap(),
        (tokens.as_ptr(), 2)
    );
    // A prepared request lowers the same options to the same struct, but for the id (set per
    // call) and the pointers, which point at its own copies of the same data.
    let prepared = PreparedRequest::new(&request).unwrap();
    let pointers = [
        "request_id",
        "lora_name",
        "cache_namespace",
        "mm_hashes",
        "mm_counts",
        "allowed_worker_ids",
        "local_hashes",
    ];
    let same = left_at_default(
        &request_fields!(*prepared.raw()),
        &request_fields!(lowered),
        &[],
    );
    let differ: Vec<&str> = request_fields!(*prepared.raw())
        .iter()
        .map(|(f, _)| *f)
        .filter(|f| !same.contains(f))
        .collect();
    assert_eq!(
        differ, pointers,
        "fields a prepared request lowers otherwise"
    );
    let p = prepared.raw();
    assert!(p.request_id.is_null());
    // SAFETY: NUL-terminated strings and arrays of the stated lengths, owned by `prepared`.
    unsafe {
        assert_eq!(std::ffi::CStr::from_ptr(p.lora_name).to_str(), Ok("lora"));
        assert_eq!(
            std::ffi::CStr::from_ptr(p.cache_namespace).to_str(),
            Ok("ns")
        );
        assert_eq!(std::slice::from_raw_parts(p.mm_hashes, 3), &mm_hashes);
        assert_eq!(std::slice::from_raw_parts(p.mm_counts, 2), &mm_counts);
        assert_eq!(std::slice::from_raw_parts(p.allowed_worker_ids, 2), &ids);
        assert_eq!(std::slice::from_raw_parts(p.local_hashes, 3), &local_hashes);
    }
    assert_ne!(p.local_hashes, local_hashes.as_ptr());
    assert_eq!(prepared.prompt(&[]).unwrap(), (std::ptr::null(), 50));
    let unset = PreparedRequest::new(&RequestOptions::default()).unwrap();
    assert_eq!(bytes_of(unset.raw()), bytes_of(&default));

    // An empty allow-list is a list (no worker allowed), per call and prepared alike; None
    // leaves the flag off (every worker).
    let empty = RequestOptions {
        allowed_worker_ids: Some(&[]),
        ..Default::default()
    };
    let lowered_empty = empty.lower(&mut strs).unwrap();
    let prepared_empty = PreparedRequest::new(&empty).unwrap();
    for raw in [
        &lowered_empty,
        prepared_empty.raw(),
        prepared_empty.clone().raw(),
    ] {
        assert_eq!(raw.flags, sys::KVR_REQUEST_ALLOW_LIST);
        assert_eq!(raw.num_allowed_worker_ids, 0);
    }
    assert!(format!("{prepared_empty:?}").contains("allowed_worker_ids: Some([])"));
    assert!(format!("{unset:?}").contains("allowed_worker_ids: None"));

    // Unset overrides keep the library's "the router's" markers (NaN, -1).
    let unset = RequestOptions::default().lower(&mut strs).unwrap();
    assert_eq!(bytes_of(&unset), bytes_of(&default));
    assert!(default.overlap_score_credit_decay.is_nan() && default.assume_kv_reuse == -1);
    assert!(default.ttft_miss_weight.is_nan() && default.cost_function == -1);
}

#[test]
fn queue_timeouts_round_up_to_whole_milliseconds_and_saturate_to_never() {
    let ms = |t: Duration| {
        RequestOptions {
            queue_timeout: Some(t),
            ..Default::default()
        }
        .lower(&mut crate::util::CStrs::new())
        .unwrap()
        .queue_timeout_ms
    };
    // 0 ms gives up at once: only a zero wait may become 0, never a short one.
    assert_eq!(ms(Duration::ZERO), 0);
    assert_eq!(ms(Duration::from_nanos(1)), 1);
    assert_eq!(ms(Duration::from_micros(500)), 1);
    assert_eq!(ms(Duration::from_millis(1)), 1);
    assert_eq!(ms(Duration::from_micros(1_001)), 2);
    assert_eq!(ms(Duration::from_millis(250)), 250);
    // The longest an int64_t of milliseconds holds, then "never" (-1) past it.
    let longest = Duration::from_millis(i64::MAX as u64);
    assert_eq!(ms(longest), i64::MAX);
    assert_eq!(ms(longest + Duration::from_nanos(1)), -1);
    assert_eq!(ms(Duration::MAX), -1);
    // Unset: the library's default, -1 (no timeout).
    let unset: sys::kvr_request_options = init();
    assert_eq!(unset.queue_timeout_ms, -1);
    // Prepared requests lower it the same way.
    let prepared = PreparedRequest::new(&RequestOptions {
        queue_timeout: Some(Duration::from_micros(500)),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(prepared.raw().queue_timeout_ms, 1);
}

#[test]
fn session_ttls_keep_sub_millisecond_and_huge_durations() {
    // Seconds as a double: nothing rounds to 0 and nothing overflows (the library saturates
    // a huge TTL at about 146 years).
    let ttl = |t: Duration| {
        RoutingHints {
            session_ttl: Some(t),
            ..Default::default()
        }
        .lower()
        .unwrap()
        .raw
        .session_ttl_seconds
    };
    assert_eq!(ttl(Duration::from_micros(500)), 0.0005);
    assert_eq!(ttl(Duration::from_nanos(1)), 1e-9);
    assert!(ttl(Duration::MAX).is_finite() && ttl(Duration::MAX) > 1e19);
}

#[test]
fn every_hint_and_pool_setting_reaches_the_c_struct() {
    let hints = RoutingHints {
        phase: Phase::Decode,
        worker_id: Some(1),
        prefill_worker_id: Some(2),
        decode_worker_id: Some(3),
        dp_rank: Some(4),
        prefill_dp_rank: Some(5),
        session_id: Some("s"),
        session_mode: SessionMode::Soft,
        session_ttl: Some(Duration::from_secs(9)),
    };
    let lowered = hints.lower().unwrap();
    let default: sys::kvr_routing_hints = init();
    macro_rules! hints_fields {
        ($v:expr) => {
            fields!(
                $v,
                kvr_routing_hints {
                    struct_size,
                    phase,
                    worker_id,
                    prefill_worker_id,
                    decode_worker_id,
                    dp_rank,
                    prefill_dp_rank,
                    session_id,
                    session_mode,
                    reserved,
                    session_ttl_seconds
                }
            )
        };
    }
    let left = left_at_default(
        &hints_fields!(lowered.raw),
        &hints_fields!(default),
        &["struct_size", "reserved"],
    );
    assert!(left.is_empty(), "RoutingHints leaves {left:?}");
    let unset = RoutingHints::default().lower().unwrap();
    assert_eq!(bytes_of(&unset.raw), bytes_of(&default));

    let disagg = DisaggOptions {
        policy: DisaggPolicy::IslOrLoad,
        enforce: true,
        max_local_prefill_tokens: 64,
        max_local_prefill_ratio: 0.5,
        prefill_busy_threshold: 2.0,
        decode_busy_threshold: Some(0.9),
    };
    let default: sys::kvr_disagg_options = init();
    macro_rules! disagg_fields {
        ($v:expr) => {
            fields!(
                $v,
                kvr_disagg_options {
                    struct_size,
                    policy,
                    enforce,
                    reserved,
                    max_local_prefill_tokens,
                    max_local_prefill_ratio,
                    prefill_busy_threshold,
                    decode_busy_threshold
                }
            )
        };
    }
    let left = left_at_default(
        &disagg_fields!(disagg.to_raw()),
        &disagg_fields!(default),
        &["struct_size", "reserved"],
    );
    assert!(left.is_empty(), "DisaggOptions leaves {left:?}");
    assert_eq!(
        bytes_of(&DisaggOptions::default().to_raw()),
        bytes_of(&default)
    );

    let ingest = IngestOptions {
        max_frame_bytes: 1 << 20,
        replay_timeout_ms: 10,
        replica_heartbeat_ms: 250,
        replica_timeout_ms: 2500,
    };
    let default: sys::kvr_ingest_options = init();
    macro_rules! ingest_fields {
        ($v:expr) => {
            fields!(
                $v,
                kvr_ingest_options {
                    struct_size,
                    max_frame_bytes,
                    replay_timeout_ms,
                    reserved,
                    replica_heartbeat_ms,
                    replica_timeout_ms
                }
            )
        };
    }
    let left = left_at_default(
        &ingest_fields!(ingest.to_raw()),
        &ingest_fields!(default),
        &["struct_size", "reserved"],
    );
    assert!(left.is_empty(), "IngestOptions leaves {left:?}");
    assert_eq!(
        bytes_of(&IngestOptions::default().to_raw()),
        bytes_of(&default)
    );
}

#[test]
fn every_event_field_reaches_the_c_struct() {
    let (blocks, local, tokens) = ([1u64, 2], [3u64, 4], [5u32; 8]);
    let (mm_hashes, mm_counts) = ([6u64], [1usize, 0]);
    let stored = StoredEvent {
        worker_id: 1,
        dp_rank: 2,
        event_id: 3,
        tier: Tier::Disk,
        parent_hash: Some(4),
        eagle: true,
        block_hashes: &blocks,
        local_hashes: Some(&local),
        token_ids: &tokens,
        lora_name: Some("lora"),
        cache_namespace: Some("ns"),
        multimodal: Some(Multimodal {
            hashes: &mm_hashes,
            counts: &mm_counts,
        }),
        // The library would refuse a window beside tokens; lowering passes both on.
        sliding_window: Some(SlidingWindow {
            group: 5,
            window_tokens: 32,
        }),
    };
    let lowered = stored.lower().unwrap();
    let default: sys::kvr_stored_event = init();
    macro_rules! stored_fields {
        ($v:expr) => {
            fields!(
                $v,
                kvr_stored_event {
                    struct_size,
                    dp_rank,
                    worker_id,
                    event_id,
                    tier,
                    flags,
                    parent_hash,
                    block_hashes,
                    num_blocks,
                    local_hashes,
                    token_ids,
                    num_tokens,
                    lora_name,
                    cache_namespace,
                    mm_hashes,
                    mm_counts,
                    sliding_group,
                    sliding_window_tokens,
                    reserved1
                }
            )
        };
    }
    let left = left_at_default(
        &stored_fields!(lowered.raw),
        &stored_fields!(default),
        &["struct_size", "reserved1"],
    );
    assert!(left.is_empty(), "StoredEvent leaves {left:?}");
    assert_eq!(
        lowered.raw.flags,
        sys::KVR_STORED_HAS_PARENT | sys::KVR_STORED_EAGLE
    );

    let removed = RemovedEvent {
        worker_id: 1,
        dp_rank: 2,
        event_id: 3,
        tier: Tier::External,
        block_hashes: &blocks,
        sliding_group: Some(6),
    };
    let default: sys::kvr_removed_event = init();
    macro_rules! removed_fields {
        ($v:expr) => {
            fields!(
                $v,
                kvr_removed_event {
                    struct_size,
                    dp_rank,
                    worker_id,
                    event_id,
                    tier,
                    reserved,
                    block_hashes,
                    num_blocks,
                    sliding_group,
                    flags,
                    reserved1
                }
            )
        };
    }
    let left = left_at_default(
        &removed_fields!(removed.lower()),
        &removed_fields!(default),
        &["struct_size", "reserved", "reserved1"],
    );
    assert!(left.is_empty(), "RemovedEvent leaves {left:?}");
    assert_eq!(removed.lower().flags, sys::KVR_REMOVED_SLIDING);
}

#[test]
fn sliding_window_fields_only_with_a_window() {
    // Without a window (or a sliding group), the events lower as before: the fields at zero.
    let stored = StoredEvent {
        block_hashes: &[1],
        ..Default::default()
    };
    let raw = stored.lower().unwrap().raw;
    assert_eq!((raw.sliding_group, raw.sliding_window_tokens), (0, 0));
    let raw = RemovedEvent::default().lower();
    assert_eq!((raw.sliding_group, raw.flags), (0, 0));
    // Group 0 is a group: the flag says so.
    let raw = RemovedEvent {
        sliding_group: Some(0),
        ..Default::default()
    }
    .lower();
    assert_eq!(
        (raw.sliding_group, raw.flags),
        (0, sys::KVR_REMOVED_SLIDING)
    );
    // A window of 0 tokens would be a full-attention store in C: refused here.
    let zero = StoredEvent {
        block_hashes: &[1],
        sliding_window: Some(SlidingWindow {
            group: 1,
            window_tokens: 0,
        }),
        ..Default::default()
    };
    assert_eq!(zero.lower().err().unwrap().code(), Code::InvalidArgument);
}

#[test]
fn every_jetstream_setting_reaches_the_c_struct() {
    let source = JetStreamSource {
        url: "nats://127.0.0.1:1",
        stream: "KV",
        subject: "kv.>",
        durable: Some("gw-1"),
        start_sequence: 7,
        resume: true,
        create_stream: true,
        max_age_seconds: 90.0,
        max_bytes: 1 << 20,
    };
    let lowered = source.lower().unwrap();
    let default: sys::kvr_jetstream_source = init();
    macro_rules! jetstream_fields {
        ($v:expr) => {
            fields!(
                $v,
                kvr_jetstream_source {
                    struct_size,
                    flags,
                    url,
                    stream,
                    subject,
                    durable,
                    start_sequence,
                    max_age_seconds,
                    max_bytes
                }
            )
        };
    }
    let left = left_at_default(
        &jetstream_fields!(lowered.raw),
        &jetstream_fields!(default),
        &["struct_size"],
    );
    assert!(left.is_empty(), "JetStreamSource leaves {left:?}");
    assert_eq!(
        lowered.raw.flags,
        sys::KVR_JETSTREAM_RESUME | sys::KVR_JETSTREAM_CREATE_STREAM
    );
    // SAFETY: the lowered strings live as long as `lowered`.
    let text =
        |p: *const std::ffi::c_char| unsafe { std::ffi::CStr::from_ptr(p) }.to_str().unwrap();
    assert_eq!(
        (text(lowered.raw.url), text(lowered.raw.stream)),
        ("nats://127.0.0.1:1", "KV")
    );
    assert_eq!(
        (text(lowered.raw.subject), text(lowered.raw.durable)),
        ("kv.>", "gw-1")
    );
    // Each flag alone, from its own field.
    let only_create = JetStreamSource {
        create_stream: true,
        ..Default::default()
    };
    assert_eq!(
        only_create.lower().unwrap().raw.flags,
        sys::KVR_JETSTREAM_CREATE_STREAM
    );
    let only_resume = JetStreamSource {
        resume: true,
        ..Default::default()
    };
    assert_eq!(
        only_resume.lower().unwrap().raw.flags,
        sys::KVR_JETSTREAM_RESUME
    );

    // Default is the library's (the header's 1 h and 1 GiB), and lowers to its bytes but for
    // the strings (empty ones, set, and no durable).
    let d = JetStreamSource::default();
    assert_eq!((d.max_age_seconds, d.max_bytes), (3600.0, 1 << 30));
    assert_eq!(
        (d.start_sequence, d.resume, d.create_stream),
        (0, false, false)
    );
    let unset = d.lower().unwrap();
    let left = left_at_default(
        &jetstream_fields!(unset.raw),
        &jetstream_fields!(default),
        &["url", "stream", "subject"],
    );
    assert_eq!(left.len(), 6, "{left:?}");
    assert!(unset.raw.durable.is_null());
}

#[test]
fn every_ingest_stats_field_reaches_the_safe_struct() {
    // SAFETY: all-zero bytes are a valid kvr_ingest_stats.
    let mut raw: sys::kvr_ingest_stats = unsafe { std::mem::zeroed() };
    // Listed to fail here when the header gains a field (the struct literal below must then
    // set it too).
    let _ = fields!(
        raw,
        kvr_ingest_stats {
            struct_size,
            state_unknown,
            messages,
            events_applied,
            rejected,
            gaps,
            missed_messages,
            restarts,
            recoveries,
            connections,
            lag_samples,
            lag_total_us,
            lag_max_us,
            lag_last_us,
            published,
            publish_failures,
            last_reject,
            stream_sequence,
            consumer_remakes,
            consumer_remake_failures,
            events_ignored,
            bookings_trimmed
        }
    );
    raw.state_unknown = 1;
    raw.messages = 2;
    raw.events_applied = 3;
    for (i, r) in raw.rejected.iter_mut().enumerate() {
        *r = 100 + i as u64;
    }
    raw.gaps = 4;
    raw.missed_messages = 5;
    raw.restarts = 6;
    raw.recoveries = 7;
    raw.connections = 8;
    raw.lag_samples = 9;
    raw.lag_total_us = 10;
    raw.lag_max_us = 11;
    raw.lag_last_us = 12;
    raw.published = 13;
    raw.publish_failures = 14;
    raw.last_reject[0] = b'x' as std::ffi::c_char;
    raw.stream_sequence = 15;
    raw.consumer_remakes = 16;
    raw.consumer_remake_failures = 17;
    raw.events_ignored = 18;
    raw.bookings_trimmed = 19;
    let s = IngestStats::from(raw);
    assert_eq!(
        (
            s.state_unknown,
            s.messages,
            s.events_applied,
            s.gaps,
            s.missed_messages
        ),
        (1, 2, 3, 4, 5)
    );
    assert_eq!(
        (
            s.restarts,
            s.recoveries,
            s.connections,
            s.lag_samples,
            s.lag_total_us
        ),
        (6, 7, 8, 9, 10)
    );
    assert_eq!(
        (s.lag_max_us, s.lag_last_us, s.published, s.publish_failures),
        (11, 12, 13, 14)
    );
    assert_eq!((s.last_reject.as_str(), s.stream_sequence), ("x", 15));
    assert_eq!((s.consumer_remakes, s.consumer_remake_failures), (16, 17));
    assert_eq!((s.events_ignored, s.bookings_trimmed), (18, 19));
    assert_eq!(s.rejected, raw.rejected);
}
