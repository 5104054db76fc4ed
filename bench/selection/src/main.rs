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
//!    order alternating from round to round), every call timed on its own;
//! 5. then, for each caller count C > 1 in `--callers`, `--rounds` rounds in which C threads
//!    call the one router concurrently (the same order alternating): each caller runs
//!    `--iters` requests of its own (its own request ids, its own start in the cycle of
//!    prompts), each freed right after its decision, every call timed on its own; a round's
//!    throughput is all its requests over its wall time, from the callers' common start (a
//!    barrier) to the last one's end. Dynamo's callers all `block_on` the core's one
//!    current_thread runtime, the one its tasks (the partition's scheduler queue actor) were
//!    spawned on: whichever caller holds the runtime's core runs them.
//!
//! Flags: `--trace PATH`, `--trace-requests N` (first N requests; 0 = all), `--workers LIST`,
//! `--rounds N` (default 5), `--iters N` (requests per router per round, default 4096),
//! `--short-tokens N` (default 1024; 0 = only the full prompts), `--dynamo-indexer-threads N`
//! (default 2: Dynamo's concurrent indexer, lookups inline on the caller's thread; 1 = its
//! single-threaded `KvIndexer`, lookups sent to the indexer's task), `--callers LIST` (default
//! 1: one caller only; e.g. `1,2,4` adds rounds of 2 and of 4 concurrent callers, and a table
//! of them).

#[path = "../../peers/src/sampling.rs"]
mod sampling;
#[allow(dead_code)]
#[path = "../../peers/src/workload.rs"]
mod workload;

mod dynamo;
mod kvr;
mod trace;

use std::sync::Barrier;
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
    callers: Vec<usize>,
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
        callers: vec![1],
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
            "--workers" => a.workers = list(&flag, &value),
            "--rounds" => a.rounds = number(),
            "--iters" => a.iters = number(),
            "--short-tokens" => a.short_tokens = number(),
            "--dynamo-indexer-threads" => a.dynamo_indexer_threads = number(),
            "--callers" => a.callers = list(&flag, &value),
            other => panic!("unknown flag {other}"),
        }
    }
    assert!(
        a.rounds > 0 && a.iters > 0,
        "--rounds and --iters must be > 0"
    );
    assert!(
        a.callers.iter().all(|&c| c > 0),
        "--callers: every count must be > 0"
    );
    a
}

/// A flag's comma-separated numbers.
fn list<T: std::str::FromStr>(flag: &str, value: &str) -> Vec<T> {
    value
        .split(',')
        .map(|x| {
            x.trim()
                .parse()
                .unwrap_or_else(|_| panic!("{flag}: bad number {x}"))
        })
        .collect()
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

/// One round of one router: per-call times in µs (of every caller) and what the calling
/// threads and the others used of the CPU meanwhile.
struct Round {
    total_us: Vec<f64>,
    decide_us: Vec<f64>,
    release_us: Vec<f64>,
    /// Wall time of the loop, s (C callers: from their common start to the last one's end).
    wall: f64,
    /// CPU time of the process's other threads during the loop / loop wall time.
    others_cpu: f64,
    /// CPU time of the calling threads / loop wall time (1 caller: 1 = never preempted).
    own_cpu: f64,
}

struct Stats {
    p50: f64,
    p99: f64,
    decide_p50: f64,
    release_p50: f64,
    /// Calls / (sum of the timed calls): the rate of one caller doing nothing else.
    per_s: f64,
    /// Calls / the loop's wall time (what each request takes outside the calls included: for
    /// Dynamo, making its request): the rate of all the callers together.
    wall_per_s: f64,
    /// The timed calls' summed time / the loop's wall time: how many callers were inside a
    /// call on average (at most the number of callers).
    in_calls: f64,
    others_cpu: f64,
    own_cpu: f64,
}

impl Round {
    fn with_capacity(calls: usize) -> Round {
        Round {
            total_us: Vec::with_capacity(calls),
            decide_us: Vec::with_capacity(calls),
            release_us: Vec::with_capacity(calls),
            wall: 0.0,
            others_cpu: 0.0,
            own_cpu: 0.0,
        }
    }

    fn stats(&self) -> Stats {
        let sum: f64 = self.total_us.iter().sum();
        Stats {
            p50: percentile(&mut self.total_us.clone(), 0.5),
            p99: percentile(&mut self.total_us.clone(), 0.99),
            decide_p50: percentile(&mut self.decide_us.clone(), 0.5),
            release_p50: percentile(&mut self.release_us.clone(), 0.5),
            per_s: self.total_us.len() as f64 / (sum * 1e-6),
            wall_per_s: self.total_us.len() as f64 / self.wall,
            in_calls: sum * 1e-6 / self.wall,
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

/// Request ids `{prefix}-{n}` for n < `iters` (made before the clock starts).
fn request_ids(prefix: &str, iters: usize) -> Vec<String> {
    (0..iters).map(|n| format!("{prefix}-{n}")).collect()
}

/// One request per id through `side`, cycling over `prompts` from `start`: each decided then
/// released at once, both calls timed into `r`.
fn time_calls<S: Side>(
    side: &S,
    prompts: &[Vec<u32>],
    start: usize,
    ids: &[String],
    r: &mut Round,
    errors: &mut usize,
) {
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
}

/// After a round every request has been released: a booked one is an error.
fn check_released<S: Side>(side: &S, errors: &mut usize) {
    let active = side.active();
    if active != 0 {
        eprintln!(
            "{}: {active} requests still booked after a round",
            side.name()
        );
        *errors += 1;
    }
}

/// What a round runs: `iters` requests per caller, cycling over `prompts` from `start`, with
/// `callers` threads calling at once.
#[derive(Clone, Copy)]
struct Plan<'a> {
    prompts: &'a [Vec<u32>],
    start: usize,
    iters: usize,
    callers: usize,
}

impl<'a> Plan<'a> {
    /// Round `round`'s: its start moves 257 prompts a round.
    fn new(prompts: &'a [Vec<u32>], round: usize, iters: usize, callers: usize) -> Plan<'a> {
        Plan {
            prompts,
            start: round * 257 % prompts.len(),
            iters,
            callers,
        }
    }

    fn run<S: Side + Sync>(self, side: &S, prefix: &str, errors: &mut usize) -> Stats {
        if self.callers == 1 {
            run_round(side, self.prompts, self.start, self.iters, prefix, errors).stats()
        } else {
            run_concurrent_round(side, self, prefix, errors).stats()
        }
    }
}

/// Both routers' round `round` of `plan` (request ids `k{tag}-…`, `d{tag}-…`): kvrouter first
/// in even rounds, Dynamo first in odd ones. Their stats, kvrouter's first.
fn both_rounds<K: Side + Sync, D: Side + Sync>(
    k: &K,
    d: &D,
    plan: Plan,
    round: usize,
    tag: &str,
    errors: &mut usize,
) -> (Stats, Stats) {
    let run_k = |errors: &mut usize| plan.run(k, &format!("k{tag}"), errors);
    let run_d = |errors: &mut usize| plan.run(d, &format!("d{tag}"), errors);
    if round % 2 == 0 {
        let ks = run_k(errors);
        (ks, run_d(errors))
    } else {
        let ds = run_d(errors);
        (run_k(errors), ds)
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
    let ids = request_ids(prefix, iters);
    let mut r = Round::with_capacity(iters);
    let wall = Instant::now();
    let proc0 = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID);
    let thread0 = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
    time_calls(side, prompts, start, &ids, &mut r, errors);
    let wall = wall.elapsed().as_secs_f64();
    let own = cpu_seconds(CLOCK_THREAD_CPUTIME_ID) - thread0;
    let all = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID) - proc0;
    check_released(side, errors);
    r.wall = wall;
    r.own_cpu = own / wall;
    r.others_cpu = (all - own).max(0.0) / wall;
    r
}

/// What one concurrent caller measured: its calls, when it started and ended (wall clock,
/// process CPU), the CPU its thread used and its failures.
struct Caller {
    round: Round,
    start: Instant,
    end: Instant,
    process_cpu: (f64, f64),
    own_cpu: f64,
    errors: usize,
}

/// `plan.callers` threads calling `side` at once, each `plan.iters` requests (ids
/// `{prefix}-t{thread}-{n}`, made before the common start) cycling over the prompts from its
/// own start, the callers' starts spread evenly over the cycle from `plan.start`. The round's
/// wall time runs from the earliest caller's start (right after the barrier) to the last
/// caller's end.
fn run_concurrent_round<S: Side + Sync>(
    side: &S,
    plan: Plan,
    prefix: &str,
    errors: &mut usize,
) -> Round {
    let Plan {
        prompts,
        start,
        iters,
        callers,
    } = plan;
    let barrier = Barrier::new(callers);
    let done: Vec<Caller> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..callers)
            .map(|t| {
                let barrier = &barrier;
                scope.spawn(move || {
                    let ids = request_ids(&format!("{prefix}-t{t}"), iters);
                    let first = start + t * prompts.len() / callers;
                    let mut round = Round::with_capacity(iters);
                    let mut errors = 0;
                    barrier.wait();
                    let begin = Instant::now();
                    let process0 = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID);
                    let thread0 = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
                    time_calls(side, prompts, first, &ids, &mut round, &mut errors);
                    let own_cpu = cpu_seconds(CLOCK_THREAD_CPUTIME_ID) - thread0;
                    let process1 = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID);
                    Caller {
                        round,
                        start: begin,
                        end: Instant::now(),
                        process_cpu: (process0, process1),
                        own_cpu,
                        errors,
                    }
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("a caller thread panicked"))
            .collect()
    });
    check_released(side, errors);
    let mut r = Round::with_capacity(iters * callers);
    let first = done.iter().map(|c| c.start).min().expect("callers > 0");
    let last = done.iter().map(|c| c.end).max().expect("callers > 0");
    r.wall = (last - first).as_secs_f64();
    let process0 = done
        .iter()
        .map(|c| c.process_cpu.0)
        .fold(f64::MAX, f64::min);
    let process1 = done.iter().map(|c| c.process_cpu.1).fold(0.0, f64::max);
    let own: f64 = done.iter().map(|c| c.own_cpu).sum();
    r.own_cpu = own / r.wall;
    r.others_cpu = (process1 - process0 - own).max(0.0) / r.wall;
    for c in done {
        *errors += c.errors;
        r.total_us.extend(c.round.total_us);
        r.decide_us.extend(c.round.decide_us);
        r.release_us.extend(c.round.release_us);
    }
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
    /// Per caller count above 1, the same for its concurrent rounds.
    concurrent: Vec<(usize, Vec<(Stats, Stats)>)>,
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
                let plan = Plan::new(prompts, round, args.iters, 1);
                let (ks, ds) =
                    both_rounds(&k, &d, plan, round, &format!("{v}-{round}"), &mut errors);
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
            let mut concurrent = Vec::new();
            for &callers in args.callers.iter().filter(|&&c| c > 1) {
                let mut by_round = Vec::new();
                for round in 0..args.rounds {
                    let plan = Plan::new(prompts, round, args.iters, callers);
                    let tag = format!("{v}-c{callers}-{round}");
                    let (ks, ds) = both_rounds(&k, &d, plan, round, &tag, &mut errors);
                    for (s, name) in [(&ks, k.name()), (&ds, d.name())] {
                        eprintln!(
                            "[{workers} workers, {tokens} tokens, {callers} callers, round {}/{}] \
                             {name:<8} {:.0} decisions/s, p50 {:.2} µs, p99 {:.2} µs, in calls \
                             {:.2} callers, callers' CPU {:.2} cores, other threads {:.3} cores \
                             (load {})",
                            round + 1,
                            args.rounds,
                            s.wall_per_s,
                            s.p50,
                            s.p99,
                            s.in_calls,
                            s.own_cpu,
                            s.others_cpu,
                            loadavg()
                        );
                    }
                    by_round.push((ks, ds));
                }
                concurrent.push((callers, by_round));
            }
            results.push(Variant {
                label: format!(
                    "{tokens}-token prompts ({} blocks)",
                    tokens / BLOCK_SIZE as usize
                ),
                tokens,
                rounds,
                concurrent,
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
    if args.callers.iter().any(|&c| c > 1) {
        println!();
        println!(
            "Concurrent callers: C threads share each side's one router, each caller running {} \
             requests a round of its own (its own request ids, its own start in the cycle of \
             prompts), each freed right after its decision (so at most C are booked at once), \
             all starting together at a barrier; kvrouter then Dynamo or the other way round, \
             alternating. kvrouter's callers call its `Router` (Send + Sync) directly; Dynamo's \
             all `block_on` the core's one current_thread runtime, the one its partition's tasks \
             (the scheduler queue actor among them) run on: whichever caller holds the \
             runtime's core runs them, so neither side adds a thread. decisions/s = all the \
             round's requests / its wall time, from the barrier to the last caller's end (what \
             a request takes outside the calls counts: for Dynamo, making its request, a copy of \
             the prompt); p50 and p99 over every caller's calls; scaling = decisions/s over the \
             same router's with 1 caller, counted the same way (requests / the loop's wall time \
             in the rounds above: the `1 caller` rows; the first table's decisions/s count only \
             the calls' time). Medians over {} rounds.",
            args.iters, args.rounds
        );
    }
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
            print_medians(&v.label, &v.rounds, &rows);
            let each = |measure, f: &dyn Fn(&Stats) -> f64, digits| {
                print_per_round(&v.label, measure, &v.rounds, f, digits)
            };
            each("p50 per round, µs", &|s| s.p50, 2);
            each("decisions/s per round", &|s| s.per_s, 0);
            each(
                "CPU of the process's other threads while timing, cores, per round",
                &|s| s.others_cpu,
                2,
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
        if results.iter().any(|v| !v.concurrent.is_empty()) {
            print_concurrent(*workers, results);
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

/// Kvrouter's and Dynamo's medians of a figure over the rounds.
fn medians(rounds: &[(Stats, Stats)], f: &dyn Fn(&Stats) -> f64) -> (f64, f64) {
    (
        median(&mut rounds.iter().map(|(k, _)| f(k)).collect::<Vec<_>>()),
        median(&mut rounds.iter().map(|(_, d)| f(d)).collect::<Vec<_>>()),
    )
}

/// Table rows of medians: `| label | measure | kvrouter | Dynamo | kvrouter's advantage |`,
/// the advantage the ratio of the medians, > 1 when kvrouter is better.
fn print_medians(label: &str, rounds: &[(Stats, Stats)], rows: &[Row]) {
    for &(measure, f, digits, higher_better) in rows {
        let (k, d) = medians(rounds, f);
        let ratio = if higher_better { k / d } else { d / k };
        println!("| {label} | {measure} | {k:.digits$} | {d:.digits$} | **{ratio:.2}×** |");
    }
}

/// A table row of a figure in every round, kvrouter's and Dynamo's joined with " / ".
fn print_per_round(
    label: &str,
    measure: &str,
    rounds: &[(Stats, Stats)],
    f: &dyn Fn(&Stats) -> f64,
    digits: usize,
) {
    let each = |x: &dyn Fn(&(Stats, Stats)) -> &Stats| {
        let v: Vec<String> = rounds
            .iter()
            .map(|r| format!("{:.*}", digits, f(x(r))))
            .collect();
        v.join(" / ")
    };
    let (k, d) = (each(&|r| &r.0), each(&|r| &r.1));
    println!("| {label} | {measure} | {k} | {d} | |");
}

/// The table of a worker count's concurrent rounds: per prompt length and caller count.
fn print_concurrent(workers: u32, results: &[Variant]) {
    println!();
    println!("**{workers} workers, concurrent callers** (the same workload).");
    println!();
    println!("| prompt | measure | kvrouter | Dynamo SelectionCore | kvrouter's advantage |");
    println!("| --- | --- | ---: | ---: | ---: |");
    let throughput: Row = (
        "decisions/s, all callers (requests / wall time)",
        &|s| s.wall_per_s,
        0,
        true,
    );
    for v in results {
        // The base of the scaling: the one-caller rounds, counted by wall time as here.
        print_medians(&format!("{}, 1 caller", v.label), &v.rounds, &[throughput]);
        let (k1, d1) = medians(&v.rounds, &|s| s.wall_per_s);
        for (callers, rounds) in &v.concurrent {
            let label = format!("{}, {callers} callers", v.label);
            let rows: [Row; 3] = [
                throughput,
                ("decision + booking + release, p50 µs", &|s| s.p50, 2, false),
                ("decision + booking + release, p99 µs", &|s| s.p99, 2, false),
            ];
            print_medians(&label, rounds, &rows);
            let (k, d) = medians(rounds, &|s| s.wall_per_s);
            println!(
                "| {label} | scaling: decisions/s ÷ 1 caller's (requests / wall time both) | \
                 {:.2}× | {:.2}× | |",
                k / k1,
                d / d1
            );
            let (k, d) = medians(rounds, &|s| s.in_calls);
            println!(
                "| {label} | callers inside a timed call, on average (of {callers}) | {k:.2} | \
                 {d:.2} | |"
            );
            let each = |measure, f: &dyn Fn(&Stats) -> f64, digits| {
                print_per_round(&label, measure, rounds, f, digits)
            };
            each("decisions/s per round", &|s| s.wall_per_s, 0);
            each(
                "CPU of the calling threads while timing, cores, per round",
                &|s| s.own_cpu,
                2,
            );
            each(
                "CPU of the process's other threads while timing, cores, per round",
                &|s| s.others_cpu,
                2,
            );
        }
    }
}

fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(0)
}
