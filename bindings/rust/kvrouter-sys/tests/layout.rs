//! The declarations against the real header, in the spirit of git2-rs' `systest`, without
//! crates. `src/lib.rs` is generated (tools/ffigen) and asserts at compile time the struct
//! layouts clang computed *when it was generated*; these tests check the generated file again,
//! independently of the generator, against the header installed *now* (pkg-config's, which may
//! not be the one it was generated from), and check what those asserts cannot see:
//!
//! * a C program compiled with the system's `cc` prints every struct's size, alignment and field
//!   offsets and sizes, each typed enumeration's width and signedness (`kvr_tier`, ...), every
//!   constant's value and the members of every X-macro list (`KVR_TIER_MAP`, ...); the Rust side
//!   computes the same with `size_of` / `offset_of!`, and each constant of an enumeration must
//!   have the enumeration's type;
//! * the header's struct definitions are parsed, and the field lists checked here must be
//!   exactly the header's, in order; the preprocessor lists every macro and enumerator of the
//!   headers, and each must be checked here; so nothing the header gains goes unchecked;
//! * the header's function declarations and the extern block of `src/lib.rs` are parsed and
//!   every function's name, parameter types and return type compared (the sized `_init`s
//!   included: one per struct beginning with `struct_size`);
//! * the crate's version and build.rs's pkg-config probe name the generated header version.
//!
//! The header is the one `build.rs` found (pkg-config's includedir, or `KVROUTER_INCLUDE_DIR`);
//! `KVROUTER_LAYOUT_INCLUDE_DIR` overrides it for this test only.

use std::collections::BTreeMap;
use std::mem::{align_of, offset_of, size_of, size_of_val, zeroed};
use std::path::PathBuf;
use std::process::Command;

use kvrouter_sys::*;

struct Layout {
    name: &'static str,
    size: usize,
    align: usize,
    /// (field, offset, size)
    fields: Vec<(&'static str, usize, usize)>,
}

macro_rules! layouts {
    ($($s:ident { $($f:ident),* $(,)? })*) => {
        vec![$({
            // SAFETY: every struct here is plain data (integers, floats, raw pointers), for which
            // all-zero bytes are a valid value.
            let value: $s = unsafe { zeroed() };
            let _ = &value;
            Layout {
                name: stringify!($s),
                size: size_of::<$s>(),
                align: align_of::<$s>(),
                fields: vec![$((stringify!($f), offset_of!($s, $f), size_of_val(&value.$f))),*],
            }
        }),*]
    };
}

fn rust_layouts() -> Vec<Layout> {
    layouts! {
        kvr_hash_options { struct_size, flags, lora_name, cache_namespace, mm_hashes, mm_counts,
            mm_num_blocks }
        kvr_router_options { struct_size, block_size, flags, queue_policy, overlap_score_credit,
            prefill_load_scale, host_cache_hit_weight, disk_cache_hit_weight, temperature,
            queue_threshold, approx_ttl_seconds, approx_max_blocks, approx_prune_target_ratio,
            request_expiry_seconds, random_seed, overlap_score_credit_decay,
            decode_active_request_weight, index_shards, reserved, cost_function, reserved2,
            prefill_tokens_per_second, ttft_miss_weight }
        kvr_worker_config { struct_size, block_size, worker_id, dp_start, dp_size,
            total_kv_blocks, max_num_batched_tokens }
        kvr_stored_event { struct_size, dp_rank, worker_id, event_id, tier, flags, parent_hash,
            block_hashes, num_blocks, local_hashes, token_ids, num_tokens, lora_name,
            cache_namespace, mm_hashes, mm_counts, sliding_group, sliding_window_tokens,
            reserved1 }
        kvr_removed_event { struct_size, dp_rank, worker_id, event_id, tier, reserved,
            block_hashes, num_blocks, sliding_group, flags, reserved1 }
        kvr_request_options { struct_size, flags, request_id, lora_name, cache_namespace,
            mm_hashes, mm_counts, mm_num_blocks, allowed_worker_ids, num_allowed_worker_ids,
            overlap_score_credit, prefill_load_scale, host_cache_hit_weight,
            disk_cache_hit_weight, temperature, assume_kv_reuse, track_prefill_tokens,
            priority_jump, expected_output_tokens, reserved, queue_timeout_ms,
            overlap_score_credit_decay, decode_active_request_weight, cost_function, reserved2,
            ttft_miss_weight, local_hashes, num_local_hashes }
        kvr_route_result { struct_size, dp_rank, worker_id, prompt_blocks, device_overlap_blocks,
            effective_overlap_blocks, cached_tokens, prompt_tokens, cost, booked, queued }
        kvr_candidate { worker_id, dp_rank, device_blocks, host_blocks, disk_blocks,
            external_blocks, chosen, effective_overlap_blocks, cached_tokens,
            active_prefill_tokens, active_blocks, new_blocks, raw_prefill_blocks, credit,
            prefill_cost, decode_blocks, cost, probability, credit_decay, active_requests,
            request_cost, reserved }
        kvr_overlap { worker_id, dp_rank, device_blocks, host_blocks, disk_blocks,
            external_blocks, reserved0, effective_overlap_blocks, cached_tokens, tree_size,
            reserved }
        kvr_match { worker_id, dp_rank, device_blocks, host_blocks, disk_blocks,
            external_blocks, reserved0, tree_size }
        kvr_potential_load { worker_id, dp_rank, reserved0, potential_prefill_tokens,
            potential_decode_blocks, active_prefill_tokens, active_blocks, active_requests,
            reserved }
        kvr_metrics { struct_size, reserved0, events, event_batches_rejected, decisions,
            requests_active, queue_pending, queue_pending_tokens, workers, index_nodes,
            index_blocks, index_bytes, replica_changes_applied, replica_changes_rejected,
            replica_requests_active, decision_latency_bounds_ns, decision_latency_le,
            decision_latency_count, decision_latency_sum_ns, replicas_live, replicas_expired,
            events_refused_for_memory, replica_changes_unpublished, decisions_priced_again,
            sliding_events_applied, sliding_events_rejected, index_sliding_blocks }
        kvr_routing_hints { struct_size, phase, worker_id, prefill_worker_id, decode_worker_id,
            dp_rank, prefill_dp_rank, session_id, session_mode, reserved, session_ttl_seconds }
        kvr_route_signals { struct_size, dp_rank, worker_id, overlap_blocks, prompt_blocks,
            cached_tokens, potential_decode_blocks, total_kv_blocks, cost, prompt_tokens, booked,
            moved, queued, reserved }
        kvr_disagg_options { struct_size, policy, enforce, reserved, max_local_prefill_tokens,
            max_local_prefill_ratio, prefill_busy_threshold, decode_busy_threshold }
        kvr_prefill_result { struct_size, remote, reason, dp_rank, worker_id, bootstrap_room,
            cached_tokens }
        kvr_ingest_options { struct_size, max_frame_bytes, replay_timeout_ms, reserved,
            replica_heartbeat_ms, replica_timeout_ms }
        kvr_engine_worker { struct_size, engine, endpoint, worker_id, dp_start, dp_size,
            block_size, flags, topic, replay_endpoint }
        kvr_jetstream_source { struct_size, flags, url, stream, subject, durable, start_sequence,
            max_age_seconds, max_bytes }
        kvr_ingest_stats { struct_size, state_unknown, messages, events_applied, rejected, gaps,
            missed_messages, restarts, recoveries, connections, lag_samples, lag_total_us,
            lag_max_us, lag_last_us, published, publish_failures, last_reject, stream_sequence,
            consumer_remakes, consumer_remake_failures, events_ignored, bookings_trimmed }
    }
}

/// One typed enumeration of the header (`typedef uint32_t kvr_tier;` and its X-macro list
/// `KVR_TIER_MAP`): the Rust alias's width and signedness, and its constants, each of which must
/// have the alias as its type (a `let` of that type below, or the test does not compile).
struct Enumeration {
    name: &'static str,
    size: usize,
    signed: bool,
    values: Vec<(&'static str, i64)>,
}

impl Enumeration {
    /// The X-macro list the header defines the constants with: `kvr_queue_policy` →
    /// `KVR_QUEUE_POLICY_MAP`.
    fn list(&self) -> String {
        format!("{}_MAP", self.name.to_uppercase())
    }
}

macro_rules! enumerations {
    ($($t:ident { $($c:ident),* $(,)? })*) => {
        vec![$(Enumeration {
            name: stringify!($t),
            size: size_of::<$t>(),
            signed: <$t>::MIN != 0,
            values: vec![$({
                let value: $t = $c;
                (stringify!($c), i64::from(value))
            }),*],
        }),*]
    };
}

fn rust_enumerations() -> Vec<Enumeration> {
    enumerations! {
        kvr_status { KVR_OK, KVR_CANCELLED, KVR_INVALID_ARGUMENT, KVR_DEADLINE_EXCEEDED,
            KVR_NOT_FOUND, KVR_ALREADY_EXISTS, KVR_RESOURCE_EXHAUSTED, KVR_FAILED_PRECONDITION,
            KVR_UNIMPLEMENTED, KVR_INTERNAL, KVR_UNAVAILABLE, KVR_BUFFER_TOO_SMALL }
        kvr_tier { KVR_TIER_DEVICE, KVR_TIER_HOST_PINNED, KVR_TIER_DISK, KVR_TIER_EXTERNAL }
        kvr_queue_policy { KVR_QUEUE_FCFS, KVR_QUEUE_LCFS, KVR_QUEUE_WSPT }
        kvr_cost_function { KVR_COST_CREDIT, KVR_COST_PREDICTED_TTFT }
        kvr_event_kind { KVR_EVENT_STORED, KVR_EVENT_REMOVED, KVR_EVENT_CLEARED }
        kvr_event_outcome { KVR_EVENT_OK, KVR_EVENT_PARENT_BLOCK_NOT_FOUND,
            KVR_EVENT_BLOCK_NOT_FOUND, KVR_EVENT_INVALID_BLOCK_SEQUENCE, KVR_EVENT_INVALID_BLOCK }
        kvr_phase { KVR_PHASE_AGGREGATED, KVR_PHASE_PREFILL, KVR_PHASE_DECODE }
        kvr_session_mode { KVR_SESSION_HARD, KVR_SESSION_SOFT }
        kvr_disagg_policy { KVR_DISAGG_ALWAYS, KVR_DISAGG_ISL_BOUNDING, KVR_DISAGG_PREFILL_LOAD,
            KVR_DISAGG_ISL_OR_LOAD }
        kvr_prefill_reason { KVR_PREFILL_REMOTE, KVR_PREFILL_NO_PREFILL_WORKERS,
            KVR_PREFILL_SHORT_ISL, KVR_PREFILL_WORKER_BUSY }
        kvr_engine { KVR_ENGINE_VLLM, KVR_ENGINE_SGLANG }
        kvr_ingest_reject { KVR_INGEST_REJECT_FRAME_TOO_LARGE, KVR_INGEST_REJECT_BAD_FLATBUFFERS,
            KVR_INGEST_REJECT_BAD_MSGPACK, KVR_INGEST_REJECT_BAD_MESSAGE,
            KVR_INGEST_REJECT_BLOCK_SIZE, KVR_INGEST_REJECT_INDEX,
            KVR_INGEST_REJECT_STALE_SEQUENCE }
    }
}

/// The other constants, each with the Rust type it must have: flags (enum constants of C,
/// `u32` here, as the `uint32_t flags` fields they go into), array dimensions and macros.
macro_rules! constants {
    ($($t:ty { $($c:ident),* $(,)? })*) => {
        vec![$($({
            let value: $t = $c;
            (stringify!($c), value as u64)
        }),*),*]
    };
}

fn rust_constants() -> Vec<(&'static str, u64)> {
    constants! {
        u32 { KVR_VERSION_MAJOR, KVR_VERSION_MINOR }
        u32 { KVR_HASH_EAGLE }
        u32 { KVR_ROUTER_APPROXIMATE, KVR_ROUTER_NO_KV_REUSE, KVR_ROUTER_NO_PREFILL_TRACKING,
            KVR_ROUTER_EAGLE, KVR_ROUTER_ENTROPY_SEED, KVR_ROUTER_TRACK_OUTPUT_BLOCKS }
        u32 { KVR_STORED_HAS_PARENT, KVR_STORED_EAGLE }
        u32 { KVR_REMOVED_SLIDING }
        u32 { KVR_REQUEST_ADMIT, KVR_REQUEST_PREHASHED, KVR_REQUEST_ALLOW_LIST }
        u32 { KVR_JETSTREAM_RESUME, KVR_JETSTREAM_CREATE_STREAM }
        usize { KVR_EVENT_KINDS, KVR_EVENT_OUTCOMES, KVR_INGEST_REJECT_REASONS,
            KVR_DECISION_LATENCY_BUCKETS }
        u64 { KVR_WORKER_NONE }
    }
}

/// Macros of the headers that are no values to compare: the export attribute, the include
/// guard, the X-macro lists (compared through their enumerations), and the version macros a
/// library of another 0.2 patch release has other values of (the major.minor is compared;
/// `the_crates_name_the_generated_version` checks the generated ones).
fn not_compared(name: &str) -> bool {
    [
        "KVR_API",
        "KVROUTER_H",
        "KVR_VERSION_PATCH",
        "KVR_VERSION_NUMBER",
        "KVR_VERSION_STRING",
    ]
    .contains(&name)
        || name.ends_with("_MAP")
}

fn include_dir() -> PathBuf {
    let dir = std::env::var("KVROUTER_LAYOUT_INCLUDE_DIR")
        .ok()
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| env!("KVROUTER_SYS_INCLUDE_DIR").to_string());
    assert!(
        !dir.is_empty(),
        "no kvrouter.h was found at build time; set KVROUTER_INCLUDE_DIR (or \
         KVROUTER_LAYOUT_INCLUDE_DIR) to the directory holding kvrouter.h"
    );
    PathBuf::from(dir)
}

fn header_text() -> String {
    let path = include_dir().join("kvrouter.h");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".into())
}

/// `cc ARGS -I<include dir> kvrouter.h`'s output: the header as the C preprocessor sees it.
fn preprocess(args: &[&str]) -> String {
    let out = Command::new(cc())
        .args(args)
        .arg("-I")
        .arg(include_dir())
        .arg(include_dir().join("kvrouter.h"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", cc()));
    assert!(
        out.status.success(),
        "preprocessing kvrouter.h failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Every named value the headers define: object-like `KVR_*` macros (both headers' `#define`s)
/// and every enumerator of a `kvr_*` enum, the X-macro lists expanded (as the preprocessor
/// expands them, not as a reading of the text would).
fn header_values() -> Vec<String> {
    let mut names: Vec<String> = preprocess(&["-dM", "-E"])
        .lines()
        .filter_map(|line| line.strip_prefix("#define "))
        .map(|rest| rest.split([' ', '(']).next().unwrap().to_string())
        .filter(|name| name.starts_with("KVR_"))
        .collect();
    let expanded = preprocess(&["-E", "-P"]);
    let mut rest = expanded.as_str();
    while let Some(start) = rest.find("enum kvr_") {
        rest = &rest[start..];
        let open = rest.find('{').unwrap();
        let close = rest.find('}').unwrap();
        names.extend(
            rest[open + 1..close]
                .split(',')
                .map(|e| e.split('=').next().unwrap().trim().to_string())
                .filter(|e| !e.is_empty()),
        );
        rest = &rest[close..];
    }
    names
}

/// Compiles and runs the probe program; returns its `key value...` lines (values as i128, so
/// that signed and unsigned ones both fit).
fn c_facts(
    layouts: &[Layout],
    enumerations: &[Enumeration],
    constants: &[(&str, u64)],
) -> BTreeMap<String, Vec<i128>> {
    let mut src = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include \"kvrouter.h\"\n\
         #define PROBE_LIST(name, value, description) \
         printf(\"member %s %lld\\n\", #name, (long long)(value));\n\
         int main(void) {\n",
    );
    for l in layouts {
        src += &format!(
            "  printf(\"{0} %zu %zu\\n\", sizeof({0}), _Alignof({0}));\n",
            l.name
        );
        for (f, _, _) in &l.fields {
            src += &format!(
                "  printf(\"{0}.{1} %zu %zu\\n\", offsetof({0}, {1}), sizeof((({0} *)0)->{1}));\n",
                l.name, f
            );
        }
    }
    // The callback typedef (which layouts cannot see): the Rust declaration's C twin must be
    // assignment-compatible with it, or -Werror stops the compilation.
    src += "  { void (*publish)(void *, const void *, size_t) = (kvr_replica_publish_fn)0;\n";
    src += "    kvr_replica_publish_fn back = publish; (void)back; }\n";
    src += "  printf(\"kvr_replica_publish_fn %zu %zu\\n\", sizeof(kvr_replica_publish_fn), \
            _Alignof(kvr_replica_publish_fn));\n";
    // Each typed enumeration: the typedef's width and signedness, each constant's value, and
    // its X-macro list's members.
    for e in enumerations {
        src += &format!(
            "  printf(\"{0} %zu %d\\n\", sizeof({0}), ({0})-1 < 0);\n",
            e.name
        );
        for (c, _) in &e.values {
            src += &format!("  printf(\"{c} %lld\\n\", (long long)({c}));\n");
        }
        src += &format!("  printf(\"list {0}\\n\"); {0}(PROBE_LIST)\n", e.list());
    }
    for (c, _) in constants {
        src += &format!("  printf(\"{c} %llu\\n\", (unsigned long long)({c}));\n");
    }
    src += "  return 0;\n}\n";

    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kvrouter-sys-layout");
    std::fs::create_dir_all(&dir).unwrap();
    let c_file = dir.join("layout.c");
    let exe = dir.join("layout");
    std::fs::write(&c_file, src).unwrap();
    let out = Command::new(cc())
        .args(["-std=c11", "-Wall", "-Werror", "-I"])
        .arg(include_dir())
        .arg(&c_file)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", cc()));
    assert!(
        out.status.success(),
        "compiling the layout probe failed (a field, constant or list the Rust side names that \
         C does not have?):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    assert!(run.status.success());
    let stdout = String::from_utf8(run.stdout).unwrap();
    // "list NAME" starts a list, whose "member MEMBER VALUE" lines are filed as "NAME.MEMBER".
    let mut facts = BTreeMap::new();
    let mut list = "";
    for line in stdout.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let (key, values) = match words[0] {
            "list" => {
                list = words[1];
                continue;
            }
            "member" => (format!("{list}.{}", words[1]), &words[2..]),
            key => (key.to_string(), &words[1..]),
        };
        facts.insert(key, values.iter().map(|w| w.parse().unwrap()).collect());
    }
    facts
}

#[test]
fn structs_and_constants_match_the_header() {
    // What the generated file's compile-time asserts cannot see: the installed header (which
    // may not be the one the file was generated from), field sizes, the typedefs' widths and
    // signedness, and every constant's value.
    let layouts = rust_layouts();
    let enumerations = rust_enumerations();
    let constants = rust_constants();
    let c = c_facts(&layouts, &enumerations, &constants);
    let mut mismatches = Vec::new();
    for l in &layouts {
        let want = &c[l.name];
        if want[..] != [l.size as i128, l.align as i128] {
            mismatches.push(format!(
                "{}: C size {} align {}, Rust size {} align {}",
                l.name, want[0], want[1], l.size, l.align
            ));
        }
        let mut covered = 0;
        for (f, offset, size) in &l.fields {
            let want = &c[&format!("{}.{f}", l.name)];
            covered += size;
            if want[..] != [*offset as i128, *size as i128] {
                mismatches.push(format!(
                    "{}.{f}: C offset {} size {}, Rust offset {offset} size {size}",
                    l.name, want[0], want[1]
                ));
            }
        }
        // Every byte is a listed field (the header's structs have no padding, which is what
        // lets each struct_size name one layout): a C field missing from the list shows here.
        if covered != l.size {
            mismatches.push(format!(
                "{}: the listed fields cover {covered} of {} bytes",
                l.name, l.size
            ));
        }
    }
    let callback = &c["kvr_replica_publish_fn"];
    assert_eq!(callback[0] as usize, size_of::<kvr_replica_publish_fn>());
    assert_eq!(callback[1] as usize, align_of::<kvr_replica_publish_fn>());
    for e in &enumerations {
        let want = &c[e.name];
        if want[..] != [e.size as i128, i128::from(e.signed)] {
            mismatches.push(format!(
                "{}: C {} bytes signed {}, Rust {} bytes signed {}",
                e.name,
                want[0],
                want[1] != 0,
                e.size,
                e.signed
            ));
        }
        for (name, value) in &e.values {
            if c[*name][0] != i128::from(*value) {
                mismatches.push(format!("{name}: C {}, Rust {value}", c[*name][0]));
            }
        }
        // The X-macro list, member by member: each is one of the Rust constants of this type
        // (named PREFIX_MEMBER, with its value), and there is no other.
        let prefix = format!("{}.", e.list());
        let members: Vec<(&str, i128)> = c
            .iter()
            .filter_map(|(k, v)| k.strip_prefix(&prefix).map(|m| (m, v[0])))
            .collect();
        for (member, value) in &members {
            let found = e
                .values
                .iter()
                .any(|(n, v)| n.ends_with(&format!("_{member}")) && i128::from(*v) == *value);
            if !found {
                mismatches.push(format!(
                    "{}: {member} = {value} has no constant of type {} in Rust",
                    e.list(),
                    e.name
                ));
            }
        }
        if members.len() != e.values.len() {
            mismatches.push(format!(
                "{}: {} members in C, {} constants of type {} in Rust",
                e.list(),
                members.len(),
                e.values.len(),
                e.name
            ));
        }
    }
    for (name, value) in &constants {
        if c[*name][0] as u64 != *value {
            mismatches.push(format!("{name}: C {}, Rust {value}", c[*name][0] as u64));
        }
    }
    assert!(
        mismatches.is_empty(),
        "layout mismatches:\n{}",
        mismatches.join("\n")
    );
}

#[test]
fn every_header_struct_field_is_checked() {
    // The layout comparison sees only the fields listed in rust_layouts(): a field the header
    // gains (or renames) must be listed there too, in the header's order.
    let header = header_struct_fields(&header_text());
    assert!(
        header.len() >= 18,
        "parsed only {} header structs",
        header.len()
    );
    let layouts = rust_layouts();
    let mut mismatches = Vec::new();
    for (name, fields) in &header {
        match layouts.iter().find(|l| l.name == name) {
            None => mismatches.push(format!("{name}: not in rust_layouts()")),
            Some(l) => {
                let listed: Vec<&str> = l.fields.iter().map(|(f, _, _)| *f).collect();
                if listed != *fields {
                    mismatches.push(format!("{name}: header {fields:?}, checked {listed:?}"));
                }
            }
        }
    }
    for l in &layouts {
        if !header.contains_key(l.name) {
            mismatches.push(format!("{}: not a struct of the header", l.name));
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
}

#[test]
fn every_header_value_is_checked() {
    // Every macro and enumerator the preprocessor finds in the headers is compared above (or
    // deliberately not: not_compared), and every X-macro list belongs to a checked enumeration.
    let enumerations = rust_enumerations();
    let mut checked: Vec<&str> = rust_constants().iter().map(|(n, _)| *n).collect();
    for e in &enumerations {
        checked.extend(e.values.iter().map(|(n, _)| *n));
    }
    let header = header_values();
    assert!(
        header.len() >= 70,
        "found only {} header values",
        header.len()
    );
    let missing: Vec<&String> = header
        .iter()
        .filter(|n| !not_compared(n) && !checked.contains(&n.as_str()))
        .collect();
    assert!(missing.is_empty(), "header values not checked: {missing:?}");
    let lists: Vec<String> = enumerations.iter().map(Enumeration::list).collect();
    let unchecked: Vec<&String> = header
        .iter()
        .filter(|n| n.ends_with("_MAP") && !lists.contains(n))
        .collect();
    assert!(
        unchecked.is_empty(),
        "X-macro lists without an enumeration in rust_enumerations(): {unchecked:?}"
    );
    // And every integer typedef of the header is one of them (kvr_status, kvr_tier, ...).
    let typedefs: Vec<String> = preprocess(&["-E", "-P"])
        .lines()
        .filter_map(|l| l.trim().strip_prefix("typedef "))
        .filter(|l| l.starts_with("int") || l.starts_with("uint"))
        .filter_map(|l| l.trim_end_matches(';').split_whitespace().nth(1))
        .filter(|n| n.starts_with("kvr_"))
        .map(str::to_string)
        .collect();
    let names: Vec<&str> = enumerations.iter().map(|e| e.name).collect();
    assert_eq!(typedefs, names, "the header's integer typedefs, in order");
}

/// One function: name → (parameter types, return type), both as Rust type strings.
type Signatures = BTreeMap<String, (Vec<String>, String)>;

/// A C type (`const uint32_t *`, `kvr_error **`, `double`) as the Rust type the binding uses.
fn c_type_to_rust(c: &str) -> String {
    let stars = c.matches('*').count();
    let base_words: Vec<&str> = c
        .split(|ch: char| ch.is_whitespace() || ch == '*')
        .filter(|w| !w.is_empty())
        .collect();
    let is_const = base_words.first() == Some(&"const");
    let base = *base_words.last().unwrap();
    let base = match base {
        "uint8_t" => "u8",
        "int32_t" => "i32",
        "uint32_t" => "u32",
        "int64_t" => "i64",
        "uint64_t" => "u64",
        "size_t" => "usize",
        "double" => "f64",
        "int" => "c_int",
        "char" => "c_char",
        "void" if stars == 0 => return String::new(),
        "void" => "c_void",
        other => other,
    };
    let mut rust = base.to_string();
    for level in 0..stars {
        let qualifier = if level == 0 && is_const {
            "*const "
        } else {
            "*mut "
        };
        rust = format!("{qualifier}{rust}");
    }
    rust
}

/// The header without its comments.
fn strip_comments(header: &str) -> String {
    let mut text = String::new();
    let mut rest = header;
    while let Some(start) = rest.find("/*") {
        text += &rest[..start];
        rest = &rest[start + rest[start..].find("*/").unwrap() + 2..];
    }
    text + rest
}

/// Every `typedef struct NAME { ... } NAME;` of the header: its field names, in order.
fn header_struct_fields(header: &str) -> BTreeMap<String, Vec<String>> {
    let text = strip_comments(header);
    let mut out = BTreeMap::new();
    let mut rest = text.as_str();
    while let Some(start) = rest.find("typedef struct ") {
        rest = &rest[start + "typedef struct ".len()..];
        let head_end = rest.find(['{', ';']).unwrap();
        if !rest[head_end..].starts_with('{') {
            continue; // an opaque handle
        }
        let name = rest[..head_end].trim().to_string();
        let body_end = rest.find('}').unwrap();
        let fields = rest[head_end + 1..body_end]
            .split(';')
            .map(|decl| decl.split('[').next().unwrap().trim())
            .filter(|decl| !decl.is_empty())
            .map(|decl| {
                let start = decl
                    .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .map_or(0, |i| i + 1);
                decl[start..].to_string()
            })
            .collect();
        out.insert(name, fields);
        rest = &rest[body_end..];
    }
    out
}

fn header_signatures(header: &str) -> Signatures {
    // Drop comments and preprocessor directives (with their continuation lines: the X-macro
    // lists' descriptions hold semicolons), then take every `KVR_API ...;` declaration.
    let mut in_directive = false;
    let text: String = strip_comments(header)
        .lines()
        .filter(|l| {
            let directive = in_directive || l.trim_start().starts_with('#');
            in_directive = directive && l.trim_end().ends_with('\\');
            !directive
        })
        .collect::<Vec<_>>()
        .join(" ");
    let mut out = Signatures::new();
    for decl in text.split("KVR_API").skip(1) {
        let decl = &decl[..decl.find(';').unwrap()];
        let open = decl.find('(').unwrap();
        let head = decl[..open].trim();
        let name_start = head
            .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
            .map_or(0, |i| i + 1);
        let name = head[name_start..].to_string();
        let ret = c_type_to_rust(&head[..name_start]);
        let params_text = decl[open + 1..decl.rfind(')').unwrap()].trim();
        let params = if params_text == "void" {
            Vec::new()
        } else {
            params_text
                .split(',')
                .map(|p| {
                    let p = p.trim();
                    let cut = p
                        .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
                        .unwrap();
                    c_type_to_rust(&p[..=cut])
                })
                .collect()
        };
        out.insert(name, (params, ret));
    }
    out
}

fn rust_signatures(source: &str) -> Signatures {
    let mut out = Signatures::new();
    let mut pending: Option<String> = None;
    for line in source.lines() {
        let line = line.trim();
        match pending.as_mut() {
            Some(decl) => {
                decl.push(' ');
                decl.push_str(line);
            }
            None if line.starts_with("pub fn kvr_") => pending = Some(line.to_string()),
            None => continue,
        }
        if let Some(decl) = pending.take_if(|d| d.ends_with(';')) {
            let decl = decl.trim_start_matches("pub fn ").trim_end_matches(';');
            let open = decl.find('(').unwrap();
            let close = decl.rfind(')').unwrap();
            let name = decl[..open].trim().to_string();
            let params = decl[open + 1..close]
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let ty = p.split_once(':').unwrap().1;
                    ty.split_whitespace().collect::<Vec<_>>().join(" ")
                })
                .collect();
            let ret = decl[close + 1..]
                .trim()
                .trim_start_matches("->")
                .trim()
                .to_string();
            out.insert(name, (params, ret));
        }
    }
    out
}

#[test]
fn every_function_is_declared_with_the_header_signature() {
    let header = header_signatures(&header_text());
    let rust = rust_signatures(include_str!("../src/lib.rs"));
    assert!(
        header.len() >= 84,
        "parsed only {} header declarations",
        header.len()
    );
    let missing: Vec<&String> = header.keys().filter(|k| !rust.contains_key(*k)).collect();
    let extra: Vec<&String> = rust.keys().filter(|k| !header.contains_key(*k)).collect();
    assert!(
        missing.is_empty(),
        "functions not declared in kvrouter-sys: {missing:?}"
    );
    assert!(
        extra.is_empty(),
        "functions kvrouter-sys declares that the header lacks: {extra:?}"
    );
    let wrong: Vec<String> = header
        .iter()
        .filter(|(name, sig)| rust[*name] != **sig)
        .map(|(name, sig)| format!("{name}: header {sig:?}, Rust {:?}", rust[name]))
        .collect();
    assert!(
        wrong.is_empty(),
        "signature mismatches:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn linked_library_matches_the_declared_version() {
    // SAFETY: no arguments; the string is static.
    let (number, text) = unsafe {
        (
            kvr_version(),
            std::ffi::CStr::from_ptr(kvr_version_string()),
        )
    };
    assert_eq!(number / 100, KVR_VERSION_NUMBER / 100, "library {text:?}");
    assert!(text
        .to_str()
        .unwrap()
        .starts_with(&format!("{KVR_VERSION_MAJOR}.{KVR_VERSION_MINOR}.")));
}

#[test]
fn every_versioned_struct_has_a_sized_init() {
    // ABI 0.2: a struct beginning with struct_size is initialised by
    // `kvr_status NAME_init(NAME *, size_t size)`, whose size the safe layer's `raw::init` takes
    // from size_of (one entry per such struct in kvrouter's raw.rs).
    let rust = rust_signatures(include_str!("../src/lib.rs"));
    let versioned: Vec<String> = header_struct_fields(&header_text())
        .into_iter()
        .filter(|(_, fields)| fields.first().map(String::as_str) == Some("struct_size"))
        .map(|(name, _)| name)
        .collect();
    assert_eq!(versioned.len(), 16, "versioned structs: {versioned:?}");
    for name in &versioned {
        let init = format!("{name}_init");
        let want = (
            vec![format!("*mut {name}"), "usize".to_string()],
            "kvr_status".to_string(),
        );
        assert_eq!(rust.get(&init), Some(&want), "{init}");
    }
}

#[test]
fn the_crates_name_the_generated_version() {
    // The generated constants are the header's version (0.2.2); the crate's version carries it
    // as build metadata and shares its major.minor, and build.rs probes for that major.minor.
    let (major, minor) = (KVR_VERSION_MAJOR, KVR_VERSION_MINOR);
    assert_eq!(
        KVR_VERSION_STRING,
        format!("{major}.{minor}.{KVR_VERSION_PATCH}")
    );
    assert_eq!(
        KVR_VERSION_NUMBER,
        major * 10000 + minor * 100 + KVR_VERSION_PATCH
    );
    let crate_version = env!("CARGO_PKG_VERSION");
    assert!(
        crate_version.starts_with(&format!("{major}.{minor}."))
            && crate_version.ends_with(&format!("+kvrouter.{KVR_VERSION_STRING}")),
        "Cargo.toml's version {crate_version} does not name libkvrouter {KVR_VERSION_STRING}"
    );
    let build = include_str!("../build.rs");
    for line in [
        format!("const MIN_VERSION: &str = \"{major}.{minor}\";"),
        format!("const NEXT_MINOR: &str = \"{major}.{}\";", minor + 1),
    ] {
        assert!(build.contains(&line), "build.rs lacks `{line}`");
    }
}
