"""The option and event types: plain dataclasses, lowered onto the C structs by the extension.

Defaults are the library's own: each is read at import from the struct's sized ``_init``
(``kvr_router_options_init`` and so on), so none is restated here. Each type's ``_fields()``
names the C fields it sets; the extension sets them, by name, on a struct freshly initialised
with the size it was compiled with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _native
from ._abi import (
    JETSTREAM_CREATE_STREAM,
    JETSTREAM_RESUME,
    REMOVED_SLIDING,
    REQUEST_ADMIT,
    ROUTER_APPROXIMATE,
    ROUTER_EAGLE,
    ROUTER_ENTROPY_SEED,
    ROUTER_NO_KV_REUSE,
    ROUTER_NO_PREFILL_TRACKING,
    ROUTER_TRACK_OUTPUT_BLOCKS,
    STORED_EAGLE,
    STORED_HAS_PARENT,
    WORKER_NONE,
    CostFunction,
    DisaggPolicy,
    Engine,
    Phase,
    QueuePolicy,
    SessionMode,
    Tier,
)

Ints = Sequence[int]
"""Integers: a list or tuple, an ``array.array`` or a numpy array (read in place when its items
are 4-byte unsigned for tokens, 8-byte unsigned for hashes), or any iterable."""

_ROUTER = _native.defaults("kvr_router_options")
_WORKER = _native.defaults("kvr_worker_config")
_HINTS = _native.defaults("kvr_routing_hints")
_DISAGG = _native.defaults("kvr_disagg_options")
_INGEST = _native.defaults("kvr_ingest_options")
_ENGINE = _native.defaults("kvr_engine_worker")
_JETSTREAM = _native.defaults("kvr_jetstream_source")


def _flatten_mm(
    mm_hashes: Optional[Sequence[Optional[Sequence[int]]]],
) -> Tuple[Optional[List[int]], Optional[List[int]]]:
    """Per-block multimodal hashes -> (one flat list, a count per block), as the C structs take."""
    if mm_hashes is None:
        return None, None
    flat: List[int] = []
    counts: List[int] = []
    for block in mm_hashes:
        block = () if block is None else block
        flat.extend(block)
        counts.append(len(block))
    return flat, counts


@dataclass
class RouterOptions:
    """Every router-wide setting (``kvr_router_options``, Dynamo's KvRouterConfig).

    The booleans are the ``KVR_ROUTER_*`` flags (``assume_kv_reuse`` and ``track_prefill_tokens``
    are the negations of ``NO_KV_REUSE`` and ``NO_PREFILL_TRACKING``); every number keeps the C
    field's name and unit, with the library's default.
    """

    block_size: int = _ROUTER["block_size"]
    approximate: bool = False
    assume_kv_reuse: bool = True
    track_prefill_tokens: bool = True
    eagle: bool = False
    entropy_seed: bool = False
    track_output_blocks: bool = False
    queue_policy: QueuePolicy = QueuePolicy(_ROUTER["queue_policy"])
    overlap_score_credit: float = _ROUTER["overlap_score_credit"]
    prefill_load_scale: float = _ROUTER["prefill_load_scale"]
    host_cache_hit_weight: float = _ROUTER["host_cache_hit_weight"]
    disk_cache_hit_weight: float = _ROUTER["disk_cache_hit_weight"]
    temperature: float = _ROUTER["temperature"]
    queue_threshold: float = _ROUTER["queue_threshold"]
    approx_ttl_seconds: float = _ROUTER["approx_ttl_seconds"]
    approx_max_blocks: int = _ROUTER["approx_max_blocks"]
    approx_prune_target_ratio: float = _ROUTER["approx_prune_target_ratio"]
    request_expiry_seconds: float = _ROUTER["request_expiry_seconds"]
    random_seed: int = _ROUTER["random_seed"]
    overlap_score_credit_decay: float = _ROUTER["overlap_score_credit_decay"]
    decode_active_request_weight: float = _ROUTER["decode_active_request_weight"]
    index_shards: int = _ROUTER["index_shards"]
    #: How a candidate rank is priced: ``CREDIT`` (the default, Dynamo's credit form) or
    #: ``PREDICTED_TTFT``, the seconds until the prompt's first token: (the rank's prefill tokens
    #: in flight + the prompt's uncached tokens) / the fleet's prefill rate, learnt from the
    #: time between booking and ``mark_prefill_completed`` of every request, plus
    #: ``ttft_miss_weight`` x the uncached tokens' own time. It needs ``track_prefill_tokens``.
    cost_function: CostFunction = CostFunction(_ROUTER["cost_function"])
    #: ``PREDICTED_TTFT``: the prefill rate (prompt tokens per second) assumed before the first
    #: completion; 0 (the default) = unknown, every rank equally fast until one completes.
    prefill_tokens_per_second: float = _ROUTER["prefill_tokens_per_second"]
    #: ``PREDICTED_TTFT``: the weight of a miss's own prefill time (the delay it adds for the
    #: requests queueing behind it); default 3, finite and >= 0.
    ttft_miss_weight: float = _ROUTER["ttft_miss_weight"]

    def _fields(self) -> Dict[str, Any]:
        flags = (
            (ROUTER_APPROXIMATE if self.approximate else 0)
            | (0 if self.assume_kv_reuse else ROUTER_NO_KV_REUSE)
            | (0 if self.track_prefill_tokens else ROUTER_NO_PREFILL_TRACKING)
            | (ROUTER_EAGLE if self.eagle else 0)
            | (ROUTER_ENTROPY_SEED if self.entropy_seed else 0)
            | (ROUTER_TRACK_OUTPUT_BLOCKS if self.track_output_blocks else 0)
        )
        return {
            "block_size": self.block_size,
            "flags": flags,
            "queue_policy": int(self.queue_policy),
            "overlap_score_credit": self.overlap_score_credit,
            "prefill_load_scale": self.prefill_load_scale,
            "host_cache_hit_weight": self.host_cache_hit_weight,
            "disk_cache_hit_weight": self.disk_cache_hit_weight,
            "temperature": self.temperature,
            "queue_threshold": self.queue_threshold,
            "approx_ttl_seconds": self.approx_ttl_seconds,
            "approx_max_blocks": self.approx_max_blocks,
            "approx_prune_target_ratio": self.approx_prune_target_ratio,
            "request_expiry_seconds": self.request_expiry_seconds,
            "random_seed": self.random_seed,
            "overlap_score_credit_decay": self.overlap_score_credit_decay,
            "decode_active_request_weight": self.decode_active_request_weight,
            "index_shards": self.index_shards,
            "cost_function": int(self.cost_function),
            "prefill_tokens_per_second": self.prefill_tokens_per_second,
            "ttft_miss_weight": self.ttft_miss_weight,
        }


@dataclass
class WorkerConfig:
    """A worker and its data-parallel ranks (``kvr_worker_config``). ``block_size`` 0 is the
    router's; ``total_kv_blocks`` and ``max_num_batched_tokens`` 0 are "not reported"."""

    worker_id: int
    block_size: int = _WORKER["block_size"]
    dp_start: int = _WORKER["dp_start"]
    dp_size: int = _WORKER["dp_size"]
    total_kv_blocks: int = _WORKER["total_kv_blocks"]
    max_num_batched_tokens: int = _WORKER["max_num_batched_tokens"]

    def _fields(self) -> Dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "block_size": self.block_size,
            "dp_start": self.dp_start,
            "dp_size": self.dp_size,
            "total_kv_blocks": self.total_kv_blocks,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }


def _override(value: Optional[float]) -> float:
    return math.nan if value is None else float(value)


def _tristate(value: Optional[bool]) -> int:
    return -1 if value is None else int(bool(value))


_LONGEST_MS = (1 << 63) - 1


def _queue_timeout_ms(seconds: Optional[float]) -> int:
    """The ABI's queue_timeout_ms: -1 (never) for None or an infinite wait, else the seconds
    rounded up to whole milliseconds (a 0.4 ms wait is 1 ms, not 0: giving up at once), at most
    the int64 field's largest. A product within a rounding error of a whole millisecond is that
    millisecond: 2.007 s (2007.0000000000002 ms in floating point) is 2007 ms, not 2008."""
    if seconds is None or seconds == math.inf:
        return -1
    if math.isnan(seconds):
        raise ValueError("queue_timeout must be a number of seconds or None, not NaN")
    if seconds <= 0:
        return 0
    if seconds >= _LONGEST_MS / 1000:
        return _LONGEST_MS
    ms = float(seconds) * 1000
    nearest = round(ms)
    if abs(ms - nearest) <= 1e-9 * max(1.0, ms):
        return min(nearest, _LONGEST_MS)
    return min(math.ceil(ms), _LONGEST_MS)


@dataclass(frozen=True)
class RequestOptions:
    """Per-request options (``kvr_request_options``). ``None`` overrides keep the router's
    setting. Frozen: it is lowered to C once, on first use, and reused by every call it is
    passed to (build one per kind of request, change one with ``dataclasses.replace``).

    ``admit`` books the request under ``request_id`` (the routing calls' ``request_id=``
    keyword does the same for one call). ``mm_hashes`` has one sequence of multimodal hashes
    per block (empty or None for a block without any). ``allowed_worker_ids`` restricts the
    candidates: None allows every worker, an empty sequence none (a routing call then raises
    :class:`UnavailableError`). ``queue_timeout`` is in seconds, rounded up to whole
    milliseconds (None: wait for as long as the queue holds the request).
    """

    admit: bool = False
    request_id: Optional[str] = None
    lora_name: Optional[str] = None
    cache_namespace: Optional[str] = None
    mm_hashes: Optional[Sequence[Optional[Sequence[int]]]] = None
    allowed_worker_ids: Optional[Sequence[int]] = None
    overlap_score_credit: Optional[float] = None
    prefill_load_scale: Optional[float] = None
    host_cache_hit_weight: Optional[float] = None
    disk_cache_hit_weight: Optional[float] = None
    temperature: Optional[float] = None
    assume_kv_reuse: Optional[bool] = None
    track_prefill_tokens: Optional[bool] = None
    priority_jump: float = 0.0
    expected_output_tokens: int = 0
    queue_timeout: Optional[float] = None
    overlap_score_credit_decay: Optional[float] = None
    decode_active_request_weight: Optional[float] = None
    cost_function: Optional[CostFunction] = None
    ttft_miss_weight: Optional[float] = None

    def _fields(self) -> Dict[str, Any]:
        return {
            "flags": REQUEST_ADMIT if self.admit else 0,
            "overlap_score_credit": _override(self.overlap_score_credit),
            "prefill_load_scale": _override(self.prefill_load_scale),
            "host_cache_hit_weight": _override(self.host_cache_hit_weight),
            "disk_cache_hit_weight": _override(self.disk_cache_hit_weight),
            "temperature": _override(self.temperature),
            "assume_kv_reuse": _tristate(self.assume_kv_reuse),
            "track_prefill_tokens": _tristate(self.track_prefill_tokens),
            "priority_jump": float(self.priority_jump),
            "expected_output_tokens": self.expected_output_tokens,
            "queue_timeout_ms": _queue_timeout_ms(self.queue_timeout),
            "overlap_score_credit_decay": _override(self.overlap_score_credit_decay),
            "decode_active_request_weight": _override(self.decode_active_request_weight),
            "cost_function": -1 if self.cost_function is None else int(self.cost_function),
            "ttft_miss_weight": _override(self.ttft_miss_weight),
        }

    @cached_property
    def _c(self) -> Any:
        """The lowered C struct (an extension object holding what it points at)."""
        flat, counts = _flatten_mm(self.mm_hashes)
        return _native.Request(
            self._fields(), self.request_id, self.lora_name, self.cache_namespace, flat, counts,
            None if self.allowed_worker_ids is None else list(self.allowed_worker_ids),
        )


@dataclass(frozen=True)
class RoutingHints:
    """Where a request may or should run (``kvr_routing_hints``): per-phase pins (None = no
    pin; a pin without a rank takes the best of the worker's ranks) and session affinity.
    Frozen and lowered once, as :class:`RequestOptions`."""

    phase: Phase = Phase(_HINTS["phase"])
    worker_id: Optional[int] = None
    prefill_worker_id: Optional[int] = None
    decode_worker_id: Optional[int] = None
    dp_rank: Optional[int] = None
    prefill_dp_rank: Optional[int] = None
    session_id: Optional[str] = None
    session_mode: SessionMode = SessionMode(_HINTS["session_mode"])
    session_ttl_seconds: float = _HINTS["session_ttl_seconds"]

    def _fields(self) -> Dict[str, Any]:
        def pin(v: Optional[int]) -> int:
            return WORKER_NONE if v is None else v

        return {
            "phase": int(self.phase),
            "worker_id": pin(self.worker_id),
            "prefill_worker_id": pin(self.prefill_worker_id),
            "decode_worker_id": pin(self.decode_worker_id),
            "dp_rank": -1 if self.dp_rank is None else self.dp_rank,
            "prefill_dp_rank": -1 if self.prefill_dp_rank is None else self.prefill_dp_rank,
            "session_mode": int(self.session_mode),
            "session_ttl_seconds": float(self.session_ttl_seconds),
        }

    @cached_property
    def _c(self) -> Any:
        return _native.Hints(self._fields(), self.session_id)


@dataclass
class DisaggOptions:
    """The disaggregation policy (``kvr_disagg_options``); see docs/lifecycle.md."""

    policy: DisaggPolicy = DisaggPolicy(_DISAGG["policy"])
    enforce: bool = bool(_DISAGG["enforce"])
    max_local_prefill_tokens: int = _DISAGG["max_local_prefill_tokens"]
    max_local_prefill_ratio: float = _DISAGG["max_local_prefill_ratio"]
    prefill_busy_threshold: float = _DISAGG["prefill_busy_threshold"]
    decode_busy_threshold: float = _DISAGG["decode_busy_threshold"]

    def _fields(self) -> Dict[str, Any]:
        return {
            "policy": int(self.policy),
            "enforce": int(self.enforce),
            "max_local_prefill_tokens": self.max_local_prefill_tokens,
            "max_local_prefill_ratio": self.max_local_prefill_ratio,
            "prefill_busy_threshold": self.prefill_busy_threshold,
            "decode_busy_threshold": self.decode_busy_threshold,
        }


@dataclass
class IngestOptions:
    """Settings of an ingest object (``kvr_ingest_options``)."""

    max_frame_bytes: int = _INGEST["max_frame_bytes"]
    replay_timeout_ms: int = _INGEST["replay_timeout_ms"]
    # Replica liveness for Ingest.sync_replicas: a heartbeat every replica_heartbeat_ms (default
    # 1000, 0 = none), and the bookings of a replica silent for replica_timeout_ms dropped
    # (default 10000, 0 = never); at most 3,600,000 each.
    replica_heartbeat_ms: int = _INGEST["replica_heartbeat_ms"]
    replica_timeout_ms: int = _INGEST["replica_timeout_ms"]

    def _fields(self) -> Dict[str, Any]:
        return {"max_frame_bytes": self.max_frame_bytes, "replay_timeout_ms": self.replay_timeout_ms,
                "replica_heartbeat_ms": self.replica_heartbeat_ms, "replica_timeout_ms": self.replica_timeout_ms}


@dataclass
class EngineWorker:
    """A vLLM or SGLang worker publishing KV events over ZMQ (``kvr_engine_worker``): rank
    ``dp_start + r`` publishes on the endpoint's port + r. ``replay_endpoint`` is vLLM's replay
    socket (None: missed messages clear the worker instead)."""

    endpoint: str
    worker_id: int
    engine: Engine = Engine(_ENGINE["engine"])
    dp_start: int = _ENGINE["dp_start"]
    dp_size: int = _ENGINE["dp_size"]
    block_size: int = _ENGINE["block_size"]
    eagle: bool = False
    topic: Optional[str] = None
    replay_endpoint: Optional[str] = None

    def _fields(self) -> Dict[str, Any]:
        return {
            "engine": int(self.engine),
            "worker_id": self.worker_id,
            "dp_start": self.dp_start,
            "dp_size": self.dp_size,
            "block_size": self.block_size,
            "flags": STORED_EAGLE if self.eagle else 0,
        }


@dataclass
class _JetStreamSource:
    """The value fields of a ``kvr_jetstream_source`` (:meth:`Ingest.subscribe_jetstream`'s
    keyword arguments; its strings are passed apart), from the library's defaults."""

    start_sequence: int = _JETSTREAM["start_sequence"]
    resume: bool = False
    create_stream: bool = False
    max_age_seconds: float = _JETSTREAM["max_age_seconds"]
    max_bytes: int = _JETSTREAM["max_bytes"]

    def _fields(self) -> Dict[str, Any]:
        return {
            "flags": (JETSTREAM_RESUME if self.resume else 0) | (JETSTREAM_CREATE_STREAM if self.create_stream else 0),
            "start_sequence": self.start_sequence,
            "max_age_seconds": self.max_age_seconds,
            "max_bytes": self.max_bytes,
        }


@dataclass
class StoredEvent:
    """Blocks newly cached by one worker rank, consecutive along one sequence
    (``kvr_stored_event``): each block's engine hash, and either its tokens (``token_ids``,
    block_size per block, concatenated) or its precomputed local hash (``local_hashes``).
    ``parent_hash`` None: the first block starts a sequence. ``mm_hashes`` has one sequence of
    multimodal hashes per block.

    ``sliding_window_tokens`` > 0 makes it a hybrid model's sliding-window store instead
    (docs/ingest.md, "Sliding windows"): the blocks KV-cache group ``sliding_group`` (the engine's
    group index; its window is ``sliding_window_tokens``) now holds, by engine hash, each one the
    rank holds in full attention under that hash (the others are skipped: ``NotFoundError``). A
    prefix is then cached on the rank only where its sliding-window groups also hold the blocks
    before the prefix's end that their windows need, as the engine counts it. Such a store names
    ``block_hashes`` only, on ``Tier.DEVICE``: a parent, local hashes, tokens, eagle, a LoRA name,
    a namespace or multimodal hashes raise ``InvalidArgumentError``. The default, 0, is a
    full-attention store (leave ``sliding_group`` 0 then)."""

    worker_id: int
    block_hashes: Ints
    token_ids: Optional[Ints] = None
    local_hashes: Optional[Ints] = None
    parent_hash: Optional[int] = None
    dp_rank: int = 0
    event_id: int = 0
    tier: Tier = Tier.DEVICE
    lora_name: Optional[str] = None
    cache_namespace: Optional[str] = None
    mm_hashes: Optional[Sequence[Optional[Sequence[int]]]] = None
    eagle: bool = False
    sliding_group: int = 0
    sliding_window_tokens: int = 0

    def _args(self) -> Tuple[Any, ...]:
        flags = (STORED_HAS_PARENT if self.parent_hash is not None else 0) | (STORED_EAGLE if self.eagle else 0)
        fields = {
            "worker_id": self.worker_id,
            "dp_rank": self.dp_rank,
            "event_id": self.event_id,
            "tier": int(self.tier),
            "flags": flags,
            "parent_hash": 0 if self.parent_hash is None else self.parent_hash,
            "sliding_group": self.sliding_group,
            "sliding_window_tokens": self.sliding_window_tokens,
        }
        flat, counts = _flatten_mm(self.mm_hashes)
        return (fields, self.block_hashes, self.local_hashes, self.token_ids, self.lora_name,
                self.cache_namespace, flat, counts)


@dataclass
class RemovedEvent:
    """Blocks a worker rank evicted, by engine hash (``kvr_removed_event``).

    ``sliding_group`` None (the default): full attention let them go. An index: a hybrid model's
    sliding-window KV-cache group of that index did (``KVR_REMOVED_SLIDING``; docs/ingest.md,
    "Sliding windows"), and the rank's full-attention blocks stay (a window lets go of a block
    long before full attention does)."""

    worker_id: int
    block_hashes: Ints
    dp_rank: int = 0
    event_id: int = 0
    tier: Tier = Tier.DEVICE
    sliding_group: Optional[int] = None

    def _args(self) -> Tuple[Any, ...]:
        fields = {"worker_id": self.worker_id, "dp_rank": self.dp_rank, "event_id": self.event_id,
                  "tier": int(self.tier)}
        if self.sliding_group is not None:
            fields["flags"] = REMOVED_SLIDING
            fields["sliding_group"] = self.sliding_group
        return (fields, self.block_hashes)
