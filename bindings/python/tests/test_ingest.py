"""Live KV events: stream listeners with the publisher, NATS subjects, a JetStream stream, a vLLM
engine over ZMQ, router replica sync through a Python callback and over NATS."""

from __future__ import annotations

import json
import os
import socket
import struct
import tempfile
import threading
import time
from typing import Callable

import pytest

import kvrouter
from conftest import free_port, prompt, wait_for
from kvrouter import StoredEvent


def batch_of(worker: int, tokens, first_hash: int = 1) -> kvrouter.EventBatch:
    b = kvrouter.EventBatch()
    n = len(tokens) // 16
    b.add_stored(StoredEvent(worker_id=worker, block_hashes=list(range(first_hash, first_hash + n)), token_ids=tokens))
    return b


def device_blocks(router: kvrouter.Router, tokens, worker: int) -> int:
    return next((o.device_blocks for o in router.overlap_scores(tokens) if o.worker_id == worker), 0)


@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_stream_listener_and_publisher(router, kind):
    p = prompt(100, 3)
    with tempfile.TemporaryDirectory() as tmp, kvrouter.Ingest(router) as ingest:
        endpoint = f"unix://{tmp}/kv.sock" if kind == "unix" else "tcp://127.0.0.1:0"
        listener = ingest.listen(endpoint)
        assert listener.endpoint.startswith(kind) and not listener.endpoint.endswith(":0")
        assert ingest.source_endpoint(listener.source_id) == listener.endpoint
        ingest.start()
        with kvrouter.Publisher(listener.endpoint) as pub:
            batch = batch_of(2, p)
            batch.set_publish_time(time.time_ns())
            pub.send(batch)
            pub.send_encoded(batch_of(3, p, first_hash=50).encode())
            pub.send_encoded(b"\x00garbage frame")
        wait_for("events applied", lambda: device_blocks(router, p, 2) == 3 and device_blocks(router, p, 3) == 3)
        wait_for("the bad frame counted",
                 lambda: ingest.stats().rejected[kvrouter.IngestReject.BAD_FLATBUFFERS] == 1)
        stats = ingest.stats(listener.source_id)
        assert stats.messages == 3 and stats.events_applied == 2 and stats.connections == 1
        assert stats.lag_samples >= 1
        labels = f'source_id="{listener.source_id}",kind="listener",endpoint="{listener.endpoint}"'
        text = ingest.metrics_prometheus()
        assert f"\nkvrouter_ingest_messages_total{{{labels}}} 3\n" in text
        assert f'\nkvrouter_ingest_rejected_total{{{labels},reason="bad_flatbuffers"}} 1\n' in text
        assert f"\nkvrouter_ingest_lag_seconds_count{{{labels}}} {stats.lag_samples}\n" in text
        with pytest.raises(kvrouter.FailedPreconditionError):
            router.close()  # fed by an open ingest
        with pytest.raises(kvrouter.NotFoundError):
            ingest.stats(999)
        ingest.stop()
        ingest.stop()
    assert ingest.closed
    with pytest.raises(kvrouter.ClosedError):
        ingest.stats()


def test_publisher_connection_failure():
    with pytest.raises(kvrouter.UnavailableError):
        kvrouter.Publisher(f"tcp://127.0.0.1:{free_port()}")
    with kvrouter.Router() as r, kvrouter.Ingest(r) as ingest:
        with pytest.raises(kvrouter.InvalidArgumentError):
            ingest.listen("bogus://x")


def test_nats_subjects(router, nats_url):
    p = prompt(200, 2)
    with kvrouter.Ingest(router) as ingest:
        ingest.start()
        source = ingest.subscribe_nats(nats_url, "kv.events.>")
        assert ingest.source_endpoint(source) == nats_url
        # One EventBatch per message, published by a minimal NATS client (the text protocol).
        import socket

        host, port = nats_url.rsplit("/", 1)[1].split(":")
        with socket.create_connection((host, int(port))) as s:
            s.recv(4096)  # INFO
            data = batch_of(4, p).encode()
            s.sendall(b"CONNECT {\"verbose\":false}\r\n" + f"PUB kv.events.w4 {len(data)}\r\n".encode() + data
                      + b"\r\nPING\r\n")
            s.recv(4096)  # PONG
        wait_for("the NATS batch applied", lambda: device_blocks(router, p, 4) == 2)
        assert ingest.stats(source).connections >= 1


def _nats_publish(url: str, subject: str, data: bytes) -> None:
    """One message, published by a minimal NATS client (the text protocol), flushed."""
    import socket

    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port))) as s:
        s.recv(4096)  # INFO
        s.sendall(b"CONNECT {\"verbose\":false}\r\n" + f"PUB {subject} {len(data)}\r\n".encode() + data
                  + b"\r\nPING\r\n")
        s.recv(4096)  # PONG


def test_jetstream_stream_created_consumed_and_acknowledged(router, nats_jetstream_url):
    url = nats_jetstream_url
    p = prompt(300, 3)
    with kvrouter.Ingest(router) as ingest:
        ingest.start()
        # The refusals: no stream yet (and not asked to create it), a name with '.', no server.
        with pytest.raises(kvrouter.NotFoundError):
            ingest.subscribe_jetstream(url, "KV", "kv.>", durable="gw-1")
        with pytest.raises(kvrouter.InvalidArgumentError):
            ingest.subscribe_jetstream(url, "K.V", "kv.>", create_stream=True)
        with pytest.raises(kvrouter.UnavailableError):
            ingest.subscribe_jetstream(f"nats://127.0.0.1:{free_port()}", "KV", "kv.>", create_stream=True)

        source = ingest.subscribe_jetstream(url, "KV", "kv.>", durable="gw-1", create_stream=True)
        assert ingest.source_endpoint(source) == url
        _nats_publish(url, "kv.w1", batch_of(2, p).encode())  # a core publish: the stream stores it
        wait_for("stream sequence 1", lambda: ingest.stats(source).stream_sequence >= 1)
        stats = ingest.stats(source)
        assert (stats.stream_sequence, stats.messages, stats.events_applied) == (1, 1, 1)
        assert (stats.consumer_remakes, stats.consumer_remake_failures) == (0, 0)  # nothing lost
        assert ingest.stats().stream_sequence == 1  # the largest over the sources
        assert device_blocks(router, p, 2) == 3


def test_jetstream_relay_feeds_another_router(router, nats_jetstream_url):
    # A router fed by a stream listener relays its index changes into stream KV on
    # kv.relay.<worker>; a second router consuming kv.relay.> ends with the same index.
    url = nats_jetstream_url
    p = prompt(400, 3)
    with tempfile.TemporaryDirectory() as tmp, kvrouter.Router(block_size=16, random_seed=7) as second:
        for worker in (1, 2, 3, 4):
            second.add_worker(worker)
        with kvrouter.Ingest(router) as ingest, kvrouter.Ingest(second) as consumer:
            listener = ingest.listen(f"unix://{tmp}/relay.sock")
            ingest.start()
            # The refusals: a consumer's field (a durable name), a second relay.
            with pytest.raises(kvrouter.InvalidArgumentError):
                ingest.relay_jetstream(url, "KV", "kv.relay", durable="relay-1", create_stream=True)
            relay = ingest.relay_jetstream(url, "KV", "kv.relay", create_stream=True)
            assert relay not in (0, listener.source_id)
            with pytest.raises(kvrouter.FailedPreconditionError):
                ingest.relay_jetstream(url, "KV", "kv.relay", create_stream=True)

            consumer.start()
            consumed = consumer.subscribe_jetstream(url, "KV", "kv.relay.>", durable="gw-2")
            with kvrouter.Publisher(listener.endpoint) as pub:
                pub.send(batch_of(2, p))

            def caught_up() -> bool:
                s = ingest.stats(relay)
                return s.messages >= 1 and s.messages == s.events_applied + s.missed_messages and s.state_unknown == 0

            wait_for("the relay caught up", caught_up)
            relayed = ingest.stats(relay)
            assert relayed.stream_sequence > 0 and relayed.published > 0 and relayed.missed_messages == 0
            wait_for("the consumer at the relay's last message",
                     lambda: consumer.stats(consumed).stream_sequence >= relayed.stream_sequence)
            assert consumer.stats(consumed).stream_sequence == relayed.stream_sequence
            assert router.index_digest() == second.index_digest()
            assert device_blocks(second, p, 2) == 3


def test_jetstream_defaults_are_the_librarys():
    from kvrouter import _abi, _native
    from kvrouter._options import _JetStreamSource

    lowered = _native.lower("kvr_jetstream_source", _JetStreamSource()._fields())
    assert lowered == _native.defaults("kvr_jetstream_source")
    assert (lowered["max_age_seconds"], lowered["max_bytes"]) == (3600.0, 1 << 30)
    # Each flag from its own argument.
    assert _JetStreamSource(resume=True)._fields()["flags"] == _abi.JETSTREAM_RESUME
    assert _JetStreamSource(create_stream=True)._fields()["flags"] == _abi.JETSTREAM_CREATE_STREAM


def test_replica_sync_through_a_python_callback():
    with kvrouter.Router(block_size=16) as a, kvrouter.Router(block_size=16) as b:
        for r in (a, b):
            r.add_worker(1)
            r.add_worker(2)
        sent = []
        a.set_replica_publisher("gw-a", sent.append)
        assert len(sent) == 2  # a Reset and a SyncRequest: a has no bookings yet
        for change in sent:
            b.apply_replica_event(change)
        del sent[:]
        p = prompt(1, 8)
        a.find_best_match(p, request_id="r1")
        assert sent, "the booking was published"
        for change in sent:
            b.apply_replica_event(change)
        assert b.metrics().replica_requests_active == 1
        del sent[:]
        a.free_request("r1")
        for change in sent:
            b.apply_replica_event(change)
        assert b.metrics().replica_requests_active == 0
        with pytest.raises(kvrouter.InvalidArgumentError):
            b.apply_replica_event(b"junk")
        with pytest.raises(kvrouter.InvalidArgumentError):
            a.set_replica_publisher("bad\x1fid", sent.append)
        a.set_replica_publisher("gw-a", None)


def test_a_silent_replica_that_sent_heartbeats_is_expired_with_its_bookings():
    with kvrouter.Router(block_size=16) as a, kvrouter.Router(block_size=16) as b:
        for r in (a, b):
            r.add_worker(1)
            r.add_worker(2)
        sent = []
        a.set_replica_publisher("gw-a", sent.append)
        b.set_time(0)

        def deliver():
            for change in sent:
                b.apply_replica_event(change)
            del sent[:]

        deliver()  # the Reset and the SyncRequest
        a.find_best_match(prompt(1, 8), request_id="r1")
        a.replica_heartbeat(1000)
        assert len(sent) == 2  # the booking and the heartbeat
        deliver()
        m = b.metrics()
        assert (m.replicas_live, m.replicas_expired, m.replica_requests_active) == (1, 0, 1)
        assert m.replica_changes_applied == 4  # a heartbeat counts as applied, as a Reset does

        # 9 s of silence is within a 10 s timeout (three 1 s intervals are less); 11 s is not.
        b.set_time(9_000_000_000)
        assert b.expire_replicas(10.0) == 0
        b.set_time(11_000_000_000)
        assert b.expire_replicas(10.0) == 1
        m = b.metrics()
        assert (m.replicas_live, m.replicas_expired, m.replica_requests_active, m.requests_active) == (0, 1, 0, 0)
        assert b.expire_replicas(10.0) == 0
        assert a.metrics().requests_active == 1  # a keeps its own booking

        with pytest.raises(kvrouter.InvalidArgumentError):
            a.replica_heartbeat(0)
        with pytest.raises(OverflowError):
            a.replica_heartbeat(-1)
        with pytest.raises(kvrouter.FailedPreconditionError):
            b.replica_heartbeat(1000)  # b has no publisher
        with pytest.raises(kvrouter.InvalidArgumentError):
            b.expire_replicas(0.0)
        assert sent == []  # refused heartbeats publish nothing
    with pytest.raises(kvrouter.ClosedError):
        a.replica_heartbeat(1000)
    with pytest.raises(kvrouter.ClosedError):
        a.expire_replicas(1.0)


def test_replica_liveness_settings_reach_the_library():
    assert (kvrouter.IngestOptions().replica_heartbeat_ms, kvrouter.IngestOptions().replica_timeout_ms) == (1000, 10000)
    with kvrouter.Router(block_size=16) as router:
        for options in (kvrouter.IngestOptions(replica_heartbeat_ms=3_600_001),
                        kvrouter.IngestOptions(replica_timeout_ms=3_600_001)):
            with pytest.raises(kvrouter.InvalidArgumentError):
                kvrouter.Ingest(router, options)
        kvrouter.Ingest(router, kvrouter.IngestOptions(replica_heartbeat_ms=3_600_000, replica_timeout_ms=0)).close()


def test_a_raising_callback_is_reported_not_lost(monkeypatch):
    seen = []
    monkeypatch.setattr("sys.unraisablehook", lambda u: seen.append(u.exc_value))
    with kvrouter.Router(block_size=16) as r:
        r.add_worker(1)

        def boom(change: bytes) -> None:
            raise RuntimeError("publish failed")

        r.set_replica_publisher("gw", boom)
        r.find_best_match(prompt(1, 2), request_id="x")
    assert seen and all(isinstance(e, RuntimeError) for e in seen)


def test_replica_sync_over_nats(nats_url):
    routers = [kvrouter.Router(block_size=16) for _ in range(2)]
    ingests = []
    try:
        for i, r in enumerate(routers):
            r.add_worker(1)
            r.add_worker(2)
            ing = kvrouter.Ingest(r)
            ing.start()
            ing.sync_replicas(nats_url, "kv.replicas", f"gw-{i}")
            ingests.append(ing)
        routers[0].find_best_match(prompt(1, 8), request_id="r1")
        wait_for("the booking synced", lambda: routers[1].metrics().replica_requests_active == 1)
        routers[0].free_request("r1")
        wait_for("the free synced", lambda: routers[1].metrics().replica_requests_active == 0)
        assert ingests[0].stats().published >= 2
        assert ingests[0].stats().bookings_trimmed == 0  # a short booking, 1 MiB messages
    finally:
        for ing in ingests:
            ing.close()
        for r in routers:
            r.close()


def test_replica_sync_counts_trimmed_bookings(nats_4k_url):
    # Over a server whose messages are at most 4 KiB, a booking of 1,000 blocks (8 KB of block
    # ids) goes with its leading block ids and is counted in bookings_trimmed; a short booking,
    # and a free (no block ids), are not. The changes are published, and counted, within the
    # routing calls.
    with kvrouter.Router(block_size=16) as r:
        r.add_worker(1)
        with kvrouter.Ingest(r, kvrouter.IngestOptions(replica_heartbeat_ms=0)) as ingest:
            ingest.start()
            source = ingest.sync_replicas(nats_4k_url, "kv.trimmed", "gw-a")  # Reset, SyncRequest
            r.add_request(prompt(0, 4), 1, request_id="short")
            assert ingest.stats(source).bookings_trimmed == 0
            r.add_request(prompt(100_000, 1000), 1, request_id="long")
            r.free_request("long")
            stats = ingest.stats(source)
            assert (stats.bookings_trimmed, stats.published, stats.publish_failures) == (1, 5, 0)
            assert ingest.stats().bookings_trimmed == 1  # source 0: the sum
            assert any(line.startswith(f'kvrouter_ingest_bookings_trimmed_total{{source_id="{source}",'
                                       'kind="replicas",') and line.endswith("} 1")
                       for line in ingest.metrics_prometheus().splitlines())


def test_vllm_engine_over_zmq(router):
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    p = prompt(300, 3)
    try:
        with kvrouter.Ingest(router) as ingest:
            source = ingest.add_engine_worker(kvrouter.EngineWorker(f"tcp://127.0.0.1:{port}", 3))
            ingest.start()
            seq = 0

            def send(events):
                nonlocal seq
                payload = msgpack.packb([time.time(), events, 0])
                pub.send_multipart([b"", struct.pack(">Q", seq), payload])
                seq += 1

            stored = ["BlockStored", [11, 12, 13], None, p, 16, None, "GPU"]
            # The subscription takes a moment: resend until it is applied (a restart at 0 each time).
            deadline = time.monotonic() + 10
            while device_blocks(router, p, 3) != 3 and time.monotonic() < deadline:
                seq = 0
                send([stored])
                time.sleep(0.05)
            assert device_blocks(router, p, 3) == 3
            send([["BlockRemoved", [13], "GPU"]])
            wait_for("the removal", lambda: device_blocks(router, p, 3) == 2)
            pub.send_multipart([b"", struct.pack(">Q", seq), b"\xc1not msgpack"])
            seq += 1
            wait_for("the bad payload counted",
                     lambda: ingest.stats(source).rejected[kvrouter.IngestReject.BAD_MSGPACK] == 1)
            # An event of a type this library does not know is skipped alone, with its reason.
            send([["SomethingNew", 1], ["BlockRemoved", [12], "GPU"]])
            wait_for("the removal beside it", lambda: device_blocks(router, p, 3) == 1)
            stats = ingest.stats(source)
            assert stats.rejected[kvrouter.IngestReject.BAD_MSGPACK] == 2
            assert stats.last_reject == "event 0: unknown event tag 'SomethingNew'"
            assert stats.events_ignored == 0
            # A hybrid model's batch: a store of its sliding-window group (group_idx 1), which no
            # router indexes, is counted as ignored, not rejected; the full-attention store
            # beside it applies. The array form: [tag, block_hashes, parent_hash, token_ids,
            # block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind].
            q = prompt(700, 1)
            send([["BlockStored", [31], None, q, 16, None, "GPU", None, None, 1, "sliding_window"],
                  ["BlockStored", [21], None, q, 16, None, "GPU", None, None, 0, "full_attention"]])
            wait_for("the full-attention store, and the sliding-window one counted",
                     lambda: device_blocks(router, q, 3) == 1 and ingest.stats(source).events_ignored >= 1)
            ignored = ingest.stats(source)
            assert ignored.events_ignored == 1
            assert ignored.events_applied == stats.events_applied + 1  # the full-attention store only
            assert ignored.rejected == stats.rejected and ignored.last_reject == stats.last_reject
            assert ingest.stats().events_ignored == 1  # source 0: the sum
            assert (f'\nkvrouter_ingest_events_ignored_total{{source_id="{source}",kind="engine",'
                    f'endpoint="tcp://127.0.0.1:{port}"}} 1\n') in ingest.metrics_prometheus()
            with pytest.raises(kvrouter.AlreadyExistsError):
                ingest.add_engine_worker(kvrouter.EngineWorker(f"tcp://127.0.0.1:{port}", 3))
            ingest.remove_engine_worker(3, clear_index=True)
            assert device_blocks(router, p, 3) == 0
    finally:
        pub.close(0)
        ctx.term()


def test_a_router_in_a_cycle_with_its_publisher_is_collected():
    import gc
    import weakref

    class Bus:
        def __init__(self) -> None:
            self.router = kvrouter.Router(block_size=16)
            self.sent = []
            self.router.set_replica_publisher("gw", self.publish)  # router -> bound method -> self

        def publish(self, change: bytes) -> None:
            self.sent.append(change)

    bus = Bus()
    ref = weakref.ref(bus.router)
    assert bus.sent
    del bus
    gc.collect()
    assert ref() is None



def test_a_pool_router_in_a_cycle_with_its_publisher_is_collected_after_its_disagg_closed():
    # The collector once unset the publisher of a Disagg pool's router whose Disagg had freed it.
    import gc
    import weakref

    sent = []
    for _ in range(10):
        d = kvrouter.Disagg()
        pool = d.prefill_router
        pool.set_replica_publisher("gw", lambda change, pool=pool: sent.append(change))
        d.close()  # frees both pools' C routers
        ref = weakref.ref(pool)
        del d, pool
        gc.collect()
        assert ref() is None
    assert len(sent) == 20  # each publisher's Reset and SyncRequest; no farewell: its router is gone

_CYCLE_CLEARED_BEFORE_ITS_ROUTER = r"""
import gc, sys
import kvrouter

sent = []

def owned():
    # The closure's cell and publish are tracked before the router, the list holding it after:
    # the collector clears them in that order, so publish is cleared while the router still
    # holds it (the router goes by its tp_clear, not by its count falling to 0).
    def publish(change):
        sent.append(("owned", len(change)))
        try:
            holder.append(len(change))
        except NameError:  # the announcement, before holder is bound
            pass
    r = kvrouter.Router(block_size=16)
    r.set_replica_publisher("a", publish)  # Reset, SyncRequest
    holder = [r]
    holder.append(holder)

def pool():
    def publish(change):
        sent.append(("pool", len(change)))
        try:
            holder.append(len(change))
        except NameError:
            pass
    d = kvrouter.Disagg()
    d.prefill_router.set_replica_publisher("p", publish)  # Reset, SyncRequest
    holder = [d]
    holder.append(holder)

for _ in range(int(sys.argv[1])):
    owned()
    pool()
    gc.collect()
print(sum(k == "owned" for k, _ in sent), sum(k == "pool" for k, _ in sent))
"""


def test_a_publisher_collected_in_a_cycle_with_its_router_is_never_called_half_cleared():
    # The collector clears a cycle's objects in any order: the router's tp_clear once unset the
    # publisher, whose farewell called a publish function already cleared (a crash). Now a
    # router the object frees says no farewell (as kvr_router_free, and the Go, Rust and Java
    # bindings): 2 messages each. A Disagg pool's router, whose C router outlives it, says
    # farewell in its finalizer, before anything in the cycle is cleared: 3 each.
    import subprocess
    import sys

    rounds = 200
    child = subprocess.run([sys.executable, "-c", _CYCLE_CLEARED_BEFORE_ITS_ROUTER, str(rounds)],
                           capture_output=True, text=True)
    assert (child.returncode == 0 and child.stdout == f"{2 * rounds} {3 * rounds}\n"
            and "Exception ignored" not in child.stderr), (
        f"exit status {child.returncode}\n{child.stdout}{child.stderr}")


_CYCLE_THROUGH_AN_INGEST = r"""
import gc, sys, threading, time, weakref
import kvrouter

def encoded_batches():
    out = []
    for n in range(1, 9):
        b = kvrouter.EventBatch()
        b.add_stored(kvrouter.StoredEvent(worker_id=1, block_hashes=list(range(1, n + 1)),
                                          token_ids=list(range(n * 16))))
        out.append(b.encode())
    return out

def feed(endpoint, stop):
    # Until told to stop, or until the ingest goes away (its connection closed).
    try:
        with kvrouter.Publisher(endpoint) as pub:
            batches = encoded_batches()
            while not stop.is_set():
                for data in batches:
                    pub.send_encoded(data)
    except kvrouter.UnavailableError:
        pass


def cycle(n, collected):
    # A router and an ingest feeding it, in a cycle and held nowhere else: their weak
    # references, and the feeder's stop event and thread.
    r = kvrouter.Router(block_size=16)
    r.add_worker(1)
    if n % 2 == 0:  # router -> publisher -> ingest -> router
        i = kvrouter.Ingest(r)
        r.set_replica_publisher("b", lambda b, i=i: None)
    else:  # the same cycle, its objects made in another order (the collector clears in order)
        box = []
        r.set_replica_publisher("b", lambda b, box=box: None)
        i = kvrouter.Ingest(r)
        box.append(i)
    endpoint = i.listen("tcp://127.0.0.1:0").endpoint
    i.start()
    stop = threading.Event()
    feeder = threading.Thread(target=feed, args=(endpoint, stop))
    feeder.start()
    while i.stats().events_applied < 100:  # events flowing into the router
        time.sleep(0.001)
    refs = (weakref.ref(r, lambda _: collected.append(("router", n))),
            weakref.ref(i, lambda _: collected.append(("ingest", n))))
    return refs, stop, feeder


collected = []
for n in range(int(sys.argv[1])):
    refs, stop, feeder = cycle(n, collected)
    try:
        # The ingest's loop keeps applying events meanwhile. (A collection the feeder's
        # allocations started may be under way, and gc.collect() then returns at once: again.)
        deadline = time.monotonic() + 60
        while len(collected) < 2 * (n + 1) and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.001)
        assert sorted(collected[-2:]) == [("ingest", n), ("router", n)], collected
    finally:
        stop.set()
        feeder.join()
print("collected", len(collected))
"""


def test_a_router_in_a_cycle_through_an_ingest_is_collected_while_it_feeds_the_router():
    # router -> replica publisher -> Ingest -> router: the collector once freed the C router
    # (the router's tp_clear) while the ingest's loop thread was still applying events to it, and
    # later stopped the ingest against the freed router. A crash kills the child, not the tests.
    import subprocess
    import sys

    rounds = 10
    child = subprocess.run([sys.executable, "-c", _CYCLE_THROUGH_AN_INGEST, str(rounds)],
                           capture_output=True, text=True)
    assert child.returncode == 0 and child.stdout == f"collected {2 * rounds}\n", (
        f"exit status {child.returncode}\n{child.stdout}{child.stderr}")


def _serve_nats_pings(conn: socket.socket, server_id: str, port: int,
                      on_confirmation: Callable[[], None]) -> None:
    """Plays a NATS server on `conn` until the client closes it: INFO, then a PONG for every
    PING; `on_confirmation` runs before answering the second PING (the first is the handshake's,
    the second a subscription's confirmation round trip)."""
    with conn:
        info = {"server_id": server_id, "version": "2.10.0", "go": "go1.21", "host": "127.0.0.1",
                "port": port, "max_payload": 1 << 20, "proto": 1}
        conn.sendall(b"INFO " + json.dumps(info).encode() + b"\r\n")
        pending, pings = b"", 0
        try:
            while True:
                data = conn.recv(4096)
                if not data:
                    return
                pending += data
                while b"\r\n" in pending:
                    line, pending = pending.split(b"\r\n", 1)
                    if line == b"PING":
                        pings += 1
                        if pings == 2:
                            on_confirmation()
                        conn.sendall(b"PONG\r\n")
        except OSError:  # the client closed the connection
            return


class _HeldNatsServer:
    """A NATS server on 127.0.0.1 that answers a client's handshake, then holds its answer to
    the next PING (a subscription's confirmation round trip: kvr_ingest_subscribe_nats waits for
    it on the caller's thread) until `release` is set."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1)
        self.port = self.listener.getsockname()[1]
        self.url = f"nats://127.0.0.1:{self.port}"
        self.holding = threading.Event()
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        _serve_nats_pings(conn, "held", self.port, self._hold)

    def _hold(self) -> None:
        self.holding.set()
        self.release.wait()

    def close(self) -> None:
        self.release.set()
        self.listener.close()
        self.thread.join(60)


@pytest.mark.parametrize("call", ["subscribe_nats", "sync_replicas"])
def test_stop_waits_for_a_nats_subscription_in_flight(router, call):
    # kvrouter.h: subscribe_nats and sync_replicas (as subscribe_jetstream and relay_jetstream)
    # are concurrent "except with kvr_ingest_stop": the confirmation round trip runs on the
    # caller's thread, on the connection stop closes. stop() once went ahead, closing the
    # connection under the subscription (which then failed, when it did not touch the freed
    # connection); it now waits for the call in flight.
    server = _HeldNatsServer()
    events = []  # in the order they happened
    stop_called, stopped = threading.Event(), threading.Event()
    try:
        with kvrouter.Ingest(router) as ingest:
            ingest.start()

            def subscribe() -> None:
                try:
                    if call == "subscribe_nats":
                        source = ingest.subscribe_nats(server.url, "kv.>")
                    else:
                        source = ingest.sync_replicas(server.url, "kv.replicas", "gw-a")
                    events.append(("subscribed", source))
                except kvrouter.KvRouterError as e:
                    events.append(("refused", str(e)))

            def stop() -> None:
                stop_called.set()
                ingest.stop()
                events.append("stopped")
                stopped.set()

            subscriber = threading.Thread(target=subscribe)
            subscriber.start()
            assert server.holding.wait(60), "the subscription's round trip never came"
            stopper = threading.Thread(target=stop)
            stopper.start()
            assert stop_called.wait(60)
            # A stop that does not wait returns in a few milliseconds; give it a second (the
            # client gives up on the answer after 5 s) before answering the subscription.
            stopped.wait(1.0)
            events.append("answered")
            server.release.set()
            subscriber.join(60)
            stopper.join(60)
            assert not subscriber.is_alive() and not stopper.is_alive()
            assert [e[0] if isinstance(e, tuple) else e for e in events] == ["answered", "subscribed", "stopped"], events
            assert ingest.stats(events[1][1]).connections == 1
    finally:
        server.close()


class _ChainedNatsServer:
    """A NATS server on 127.0.0.1 that holds its answer to each subscription's confirmation
    round trip (the second PING of a connection, as _HeldNatsServer) for at least `min_hold`
    seconds and until the next subscription's has arrived, at most `max_hold` seconds: while
    subscriptions keep coming, one is always in flight, so the calls' hold on the ingest's
    stop lock (shared) never lapses."""

    def __init__(self, min_hold: float, max_hold: float) -> None:
        self.min_hold, self.max_hold = min_hold, max_hold
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.listener.settimeout(0.1)  # closing a socket does not wake a thread in accept()
        self.port = self.listener.getsockname()[1]
        self.url = f"nats://127.0.0.1:{self.port}"
        self.closing = threading.Event()
        self.arrived = threading.Condition()
        self.arrivals = 0  # subscriptions whose round trip has reached the server
        self.threads = []
        self.accepter = threading.Thread(target=self._accept, daemon=True)
        self.accepter.start()

    def _accept(self) -> None:
        while not self.closing.is_set():
            try:
                conn, _ = self.listener.accept()  # blocking, unlike the listener
            except socket.timeout:
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _hold(self) -> None:
        with self.arrived:
            self.arrivals += 1
            mine = self.arrivals
            self.arrived.notify_all()
        start = time.monotonic()
        with self.arrived:
            self.arrived.wait_for(lambda: self.arrivals > mine, self.max_hold)
        time.sleep(max(0.0, self.min_hold - (time.monotonic() - start)))

    def _serve(self, conn: socket.socket) -> None:
        _serve_nats_pings(conn, "chained", self.port, self._hold)

    def close(self) -> None:
        self.closing.set()
        self.accepter.join(60)
        self.listener.close()
        for thread in self.threads:  # each ends when the client closes its connection
            thread.join(60)


def test_stop_is_not_starved_by_overlapping_subscriptions(router):
    # stop() takes the ingest's stop lock exclusively, the subscribe calls shared (see
    # test_stop_waits_for_a_nats_subscription_in_flight). glibc's default rwlock admits a
    # reader whenever readers hold it, even while a writer waits: two threads subscribing
    # without a pause, their round trips overlapping, kept stop waiting for as long as they
    # went on. The calls made once stop has been called are now refused: the one in flight
    # ends (its answer comes after max_hold at the latest) and stop runs.
    server = _ChainedNatsServer(min_hold=0.2, max_hold=1.0)
    done = threading.Event()
    stopped = threading.Event()
    outcomes = []

    def subscribe() -> None:
        while not done.is_set():
            try:
                ingest.subscribe_nats(server.url, "kv.>")
                outcomes.append("subscribed")
            except kvrouter.FailedPreconditionError:  # stopping, or stopped
                outcomes.append("refused")
                return

    def stop() -> None:
        ingest.stop()
        stopped.set()

    try:
        with kvrouter.Ingest(router) as ingest:
            ingest.start()
            subscribers = [threading.Thread(target=subscribe) for _ in range(2)]
            for t in subscribers:
                t.start()
            wait_for("subscriptions in a chain", lambda: server.arrivals >= 4)
            stopper = threading.Thread(target=stop)
            began = time.monotonic()
            stopper.start()
            in_time = stopped.wait(10)
            waited = time.monotonic() - began
            done.set()  # a starved stop runs once the subscriptions end
            for t in subscribers:
                t.join(60)
            stopper.join(60)
            assert not stopper.is_alive() and not any(t.is_alive() for t in subscribers)
            assert in_time, f"stop starved: still waiting after {waited:.1f} s, {server.arrivals} subscriptions arrived"
            assert outcomes.count("subscribed") >= 3, outcomes
    finally:
        server.close()

