//! What the integration tests share: routers with workers, prompts, stored events, polling.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use kvrouter::{Router, RouterOptions, StoredEvent, WorkerConfig};

pub const BS: u32 = 16;

/// A router of block size 16 with workers `1..=workers` (seeded: deterministic tie-breaks).
pub fn router(workers: u64) -> Router {
    let router = Router::new(&RouterOptions {
        random_seed: 7,
        ..RouterOptions::with_block_size(BS)
    })
    .unwrap();
    for id in 1..=workers {
        router.add_worker(&WorkerConfig::new(id)).unwrap();
    }
    router
}

/// `blocks` full blocks of distinct tokens starting at `seed`.
pub fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks as u32 * BS))
        .map(|i| seed.wrapping_mul(7919).wrapping_add(i))
        .collect()
}

/// Engine hashes `first..first + n`.
pub fn engine_hashes(first: u64, n: usize) -> Vec<u64> {
    (first..first + n as u64).collect()
}

/// Worker `worker` caches the first `blocks` blocks of `tokens` (engine hashes from `first`).
pub fn store(router: &kvrouter::RouterRef, worker: u64, tokens: &[u32], blocks: usize, first: u64) {
    let hashes = engine_hashes(first, blocks);
    router
        .apply_stored(&StoredEvent {
            worker_id: worker,
            event_id: first,
            block_hashes: &hashes,
            token_ids: &tokens[..blocks * BS as usize],
            ..Default::default()
        })
        .unwrap();
}

/// Polls `f` every millisecond until it returns Some, for at most 10 s.
pub fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}
