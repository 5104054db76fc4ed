//! The workload's 1,024 query prompts as token ids.
//!
//! `workload.rs` (bench/peers') keeps each query as its 512 local hashes only; the routers here
//! take tokens, so the queries are read from the trace again with its own parsing and
//! expansion, and every query's tokens must hash (kvrouter's `compute_block_hashes`) to exactly
//! the workload's query hashes, or the bench stops.

use kvrouter::{compute_block_hashes, HashOptions};

use crate::workload::{expand_into, parse_line, Workload, BLOCK_SIZE, MAX_QUERIES, QUERY_BLOCKS};

/// The query prompts of `w` (built from the same trace and request limit) as tokens: the
/// first 8,192 tokens of the first 1,024 requests holding at least 512 blocks.
pub fn query_tokens(trace: &str, max_requests: usize, w: &Workload) -> Vec<Vec<u32>> {
    let text =
        std::fs::read_to_string(trace).unwrap_or_else(|e| panic!("{trace}: {e} (pass --trace)"));
    let query_tokens = QUERY_BLOCKS * BLOCK_SIZE as usize;
    let mut out = Vec::new();
    let mut tokens = Vec::new();
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        if (max_requests > 0 && i >= max_requests) || out.len() >= MAX_QUERIES {
            break;
        }
        let (input, ids) = parse_line(line, i + 1);
        expand_into(input, &ids, &mut tokens);
        if tokens.len() / BLOCK_SIZE as usize >= QUERY_BLOCKS {
            out.push(tokens[..query_tokens].to_vec());
        }
    }
    assert_eq!(
        out.len(),
        w.queries.len(),
        "query count differs from the workload's"
    );
    let options = HashOptions::default();
    for (q, tokens) in out.iter().enumerate() {
        let local = compute_block_hashes(tokens, BLOCK_SIZE, &options).expect("hashing");
        assert_eq!(
            local, w.queries[q],
            "query {q}: the tokens do not hash to the workload's query"
        );
    }
    out
}
