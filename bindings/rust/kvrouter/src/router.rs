//! The router: [`Router`] owns a `kvr_router`; [`RouterRef`] is what every call takes, so the
//! pools of a [`Disagg`](crate::Disagg) (owned by it) expose the same methods.

use std::cell::UnsafeCell;
use std::fmt;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ops::Deref;
use std::ptr::{self, NonNull};
use std::time::Duration;

use kvrouter_sys as sys;

use crate::error::{call, call_routing, fill_vec, Code, Error, Result};
use crate::events::{Buffer, RemovedEvent, StoredEvent};
use crate::options::{
    hints_ptr, lower_hints, request_template, RequestOptions, RouterOptions, RoutingHints,
    WorkerConfig,
};
use crate::prepared::PreparedRequest;
use crate::raw::{init, Template};
use crate::util::{slice_ptr, CStrs};

/// An owned router (`kvr_router`), internally synchronised: share it between threads with
/// `Arc<Router>`. Every method is on [`RouterRef`], which it derefs to.
pub struct Router(NonNull<sys::kvr_router>);

// SAFETY: every kvr_router function is tagged `concurrent` (any thread, concurrently with any
// other call on the handle) except kvr_router_free, which only Drop calls, with ownership.
unsafe impl Send for Router {}
// SAFETY: as above; a shared &Router reaches only `concurrent` functions.
unsafe impl Sync for Router {}

impl Router {
    /// Creates a router (`kvr_router_new`); first checks that the library's major.minor
    /// version is the one this binding was written for.
    pub fn new(options: &RouterOptions) -> Result<Router> {
        crate::check_version()?;
        let raw = options.to_raw();
        let mut out = ptr::null_mut();
        // SAFETY: raw is a complete options struct; out is written on success only.
        call(|err| unsafe { sys::kvr_router_new(&raw, &mut out, err) })?;
        NonNull::new(out)
            .map(Router)
            .ok_or_else(|| Error::new(Code::Internal, "kvr_router_new gave NULL"))
    }
}

impl Deref for Router {
    type Target = RouterRef;
    fn deref(&self) -> &RouterRef {
        // SAFETY: the router is live for as long as the borrow of self.
        unsafe { RouterRef::from_ptr(self.0.as_ptr()) }
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let router = self.0.as_ptr();
        // Its publisher's closure leaves the table first, while the address is still this
        // router's (replica::take_before_free), and is dropped once C is done with it.
        let closures = crate::replica::take_before_free(&[router]);
        // SAFETY: owned; Drop has exclusive access, so no other call is in progress
        // (kvr_router_free is `none`). Ingest objects feeding it are gone: each holds an Arc to
        // it (dropped after its free, which joins its loop thread) or a scope's borrow.
        //
        // Never inside this router's own publisher (under its lock): the library runs a closure
        // only inside a call on this router (or on an Ingest feeding it), made by a caller whose
        // borrow of the router outlives the call and which the closure cannot end, or on the
        // loop thread of an Ingest feeding it, which keeps it alive until that thread is joined
        // (an Ingest dropped there hands its free, and its Arc, to a thread of its own).
        unsafe { sys::kvr_router_free(router) }
        drop(closures);
    }
}

impl fmt::Debug for Router {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Router").field(&self.0).finish()
    }
}

/// A borrowed router: a `&RouterRef` is a `kvr_router *` that lives as long as its owner (a
/// [`Router`], or a [`Disagg`](crate::Disagg) for its pools). All methods take `&self`: every
/// one of them is `concurrent` in the C ABI.
pub struct RouterRef {
    _opaque: PhantomData<UnsafeCell<*mut ()>>,
}

// SAFETY: a RouterRef is only ever seen behind a reference to a live kvr_router, whose
// functions other than kvr_router_free are all `concurrent`; it cannot be freed through one.
unsafe impl Send for RouterRef {}
// SAFETY: as above.
unsafe impl Sync for RouterRef {}

impl fmt::Debug for RouterRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RouterRef").field(&self.as_raw()).finish()
    }
}

/// The decision for one request (`kvr_route_result`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouteResult {
    pub worker_id: u64,
    pub dp_rank: u32,
    /// Complete blocks in the prompt.
    pub prompt_blocks: u32,
    /// Leading blocks cached on the chosen rank's device.
    pub device_overlap_blocks: u32,
    /// Device + tier-weighted lower-tier hits.
    pub effective_overlap_blocks: f64,
    /// round(effective_overlap_blocks × block_size).
    pub cached_tokens: u64,
    pub prompt_tokens: u64,
    /// The chosen rank's cost.
    pub cost: f64,
    /// The request is now active on the chosen rank.
    pub booked: bool,
    /// It waited in the admission queue first.
    pub queued: bool,
}

/// `kvr_route_result` as `_init` leaves it (made once, copied afterwards).
fn result_template() -> sys::kvr_route_result {
    static RESULT: Template<sys::kvr_route_result> = Template::new();
    RESULT.get()
}

impl From<sys::kvr_route_result> for RouteResult {
    fn from(r: sys::kvr_route_result) -> Self {
        RouteResult {
            worker_id: r.worker_id,
            dp_rank: r.dp_rank,
            prompt_blocks: r.prompt_blocks,
            device_overlap_blocks: r.device_overlap_blocks,
            effective_overlap_blocks: r.effective_overlap_blocks,
            cached_tokens: r.cached_tokens,
            prompt_tokens: r.prompt_tokens,
            cost: r.cost,
            booked: r.booked != 0,
            queued: r.queued != 0,
        }
    }
}

/// One candidate rank with every term of its cost (`kvr_candidate`):
/// `cost = prefill_load_scale · max(0, raw_prefill_blocks − credit) + decode_blocks +
/// request_cost`, where `credit` counts the device hit times `credit_decay`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub device_blocks: u32,
    pub host_blocks: u32,
    pub disk_blocks: u32,
    pub external_blocks: u32,
    /// The rank picked.
    pub chosen: bool,
    pub effective_overlap_blocks: f64,
    pub cached_tokens: u64,
    pub active_prefill_tokens: u64,
    pub active_blocks: u64,
    pub new_blocks: u64,
    pub raw_prefill_blocks: f64,
    pub credit: f64,
    pub prefill_cost: f64,
    pub decode_blocks: u64,
    pub cost: f64,
    /// The chance this rank had of being picked.
    pub probability: f64,
    /// The factor the device credit was multiplied by (1 = no decay; below 1 when
    /// `overlap_score_credit_decay` is set and this rank has more prefill queued than the
    /// least loaded one).
    pub credit_decay: f64,
    /// Requests in flight on this rank.
    pub active_requests: u64,
    /// `decode_active_request_weight × active_requests`, included in `cost`.
    pub request_cost: f64,
}

impl From<&sys::kvr_candidate> for Candidate {
    fn from(c: &sys::kvr_candidate) -> Self {
        Candidate {
            worker_id: c.worker_id,
            dp_rank: c.dp_rank,
            device_blocks: c.device_blocks,
            host_blocks: c.host_blocks,
            disk_blocks: c.disk_blocks,
            external_blocks: c.external_blocks,
            chosen: c.chosen != 0,
            effective_overlap_blocks: c.effective_overlap_blocks,
            cached_tokens: c.cached_tokens,
            active_prefill_tokens: c.active_prefill_tokens,
            active_blocks: c.active_blocks,
            new_blocks: c.new_blocks,
            raw_prefill_blocks: c.raw_prefill_blocks,
            credit: c.credit,
            prefill_cost: c.prefill_cost,
            decode_blocks: c.decode_blocks,
            cost: c.cost,
            probability: c.probability,
            credit_decay: c.credit_decay,
            active_requests: c.active_requests,
            request_cost: c.request_cost,
        }
    }
}

/// What one rank holds of a prompt's prefix, per tier (`kvr_overlap`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Overlap {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub device_blocks: u32,
    pub host_blocks: u32,
    pub disk_blocks: u32,
    pub external_blocks: u32,
    pub effective_overlap_blocks: f64,
    pub cached_tokens: u64,
    /// Blocks the rank holds in the index.
    pub tree_size: u64,
}

impl From<&sys::kvr_overlap> for Overlap {
    fn from(o: &sys::kvr_overlap) -> Self {
        Overlap {
            worker_id: o.worker_id,
            dp_rank: o.dp_rank,
            device_blocks: o.device_blocks,
            host_blocks: o.host_blocks,
            disk_blocks: o.disk_blocks,
            external_blocks: o.external_blocks,
            effective_overlap_blocks: o.effective_overlap_blocks,
            cached_tokens: o.cached_tokens,
            tree_size: o.tree_size,
        }
    }
}

/// What one rank holds of a hashed prompt's prefix, per tier: the index walk alone
/// (`kvr_match`; `device_blocks` is Dynamo's `find_matches` depth).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Match {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub device_blocks: u32,
    pub host_blocks: u32,
    pub disk_blocks: u32,
    pub external_blocks: u32,
    /// Blocks the rank holds in the index.
    pub tree_size: u64,
}

impl From<&sys::kvr_match> for Match {
    fn from(m: &sys::kvr_match) -> Self {
        Match {
            worker_id: m.worker_id,
            dp_rank: m.dp_rank,
            device_blocks: m.device_blocks,
            host_blocks: m.host_blocks,
            disk_blocks: m.disk_blocks,
            external_blocks: m.external_blocks,
            tree_size: m.tree_size,
        }
    }
}

/// The load one registered rank would carry with a prompt (`kvr_potential_load`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PotentialLoad {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub potential_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    pub active_prefill_tokens: u64,
    pub active_blocks: u64,
    pub active_requests: u64,
}

impl From<&sys::kvr_potential_load> for PotentialLoad {
    fn from(p: &sys::kvr_potential_load) -> Self {
        PotentialLoad {
            worker_id: p.worker_id,
            dp_rank: p.dp_rank,
            potential_prefill_tokens: p.potential_prefill_tokens,
            potential_decode_blocks: p.potential_decode_blocks,
            active_prefill_tokens: p.active_prefill_tokens,
            active_blocks: p.active_blocks,
            active_requests: p.active_requests,
        }
    }
}

/// The signals of a preview or a plan (`kvr_route_signals`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouteSignals {
    pub worker_id: u64,
    pub dp_rank: u32,
    /// Leading prompt blocks cached on the rank's device.
    pub overlap_blocks: u32,
    pub prompt_blocks: u32,
    /// round(effective overlap × block_size).
    pub cached_tokens: u64,
    /// The rank's active blocks + the prompt's new ones.
    pub potential_decode_blocks: u64,
    /// The worker's KV capacity; 0 = not reported.
    pub total_kv_blocks: u64,
    pub cost: f64,
    pub prompt_tokens: u64,
    /// A plan booked it.
    pub booked: bool,
    /// Plan: the previewed (or soft-session) rank was no longer eligible.
    pub moved: bool,
    /// Plan: it waited in the admission queue.
    pub queued: bool,
}

impl From<sys::kvr_route_signals> for RouteSignals {
    fn from(s: sys::kvr_route_signals) -> Self {
        RouteSignals {
            worker_id: s.worker_id,
            dp_rank: s.dp_rank,
            overlap_blocks: s.overlap_blocks,
            prompt_blocks: s.prompt_blocks,
            cached_tokens: s.cached_tokens,
            potential_decode_blocks: s.potential_decode_blocks,
            total_kv_blocks: s.total_kv_blocks,
            cost: s.cost,
            prompt_tokens: s.prompt_tokens,
            booked: s.booked != 0,
            moved: s.moved != 0,
            queued: s.queued != 0,
        }
    }
}

impl RouteSignals {
    pub(crate) fn to_raw(self) -> sys::kvr_route_signals {
        let mut raw = init::<sys::kvr_route_signals>();
        raw.dp_rank = self.dp_rank;
        raw.worker_id = self.worker_id;
        raw.overlap_blocks = self.overlap_blocks;
        raw.prompt_blocks = self.prompt_blocks;
        raw.cached_tokens = self.cached_tokens;
        raw.potential_decode_blocks = self.potential_decode_blocks;
        raw.total_kv_blocks = self.total_kv_blocks;
        raw.cost = self.cost;
        raw.prompt_tokens = self.prompt_tokens;
        raw.booked = u32::from(self.booked);
        raw.moved = u32::from(self.moved);
        raw.queued = u32::from(self.queued);
        raw
    }
}

/// The kind of a KV event, for [`Metrics::events`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventKind {
    Stored,
    Removed,
    Cleared,
}

/// What became of a KV event, for [`Metrics::events`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventOutcome {
    Applied,
    ParentBlockNotFound,
    BlockNotFound,
    InvalidBlockSequence,
    InvalidBlock,
}

/// Router counters (`kvr_metrics`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Metrics {
    /// `events[kind][outcome]` as in C; read with [`Metrics::events`].
    pub events: [[u64; sys::KVR_EVENT_OUTCOMES]; sys::KVR_EVENT_KINDS],
    /// Event batches that failed verification.
    pub event_batches_rejected: u64,
    /// find_best_match calls that picked a worker.
    pub decisions: u64,
    pub requests_active: u64,
    pub queue_pending: u64,
    pub queue_pending_tokens: u64,
    pub workers: u64,
    pub index_nodes: u64,
    /// Cached (block, rank) entries.
    pub index_blocks: u64,
    pub index_bytes: i64,
    /// Other replicas' booking changes applied here.
    pub replica_changes_applied: u64,
    /// Changes refused (undecodable, unknown worker rank, duplicate booking).
    pub replica_changes_rejected: u64,
    /// Of `requests_active`, those booked by other replicas.
    pub replica_requests_active: u64,
    /// Other replicas heard sending heartbeats and not expired.
    pub replicas_live: u64,
    /// Replicas whose bookings [`RouterRef::expire_replicas`] dropped because they fell silent.
    pub replicas_expired: u64,
    /// KV events the index could not apply for want of memory (`ResourceExhausted`), before
    /// they changed anything or midway, the rank then left holding nothing; 0 in approximate
    /// mode, which takes no events.
    pub events_refused_for_memory: u64,
    /// This router's own booking changes its replica publisher lost for want of memory (the
    /// booking stands; each loss is repaired by announcing every booking again).
    pub replica_changes_unpublished: u64,
    /// Routing decisions decided a second time: priced outside the router's lock while another
    /// call changed what they priced (the chosen rank's load, the queue, the session's binding),
    /// then decided again under it. Such a change comes from another thread (another routing
    /// call, a release, another replica's booking); 0 while nothing else calls the router. What
    /// concurrent callers cost each other.
    pub decisions_priced_again: u64,
    /// Sliding-window events applied: those of hybrid models' sliding-window KV-cache groups
    /// (docs/ingest.md, "Sliding windows"); 0 for models without such groups.
    pub sliding_events_applied: u64,
    /// Sliding-window events rejected (a stored block the rank does not hold in full attention,
    /// a removed block the group lacks, a window of 0, a tier other than the device).
    pub sliding_events_rejected: u64,
    /// The (sliding-window group, block) entries held over every rank (0 without such groups).
    pub index_sliding_blocks: u64,
    /// How long routing calls took to decide.
    pub decision_latency: DecisionLatency,
}

/// The number of buckets of [`DecisionLatency`] (`KVR_DECISION_LATENCY_BUCKETS`, fixed forever).
pub const DECISION_LATENCY_BUCKETS: usize = sys::KVR_DECISION_LATENCY_BUCKETS;

/// How long routing calls took to decide, as a Prometheus histogram (`kvr_metrics`'
/// `decision_latency_*`): on the router's clock from the call's start (hashing included) to its
/// decision, for routing and plans answered without waiting in the admission queue, and
/// previews, over a sample of them (the first call, then one in 16: `count` is not
/// [`Metrics::decisions`]); failed calls are not measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecisionLatency {
    /// The buckets' upper bounds in nanoseconds, rising (the library's to choose).
    pub bounds_ns: [u64; DECISION_LATENCY_BUCKETS],
    /// `le[i]`: the calls that took at most `bounds_ns[i]` (cumulative).
    pub le: [u64; DECISION_LATENCY_BUCKETS],
    /// Every call measured (the +Inf bucket).
    pub count: u64,
    /// Their durations summed, in nanoseconds.
    pub sum_ns: u64,
}

impl DecisionLatency {
    /// The mean decision time in nanoseconds (0 before any call).
    pub fn mean_ns(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum_ns as f64 / self.count as f64
        }
    }
}

impl Metrics {
    /// Events of `kind` applied (`EventOutcome::Applied`) or rejected for a reason.
    pub fn events(&self, kind: EventKind, outcome: EventOutcome) -> u64 {
        let k: sys::kvr_event_kind = match kind {
            EventKind::Stored => sys::KVR_EVENT_STORED,
            EventKind::Removed => sys::KVR_EVENT_REMOVED,
            EventKind::Cleared => sys::KVR_EVENT_CLEARED,
        };
        let o: sys::kvr_event_outcome = match outcome {
            EventOutcome::Applied => sys::KVR_EVENT_OK,
            EventOutcome::ParentBlockNotFound => sys::KVR_EVENT_PARENT_BLOCK_NOT_FOUND,
            EventOutcome::BlockNotFound => sys::KVR_EVENT_BLOCK_NOT_FOUND,
            EventOutcome::InvalidBlockSequence => sys::KVR_EVENT_INVALID_BLOCK_SEQUENCE,
            EventOutcome::InvalidBlock => sys::KVR_EVENT_INVALID_BLOCK,
        };
        // The typed enumerations index kvr_metrics.events (a u32 always fits a usize).
        self.events[k as usize][o as usize]
    }
}

impl From<sys::kvr_metrics> for Metrics {
    fn from(m: sys::kvr_metrics) -> Self {
        Metrics {
            events: m.events,
            event_batches_rejected: m.event_batches_rejected,
            decisions: m.decisions,
            requests_active: m.requests_active,
            queue_pending: m.queue_pending,
            queue_pending_tokens: m.queue_pending_tokens,
            workers: m.workers,
            index_nodes: m.index_nodes,
            index_blocks: m.index_blocks,
            index_bytes: m.index_bytes,
            replica_changes_applied: m.replica_changes_applied,
            replica_changes_rejected: m.replica_changes_rejected,
            replica_requests_active: m.replica_requests_active,
            replicas_live: m.replicas_live,
            replicas_expired: m.replicas_expired,
            events_refused_for_memory: m.events_refused_for_memory,
            replica_changes_unpublished: m.replica_changes_unpublished,
            decisions_priced_again: m.decisions_priced_again,
            sliding_events_applied: m.sliding_events_applied,
            sliding_events_rejected: m.sliding_events_rejected,
            index_sliding_blocks: m.index_sliding_blocks,
            decision_latency: DecisionLatency {
                bounds_ns: m.decision_latency_bounds_ns,
                le: m.decision_latency_le,
                count: m.decision_latency_count,
                sum_ns: m.decision_latency_sum_ns,
            },
        }
    }
}

/// Candidates asked for when the caller's vector has less room: enough for most fleets.
const MIN_CANDIDATES: usize = 64;
/// First capacity tried for overlap scores and potential loads (grown on demand).
const INITIAL_ROWS: usize = 16;

thread_local! {
    /// Rows the last per-rank query on this thread returned: the next one starts with room for
    /// as many, so a fleet of more than INITIAL_ROWS ranks does not pay for every lookup twice
    /// (the library walks the index before it can say the buffer was short).
    static LAST_ROWS: std::cell::Cell<usize> = const { std::cell::Cell::new(INITIAL_ROWS) };
}

/// A per-rank query's rows, starting with room for as many as the thread's last one returned.
fn fill_rows<T>(
    call: impl FnMut(*mut T, usize, *mut usize, *mut *mut sys::kvr_error) -> sys::kvr_status,
) -> Result<Vec<T>> {
    let rows = fill_vec(LAST_ROWS.with(|n| n.get()).max(INITIAL_ROWS), call)?;
    LAST_ROWS.with(|n| n.set(rows.len()));
    Ok(rows)
}

impl RouterRef {
    /// # Safety
    /// `ptr` must be a live `kvr_router` that outlives `'a`.
    pub(crate) unsafe fn from_ptr<'a>(ptr: *mut sys::kvr_router) -> &'a RouterRef {
        &*(ptr as *const RouterRef)
    }

    /// The C handle, for calls through `kvrouter_sys` directly. It stays owned by this
    /// binding: never pass it to `kvr_router_free`.
    pub fn as_raw(&self) -> *mut sys::kvr_router {
        self as *const RouterRef as *mut sys::kvr_router
    }

    // ---- Workers ----

    /// Registers a worker. `AlreadyExists` for a registered id; `InvalidArgument` for a block
    /// size mismatch or a bad rank range.
    pub fn add_worker(&self, config: &WorkerConfig) -> Result<()> {
        let raw = config.to_raw();
        // SAFETY: a live router (concurrent); raw lives across the call.
        call(|err| unsafe { sys::kvr_router_add_worker(self.as_raw(), &raw, err) })
    }

    /// Changes a worker's ranks or capacity. `NotFound` for an unknown id.
    pub fn update_worker(&self, config: &WorkerConfig) -> Result<()> {
        let raw = config.to_raw();
        // SAFETY: as add_worker.
        call(|err| unsafe { sys::kvr_router_update_worker(self.as_raw(), &raw, err) })
    }

    /// Drops the worker's ranks, active requests and index entries. `NotFound` for an
    /// unknown id.
    pub fn remove_worker(&self, worker_id: u64) -> Result<()> {
        // SAFETY: a live router (concurrent).
        call(|err| unsafe { sys::kvr_router_remove_worker(self.as_raw(), worker_id, err) })
    }

    // ---- KV events ----

    /// Applies one stored event. A rejected part is reported (`NotFound`: unknown parent;
    /// `InvalidArgument`: broken sequence or incomplete block) while the rest applies.
    pub fn apply_stored(&self, event: &StoredEvent<'_>) -> Result<()> {
        let lowered = event.lower()?;
        // SAFETY: a live router; every pointer in lowered.raw lives across the call, with the
        // lengths it states (checked by lower()).
        call(|err| unsafe { sys::kvr_router_apply_stored(self.as_raw(), &lowered.raw, err) })
    }

    pub fn apply_removed(&self, event: &RemovedEvent<'_>) -> Result<()> {
        let raw = event.lower();
        // SAFETY: as apply_stored.
        call(|err| unsafe { sys::kvr_router_apply_removed(self.as_raw(), &raw, err) })
    }

    /// The rank (worker_id, dp_rank) lost every block; the worker's other ranks keep theirs
    /// (each rank has a cache of its own). `remove_worker` forgets every rank.
    pub fn apply_cleared(&self, worker_id: u64, dp_rank: u32, event_id: u64) -> Result<()> {
        // SAFETY: a live router (concurrent).
        call(|err| unsafe {
            sys::kvr_router_apply_cleared(self.as_raw(), worker_id, dp_rank, event_id, err)
        })
    }

    /// Applies an encoded FlatBuffers `EventBatch` (e.g. [`EventBatch::encode`]'s output).
    /// Bytes that fail verification change nothing (`InvalidArgument`; empty ones: "event batch
    /// of 0 bytes is too short to be a FlatBuffer").
    ///
    /// [`EventBatch::encode`]: crate::EventBatch::encode
    pub fn apply_event_batch(&self, bytes: &[u8]) -> Result<()> {
        // SAFETY: bytes is borrowed for the call only, as the ABI states.
        call(|err| unsafe {
            sys::kvr_router_apply_event_batch(
                self.as_raw(),
                bytes.as_ptr().cast(),
                bytes.len(),
                err,
            )
        })
    }

    // ---- Router replicas ----

    /// Publishes this router's booking changes (booked, prefill completed, freed), each an
    /// encoded `SequenceChange`, through `publish`, under the name `replica_id` (unique among
    /// the live replicas; `InvalidArgument` if empty or containing byte 0x1F).
    ///
    /// Before this returns, `publish` receives a `Reset`, an `Added` change for every booking
    /// the router holds (its own, not other replicas'), then a `SyncRequest`: applied at a
    /// peer, the Reset drops whatever the peer held from `replica_id` (a restarted replica's
    /// stale bookings), the Added changes replace them, and the SyncRequest makes the peer
    /// answer through its own publisher with a Reset and its bookings (at once, or with its
    /// next heartbeat if it beats every 2 s or less and announced them within that interval:
    /// joins close together share one announcement), so a joining replica converges within
    /// a heartbeat interval. A router holding no bookings thus publishes exactly two messages
    /// here.
    ///
    /// `publish` runs on the thread that made the change (for the announcement above, this
    /// one; for an answer to a peer's SyncRequest, the one applying it, or for joins answered
    /// with the next heartbeat, the one beating, or past their due time the one making a
    /// change, applying any replica change or expiring replicas), under the router's
    /// lock, in order: it must be quick (queue the bytes) and must not call into any router.
    /// A panic in it is caught at the C boundary and resumed when the call that made the
    /// change returns (the first, if it panicked more than once there); one raised during the
    /// announcement is resumed from this call, with the publisher installed. One raised on a
    /// thread where no call of yours waits (an ingest's loop thread) is only printed by the
    /// panic hook. Replaces any previous publisher (or
    /// [`Ingest::sync_replicas`](crate::Ingest::sync_replicas)), which first receives a
    /// farewell Reset (peers drop what they hold from its id) and is dropped before this
    /// returns; the closure of a call that overlapped this one on the same router is dropped
    /// by the next call that starts after both returned, or with the router. See
    /// docs/replicas.md.
    pub fn set_replica_publisher<F>(&self, replica_id: &str, publish: F) -> Result<()>
    where
        F: Fn(&[u8]) + Send + Sync + 'static,
    {
        crate::replica::set(self.as_raw(), Some(replica_id), Some(Box::new(publish)))
    }

    /// Stops publishing booking changes, after a farewell Reset through the publisher (peers drop
    /// what they hold from this replica); once this returns the publisher has finished and is
    /// dropped.
    pub fn clear_replica_publisher(&self) -> Result<()> {
        crate::replica::set(self.as_raw(), None, None)
    }

    /// Applies one change another replica published: its bookings count as load here. A
    /// `Reset` replaces every booking held from its origin by those announced after it (kept
    /// until they have come: docs/replicas.md); a `SyncRequest` (a replica joining)
    /// makes this router answer through its own publisher with a Reset and its bookings
    /// (nothing without a publisher): on this thread, or, while this router beats every 2 s or less
    /// and announced them within its interval, with its next heartbeat. Changes from this router's
    /// own replica id are ignored. `InvalidArgument` for bytes that are not a change (or whose
    /// origin is empty or contains byte 0x1F), `NotFound` for a worker rank this router does not
    /// know, `AlreadyExists` for a booking applied twice.
    pub fn apply_replica_event(&self, change: &[u8]) -> Result<()> {
        // SAFETY: a live router (concurrent); the bytes are borrowed for the call.
        call(|err| unsafe {
            sys::kvr_router_apply_replica_event(
                self.as_raw(),
                change.as_ptr().cast(),
                change.len(),
                err,
            )
        })
    }

    /// Publishes a heartbeat through this router's replica publisher (after an announcement of
    /// every booking if one is due: a lost change's repair, or the answer to joins), promising the
    /// next within `interval_ms` (1..=3,600,000; else `InvalidArgument`). A peer that has heard one
    /// from this replica (or a change published after it: each carries the interval) drops its
    /// bookings there ([`expire_replicas`](Self::expire_replicas)) once it falls silent. Over a
    /// bus of your own, call it every interval;
    /// [`Ingest::sync_replicas`](crate::Ingest::sync_replicas) does it on a timer, the first at
    /// once ([`IngestOptions::replica_heartbeat_ms`](crate::IngestOptions::replica_heartbeat_ms)).
    /// `FailedPrecondition` if the router has no replica publisher.
    pub fn replica_heartbeat(&self, interval_ms: u32) -> Result<()> {
        // SAFETY: a live router (concurrent).
        call(|err| unsafe { sys::kvr_router_replica_heartbeat(self.as_raw(), interval_ms, err) })
    }

    /// Drops the bookings held from every replica that has sent heartbeats and has been heard
    /// from (any change) no later than `timeout` ago on the router's clock (or three of its own
    /// heartbeat intervals, if longer); returns how many replicas were dropped (counted in
    /// [`Metrics::replicas_expired`]). The freed capacity may admit queued requests. A replica
    /// that never sent a heartbeat keeps its bookings until the request expiry; one dropped but
    /// heard again is asked (if this router publishes) to announce its bookings again. It may
    /// publish this router's own bookings, answering joins whose heartbeat did not come: a
    /// caller beating by hand calls it on a timer too. `InvalidArgument` for a zero timeout.
    pub fn expire_replicas(&self, timeout: Duration) -> Result<usize> {
        let mut expired = 0;
        // SAFETY: a live router (concurrent); expired is a valid usize.
        call(|err| unsafe {
            sys::kvr_router_expire_replicas(self.as_raw(), timeout.as_secs_f64(), &mut expired, err)
        })?;
        Ok(expired)
    }

    // ---- Routing ----

    fn route_raw(
        &self,
        tokens: &[u32],
        opts: &RequestOptions<'_>,
        candidates: &mut Vec<sys::kvr_candidate>,
    ) -> Result<(RouteResult, usize)> {
        let mut strs = CStrs::new();
        let (prompt, num_tokens) = opts.prompt(tokens)?;
        // Default options (a plain preview) go as NULL, as a C caller would pass them; others
        // are lowered in place. (An admitted call is never the default: no comparison.)
        let mut raw_opts = MaybeUninit::<sys::kvr_request_options>::uninit();
        let req: *const sys::kvr_request_options =
            if !opts.admit && *opts == RequestOptions::default() {
                ptr::null()
            } else {
                let raw = raw_opts.write(request_template());
                opts.lower_into(raw, &mut strs)?;
                raw
            };
        let mut out = result_template();
        let mut total = 0usize;
        let cap = candidates.capacity();
        // No room asks for no candidates (NULL, as a C caller passes): the library then does
        // not gather them.
        let (cands, total_ptr) = if cap == 0 {
            (ptr::null_mut(), ptr::null_mut())
        } else {
            (candidates.as_mut_ptr(), &mut total as *mut usize)
        };
        // SAFETY: a live router (concurrent); tokens (prompt: NULL or their first), req (and
        // the hashes it points at, borrowed by opts), out and total live across the call; cands
        // is NULL or has room for cap entries.
        let route = |err| unsafe {
            sys::kvr_find_best_match(
                self.as_raw(),
                prompt,
                num_tokens,
                req,
                &mut out,
                cands,
                cap,
                total_ptr,
                err,
            )
        };
        call_routing(opts.admit, route)?;
        // SAFETY: the library wrote min(total, cap) candidates.
        unsafe { candidates.set_len(total.min(cap)) };
        Ok((RouteResult::from(out), total))
    }

    /// Picks the worker rank for a prompt. Without `opts.admit` it changes nothing; with it the
    /// request is booked under `opts.request_id`, after waiting in the admission queue if the
    /// router queues (this thread blocks). Errors: `InvalidArgument`, `AlreadyExists` (id
    /// active or waiting), `Unavailable` (no eligible worker), `DeadlineExceeded` (queue
    /// timeout), `Cancelled` (freed while waiting, or the queue closed by
    /// [`close_queue`](Self::close_queue)).
    pub fn find_best_match(
        &self,
        tokens: &[u32],
        opts: &RequestOptions<'_>,
    ) -> Result<RouteResult> {
        let mut none = Vec::new();
        self.route_raw(tokens, opts, &mut none).map(|(r, _)| r)
    }

    /// [`find_best_match`](Self::find_best_match), also filling `candidates` with every
    /// candidate's cost breakdown. It holds at most `max(candidates.capacity(), 64)` of them
    /// (a decision is never repeated to fetch more); the total is returned beside the result,
    /// so a caller seeing a larger total can reserve that many next time.
    pub fn find_best_match_with_candidates(
        &self,
        tokens: &[u32],
        opts: &RequestOptions<'_>,
        candidates: &mut Vec<Candidate>,
    ) -> Result<(RouteResult, usize)> {
        let mut raw = Vec::with_capacity(candidates.capacity().max(MIN_CANDIDATES));
        let (result, total) = self.route_raw(tokens, opts, &mut raw)?;
        candidates.clear();
        candidates.extend(raw.iter().map(Candidate::from));
        Ok((result, total))
    }

    /// [`find_best_match`](Self::find_best_match) with options lowered beforehand: `prepared`
    /// holds the C options struct, made once by [`PreparedRequest::new`], and this call only
    /// writes `request_id` into it (a NUL-terminated copy in the prepared request's own buffer:
    /// no allocation) before calling `kvr_find_best_match`. The decision, the booking and every
    /// error are those of `find_best_match(tokens, &RequestOptions { request_id:
    /// Some(request_id), ..options })` for the options `prepared` was made from
    /// (`InvalidArgument` for an id with a NUL byte, or an empty one when admitting,
    /// `AlreadyExists` for an id active or waiting, `Unavailable` when no allowed worker is
    /// registered, ...), and, like it, an admitted call on a queueing router may block this
    /// thread. No candidates are returned (use `find_best_match_with_candidates` for those).
    /// A prepared request made from [`prehashed`](RequestOptions::prehashed) options routes
    /// that prompt, from its own copy of the hashes: `tokens` must then be empty.
    ///
    /// ```
    /// # use kvrouter::{PreparedRequest, RequestOptions, Router, RouterOptions, WorkerConfig};
    /// # let router = Router::new(&RouterOptions::default())?;
    /// # router.add_worker(&WorkerConfig::new(1))?;
    /// let mut prepared = PreparedRequest::new(&RequestOptions::admit(""))?;
    /// let prompt: Vec<u32> = (0..48).collect();
    /// let decision = router.find_best_match_prepared(&prompt, &mut prepared, "req-17")?;
    /// assert_eq!((decision.worker_id, decision.booked), (1, true));
    /// router.free_request("req-17")?;
    /// # Ok::<(), kvrouter::Error>(())
    /// ```
    pub fn find_best_match_prepared(
        &self,
        tokens: &[u32],
        prepared: &mut PreparedRequest,
        request_id: &str,
    ) -> Result<RouteResult> {
        let admit = prepared.admits();
        let (prompt, num_tokens) = prepared.prompt(tokens)?;
        let req = prepared.with_id(request_id)?;
        let mut out = result_template();
        // SAFETY: a live router (concurrent); tokens (prompt), req (and the buffers it points
        // into, owned by `prepared`, borrowed for the call) and out live across the call; no
        // candidate buffer (NULL, cap 0).
        let route = |err| unsafe {
            sys::kvr_find_best_match(
                self.as_raw(),
                prompt,
                num_tokens,
                req,
                &mut out,
                ptr::null_mut(),
                0,
                ptr::null_mut(),
                err,
            )
        };
        call_routing(admit, route)?;
        Ok(RouteResult::from(out))
    }

    /// Every rank holding at least the prompt's first block, with what it holds per tier.
    pub fn overlap_scores(
        &self,
        tokens: &[u32],
        opts: &RequestOptions<'_>,
    ) -> Result<Vec<Overlap>> {
        let mut strs = CStrs::new();
        let req = opts.lower(&mut strs)?;
        let (prompt, num_tokens) = opts.prompt(tokens)?;
        let rows = fill_rows(|out, cap, len, err| {
            // SAFETY: a live router (concurrent); tokens (prompt) and req (and the hashes it
            // points at, borrowed by opts) live across the call; out has room for cap rows.
            unsafe {
                sys::kvr_router_overlap_scores(
                    self.as_raw(),
                    prompt,
                    num_tokens,
                    &req,
                    out,
                    cap,
                    len,
                    err,
                )
            }
        })?;
        Ok(rows.iter().map(Overlap::from).collect())
    }

    /// As `overlap_scores`, for a prompt already hashed: `local_hashes` are its blocks'
    /// local hashes ([`crate::compute_block_hashes`]; what engines' KV events and Dynamo's
    /// `find_matches` take). Of `opts` only the cost overrides apply
    /// (`kvr_router_overlap_scores_hashed`).
    pub fn overlap_scores_hashed(
        &self,
        local_hashes: &[u64],
        opts: &RequestOptions<'_>,
    ) -> Result<Vec<Overlap>> {
        let mut strs = CStrs::new();
        let req = opts.lower(&mut strs)?;
        let rows = fill_rows(|out, cap, len, err| {
            // SAFETY: as overlap_scores; local_hashes is read during the call only.
            unsafe {
                sys::kvr_router_overlap_scores_hashed(
                    self.as_raw(),
                    slice_ptr(local_hashes),
                    local_hashes.len(),
                    &req,
                    out,
                    cap,
                    len,
                    err,
                )
            }
        })?;
        Ok(rows.iter().map(Overlap::from).collect())
    }

    /// The index walk alone, Dynamo's `find_matches` contract: every rank holding at least
    /// the first of `local_hashes`, with its depth per tier and tree size, none of the cost
    /// model's figures (`kvr_router_find_matches`; the lean call when the caller scores ranks
    /// itself).
    pub fn find_matches(&self, local_hashes: &[u64]) -> Result<Vec<Match>> {
        let rows = fill_rows(|out, cap, len, err| {
            // SAFETY: a live router (concurrent); out has room for cap rows; local_hashes is
            // read during the call only.
            unsafe {
                sys::kvr_router_find_matches(
                    self.as_raw(),
                    slice_ptr(local_hashes),
                    local_hashes.len(),
                    out,
                    cap,
                    len,
                    err,
                )
            }
        })?;
        Ok(rows.iter().map(Match::from).collect())
    }

    /// The load every registered rank would carry with this prompt.
    pub fn potential_loads(
        &self,
        tokens: &[u32],
        opts: &RequestOptions<'_>,
    ) -> Result<Vec<PotentialLoad>> {
        let mut strs = CStrs::new();
        let req = opts.lower(&mut strs)?;
        let (prompt, num_tokens) = opts.prompt(tokens)?;
        let rows = fill_rows(|out, cap, len, err| {
            // SAFETY: as overlap_scores.
            unsafe {
                sys::kvr_router_potential_loads(
                    self.as_raw(),
                    prompt,
                    num_tokens,
                    &req,
                    out,
                    cap,
                    len,
                    err,
                )
            }
        })?;
        Ok(rows.iter().map(PotentialLoad::from).collect())
    }

    // ---- Request lifecycle ----

    /// Books a request on a rank chosen elsewhere (`opts.request_id` required). `NotFound` for
    /// an unregistered rank, `AlreadyExists` for an active id.
    pub fn add_request(
        &self,
        tokens: &[u32],
        worker_id: u64,
        dp_rank: u32,
        opts: &RequestOptions<'_>,
    ) -> Result<()> {
        let mut strs = CStrs::new();
        let req = opts.lower(&mut strs)?;
        let (prompt, num_tokens) = opts.prompt(tokens)?;
        // SAFETY: a live router (concurrent); tokens (prompt) and req (and the hashes it points
        // at, borrowed by opts) live across the call.
        call(|err| unsafe {
            sys::kvr_router_add_request(
                self.as_raw(),
                prompt,
                num_tokens,
                worker_id,
                dp_rank,
                &req,
                err,
            )
        })
    }

    /// The request produced its first token. An unknown id is no error.
    pub fn mark_prefill_completed(&self, request_id: &str) -> Result<()> {
        let mut strs = CStrs::new();
        let id = strs.push("request_id", request_id)?;
        // SAFETY: a live router (concurrent); id lives across the call.
        call(|err| unsafe { sys::kvr_router_mark_prefill_completed(self.as_raw(), id, err) })
    }

    /// The request has generated `output_tokens` tokens so far (cumulative: call it as the
    /// stream goes, e.g. once per block of output). Its rank then holds one more, unshared,
    /// block each time prompt + output crosses a block boundary, until the request is freed.
    /// `FailedPrecondition` unless the router was created with
    /// [`RouterOptions::track_output_blocks`]; an unknown id is no error. Not published to
    /// router replicas.
    pub fn record_output(&self, request_id: &str, output_tokens: u64) -> Result<()> {
        let mut strs = CStrs::new();
        let id = strs.push("request_id", request_id)?;
        // SAFETY: as mark_prefill_completed.
        call(|err| unsafe { sys::kvr_router_record_output(self.as_raw(), id, output_tokens, err) })
    }

    /// The request ended (finished, cancelled or failed). An unknown id is no error.
    pub fn free_request(&self, request_id: &str) -> Result<()> {
        let mut strs = CStrs::new();
        let id = strs.push("request_id", request_id)?;
        // SAFETY: as mark_prefill_completed.
        call(|err| unsafe { sys::kvr_router_free_request(self.as_raw(), id, err) })
    }

    /// For a shutdown: closes the admission queue for good (`kvr_router_close_queue`). Every
    /// request waiting in it is cancelled (its `find_best_match*`, `plan_route` or `Disagg`
    /// routing call, blocked on another thread, returns `Cancelled`), and from now on a request
    /// that would wait fails with `Cancelled` at once; one admitted at once is still routed and
    /// booked, and previews, frees and every other call work as before. Returns how many were
    /// waiting; idempotent (0 the second time).
    ///
    /// Dropping a [`Router`] (or a [`Disagg`](crate::Disagg)) cannot race a call on it (the
    /// borrow checker sees to that), so `Drop` does not need this. A server whose threads share
    /// an `Arc<Router>` calls it when it shuts down, so that no thread stays blocked in the
    /// queue (without a [`RequestOptions::queue_timeout`], for good) holding its clone of the
    /// `Arc`; for a `Disagg`, on both pools.
    ///
    /// ```
    /// # use kvrouter::{Router, RouterOptions};
    /// # let router = Router::new(&RouterOptions::default())?;
    /// assert_eq!(router.close_queue()?, 0); // nothing was waiting
    /// # Ok::<(), kvrouter::Error>(())
    /// ```
    ///
    /// [`RequestOptions::queue_timeout`]: crate::RequestOptions::queue_timeout
    pub fn close_queue(&self) -> Result<u64> {
        let mut cancelled = 0u64;
        // SAFETY: a live router (concurrent); cancelled is a valid u64.
        call(|err| unsafe { sys::kvr_router_close_queue(self.as_raw(), &mut cancelled, err) })?;
        Ok(cancelled)
    }

    // ---- Index snapshot ----

    /// The whole KV index as a FlatBuffers `IndexSnapshot`.
    pub fn snapshot(&self) -> Result<Buffer> {
        let mut out = ptr::null_mut();
        // SAFETY: a live router (concurrent); out is written on success only.
        call(|err| unsafe { sys::kvr_router_snapshot(self.as_raw(), &mut out, err) })?;
        // SAFETY: a buffer the call returned, now ours.
        unsafe { Buffer::from_raw(out) }
    }

    /// Loads a snapshot into a router whose index is empty (else `FailedPrecondition`; of two
    /// restores at once, one loads its snapshot and the other gets that). A bad buffer, or one
    /// of another block size, changes nothing (`InvalidArgument`); an empty one is
    /// `InvalidArgument` "index snapshot of 0 bytes is too short to be a FlatBuffer", as
    /// [`apply_event_batch`](Self::apply_event_batch) and
    /// [`apply_replica_event`](Self::apply_replica_event) say for theirs.
    pub fn restore(&self, snapshot: &[u8]) -> Result<()> {
        // SAFETY: a live router (concurrent); the bytes are borrowed for the call. An empty
        // slice's pointer is dangling but not NULL (the library reads none of its 0 bytes), so
        // the library reports the size, as for an event batch, not a NULL pointer.
        call(|err| unsafe {
            sys::kvr_router_restore(self.as_raw(), snapshot.as_ptr().cast(), snapshot.len(), err)
        })
    }

    // ---- Metrics ----

    pub fn metrics(&self) -> Result<Metrics> {
        let mut out = init::<sys::kvr_metrics>();
        // SAFETY: a live router (concurrent); out is an initialised struct.
        call(|err| unsafe { sys::kvr_router_get_metrics(self.as_raw(), &mut out, err) })?;
        Ok(Metrics::from(out))
    }

    /// The metrics in Prometheus text exposition format (with per-worker load gauges).
    pub fn metrics_prometheus(&self) -> Result<String> {
        let mut bytes = fill_vec::<u8>(4096, |out, cap, len, err| {
            // SAFETY: a live router (concurrent); out has room for cap bytes.
            unsafe { sys::kvr_router_metrics_prometheus(self.as_raw(), out.cast(), cap, len, err) }
        })?;
        if bytes.last() == Some(&0) {
            bytes.pop();
        }
        String::from_utf8(bytes)
            .map_err(|_| Error::new(Code::Internal, "the Prometheus text is not UTF-8"))
    }

    // ---- Staged routing ----

    /// What routing would pick, changing nothing (no admission, booking, approximate-mode
    /// record, or session binding made or refreshed). `opts.admit` is ignored.
    pub fn preview_route(
        &self,
        tokens: &[u32],
        opts: &RequestOptions<'_>,
        hints: Option<&RoutingHints<'_>>,
    ) -> Result<RouteSignals> {
        let mut strs = CStrs::new();
        let req = opts.lower(&mut strs)?;
        let (prompt, num_tokens) = opts.prompt(tokens)?;
        let hints = lower_hints(hints)?;
        let mut out = init::<sys::kvr_route_signals>();
        // SAFETY: a live router (concurrent); every input lives across the call.
        call(|err| unsafe {
            sys::kvr_preview_route(
                self.as_raw(),
                prompt,
                num_tokens,
                &req,
                hints_ptr(&hints),
                &mut out,
                err,
            )
        })?;
        Ok(RouteSignals::from(out))
    }

    /// Books the request (`opts.request_id` required) as a plan, keeping `previewed`'s rank
    /// while it is still a candidate. Waits in the admission queue like an admitted
    /// `find_best_match`. Planning an id with a live plan returns that plan.
    pub fn plan_route(
        &self,
        tokens: &[u32],
        opts: &RequestOptions<'_>,
        hints: Option<&RoutingHints<'_>>,
        previewed: Option<&RouteSignals>,
    ) -> Result<RouteSignals> {
        let mut strs = CStrs::new();
        let req = opts.lower(&mut strs)?;
        let (prompt, num_tokens) = opts.prompt(tokens)?;
        let hints = lower_hints(hints)?;
        let previewed = previewed.map(|p| p.to_raw());
        let mut out = init::<sys::kvr_route_signals>();
        // SAFETY: as preview_route.
        call(|err| unsafe {
            sys::kvr_plan_route(
                self.as_raw(),
                prompt,
                num_tokens,
                &req,
                hints_ptr(&hints),
                previewed.as_ref().map_or(ptr::null(), |p| p as *const _),
                &mut out,
                err,
            )
        })?;
        Ok(RouteSignals::from(out))
    }

    /// The plan was dispatched. `NotFound`: no plan (never made, aborted, freed or past its
    /// deadline); `FailedPrecondition`: its worker was removed (plan again).
    pub fn commit_route(&self, request_id: &str) -> Result<()> {
        let mut strs = CStrs::new();
        let id = strs.push("request_id", request_id)?;
        // SAFETY: a live router (concurrent); id lives across the call.
        call(|err| unsafe { sys::kvr_commit_route(self.as_raw(), id, err) })
    }

    /// Frees the plan, its booking or its queue place; true if anything was freed.
    pub fn abort_route(&self, request_id: &str) -> Result<bool> {
        let mut strs = CStrs::new();
        let id = strs.push("request_id", request_id)?;
        let mut freed = 0;
        // SAFETY: as commit_route; freed is a valid int.
        call(|err| unsafe { sys::kvr_abort_route(self.as_raw(), id, &mut freed, err) })?;
        Ok(freed != 0)
    }

    /// How long a plan may wait for commit or abort before it is dropped with its booking
    /// (default 30 s; applies to plans made afterwards). `InvalidArgument` for zero.
    pub fn set_plan_deadline(&self, deadline: Duration) -> Result<()> {
        // SAFETY: a live router (concurrent).
        call(|err| unsafe {
            sys::kvr_router_set_plan_deadline(self.as_raw(), deadline.as_secs_f64(), err)
        })
    }

    /// Drives the router's clock by hand from now on, for simulations and tests in which time
    /// passes at their own pace: everything the router times (request expiry, plan deadlines,
    /// session bindings, approximate-mode TTLs, queue order, the prefill rates of
    /// [`CostFunction::PredictedTtft`](crate::CostFunction::PredictedTtft)) then sees `now_ns`
    /// (nanoseconds from any origin) plus a fixed offset chosen at the first call, so that the
    /// router's time continues from where it was: only differences matter. Until the first
    /// call the router reads the process's monotonic clock. `InvalidArgument` if `now_ns` is
    /// earlier than the last time set, or would take the router's time past +-2^62 ns (146
    /// years).
    pub fn set_time(&self, now_ns: i64) -> Result<()> {
        // SAFETY: a live router (concurrent).
        call(|err| unsafe { sys::kvr_router_set_time(self.as_raw(), now_ns, err) })
    }

    /// Drops requests booked longer than `request_expiry_seconds` ago (their free was lost) and
    /// plans past their deadline, then admits the queued requests that now fit; returns how many
    /// requests were dropped. The router has no timer thread: with a queue threshold, call this
    /// periodically (every second, say), or a lost request can keep the queue waiting until a
    /// routing call sweeps it.
    pub fn expire_requests(&self) -> Result<usize> {
        let mut expired = 0;
        // SAFETY: a live router (concurrent).
        call(|err| unsafe { sys::kvr_router_expire_requests(self.as_raw(), &mut expired, err) })?;
        Ok(expired)
    }

    /// Drops plans past their deadline now; returns how many.
    pub fn expire_plans(&self) -> Result<usize> {
        let mut expired = 0;
        // SAFETY: a live router (concurrent).
        call(|err| unsafe { sys::kvr_router_expire_plans(self.as_raw(), &mut expired, err) })?;
        Ok(expired)
    }

    /// The `(worker_id, dp_rank)` a live session is bound to (without refreshing it); None if
    /// it is unbound or expired.
    pub fn session_binding(&self, session_id: &str) -> Result<Option<(u64, u32)>> {
        let mut strs = CStrs::new();
        let id = strs.push("session_id", session_id)?;
        let (mut worker, mut rank) = (0u64, 0u32);
        // SAFETY: a live router (concurrent); id and the out values live across the call.
        let result = call(|err| unsafe {
            sys::kvr_router_session_binding(self.as_raw(), id, &mut worker, &mut rank, err)
        });
        match result {
            Ok(()) => Ok(Some((worker, rank))),
            Err(e) if e.code() == Code::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Unbinds a session (no error if unbound).
    pub fn close_session(&self, session_id: &str) -> Result<()> {
        let mut strs = CStrs::new();
        let id = strs.push("session_id", session_id)?;
        // SAFETY: a live router (concurrent); id lives across the call.
        call(|err| unsafe { sys::kvr_router_close_session(self.as_raw(), id, err) })
    }

    /// Drops expired session bindings now; returns how many.
    pub fn reclaim_sessions(&self) -> Result<usize> {
        let mut reclaimed = 0;
        // SAFETY: a live router (concurrent).
        call(|err| unsafe {
            sys::kvr_router_reclaim_sessions(self.as_raw(), &mut reclaimed, err)
        })?;
        Ok(reclaimed)
    }

    /// A digest of all routing state (index, active requests, queue, plans, sessions): equal
    /// digests mean nothing changed. Stable within one process only.
    pub fn state_digest(&self) -> Result<u64> {
        let mut digest = 0;
        // SAFETY: a live router (concurrent).
        call(|err| unsafe { sys::kvr_router_state_digest(self.as_raw(), &mut digest, err) })?;
        Ok(digest)
    }

    /// A digest of the KV index alone: which worker and rank holds which block, on which tier,
    /// under which prefix. Unlike [`state_digest`](Self::state_digest) it is equal across
    /// processes and machines running the same library version when their indexes hold the same
    /// blocks, so replicas can compare their views; bookings, the queue, plans and sessions do
    /// not enter it (except in approximate mode, where the index is the routing decisions
    /// recorded when admitted or committed). It may change between library versions.
    pub fn index_digest(&self) -> Result<u64> {
        let mut digest = 0;
        // SAFETY: a live router (concurrent).
        call(|err| unsafe { sys::kvr_router_index_digest(self.as_raw(), &mut digest, err) })?;
        Ok(digest)
    }
}
