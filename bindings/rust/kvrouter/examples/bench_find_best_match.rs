//! find_best_match through the Rust binding, on the same index and queries as the C++
//! `bench/router_bench.cc` (BENCHMARKS.md, "Router"), so the FFI and wrapper overhead can be
//! read off against the C++ figure.
//!
//! The index: the Mooncake conversation trace (expanded at block size 16 as
//! tools/replay/trace/mooncake_trace.cc does), every request's prompt stored on one of 64 workers
//! round-robin as only the blocks new to that worker, through the C ABI. Queries: the first
//! 1,024 prompts of at least 512 blocks, cut to 8,192 tokens, each copied into a reused buffer
//! before the clock starts (as the C++ benchmark does). Every call is timed on its own; p50 /
//! p99 per repetition, and the median over repetitions, which run the loops interleaved:
//!
//! * `safe admit + free`: `Router::find_best_match` with `RequestOptions::admit(id)` (hash, match,
//!   price 64 candidates, book), then `free_request` (untimed), as `BM_FindBestMatch/inflight:0`;
//! * `safe preview`: `find_best_match` with default options, as `BM_FindBestMatchPreview`;
//! * `raw sys ...`: `kvr_find_best_match` called directly with a prepared options struct
//!   and C string: what a C caller pays, so `safe − raw` is the wrapper's own cost;
//! * the same pair on a 16-token prompt and one worker: the fixed cost of a call.
//!
//! ```sh
//! cargo run --release --example bench_find_best_match -- [--trace PATH] [--iters N] [--reps N]
//! ```

use std::collections::HashSet;
use std::ffi::CString;
use std::time::Instant;

use kvrouter::{
    compute_block_hashes, compute_sequence_hashes, HashOptions, RequestOptions, Router,
    RouterOptions, StoredEvent, WorkerConfig,
};
use kvrouter_sys as sys;

const BLOCK: u32 = 16;
const QUERY_BLOCKS: usize = 512;
const MAX_QUERIES: usize = 1024;
const TRACE_BLOCK_TOKENS: usize = 512;

struct Args {
    trace: String,
    iters: usize,
    reps: usize,
    workers: u64,
}

fn parse_args() -> Args {
    let mut args = Args {
        trace: concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../data/mooncake/conversation_trace.jsonl"
        )
        .to_string(),
        iters: 20_000,
        reps: 3,
        workers: 64,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--trace" => args.trace = value,
            "--iters" => args.iters = value.parse().unwrap(),
            "--reps" => args.reps = value.parse().unwrap(),
            "--workers" => args.workers = value.parse().unwrap(),
            other => panic!("unknown flag {other}"),
        }
    }
    args
}

/// One trace line: `{"timestamp": .., "input_length": N, "output_length": .., "hash_ids": [..]}`.
fn parse_line(line: &str) -> Option<(usize, Vec<u64>)> {
    let field = |name: &str| -> Option<&str> {
        let at = line.find(&format!("\"{name}\""))? + name.len() + 2;
        Some(line[at..].trim_start().strip_prefix(':')?.trim_start())
    };
    let input = field("input_length")?;
    let input: usize = input[..input.find(|c: char| !c.is_ascii_digit())?]
        .parse()
        .ok()?;
    let ids = field("hash_ids")?.strip_prefix('[')?;
    let ids = &ids[..ids.find(']')?];
    let ids = ids
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().ok())
        .collect::<Option<Vec<u64>>>()?;
    Some((input, ids))
}

/// tools/replay/trace/mooncake_trace.cc's token expansion: pairs of tokens from splitmix64 of
/// (hash_id × 256 + pair), truncated to input_length.
fn expand(input_length: usize, hash_ids: &[u64]) -> Vec<u32> {
    fn mix64(mut x: u64) -> u64 {
        x = x.wrapping_add(0x9e3779b97f4a7c15);
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d049bb133111eb);
        x ^ (x >> 31)
    }
    let length = input_length.min(hash_ids.len() * TRACE_BLOCK_TOKENS);
    let mut out = vec![0u32; length];
    let pairs_per_block = (TRACE_BLOCK_TOKENS / 2) as u64;
    for pos in (0..length).step_by(2) {
        let id = hash_ids[pos / TRACE_BLOCK_TOKENS];
        let pair = mix64(id * pairs_per_block + ((pos % TRACE_BLOCK_TOKENS) / 2) as u64);
        out[pos] = pair as u32;
        if pos + 1 < length {
            out[pos + 1] = (pair >> 32) as u32;
        }
    }
    out
}

fn load(args: &Args) -> (Router, Vec<Vec<u32>>) {
    let router = Router::new(&RouterOptions {
        random_seed: 1,
        ..RouterOptions::with_block_size(BLOCK)
    })
    .unwrap();
    for w in 0..args.workers {
        router
            .add_worker(&WorkerConfig {
                max_num_batched_tokens: 16384,
                ..WorkerConfig::new(w)
            })
            .unwrap();
    }
    let text = std::fs::read_to_string(&args.trace)
        .unwrap_or_else(|e| panic!("{}: {e} (pass --trace PATH)", args.trace));
    let mut held: Vec<HashSet<u64>> = vec![HashSet::new(); args.workers as usize];
    let mut queries = Vec::new();
    let mut records = 0u64;
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let (input, ids) = parse_line(line).unwrap_or_else(|| panic!("bad trace line {}", i + 1));
        let tokens = expand(input, &ids);
        let local = compute_block_hashes(&tokens, BLOCK, &HashOptions::default()).unwrap();
        let engine = compute_sequence_hashes(&local).unwrap();
        let w = i % args.workers as usize;
        let first_new = engine.iter().take_while(|h| held[w].contains(h)).count();
        if first_new < engine.len() {
            router
                .apply_stored(&StoredEvent {
                    worker_id: w as u64,
                    event_id: i as u64,
                    parent_hash: (first_new > 0).then(|| engine[first_new - 1]),
                    block_hashes: &engine[first_new..],
                    local_hashes: Some(&local[first_new..]),
                    ..Default::default()
                })
                .unwrap();
            held[w].extend(&engine[first_new..]);
        }
        if queries.len() < MAX_QUERIES && local.len() >= QUERY_BLOCKS {
            queries.push(tokens[..QUERY_BLOCKS * BLOCK as usize].to_vec());
        }
        records += 1;
    }
    let m = router.metrics().unwrap();
    eprintln!(
        "index: {records} trace requests over {} workers, {} cached (block, worker) entries, \
         {} nodes; {} queries of {} tokens",
        args.workers,
        m.index_blocks,
        m.index_nodes,
        queries.len(),
        QUERY_BLOCKS * BLOCK as usize
    );
    (router, queries)
}

/// Nearest-rank percentile, as bench/bench_common.h.
fn percentile(samples: &mut [f64], p: f64) -> f64 {
    let k = ((p * samples.len() as f64) as usize).min(samples.len() - 1);
    *samples.select_nth_unstable_by(k, |a, b| a.total_cmp(b)).1
}

type Bench<'a> = (&'static str, Box<dyn FnMut(usize) -> f64 + 'a>);

/// Runs every benchmark once per repetition, interleaved, so that a change of load on this
/// shared machine hits them all alike; prints each one's median p50 and p99 over repetitions.
fn run(args: &Args, benches: &mut [Bench<'_>]) {
    let mut p50s = vec![Vec::new(); benches.len()];
    let mut p99s = vec![Vec::new(); benches.len()];
    for _ in 0..args.reps {
        for (b, (_, call)) in benches.iter_mut().enumerate() {
            for i in 0..1000 {
                call(i); // warm-up
            }
            let mut samples: Vec<f64> = (0..args.iters).map(&mut *call).collect();
            p50s[b].push(percentile(&mut samples, 0.50));
            p99s[b].push(percentile(&mut samples, 0.99));
        }
    }
    for (b, (name, _)) in benches.iter().enumerate() {
        println!(
            "{name:<34} p50 {:>7.2} us   p99 {:>7.2} us   (p50 per rep {:?})",
            percentile(&mut p50s[b].clone(), 0.5),
            percentile(&mut p99s[b], 0.5),
            p50s[b]
                .iter()
                .map(|p| (p * 100.0).round() / 100.0)
                .collect::<Vec<_>>()
        );
    }
    println!(
        "({} reps x {} calls each; medians over reps)",
        args.reps, args.iters
    );
}

/// One timed kvr_find_best_match straight through kvrouter-sys, as a C caller makes it.
fn raw_call(router: *mut sys::kvr_router, tokens: &[u32], opts: &sys::kvr_request_options) -> f64 {
    // Initialised (kvr_route_result_init with the compiled size) before the clock starts.
    let mut out: sys::kvr_route_result = kvrouter::raw::init();
    // SAFETY: a live router; every pointer lives across the call.
    unsafe {
        let start = Instant::now();
        let status = sys::kvr_find_best_match(
            router,
            tokens.as_ptr(),
            tokens.len(),
            opts,
            &mut out,
            std::ptr::null_mut(),
            0,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        );
        let us = start.elapsed().as_secs_f64() * 1e6;
        assert_eq!(status, sys::KVR_OK);
        us
    }
}

fn main() {
    let args = parse_args();
    let (router, queries) = load(&args);
    assert!(
        !queries.is_empty(),
        "no trace prompt has {QUERY_BLOCKS} blocks"
    );
    let ids: Vec<String> = (0..4096).map(|i| format!("request-{i}")).collect();
    let c_ids: Vec<CString> = ids
        .iter()
        .map(|s| CString::new(s.as_str()).unwrap())
        .collect();

    let raw_router = router.as_raw();
    let mut admit: sys::kvr_request_options = kvrouter::raw::init();
    admit.flags = sys::KVR_REQUEST_ADMIT;
    let preview: sys::kvr_request_options = kvrouter::raw::init();

    // The fixed cost of one call, apart from the routing work: a one-block prompt on a
    // one-worker router.
    let tiny_router = Router::new(&RouterOptions::with_block_size(BLOCK)).unwrap();
    tiny_router.add_worker(&WorkerConfig::new(1)).unwrap();
    let tiny: Vec<u32> = (0..BLOCK).collect();

    // As in router_bench.cc, each prompt is copied into a reused buffer before the clock
    // starts (a request's tokens are in cache right after they were decoded).
    let (router, queries, ids, c_ids) = (&router, &queries, &ids, &c_ids);
    let hot = |i: usize, buf: &mut Vec<u32>| {
        buf.clear();
        buf.extend_from_slice(&queries[i % queries.len()]);
    };
    let mut benches: Vec<Bench<'_>> = vec![
        (
            "safe admit + free (untimed)",
            Box::new({
                let mut buf = Vec::new();
                move |i| {
                    let id = &ids[i % ids.len()];
                    hot(i, &mut buf);
                    let opts = RequestOptions::admit(id);
                    let start = Instant::now();
                    let r = router.find_best_match(&buf, &opts);
                    let us = start.elapsed().as_secs_f64() * 1e6;
                    assert!(r.unwrap().booked);
                    router.free_request(id).unwrap();
                    us
                }
            }),
        ),
        (
            "raw sys admit + free (untimed)",
            Box::new({
                let mut buf = Vec::new();
                move |i| {
                    let id = &c_ids[i % c_ids.len()];
                    hot(i, &mut buf);
                    admit.request_id = id.as_ptr();
                    let us = raw_call(raw_router, &buf, &admit);
                    // SAFETY: a live router and C string.
                    unsafe {
                        sys::kvr_router_free_request(raw_router, id.as_ptr(), std::ptr::null_mut())
                    };
                    us
                }
            }),
        ),
        (
            "safe preview",
            Box::new({
                let mut buf = Vec::new();
                move |i| {
                    hot(i, &mut buf);
                    let start = Instant::now();
                    let r = router.find_best_match(&buf, &RequestOptions::default());
                    let us = start.elapsed().as_secs_f64() * 1e6;
                    r.unwrap();
                    us
                }
            }),
        ),
        (
            "raw sys preview",
            Box::new({
                let mut buf = Vec::new();
                move |i| {
                    hot(i, &mut buf);
                    raw_call(raw_router, &buf, &preview)
                }
            }),
        ),
        (
            "safe preview, 16 tokens, 1 worker",
            Box::new(|_| {
                let start = Instant::now();
                let r = tiny_router.find_best_match(&tiny, &RequestOptions::default());
                let us = start.elapsed().as_secs_f64() * 1e6;
                r.unwrap();
                us
            }),
        ),
        (
            "raw sys preview, 16 tokens, 1 worker",
            Box::new(|_| raw_call(tiny_router.as_raw(), &tiny, &preview)),
        ),
    ];
    run(&args, &mut benches);
}
