//! Settings passed into the library: router options, worker configurations, per-request
//! options and routing hints. Each is plain Rust data; it is lowered to its C struct (starting
//! from the C `_init` defaults) for the duration of one call.

use std::ffi::CString;
use std::time::Duration;

use kvrouter_sys as sys;

use crate::error::{Error, Result};
use crate::raw::{init, Template};
use crate::util::{opt_cstring, opt_ptr, slice_ptr, CStrs, Multimodal};

/// How the admission queue orders waiting requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum QueuePolicy {
    /// First come, first served (the default).
    #[default]
    Fcfs,
    /// Last come, first served.
    Lcfs,
    /// Weighted shortest processing time first.
    Wspt,
}

impl QueuePolicy {
    fn raw(self) -> sys::kvr_queue_policy {
        match self {
            QueuePolicy::Fcfs => sys::KVR_QUEUE_FCFS,
            QueuePolicy::Lcfs => sys::KVR_QUEUE_LCFS,
            QueuePolicy::Wspt => sys::KVR_QUEUE_WSPT,
        }
    }
    fn from_raw(raw: sys::kvr_queue_policy) -> QueuePolicy {
        match raw {
            sys::KVR_QUEUE_LCFS => QueuePolicy::Lcfs,
            sys::KVR_QUEUE_WSPT => QueuePolicy::Wspt,
            _ => QueuePolicy::Fcfs,
        }
    }
}

/// How the router prices a candidate rank (`kvr_cost_function`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CostFunction {
    /// Dynamo's credit form: prefill blocks less the cache credit, plus decode blocks (the
    /// default).
    #[default]
    Credit,
    /// The seconds until the prompt's first token: the rank's prefill backlog and the prompt's
    /// uncached tokens over its learnt prefill rate
    /// (see [`RouterOptions::cost_function`]).
    PredictedTtft,
}

impl CostFunction {
    pub(crate) fn raw(self) -> sys::kvr_cost_function {
        match self {
            CostFunction::Credit => sys::KVR_COST_CREDIT,
            CostFunction::PredictedTtft => sys::KVR_COST_PREDICTED_TTFT,
        }
    }
    fn from_raw(raw: sys::kvr_cost_function) -> CostFunction {
        match raw {
            sys::KVR_COST_PREDICTED_TTFT => CostFunction::PredictedTtft,
            _ => CostFunction::Credit,
        }
    }
}

/// Every router-wide setting (`kvr_router_options`; Dynamo's KvRouterConfig).
/// `Default` is the library's defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterOptions {
    /// Tokens per KV block (default 16); every worker must match.
    pub block_size: u32,
    /// Approximate mode: no KV events; routing decisions are recorded as cached blocks.
    pub approximate: bool,
    /// Assume a request reuses its KV blocks (default true; false = `KVR_ROUTER_NO_KV_REUSE`).
    pub assume_kv_reuse: bool,
    /// Count prefill tokens in flight (default true; false = `KVR_ROUTER_NO_PREFILL_TRACKING`).
    pub track_prefill_tokens: bool,
    /// The model uses eagle block windows.
    pub eagle: bool,
    /// Seed the random source from the OS rather than `random_seed`.
    pub entropy_seed: bool,
    /// Grow a request's blocks as it generates, from [`RouterRef::record_output`]
    /// (`KVR_ROUTER_TRACK_OUTPUT_BLOCKS`; Dynamo's `router_track_output_blocks`). Default false.
    ///
    /// [`RouterRef::record_output`]: crate::RouterRef::record_output
    pub track_output_blocks: bool,
    pub queue_policy: QueuePolicy,
    /// Default 1.0.
    pub overlap_score_credit: f64,
    /// Default 1.0.
    pub prefill_load_scale: f64,
    /// Default 0.75.
    pub host_cache_hit_weight: f64,
    /// Default 0.25 (disk and external tiers).
    pub disk_cache_hit_weight: f64,
    /// Default 0: argmin with a random tie-break; above 0, softmax sampling.
    pub temperature: f64,
    /// Queue when every rank's prefill tokens exceed this × max_num_batched_tokens; None
    /// (the default) never queues.
    pub queue_threshold: Option<f64>,
    /// Approximate mode's block TTL (default 120 s).
    pub approx_ttl_seconds: f64,
    /// Approximate mode's budget in blocks (default 2^20).
    pub approx_max_blocks: u64,
    /// Approximate mode prunes to this fraction of the budget (default 0.8).
    pub approx_prune_target_ratio: f64,
    /// A booked request older than this is dropped (default 300 s).
    pub request_expiry_seconds: f64,
    /// Default 0; ignored with `entropy_seed`.
    pub random_seed: u64,
    /// Default 0 (off): a rank's device credit is multiplied by
    /// 1 / (1 + decay × its prefill backlog beyond the least loaded rank's, in prompt blocks).
    pub overlap_score_credit_decay: f64,
    /// Default 0 (off): adds weight × active requests to each rank's cost.
    pub decode_active_request_weight: f64,
    /// Trees the KV index splits the workers over, 1..=64 (default 1). Events of workers in
    /// different trees apply in parallel (one writer lock per tree), so several threads applying
    /// events scale; every lookup walks every tree (on the Mooncake trace 2 trees cost 1.4x a
    /// lookup, 4 cost 2.3x). Passed on as set, like every field: 0 or above 64 makes
    /// [`Router::new`](crate::Router::new) fail with `InvalidArgument` naming `index_shards`.
    pub index_shards: u32,
    /// How a candidate rank is priced (default [`CostFunction::Credit`], Dynamo's).
    /// [`CostFunction::PredictedTtft`] prices each rank as the seconds until this prompt's
    /// first token: (its prefill tokens in flight + the prompt's uncached tokens) / the prefill
    /// rate, learnt from the time between booking and
    /// [`mark_prefill_completed`](crate::RouterRef::mark_prefill_completed) of every request
    /// (one rate for the fleet), plus `ttft_miss_weight`
    /// × the uncached tokens' own time. The credit-form weights do not apply; it needs
    /// `track_prefill_tokens`.
    pub cost_function: CostFunction,
    /// [`CostFunction::PredictedTtft`]: the prefill rate (prompt tokens per second) assumed
    /// before the first completion; default 0 = unknown (every rank equally fast until one
    /// completes).
    pub prefill_tokens_per_second: f64,
    /// [`CostFunction::PredictedTtft`]: the weight of the uncached tokens' own time, the delay
    /// a miss adds for the requests that will queue behind it. Default 3; finite, >= 0.
    ///
    /// ```
    /// assert_eq!(kvrouter::RouterOptions::default().ttft_miss_weight, 3.0);
    /// ```
    pub ttft_miss_weight: f64,
}

impl Default for RouterOptions {
    fn default() -> Self {
        RouterOptions::from_raw(&init::<sys::kvr_router_options>())
    }
}

impl RouterOptions {
    /// The options a C struct holds (the library's defaults, for `Default`).
    pub(crate) fn from_raw(raw: &sys::kvr_router_options) -> Self {
        RouterOptions {
            block_size: raw.block_size,
            approximate: raw.flags & sys::KVR_ROUTER_APPROXIMATE != 0,
            assume_kv_reuse: raw.flags & sys::KVR_ROUTER_NO_KV_REUSE == 0,
            track_prefill_tokens: raw.flags & sys::KVR_ROUTER_NO_PREFILL_TRACKING == 0,
            eagle: raw.flags & sys::KVR_ROUTER_EAGLE != 0,
            entropy_seed: raw.flags & sys::KVR_ROUTER_ENTROPY_SEED != 0,
            track_output_blocks: raw.flags & sys::KVR_ROUTER_TRACK_OUTPUT_BLOCKS != 0,
            queue_policy: QueuePolicy::from_raw(raw.queue_policy),
            overlap_score_credit: raw.overlap_score_credit,
            prefill_load_scale: raw.prefill_load_scale,
            host_cache_hit_weight: raw.host_cache_hit_weight,
            disk_cache_hit_weight: raw.disk_cache_hit_weight,
            temperature: raw.temperature,
            queue_threshold: (raw.queue_threshold >= 0.0).then_some(raw.queue_threshold),
            approx_ttl_seconds: raw.approx_ttl_seconds,
            approx_max_blocks: raw.approx_max_blocks,
            approx_prune_target_ratio: raw.approx_prune_target_ratio,
            request_expiry_seconds: raw.request_expiry_seconds,
            random_seed: raw.random_seed,
            overlap_score_credit_decay: raw.overlap_score_credit_decay,
            decode_active_request_weight: raw.decode_active_request_weight,
            index_shards: raw.index_shards,
            cost_function: CostFunction::from_raw(raw.cost_function),
            prefill_tokens_per_second: raw.prefill_tokens_per_second,
            ttft_miss_weight: raw.ttft_miss_weight,
        }
    }

    /// The defaults with another block size.
    pub fn with_block_size(block_size: u32) -> Self {
        RouterOptions {
            block_size,
            ..Default::default()
        }
    }

    pub(crate) fn to_raw(&self) -> sys::kvr_router_options {
        let mut raw = init::<sys::kvr_router_options>();
        let mut flags = 0;
        for (on, flag) in [
            (self.approximate, sys::KVR_ROUTER_APPROXIMATE),
            (!self.assume_kv_reuse, sys::KVR_ROUTER_NO_KV_REUSE),
            (
                !self.track_prefill_tokens,
                sys::KVR_ROUTER_NO_PREFILL_TRACKING,
            ),
            (self.eagle, sys::KVR_ROUTER_EAGLE),
            (self.entropy_seed, sys::KVR_ROUTER_ENTROPY_SEED),
            (
                self.track_output_blocks,
                sys::KVR_ROUTER_TRACK_OUTPUT_BLOCKS,
            ),
        ] {
            if on {
                flags |= flag;
            }
        }
        raw.block_size = self.block_size;
        raw.flags = flags;
        raw.queue_policy = self.queue_policy.raw();
        raw.overlap_score_credit = self.overlap_score_credit;
        raw.prefill_load_scale = self.prefill_load_scale;
        raw.host_cache_hit_weight = self.host_cache_hit_weight;
        raw.disk_cache_hit_weight = self.disk_cache_hit_weight;
        raw.temperature = self.temperature;
        raw.queue_threshold = self.queue_threshold.unwrap_or(-1.0);
        raw.approx_ttl_seconds = self.approx_ttl_seconds;
        raw.approx_max_blocks = self.approx_max_blocks;
        raw.approx_prune_target_ratio = self.approx_prune_target_ratio;
        raw.request_expiry_seconds = self.request_expiry_seconds;
        raw.random_seed = self.random_seed;
        raw.overlap_score_credit_decay = self.overlap_score_credit_decay;
        raw.decode_active_request_weight = self.decode_active_request_weight;
        raw.index_shards = self.index_shards;
        raw.cost_function = self.cost_function.raw();
        raw.prefill_tokens_per_second = self.prefill_tokens_per_second;
        raw.ttft_miss_weight = self.ttft_miss_weight;
        raw
    }
}

/// One worker (`kvr_worker_config`): its id, data-parallel ranks and capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerConfig {
    pub worker_id: u64,
    /// 0 = the router's; otherwise it must equal it.
    pub block_size: u32,
    /// First data-parallel rank (default 0).
    pub dp_start: u32,
    /// Number of ranks (default 1).
    pub dp_size: u32,
    /// KV capacity in blocks; 0 = not reported.
    pub total_kv_blocks: u64,
    /// 0 = not reported (the queue then assumes 10,000,000).
    pub max_num_batched_tokens: u64,
}

impl WorkerConfig {
    /// Worker `worker_id` with the library's defaults (one rank, capacity not reported).
    pub fn new(worker_id: u64) -> Self {
        let raw = init::<sys::kvr_worker_config>();
        WorkerConfig {
            worker_id,
            block_size: raw.block_size,
            dp_start: raw.dp_start,
            dp_size: raw.dp_size,
            total_kv_blocks: raw.total_kv_blocks,
            max_num_batched_tokens: raw.max_num_batched_tokens,
        }
    }

    pub(crate) fn to_raw(self) -> sys::kvr_worker_config {
        let mut raw = init::<sys::kvr_worker_config>();
        raw.block_size = self.block_size;
        raw.worker_id = self.worker_id;
        raw.dp_start = self.dp_start;
        raw.dp_size = self.dp_size;
        raw.total_kv_blocks = self.total_kv_blocks;
        raw.max_num_batched_tokens = self.max_num_batched_tokens;
        raw
    }
}

/// Per-request options (`kvr_request_options`). Every `None` keeps the router's setting;
/// `Default` is a query-only request with no id.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RequestOptions<'a> {
    /// Book the request under `request_id` (`KVR_REQUEST_ADMIT`); without it
    /// `find_best_match` changes nothing.
    pub admit: bool,
    /// Required with `admit`, and for `add_request`, plans and disaggregated routing.
    pub request_id: Option<&'a str>,
    pub lora_name: Option<&'a str>,
    pub cache_namespace: Option<&'a str>,
    pub multimodal: Option<Multimodal<'a>>,
    /// Restrict the candidates to these workers (and bypass the admission queue). `None` (the
    /// default): every worker. `Some` is an allow-list even empty (lowered with
    /// `KVR_REQUEST_ALLOW_LIST` then; a non-empty list needs no flag, so it works with a 0.2
    /// library from before the flag): `Some(&[])` allows no worker, so a call that would pick one (routing, a preview,
    /// a plan, [`Disagg::route_prefill`](crate::Disagg::route_prefill) /
    /// [`route_decode`](crate::Disagg::route_decode)) fails with `Unavailable` and books
    /// nothing, as does a list naming only unregistered workers;
    /// [`potential_loads`](crate::RouterRef::potential_loads) returns no rows, and
    /// [`Disagg::prefill_worker_busy`](crate::Disagg::prefill_worker_busy) says busy.
    pub allowed_worker_ids: Option<&'a [u64]>,
    pub overlap_score_credit: Option<f64>,
    pub prefill_load_scale: Option<f64>,
    pub host_cache_hit_weight: Option<f64>,
    pub disk_cache_hit_weight: Option<f64>,
    pub temperature: Option<f64>,
    pub assume_kv_reuse: Option<bool>,
    pub track_prefill_tokens: Option<bool>,
    /// Queue priority boost (default 0).
    pub priority_jump: Option<f64>,
    pub expected_output_tokens: Option<u32>,
    /// Give up waiting in the admission queue after this long (`None`, the default: never).
    /// Sent to C in whole milliseconds rounded up, so any wait shorter than a millisecond
    /// waits one (only `Duration::ZERO` is 0 ms: give up unless admitted at once); a duration
    /// past `i64::MAX` milliseconds is sent as -1, "never".
    pub queue_timeout: Option<Duration>,
    /// [`RouterOptions::overlap_score_credit_decay`] for this request.
    pub overlap_score_credit_decay: Option<f64>,
    /// [`RouterOptions::decode_active_request_weight`] for this request.
    pub decode_active_request_weight: Option<f64>,
    /// [`RouterOptions::cost_function`] for this request.
    pub cost_function: Option<CostFunction>,
    /// [`RouterOptions::ttft_miss_weight`] for this request.
    pub ttft_miss_weight: Option<f64>,
    /// The prompt given as its local block hashes instead of its tokens
    /// (`KVR_REQUEST_PREHASHED`; [`prehashed`](Self::prehashed) sets it): every call taking
    /// `tokens` and these options (routing, previews, plans, `add_request`, `overlap_scores`,
    /// `potential_loads`, the [`Disagg`](crate::Disagg) calls) then takes empty `tokens`
    /// (`InvalidArgument` otherwise) and hashes nothing; the decision, booking and prices are
    /// those of the tokens hashed. `lora_name`, `cache_namespace` and `multimodal` are not read:
    /// they are in the hashes already. `None`: the prompt is the call's tokens.
    pub prehashed: Option<PrehashedPrompt<'a>>,
}

/// A prompt its caller hashed ([`RequestOptions::prehashed`]): a gateway that hashes once for
/// several routers, or whose tokenizer service hands it hashes, routes without its tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrehashedPrompt<'a> {
    /// One local hash per complete block of the prompt: [`compute_block_hashes`] of its tokens
    /// with the router's block size and the request's [`HashOptions`] (LoRA, namespace,
    /// multimodal content, eagle windows). `InvalidArgument` unless there is exactly one per
    /// complete block of `num_tokens` tokens (none for a prompt shorter than a block).
    ///
    /// [`compute_block_hashes`]: crate::compute_block_hashes
    /// [`HashOptions`]: crate::HashOptions
    pub local_hashes: &'a [u64],
    /// The prompt's length in tokens (its partial last block included).
    pub num_tokens: usize,
}

impl<'a> RequestOptions<'a> {
    /// A request to book under `request_id` (`admit` set).
    pub fn admit(request_id: &'a str) -> Self {
        RequestOptions {
            admit: true,
            request_id: Some(request_id),
            ..Default::default()
        }
    }

    /// A request carrying `request_id` without `admit` (what plans, `add_request` and the
    /// disaggregated calls take).
    pub fn with_id(request_id: &'a str) -> Self {
        RequestOptions {
            request_id: Some(request_id),
            ..Default::default()
        }
    }

    /// These options with the prompt given as its local hashes and its length in tokens (see
    /// [`PrehashedPrompt`]); the calls then take empty `tokens`. The hashes are borrowed for as
    /// long as the options, so they outlive every call the options are passed to.
    ///
    /// ```
    /// # use kvrouter::{compute_block_hashes, HashOptions, RequestOptions, Router, RouterOptions};
    /// # let router = Router::new(&RouterOptions::with_block_size(16))?;
    /// # router.add_worker(&kvrouter::WorkerConfig::new(1))?;
    /// let prompt: Vec<u32> = (0..40).collect();
    /// // 2 complete blocks: 2 hashes (with the request's LoRA, namespace, ... if it has any).
    /// let hashes = compute_block_hashes(&prompt, 16, &HashOptions::default())?;
    /// let opts = RequestOptions::admit("req-1").prehashed(&hashes, prompt.len());
    /// let decision = router.find_best_match(&[], &opts)?;
    /// assert_eq!((decision.prompt_tokens, decision.prompt_blocks), (40, 2));
    /// router.free_request("req-1")?;
    /// # Ok::<(), kvrouter::Error>(())
    /// ```
    pub fn prehashed(self, local_hashes: &'a [u64], num_tokens: usize) -> Self {
        RequestOptions {
            prehashed: Some(PrehashedPrompt {
                local_hashes,
                num_tokens,
            }),
            ..self
        }
    }

    /// A call's prompt as C takes it: `tokens`, or with [`prehashed`](Self::prehashed) NULL
    /// and the prompt's length (the hashes travel in the lowered options). Tokens beside the
    /// hashes are refused here, as the library would refuse them.
    pub(crate) fn prompt(&self, tokens: &[u32]) -> Result<(*const u32, usize)> {
        prompt_arg(tokens, self.prehashed.map(|p| p.num_tokens))
    }

    /// The options as C reads them; their strings are copied into `strs`, which must outlive
    /// the call the result is passed to (no heap allocation for the usual short ones).
    pub(crate) fn lower(&self, strs: &mut CStrs) -> Result<sys::kvr_request_options> {
        let mut raw = request_template();
        self.lower_into(&mut raw, strs)?;
        Ok(raw)
    }

    /// [`lower`](Self::lower) in place: sets `raw`, a copy of [`request_template`], to the
    /// options (no copy of the struct on the way back: it is a quarter of a KiB).
    pub(crate) fn lower_into(
        &self,
        raw: &mut sys::kvr_request_options,
        strs: &mut CStrs,
    ) -> Result<()> {
        if self.admit {
            raw.flags |= sys::KVR_REQUEST_ADMIT;
        }
        raw.request_id = strs.push_opt("request_id", self.request_id)?;
        raw.lora_name = strs.push_opt("lora_name", self.lora_name)?;
        raw.cache_namespace = strs.push_opt("cache_namespace", self.cache_namespace)?;
        if let Some(mm) = &self.multimodal {
            mm.check("request options", None)?;
            raw.mm_hashes = slice_ptr(mm.hashes);
            raw.mm_counts = slice_ptr(mm.counts);
            raw.mm_num_blocks = mm.counts.len();
        }
        if let Some(ids) = self.allowed_worker_ids {
            // A list even when empty: without the flag C reads length 0 as "every worker". Only
            // then: a library from before the flag refuses it (an unknown bit), and a non-empty
            // list means the same with or without it.
            if ids.is_empty() {
                raw.flags |= sys::KVR_REQUEST_ALLOW_LIST;
            }
            raw.allowed_worker_ids = slice_ptr(ids);
            raw.num_allowed_worker_ids = ids.len();
        }
        if let Some(p) = self.prehashed {
            raw.flags |= sys::KVR_REQUEST_PREHASHED;
            raw.local_hashes = slice_ptr(p.local_hashes);
            raw.num_local_hashes = p.local_hashes.len();
        }
        let doubles = [
            (self.overlap_score_credit, &mut raw.overlap_score_credit),
            (self.prefill_load_scale, &mut raw.prefill_load_scale),
            (self.host_cache_hit_weight, &mut raw.host_cache_hit_weight),
            (self.disk_cache_hit_weight, &mut raw.disk_cache_hit_weight),
            (self.temperature, &mut raw.temperature),
            (self.priority_jump, &mut raw.priority_jump),
            (
                self.overlap_score_credit_decay,
                &mut raw.overlap_score_credit_decay,
            ),
            (
                self.decode_active_request_weight,
                &mut raw.decode_active_request_weight,
            ),
            (self.ttft_miss_weight, &mut raw.ttft_miss_weight),
        ];
        for (value, field) in doubles {
            if let Some(v) = value {
                *field = v;
            }
        }
        if let Some(b) = self.assume_kv_reuse {
            raw.assume_kv_reuse = i32::from(b);
        }
        if let Some(b) = self.track_prefill_tokens {
            raw.track_prefill_tokens = i32::from(b);
        }
        if let Some(f) = self.cost_function {
            // The two values are 0 and 1: always within i32.
            raw.cost_function = f.raw() as i32;
        }
        if let Some(n) = self.expected_output_tokens {
            raw.expected_output_tokens = n;
        }
        if let Some(t) = self.queue_timeout {
            raw.queue_timeout_ms = queue_timeout_ms(t);
        }
        Ok(())
    }
}

/// `kvr_request_options.queue_timeout_ms` for a timeout: whole milliseconds rounded up (a
/// 500 µs wait is 1 ms, not 0 ms, which gives up at once), and -1 ("never") for one too long
/// for an `int64_t` of milliseconds (the library takes any wait past about 146 years for no
/// limit anyway).
pub(crate) fn queue_timeout_ms(t: Duration) -> i64 {
    i64::try_from(t.as_nanos().div_ceil(1_000_000)).unwrap_or(-1)
}

/// A call's `tokens, num_tokens` arguments: the tokens, or for a prompt given hashed (its
/// length `prehashed_tokens`) NULL and that length; `InvalidArgument` for tokens beside hashes.
pub(crate) fn prompt_arg(
    tokens: &[u32],
    prehashed_tokens: Option<usize>,
) -> Result<(*const u32, usize)> {
    match prehashed_tokens {
        None => Ok((slice_ptr(tokens), tokens.len())),
        Some(_) if !tokens.is_empty() => Err(Error::invalid(
            "the prompt is given either as tokens or as RequestOptions::prehashed, not both: \
             tokens must be empty",
        )),
        Some(num_tokens) => Ok((std::ptr::null(), num_tokens)),
    }
}

/// `kvr_request_options` as `_init` leaves it (made once, copied afterwards).
pub(crate) fn request_template() -> sys::kvr_request_options {
    static TEMPLATE: Template<sys::kvr_request_options> = Template::new();
    TEMPLATE.get()
}

/// Which pins of [`RoutingHints`] apply.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Phase {
    /// `worker_id` / `dp_rank`.
    #[default]
    Aggregated,
    /// `prefill_worker_id` (else `worker_id`) with `prefill_dp_rank` (else `dp_rank`).
    Prefill,
    /// `decode_worker_id` (else `worker_id`) with `dp_rank`.
    Decode,
}

/// How a session binding applies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SessionMode {
    /// The bound rank is the exact target (rebound if it is gone). The default.
    #[default]
    Hard,
    /// The bound rank is preferred while eligible; rebound on dispatch.
    Soft,
}

/// Where a request may or should run (`kvr_routing_hints`): per-phase pins and session
/// affinity. `Default` pins nothing and has no session.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RoutingHints<'a> {
    pub phase: Phase,
    pub worker_id: Option<u64>,
    pub prefill_worker_id: Option<u64>,
    pub decode_worker_id: Option<u64>,
    /// None = any rank of the pinned worker.
    pub dp_rank: Option<u32>,
    pub prefill_dp_rank: Option<u32>,
    pub session_id: Option<&'a str>,
    pub session_mode: SessionMode,
    /// Sliding TTL of the session binding (default 300 s).
    pub session_ttl: Option<Duration>,
}

impl RoutingHints<'_> {
    pub(crate) fn lower(&self) -> Result<LoweredHints> {
        let mut raw = init::<sys::kvr_routing_hints>();
        let session = opt_cstring("session_id", self.session_id)?;
        let rank = |r: Option<u32>| -> Result<i32> {
            r.map_or(Ok(-1), |r| {
                i32::try_from(r).map_err(|_| Error::invalid(format!("dp_rank {r} is too large")))
            })
        };
        raw.phase = match self.phase {
            Phase::Aggregated => sys::KVR_PHASE_AGGREGATED,
            Phase::Prefill => sys::KVR_PHASE_PREFILL,
            Phase::Decode => sys::KVR_PHASE_DECODE,
        };
        raw.worker_id = self.worker_id.unwrap_or(sys::KVR_WORKER_NONE);
        raw.prefill_worker_id = self.prefill_worker_id.unwrap_or(sys::KVR_WORKER_NONE);
        raw.decode_worker_id = self.decode_worker_id.unwrap_or(sys::KVR_WORKER_NONE);
        raw.dp_rank = rank(self.dp_rank)?;
        raw.prefill_dp_rank = rank(self.prefill_dp_rank)?;
        raw.session_id = opt_ptr(&session);
        raw.session_mode = match self.session_mode {
            SessionMode::Hard => sys::KVR_SESSION_HARD,
            SessionMode::Soft => sys::KVR_SESSION_SOFT,
        };
        if let Some(ttl) = self.session_ttl {
            raw.session_ttl_seconds = ttl.as_secs_f64();
        }
        Ok(LoweredHints {
            raw,
            _session: session,
        })
    }
}

pub(crate) struct LoweredHints {
    pub(crate) raw: sys::kvr_routing_hints,
    _session: Option<CString>,
}

/// Lowers optional hints; the pointer is NULL for None.
pub(crate) fn lower_hints(hints: Option<&RoutingHints<'_>>) -> Result<Option<LoweredHints>> {
    hints.map(RoutingHints::lower).transpose()
}

pub(crate) fn hints_ptr(h: &Option<LoweredHints>) -> *const sys::kvr_routing_hints {
    h.as_ref().map_or(std::ptr::null(), |h| &h.raw)
}
