"""Router and Disagg: routing, workers, events, the request lifecycle, staged routing,
sessions, snapshots, metrics and replica sync."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, List, Optional, Tuple, Union

from . import _native
from ._native import Candidate, Match, Metrics, Overlap, PotentialLoad, PrefillResult, RouteResult, RouteSignals
from ._errors import NotFoundError
from ._prompt import Prompt
from ._options import (
    DisaggOptions,
    Ints,
    RemovedEvent,
    RequestOptions,
    RouterOptions,
    RoutingHints,
    StoredEvent,
    WorkerConfig,
)

Buffer = Union[bytes, bytearray, memoryview]


def _opt(options: Optional[RequestOptions]) -> Any:
    return None if options is None else options._c


def _hints(hints: Optional[RoutingHints]) -> Any:
    return None if hints is None else hints._c


class Router(_native.Router):
    """A KV-cache-aware router (``kvr_router``): the workers, their KV index and their load.

    Every call that takes a prompt (``tokens``) takes its token ids or a :class:`HashedPrompt`,
    the prompt's local block hashes and its length: nothing is hashed in the call, and the
    decision, booking and prices are those of the tokens.

    Every method may be called from any number of threads at once; each releases the GIL
    while the library works, so routing runs in parallel with other Python threads. An
    admitted routing call (``request_id=`` given, or ``RequestOptions(admit=True)``) on a
    router with a queue threshold may block its thread in the admission queue (bound it with
    ``RequestOptions.queue_timeout``, or end every such wait with :meth:`close_queue`).
    ``close()`` (or leaving a ``with`` block) frees the router; it may be called while other
    threads still call, which then finish first, and later calls raise :class:`ClosedError`.
    It closes the admission queue first: a call waiting there raises
    :class:`RequestCancelledError` rather than keep its thread, and the router, for good.
    Called from a replica publisher, which runs under the router's lock that closing the queue
    takes, ``close()`` (and :meth:`close_queue`) raises :class:`FailedPreconditionError`
    instead of blocking that thread, and the router with it: close after the publisher returns.
    A router closed, or dropped (also by the garbage
    collector, in a cycle with its replica publisher), says no farewell through its publisher,
    as ``kvr_router_free`` and the Go, Rust and Java bindings: its peers keep its bookings until
    they expire them; ``set_replica_publisher(replica_id, None)`` first has them dropped at once.
    A :class:`Disagg` pool's router, which lives as long as its Disagg, says farewell when it
    is dropped while the Disagg is open; dropped inside a replica publisher (which must not call
    a router), or while the Disagg is closing, it says none: its publisher is only disarmed,
    called with no effect until the Disagg frees the pool.
    """

    # The extension type implements the hot methods itself (find_best_match,
    # mark_prefill_completed, free_request) and close / closed; the others are here, over its
    # underscored low-level methods.
    __slots__ = ()

    def __new__(cls, options: Optional[RouterOptions] = None, **settings: Any) -> "Router":
        """``Router(RouterOptions(block_size=16))`` or ``Router(block_size=16)``: keyword
        settings are :class:`RouterOptions` fields, applied over ``options``."""
        if settings:
            options = replace(options or RouterOptions(), **settings)
        return super().__new__(cls, None if options is None else options._fields())

    # ---- lifetime (close() and the closed property come from the extension)

    def __enter__(self) -> "Router":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- workers

    def add_worker(self, worker: Union[WorkerConfig, int], **settings: Any) -> None:
        """Registers a worker: ``add_worker(1)``, ``add_worker(1, dp_size=2)`` or
        ``add_worker(WorkerConfig(...))``. AlreadyExistsError for a registered id."""
        if not isinstance(worker, WorkerConfig):
            worker = WorkerConfig(worker, **settings)
        elif settings:
            worker = replace(worker, **settings)
        self._add_worker(worker._fields())

    def update_worker(self, worker: WorkerConfig) -> None:
        """Changes a registered worker's settings (NotFoundError for an unknown id)."""
        self._update_worker(worker._fields())

    def remove_worker(self, worker_id: int) -> None:
        """Drops the worker's ranks, active requests and index entries."""
        self._remove_worker(worker_id)

    # ---- KV events

    def apply_stored(self, event: StoredEvent) -> None:
        """Applies a stored event. A rejected part raises (NotFoundError: unknown parent;
        InvalidArgumentError: broken sequence or incomplete block) after the part Dynamo
        applies despite it is applied."""
        self._apply_stored(*event._args())

    def apply_removed(self, event: RemovedEvent) -> None:
        """Applies a removed event (NotFoundError names an unknown block; the others go)."""
        self._apply_removed(*event._args())

    def apply_cleared(self, worker_id: int, dp_rank: int = 0, event_id: int = 0) -> None:
        """The rank (worker_id, dp_rank) lost every block; the worker's other ranks keep
        theirs (each rank has a cache of its own). :meth:`remove_worker` forgets every rank."""
        self._apply_cleared(worker_id, dp_rank, event_id)

    def apply_event_batch(self, data: Buffer) -> None:
        """Applies a FlatBuffers EventBatch (:meth:`EventBatch.encode`), verified first."""
        self._apply_event_batch(data)

    # ---- routing

    def find_best_match_with_candidates(
        self,
        tokens: Prompt,
        options: Optional[RequestOptions] = None,
        *,
        request_id: Optional[str] = None,
        max_candidates: int = 64,
    ) -> Tuple[RouteResult, List[Candidate], int]:
        """As :meth:`find_best_match`, with up to ``max_candidates`` candidates and every term of
        their cost, and the total number of candidates (the list is truncated, never refused)."""
        return self._find_best_match(tokens, _opt(options), request_id, max(1, max_candidates))

    def overlap_scores(self, tokens: Prompt, options: Optional[RequestOptions] = None) -> List[Overlap]:
        """What each rank holds of the prompt's prefix, per tier (ranks holding its first block)."""
        return self._overlap_scores(tokens, _opt(options))

    def overlap_scores_hashed(self, local_hashes: Ints, options: Optional[RequestOptions] = None) -> List[Overlap]:
        """As :meth:`overlap_scores` for a prompt already hashed (:func:`compute_block_hashes`):
        LoRA, namespace and multimodal content are in the hashes; only cost overrides apply.
        (``overlap_scores(HashedPrompt(local_hashes, num_tokens))`` is the same, with the hashes
        checked against the prompt's length.)"""
        return self._overlap_scores_hashed(local_hashes, _opt(options))

    def find_matches(self, local_hashes: Ints) -> List[Match]:
        """The index walk alone, Dynamo's ``find_matches`` contract (``kvr_router_find_matches``):
        per rank holding at least the first of ``local_hashes`` (:func:`compute_block_hashes`), in
        no particular order, the leading blocks it holds per tier and its tree size. Each row has
        the tiers and tree size of the rank's :meth:`overlap_scores_hashed` row, without the cost
        model's figures, and costs less to get. No hashes match no rank."""
        return self._find_matches(local_hashes)

    def potential_loads(self, tokens: Prompt, options: Optional[RequestOptions] = None) -> List[PotentialLoad]:
        """The load each registered rank would carry with this prompt."""
        return self._potential_loads(tokens, _opt(options))

    # ---- request lifecycle

    def add_request(
        self,
        tokens: Prompt,
        worker_id: int,
        dp_rank: int = 0,
        options: Optional[RequestOptions] = None,
        *,
        request_id: Optional[str] = None,
    ) -> None:
        """Books a request on a rank chosen elsewhere (the id from ``request_id`` or ``options``)."""
        self._add_request(tokens, worker_id, dp_rank, _opt(options), request_id)

    def record_output(self, request_id: str, output_tokens: int) -> None:
        """The request has generated ``output_tokens`` so far (cumulative). Needs
        ``RouterOptions(track_output_blocks=True)`` (FailedPreconditionError otherwise)."""
        self._record_output(request_id, output_tokens)

    def close_queue(self) -> int:
        """For a shutdown: closes the admission queue for good (``kvr_router_close_queue``).
        Every request waiting in it is cancelled (its routing call, blocked on another thread,
        raises :class:`RequestCancelledError`), and from now on a request that would wait raises
        it at once; one admitted at once is still routed and booked, and previews, frees and
        every other call work as before. :meth:`close` (and leaving a ``with`` block) does this
        first. Returns how many requests were waiting (0 once closed); idempotent. From a
        replica publisher, FailedPreconditionError (as :meth:`close`)."""
        return self._close_queue()

    def expire_requests(self) -> int:
        """Drops every request booked longer than ``RouterOptions.request_expiry_seconds`` ago
        (its :meth:`free_request` was lost: a crashed client, a missed event) and every plan past
        its deadline, then admits the queued requests that now fit
        (``kvr_router_expire_requests``). Returns how many requests were dropped. The router has
        no timer thread: a routing call that books does this at most once per min(30 s, the
        expiry), and nothing does while no call comes, so with a queue threshold a lost request
        can keep the queue waiting until one does: call this on a timer (every second, say).
        From a replica publisher, FailedPreconditionError (as every call on its own router)."""
        return self._expire_requests()

    # ---- staged routing, pins, sessions

    def preview_route(
        self, tokens: Prompt, options: Optional[RequestOptions] = None, hints: Optional[RoutingHints] = None
    ) -> RouteSignals:
        """What routing would pick, changing nothing."""
        return self._preview_route(tokens, _opt(options), _hints(hints))

    def plan_route(
        self,
        tokens: Prompt,
        options: Optional[RequestOptions] = None,
        hints: Optional[RoutingHints] = None,
        previewed: Optional[RouteSignals] = None,
        *,
        request_id: Optional[str] = None,
    ) -> RouteSignals:
        """Books the request as a plan, keeping ``previewed``'s rank while it is still a
        candidate (``moved`` says otherwise). Idempotent per request id."""
        return self._plan_route(tokens, _opt(options), _hints(hints), previewed, request_id)

    def commit_route(self, request_id: str) -> None:
        """The plan was dispatched (NotFoundError: no live plan)."""
        self._commit_route(request_id)

    def abort_route(self, request_id: str) -> bool:
        """Frees the plan, its booking or its queue place; True if anything was freed."""
        return self._abort_route(request_id)

    def set_plan_deadline(self, seconds: float) -> None:
        """How long a plan may wait for commit or abort (default 30 s; later plans)."""
        self._set_plan_deadline(seconds)

    def set_time(self, ns: int) -> None:
        """Drives the router's clock by hand from now on, for simulations and tests in which
        time passes at their own pace: everything the router times (request expiry, plan
        deadlines, session bindings, approximate-mode TTLs, queue order, the prefill rates of
        ``CostFunction.PREDICTED_TTFT``) then sees ``ns`` (nanoseconds from any origin) plus a
        fixed offset chosen at the first call, so that the router's time continues from where it
        was: only differences matter. Until the first call the router reads the process's
        monotonic clock. InvalidArgumentError if ``ns`` is earlier than the last time set, or
        would take the router's time past +-2^62 ns (146 years)."""
        self._set_time(ns)

    def expire_plans(self) -> int:
        """Drops plans past their deadline now; how many."""
        return self._expire_plans()

    def session_binding(self, session_id: str) -> Optional[Tuple[int, int]]:
        """(worker_id, dp_rank) a live session is bound to, or None (does not refresh it)."""
        try:
            return self._session_binding(session_id)
        except NotFoundError:
            return None

    def close_session(self, session_id: str) -> None:
        """Unbinds a session (no error if unbound)."""
        self._close_session(session_id)

    def reclaim_sessions(self) -> int:
        """Drops expired session bindings now; how many."""
        return self._reclaim_sessions()

    def state_digest(self) -> int:
        """A digest of all routing state: equal digests mean nothing changed (this process only)."""
        return self._state_digest()

    def index_digest(self) -> int:
        """A digest of the KV index alone: which worker and rank holds which block, on which
        tier, under which prefix. Unlike state_digest it is equal across processes and machines
        running the same library version when their indexes hold the same blocks, so replicas
        can compare their views; bookings, the queue, plans and sessions do not enter it (except
        in approximate mode, where the index is the routing decisions recorded when admitted or
        committed). It may change between library versions."""
        return self._index_digest()

    # ---- snapshots and metrics

    def snapshot(self) -> bytes:
        """The whole KV index as a FlatBuffers IndexSnapshot."""
        return self._snapshot()

    def restore(self, data: Buffer) -> None:
        """Loads a snapshot into a router whose index is empty (else FailedPreconditionError;
        of two restores at once, one loads its snapshot and the other gets that error)."""
        self._restore(data)

    def metrics(self) -> Metrics:
        """The router's counters (``kvr_metrics``)."""
        return self._get_metrics()

    def metrics_prometheus(self) -> str:
        """The metrics, with per-worker load gauges, in Prometheus text format."""
        return self._metrics_prometheus()

    # ---- router replicas

    def set_replica_publisher(self, replica_id: str, publish: Optional[Callable[[bytes], Any]]) -> None:
        """Publishes this router's booking changes through ``publish(change: bytes)`` under
        ``replica_id`` (None stops). ``publish`` runs on the thread that made the change (an
        announcement that falls due: the one beating, expiring or applying a replica change),
        under the router's lock: it must be quick and must not call any router. Before this
        returns it receives a Reset, an Added change per booking and a SyncRequest; a publisher
        replaced (or stopped by None) first receives a farewell Reset, so peers drop what they
        hold from its id. An exception it raises is reported through
        ``sys.unraisablehook``. It may close (or stop) an :class:`Ingest`, even the one whose
        loop thread runs it: that is done by a new thread once it has returned
        (:meth:`Ingest.close`); :meth:`close`, :meth:`close_queue`, :meth:`Disagg.close` and
        this method (on any router: a publisher replacing or clearing itself, or another)
        raise FailedPreconditionError there: set publishers after it returns."""
        self._set_replica_publisher(replica_id, publish)

    def apply_replica_event(self, data: Buffer) -> None:
        """Applies one change another replica published."""
        self._apply_replica_event(data)

    def replica_heartbeat(self, interval_ms: int) -> None:
        """Publishes a heartbeat through the replica publisher (after an announcement of every
        booking if one is due: a lost change's repair, or joins' answer), promising the next within
        ``interval_ms`` (1..3,600,000, else InvalidArgumentError): a peer that has heard one from
        this replica (or a change published after it: each carries the interval) drops its
        bookings there (``expire_replicas``) once it falls silent. Over a bus of your own, call
        it every interval; ``Ingest.sync_replicas`` does it on a timer, the first at once
        (``IngestOptions.replica_heartbeat_ms``). FailedPreconditionError without a publisher."""
        self._replica_heartbeat(interval_ms)

    def expire_replicas(self, timeout_seconds: float) -> int:
        """Drops the bookings held from every replica that has sent heartbeats and has been
        heard from (any change) no later than ``timeout_seconds`` ago on the router's clock (or
        three of its own heartbeat intervals, if longer); how many replicas were dropped
        (``Metrics.replicas_expired`` counts them). A replica that never sent a heartbeat keeps
        its bookings until the request expiry; one dropped but heard again is asked (if this
        router publishes) to announce its bookings again. It may publish this router's own
        bookings, answering joins whose heartbeat did not come: a caller beating by hand calls
        it on a timer too. InvalidArgumentError unless the timeout is > 0."""
        return self._expire_replicas(timeout_seconds)


class Disagg:
    """Disaggregated prefill and decode (``kvr_disagg``): two pools, each a full router
    (:attr:`prefill_router`, :attr:`decode_router`: register workers, apply events and free
    requests there). Thread-safe as :class:`Router`. Its calls take a prompt's token ids or a
    :class:`HashedPrompt`, as the router's do; the policies read its length."""

    __slots__ = ("_h", "_prefill", "_decode", "__weakref__")

    def __init__(
        self,
        prefill: Optional[RouterOptions] = None,
        decode: Optional[RouterOptions] = None,
        options: Optional[DisaggOptions] = None,
    ) -> None:
        self._h = _native.Disagg(
            None if prefill is None else prefill._fields(),
            None if decode is None else decode._fields(),
            None if options is None else options._fields(),
        )
        self._prefill: Router = self._h.pool_router(True, Router)
        self._decode: Router = self._h.pool_router(False, Router)

    def close(self) -> None:
        """Frees both pools once calls in flight return (idempotent). It closes both pools'
        admission queues first (:meth:`Router.close_queue`): a call waiting in one, here or on a
        pool's router, raises :class:`RequestCancelledError`. From a replica publisher,
        FailedPreconditionError (as :meth:`Router.close`)."""
        self._h.close()

    @property
    def closed(self) -> bool:
        return self._h.closed

    def __enter__(self) -> "Disagg":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def prefill_router(self) -> Router:
        """The prefill pool's router (owned by this object)."""
        return self._prefill

    @property
    def decode_router(self) -> Router:
        """The decode pool's router (owned by this object)."""
        return self._decode

    def route_prefill(
        self,
        tokens: Prompt,
        options: Optional[RequestOptions] = None,
        hints: Optional[RoutingHints] = None,
        *,
        request_id: Optional[str] = None,
    ) -> PrefillResult:
        """Decides where the prompt is prefilled; when remote, books a prefill rank under the
        request id (free it on :attr:`prefill_router` when the prefill ends)."""
        return self._h.route_prefill(tokens, _opt(options), _hints(hints), request_id)

    def route_decode(
        self,
        tokens: Prompt,
        options: Optional[RequestOptions] = None,
        hints: Optional[RoutingHints] = None,
        *,
        remote_prefill: bool,
        request_id: Optional[str] = None,
    ) -> RouteSignals:
        """Selects and books the decode rank; after a remote prefill the decode overrides are
        forced (no overlap credit, no KV reuse, no prefill tracking)."""
        return self._h.route_decode(tokens, _opt(options), _hints(hints), remote_prefill, request_id)

    def prefill_worker_busy(self, tokens: Prompt, threshold: float, options: Optional[RequestOptions] = None) -> bool:
        """Would the prefill rank chosen now carry more than threshold × its
        max_num_batched_tokens prefill tokens? (advisory)"""
        return self._h.prefill_worker_busy(tokens, _opt(options), threshold)
