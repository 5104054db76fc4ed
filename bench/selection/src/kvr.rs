//! kvrouter through its safe Rust binding, as a user replacing Dynamo's router calls it.
//!
//! One `Router` with the library's default options (block size 16, no admission queue,
//! temperature 0: argmin with a random tie-break, seeded 1), every worker added with
//! `max_num_batched_tokens` 8,192 (what the Dynamo side's workers report), the workload's
//! stored events applied with their engine and local hashes. Per request:
//! `find_best_match(tokens, &RequestOptions::admit(id))` (hash the tokens, walk the index,
//! price every rank, pick one and book the request on it: prefill tokens and blocks in flight)
//! then `free_request(id)`.

use kvrouter::{RequestOptions, Router, RouterOptions, StoredEvent, WorkerConfig};

use crate::workload::{Workload, BLOCK_SIZE};
use crate::{Decision, Side};

pub struct Kvr {
    router: Router,
}

impl Kvr {
    pub fn new(w: &Workload) -> Kvr {
        let options = RouterOptions {
            random_seed: 1,
            ..RouterOptions::with_block_size(BLOCK_SIZE)
        };
        let router = Router::new(&options).expect("kvr_router_new");
        for worker in 0..w.workers as u64 {
            router
                .add_worker(&WorkerConfig {
                    max_num_batched_tokens: 8192,
                    ..WorkerConfig::new(worker)
                })
                .expect("add_worker");
        }
        for (i, s) in w.stores.iter().enumerate() {
            router
                .apply_stored(&StoredEvent {
                    worker_id: s.worker as u64,
                    dp_rank: 0,
                    event_id: i as u64,
                    parent_hash: s.parent,
                    block_hashes: w.engine_of(s),
                    local_hashes: Some(w.local_of(s)),
                    ..Default::default()
                })
                .expect("kvrouter rejected a trace event");
        }
        let m = router.metrics().expect("metrics");
        assert_eq!(
            m.index_blocks,
            w.blocks() as u64,
            "kvrouter's index does not hold the workload's entries"
        );
        Kvr { router }
    }
}

impl Side for Kvr {
    type Prepared = ();

    fn name(&self) -> &'static str {
        "kvrouter"
    }

    fn prepare(&self, _tokens: &[u32], _id: &str) {}

    fn decide(&self, tokens: &[u32], id: &str, _: ()) -> Result<Decision, String> {
        let r = self
            .router
            .find_best_match(tokens, &RequestOptions::admit(id))
            .map_err(|e| e.to_string())?;
        if !r.booked {
            return Err(format!("{id} was not booked"));
        }
        Ok(Decision {
            worker: r.worker_id,
            cached_blocks: r.device_overlap_blocks,
        })
    }

    fn release(&self, id: &str) -> Result<(), String> {
        self.router.free_request(id).map_err(|e| e.to_string())
    }

    fn active(&self) -> u64 {
        self.router.metrics().expect("metrics").requests_active
    }
}
