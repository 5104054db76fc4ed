"""The engines' own KV event publishers feeding kvrouter's ingest over ZMQ on 127.0.0.1:
SGLang's ZmqEventPublisher with its KVCacheEventRecorder, and vLLM's ZmqEventPublisher with
its event classes (tests/engines.py loads them without torch). Each test walks one worker with
two data-parallel ranks through stores, removals, clears, storage media, LoRA, salts,
multimodal keys, a lost message (replayed from vLLM's replay socket, or cleared), a publisher
restart, and checks the index after each step: the leading blocks each rank holds per tier
(find_matches on the prompt's hashes, with the request's LoRA, salt or images).

Every message passes a Link (a forwarder that can drop messages) between the engine and
kvrouter, so that a gap is a message lost on the way, as on a real network.

Outside scripts/test-python.sh's venv (no sglang wheel, no KVR_VLLM_KV_EVENTS) these tests are
skipped, unless KVR_REQUIRE_ENGINES=1 (set by that script), which makes a missing engine a
failure."""

from __future__ import annotations

import atexit
import os
import random
import socket
import time
import types
from typing import Any, Dict, List, Optional, Tuple

import pytest

import kvrouter
from conftest import ephemeral_ports, free_port, wait_for
from engines import SGLANG_VERSION, VLLM_VERSION, Link, load_sglang, load_vllm

REQUIRED = os.environ.get("KVR_REQUIRE_ENGINES") == "1"
BS = 16


def _skip_or_fail(why: str) -> None:
    if REQUIRED:
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def sglang() -> types.SimpleNamespace:
    try:
        return load_sglang()
    except ImportError as e:
        _skip_or_fail(f"SGLang {SGLANG_VERSION} publisher: {e}")
        raise


@pytest.fixture(scope="module")
def vllm() -> Any:
    path = os.environ.get("KVR_VLLM_KV_EVENTS")
    if not path or not os.path.exists(path):
        _skip_or_fail(f"vLLM {VLLM_VERSION} kv_events.py: KVR_VLLM_KV_EVENTS is not set")
    return load_vllm(path)


def free_port_block(n: int) -> int:
    """The first of n consecutive free ports on 127.0.0.1, below the ephemeral range (free_port)."""
    rng = random.Random()
    top = ephemeral_ports()
    for _ in range(200):
        base = rng.randrange(max(1024, top - 12000), top - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no block of free ports")


def tiers(router: kvrouter.Router, tokens: List[int], worker: int, rank: int,
          **hash_options: Any) -> Tuple[int, int, int, int]:
    """(device, host, disk, external): the leading blocks of `tokens` the rank holds per tier."""
    hashes = kvrouter.compute_block_hashes(tokens, BS, **hash_options)
    for m in router.find_matches(hashes):
        if (m.worker_id, m.dp_rank) == (worker, rank):
            return (m.device_blocks, m.host_blocks, m.disk_blocks, m.external_blocks)
    return (0, 0, 0, 0)


def prompt(seed: int, blocks: int, extra: int = 0) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 150000) for _ in range(blocks * BS + extra)]


class Worker:
    """One engine worker: a publisher per dp rank (ports base + rank, as the engines offset
    them), a Link per rank, and its registration with kvrouter's ingest. `new_publisher(rank)`
    makes the engine's own publisher; the Worker counts what kvrouter should have handled."""

    def __init__(self, ingest: kvrouter.Ingest, engine: kvrouter.Engine, worker_id: int,
                 new_publisher: Any, replay: bool, ranks: int = 2, topic: str = "kv@") -> None:
        # Imported here, not at collection: test_abi checks that the process loaded no libzmq
        # but the wheel's, before anything else imports pyzmq.
        import zmq

        self.zmq = zmq
        self.ingest = ingest
        self.worker_id = worker_id
        self.ranks = ranks
        self.new_publisher = new_publisher
        base = free_port_block(3 * ranks)
        self.engine_endpoint = f"tcp://127.0.0.1:{base}"
        self.replay_endpoint = f"tcp://127.0.0.1:{base + ranks}" if replay else None
        link_base = base + 2 * ranks
        self.publishers = [new_publisher(r, self.engine_endpoint, self.replay_endpoint, topic)
                           for r in range(ranks)]
        self.links = [Link(self.zmq, f"tcp://127.0.0.1:{base + r}", f"tcp://127.0.0.1:{link_base + r}")
                      for r in range(ranks)]
        self.source = ingest.add_engine_worker(kvrouter.EngineWorker(
            f"tcp://127.0.0.1:{link_base}", worker_id, engine=engine, dp_size=ranks, block_size=BS,
            topic=topic, replay_endpoint=self.replay_endpoint))
        self.expected = 0  # messages kvrouter should have counted
        self.baseline()

    def stats(self) -> Any:
        return self.ingest.stats(self.source)

    def baseline(self) -> None:
        """Publishes clears on each rank until kvrouter counted one from it: ZMQ subscriptions
        take a moment, and the first message a rank's subscriber sees is its baseline."""
        for r in range(self.ranks):
            deadline = time.monotonic() + 15
            while True:
                before = self.stats().messages
                self.send(r, [self.clear_event()], count=False)
                t = time.monotonic() + 0.2
                while time.monotonic() < t and self.stats().messages == before:
                    time.sleep(0.01)
                if self.stats().messages > before:
                    break
                assert time.monotonic() < deadline, f"rank {r}: no message reached kvrouter"
        # A clear resent while the first was only late would count after `expected` is read:
        # the count settles (unchanged for 0.3 s) first.
        settled, last = time.monotonic(), self.stats().messages
        while time.monotonic() - settled < 0.3:
            time.sleep(0.02)
            if self.stats().messages != last:
                settled, last = time.monotonic(), self.stats().messages
        # A rank first heard above its message 0 (ZMQ subscriptions take a moment) is a join:
        # with a replay endpoint its history is replayed from 0, which counts as a recovery.
        wait_for("the joins settled", lambda: self.stats().state_unknown == 0)
        self.recoveries_at_start = self.stats().recoveries
        self.expected = self.stats().messages
        for link in self.links:
            link.handshakes(0.01)  # forget the first connections

    def clear_event(self) -> Any:
        raise NotImplementedError

    def send(self, rank: int, events: List[Any], count: bool = True) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        """Waits until kvrouter has handled every message published so far."""
        wait_for(f"{self.expected} messages counted (now {self.stats().messages})",
                 lambda: self.stats().messages >= self.expected)
        assert self.stats().messages == self.expected  # each sequence number counts once

    def restart(self, rank: int) -> None:
        """Stops the rank's publisher and starts a new one on the same endpoints (sequence
        numbers from 0 again), once the link has reconnected to it."""
        self.shutdown(self.publishers[rank])
        deadline = time.monotonic() + 5
        while True:  # the old sockets close asynchronously (ZMQ's I/O thread unbinds them)
            try:
                self.publishers[rank] = self.new_publisher(rank, self.engine_endpoint,
                                                           self.replay_endpoint, self.topic)
                break
            except self.zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        assert self.links[rank].handshakes(5.0) >= 1, "the link did not reconnect"
        time.sleep(0.3)  # its subscription reaches the new PUB socket

    @staticmethod
    def shutdown(publisher: Any) -> None:
        publisher.shutdown()
        # SGLang's publisher also registers its shutdown to run at exit, where a second one
        # waits a second for a queue no thread drains any more.
        atexit.unregister(publisher.shutdown)

    def close(self) -> None:
        for p in self.publishers:
            self.shutdown(p)
        for link in self.links:
            link.close()


# ---- vLLM


class VllmWorker(Worker):
    def __init__(self, vllm: Any, *args: Any, **kwargs: Any) -> None:
        self.vllm = vllm
        self.topic = kwargs.get("topic", "kv@")
        super().__init__(*args, **kwargs)

    def clear_event(self) -> Any:
        return self.vllm.AllBlocksCleared()

    def send(self, rank: int, events: List[Any], count: bool = True) -> None:
        self.publishers[rank].publish(self.vllm.KVEventBatch(ts=time.time(), events=events))
        self.expected += count


def vllm_publisher(vllm: Any) -> Any:
    class LoopbackPublisher(vllm.ZmqEventPublisher):
        # vLLM binds only wildcard hosts (tcp://*:port) and connects to others; the test binds
        # loopback. Nothing else of the publisher is changed.
        _is_bind_endpoint = staticmethod(lambda endpoint: True)

    def new(rank: int, endpoint: str, replay: Optional[str], topic: str) -> Any:
        return LoopbackPublisher(data_parallel_rank=rank, endpoint=endpoint, replay_endpoint=replay,
                                 topic=topic)

    return new


def hashes(n: int, seed: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(1 << 64) for _ in range(n)]


def test_vllm_publisher(vllm):
    v = vllm
    W = 11

    def stored(hs, parent, tokens, medium="GPU", lora=None, extra_keys=None):
        return v.BlockStored(block_hashes=hs, parent_block_hash=parent, token_ids=tokens,
                             block_size=BS if tokens else 0, lora_id=7 if lora else None,
                             medium=medium, lora_name=lora, extra_keys=extra_keys)

    def copy(h, medium):  # vLLM's offloading connector: one store per block, hashes only
        return stored([h], None, [], medium=medium)

    with kvrouter.Router(block_size=BS) as router, kvrouter.Ingest(router) as ingest:
        router.add_worker(kvrouter.WorkerConfig(W, dp_size=2))
        ingest.start()
        w = VllmWorker(v, ingest, kvrouter.Engine.VLLM, W, vllm_publisher(v), replay=True)
        try:
            # Stores, in two events along one sequence (rank 0) and one (rank 1).
            A, a = prompt(1, 4), hashes(4, 1)
            B, b = prompt(2, 3), hashes(3, 2)
            w.send(0, [stored(a[:2], None, A[:32]), stored(a[2:], a[1], A[32:])])
            w.send(1, [stored(b, None, B)])
            w.sync()
            assert tiers(router, A, W, 0) == (4, 0, 0, 0)
            assert tiers(router, A, W, 1) == (0, 0, 0, 0)
            assert tiers(router, B, W, 1) == (3, 0, 0, 0)

            # Media: offload copies (CPU, STORAGE) of blocks held on the GPU, then GPU evictions.
            w.send(0, [copy(a[0], "CPU"), copy(a[1], "CPU"), copy(a[2], "CPU"), copy(a[3], "STORAGE")])
            w.sync()
            assert tiers(router, A, W, 0) == (4, 0, 0, 0)
            w.send(0, [v.BlockRemoved(block_hashes=[a[3], a[2]], medium="GPU")])
            w.sync()
            assert tiers(router, A, W, 0) == (2, 1, 1, 0)
            # A removal from the CPU leaves the GPU copy (the case: 0 before the fix).
            w.send(0, [v.BlockRemoved(block_hashes=[a[0]], medium="CPU")])
            w.sync()
            assert tiers(router, A, W, 0) == (2, 1, 1, 0)
            w.send(0, [v.BlockRemoved(block_hashes=[a[2]], medium="CPU")])
            w.sync()
            assert tiers(router, A, W, 0) == (2, 0, 0, 0)

            # A block held twice: vLLM recomputes the last block of a fully cached prompt into a
            # second physical block with the same hash, publishes a store for it, and later one
            # removal per copy it evicts (scripts/test-engines.sh found it with a real engine).
            # Evicting one copy leaves the block cached.
            H, h = prompt(9, 2), hashes(2, 9)
            w.send(0, [stored(h, None, H)])
            w.send(0, [stored(h[1:], h[0], H[16:])])
            w.send(0, [v.BlockRemoved(block_hashes=[h[1]], medium="GPU")])
            w.sync()
            assert tiers(router, H, W, 0) == (2, 0, 0, 0), "one copy evicted, one left"
            w.send(0, [v.BlockRemoved(block_hashes=[h[1]], medium="GPU")])
            w.sync()
            assert tiers(router, H, W, 0) == (1, 0, 0, 0), "the last copy evicted"

            # LoRA: the adapter's name is in every block's extra keys.
            C, c = prompt(3, 2), hashes(2, 3)
            w.send(1, [stored(c, None, C, lora="sql-adapter", extra_keys=[("sql-adapter",)] * 2)])
            w.sync()
            assert tiers(router, C, W, 1, lora_name="sql-adapter") == (2, 0, 0, 0)
            assert tiers(router, C, W, 1) == (0, 0, 0, 0)

            # Salt: in the request's first block only; the continuation inherits it.
            D, d = prompt(4, 3), hashes(3, 4)
            w.send(0, [stored(d[:2], None, D[:32], extra_keys=[("tenant-a",), None])])
            w.send(0, [stored(d[2:], d[1], D[32:])])
            w.sync()
            assert tiers(router, D, W, 0, cache_namespace="tenant-a") == (3, 0, 0, 0)
            assert tiers(router, D, W, 0) == (0, 0, 0, 0)
            assert tiers(router, D, W, 0, cache_namespace="tenant-b") == (0, 0, 0, 0)

            # Multimodal: an image in the first block ([identifier, offset], vLLM's digest).
            E, e = prompt(5, 2), hashes(2, 5)
            image = "3f" * 32
            w.send(1, [stored(e, None, E, extra_keys=[((image, 3),), None])])
            w.sync()
            assert tiers(router, E, W, 1, mm_hashes=[[int(image[:16], 16)], None]) == (2, 0, 0, 0)
            assert tiers(router, E, W, 1) == (0, 0, 0, 0)

            # A hybrid model publishes a store per KV-cache group, under the same block hash: the
            # sliding-window group's (group_idx 1, a window of 4 blocks) first, placed by the
            # full-attention one after it in the same batch; neither ignored nor rejected.
            S, s = prompt(8, 1), hashes(1, 8)

            def sliding_store() -> Any:
                return v.BlockStored(block_hashes=s, parent_block_hash=None, token_ids=S,
                                     block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                                     group_idx=1, kv_cache_spec_kind="sliding_window",
                                     kv_cache_spec_sliding_window=4 * BS)

            w.send(1, [sliding_store(),
                       v.BlockStored(block_hashes=s, parent_block_hash=None, token_ids=S, block_size=BS,
                                     lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                                     kv_cache_spec_kind="full_attention")])
            w.sync()
            assert w.stats().events_ignored == 0
            assert tiers(router, S, W, 1) == (1, 0, 0, 0)  # the window holds the block: a hit

            def sliding() -> Tuple[int, int, int]:  # kvr_metrics: events applied, rejected; blocks
                m = router.metrics()
                return m.sliding_events_applied, m.sliding_events_rejected, m.index_sliding_blocks

            assert sliding() == (1, 0, 1)
            # The sliding window moves on: its removal names group 1 only. Full attention still
            # holds the block, but the engine cannot resume there without the window's copy.
            w.send(1, [v.BlockRemoved(block_hashes=s, medium="GPU", group_idx=1)])
            w.sync()
            assert tiers(router, S, W, 1) == (0, 0, 0, 0)
            assert sliding() == (2, 0, 0)
            w.send(1, [sliding_store()])  # a later request's window holds it again
            w.sync()
            assert tiers(router, S, W, 1) == (1, 0, 0, 0)
            assert sliding() == (3, 0, 1)
            assert w.stats().events_ignored == 0
            # An MLA model (DeepSeek) stores as "mla_attention": full attention, indexed (on
            # rank 0: rank 1 is the hybrid model's, whose window would hold nothing of it).
            M, m = prompt(91, 1), hashes(1, 91)
            w.send(0, [v.BlockStored(block_hashes=m, parent_block_hash=None, token_ids=M, block_size=BS,
                                     lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                                     kv_cache_spec_kind="mla_attention")])
            w.sync()
            assert tiers(router, M, W, 0) == (1, 0, 0, 0)
            assert w.stats().events_ignored == 0

            # Two messages lost on rank 0's link, the third arrives: a gap, replayed from the
            # engine's replay socket; nothing is cleared.
            F, f = prompt(6, 3), hashes(3, 6)
            link = w.links[0]
            nxt = max(link.forwarded) + 1
            link.drop.update({nxt, nxt + 1})
            w.send(0, [stored(f[:1], None, F[:16])])
            w.send(0, [stored(f[1:], f[0], F[16:])])
            w.send(0, [v.BlockRemoved(block_hashes=[a[1]], medium="GPU")])
            w.sync()
            assert link.dropped == [nxt, nxt + 1]
            s = w.stats()
            assert (s.gaps, s.missed_messages, s.recoveries - w.recoveries_at_start,
                    s.state_unknown) == (1, 2, 1, 0)
            assert tiers(router, F, W, 0) == (3, 0, 0, 0)
            assert tiers(router, A, W, 0) == (1, 1, 0, 0)  # a[1] is still on the CPU
            assert tiers(router, D, W, 0, cache_namespace="tenant-a") == (3, 0, 0, 0)

            # A clear from rank 1's engine empties rank 1 only: each vLLM dp rank has a cache of
            # its own (docs/ingest.md), and rank 0 keeps its blocks.
            w.send(1, [v.AllBlocksCleared()])
            w.sync()
            assert tiers(router, B, W, 1) == tiers(router, C, W, 1, lora_name="sql-adapter") == (0, 0, 0, 0)
            assert tiers(router, F, W, 0) == (3, 0, 0, 0), "a clear is the publishing rank's"
            assert sliding() == (3, 0, 0), "the clear forgets rank 1's sliding-window group"

            # Rank 0's engine restarts: sequence 0 again, an empty cache.
            w.send(0, [stored(f[:1], None, F[:16])])
            w.send(1, [stored(b, None, B)])
            w.sync()
            assert tiers(router, F, W, 0) == (3, 0, 0, 0) and tiers(router, B, W, 1) == (3, 0, 0, 0)
            w.restart(0)
            G, g = prompt(7, 2), hashes(2, 7)
            w.send(0, [stored(g, None, G)])
            w.sync()
            assert w.stats().restarts == 1
            assert tiers(router, G, W, 0) == (2, 0, 0, 0)
            assert tiers(router, F, W, 0) == (0, 0, 0, 0)
            assert tiers(router, B, W, 1) == (3, 0, 0, 0), "a restart clears the restarted rank only"
            assert w.stats().rejected == (0,) * len(w.stats().rejected)
        finally:
            w.close()


# ---- SGLang


class Key:
    """The fields of SGLang's RadixKey that its event recorder reads."""

    def __init__(self, tokens: List[int], extra_key: Optional[str] = None,
                 cache_salt: Optional[str] = None, bigram: bool = False) -> None:
        self.token_ids = tokens
        self.extra_key = extra_key
        self.cache_salt = cache_salt
        self.is_bigram = bigram

    def __len__(self) -> int:
        return max(0, len(self.token_ids) - 1) if self.is_bigram else len(self.token_ids)


class Node:
    """A radix tree node as the recorder reads it: its key, its parent, and its pages' hex
    digests (SGLang's own are sha256 chains; any distinct digests do here)."""

    def __init__(self, parent: Optional["Node"], key: Key, seed: int, page_size: int = BS) -> None:
        self.parent = parent
        self.key = key
        rng = random.Random(seed)
        pages = (len(key) + page_size - 1) // page_size
        self.hash_value = [f"{rng.randrange(1 << 256):064x}" for _ in range(pages)]
        namespaced = key.extra_key is not None or key.cache_salt is not None
        self.event_hash_value = [f"{rng.randrange(1 << 256):064x}" for _ in range(pages)] if namespaced else None


class SglangWorker(Worker):
    def __init__(self, sglang: Any, *args: Any, dynamo_format: bool = False, page_size: int = BS,
                 **kwargs: Any) -> None:
        self.sg = sglang
        self.topic = kwargs.get("topic", "kv@")
        self.lora_names = sglang.events.KvEventLoraNames()
        self.recorder = sglang.events.KVCacheEventRecorder(
            enabled=True, page_size=page_size, dynamo_format=dynamo_format, lora_names=self.lora_names)
        super().__init__(*args, **kwargs)

    def clear_event(self) -> Any:
        return self.sg.kv_events.AllBlocksCleared()

    def send(self, rank: int, events: List[Any], count: bool = True) -> None:
        self.publishers[rank].publish(self.sg.kv_events.KVEventBatch(ts=time.time(), events=events))
        self.expected += count

    def record(self, rank: int, *calls: Tuple[str, Node, Any]) -> None:
        """Runs the recorder's record_store / record_remove calls and publishes what it made."""
        for what, node, medium in calls:
            getattr(self.recorder, what)(node, medium)
        self.send(rank, self.recorder.take())


def sglang_publisher(sg: Any) -> Any:
    def new(rank: int, endpoint: str, replay: Optional[str], topic: str) -> Any:
        return sg.kv_events.ZmqEventPublisher(attn_dp_rank=rank, endpoint=endpoint,
                                              replay_endpoint=replay, topic=topic, bind=True)

    return new


@pytest.mark.parametrize("dynamo_format", [False, True], ids=["default-format", "dynamo-format"])
def test_sglang_publisher(sglang, dynamo_format):
    sg = sglang
    GPU, CPU, DISK = (sg.kv_events.StorageMedium.GPU, sg.kv_events.StorageMedium.CPU,
                      sg.kv_events.StorageMedium.DISK)
    W = 21
    with kvrouter.Router(block_size=BS) as router, kvrouter.Ingest(router) as ingest:
        router.add_worker(kvrouter.WorkerConfig(W, dp_size=2))
        ingest.start()
        w = SglangWorker(sg, ingest, kvrouter.Engine.SGLANG, W, sglang_publisher(sg), replay=False,
                         dynamo_format=dynamo_format)
        try:
            root = Node(None, Key([]), 0)
            # Stores: a node of 2 pages and its child of 2 (one event: the recorder coalesces).
            A = prompt(1, 4)
            a1 = Node(root, Key(A[:32]), 1)
            a2 = Node(a1, Key(A[32:]), 2)
            B = prompt(2, 3)
            b1 = Node(root, Key(B), 3)
            w.record(0, ("record_store", a1, None), ("record_store", a2, None))
            w.record(1, ("record_store", b1, None))
            w.sync()
            assert tiers(router, A, W, 0) == (4, 0, 0, 0)
            assert tiers(router, B, W, 1) == (3, 0, 0, 0) and tiers(router, B, W, 0) == (0, 0, 0, 0)

            # HiCache: a2 backed up to host memory and to disk, then evicted from the GPU, then
            # from the host.
            w.record(0, ("record_store", a2, CPU), ("record_store", a2, DISK))
            w.sync()
            assert tiers(router, A, W, 0) == (4, 0, 0, 0)
            w.record(0, ("record_remove", a2, GPU))
            w.sync()
            assert tiers(router, A, W, 0) == (2, 2, 0, 0)
            w.record(0, ("record_remove", a2, CPU))
            w.sync()
            assert tiers(router, A, W, 0) == (2, 0, 2, 0)
            w.record(0, ("record_remove", a2, DISK))
            w.sync()
            assert tiers(router, A, W, 0) == (2, 0, 0, 0)

            # LoRA: the request's extra key ends with the adapter's id.
            lora_id = "0123456789abcdef0123456789abcdef"
            w.lora_names.register(types.SimpleNamespace(lora_id=lora_id, extra_key="x" + lora_id),
                                  "sql-adapter")
            C = prompt(3, 2)
            w.record(1, ("record_store", Node(root, Key(C, extra_key="x" + lora_id), 4), None))
            w.sync()
            assert tiers(router, C, W, 1, lora_name="sql-adapter") == (2, 0, 0, 0)
            assert tiers(router, C, W, 1) == (0, 0, 0, 0)

            # Salt: every page of a salted request says it.
            D = prompt(4, 3)
            d1 = Node(root, Key(D[:32], cache_salt="tenant-a"), 5)
            d2 = Node(d1, Key(D[32:], cache_salt="tenant-a"), 6)
            w.record(0, ("record_store", d1, None), ("record_store", d2, None))
            w.sync()
            assert tiers(router, D, W, 0, cache_namespace="tenant-a") == (3, 0, 0, 0)
            assert tiers(router, D, W, 0) == (0, 0, 0, 0)

            # EAGLE: a bigram key of 2 pages (33 raw tokens), published as token pairs.
            E = prompt(5, 2, extra=1)
            w.record(1, ("record_store", Node(root, Key(E, bigram=True), 7), None))
            w.sync()
            assert tiers(router, E, W, 1, eagle=True) == (2, 0, 0, 0)

            # A removal.
            w.record(0, ("record_remove", a1, GPU))
            w.sync()
            assert tiers(router, A, W, 0) == (0, 0, 0, 0)

            # A message lost on rank 0's link and no replay socket: the worker is cleared and
            # rank 0 flagged until its engine clears or restarts.
            link = w.links[0]
            nxt = max(link.forwarded) + 1
            link.drop.add(nxt)
            F = prompt(6, 2)
            f1 = Node(root, Key(F), 8)
            w.record(0, ("record_store", f1, None))
            w.expected -= 1
            w.record(0, ("record_store", a1, None))
            w.sync()
            s = w.stats()
            assert (s.gaps, s.missed_messages, s.state_unknown) == (1, 1, 1)
            assert tiers(router, D, W, 0, cache_namespace="tenant-a") == (0, 0, 0, 0)
            assert tiers(router, F, W, 0) == (0, 0, 0, 0)
            assert tiers(router, A, W, 0) == (2, 0, 0, 0)

            # A clear from rank 1's engine empties rank 1 only: each SGLang attention-dp rank has
            # a cache of its own, and rank 0 keeps its blocks.
            w.send(1, [sg.kv_events.AllBlocksCleared()])
            w.sync()
            assert tiers(router, B, W, 1) == tiers(router, E, W, 1, eagle=True) == (0, 0, 0, 0)
            assert tiers(router, A, W, 0) == (2, 0, 0, 0)
            assert w.stats().state_unknown == 1  # rank 0's own state is still unknown

            # Rank 0's engine restarts: sequence 0, the flag drops.
            w.restart(0)
            w.record(0, ("record_store", f1, None))
            w.sync()
            s = w.stats()
            assert (s.restarts, s.state_unknown) == (1, 0)
            assert tiers(router, F, W, 0) == (2, 0, 0, 0) and tiers(router, A, W, 0) == (0, 0, 0, 0)
            assert w.stats().rejected == (0,) * len(w.stats().rejected)
        finally:
            w.close()


def test_sglang_default_page_size_is_refused_with_advice(sglang):
    """SGLang's default page size 1 publishes one-token blocks: counted as BLOCK_SIZE."""
    with kvrouter.Router(block_size=BS) as router, kvrouter.Ingest(router) as ingest:
        ingest.start()
        w = SglangWorker(sglang, ingest, kvrouter.Engine.SGLANG, 31, sglang_publisher(sglang),
                         replay=False, ranks=1, page_size=1)
        try:
            A = prompt(1, 1)
            w.record(0, ("record_store", Node(Node(None, Key([]), 0), Key(A), 1, page_size=1), None))
            w.sync()
            assert tiers(router, A, 31, 0) == (0, 0, 0, 0)
            assert w.stats().rejected[kvrouter.IngestReject.BLOCK_SIZE] == 1
        finally:
            w.close()


# ---- Dynamo's selection core, fed by the same vLLM publishers


def test_candidate_figures_agree_with_dynamos_selection_service(vllm):
    """Dynamo's runtime-free SelectionService (ai-dynamo-runtime 1.6.1) and kvrouter both
    subscribe to the same two vLLM publishers (vLLM's own ZmqEventPublisher) and are asked the
    same questions, both with Dynamo's default cost settings: per candidate the overlap and the
    potential loads agree, the choice agrees where one candidate is best, and a booking, its
    prefill completion and its release move both routers' loads alike."""
    try:
        from dynamo import llm as dl
    except ImportError:  # pragma: no cover - depends on the venv
        _skip_or_fail("ai-dynamo-runtime (dynamo.llm) is not installed")
        return
    import asyncio

    v = vllm

    def stored(hs, parent, tokens):
        return v.BlockStored(block_hashes=hs, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                             lora_id=None, medium="GPU", lora_name=None, extra_keys=None)

    P, p = prompt(21, 4), hashes(4, 21)
    Q, q = prompt(22, 3), hashes(3, 22)
    R = prompt(23, 2)
    mixed = P[:2 * BS] + prompt(24, 2)

    def ours(router: kvrouter.Router, tokens: List[int]) -> Dict[int, Tuple[int, int, int, int]]:
        """Per worker: (device blocks, potential prefill tokens, potential decode blocks, active)."""
        overlap = {o.worker_id: o.device_blocks for o in router.overlap_scores(tokens)}
        return {l.worker_id: (overlap.get(l.worker_id, 0), l.potential_prefill_tokens,
                              l.potential_decode_blocks, l.active_requests)
                for l in router.potential_loads(tokens)}

    async def theirs(service: Any, tokens: List[int]) -> Dict[int, Tuple[int, int, int, int]]:
        request = {"token_ids": tokens}
        overlap = {o["worker_id"]: o["device_blocks"] for o in (await service.overlap_scores(request))["workers"]}
        return {l["worker_id"]: (overlap.get(l["worker_id"], 0), l["potential_prefill_tokens"],
                                 l["potential_decode_blocks"], l["active_requests"])
                for l in await service.potential_loads(request)}

    async def agree(router: kvrouter.Router, service: Any, tokens: List[int], what: str) -> None:
        # Dynamo applies events on its own threads: give it a moment to catch up.
        for _ in range(500):
            if await theirs(service, tokens) == ours(router, tokens):
                return
            await asyncio.sleep(0.02)
        assert await theirs(service, tokens) == ours(router, tokens), what

    async def heard(service: Any, workers: List[Any]) -> None:
        # Its ZMQ subscriptions reach the publishers when they do (replay off: what is published
        # before is lost to it): each worker stores a probe block until the service has it.
        probe = prompt(29, 1)
        for w in workers:
            for _ in range(500):
                w.send(0, [stored(hashes(1, 29), None, probe)])
                await asyncio.sleep(0.02)
                scores = (await service.overlap_scores({"token_ids": probe}))["workers"]
                if any(o["worker_id"] == w.worker_id for o in scores):
                    break
            else:
                raise AssertionError(f"Dynamo's service never heard worker {w.worker_id}")

    async def run(router: kvrouter.Router, workers: List[Any]) -> None:
        service = dl.SelectionService(indexer_threads=1)
        try:
            for w in workers:
                await service.upsert_worker({
                    "worker_id": w.worker_id, "endpoint": f"tcp://127.0.0.1:{free_port()}",
                    "kv_events_endpoint": w.engine_endpoint, "block_size": BS, "data_parallel_size": 1,
                    "total_kv_blocks": 1000, "max_num_batched_tokens": 8192})
            await heard(service, workers)
            one, two = workers
            one.send(0, [stored(p, None, P)])
            two.send(0, [stored(p[:2], None, P[:2 * BS]), stored(q, None, Q)])
            one.sync()
            two.sync()
            for tokens, what in ((P, "P"), (Q, "Q"), (mixed, "P's prefix, then new"), (R, "nothing cached")):
                await agree(router, service, tokens, what)
            for tokens in (P, Q):  # one candidate is best: both choose it
                choice = await service.select({"token_ids": tokens})
                assert choice["worker_id"] == router.find_best_match(tokens).worker_id

            # A booking of P on its holder, then its prefill, then its end.
            reserved = await service.select_and_reserve({"token_ids": P, "selection_id": "r1"})
            booked = router.find_best_match(P, kvrouter.RequestOptions(admit=True), request_id="r1")
            assert (reserved["worker_id"], booked.worker_id) == (one.worker_id, one.worker_id)
            for tokens in (Q, mixed):
                await agree(router, service, tokens, "with r1 booked")
            await service.prefill_complete("r1")
            router.mark_prefill_completed("r1")
            await agree(router, service, Q, "after r1's prefill")
            await service.free_reservation("r1")
            router.free_request("r1")
            await agree(router, service, Q, "after r1 ended")
        finally:
            service.shutdown()

    with kvrouter.Router(block_size=BS) as router, kvrouter.Ingest(router) as ingest:
        for worker in (31, 32):
            router.add_worker(worker)
        ingest.start()
        workers = [VllmWorker(v, ingest, kvrouter.Engine.VLLM, worker, vllm_publisher(v), replay=False, ranks=1)
                   for worker in (31, 32)]
        try:
            asyncio.run(run(router, workers))
        finally:
            for w in workers:
                w.close()
