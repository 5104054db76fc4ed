//! kvrouter's index side by side with Dynamo's indexers (the published `dynamo-kv-router`
//! crate, 1.6.1, used as a dependency: none of its code is copied here), on the events and
//! queries of bench/index_bench.cc (see `workload.rs`).
//!
//! ```sh
//! scripts/bench-peers.sh            # builds, then the table (below)
//! scripts/bench-peers.sh --check    # builds, then only the differential check
//! ```
//!
//! The binary (`build/peers-target/release/kvrouter-peers-bench`):
//!
//! * default: the table. For each worker count (`--workers 64,1000`), `--rounds` rounds; in
//!   each round, for 1 then 2 threads, one run of kvrouter and one of each Dynamo indexer
//!   (RadixTree at 1 thread only), alternating which goes first from round to round, each
//!   run a fresh process (this binary re-executed with `--run`, see `measure.rs`). Prints a
//!   markdown table of medians and of kvrouter's advantage (the ratio of the medians, > 1
//!   meaning kvrouter is faster or smaller).
//! * `--check N`: the differential check (`check.rs`) on N queries per phase, for each worker
//!   count; exits 1 on any difference. `--probes` also prints where the rules differ.
//! * `--run INDEXER --threads T`: one measured run (kvrouter, radix or crtc); prints
//!   `RESULT {json}`.
//!
//! Other flags: `--trace PATH` (default data/mooncake/conversation_trace.jsonl),
//! `--trace-requests N` (first N requests only; 0 = all), `--iters N` (find_matches calls per
//! thread, default 20000), `--apply-iters N` (continuation store/remove rounds, default 40),
//! `--kvr-index-shards N` (kvrouter's `index_shards` router option; default: the library's;
//! `threads`: as many trees as the run has threads, each event thread applying one tree's
//! workers, as a gateway applying events from several threads would set it).

mod check;
mod drivers;
mod measure;
mod sampling;
mod workload;

use std::process::Command;

use measure::{Kind, RunArgs};
use sampling::{loadavg, median};
use serde_json::Value;

struct Args {
    trace: String,
    trace_requests: usize,
    workers: Vec<u32>,
    rounds: usize,
    iters: usize,
    apply_iters: usize,
    check: Option<usize>,
    probes: bool,
    run: Option<Kind>,
    threads: Vec<usize>,
    index_shards: Option<u32>,
}

fn parse_args() -> Args {
    let mut a = Args {
        trace: workload::default_trace_path(),
        trace_requests: 0,
        workers: vec![64, 1000],
        rounds: 5,
        iters: 20_000,
        apply_iters: 40,
        check: None,
        probes: false,
        run: None,
        threads: vec![1, 2],
        index_shards: None,
    };
    let list = |v: &str| -> Vec<usize> {
        v.split(',')
            .map(|x| {
                x.trim()
                    .parse()
                    .unwrap_or_else(|_| panic!("bad number {x}"))
            })
            .collect()
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--probes" {
            a.probes = true;
            continue;
        }
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        let number = || {
            value
                .parse::<usize>()
                .unwrap_or_else(|_| panic!("{flag}: bad number {value}"))
        };
        match flag.as_str() {
            "--trace" => a.trace = value.clone(),
            "--trace-requests" => a.trace_requests = number(),
            "--workers" => a.workers = list(&value).into_iter().map(|w| w as u32).collect(),
            "--rounds" => a.rounds = number(),
            "--iters" => a.iters = number(),
            "--apply-iters" => a.apply_iters = number(),
            "--check" => a.check = Some(number()),
            "--run" => a.run = Some(Kind::parse(&value)),
            "--threads" => a.threads = list(&value),
            // 0 stands for "as many as threads" in the table's runs.
            "--kvr-index-shards" if value == "threads" => a.index_shards = Some(0),
            "--kvr-index-shards" => a.index_shards = Some(number() as u32),
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

fn main() {
    let args = parse_args();
    if let Some(kind) = args.run {
        let w = workload::build(&args.trace, args.workers[0], args.trace_requests);
        let result = measure::run(
            &w,
            &RunArgs {
                kind,
                threads: args.threads[0],
                index_shards: args.index_shards,
                iters: args.iters,
                apply_iters: args.apply_iters,
            },
        );
        println!("RESULT {result}");
        return;
    }
    if let Some(n) = args.check {
        let mut mismatches = 0;
        for &workers in &args.workers {
            let w = workload::build(&args.trace, workers, args.trace_requests);
            mismatches += check::check(&w, n);
        }
        if args.probes {
            check::probes();
        }
        if mismatches > 0 {
            eprintln!("check FAILED: {mismatches} mismatches");
            std::process::exit(1);
        }
        eprintln!("check passed");
        return;
    }
    table(&args);
}

/// One child run.
fn child(args: &Args, kind: Kind, workers: u32, threads: usize) -> Value {
    let exe = std::env::current_exe().expect("current_exe");
    let out = Command::new(exe)
        .args(["--run", kind.name()])
        .args(["--workers", &workers.to_string()])
        .args(["--threads", &threads.to_string()])
        .args(["--trace", &args.trace])
        .args(["--trace-requests", &args.trace_requests.to_string()])
        .args(["--iters", &args.iters.to_string()])
        .args(["--apply-iters", &args.apply_iters.to_string()])
        .args(
            args.index_shards
                .map(|n| {
                    let n = if n == 0 { threads as u32 } else { n };
                    vec!["--kvr-index-shards".to_string(), n.to_string()]
                })
                .unwrap_or_default(),
        )
        .output()
        .expect("spawn a run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        eprintln!("{}", String::from_utf8_lossy(&out.stderr));
        panic!(
            "run {} workers={workers} threads={threads} failed",
            kind.name()
        );
    }
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .expect("no RESULT line");
    serde_json::from_str(line).expect("bad RESULT json")
}

fn table(args: &Args) {
    let load_start = loadavg();
    let began = std::time::Instant::now();
    // results[(workers, kind, threads)] = one Value per round
    let mut results: std::collections::BTreeMap<(u32, &'static str, usize), Vec<Value>> =
        Default::default();
    for &workers in &args.workers {
        for round in 0..args.rounds {
            for &threads in &args.threads {
                let mut kinds = vec![Kind::Kvr, Kind::Crtc];
                if threads == 1 {
                    kinds.push(Kind::Radix);
                }
                if round % 2 == 1 {
                    kinds.reverse();
                }
                for kind in kinds {
                    let v = child(args, kind, workers, threads);
                    eprintln!(
                        "[{workers} workers, round {}/{}, {threads} thread(s)] {:<8} load {:.2} M blocks/s, \
                         find p50 {:.2} us p99 {:.2} us, {:.0} lookups/s, stores {:.2} M/s, removals {:.2} M/s, \
                         {:.1} B/entry, CPU share {:.2} (load {})",
                        round + 1,
                        args.rounds,
                        kind.name(),
                        v["load_blocks_per_s"].as_f64().unwrap() / 1e6,
                        v["find_p50_us"].as_f64().unwrap(),
                        v["find_p99_us"].as_f64().unwrap(),
                        v["lookups_per_s"].as_f64().unwrap(),
                        v["store_blocks_per_s"].as_f64().unwrap() / 1e6,
                        v["remove_blocks_per_s"].as_f64().unwrap() / 1e6,
                        v["rss_bytes_per_entry"].as_f64().unwrap(),
                        v["find_cpu_share"].as_f64().unwrap(),
                        loadavg(),
                    );
                    results
                        .entry((workers, kind.name(), threads))
                        .or_default()
                        .push(v);
                }
            }
        }
    }
    print_table(args, &results);
    println!();
    println!(
        "Load average (1, 5, 15 min) at the start: {load_start}; at the end: {}; {:.0} s in all.",
        loadavg(),
        began.elapsed().as_secs_f64()
    );
}

type Results = std::collections::BTreeMap<(u32, &'static str, usize), Vec<Value>>;

fn values(r: &Results, workers: u32, kind: &str, threads: usize, field: &str) -> Vec<f64> {
    r.get(&(workers, kind_static(kind), threads))
        .map(|v| v.iter().filter_map(|x| x[field].as_f64()).collect())
        .unwrap_or_default()
}

fn kind_static(kind: &str) -> &'static str {
    Kind::parse(kind).name()
}

fn med(mut v: Vec<f64>) -> Option<f64> {
    (!v.is_empty()).then(|| median(&mut v))
}

/// kvrouter's advantage over `peer`: the ratio of the two medians, oriented so that > 1 means
/// kvrouter is better (faster, or smaller for `higher_better = false` fields).
fn advantage(
    r: &Results,
    workers: u32,
    peer: &str,
    threads: usize,
    field: &str,
    higher_better: bool,
) -> Option<f64> {
    let k = med(values(r, workers, "kvrouter", threads, field))?;
    let p = med(values(r, workers, peer, threads, field))?;
    Some(if higher_better { k / p } else { p / k })
}

fn fmt(v: Option<f64>, scale: f64, digits: usize) -> String {
    v.map_or("n/a".to_string(), |x| format!("{:.*}", digits, x / scale))
}

fn fmt_ratio(v: Option<f64>) -> String {
    v.map_or("n/a".to_string(), |x| format!("**{x:.2}×**"))
}

fn print_table(args: &Args, r: &Results) {
    struct Row {
        label: &'static str,
        field: &'static str,
        scale: f64,
        digits: usize,
        higher_better: bool,
        threads: &'static [usize],
        /// Whether kvrouter's advantage means anything for this row.
        ratio: bool,
    }
    let rows = [
        Row {
            label: "trace load: applying the stored events, M blocks/s (growing index)",
            field: "load_blocks_per_s",
            scale: 1e6,
            digits: 2,
            higher_better: true,
            threads: &[1, 2],
            ratio: true,
        },
        Row {
            label: "trace load: stored events applied, k events/s",
            field: "load_events_per_s",
            scale: 1e3,
            digits: 2,
            higher_better: true,
            threads: &[1, 2],
            ratio: true,
        },
        Row {
            label: "continuation stores (1,024 × 32 blocks), M blocks/s",
            field: "store_blocks_per_s",
            scale: 1e6,
            digits: 2,
            higher_better: true,
            threads: &[1, 2],
            ratio: true,
        },
        Row {
            label: "continuation removals, M blocks/s",
            field: "remove_blocks_per_s",
            scale: 1e6,
            digits: 2,
            higher_better: true,
            threads: &[1, 2],
            ratio: true,
        },
        Row {
            label: "find_matches p50, µs (8,192-token prompt: 512 blocks)",
            field: "find_p50_us",
            scale: 1.0,
            digits: 2,
            higher_better: false,
            threads: &[1, 2],
            ratio: true,
        },
        Row {
            label: "find_matches p99, µs",
            field: "find_p99_us",
            scale: 1.0,
            digits: 2,
            higher_better: false,
            threads: &[1, 2],
            ratio: true,
        },
        Row {
            label: "find_matches, k lookups/s (all threads)",
            field: "lookups_per_s",
            scale: 1e3,
            digits: 1,
            higher_better: true,
            threads: &[1, 2],
            ratio: true,
        },
        Row {
            label: "CPU share while looking up (process CPU time / (threads × wall); 1 = never preempted)",
            field: "find_cpu_share",
            scale: 1.0,
            digits: 2,
            higher_better: true,
            threads: &[1, 2],
            ratio: false,
        },
        Row {
            label: "memory: RSS growth per cached (block, worker), B",
            field: "rss_bytes_per_entry",
            scale: 1.0,
            digits: 1,
            higher_better: false,
            threads: &[1],
            ratio: true,
        },
        Row {
            label: "memory without `malloc_trim`: RSS growth per cached (block, worker), B",
            field: "untrimmed_rss_bytes_per_entry",
            scale: 1.0,
            digits: 1,
            higher_better: false,
            threads: &[1],
            ratio: true,
        },
    ];
    for &workers in &args.workers {
        let first = r
            .get(&(workers, "kvrouter", 1))
            .and_then(|v| v.first())
            .cloned()
            .unwrap_or(Value::Null);
        println!();
        println!(
            "**{workers} workers**: {} trace requests, {} stored events, {} cached (block, worker) \
             entries, {} queries (ranks matched per query: {:.0}); medians of {} runs per cell{}.",
            first["requests"], first["events"], first["entries"], first["queries"],
            first["ranks_matched_mean"].as_f64().unwrap_or(0.0), args.rounds,
            args.index_shards.map_or(String::new(), |n| match n {
                0 => "; kvrouter with index_shards = its thread count (a tree per event thread)"
                    .to_string(),
                n => format!("; kvrouter with index_shards = {n}"),
            })
        );
        println!();
        println!("| measure | threads | kvrouter | RadixTree | kvrouter vs RadixTree | CRTC | kvrouter vs CRTC |");
        println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
        for row in &rows {
            for &t in row.threads {
                if !args.threads.contains(&t) {
                    continue;
                }
                let cell = |kind: &str| {
                    fmt(
                        med(values(r, workers, kind, t, row.field)),
                        row.scale,
                        row.digits,
                    )
                };
                let radix = if t == 1 {
                    cell("radix")
                } else {
                    "—".to_string()
                };
                let adv = |peer: &str| {
                    if row.ratio {
                        fmt_ratio(advantage(r, workers, peer, t, row.field, row.higher_better))
                    } else {
                        String::new()
                    }
                };
                let radix_adv = if t == 1 {
                    adv("radix")
                } else {
                    "—".to_string()
                };
                println!(
                    "| {} | {t} | {} | {radix} | {radix_adv} | {} | {} |",
                    row.label,
                    cell("kvrouter"),
                    cell("crtc"),
                    adv("crtc"),
                );
            }
        }
        // Exact figure and the safe-layer path, kvrouter only.
        println!(
            "| kvrouter's own count: allocated bytes per entry (`index_bytes`) | 1 | {} | | | | |",
            fmt(
                med(values(r, workers, "kvrouter", 1, "exact_bytes_per_entry")),
                1.0,
                1
            )
        );
        println!(
            "| find through the safe `Router::find_matches`, p50 µs | 1 | {} | | | | |",
            fmt(
                med(values(r, workers, "kvrouter", 1, "safe_find_p50_us")),
                1.0,
                2
            )
        );
        println!(
            "| find with the cost model's figures (`kvr_router_overlap_scores_hashed`), p50 µs | 1 | {} | | | | |",
            fmt(
                med(values(r, workers, "kvrouter", 1, "overlap_find_p50_us")),
                1.0,
                2
            )
        );
        // Scaling 1 -> 2 threads.
        if args.threads.contains(&1) && args.threads.contains(&2) {
            for (label, field) in [
                ("scaling 1 → 2 threads: lookups/s", "lookups_per_s"),
                ("scaling 1 → 2 threads: trace load", "load_blocks_per_s"),
                (
                    "scaling 1 → 2 threads: continuation stores",
                    "store_blocks_per_s",
                ),
                (
                    "scaling 1 → 2 threads: continuation removals",
                    "remove_blocks_per_s",
                ),
            ] {
                let scale = |kind: &str| {
                    let one = med(values(r, workers, kind, 1, field));
                    let two = med(values(r, workers, kind, 2, field));
                    one.zip(two)
                        .map(|(a, b)| format!("{:.2}×", b / a))
                        .unwrap_or("n/a".into())
                };
                println!(
                    "| {label} | 1 → 2 | {} | — | | {} | |",
                    scale("kvrouter"),
                    scale("crtc")
                );
            }
        }
    }
}
