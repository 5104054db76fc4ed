//! The three indexers behind one small interface.
//!
//! * kvrouter: one `kvr_router` (approximate mode off, every worker registered), fed through
//!   the C ABI: `kvr_router_apply_stored` with precomputed `local_hashes` (no token hashing),
//!   `kvr_router_apply_removed`, and `kvr_router_find_matches` (the index walk alone for a
//!   prompt already hashed: Dynamo's `find_matches` contract) into a buffer reused across
//!   calls. These are raw `kvrouter::sys` calls; the safe `Router::find_matches` (a fresh
//!   `Vec` per call) is timed separately (`safe_find_p50_us`), and so is
//!   `kvr_router_overlap_scores_hashed`, the same walk with the cost model's figures per rank
//!   (`overlap_find_p50_us`).
//! * Dynamo's `RadixTree`: single-threaded (`Rc<RefCell<..>>` nodes, neither Send nor Sync),
//!   `apply_event` and `find_matches(sequence, early_exit = false)` called directly, as its
//!   `KvIndexer` does on its one task.
//! * Dynamo's `ConcurrentRadixTreeCompressed`: driven as its `ThreadPoolIndexer` drives it:
//!   N OS threads each running the backend's own `SyncIndexer::worker` loop on a flume
//!   channel; each (worker, dp_rank) is assigned a thread round-robin the first time it is
//!   seen and keeps it; events go to that thread's channel as `WorkerTask::Event`
//!   (`EventWithAck` when the outcome is wanted), followed by `CleanupStaleChildren` whenever
//!   `try_schedule_cleanup` says so; `WorkerTask::Flush` on every channel is the barrier;
//!   lookups run inline on the caller's thread (`find_matches(sequence, false)`).

use std::ptr;
use std::sync::Arc;
use std::thread::JoinHandle;

use dynamo_kv_router::indexer::{SyncIndexer, WorkerTask};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, OverlapScores, RouterEvent, WorkerWithDpRank,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, RadixTree};
use kvrouter::{raw, sys, Router, RouterOptions, WorkerConfig};
use rustc_hash::FxHashMap;
use tokio::sync::oneshot;

use crate::workload::BLOCK_SIZE;

/// Calls a per-rank query into `rows` (its capacity is the cap), growing it once when the
/// library asks for more; returns the rows written.
fn fill<T>(
    rows: &mut Vec<T>,
    mut call: impl FnMut(*mut T, usize, &mut usize) -> sys::kvr_status,
) -> usize {
    loop {
        rows.clear();
        let mut len = 0usize;
        let status = call(rows.as_mut_ptr(), rows.capacity(), &mut len);
        if status == sys::KVR_BUFFER_TOO_SMALL && len > rows.capacity() {
            rows.reserve_exact(len);
            continue;
        }
        assert_eq!(status, sys::KVR_OK, "a kvrouter lookup failed");
        // SAFETY: on success the first len <= capacity rows were written.
        unsafe { rows.set_len(len) };
        return len;
    }
}

/// Per (worker, dp_rank) overlap depth in blocks (entries with depth 0 left out).
pub type Depths = std::collections::BTreeMap<(u64, u32), u32>;

// ---------------------------------------------------------------------------------------------
// kvrouter

pub struct Kvr {
    router: Router,
}

/// A reusable result buffer for `Kvr::find`.
pub struct KvrBuf(Vec<sys::kvr_match>);

/// A reusable result buffer for `Kvr::find_overlap`.
pub struct OverlapBuf(Vec<sys::kvr_overlap>);

impl Kvr {
    /// `dp_size` ranks per worker (1 for the trace); `index_shards` None keeps the library's
    /// default (one tree).
    pub fn new(workers: u32, dp_size: u32, index_shards: Option<u32>) -> Kvr {
        let mut options = RouterOptions {
            random_seed: 1,
            ..RouterOptions::with_block_size(BLOCK_SIZE)
        };
        if let Some(shards) = index_shards {
            options.index_shards = shards;
        }
        let router = Router::new(&options).expect("kvr_router_new");
        for w in 0..workers as u64 {
            router
                .add_worker(&WorkerConfig {
                    dp_size,
                    ..WorkerConfig::new(w)
                })
                .expect("kvr_router_add_worker");
        }
        Kvr { router }
    }

    pub fn buffer(&self, ranks: usize) -> KvrBuf {
        KvrBuf(Vec::with_capacity(ranks.max(16)))
    }

    pub fn overlap_buffer(&self, ranks: usize) -> OverlapBuf {
        OverlapBuf(Vec::with_capacity(ranks.max(16)))
    }

    /// Applies a stored event; returns the kvr_status.
    pub fn store(
        &self,
        worker: u64,
        dp_rank: u32,
        parent: Option<u64>,
        local: &[u64],
        engine: &[u64],
    ) -> sys::kvr_status {
        let mut ev = raw::init::<sys::kvr_stored_event>();
        ev.worker_id = worker;
        ev.dp_rank = dp_rank;
        if let Some(p) = parent {
            ev.flags |= sys::KVR_STORED_HAS_PARENT;
            ev.parent_hash = p;
        }
        ev.block_hashes = engine.as_ptr();
        ev.num_blocks = engine.len();
        ev.local_hashes = local.as_ptr();
        // SAFETY: a live router (concurrent); the event's arrays hold num_blocks values and
        // live across the call; NULL error pointer: no details wanted.
        unsafe { sys::kvr_router_apply_stored(self.router.as_raw(), &ev, ptr::null_mut()) }
    }

    pub fn remove(&self, worker: u64, dp_rank: u32, engine: &[u64]) -> sys::kvr_status {
        let mut ev = raw::init::<sys::kvr_removed_event>();
        ev.worker_id = worker;
        ev.dp_rank = dp_rank;
        ev.block_hashes = engine.as_ptr();
        ev.num_blocks = engine.len();
        // SAFETY: as store.
        unsafe { sys::kvr_router_apply_removed(self.router.as_raw(), &ev, ptr::null_mut()) }
    }

    pub fn clear(&self, worker: u64, dp_rank: u32) -> sys::kvr_status {
        // SAFETY: a live router (concurrent).
        unsafe {
            sys::kvr_router_apply_cleared(self.router.as_raw(), worker, dp_rank, 0, ptr::null_mut())
        }
    }

    /// The index walk for `local` into `buf`; returns how many ranks matched.
    pub fn find(&self, local: &[u64], buf: &mut KvrBuf) -> usize {
        fill(&mut buf.0, |out, cap, len| {
            // SAFETY: a live router (concurrent); local is read during the call; out has room
            // for cap rows and the library writes at most that many.
            unsafe {
                sys::kvr_router_find_matches(
                    self.router.as_raw(),
                    local.as_ptr(),
                    local.len(),
                    out,
                    cap,
                    len,
                    ptr::null_mut(),
                )
            }
        })
    }

    /// The same walk with the cost model's figures per rank (effective overlap, cached
    /// tokens): `kvr_router_overlap_scores_hashed`.
    pub fn find_overlap(&self, local: &[u64], buf: &mut OverlapBuf) -> usize {
        fill(&mut buf.0, |out, cap, len| {
            // SAFETY: as find; opts may be NULL.
            unsafe {
                sys::kvr_router_overlap_scores_hashed(
                    self.router.as_raw(),
                    local.as_ptr(),
                    local.len(),
                    ptr::null(),
                    out,
                    cap,
                    len,
                    ptr::null_mut(),
                )
            }
        })
    }

    pub fn depths(&self, local: &[u64]) -> Depths {
        let mut buf = self.buffer(64);
        self.find(local, &mut buf);
        buf.0
            .iter()
            .filter(|o| o.device_blocks > 0)
            .map(|o| ((o.worker_id, o.dp_rank), o.device_blocks))
            .collect()
    }

    /// Blocks each matched rank holds (`kvr_overlap.tree_size`).
    pub fn tree_sizes(&self, local: &[u64]) -> Vec<((u64, u32), u64)> {
        let mut buf = self.buffer(64);
        self.find(local, &mut buf);
        buf.0
            .iter()
            .map(|o| ((o.worker_id, o.dp_rank), o.tree_size))
            .collect()
    }

    /// The same walk through the safe layer (a fresh Vec per call).
    pub fn find_safe(&self, local: &[u64]) -> usize {
        self.router.find_matches(local).expect("find_matches").len()
    }

    /// (cached (block, rank) entries, exact index bytes, nodes) from kvr_router_get_metrics.
    pub fn index_stats(&self) -> (u64, i64, u64) {
        let m = self.router.metrics().expect("metrics");
        (m.index_blocks, m.index_bytes, m.index_nodes)
    }
}

// ---------------------------------------------------------------------------------------------
// Dynamo's events

pub fn stored_event(
    worker: u64,
    dp_rank: u32,
    event_id: u64,
    parent: Option<u64>,
    local: &[u64],
    engine: &[u64],
) -> RouterEvent {
    let blocks = local
        .iter()
        .zip(engine)
        .map(|(&l, &e)| KvCacheStoredBlockData {
            block_hash: ExternalSequenceBlockHash(e),
            tokens_hash: LocalBlockHash(l),
            mm_extra_info: None,
        })
        .collect();
    RouterEvent::new(
        worker,
        KvCacheEvent {
            event_id,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: parent.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks,
            }),
            dp_rank,
        },
    )
}

pub fn removed_event(worker: u64, dp_rank: u32, event_id: u64, engine: &[u64]) -> RouterEvent {
    RouterEvent::new(
        worker,
        KvCacheEvent {
            event_id,
            data: KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: engine
                    .iter()
                    .map(|&e| ExternalSequenceBlockHash(e))
                    .collect(),
            }),
            dp_rank,
        },
    )
}

pub fn cleared_event(worker: u64, dp_rank: u32, event_id: u64) -> RouterEvent {
    RouterEvent::new(
        worker,
        KvCacheEvent {
            event_id,
            data: KvCacheEventData::Cleared,
            dp_rank,
        },
    )
}

pub fn dynamo_query(local: &[u64]) -> Vec<LocalBlockHash> {
    local.iter().map(|&h| LocalBlockHash(h)).collect()
}

pub fn dynamo_depths(scores: &OverlapScores) -> Depths {
    scores
        .scores
        .iter()
        .filter(|(_, &d)| d > 0)
        .map(|(w, &d)| ((w.worker_id, w.dp_rank), d))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Dynamo's RadixTree

pub struct Radix {
    pub tree: RadixTree,
}

impl Radix {
    pub fn new() -> Radix {
        Radix {
            tree: RadixTree::new(),
        }
    }

    pub fn depths(&self, local: &[u64]) -> Depths {
        dynamo_depths(&self.tree.find_matches(dynamo_query(local), false))
    }
}

// ---------------------------------------------------------------------------------------------
// Dynamo's ConcurrentRadixTreeCompressed behind its own worker loop

pub struct Crtc {
    pub backend: Arc<ConcurrentRadixTreeCompressed>,
    lanes: Vec<flume::Sender<WorkerTask>>,
    threads: Vec<JoinHandle<()>>,
    assignment: FxHashMap<WorkerWithDpRank, usize>,
    assigned: usize,
}

impl Crtc {
    pub fn new(threads: usize) -> Crtc {
        let backend = Arc::new(ConcurrentRadixTreeCompressed::new());
        let mut lanes = Vec::new();
        let mut handles = Vec::new();
        for _ in 0..threads.max(1) {
            let (tx, rx) = flume::unbounded::<WorkerTask>();
            let backend = Arc::clone(&backend);
            handles.push(std::thread::spawn(move || {
                backend.worker(rx, None).expect("CRTC worker loop");
            }));
            lanes.push(tx);
        }
        Crtc {
            backend,
            lanes,
            threads: handles,
            assignment: FxHashMap::default(),
            assigned: 0,
        }
    }

    /// The event thread of a (worker, dp_rank): round-robin in order of first appearance.
    pub fn lane(&mut self, worker: u64, dp_rank: u32) -> usize {
        let key = WorkerWithDpRank::new(worker, dp_rank);
        let n = self.lanes.len();
        let next = &mut self.assigned;
        *self.assignment.entry(key).or_insert_with(|| {
            let lane = *next % n;
            *next += 1;
            lane
        })
    }

    fn after_send(&self, lane: usize) {
        if self.backend.try_schedule_cleanup()
            && self.lanes[lane]
                .send(WorkerTask::CleanupStaleChildren)
                .is_err()
        {
            self.backend.cancel_scheduled_cleanup();
        }
    }

    /// Enqueues an event on its worker's thread.
    pub fn send(&mut self, event: RouterEvent) {
        let lane = self.lane(event.worker_id, event.event.dp_rank);
        self.lanes[lane]
            .send(WorkerTask::Event(event))
            .expect("CRTC lane closed");
        self.after_send(lane);
    }

    /// Enqueues an event whose outcome (applied or not) the receiver will carry.
    pub fn send_with_ack(&mut self, event: RouterEvent) -> oneshot::Receiver<bool> {
        let lane = self.lane(event.worker_id, event.event.dp_rank);
        let (tx, rx) = oneshot::channel();
        self.lanes[lane]
            .send(WorkerTask::EventWithAck { event, resp: tx })
            .expect("CRTC lane closed");
        self.after_send(lane);
        rx
    }

    /// Returns once every event sent before has been applied.
    pub fn flush(&self) {
        let waits: Vec<_> = self
            .lanes
            .iter()
            .map(|lane| {
                let (tx, rx) = oneshot::channel();
                lane.send(WorkerTask::Flush(tx)).expect("CRTC lane closed");
                rx
            })
            .collect();
        for rx in waits {
            rx.blocking_recv().expect("CRTC flush");
        }
    }

    /// Blocks held per (worker, dp_rank), from every thread's lookup table.
    pub fn tree_sizes(&self) -> FxHashMap<(u64, u32), usize> {
        let waits: Vec<_> = self
            .lanes
            .iter()
            .map(|lane| {
                let (tx, rx) = oneshot::channel();
                lane.send(WorkerTask::Stats(tx)).expect("CRTC lane closed");
                rx
            })
            .collect();
        let mut sizes = FxHashMap::default();
        for rx in waits {
            for (w, n) in rx.blocking_recv().expect("CRTC stats").worker_blocks {
                *sizes.entry((w.worker_id, w.dp_rank)).or_default() += n;
            }
        }
        sizes
    }

    pub fn find(&self, query: &[LocalBlockHash]) -> OverlapScores {
        self.backend.find_matches(query, false)
    }

    pub fn depths(&self, local: &[u64]) -> Depths {
        dynamo_depths(&self.find(&dynamo_query(local)))
    }
}

impl Drop for Crtc {
    fn drop(&mut self) {
        for lane in &self.lanes {
            let _ = lane.send(WorkerTask::Terminate);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
