"""Live KV events: Ingest (a libuv loop applying events to a router), EventBatch and Publisher
(the native stream format, for engines in any language)."""

from __future__ import annotations

import atexit
import weakref
from typing import Any, NamedTuple, Optional, Union

from . import _native
from ._native import IngestStats
from ._options import _JETSTREAM, EngineWorker, IngestOptions, RemovedEvent, StoredEvent, _JetStreamSource
from ._router import Router

Buffer = Union[bytes, bytearray, memoryview]


class Listener(NamedTuple):
    """A stream listener: its source id (for :meth:`Ingest.stats`) and the endpoint it bound
    (with the real port when 0 was asked for)."""

    source_id: int
    endpoint: str


_open_ingests: "weakref.WeakSet[Ingest]" = weakref.WeakSet()


@atexit.register
def _close_open_ingests() -> None:
    # An ingest loop thread may call into Python (a replica publisher); stop every loop while
    # the interpreter can still run it.
    for ingest in list(_open_ingests):
        ingest.close()


class Ingest:
    """One event loop thread that receives KV events and applies them to ``router`` while
    other threads route (``kvr_ingest``; docs/ingest.md). Sources: native stream listeners
    (:meth:`listen`), NATS subjects (:meth:`subscribe_nats`), NATS JetStream streams
    (:meth:`subscribe_jetstream`), vLLM/SGLang ZMQ publishers
    (:meth:`add_engine_worker`), and router replica sync (:meth:`sync_replicas`); they may be
    added before or after :meth:`start` (:meth:`relay_jetstream` republishes what they change
    into a JetStream stream). The router cannot be closed while this is open.
    Every method may be called from any thread."""

    __slots__ = ("_h", "router", "__weakref__")

    def __init__(self, router: Router, options: Optional[IngestOptions] = None) -> None:
        self._h = _native.Ingest(router, None if options is None else options._fields())
        #: The router fed.
        self.router = router
        _open_ingests.add(self)

    def start(self) -> None:
        """Starts the loop thread (FailedPreconditionError if started or stopped before)."""
        self._h.start()

    def stop(self) -> None:
        """Closes every source and joins the loop thread; final and idempotent. Waits for the
        :meth:`subscribe_nats`, :meth:`subscribe_jetstream`, :meth:`relay_jetstream` and
        :meth:`sync_replicas` calls other threads have in flight (their server round trips run
        on the caller's thread, over connections this closes); those made once it has been
        called raise FailedPreconditionError at once, as after it, so that calls overlapping
        one another cannot keep it waiting.

        Called from a replica publisher (see :meth:`close`) it returns at once: those calls are
        refused from then on, and a new thread stops the ingest, once the publisher has
        returned."""
        self._h.stop()

    def close(self) -> None:
        """Stops if needed and frees (idempotent); the router may be closed afterwards. Later
        calls raise :class:`ClosedError`; calls in flight on other threads finish first, and
        the last of them frees it.

        Called from a replica publisher (a ``Router.set_replica_publisher`` callable: on this
        ingest's own loop thread, for its heartbeats, or on a thread whose routing call holds
        the router's lock), it is asynchronous: the object is closed at once (a later
        ``close()`` does nothing, other calls raise ClosedError), and a new thread stops and
        frees it once the publisher has returned (freeing it there would join the very loop
        thread, or one waiting for that lock); :meth:`Router.close` refuses until then. The
        same goes for the object's last reference dropped (or a collection) in a publisher."""
        self._h.close()
        _open_ingests.discard(self)

    @property
    def closed(self) -> bool:
        return self._h.closed

    def __enter__(self) -> "Ingest":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def listen(self, endpoint: str) -> Listener:
        """Listens for native event streams on ``tcp://HOST:PORT`` (port 0: a free one) or
        ``unix://PATH`` (UnavailableError if it cannot bind)."""
        source_id, bound = self._h.listen(endpoint)
        return Listener(source_id, bound)

    def source_endpoint(self, source_id: int) -> str:
        """Where a source is (a listener's bound endpoint, a worker's or NATS server's url)."""
        return self._h.source_endpoint(source_id)

    def add_engine_worker(self, worker: EngineWorker) -> int:
        """Subscribes to a vLLM/SGLang worker's ranks; returns the source id. (Register the
        worker with the router too, for routing.)"""
        return self._h.add_engine_worker(worker._fields(), worker.endpoint, worker.topic, worker.replay_endpoint)

    def remove_engine_worker(self, worker_id: int, clear_index: bool = False) -> None:
        """Unsubscribes; ``clear_index`` also drops the worker's entries from the index."""
        self._h.remove_engine_worker(worker_id, clear_index)

    def subscribe_nats(self, url: str, subject: str) -> int:
        """Subscribes to a NATS subject (wildcards allowed) carrying native EventBatches;
        returns the source id. UnavailableError if the first connection fails."""
        return self._h.subscribe_nats(url, subject)

    def subscribe_jetstream(
        self,
        url: str,
        stream: str,
        subject: str,
        *,
        durable: Optional[str] = None,
        start_sequence: int = _JETSTREAM["start_sequence"],
        resume: bool = False,
        create_stream: bool = False,
        max_age_seconds: float = _JETSTREAM["max_age_seconds"],
        max_bytes: int = _JETSTREAM["max_bytes"],
    ) -> int:
        """Consumes the NATS JetStream stream ``stream`` (no spaces, ``.``, ``*`` or ``>``) on
        the server at ``url``, subjects ``subject`` (wildcards allowed), through a durable
        consumer named ``durable`` (one per router; None: an ephemeral one): the messages
        :meth:`subscribe_nats` takes, each acknowledged once applied, so nothing is lost while
        the ingest or the server is away (``kvr_ingest_subscribe_jetstream``). Returns the
        source id, whose ``stats().stream_sequence`` is the last stream sequence applied.

        ``start_sequence``: the first sequence delivered (0: the stream's first; after
        restoring a snapshot taken at ``stream_sequence`` N, N + 1); without ``resume`` an
        existing durable consumer is replaced, with it it keeps its position.
        ``create_stream`` creates the stream if absent, keeping ``max_age_seconds`` (default
        3600; 0: no limit) and ``max_bytes`` (default 1 GiB; -1: no limit).

        Connects and sets up the consumer on the calling thread (the GIL released).
        InvalidArgumentError for a missing url, stream or subject, a bad name or bad limits;
        NotFoundError if the stream does not exist (without ``create_stream``);
        UnavailableError if the server cannot be reached or refuses."""
        fields = _JetStreamSource(start_sequence, resume, create_stream, max_age_seconds, max_bytes)._fields()
        return self._h.subscribe_jetstream(fields, url, stream, subject, durable)

    def relay_jetstream(
        self,
        url: str,
        stream: str,
        subject: str,
        *,
        durable: Optional[str] = None,
        start_sequence: int = _JETSTREAM["start_sequence"],
        resume: bool = False,
        create_stream: bool = False,
        max_age_seconds: float = _JETSTREAM["max_age_seconds"],
        max_bytes: int = _JETSTREAM["max_bytes"],
    ) -> int:
        """The JetStream relay (``kvr_ingest_relay_jetstream``): republishes every change this
        ingest's other sources make to the router's index into the stream ``stream`` on the
        server at ``url``, each as a native EventBatch on subject ``<subject>.<worker id>``
        (``subject`` is a prefix, without wildcards); returns the relay's source id. A router
        consuming that stream (:meth:`subscribe_jetstream` on ``<subject>.>``) then holds what
        this router's index holds of those workers. Not relayed: what a JetStream source
        consumed, and events applied on the router directly.

        ``durable``, ``start_sequence`` and ``resume`` are a consumer's and must be left unset
        (InvalidArgumentError otherwise); ``create_stream`` creates the stream on
        ``<subject>.>`` with ``max_age_seconds`` and ``max_bytes`` as in
        :meth:`subscribe_jetstream`. One relay per ingest object (FailedPreconditionError for
        a second); it lasts until :meth:`stop`. Its ``stats()``: ``messages`` the changes
        handed to the relay, ``events_applied`` those the stream acknowledged, ``published``
        the messages acknowledged, ``stream_sequence`` the last message's stream sequence,
        ``missed_messages`` the changes dropped while the server was away (sent again by a
        resync; ``state_unknown`` is 1 until then): it has caught up when ``messages ==
        events_applied + missed_messages`` and ``state_unknown == 0``.

        Connects (and creates the stream) on the calling thread (the GIL released). Errors
        otherwise as :meth:`subscribe_jetstream`."""
        fields = _JetStreamSource(start_sequence, resume, create_stream, max_age_seconds, max_bytes)._fields()
        return self._h.relay_jetstream(fields, url, stream, subject, durable)

    def sync_replicas(self, url: str, subject: str, replica_id: str) -> int:
        """Router replica sync over NATS: publishes this router's booking changes on
        ``subject`` as ``replica_id`` and applies the other replicas'; returns the source id.
        A booking longer than the server's max_payload goes with its leading block ids
        (``IngestStats.bookings_trimmed``); a server whose max_payload is under 4 KiB is
        refused (:class:`FailedPreconditionError`)."""
        return self._h.sync_replicas(url, subject, replica_id)

    def stats(self, source_id: int = 0) -> IngestStats:
        """One source's counters, or (0) the sum over every source."""
        return self._h.get_stats(source_id)

    def metrics_prometheus(self) -> str:
        """Every source's counters in Prometheus text format (``kvrouter_ingest_*``, labelled
        ``source_id``, ``kind`` and ``endpoint``); serve it after ``Router.metrics_prometheus``."""
        return self._h.metrics_prometheus()


class EventBatch:
    """Events collected and encoded as one FlatBuffers EventBatch (``kvr_event_batch``), the
    format of :meth:`Router.apply_event_batch`, stream listeners and NATS subjects. Not for
    concurrent use from several threads."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = _native.EventBatch()

    def close(self) -> None:
        self._h.close()

    @property
    def closed(self) -> bool:
        return self._h.closed

    def __enter__(self) -> "EventBatch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._h)

    def add_stored(self, event: StoredEvent) -> None:
        """Appends a copy of a stored event (token counts are checked when it is applied)."""
        self._h.add_stored(*event._args())

    def add_removed(self, event: RemovedEvent) -> None:
        self._h.add_removed(*event._args())

    def add_cleared(self, worker_id: int, dp_rank: int = 0, event_id: int = 0) -> None:
        self._h.add_cleared(worker_id, dp_rank, event_id)

    def set_publish_time(self, unix_ns: int) -> None:
        """The batch's publication time in ns since the epoch (ingest measures its lag from
        it); unset, a batch is stamped when encoded or sent; 0 leaves it unstamped."""
        self._h.set_publish_time(unix_ns)

    def encode(self) -> bytes:
        """The events added so far, encoded (the batch keeps them)."""
        return self._h.encode()

    def clear(self) -> None:
        """Drops the events and any publish time set."""
        self._h.clear()


class Publisher:
    """A blocking connection to a kvrouter stream listener (``kvr_publisher``), for engines
    publishing KV events. One send at a time (a concurrent send raises RuntimeError)."""

    __slots__ = ("_h",)

    def __init__(self, endpoint: str) -> None:
        """Connects to ``tcp://HOST:PORT`` or ``unix://PATH`` (UnavailableError if it fails)."""
        self._h = _native.Publisher(endpoint)

    def close(self) -> None:
        self._h.close()

    @property
    def closed(self) -> bool:
        return self._h.closed

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def send(self, batch: EventBatch) -> None:
        """Encodes the batch's events and sends them as one frame."""
        self._h.send(batch._h)

    def send_encoded(self, data: Buffer) -> None:
        """Sends an already encoded EventBatch as one frame."""
        self._h.send_encoded(data)
