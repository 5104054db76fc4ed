//! The whole per-request routing decision, with booking and release, side by side: kvrouter's
//! `Router::find_best_match` (admitting the request) then `Router::free_request`, against
//! Dynamo's `services::selection::SelectionCore` (the published `dynamo-kv-router` crate,
//! 1.6.1, used as a dependency: none of its code is copied here) `select_and_reserve` then
//! `free_reservation`. Both start from token ids, so hashing the prompt is inside the timed
//! call on both sides; both indexes hold the same stored events (bench/peers' workload: the
//! Mooncake trace, see `../../peers/src/workload.rs`).
//!
//! ```sh
//! scripts/bench-selection.sh            # builds, then the table (below)
//! ```
//!
//! The binary (`build/selection-target/release/kvrouter-selection-bench`), for each worker
//! count (`--workers 64,1000`):
//!
//! 1. builds the workload (every trace request's blocks stored on worker i mod W) and the 1,024
//!    query prompts as token ids (the workload keeps only their hashes: the tokens are expanded
//!    again here, and hashing them must give exactly the workload's query hashes);
//! 2. builds both routers in this one process, each holding the same stored events: kvrouter
//!    through `Router::apply_stored` (engine and local hashes), Dynamo through its partition
//!    indexer's `apply_event_routed` then a flush;
//! 3. a warm-up pass of every query through each router, whose decisions are compared (same
//!    worker; same cached blocks on the chosen worker);
//! 4. `--rounds` rounds per prompt length (8,192 tokens, and the first `--short-tokens` of each
//!    prompt), each round running `--iters` requests through one router then the other (the
//!    order alternating from round to round), every call timed on its own.
//!
//! Flags: `--trace PATH`, `--trace-requests N` (first N requests; 0 = all), `--workers LIST`,
//! `--rounds N` (default 5), `--iters N` (requests per router per round, default 4096),
//! `--short-tokens N` (default 1024; 0 = only the full prompts), `--dynamo-indexer-threads N`
//! (default 2: Dynamo's concurrent indexer, lookups inline on the caller's thread; 1 = its
//! single-threaded `KvIndexer`, lookups sent to the indexer's task).

#[path = "../../peers/src/sampling.rs"]
mod sampling;
#[allow(dead_code)]
#[path = "../../peers/src/workload.rs"]
mod workload;

mod dynamo;
mod kvr;
mod trace;

use std::time::Instant;

use sampling::{
    cpu_seconds, loadavg, median, percentile, CLOCK_PROCESS_CPUTIME_ID, CLOCK_THREAD_CPUTIME_ID,
};
use workload::BLOCK_SIZE;

pub struct Args {
    trace: String,
    trace_requests: usize,
    workers: Vec<u32>,
    rounds: usize,
    iters: usize,
    short_tokens: usize,
    dynamo_indexer_threads: usize,
}

fn parse_args() -> Args {
    let mut a = Args {
        trace: workload::default_trace_path(),
        trace_requests: 0,
        workers: vec![64, 1000],
        rounds: 5,
        iters: 4096,
        short_tokens: 1024,
        dynamo_indexer_threads: 2,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        let number = || {
            value
                .parse::<usize>()
                .unwrap_or_else(|_| panic!("{flag}: bad number {value}"))
        };
        match flag.as_str() {
            "--trace" => a.trace = value.clone(),
            "--trace-requests" => a.trace_requests = number(),
            "--workers" => {
                a.workers = value
                    .split(',')
                    .map(|x| {
                        x.trim()
                            .parse()
                            .unwrap_or_else(|_| panic!("bad number {x}"))
                    })
                    .collect()
            }
            "--rounds" => a.rounds = number(),
            "--iters" => a.iters = number(),
            "--short-tokens" => a.short_tokens = number(),
            "--dynamo-indexer-threads" => a.dynamo_indexer_threads = number(),
            other => panic!("unknown flag {other}"),
        }
    }
    assert!(
        a.rounds > 0 && a.iters > 0,
        "--rounds and --iters must be > 0"
    );
    a
}

/// What one routed request came to: the rank chosen and its cached prefix in blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    pub worker: u64,
    pub cached_blocks: u32,
}

/// One router as the timing loop drives it. `prepare` builds whatever the call takes by value
/// (outside the clock); `decide` routes and books it; `release` frees it.
pub trait Side {
    type Prepared;
    fn name(&self) -> &'static str;
    fn prepare(&self, tokens: &[u32], id: &str) -> Self::Prepared;
    fn decide(
        &self,
        tokens: &[u32],
        id: &str,
        prepared: Self::Prepared,
    ) -> Result<Decision, String>;
    fn release(&self, id: &str) -> Result<(), String>;
    /// Requests still booked (0 after every round: each request was released).
    fn active(&self) -> u64;
}

/// One round of one router: per-call times in µs and what the calling thread and the others
/// used of the CPU meanwhile.
struct Round {
    total_us: Vec<f64>,
    decide_us: Vec<f64>,
    release_us: Vec<f64>,
    /// CPU time of the process's other threads during the loop / loop wall time.
    others_cpu: f64,
    /// CPU time of the calling thread / loop wall time (1 = never preempted).
    own_cpu: f64,
}

struct Stats {
    p50: f64,
    p99: f64,
    decide_p50: f64,
    release_p50: f64,
    /// Calls / (sum of the timed calls): the rate of one caller doing nothing else.
    per_s: f64,
    others_cpu: f64,
    own_cpu: f64,
}

impl Round {
    fn stats(&self) -> Stats {
        let sum: f64 = self.total_us.iter().sum();
        Stats {
            p50: percentile(&mut self.total_us.clone(), 0.5),
            p99: percentile(&mut self.total_us.clone(), 0.99),
            decide_p50: percentile(&mut self.decide_us.clone(), 0.5),
            release_p50: percentile(&mut self.release_us.clone(), 0.5),
            per_s: self.total_us.len() as f64 / (sum * 1e-6),
            others_cpu: self.others_cpu,
            own_cpu: self.own_cpu,
        }
    }
}

/// Adds a call's failures (a decision's, a release's) to `errors`, printing the first five.
fn count_failures(side: &str, failures: [Option<String>; 2], errors: &mut usize) {
    for e in failures.into_iter().flatten() {
        if *errors < 5 {
            eprintln!("{side} failed: {e}");
        }
        *errors += 1;
    }
}

/// `iters` requests through `side`, cycling over `prompts` from `start`; request ids are
/// `{prefix}-{n}`, made before the clock starts.
fn run_round<S: Side>(
    side: &S,
    prompts: &[Vec<u32>],
    start: usize,
    iters: usize,
    prefix: &str,
    errors: &mut usize,
) -> Round {
    let ids: Vec<String> = (0..iters).map(|n| format!("{prefix}-{n}")).collect();
    let mut r = Round {
        total_us: Vec::with_capacity(iters),
        decide_us: Vec::with_capacity(iters),
        release_us: Vec::with_capacity(iters),
        others_cpu: 0.0,
        own_cpu: 0.0,
    };
    let wall = Instant::now();
    let proc0 = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID);
    let thread0 = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
    for (n, id) in ids.iter().enumerate() {
        let tokens = &prompts[(start + n) % prompts.len()];
        let prepared = side.prepare(tokens, id);
        let t0 = Instant::now();
        let d = side.decide(tokens, id, prepared);
        let t1 = Instant::now();
        let f = side.release(id);
        let t2 = Instant::now();
        count_failures(side.name(), [d.err(), f.err()], errors);
        r.decide_us.push((t1 - t0).as_secs_f64() * 1e6);
        r.release_us.push((t2 - t1).as_secs_f64() * 1e6);
        r.total_us.push((t2 - t0).as_secs_f64() * 1e6);
    }
    let wall = wall.elapsed().as_secs_f64();
    let own = cpu_seconds(CLOCK_THREAD_CPUTIME_ID) - thread0;
    let all = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID) - proc0;
    let active = side.active();
    if active != 0 {
        eprintln!(
            "{}: {active} requests still booked after a round",
            side.name()
        );
        *errors += 1;
    }
    r.own_cpu = own / wall;
    r.others_cpu = (all - own).max(0.0) / wall;
    r
}

/// One pass over every prompt, untimed: warms the router and returns its decisions (a failed
/// call counts in `errors` and leaves `None`).
fn decisions<S: Side>(
    side: &S,
    prompts: &[Vec<u32>],
    prefix: &str,
    errors: &mut usize,
) -> Vec<Option<Decision>> {
    let mut out = Vec::with_capacity(prompts.len());
    for (q, tokens) in prompts.iter().enumerate() {
        let id = format!("{prefix}-{q}");
        let prepared = side.prepare(tokens, &id);
        let d = side.decide(tokens, &id, prepared);
        let f = side.release(&id);
        count_failures(side.name(), [d.as_ref().err().cloned(), f.err()], errors);
        out.push(d.ok());
    }
    out
}

struct Variant {
    label: String,
    tokens: usize,
    /// Per round, kvrouter's then Dynamo's stats.
    rounds: Vec<(Stats, Stats)>,
    same_worker: usize,
    same_cached: usize,
    queries: usize,
    kvr_cached_mean: f64,
    dyn_cached_mean: f64,
}

/// A table row: label, the figure of a round, digits, whether higher is better.
type Row<'a> = (&'a str, &'a dyn Fn(&Stats) -> f64, usize, bool);

fn main() {
    let args = parse_args();
    let load_start = loadavg();
    let began = Instant::now();
    let mut errors = 0usize;
    let mut sections = Vec::new();
    for &workers in &args.workers {
        let t = Instant::now();
        let w = workload::build(&args.trace, workers, args.trace_requests);
        let prompts = trace::query_tokens(&args.trace, args.trace_requests, &w);
        eprintln!(
            "[{workers} workers] workload: {} requests, {} stored events, {} (block, worker) \
             entries, {} query prompts of {} tokens ({:.1} s)",
            w.requests,
            w.stores.len(),
            w.blocks(),
            prompts.len(),
            prompts[0].len(),
            t.elapsed().as_secs_f64()
        );
        dynamo::check_hashing(&prompts, &w);

        let t = Instant::now();
        let k = kvr::Kvr::new(&w);
        eprintln!(
            "[{workers} workers] kvrouter loaded in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        let t = Instant::now();
        let d = dynamo::Dynamo::new(&w, args.dynamo_indexer_threads);
        eprintln!(
            "[{workers} workers] Dynamo SelectionCore loaded in {:.1} s ({} threads in the process)",
            t.elapsed().as_secs_f64(),
            thread_count()
        );

        let mut variants = vec![prompts.clone()];
        if args.short_tokens > 0 && args.short_tokens < prompts[0].len() {
            variants.push(
                prompts
                    .iter()
                    .map(|p| p[..args.short_tokens].to_vec())
                    .collect(),
            );
        }
        let mut results = Vec::new();
        for (v, prompts) in variants.iter().enumerate() {
            let tokens = prompts[0].len();
            let kd = decisions(&k, prompts, &format!("warm-k{v}"), &mut errors);
            let dd = decisions(&d, prompts, &format!("warm-d{v}"), &mut errors);
            let pairs = || kd.iter().zip(&dd).filter_map(|(a, b)| a.zip(*b));
            let same_worker = pairs().filter(|(a, b)| a.worker == b.worker).count();
            let same_cached = pairs()
                .filter(|(a, b)| a.cached_blocks == b.cached_blocks)
                .count();
            let mean = |x: &[Option<Decision>]| {
                x.iter()
                    .flatten()
                    .map(|d| d.cached_blocks as f64)
                    .sum::<f64>()
                    / x.len() as f64
            };
            eprintln!(
                "[{workers} workers, {tokens} tokens] warm-up: same worker {same_worker}/{n}, same \
                 cached blocks on the chosen worker {same_cached}/{n} (mean: kvrouter {:.1}, \
                 Dynamo {:.1} of {} blocks)",
                mean(&kd),
                mean(&dd),
                tokens / BLOCK_SIZE as usize,
                n = prompts.len()
            );
            let mut rounds = Vec::new();
            for round in 0..args.rounds {
                let start = round * 257 % prompts.len();
                let run_k = |errors: &mut usize| {
                    run_round(
                        &k,
                        prompts,
                        start,
                        args.iters,
                        &format!("k{v}-{round}"),
                        errors,
                    )
                    .stats()
                };
                let run_d = |errors: &mut usize| {
                    run_round(
                        &d,
                        prompts,
                        start,
                        args.iters,
                        &format!("d{v}-{round}"),
                        errors,
                    )
                    .stats()
                };
                let (ks, ds) = if round % 2 == 0 {
                    let ks = run_k(&mut errors);
                    (ks, run_d(&mut errors))
                } else {
                    let ds = run_d(&mut errors);
                    (run_k(&mut errors), ds)
                };
                for (s, name) in [(&ks, k.name()), (&ds, d.name())] {
                    eprintln!(
                        "[{workers} workers, {tokens} tokens, round {}/{}] {name:<8} p50 {:.2} µs \
                         (decide {:.2} + release {:.2}), p99 {:.2} µs, {:.0} decisions/s, own CPU \
                         {:.2}, other threads {:.3} cores (load {})",
                        round + 1,
                        args.rounds,
                        s.p50,
                        s.decide_p50,
                        s.release_p50,
                        s.p99,
                        s.per_s,
                        s.own_cpu,
                        s.others_cpu,
                        loadavg()
                    );
                }
                rounds.push((ks, ds));
            }
            results.push(Variant {
                label: format!(
                    "{tokens}-token prompts ({} blocks)",
                    tokens / BLOCK_SIZE as usize
                ),
                tokens,
                rounds,
                same_worker,
                same_cached,
                queries: prompts.len(),
                kvr_cached_mean: mean(&kd),
                dyn_cached_mean: mean(&dd),
            });
        }
        let counts = (w.requests, w.stores.len(), w.blocks());
        drop(d);
        drop(k);
        sections.push((workers, counts, results));
    }

    println!();
    println!(
        "Per request: kvrouter `Router::find_best_match(tokens, RequestOptions::admit(id))` then \
         `free_request(id)`; Dynamo `SelectionCore::select_and_reserve` (prompt as token ids) then \
         `free_reservation`, each `block_on` a tokio current_thread runtime; Dynamo's indexer \
         threads: {}. Every call timed on its own; decisions/s = requests / their summed time. \
         Medians over {} rounds of {} requests per router; kvrouter's advantage = the ratio of \
         the medians, > 1 when kvrouter is faster.",
        args.dynamo_indexer_threads, args.rounds, args.iters
    );
    for (workers, (requests, events, entries), results) in &sections {
        println!();
        println!(
            "**{workers} workers**: {requests} trace requests, {events} stored events, {entries} \
             cached (block, worker) entries, 1,024 query prompts cycled."
        );
        println!();
        println!("| prompt | measure | kvrouter | Dynamo SelectionCore | kvrouter's advantage |");
        println!("| --- | --- | ---: | ---: | ---: |");
        for v in results {
            let col = |f: &dyn Fn(&Stats) -> f64| {
                (
                    median(&mut v.rounds.iter().map(|(k, _)| f(k)).collect::<Vec<_>>()),
                    median(&mut v.rounds.iter().map(|(_, d)| f(d)).collect::<Vec<_>>()),
                )
            };
            let per_round = |f: &dyn Fn(&Stats) -> f64, digits: usize| {
                let k: Vec<String> = v
                    .rounds
                    .iter()
                    .map(|(k, _)| format!("{:.*}", digits, f(k)))
                    .collect();
                let d: Vec<String> = v
                    .rounds
                    .iter()
                    .map(|(_, d)| format!("{:.*}", digits, f(d)))
                    .collect();
                (k.join(" / "), d.join(" / "))
            };
            let rows: [Row; 5] = [
                ("decision + booking + release, p50 µs", &|s| s.p50, 2, false),
                ("decision + booking + release, p99 µs", &|s| s.p99, 2, false),
                ("decisions/s (1 caller)", &|s| s.per_s, 0, true),
                (
                    "of which decision + booking, p50 µs",
                    &|s| s.decide_p50,
                    2,
                    false,
                ),
                ("of which release, p50 µs", &|s| s.release_p50, 2, false),
            ];
            for (label, f, digits, higher_better) in rows {
                let (k, d) = col(f);
                let ratio = if higher_better { k / d } else { d / k };
                println!(
                    "| {} | {label} | {:.*} | {:.*} | **{ratio:.2}×** |",
                    v.label, digits, k, digits, d
                );
            }
            let (k, d) = per_round(&|s| s.p50, 2);
            println!("| {} | p50 per round, µs | {k} | {d} | |", v.label);
            let (k, d) = per_round(&|s| s.per_s, 0);
            println!("| {} | decisions/s per round | {k} | {d} | |", v.label);
            let (k, d) = per_round(&|s| s.others_cpu, 2);
            println!(
                "| {} | CPU of the process's other threads while timing, cores, per round | {k} | {d} | |",
                v.label
            );
            println!(
                "| {} | decisions agreeing, of {}: same worker / same cached blocks on it | {} / {} (both routers) | | |",
                v.label, v.queries, v.same_worker, v.same_cached
            );
            println!(
                "| {} | mean cached blocks on the chosen worker (of {}) | {:.1} | {:.1} | |",
                v.label,
                v.tokens / BLOCK_SIZE as usize,
                v.kvr_cached_mean,
                v.dyn_cached_mean
            );
        }
    }
    println!();
    println!(
        "Load average (1, 5, 15 min) at the start: {load_start}; at the end: {}; {:.0} s in all; \
         errors: {errors}.",
        loadavg(),
        began.elapsed().as_secs_f64()
    );
    if errors > 0 {
        eprintln!("{errors} calls failed");
        std::process::exit(1);
    }
}

fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(0)
}
