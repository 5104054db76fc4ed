//! `--check N`: the differential test. kvrouter, Dynamo's RadixTree and its
//! ConcurrentRadixTreeCompressed (2 event threads, through its worker loop) get the same events
//! in the same process; N queries per phase compare every (worker, dp_rank)'s overlap depth.
//! Any difference fails the run (exit status 1) after printing the first few.
//!
//! The phases stay where the two semantics agree: every worker's cached blocks remain
//! prefix-closed (a worker holds every ancestor of every block it holds), which an engine's
//! stores and its tail-first (LRU leaf) evictions preserve:
//!   A. the trace load (stored events as index_bench.cc's), then N of the 1,024 queries;
//!      every event must be applied by all three and every index must hold the same number
//!      of (block, rank) entries, per rank too;
//!   B. the 1,024 continuation runs stored; N continued prompts (512 + 32 blocks);
//!   C. the runs removed again; the same N prompts; sizes back to A's;
//!   D. tail evictions: for each of the N queries whose request's last block is a leaf on its
//!      worker (no other block of that worker continues it), the worker evicts up to 48
//!      blocks from the end of that request's prompt, leaf first, stopping at a block another
//!      of its blocks continues; then the N requests' whole prompts are compared;
//!   E. a second dp rank: each of the N queries' prompts stored (no parent) on rank 1 of the
//!      next worker (workers are registered with 2 ranks); the N queries again.
//! Then `probes`: small cases where the rules differ, printed, never failing the run.

use rustc_hash::{FxHashMap, FxHashSet};

use crate::drivers::{cleared_event, removed_event, stored_event, Crtc, Depths, Kvr, Radix};
use crate::workload::{Workload, QUERY_BLOCKS};
use kvrouter::sys;

const EVICT_BLOCKS: usize = 48;
const SHOW: usize = 5;

struct Trio {
    kvr: Kvr,
    radix: Radix,
    crtc: Crtc,
    next_id: u64,
}

#[derive(Default)]
struct Tally {
    compared: usize,
    mismatches: usize,
    shown: usize,
}

impl Tally {
    fn fail(&mut self, what: String) {
        self.mismatches += 1;
        if self.shown < SHOW {
            self.shown += 1;
            eprintln!("MISMATCH {what}");
        }
    }
}

fn show(d: &Depths) -> String {
    if d.is_empty() {
        return "none".into();
    }
    let mut s: Vec<String> = d
        .iter()
        .take(8)
        .map(|((w, r), n)| format!("({w},{r}):{n}"))
        .collect();
    if d.len() > 8 {
        s.push(format!("... {} ranks", d.len()));
    }
    s.join(" ")
}

/// The first difference between two depth maps, as text.
fn first_difference(a: &Depths, b: &Depths) -> Option<String> {
    let keys: std::collections::BTreeSet<_> = a.keys().chain(b.keys()).collect();
    for k in keys {
        let (x, y) = (a.get(k), b.get(k));
        if x != y {
            return Some(format!("rank ({},{}): {:?} vs {:?}", k.0, k.1, x, y));
        }
    }
    None
}

impl Trio {
    fn new(workers: u32, crtc_threads: usize) -> Trio {
        Trio {
            kvr: Kvr::new(workers, 2, None),
            radix: Radix::new(),
            crtc: Crtc::new(crtc_threads),
            next_id: 0,
        }
    }

    /// Stores on all three; returns (kvr status, radix ok, crtc ack receiver).
    fn store(
        &mut self,
        worker: u64,
        rank: u32,
        parent: Option<u64>,
        local: &[u64],
        engine: &[u64],
    ) -> (sys::kvr_status, bool, tokio::sync::oneshot::Receiver<bool>) {
        let id = self.next_id;
        self.next_id += 1;
        let k = self.kvr.store(worker, rank, parent, local, engine);
        let r = self
            .radix
            .tree
            .apply_event(stored_event(worker, rank, id, parent, local, engine))
            .is_ok();
        let c = self
            .crtc
            .send_with_ack(stored_event(worker, rank, id, parent, local, engine));
        (k, r, c)
    }

    fn remove(
        &mut self,
        worker: u64,
        engine: &[u64],
    ) -> (sys::kvr_status, bool, tokio::sync::oneshot::Receiver<bool>) {
        let id = self.next_id;
        self.next_id += 1;
        let k = self.kvr.remove(worker, 0, engine);
        let r = self
            .radix
            .tree
            .apply_event(removed_event(worker, 0, id, engine))
            .is_ok();
        let c = self
            .crtc
            .send_with_ack(removed_event(worker, 0, id, engine));
        (k, r, c)
    }

    /// Compares the three on one prompt.
    fn compare(&self, tally: &mut Tally, phase: &str, label: &str, prompt: &[u64]) {
        let k = self.kvr.depths(prompt);
        let r = self.radix.depths(prompt);
        let c = self.crtc.depths(prompt);
        tally.compared += 1;
        if let Some(d) = first_difference(&k, &r) {
            tally.fail(format!(
                "[{phase}] {label}: kvrouter vs RadixTree: {d}\n  kvrouter:  {}\n  RadixTree: {}",
                show(&k),
                show(&r)
            ));
        } else if let Some(d) = first_difference(&k, &c) {
            tally.fail(format!(
                "[{phase}] {label}: kvrouter vs CRTC: {d}\n  kvrouter: {}\n  CRTC:     {}",
                show(&k),
                show(&c)
            ));
        }
    }

    /// Total entries, and per-rank sizes of kvrouter (ranks matching `probe`) against CRTC's.
    fn compare_sizes(&self, tally: &mut Tally, phase: &str, expected: usize, probe: &[u64]) {
        let kvr_total = self.kvr.index_stats().0 as usize;
        let radix_total = self.radix.tree.current_size();
        let crtc_sizes = self.crtc.tree_sizes();
        let crtc_total: usize = crtc_sizes.values().sum();
        tally.compared += 1;
        if kvr_total != expected || radix_total != expected || crtc_total != expected {
            tally.fail(format!(
                "[{phase}] (block, rank) entries: expected {expected}, kvrouter {kvr_total}, \
                 RadixTree {radix_total}, CRTC {crtc_total}"
            ));
        }
        for (rank, size) in self.kvr.tree_sizes(probe) {
            let theirs = crtc_sizes.get(&rank).copied().unwrap_or(0);
            if size as usize != theirs {
                tally.fail(format!(
                    "[{phase}] rank ({},{}) holds {size} blocks in kvrouter, {theirs} in CRTC",
                    rank.0, rank.1
                ));
                break;
            }
        }
    }
}

/// Waits for CRTC's acknowledgements; counts events each indexer refused.
fn settle(
    tally: &mut Tally,
    phase: &str,
    outcomes: Vec<(sys::kvr_status, bool, tokio::sync::oneshot::Receiver<bool>)>,
) {
    let mut refused = [0usize; 3];
    for (k, r, c) in outcomes {
        refused[0] += (k != sys::KVR_OK) as usize;
        refused[1] += (!r) as usize;
        refused[2] += (!c.blocking_recv().unwrap_or(false)) as usize;
    }
    tally.compared += 1;
    if refused != [0, 0, 0] {
        tally.fail(format!(
            "[{phase}] events refused: kvrouter {}, RadixTree {}, CRTC {}",
            refused[0], refused[1], refused[2]
        ));
    }
}

/// Runs the check for one workload; returns the number of mismatches.
pub fn check(w: &Workload, n: usize) -> usize {
    let n = n.min(w.queries.len());
    let mut tally = Tally::default();
    let mut t = Trio::new(w.workers, 2);
    let started = std::time::Instant::now();

    // A. Trace load.
    let outcomes: Vec<_> = w
        .stores
        .iter()
        .map(|s| t.store(s.worker as u64, 0, s.parent, w.local_of(s), w.engine_of(s)))
        .collect();
    settle(&mut tally, "A load", outcomes);
    t.crtc.flush();
    t.compare_sizes(&mut tally, "A load", w.blocks(), &w.queries[0]);
    for q in 0..n {
        t.compare(&mut tally, "A load", &format!("query {q}"), &w.queries[q]);
    }

    // B. Continuations stored.
    let outcomes: Vec<_> = w
        .runs
        .iter()
        .map(|r| t.store(r.worker as u64, 0, Some(r.parent), &r.local, &r.engine))
        .collect();
    settle(&mut tally, "B runs stored", outcomes);
    let run_blocks: usize = w.runs.iter().map(|r| r.local.len()).sum();
    t.compare_sizes(
        &mut tally,
        "B runs stored",
        w.blocks() + run_blocks,
        &w.queries[0],
    );
    for run in w.runs.iter().take(n) {
        t.compare(
            &mut tally,
            "B runs stored",
            &format!("query {} + run", run.query),
            &w.run_prompt(run),
        );
    }

    // C. Continuations removed.
    let outcomes: Vec<_> = w
        .runs
        .iter()
        .map(|r| t.remove(r.worker as u64, &r.engine))
        .collect();
    settle(&mut tally, "C runs removed", outcomes);
    t.compare_sizes(&mut tally, "C runs removed", w.blocks(), &w.queries[0]);
    for run in w.runs.iter().take(n) {
        t.compare(
            &mut tally,
            "C runs removed",
            &format!("query {} + run", run.query),
            &w.run_prompt(run),
        );
    }

    // D. Tail evictions: each query's request, from its last block (when no other block of its
    // worker continues it) towards its start, leaf first.
    let workers: FxHashSet<u32> = w.query_worker[..n].iter().copied().collect();
    // Per worker: held block -> how many held blocks continue it.
    let mut children: FxHashMap<u32, FxHashMap<u64, u32>> = FxHashMap::default();
    for s in w.stores.iter().filter(|s| workers.contains(&s.worker)) {
        let map = children.entry(s.worker).or_default();
        let mut parent = s.parent;
        for &e in w.engine_of(s) {
            map.entry(e).or_insert(0);
            if let Some(p) = parent {
                *map.entry(p).or_insert(0) += 1;
            }
            parent = Some(e);
        }
    }
    let mut evicted = 0usize;
    let mut evicting_queries = 0usize;
    let mut outcomes = Vec::new();
    for q in 0..n {
        let worker = w.query_worker[q];
        let chain = &w.query_request_engine[q];
        let map = children.get_mut(&worker).unwrap();
        let mut victims = Vec::new();
        let mut i = chain.len();
        while i > 0 && victims.len() < EVICT_BLOCKS {
            let h = chain[i - 1];
            if map.get(&h) != Some(&0) {
                break; // continued by another held block, or already evicted
            }
            map.remove(&h);
            if i >= 2 {
                if let Some(c) = map.get_mut(&chain[i - 2]) {
                    *c -= 1;
                }
            }
            victims.push(h);
            i -= 1;
        }
        if !victims.is_empty() {
            evicted += victims.len();
            evicting_queries += 1;
            outcomes.push(t.remove(worker as u64, &victims));
        }
    }
    settle(&mut tally, "D tail evictions", outcomes);
    t.compare_sizes(
        &mut tally,
        "D tail evictions",
        w.blocks() - evicted,
        &w.queries[0],
    );
    for q in 0..n {
        t.compare(
            &mut tally,
            "D tail evictions",
            &format!("request of query {q}"),
            &w.query_request_local[q],
        );
    }

    // E. A second dp rank: query q's 512-block prompt stored (no parent) on rank 1 of the
    // next worker; then the N queries again, where ranks 0 and 1 of a worker now differ.
    let mut rank1: FxHashSet<(u32, u64)> = FxHashSet::default();
    let outcomes: Vec<_> = (0..n)
        .map(|q| {
            let worker = (w.query_worker[q] + 1) % w.workers;
            let engine = &w.query_request_engine[q][..QUERY_BLOCKS];
            rank1.extend(engine.iter().map(|&e| (worker, e)));
            t.store(worker as u64, 1, None, &w.queries[q], engine)
        })
        .collect();
    settle(&mut tally, "E dp rank 1", outcomes);
    let expected = w.blocks() - evicted + rank1.len();
    t.compare_sizes(&mut tally, "E dp rank 1", expected, &w.queries[0]);
    for q in 0..n {
        t.compare(
            &mut tally,
            "E dp rank 1",
            &format!("query {q}"),
            &w.queries[q],
        );
    }

    eprintln!(
        "check: {} workers, {} requests, {} stored events ({} blocks), {} runs, {} blocks \
         evicted from {} requests' tails; {} comparisons, {} mismatches ({:.1} s)",
        w.workers,
        w.requests,
        w.stores.len(),
        w.blocks(),
        w.runs.len(),
        evicted,
        evicting_queries,
        tally.compared,
        tally.mismatches,
        started.elapsed().as_secs_f64()
    );
    tally.mismatches
}

// ---------------------------------------------------------------------------------------------
// Probes: where the rules differ (reported, not failed).

/// Distinct fake hashes: local = 1000 + i, engine = 9000 + i per "block i".
fn blocks(ids: &[u64]) -> (Vec<u64>, Vec<u64>) {
    (
        ids.iter().map(|i| 1000 + i).collect(),
        ids.iter().map(|i| 9000 + i).collect(),
    )
}

struct Probe {
    kvr: Kvr,
    radix: Radix,
    crtc: Crtc,
    id: u64,
}

impl Probe {
    fn new() -> Probe {
        Probe {
            kvr: Kvr::new(8, 2, None),
            radix: Radix::new(),
            crtc: Crtc::new(1),
            id: 0,
        }
    }

    /// Returns the three outcomes as text.
    fn store(&mut self, worker: u64, rank: u32, parent: Option<u64>, ids: &[u64]) -> [String; 3] {
        let (l, e) = blocks(ids);
        self.id += 1;
        let k = self
            .kvr
            .store(worker, rank, parent.map(|p| 9000 + p), &l, &e);
        let r = self.radix.tree.apply_event(stored_event(
            worker,
            rank,
            self.id,
            parent.map(|p| 9000 + p),
            &l,
            &e,
        ));
        let c = self.crtc.send_with_ack(stored_event(
            worker,
            rank,
            self.id,
            parent.map(|p| 9000 + p),
            &l,
            &e,
        ));
        [status(k), result(r), ack(c)]
    }

    fn remove(&mut self, worker: u64, rank: u32, ids: &[u64]) -> [String; 3] {
        let (_, e) = blocks(ids);
        self.id += 1;
        let k = self.kvr.remove(worker, rank, &e);
        let r = self
            .radix
            .tree
            .apply_event(removed_event(worker, rank, self.id, &e));
        let c = self
            .crtc
            .send_with_ack(removed_event(worker, rank, self.id, &e));
        [status(k), result(r), ack(c)]
    }

    fn clear(&mut self, worker: u64, rank: u32) -> [String; 3] {
        self.id += 1;
        let k = self.kvr.clear(worker, rank);
        let r = self
            .radix
            .tree
            .apply_event(cleared_event(worker, rank, self.id));
        let c = self
            .crtc
            .send_with_ack(cleared_event(worker, rank, self.id));
        [status(k), result(r), ack(c)]
    }

    fn depths(&self, ids: &[u64]) -> [String; 3] {
        let (l, _) = blocks(ids);
        self.crtc.flush();
        [
            show(&self.kvr.depths(&l)),
            show(&self.radix.depths(&l)),
            show(&self.crtc.depths(&l)),
        ]
    }

    fn sizes(&self) -> [String; 3] {
        self.crtc.flush();
        [
            self.kvr.index_stats().0.to_string(),
            self.radix.tree.current_size().to_string(),
            self.crtc.tree_sizes().values().sum::<usize>().to_string(),
        ]
    }
}

// Outcomes read "ok" or "error: ..." so that the verdict compares only whether an error was
// reported (each indexer names its errors its own way).
fn status(s: sys::kvr_status) -> String {
    if s == sys::KVR_OK {
        "ok".into()
    } else {
        format!("error: {}", kvrouter::status_name(s))
    }
}

fn result(r: Result<(), dynamo_kv_router::protocols::KvCacheEventError>) -> String {
    match r {
        Ok(()) => "ok".into(),
        Err(e) => format!("error: {e:?}"),
    }
}

fn ack(rx: tokio::sync::oneshot::Receiver<bool>) -> String {
    match rx.blocking_recv() {
        Ok(true) => "ok".into(),
        Ok(false) => "error: not applied (EventWithAck false)".into(),
        Err(_) => "no answer".into(),
    }
}

fn row(what: &str, v: [String; 3]) {
    let class = |s: &String| s.split(':').next().unwrap_or("").to_string();
    let outcome = v.iter().all(|s| s == "ok" || s.starts_with("error"));
    let same = if outcome {
        class(&v[0]) == class(&v[1]) && class(&v[1]) == class(&v[2])
    } else {
        v[0] == v[1] && v[1] == v[2]
    };
    let verdict = if same { "same" } else { "DIFFERS" };
    println!("| {what} | {} | {} | {} | {verdict} |", v[0], v[1], v[2]);
}

/// Prints, as a markdown table, what each indexer makes of the cases where kvrouter's rules
/// and Dynamo 1.6.1's are known to differ (and a few where they agree).
pub fn probes() {
    println!("| case | kvrouter | RadixTree | CRTC | |");
    println!("| --- | --- | --- | --- | --- |");
    let all: Vec<u64> = (0..8).collect();
    // dp ranks are separate owners everywhere.
    let mut p = Probe::new();
    p.store(7, 0, None, &[0, 1, 2, 3]);
    p.store(7, 1, None, &[0, 1]);
    row(
        "worker 7 rank 0 stores blocks 0-3, rank 1 blocks 0-1: depths of 0-3",
        p.depths(&[0, 1, 2, 3]),
    );
    row("Cleared event from (7, rank 1): outcome", p.clear(7, 1));
    row("... depths of 0-3 after it", p.depths(&[0, 1, 2, 3]));
    // Unknown blocks in a removal.
    let mut p = Probe::new();
    p.store(1, 0, None, &[0, 1, 2, 3]);
    row(
        "worker 1 removes [unknown block 50, block 3]: outcome",
        p.remove(1, 0, &[50, 3]),
    );
    row("... depths of 0-3 after it", p.depths(&[0, 1, 2, 3]));
    row(
        "a store whose parent the worker does not hold: outcome",
        p.store(1, 0, Some(60), &[61]),
    );
    // Removal in the middle of a run, then the block stored again.
    let mut p = Probe::new();
    p.store(1, 0, None, &all);
    row(
        "worker 1 stores blocks 0-7 in one event, removes block 2: depths of 0-7",
        {
            p.remove(1, 0, &[2]);
            p.depths(&all)
        },
    );
    row("... (block, rank) entries then", p.sizes());
    row("... stores block 2 again (parent 1): depths of 0-7", {
        p.store(1, 0, Some(1), &[2]);
        p.depths(&all)
    });
    row("... (block, rank) entries then", p.sizes());
    // A worker that lost a block keeps its descendants: the walk may then credit another.
    let mut p = Probe::new();
    p.store(1, 0, None, &[0, 1, 2]);
    p.store(2, 0, None, &[0, 1]);
    p.store(2, 0, Some(1), &[5]);
    row(
        "workers 1 (0-1-2) and 2 (0-1-5); worker 1 removes block 1: depths of 0-1-2",
        {
            p.remove(1, 0, &[1]);
            p.depths(&[0, 1, 2])
        },
    );
}
