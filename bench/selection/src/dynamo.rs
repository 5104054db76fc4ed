//! Dynamo's selection core (`dynamo_kv_router::services::selection::SelectionCore`, feature
//! `standalone-selection`), driven through its public API as a synchronous caller drives it.
//!
//! * Created with `SelectionCore::try_new_local`: the default `KvRouterConfig` (KV events on, no
//!   queue threshold, temperature 0), the crate's reference worker-selection policy
//!   (`WorkerSelectionPolicy::reference`, feature `bench`: the native implementation of
//!   Dynamo's default selector), `indexer_threads` index threads (more than 1: its
//!   `ConcurrentRadixTreeCompressed` behind a thread pool, lookups on the caller's thread; 1:
//!   its `KvIndexer`).
//! * W workers upserted in partition ("default", "default"), block size 16,
//!   `max_num_batched_tokens` 8,192. With KV events on, the core's own ingress (ZMQ) wants an
//!   event endpoint per worker to make it schedulable: each gets a localhost port nobody
//!   listens on, so the core's listeners (and their ZMQ I/O threads) exist and stay idle,
//!   reconnecting with back-off; the bench reports the CPU the process's other threads take
//!   while it times.
//! * The workload's stored events go to the partition's indexer through `apply_event_routed`
//!   (device tier), then a flush; the bench checks that each query's own worker matches all
//!   its blocks before and after the timed rounds.
//! * Per request: `select_and_reserve` (prompt as `token_ids`: the core hashes them, looks the
//!   blocks up, scores every worker, books the request) then `free_reservation`, each in a
//!   `block_on` of one tokio current_thread runtime. The request (it owns its tokens: a
//!   `Vec<u32>` copy of the prompt) and its id are made before the clock starts.

use std::collections::HashSet;
use std::sync::Arc;

use dynamo_kv_router::identity::RoutingPartitionId;
use dynamo_kv_router::indexer::KvIndexerInterface;
use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent,
    KvCacheEventData, KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
    RoutingConstraints, WorkerWithDpRank,
};
use dynamo_kv_router::services::indexer::backend::Indexer;
use dynamo_kv_router::services::selection::{
    PromptRequest, SelectAndReserveRequest, SelectionCacheConfig, SelectionCore, WorkerRequest,
};
use dynamo_kv_router::{KvRouterConfig, WorkerSelectionPolicy};
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

use crate::workload::{Workload, BLOCK_SIZE, QUERY_BLOCKS};
use crate::{Decision, Side};

const MODEL: &str = "default";
const GROUP: &str = "default";
/// Worker w's KV event endpoint is tcp://127.0.0.1:(EVENT_PORT_BASE + w), unserved.
const EVENT_PORT_BASE: u64 = 47_000;

/// Dynamo's hashing of every query's tokens must give the workload's local hashes (kvrouter's),
/// or the two indexes would hold different blocks.
pub fn check_hashing(prompts: &[Vec<u32>], w: &Workload) {
    for (q, tokens) in prompts.iter().enumerate() {
        let local = compute_block_hash_for_seq(tokens, BLOCK_SIZE, BlockHashOptions::default());
        let same = local.len() == w.queries[q].len()
            && local.iter().zip(&w.queries[q]).all(|(a, &b)| a.0 == b);
        assert!(same, "query {q}: Dynamo hashes the tokens differently");
    }
}

pub struct Dynamo {
    // Declared before the runtime: dropped (after `shutdown`) while the runtime still exists.
    core: SelectionCore,
    indexer: Indexer,
    rt: Runtime,
    check: Vec<(u64, Vec<u64>)>,
}

impl Dynamo {
    pub fn new(w: &Workload, indexer_threads: usize) -> Dynamo {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        let config = KvRouterConfig {
            use_kv_events: true,
            router_queue_threshold: None,
            ..Default::default()
        };
        let core = SelectionCore::try_new_local(
            config,
            indexer_threads,
            CancellationToken::new(),
            SelectionCacheConfig::default(),
            Arc::new(|config, role, _| {
                WorkerSelectionPolicy::reference(config.clone(), role.default_selector_label())
            }),
        )
        .expect("SelectionCore::try_new_local");
        let key = RoutingPartitionId::new(MODEL, GROUP);
        let indexer = rt.block_on(async {
            for worker in 0..w.workers as u64 {
                core.upsert_worker(WorkerRequest {
                    worker_id: worker,
                    model_name: MODEL.to_string(),
                    routing_group: GROUP.to_string(),
                    endpoint: Some(format!("http://worker-{worker}:8000")),
                    kv_events_endpoint: Some(format!(
                        "tcp://127.0.0.1:{}",
                        EVENT_PORT_BASE + worker
                    )),
                    block_size: Some(BLOCK_SIZE),
                    max_num_batched_tokens: Some(8192),
                    ..WorkerRequest::default()
                })
                .await
                .expect("upsert_worker");
            }
            let indexer = core
                .partition(&key)
                .expect("the partition exists once a worker is in")
                .indexer()
                .clone();
            for (i, s) in w.stores.iter().enumerate() {
                let blocks = w
                    .local_of(s)
                    .iter()
                    .zip(w.engine_of(s))
                    .map(|(&l, &e)| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(e),
                        tokens_hash: LocalBlockHash(l),
                        mm_extra_info: None,
                    })
                    .collect();
                let event = RouterEvent::new(
                    s.worker as u64,
                    KvCacheEvent {
                        event_id: i as u64,
                        data: KvCacheEventData::Stored(KvCacheStoreData {
                            parent_hash: s.parent.map(ExternalSequenceBlockHash),
                            start_position: None,
                            blocks,
                        }),
                        dp_rank: 0,
                    },
                );
                indexer
                    .apply_event_routed(event)
                    .await
                    .expect("Dynamo's indexer rejected a trace event");
            }
            flush(&indexer).await;
            indexer
        });
        // Each query's own worker holds all its blocks: the index is loaded (checked again at
        // the end).
        let check = w
            .queries
            .iter()
            .zip(&w.query_worker)
            .step_by(97)
            .map(|(q, &worker)| (worker as u64, q.clone()))
            .collect();
        let d = Dynamo {
            core,
            indexer,
            rt,
            check,
        };
        d.check_index();
        d
    }

    /// Every checked query's own worker matches its 512 blocks in Dynamo's index.
    pub fn check_index(&self) {
        for (worker, query) in &self.check {
            let hashes = query.iter().map(|&h| LocalBlockHash(h)).collect();
            let scores = self
                .rt
                .block_on(self.indexer.find_matches(hashes))
                .expect("find_matches");
            let depth = scores
                .scores
                .get(&WorkerWithDpRank::new(*worker, 0))
                .copied()
                .unwrap_or(0);
            assert_eq!(
                depth as usize, QUERY_BLOCKS,
                "Dynamo's index: worker {worker} should match all of its query"
            );
        }
    }
}

async fn flush(indexer: &Indexer) {
    match indexer {
        Indexer::Single { primary, .. } => {
            primary.flush().await;
        }
        Indexer::Concurrent { primary, .. } => primary.flush().await,
        _ => panic!("SelectionCore made a remote or no indexer"),
    }
}

impl Drop for Dynamo {
    fn drop(&mut self) {
        self.check_index();
        self.core.shutdown();
    }
}

impl Side for Dynamo {
    type Prepared = SelectAndReserveRequest;

    fn name(&self) -> &'static str {
        "Dynamo"
    }

    fn prepare(&self, tokens: &[u32], id: &str) -> SelectAndReserveRequest {
        SelectAndReserveRequest {
            model_name: MODEL.to_string(),
            routing_group: GROUP.to_string(),
            selection_id: Some(id.to_string()),
            prompt: PromptRequest {
                token_ids: Some(tokens.to_vec()),
                ..PromptRequest::default()
            },
            router_config_override: None,
            expected_output_tokens: None,
            priority_jump: None,
            strict_priority: None,
            session_id: None,
            session_context: None,
            affinity_target: None,
            pinned_worker: None,
            allowed_worker_ids: None::<HashSet<u64>>,
            routing_constraints: RoutingConstraints::default(),
        }
    }

    fn decide(
        &self,
        _tokens: &[u32],
        id: &str,
        req: SelectAndReserveRequest,
    ) -> Result<Decision, String> {
        let r = self
            .rt
            .block_on(self.core.select_and_reserve(req))
            .map_err(|e| e.to_string())?;
        if r.isl_tokens.is_none() {
            return Err(format!("{id} was not booked"));
        }
        Ok(Decision {
            worker: r.worker_id,
            cached_blocks: r.overlap.gpu / BLOCK_SIZE,
        })
    }

    fn release(&self, id: &str) -> Result<(), String> {
        self.rt
            .block_on(self.core.free_reservation(id))
            .map_err(|e| e.to_string())
    }

    fn active(&self) -> u64 {
        self.core
            .loads(Some(MODEL), Some(GROUP))
            .iter()
            .flat_map(|m| &m.loads)
            .map(|l| l.active_requests as u64)
            .sum()
    }
}
