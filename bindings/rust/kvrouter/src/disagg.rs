//! Disaggregated prefill / decode (`kvr_disagg`): a prefill pool and a decode pool, each a
//! full router, with conditional disaggregation.

use std::fmt;
use std::ptr::{self, NonNull};

use kvrouter_sys as sys;

use crate::error::{call, Code, Error, Result};
use crate::options::{hints_ptr, lower_hints, RequestOptions, RouterOptions, RoutingHints};
use crate::raw::init;
use crate::router::{RouteSignals, RouterRef};
use crate::util::CStrs;

/// When a prompt is prefilled on the decode worker instead of a prefill worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DisaggPolicy {
    /// Always prefill remotely when prefill workers exist (the default).
    #[default]
    Always,
    /// Locally when the uncached prompt is short.
    IslBounding,
    /// Locally when the chosen prefill worker is busy.
    PrefillLoad,
    /// Either condition.
    IslOrLoad,
}

/// Settings of a [`Disagg`] (`kvr_disagg_options`); `Default` is the library's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DisaggOptions {
    pub policy: DisaggPolicy,
    /// No prefill workers is `FailedPrecondition` instead of running aggregated.
    pub enforce: bool,
    /// isl_bounding: local when prompt − cached (on the decode worker) is at most this
    /// (default 512) ...
    pub max_local_prefill_tokens: u64,
    /// ... and (prompt − cached) / prompt at most this (default 1.0).
    pub max_local_prefill_ratio: f64,
    /// prefill_load: busy when the chosen prefill rank's prefill tokens exceed this ×
    /// its max_num_batched_tokens (default 1.0).
    pub prefill_busy_threshold: f64,
    /// The decode-busy guard: never prefill locally on a decode rank whose decode blocks
    /// exceed this fraction of its total_kv_blocks. None (default): the signal is unavailable,
    /// so never prefill locally.
    pub decode_busy_threshold: Option<f64>,
}

impl Default for DisaggOptions {
    fn default() -> Self {
        let raw = init::<sys::kvr_disagg_options>();
        DisaggOptions {
            policy: match raw.policy {
                sys::KVR_DISAGG_ISL_BOUNDING => DisaggPolicy::IslBounding,
                sys::KVR_DISAGG_PREFILL_LOAD => DisaggPolicy::PrefillLoad,
                sys::KVR_DISAGG_ISL_OR_LOAD => DisaggPolicy::IslOrLoad,
                _ => DisaggPolicy::Always,
            },
            enforce: raw.enforce != 0,
            max_local_prefill_tokens: raw.max_local_prefill_tokens,
            max_local_prefill_ratio: raw.max_local_prefill_ratio,
            prefill_busy_threshold: raw.prefill_busy_threshold,
            decode_busy_threshold: (raw.decode_busy_threshold >= 0.0)
                .then_some(raw.decode_busy_threshold),
        }
    }
}

impl DisaggOptions {
    pub(crate) fn to_raw(self) -> sys::kvr_disagg_options {
        let mut raw = init::<sys::kvr_disagg_options>();
        raw.policy = match self.policy {
            DisaggPolicy::Always => sys::KVR_DISAGG_ALWAYS,
            DisaggPolicy::IslBounding => sys::KVR_DISAGG_ISL_BOUNDING,
            DisaggPolicy::PrefillLoad => sys::KVR_DISAGG_PREFILL_LOAD,
            DisaggPolicy::IslOrLoad => sys::KVR_DISAGG_ISL_OR_LOAD,
        };
        raw.enforce = u32::from(self.enforce);
        raw.max_local_prefill_tokens = self.max_local_prefill_tokens;
        raw.max_local_prefill_ratio = self.max_local_prefill_ratio;
        raw.prefill_busy_threshold = self.prefill_busy_threshold;
        raw.decode_busy_threshold = self.decode_busy_threshold.unwrap_or(-1.0);
        raw
    }
}

/// Why a prompt is (or is not) prefilled remotely.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PrefillReason {
    /// Booked on a prefill worker.
    Remote,
    /// Empty prefill pool: run aggregated on the decode pool.
    NoPrefillWorkers,
    /// Policy: the uncached prompt is short.
    ShortIsl,
    /// Policy: the prefill pool is busy.
    WorkerBusy,
    Other(u32),
}

/// Where a prompt is prefilled (`kvr_prefill_result`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillResult {
    /// Prefill on `worker_id` / `dp_rank` (booked on the prefill pool: free it there when
    /// the prefill ends); false: prefill on the decode worker.
    pub remote: bool,
    pub reason: PrefillReason,
    pub worker_id: u64,
    pub dp_rank: u32,
    /// The bootstrap room id of a remote prefill (uniform in [0, i64::MAX]).
    pub bootstrap_room: Option<i64>,
    pub cached_tokens: u64,
}

impl From<sys::kvr_prefill_result> for PrefillResult {
    fn from(r: sys::kvr_prefill_result) -> Self {
        PrefillResult {
            remote: r.remote != 0,
            reason: match r.reason {
                sys::KVR_PREFILL_REMOTE => PrefillReason::Remote,
                sys::KVR_PREFILL_NO_PREFILL_WORKERS => PrefillReason::NoPrefillWorkers,
                sys::KVR_PREFILL_SHORT_ISL => PrefillReason::ShortIsl,
                sys::KVR_PREFILL_WORKER_BUSY => PrefillReason::WorkerBusy,
                other => PrefillReason::Other(other),
            },
            worker_id: r.worker_id,
            dp_rank: r.dp_rank,
            bootstrap_room: (r.bootstrap_room >= 0).then_some(r.bootstrap_room),
            cached_tokens: r.cached_tokens,
        }
    }
}

/// A prefill pool and a decode pool (`kvr_disagg`), each a full router: add workers, apply
/// events, and mark and free requests through [`prefill_router`](Self::prefill_router) and
/// [`decode_router`](Self::decode_router). A shutdown with threads routing through a shared
/// `Disagg` (an `Arc`) closes both pools' admission queues first
/// ([`RouterRef::close_queue`](crate::RouterRef::close_queue) on each pool), so that no
/// `route_prefill`, `route_decode` or pool routing call stays blocked in one.
pub struct Disagg(NonNull<sys::kvr_disagg>);

// SAFETY: every kvr_disagg function is tagged `concurrent` except kvr_disagg_free, which only
// Drop calls, with ownership; the pool routers it hands out are `concurrent` too.
unsafe impl Send for Disagg {}
// SAFETY: as above; &Disagg reaches only `concurrent` functions.
unsafe impl Sync for Disagg {}

impl Disagg {
    /// Creates both pools with their router options, and the disaggregation settings.
    pub fn new(
        prefill: &RouterOptions,
        decode: &RouterOptions,
        options: &DisaggOptions,
    ) -> Result<Disagg> {
        crate::check_version()?;
        let (p, d, o) = (prefill.to_raw(), decode.to_raw(), options.to_raw());
        let mut out = ptr::null_mut();
        // SAFETY: complete option structs; out is written on success only.
        call(|err| unsafe { sys::kvr_disagg_new(&p, &d, &o, &mut out, err) })?;
        NonNull::new(out)
            .map(Disagg)
            .ok_or_else(|| Error::new(Code::Internal, "kvr_disagg_new gave NULL"))
    }

    fn as_ptr(&self) -> *mut sys::kvr_disagg {
        self.0.as_ptr()
    }

    /// The prefill pool's router, owned by this object. An [`Ingest`](crate::Ingest) feeding
    /// it keeps the `Disagg` alive ([`Ingest::with_shared_disagg`](crate::Ingest::with_shared_disagg))
    /// or borrows the pool for a scope ([`Ingest::scope`](crate::Ingest::scope)).
    pub fn prefill_router(&self) -> &RouterRef {
        // SAFETY: the pool lives as long as the disagg object, hence as long as &self.
        unsafe { RouterRef::from_ptr(sys::kvr_disagg_prefill_router(self.as_ptr())) }
    }

    /// The decode pool's router, owned by this object (an ingest object for it: as for
    /// [`prefill_router`](Self::prefill_router)).
    pub fn decode_router(&self) -> &RouterRef {
        // SAFETY: as prefill_router.
        unsafe { RouterRef::from_ptr(sys::kvr_disagg_decode_router(self.as_ptr())) }
    }

    /// Decides where the prompt is prefilled and, when remote, books a prefill rank under
    /// `opts.request_id`. Prefill pins from `hints` apply.
    pub fn route_prefill(
        &self,
        tokens: &[u32],
        opts: &RequestOptions<'_>,
        hints: Option<&RoutingHints<'_>>,
    ) -> Result<PrefillResult> {
        let mut strs = CStrs::new();
        let req = opts.lower(&mut strs)?;
        let (prompt, num_tokens) = opts.prompt(tokens)?;
        let hints = lower_hints(hints)?;
        let mut out = init::<sys::kvr_prefill_result>();
        // SAFETY: a live disagg (concurrent); every input lives across the call.
        call(|err| unsafe {
            sys::kvr_disagg_route_prefill(
                self.as_ptr(),
                prompt,
                num_tokens,
                &req,
                hints_ptr(&hints),
                &mut out,
                err,
            )
        })?;
        Ok(PrefillResult::from(out))
    }

    /// Selects and books the decode rank (`opts.request_id` required). After a remote
    /// prefill the decode overrides are forced (overlap credit 0, no KV reuse, no prefill
    /// tracking). Decode pins from `hints` apply.
    pub fn route_decode(
        &self,
        tokens: &[u32],
        opts: &RequestOptions<'_>,
        hints: Option<&RoutingHints<'_>>,
        remote_prefill: bool,
    ) -> Result<RouteSignals> {
        let mut strs = CStrs::new();
        let req = opts.lower(&mut strs)?;
        let (prompt, num_tokens) = opts.prompt(tokens)?;
        let hints = lower_hints(hints)?;
        let mut out = init::<sys::kvr_route_signals>();
        // SAFETY: as route_prefill.
        call(|err| unsafe {
            sys::kvr_disagg_route_decode(
                self.as_ptr(),
                prompt,
                num_tokens,
                &req,
                hints_ptr(&hints),
                i32::from(remote_prefill),
                &mut out,
                err,
            )
        })?;
        Ok(RouteSignals::from(out))
    }

    /// Advisory: would the prefill rank chosen now carry more than `threshold` ×
    /// max_num_batched_tokens prefill tokens? No eligible rank counts as busy.
    pub fn prefill_worker_busy(
        &self,
        tokens: &[u32],
        opts: &RequestOptions<'_>,
        threshold: f64,
    ) -> Result<bool> {
        let mut strs = CStrs::new();
        let req = opts.lower(&mut strs)?;
        let (prompt, num_tokens) = opts.prompt(tokens)?;
        let mut busy = 0;
        // SAFETY: as route_prefill.
        call(|err| unsafe {
            sys::kvr_disagg_prefill_worker_busy(
                self.as_ptr(),
                prompt,
                num_tokens,
                &req,
                threshold,
                &mut busy,
                err,
            )
        })?;
        Ok(busy != 0)
    }
}

impl fmt::Debug for Disagg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Disagg").field(&self.0).finish()
    }
}

impl Drop for Disagg {
    fn drop(&mut self) {
        // SAFETY: owned; Drop has exclusive access, and borrows of its pools have ended.
        let pools = unsafe {
            [
                sys::kvr_disagg_prefill_router(self.as_ptr()),
                sys::kvr_disagg_decode_router(self.as_ptr()),
            ]
        };
        // The pools' publisher closures leave the table first, while the addresses are still
        // the pools' (as for a Router: replica::take_before_free).
        let closures = crate::replica::take_before_free(&pools);
        // SAFETY: as above.
        unsafe { sys::kvr_disagg_free(self.as_ptr()) }
        drop(closures);
    }
}
