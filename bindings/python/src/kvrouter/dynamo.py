"""A surface compatible with Dynamo's Python bindings (``dynamo.llm`` of ai-dynamo-runtime
1.6.1), for code moving over: :func:`compute_block_hash_for_seq` and :class:`RadixTree`, with
the same arguments, results and JSON event format, over libkvrouter.

    from kvrouter.dynamo import RadixTree, compute_block_hash_for_seq

Tested differentially against that wheel (bindings/python/tests/test_dynamo_differential.py:
random inputs and event streams, both sides' dumps replayed into both). Where they differ:

- ``find_matches(..., early_exit=True)`` returns the full match. Dynamo's stops counting once
  a single worker is left, at an edge of its own tree, so its score for that worker can be
  lower; every other score is the same.
- Index rules (kvrouter's core, shared with every binding): a stored event that repeats a
  block hash within itself is cut at the repetition (RuntimeError), where Dynamo indexes it
  whole; a rank evicting a block but keeping the blocks after it keeps them (no cascade),
  where Dynamo 1.6.1 drops the rest of its tree edge; ranks publishing different engine hashes
  for the same blocks can each remove their own, where Dynamo keeps the first publisher's and
  reports the others' removals as "Failed to find block". Engines that evict the deepest
  blocks first and hash blocks alike (vLLM with a fixed hash seed) see none of these.
- Errors are Dynamo's kinds (ValueError for bytes that are not a KvCacheEvent, RuntimeError
  for an event the index refuses, OverflowError for negative or too large integers) with
  kvrouter's messages; the part of an event applied despite an error is applied. A
  multimodal object needs ``mm_hash`` only (Dynamo also insists on ``offsets``, which do not
  change the hash).
- ``OverlapScores.frequencies`` is always empty (Dynamo's is too, for this tree).
"""

from __future__ import annotations

import json
import threading
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from . import _native
from ._abi import HASH_EAGLE
from ._errors import KvRouterError
from ._options import RemovedEvent, StoredEvent
from ._router import Router
from ._snapshot import SnapshotStored, stored_events

__all__ = ["OverlapScores", "RadixTree", "compute_block_hash_for_seq"]

_U64_MAX = (1 << 64) - 1


def compute_block_hash_for_seq(
    tokens: Sequence[int],
    kv_block_size: int,
    block_mm_infos: Optional[Sequence[Optional[Mapping[str, Any]]]] = None,
    lora_name: Optional[str] = None,
    is_eagle: Optional[bool] = None,
    cache_namespace: Optional[str] = None,
) -> List[int]:
    """The local block hash of every complete block of ``tokens``, as Dynamo computes it.

    ``block_mm_infos`` has one entry per block (None, or ``{"mm_objects": [{"mm_hash": int,
    "offsets": [...]}, ...]}``; the offsets do not change the hash, and blocks past the end of
    the list have none); ``lora_name`` and ``cache_namespace`` salt the hashes (None or "" is
    none); ``is_eagle`` hashes windows of kv_block_size + 1 tokens with stride kv_block_size.
    ValueError for kv_block_size 0, OverflowError for a token outside uint32.
    """
    if kv_block_size == 0:
        raise ValueError("kv_block_size cannot be 0")
    mm_hashes: Optional[List[int]] = None
    mm_counts: Optional[List[int]] = None
    if block_mm_infos is not None:
        mm_hashes, mm_counts = [], []
        for info in block_mm_infos:
            if info is None:
                mm_counts.append(0)
                continue
            if not isinstance(info, Mapping):
                raise TypeError(f"a block's multimodal info must be a dict or None, not {type(info).__name__}")
            if "mm_objects" not in info:
                raise ValueError("missing field `mm_objects`")
            objects = info["mm_objects"]
            for obj in objects:
                if "mm_hash" not in obj:
                    raise ValueError("missing field `mm_hash`")
                mm_hashes.append(obj["mm_hash"])
            mm_counts.append(len(objects))
    return _native.compute_block_hashes(
        tokens, kv_block_size, HASH_EAGLE if is_eagle else 0, lora_name, cache_namespace, mm_hashes, mm_counts
    )


class OverlapScores:
    """The result of :meth:`RadixTree.find_matches`: ``scores`` maps (worker_id, dp_rank) to the
    number of leading blocks that rank holds; ``frequencies`` is empty."""

    __slots__ = ("scores", "frequencies")

    def __init__(self, scores: Dict[Tuple[int, int], int], frequencies: Optional[List[int]] = None) -> None:
        self.scores = scores
        self.frequencies: List[int] = frequencies or []

    def __repr__(self) -> str:
        return f"OverlapScores(scores={self.scores!r}, frequencies={self.frequencies!r})"


def _u64(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"Failed to deserialize KvCacheEvent: {what} must be an unsigned 64-bit integer, not {value!r}")
    if not 0 <= value <= _U64_MAX:
        raise ValueError(f"Failed to deserialize KvCacheEvent: {what} {value} is not an unsigned 64-bit integer")
    return value


class RadixTree:
    """Dynamo's ``RadixTree``: a prefix index of KV blocks fed with Dynamo's JSON KV cache events,
    over a kvrouter index. Thread-safe; the index calls release the GIL."""

    def __init__(self) -> None:
        # Block size matters only for events carrying tokens: these carry local hashes.
        self._router = Router(block_size=16)
        self._ranks: Dict[int, Set[int]] = {}  # the ranks each worker's events came from
        self._lock = threading.Lock()  # _ranks

    def find_matches(self, sequence: Sequence[int], early_exit: bool = False) -> OverlapScores:
        """Per (worker_id, dp_rank) holding the first block: how many leading blocks of the
        sequence of local block hashes it holds. ``early_exit`` is accepted; the match is
        always complete (see the module's notes)."""
        if isinstance(sequence, (str, bytes)):
            raise TypeError("sequence must be a list of block hashes")
        if not len(sequence):
            return OverlapScores({})
        # The index walk alone (kvr_router_find_matches): the depths without the cost model.
        matches = self._router.find_matches(sequence)
        return OverlapScores({(m.worker_id, m.dp_rank): m.device_blocks for m in matches if m.device_blocks})

    def apply_event(self, worker_id: int, kv_cache_event_bytes: bytes) -> None:
        """Applies one KV cache event in Dynamo's JSON form (``KvCacheEvent``: ``event_id``,
        ``data`` = ``{"stored": {"parent_hash", "blocks": [{"block_hash", "tokens_hash"}]}}``,
        ``{"removed": {"block_hashes"}}`` or ``"cleared"``, optional ``dp_rank``). ValueError if
        the bytes are not such an event; RuntimeError if the index refuses part of it."""
        if worker_id < 0 or worker_id > _U64_MAX:
            raise OverflowError("can't convert negative int to unsigned" if worker_id < 0 else "worker_id out of range")
        try:
            event = json.loads(kv_cache_event_bytes)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"Failed to deserialize KvCacheEvent: {exc}") from None
        if not isinstance(event, dict):
            raise ValueError("Failed to deserialize KvCacheEvent: expected a JSON object")
        for key in ("event_id", "data"):
            if key not in event:
                raise ValueError(f"Failed to deserialize KvCacheEvent: missing field `{key}`")
        event_id = _u64(event["event_id"], "event_id")
        dp_rank = event.get("dp_rank", 0)
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < 1 << 32:
            raise ValueError(f"Failed to deserialize KvCacheEvent: bad dp_rank {dp_rank!r}")
        data = event["data"]
        if data == "cleared":
            self._clear_rank(worker_id, dp_rank, event_id)
            return
        if not isinstance(data, dict) or len(data) != 1 or next(iter(data)) not in ("stored", "removed"):
            raise ValueError(f"Failed to deserialize KvCacheEvent: unknown variant {data!r}, "
                             "expected one of `stored`, `removed`, `cleared`")
        kind, body = next(iter(data.items()))
        if not isinstance(body, dict):
            raise ValueError(f"Failed to deserialize KvCacheEvent: {kind} must be an object")
        with self._lock:
            self._ranks.setdefault(worker_id, set()).add(dp_rank)
        try:
            if kind == "stored":
                if "blocks" not in body:
                    raise ValueError("Failed to deserialize KvCacheEvent: missing field `blocks`")
                parent = body.get("parent_hash")
                blocks = body["blocks"]
                engine = [_u64(b["block_hash"], "block_hash") for b in blocks]
                local = [_u64(b["tokens_hash"], "tokens_hash") for b in blocks]
                if not engine:
                    return
                self._router.apply_stored(StoredEvent(
                    worker_id=worker_id, dp_rank=dp_rank, event_id=event_id, block_hashes=engine, local_hashes=local,
                    parent_hash=None if parent is None else _u64(parent, "parent_hash")))
            else:
                if "block_hashes" not in body:
                    raise ValueError("Failed to deserialize KvCacheEvent: missing field `block_hashes`")
                hashes = [_u64(h, "block_hash") for h in body["block_hashes"]]
                if hashes:
                    self._router.apply_removed(RemovedEvent(worker_id=worker_id, dp_rank=dp_rank,
                                                            event_id=event_id, block_hashes=hashes))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"Failed to deserialize KvCacheEvent: {exc!r}") from None
        except KvRouterError as exc:
            raise RuntimeError(f"Failed to apply event: {exc.message}") from exc

    def _clear_rank(self, worker_id: int, dp_rank: int, event_id: int) -> None:
        # A clear drops the publishing rank's blocks, in Dynamo and in kvrouter alike.
        self._router.apply_cleared(worker_id, dp_rank, event_id)

    def remove_worker(self, worker_id: int) -> None:
        """Drops every block of every rank of the worker."""
        if worker_id < 0:
            raise OverflowError("can't convert negative int to unsigned")
        with self._lock:
            for rank in sorted(self._ranks.pop(worker_id, {0})):
                self._router.apply_cleared(worker_id, rank, 0)

    def clear_all_blocks(self, worker_id: int) -> None:
        """Drops every block of every rank of the worker (as :meth:`remove_worker` here)."""
        self.remove_worker(worker_id)

    def dump_tree_as_events(self) -> List[str]:
        """The index as Dynamo ``RouterEvent`` JSON strings (stored events, event ids from 0, one
        per run of blocks a rank holds along one path, parents first): applied in order to an
        empty tree (``apply_event(worker_id, json.dumps(event))`` of each one's ``event``), they
        rebuild the same matches."""
        out = []
        for i, (worker, rank, parent, blocks) in enumerate(_chains(stored_events(self._router.snapshot()))):
            out.append(json.dumps({
                "worker_id": worker,
                "storage_tier": "device",
                "residency_domain": "worker",
                "event": {
                    "event_id": i,
                    "data": {"stored": {
                        "parent_hash": parent,
                        "start_position": None,
                        "blocks": [{"block_hash": b, "tokens_hash": t, "mm_extra_info": None} for b, t in blocks],
                    }},
                    "dp_rank": rank,
                },
            }, separators=(",", ":")))
        return out


def _chains(events: Iterable[SnapshotStored]) -> List[Tuple[int, int, Optional[int], List[Tuple[int, int]]]]:
    """kvrouter's dump (a stored event per node, breadth first) merged into runs: per rank, a
    block with exactly one child continues into it. Runs keep the order of their first block,
    so a run's parent is always in an earlier one."""
    order: List[Tuple[int, int, int]] = []  # (worker, rank, engine hash) in dump order
    blocks: Dict[Tuple[int, int], Dict[int, Tuple[Optional[int], int]]] = {}  # hash -> (parent, local)
    for ev in events:
        rank_blocks = blocks.setdefault((ev.worker_id, ev.dp_rank), {})
        parent = ev.parent_hash
        for engine, local in zip(ev.block_hashes, ev.local_hashes):
            rank_blocks[engine] = (parent, local)
            order.append((ev.worker_id, ev.dp_rank, engine))
            parent = engine
    children: Dict[Tuple[int, int], Dict[Optional[int], List[int]]] = {}
    for (worker, rank), rank_blocks in blocks.items():
        kids = children.setdefault((worker, rank), {})
        for engine, (parent, _) in rank_blocks.items():
            kids.setdefault(parent, []).append(engine)
    runs = []
    for worker, rank, engine in order:
        parent, local = blocks[(worker, rank)][engine]
        kids = children[(worker, rank)]
        if parent is not None and parent in blocks[(worker, rank)] and len(kids.get(parent, ())) == 1:
            continue  # continues its parent's run
        run = [(engine, local)]
        while len(kids.get(run[-1][0], ())) == 1:
            nxt = kids[run[-1][0]][0]
            run.append((nxt, blocks[(worker, rank)][nxt][1]))
        runs.append((worker, rank, parent, run))
    return runs
