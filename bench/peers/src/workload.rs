//! The events and queries every indexer is fed: bench/index_bench.cc's, rebuilt in Rust.
//!
//! * Trace load (`TraceIndex::Load`): request *i* of the Mooncake conversation trace is
//!   expanded to tokens as tools/replay/trace/mooncake_trace.cc does (each hash id = 512 tokens from
//!   splitmix64 of (id × 256 + pair), truncated to input_length), hashed at block size 16
//!   (local hashes; engine hashes = their chained sequence hashes) and stored on worker
//!   *i* mod W, dp rank 0, as one stored event holding only the blocks new to that worker (the
//!   leading run it already holds is skipped and its last block is the parent). No evictions.
//! * Queries (`MaybeAddQuery`): the first 1,024 requests with at least 512 blocks, cut to 512
//!   local hashes (8,192 tokens); each query's anchor is (its worker, the engine hash of its
//!   block 511).
//! * Continuations (`TraceContinuations`): 1,024 runs of 32 blocks of random tokens (an
//!   MT19937-64 seeded 11, one draw per token, as std::mt19937_64 in `MakeRun`), run *e*
//!   continuing anchor *e* mod 1,024 on its worker: a stored event with that parent, undone by
//!   a removed event naming the run's 32 engine hashes.

use std::time::Instant;

use kvrouter::{compute_block_hashes, compute_sequence_hashes, HashOptions};
use rustc_hash::FxHashSet;

pub const BLOCK_SIZE: u32 = 16;
pub const QUERY_BLOCKS: usize = 512;
pub const MAX_QUERIES: usize = 1024;
pub const RUN_BLOCKS: usize = 32;
/// kBatchSequences × kHoldersPerSequence in index_bench.cc.
pub const RUNS: usize = 1024;
const TRACE_BLOCK_TOKENS: usize = 512;

/// One stored event: blocks `start..start + len` of the workload's flat hash arrays.
#[derive(Clone, Copy, Debug)]
pub struct Store {
    pub worker: u32,
    pub parent: Option<u64>,
    pub start: usize,
    pub len: usize,
}

/// A 32-block continuation of one query prompt on the worker that stored it.
pub struct Run {
    pub worker: u32,
    pub parent: u64,
    pub query: usize,
    pub local: Vec<u64>,
    pub engine: Vec<u64>,
}

pub struct Workload {
    pub workers: u32,
    pub requests: usize,
    pub stores: Vec<Store>,
    pub local: Vec<u64>,
    pub engine: Vec<u64>,
    /// 512 local hashes per query; the query's worker; its request's whole prompt (local and
    /// engine hashes of every block, not only the first 512).
    pub queries: Vec<Vec<u64>>,
    pub query_worker: Vec<u32>,
    pub query_request_local: Vec<Vec<u64>>,
    pub query_request_engine: Vec<Vec<u64>>,
    pub runs: Vec<Run>,
    pub prepare_seconds: f64,
}

impl Workload {
    pub fn blocks(&self) -> usize {
        self.local.len()
    }

    pub fn local_of(&self, s: &Store) -> &[u64] {
        &self.local[s.start..s.start + s.len]
    }

    pub fn engine_of(&self, s: &Store) -> &[u64] {
        &self.engine[s.start..s.start + s.len]
    }

    /// The prompt of a continuation: its query's 512 blocks then the run's 32.
    pub fn run_prompt(&self, run: &Run) -> Vec<u64> {
        let mut p = self.queries[run.query].clone();
        p.extend_from_slice(&run.local);
        p
    }
}

/// One trace line: (input_length, hash_ids).
pub fn parse_line(line: &str, number: usize) -> (usize, Vec<u64>) {
    let v: serde_json::Value = serde_json::from_str(line)
        .unwrap_or_else(|e| panic!("trace line {number}: invalid JSON: {e}"));
    let input = v["input_length"]
        .as_u64()
        .unwrap_or_else(|| panic!("trace line {number}: no input_length"));
    let ids = v["hash_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("trace line {number}: no hash_ids"))
        .iter()
        .map(|id| {
            id.as_u64()
                .unwrap_or_else(|| panic!("trace line {number}: bad hash id"))
        })
        .collect();
    (input as usize, ids)
}

/// tools/replay/trace/mooncake_trace.cc's expansion (`ExpandTokensInto`).
pub fn expand_into(input_length: usize, hash_ids: &[u64], out: &mut Vec<u32>) {
    fn mix64(mut x: u64) -> u64 {
        x = x.wrapping_add(0x9e3779b97f4a7c15);
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d049bb133111eb);
        x ^ (x >> 31)
    }
    let length = input_length.min(hash_ids.len() * TRACE_BLOCK_TOKENS);
    out.clear();
    out.resize(length, 0);
    let pairs_per_block = (TRACE_BLOCK_TOKENS / 2) as u64;
    for pos in (0..length).step_by(2) {
        let id = hash_ids[pos / TRACE_BLOCK_TOKENS];
        let pair = mix64(
            id.wrapping_mul(pairs_per_block)
                .wrapping_add(((pos % TRACE_BLOCK_TOKENS) / 2) as u64),
        );
        out[pos] = pair as u32;
        if pos + 1 < length {
            out[pos + 1] = (pair >> 32) as u32;
        }
    }
}

/// std::mt19937_64 (the standard's parameters), for the continuation tokens.
pub struct Mt19937_64 {
    state: [u64; 312],
    index: usize,
}

impl Mt19937_64 {
    pub fn new(seed: u64) -> Self {
        let mut state = [0u64; 312];
        state[0] = seed;
        for i in 1..312 {
            let prev = state[i - 1];
            state[i] = 6364136223846793005u64
                .wrapping_mul(prev ^ (prev >> 62))
                .wrapping_add(i as u64);
        }
        Mt19937_64 { state, index: 312 }
    }

    pub fn next_u64(&mut self) -> u64 {
        const UPPER: u64 = 0xFFFF_FFFF_8000_0000;
        const LOWER: u64 = 0x7FFF_FFFF;
        if self.index >= 312 {
            for i in 0..312 {
                let x = (self.state[i] & UPPER) | (self.state[(i + 1) % 312] & LOWER);
                let mut next = x >> 1;
                if x & 1 != 0 {
                    next ^= 0xB502_6F5A_A966_19E9;
                }
                self.state[i] = self.state[(i + 156) % 312] ^ next;
            }
            self.index = 0;
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= (y >> 29) & 0x5555_5555_5555_5555;
        y ^= (y << 17) & 0x71D6_7FFF_EDA6_0000;
        y ^= (y << 37) & 0xFFF7_EEE0_0000_0000;
        y ^ (y >> 43)
    }
}

pub fn default_trace_path() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../data/mooncake/conversation_trace.jsonl"
    )
    .to_string()
}

/// Builds the workload for `workers` workers from the first `max_requests` trace requests
/// (0 = all).
pub fn build(trace: &str, workers: u32, max_requests: usize) -> Workload {
    let start = Instant::now();
    let text =
        std::fs::read_to_string(trace).unwrap_or_else(|e| panic!("{trace}: {e} (pass --trace)"));
    let mut held: Vec<FxHashSet<u64>> = vec![FxHashSet::default(); workers as usize];
    let mut w = Workload {
        workers,
        requests: 0,
        stores: Vec::new(),
        local: Vec::new(),
        engine: Vec::new(),
        queries: Vec::new(),
        query_worker: Vec::new(),
        query_request_local: Vec::new(),
        query_request_engine: Vec::new(),
        runs: Vec::new(),
        prepare_seconds: 0.0,
    };
    let mut tokens = Vec::new();
    let options = HashOptions::default();
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        if max_requests > 0 && i >= max_requests {
            break;
        }
        let (input, ids) = parse_line(line, i + 1);
        expand_into(input, &ids, &mut tokens);
        let local = compute_block_hashes(&tokens, BLOCK_SIZE, &options).expect("hashing");
        let engine = compute_sequence_hashes(&local).expect("hashing");
        let worker = (i % workers as usize) as u32;
        let held = &mut held[worker as usize];
        // StoreNewBlocks: the leading run the worker holds is skipped.
        let first_new = engine.iter().take_while(|h| held.contains(h)).count();
        if first_new < engine.len() {
            w.stores.push(Store {
                worker,
                parent: (first_new > 0).then(|| engine[first_new - 1]),
                start: w.local.len(),
                len: engine.len() - first_new,
            });
            w.local.extend_from_slice(&local[first_new..]);
            w.engine.extend_from_slice(&engine[first_new..]);
            held.extend(engine[first_new..].iter().copied());
        }
        // MaybeAddQuery.
        if w.queries.len() < MAX_QUERIES && local.len() >= QUERY_BLOCKS {
            w.queries.push(local[..QUERY_BLOCKS].to_vec());
            w.query_worker.push(worker);
            w.query_request_local.push(local.clone());
            w.query_request_engine.push(engine.clone());
        }
        w.requests += 1;
    }
    drop(held);
    // TraceContinuations.
    let mut rng = Mt19937_64::new(11);
    let mut run_tokens = vec![0u32; RUN_BLOCKS * BLOCK_SIZE as usize];
    for e in 0..RUNS {
        if w.queries.is_empty() {
            break;
        }
        let q = e % w.queries.len();
        for t in run_tokens.iter_mut() {
            *t = rng.next_u64() as u32;
        }
        let local = compute_block_hashes(&run_tokens, BLOCK_SIZE, &options).expect("hashing");
        // Engine hashes chained from the anchor (NextSequenceHash from the prompt's block 511):
        // the sequence hashes of prompt + run, whose first 512 are the prompt's own.
        let mut prompt = w.queries[q].clone();
        prompt.extend_from_slice(&local);
        let chained = compute_sequence_hashes(&prompt).expect("hashing");
        let parent = w.query_request_engine[q][QUERY_BLOCKS - 1];
        assert_eq!(
            chained[QUERY_BLOCKS - 1],
            parent,
            "sequence hashes are not a chain"
        );
        w.runs.push(Run {
            worker: w.query_worker[q],
            parent,
            query: q,
            local,
            engine: chained[QUERY_BLOCKS..].to_vec(),
        });
    }
    w.prepare_seconds = start.elapsed().as_secs_f64();
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mt19937_64_matches_the_standard() {
        // [rand.predef]: the 10000th consecutive invocation of a default-constructed
        // std::mt19937_64 (seed 5489) produces 9981545732273789042.
        let mut rng = Mt19937_64::new(5489);
        let mut last = 0;
        for _ in 0..10000 {
            last = rng.next_u64();
        }
        assert_eq!(last, 9981545732273789042);
    }
}
