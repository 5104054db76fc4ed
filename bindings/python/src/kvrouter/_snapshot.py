"""A reader of kvrouter's FlatBuffers IndexSnapshot (schema/index_snapshot.fbs), enough to list
its stored events: what ``kvrouter.dynamo.RadixTree.dump_tree_as_events`` and its per-rank
clear need. Read-only, bounds-checked by ``struct``; no flatbuffers package needed."""

from __future__ import annotations

import struct
from typing import Iterator, List, NamedTuple, Optional

_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U16 = struct.Struct("<H")
_U64 = struct.Struct("<Q")

# Field ids (declaration order in the schemas).
_SNAPSHOT_EVENTS = 2
_EVENT_WORKER, _EVENT_RANK, _EVENT_TIER, _EVENT_ID, _EVENT_DATA_TYPE, _EVENT_DATA = range(6)
_STORED_PARENT, _STORED_BLOCK_HASHES, _STORED_LOCAL_HASHES = range(3)
_UNION_STORED = 1


class SnapshotStored(NamedTuple):
    worker_id: int
    dp_rank: int
    tier: int
    parent_hash: Optional[int]
    block_hashes: List[int]
    local_hashes: List[int]


class _Table:
    __slots__ = ("buf", "pos", "vt", "vt_len")

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf = buf
        self.pos = pos
        self.vt = pos - _I32.unpack_from(buf, pos)[0]
        self.vt_len = _U16.unpack_from(buf, self.vt)[0]

    def _off(self, field: int) -> int:
        at = 4 + 2 * field
        off: int = _U16.unpack_from(self.buf, self.vt + at)[0] if at < self.vt_len else 0
        return off

    def scalar(self, field: int, fmt: struct.Struct, default: int = 0) -> int:
        off = self._off(field)
        value: int = fmt.unpack_from(self.buf, self.pos + off)[0] if off else default
        return value

    def present(self, field: int) -> bool:
        return self._off(field) != 0

    def _target(self, field: int) -> Optional[int]:
        off = self._off(field)
        if not off:
            return None
        at = self.pos + off
        target: int = at + _U32.unpack_from(self.buf, at)[0]
        return target

    def table(self, field: int) -> Optional["_Table"]:
        at = self._target(field)
        return None if at is None else _Table(self.buf, at)

    def u64s(self, field: int) -> List[int]:
        at = self._target(field)
        if at is None:
            return []
        n = _U32.unpack_from(self.buf, at)[0]
        return list(struct.unpack_from(f"<{n}Q", self.buf, at + 4))

    def tables(self, field: int) -> Iterator["_Table"]:
        at = self._target(field)
        if at is None:
            return
        n = _U32.unpack_from(self.buf, at)[0]
        for i in range(n):
            elem = at + 4 + 4 * i
            yield _Table(self.buf, elem + _U32.unpack_from(self.buf, elem)[0])


def stored_events(snapshot: bytes) -> Iterator[SnapshotStored]:
    """The stored events of an IndexSnapshot, in order (the index's own dump: applied in order
    to an empty index, they rebuild it)."""
    if len(snapshot) < 8 or snapshot[4:8] != b"KVIS":
        raise ValueError("not a kvrouter IndexSnapshot")
    root = _Table(snapshot, _U32.unpack_from(snapshot, 0)[0])
    for ev in root.tables(_SNAPSHOT_EVENTS):
        if ev.scalar(_EVENT_DATA_TYPE, struct.Struct("<B")) != _UNION_STORED:
            continue
        data = ev.table(_EVENT_DATA)
        if data is None:
            continue
        yield SnapshotStored(
            worker_id=ev.scalar(_EVENT_WORKER, _U64),
            dp_rank=ev.scalar(_EVENT_RANK, _U32),
            tier=ev.scalar(_EVENT_TIER, struct.Struct("<B")),
            parent_hash=data.scalar(_STORED_PARENT, _U64) if data.present(_STORED_PARENT) else None,
            block_hashes=data.u64s(_STORED_BLOCK_HASHES),
            local_hashes=data.u64s(_STORED_LOCAL_HASHES),
        )
