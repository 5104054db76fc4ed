//! One measured run of one indexer at one thread count, in a process of its own (the parent
//! re-executes this binary with `--run`), so the resident-memory growth while loading belongs
//! to that indexer alone. Prints one `RESULT {json}` line.
//!
//! Phases (each as in bench/index_bench.cc):
//! 1. trace load: every stored event of the workload, in trace order, in chunks of 256; each
//!    chunk's events are built first (Dynamo's `RouterEvent`s; kvrouter's are C structs over
//!    the same arrays), then applied, and only the applying is timed. With 2 threads the
//!    chunk's events are split by worker (each worker's events stay in order on one thread:
//!    CRTC's own lanes; for kvrouter two threads calling `kvr_router_apply_stored`).
//! 2. memory: `malloc_trim(0)` then VmRSS before building the index and after loading it;
//!    (after − before) / cached (block, worker) entries. The same without the second trim:
//!    what a process that never trims keeps (the heap's free pages among the index's
//!    arrays). kvrouter also reports its exact allocated bytes (`kvr_metrics.index_bytes`).
//! 3. find_matches: one warm-up pass over the 1,024 queries, then `iters` calls per thread,
//!    thread t starting at query 512·t, each call timed on its own: p50 / p99 and lookups/s
//!    (all threads' calls / wall time), and the share of the cores the lookup threads got
//!    (process CPU time / (threads × wall)), which shows when other processes took them.
//! 4. continuations: `apply_iters` times, store the 1,024 runs (32,768 blocks) then remove
//!    them, each phase timed; median block-events/s per phase. The index is back to its loaded
//!    size after every iteration (checked at the end).

use std::time::{Duration, Instant};

use dynamo_kv_router::protocols::{LocalBlockHash, RouterEvent};
use serde_json::json;

use crate::drivers::{removed_event, stored_event, Crtc, Kvr, Radix};
use crate::sampling::{cpu_seconds, median, percentile, CLOCK_PROCESS_CPUTIME_ID};
use crate::workload::{Workload, QUERY_BLOCKS};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Kvr,
    Radix,
    Crtc,
}

impl Kind {
    pub fn parse(s: &str) -> Kind {
        match s {
            "kvrouter" => Kind::Kvr,
            "radix" => Kind::Radix,
            "crtc" => Kind::Crtc,
            other => panic!("unknown indexer {other} (kvrouter, radix, crtc)"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::Kvr => "kvrouter",
            Kind::Radix => "radix",
            Kind::Crtc => "crtc",
        }
    }
}

pub struct RunArgs {
    pub kind: Kind,
    /// kvrouter's `index_shards` router option (None: the library's default, one tree).
    pub index_shards: Option<u32>,
    pub threads: usize,
    pub iters: usize,
    pub apply_iters: usize,
}

const CHUNK: usize = 256;

#[cfg(target_env = "gnu")]
fn trim() {
    extern "C" {
        fn malloc_trim(pad: usize) -> i32;
    }
    // SAFETY: glibc's malloc_trim has no preconditions.
    unsafe {
        malloc_trim(0);
    }
}

#[cfg(not(target_env = "gnu"))]
fn trim() {}

/// Resident memory in bytes (VmRSS), after returning free heap pages to the system.
pub fn rss_bytes() -> u64 {
    trim();
    untrimmed_rss_bytes()
}

/// Resident memory in bytes (VmRSS) as the process holds it: what an embedding process that
/// never calls `malloc_trim` keeps, free heap pages included.
pub fn untrimmed_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Thread of a worker for `threads` threads: first-appearance round robin. Workers appear in
/// the trace as 0, 1, 2, ... (request i goes to worker i mod W), so this is worker mod threads,
/// which is also what CRTC's own assignment gives.
fn thread_of(worker: u32, threads: usize) -> usize {
    worker as usize % threads
}

enum Index {
    Kvr(Kvr),
    Radix(Radix),
    Crtc(Crtc),
}

pub fn run(w: &Workload, args: &RunArgs) -> serde_json::Value {
    assert!(
        args.kind != Kind::Radix || args.threads == 1,
        "RadixTree is single-threaded (Rc/RefCell nodes): 1 thread only"
    );
    let threads = args.threads.max(1);
    let rss_before = rss_bytes();
    let mut index = match args.kind {
        Kind::Kvr => Index::Kvr(Kvr::new(w.workers, 1, args.index_shards)),
        Kind::Radix => Index::Radix(Radix::new()),
        Kind::Crtc => Index::Crtc(Crtc::new(threads)),
    };

    // 1. Trace load.
    let mut load = Duration::ZERO;
    for (c, chunk) in w.stores.chunks(CHUNK).enumerate() {
        let base_id = (c * CHUNK) as u64;
        match &mut index {
            Index::Kvr(k) => {
                let start = Instant::now();
                if threads == 1 {
                    for s in chunk {
                        let st =
                            k.store(s.worker as u64, 0, s.parent, w.local_of(s), w.engine_of(s));
                        assert_eq!(st, kvrouter::sys::KVR_OK, "kvrouter rejected a trace event");
                    }
                } else {
                    std::thread::scope(|scope| {
                        for t in 0..threads {
                            let k = &*k;
                            scope.spawn(move || {
                                for s in chunk.iter().filter(|s| thread_of(s.worker, threads) == t)
                                {
                                    let st = k.store(
                                        s.worker as u64,
                                        0,
                                        s.parent,
                                        w.local_of(s),
                                        w.engine_of(s),
                                    );
                                    assert_eq!(
                                        st,
                                        kvrouter::sys::KVR_OK,
                                        "kvrouter rejected a trace event"
                                    );
                                }
                            });
                        }
                    });
                }
                load += start.elapsed();
            }
            Index::Radix(r) => {
                let events: Vec<RouterEvent> = chunk
                    .iter()
                    .enumerate()
                    .map(|(i, s)| {
                        stored_event(
                            s.worker as u64,
                            0,
                            base_id + i as u64,
                            s.parent,
                            w.local_of(s),
                            w.engine_of(s),
                        )
                    })
                    .collect();
                let start = Instant::now();
                for e in events {
                    r.tree
                        .apply_event(e)
                        .expect("RadixTree rejected a trace event");
                }
                load += start.elapsed();
            }
            Index::Crtc(x) => {
                let events: Vec<RouterEvent> = chunk
                    .iter()
                    .enumerate()
                    .map(|(i, s)| {
                        stored_event(
                            s.worker as u64,
                            0,
                            base_id + i as u64,
                            s.parent,
                            w.local_of(s),
                            w.engine_of(s),
                        )
                    })
                    .collect();
                let start = Instant::now();
                for e in events {
                    x.send(e);
                }
                x.flush();
                load += start.elapsed();
            }
        }
    }
    let untrimmed_rss_after = untrimmed_rss_bytes();
    let rss_after = rss_bytes();
    let entries = w.blocks() as f64;
    let (index_entries, exact_bytes, nodes) = match &index {
        Index::Kvr(k) => {
            let (blocks, bytes, nodes) = k.index_stats();
            (blocks as usize, Some(bytes), Some(nodes))
        }
        Index::Radix(r) => (r.tree.current_size(), None, None),
        Index::Crtc(x) => (x.tree_sizes().values().sum(), None, None),
    };
    assert_eq!(
        index_entries,
        w.blocks(),
        "{}: the index holds {index_entries} (block, worker) entries, {} were stored",
        args.kind.name(),
        w.blocks()
    );

    // 3. find_matches.
    let queries = &w.queries;
    assert!(
        !queries.is_empty(),
        "no trace prompt has {QUERY_BLOCKS} blocks"
    );
    let dyn_queries: Vec<Vec<LocalBlockHash>> = queries
        .iter()
        .map(|q| crate::drivers::dynamo_query(q))
        .collect();
    // Warm-up pass, and the mean number of ranks matched.
    let mut matched = 0usize;
    match &index {
        Index::Kvr(k) => {
            let mut buf = k.buffer(w.workers as usize);
            for q in queries {
                matched += k.find(q, &mut buf);
            }
        }
        Index::Radix(r) => {
            for q in &dyn_queries {
                matched += r.tree.find_matches(q.clone(), false).scores.len();
            }
        }
        Index::Crtc(x) => {
            for q in &dyn_queries {
                matched += x.find(q).scores.len();
            }
        }
    }
    let iters = args.iters;
    let find_start = Instant::now();
    let find_cpu_start = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID);
    let mut latencies: Vec<f64> = match &index {
        Index::Kvr(k) => std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    scope.spawn(move || {
                        let mut buf = k.buffer(w.workers as usize);
                        let mut lat = Vec::with_capacity(iters);
                        let mut q = (t * 512) % queries.len();
                        for _ in 0..iters {
                            let s = Instant::now();
                            std::hint::black_box(k.find(&queries[q], &mut buf));
                            lat.push(s.elapsed().as_secs_f64());
                            q = (q + 1) % queries.len();
                        }
                        lat
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        }),
        Index::Radix(r) => {
            let mut lat = Vec::with_capacity(iters);
            let mut q = 0;
            for _ in 0..iters {
                // find_matches takes the sequence by value: the copy is made before the clock.
                let seq = dyn_queries[q].clone();
                let s = Instant::now();
                std::hint::black_box(r.tree.find_matches(seq, false));
                lat.push(s.elapsed().as_secs_f64());
                q = (q + 1) % queries.len();
            }
            lat
        }
        Index::Crtc(x) => std::thread::scope(|scope| {
            let dq = &dyn_queries;
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    scope.spawn(move || {
                        let mut lat = Vec::with_capacity(iters);
                        let mut q = (t * 512) % dq.len();
                        for _ in 0..iters {
                            let s = Instant::now();
                            std::hint::black_box(x.find(&dq[q]));
                            lat.push(s.elapsed().as_secs_f64());
                            q = (q + 1) % dq.len();
                        }
                        lat
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        }),
    };
    let find_wall = find_start.elapsed().as_secs_f64();
    // Idle threads (CRTC's event lanes wait in recv) use no CPU, so this is the lookup
    // threads' share of the cores they asked for: < 1 when something else ran on them.
    let find_cpu_share =
        (cpu_seconds(CLOCK_PROCESS_CPUTIME_ID) - find_cpu_start) / (threads as f64 * find_wall);
    let lookups_per_s = latencies.len() as f64 / find_wall;
    let p50 = percentile(&mut latencies, 0.50) * 1e6;
    let p99 = percentile(&mut latencies, 0.99) * 1e6;
    // kvrouter through the safe layer, for comparison (1 thread, a tenth of the calls).
    let safe_p50 = match &index {
        Index::Kvr(k) if threads == 1 => {
            let mut lat = Vec::new();
            for i in 0..(iters / 10).max(100) {
                let q = &queries[i % queries.len()];
                let s = Instant::now();
                std::hint::black_box(k.find_safe(q));
                lat.push(s.elapsed().as_secs_f64());
            }
            Some(percentile(&mut lat, 0.5) * 1e6)
        }
        _ => None,
    };
    // kvrouter's walk with the cost model's figures per rank (kvr_router_overlap_scores_hashed),
    // 1 thread, a tenth of the calls.
    let overlap_p50 = match &index {
        Index::Kvr(k) if threads == 1 => {
            let mut buf = k.overlap_buffer(w.workers as usize);
            let mut lat = Vec::new();
            for i in 0..(iters / 10).max(100) {
                let q = &queries[i % queries.len()];
                let s = Instant::now();
                std::hint::black_box(k.find_overlap(q, &mut buf));
                lat.push(s.elapsed().as_secs_f64());
            }
            Some(percentile(&mut lat, 0.5) * 1e6)
        }
        _ => None,
    };

    // 4. Continuations.
    let run_blocks: usize = w.runs.iter().map(|r| r.local.len()).sum();
    let mut store_rates = Vec::new();
    let mut remove_rates = Vec::new();
    for it in 0..args.apply_iters {
        let (ts, tr) = match &mut index {
            Index::Kvr(k) => {
                let k = &*k;
                let phase = |store: bool| {
                    let start = Instant::now();
                    std::thread::scope(|scope| {
                        for t in 0..threads {
                            scope.spawn(move || {
                                for r in w.runs.iter().filter(|r| thread_of(r.worker, threads) == t)
                                {
                                    let st = if store {
                                        k.store(
                                            r.worker as u64,
                                            0,
                                            Some(r.parent),
                                            &r.local,
                                            &r.engine,
                                        )
                                    } else {
                                        k.remove(r.worker as u64, 0, &r.engine)
                                    };
                                    assert_eq!(
                                        st,
                                        kvrouter::sys::KVR_OK,
                                        "kvrouter rejected a continuation event"
                                    );
                                }
                            });
                        }
                    });
                    start.elapsed()
                };
                let ts = if threads == 1 {
                    let start = Instant::now();
                    for r in &w.runs {
                        let st = k.store(r.worker as u64, 0, Some(r.parent), &r.local, &r.engine);
                        assert_eq!(
                            st,
                            kvrouter::sys::KVR_OK,
                            "kvrouter rejected a continuation store"
                        );
                    }
                    start.elapsed()
                } else {
                    phase(true)
                };
                let tr = if threads == 1 {
                    let start = Instant::now();
                    for r in &w.runs {
                        let st = k.remove(r.worker as u64, 0, &r.engine);
                        assert_eq!(
                            st,
                            kvrouter::sys::KVR_OK,
                            "kvrouter rejected a continuation removal"
                        );
                    }
                    start.elapsed()
                } else {
                    phase(false)
                };
                (ts, tr)
            }
            Index::Radix(r) => {
                let (stores, removes) = continuation_events(w, it);
                let start = Instant::now();
                for e in stores {
                    r.tree
                        .apply_event(e)
                        .expect("RadixTree rejected a continuation store");
                }
                let ts = start.elapsed();
                let start = Instant::now();
                for e in removes {
                    r.tree
                        .apply_event(e)
                        .expect("RadixTree rejected a continuation removal");
                }
                (ts, start.elapsed())
            }
            Index::Crtc(x) => {
                let (stores, removes) = continuation_events(w, it);
                let start = Instant::now();
                for e in stores {
                    x.send(e);
                }
                x.flush();
                let ts = start.elapsed();
                let start = Instant::now();
                for e in removes {
                    x.send(e);
                }
                x.flush();
                (ts, start.elapsed())
            }
        };
        store_rates.push(run_blocks as f64 / ts.as_secs_f64());
        remove_rates.push(run_blocks as f64 / tr.as_secs_f64());
    }
    let final_entries = match &index {
        Index::Kvr(k) => k.index_stats().0 as usize,
        Index::Radix(r) => r.tree.current_size(),
        Index::Crtc(x) => x.tree_sizes().values().sum(),
    };
    assert_eq!(
        final_entries,
        w.blocks(),
        "{}: after the continuations the index holds {final_entries} entries, not {}",
        args.kind.name(),
        w.blocks()
    );

    json!({
        "indexer": args.kind.name(),
        "threads": threads,
        "index_shards": args.index_shards,
        "workers": w.workers,
        "requests": w.requests,
        "events": w.stores.len(),
        "entries": w.blocks(),
        "prepare_s": w.prepare_seconds,
        "load_s": load.as_secs_f64(),
        "load_blocks_per_s": entries / load.as_secs_f64(),
        "load_events_per_s": w.stores.len() as f64 / load.as_secs_f64(),
        "rss_delta_bytes": rss_after as f64 - rss_before as f64,
        "rss_bytes_per_entry": (rss_after as f64 - rss_before as f64) / entries,
        "untrimmed_rss_bytes_per_entry": (untrimmed_rss_after as f64 - rss_before as f64) / entries,
        "exact_bytes_per_entry": exact_bytes.map(|b| b as f64 / entries),
        "exact_bytes": exact_bytes,
        "index_nodes": nodes,
        "queries": queries.len(),
        "ranks_matched_mean": matched as f64 / queries.len() as f64,
        "find_calls": latencies.len(),
        "find_p50_us": p50,
        "find_p99_us": p99,
        "lookups_per_s": lookups_per_s,
        "find_cpu_share": find_cpu_share,
        "safe_find_p50_us": safe_p50,
        "overlap_find_p50_us": overlap_p50,
        "run_events": w.runs.len(),
        "run_blocks": run_blocks,
        "store_blocks_per_s": median(&mut store_rates),
        "remove_blocks_per_s": median(&mut remove_rates),
        "store_events_per_s": median(&mut store_rates) / (run_blocks as f64 / w.runs.len() as f64),
        "remove_events_per_s": median(&mut remove_rates) / (run_blocks as f64 / w.runs.len() as f64),
    })
}

/// The continuation batch as Dynamo events (built outside the timed region).
fn continuation_events(w: &Workload, iteration: usize) -> (Vec<RouterEvent>, Vec<RouterEvent>) {
    let base = (iteration * 2 * w.runs.len()) as u64;
    let stores = w
        .runs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            stored_event(
                r.worker as u64,
                0,
                base + i as u64,
                Some(r.parent),
                &r.local,
                &r.engine,
            )
        })
        .collect();
    let removes = w
        .runs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            removed_event(
                r.worker as u64,
                0,
                base + (w.runs.len() + i) as u64,
                &r.engine,
            )
        })
        .collect();
    (stores, removes)
}
