"""Routing, workers, events, errors, token buffers, the lifecycle, snapshots, metrics, threads."""

from __future__ import annotations

import array
import gc
import math
import sys
import threading
import time
import weakref

import pytest

import kvrouter
from conftest import cancelled_within, in_thread, prompt, wait_for
from kvrouter import RequestOptions, StoredEvent


def store(r: kvrouter.Router, worker: int, tokens, first_hash: int = 0xA0, dp_rank: int = 0, **kw) -> None:
    blocks = len(tokens) // 16
    r.apply_stored(StoredEvent(worker_id=worker, dp_rank=dp_rank,
                               block_hashes=[first_hash + i for i in range(blocks)],
                               token_ids=tokens[: blocks * 16], **kw))


def test_routes_to_the_worker_holding_the_prefix(router):
    p = prompt(1000, 3)
    store(router, 2, p[:32])
    res = router.find_best_match(p)
    assert (res.worker_id, res.dp_rank, res.device_overlap_blocks, res.cached_tokens) == (2, 0, 2, 32)
    assert (res.prompt_blocks, res.prompt_tokens, res.booked) == (3, 48, 0)
    assert router.metrics().requests_active == 0  # a preview books nothing


def test_admitted_request_lifecycle(router):
    p = prompt(1000, 3)
    res = router.find_best_match(p, request_id="req-1")
    assert res.booked == 1
    assert router.metrics().requests_active == 1
    with pytest.raises(kvrouter.AlreadyExistsError) as err:
        router.find_best_match(p, request_id="req-1")
    assert err.value.status == kvrouter.Status.ALREADY_EXISTS
    assert "req-1" in err.value.message
    router.mark_prefill_completed("req-1")
    router.free_request("req-1")
    router.free_request("req-1")  # idempotent
    assert router.metrics().requests_active == 0
    opts = RequestOptions(admit=True, request_id="req-2")
    assert router.find_best_match(p, opts).booked == 1
    router.free_request("req-2")


def test_load_moves_requests_away(router):
    p = prompt(5000, 8)
    chosen = {router.find_best_match(p, request_id=f"r{i}").worker_id for i in range(4)}
    assert chosen == {1, 2, 3, 4}


def test_candidates_carry_every_cost_term(router):
    p = prompt(1000, 3)
    store(router, 3, p)
    res, candidates, total = router.find_best_match_with_candidates(p)
    assert total == 4 and len(candidates) == 4
    chosen = [c for c in candidates if c.chosen]
    assert len(chosen) == 1 and chosen[0].worker_id == res.worker_id == 3
    assert chosen[0].cost == res.cost and chosen[0].device_blocks == 3
    res, candidates, total = router.find_best_match_with_candidates(p, max_candidates=2)
    assert total == 4 and len(candidates) == 2


def test_token_buffers_and_sequences_agree(router):
    np = pytest.importorskip("numpy")
    p = prompt(1000, 4)
    store(router, 2, p[:48])
    want = router.find_best_match(p)
    for tokens in (p, tuple(p), array.array("I", p), array.array("Q", p), array.array("i", p),
                   memoryview(array.array("I", p)), np.array(p, dtype=np.uint32),
                   np.array(p, dtype=np.int64), (t for t in p)):
        got = router.find_best_match(tokens)
        assert (got.worker_id, got.cached_tokens) == (want.worker_id, want.cached_tokens), type(tokens)


def test_bad_tokens_are_refused(router):
    np = pytest.importorskip("numpy")
    for bad, exc in [("abc", TypeError), (b"abc", TypeError), ([1, -1], OverflowError),
                     ([1 << 32], OverflowError), ([1.5], TypeError), (array.array("d", [1.0]), TypeError),
                     (np.zeros((2, 2), dtype=np.uint32), ValueError), (np.array([-3], dtype=np.int32), OverflowError),
                     (None, TypeError), (5, TypeError)]:
        with pytest.raises(exc):
            router.find_best_match(bad)


def test_request_options(router):
    p = prompt(1000, 3)
    store(router, 1, p)
    only = RequestOptions(allowed_worker_ids=[3, 4])
    assert router.find_best_match(p, only).worker_id in (3, 4)
    # An empty list allows no worker (a tenant filtered down to none is not routed on anyone's).
    with pytest.raises(kvrouter.UnavailableError, match="no worker is allowed"):
        router.find_best_match(p, RequestOptions(allowed_worker_ids=[]), request_id="nobody")
    assert router.metrics().requests_active == 0
    lora = RequestOptions(lora_name="adapter")  # other hashes: worker 1's blocks do not match
    assert router.find_best_match(p, lora).cached_tokens == 0
    no_credit = RequestOptions(overlap_score_credit=0.0)
    _, cands, _ = router.find_best_match_with_candidates(p, no_credit)
    assert all(c.credit == 0 for c in cands)
    with pytest.raises(ValueError, match="NUL"):
        router.find_best_match(p, request_id="a\0b")
    with pytest.raises(kvrouter.InvalidArgumentError):
        router.find_best_match(p, RequestOptions(temperature=-1.0))


def test_newer_cost_knobs_and_output_tracking():
    with kvrouter.Router(block_size=16, track_output_blocks=True, decode_active_request_weight=2.0) as r:
        r.add_worker(1)
        p = prompt(1, 2)
        r.find_best_match(p, request_id="a")
        _, cands, _ = r.find_best_match_with_candidates(p)
        assert cands[0].active_requests == 1 and cands[0].request_cost == 2.0
        before = r.potential_loads(p)[0].active_blocks
        r.record_output("a", 64)
        assert r.potential_loads(p)[0].active_blocks > before
        r.free_request("a")
    with kvrouter.Router(block_size=16) as r:
        with pytest.raises(kvrouter.FailedPreconditionError):
            r.record_output("a", 1)


def test_workers(router):
    with pytest.raises(kvrouter.AlreadyExistsError):
        router.add_worker(1)
    with pytest.raises(kvrouter.NotFoundError):
        router.remove_worker(99)
    with pytest.raises(kvrouter.InvalidArgumentError):
        router.add_worker(9, block_size=32)
    router.add_worker(kvrouter.WorkerConfig(10, dp_size=2))
    router.update_worker(kvrouter.WorkerConfig(10, dp_size=3))
    assert router.metrics().workers == 5
    router.remove_worker(10)
    assert router.metrics().workers == 4


def test_events_and_their_errors(router):
    p = prompt(1000, 2)
    store(router, 1, p, first_hash=0x10)
    with pytest.raises(kvrouter.NotFoundError):
        router.apply_stored(StoredEvent(worker_id=1, block_hashes=[0x99], token_ids=p[:16], parent_hash=0x1234))
    with pytest.raises(kvrouter.InvalidArgumentError):
        router.apply_stored(StoredEvent(worker_id=1, block_hashes=[0x98], token_ids=p[:10]))
    router.apply_removed(kvrouter.RemovedEvent(worker_id=1, block_hashes=[0x11]))
    assert router.overlap_scores(p)[0].device_blocks == 1
    router.apply_cleared(1)
    assert router.overlap_scores(p) == []
    m = router.metrics()
    assert m.events[kvrouter.EventKind.STORED][kvrouter.EventOutcome.OK] == 1
    assert m.events[kvrouter.EventKind.STORED][kvrouter.EventOutcome.PARENT_BLOCK_NOT_FOUND] == 1
    assert m.events[kvrouter.EventKind.STORED][kvrouter.EventOutcome.INVALID_BLOCK] == 1
    assert len(m.events) == 3 and all(len(row) == 5 for row in m.events)


def test_sliding_window_stores_and_removals(router):
    """A hybrid model's sliding-window group (tests/capi/events_test.c,
    sliding_window_stores_and_removals): worker 1 holds a prompt's four blocks in full attention,
    its window (32 tokens: the two blocks before a hit point) blocks 2 and 3. The prompt plus a
    token is cached whole; its first three blocks and another are not (block 1 is missing before
    block 3), as the engine counts them."""
    p = prompt(1000, 4)
    longer = p + [7]
    shorter = p[:48] + [999] * 16

    def device_blocks(tokens) -> int:  # worker 1's; -1: not listed
        return next((o.device_blocks for o in router.overlap_scores(tokens) if o.worker_id == 1), -1)

    store(router, 1, p, first_hash=100)  # engine hashes 100..103
    assert StoredEvent(worker_id=1, block_hashes=[1]).sliding_window_tokens == 0  # full attention
    assert kvrouter.RemovedEvent(worker_id=1, block_hashes=[1]).sliding_group is None
    window = StoredEvent(worker_id=1, block_hashes=[102, 103], sliding_group=0, sliding_window_tokens=32)
    router.apply_stored(window)
    assert device_blocks(longer) == 4
    assert device_blocks(shorter) == -1
    preview = router.preview_route(longer)
    assert (preview.worker_id, preview.overlap_blocks) == (1, 4)

    # A block full attention does not hold cannot be placed; a sliding store names blocks only.
    with pytest.raises(kvrouter.NotFoundError):
        router.apply_stored(StoredEvent(worker_id=1, block_hashes=[999], sliding_window_tokens=32))
    with pytest.raises(kvrouter.InvalidArgumentError):
        router.apply_stored(StoredEvent(worker_id=1, block_hashes=[102, 103], token_ids=p[32:],
                                        sliding_window_tokens=32))
    with pytest.raises(kvrouter.InvalidArgumentError):
        router.apply_stored(StoredEvent(worker_id=1, block_hashes=[102, 103], tier=kvrouter.Tier.HOST_PINNED,
                                        sliding_window_tokens=32))

    # The window lets block 3 go: no hit left on worker 1; its full-attention blocks stay.
    router.apply_removed(kvrouter.RemovedEvent(worker_id=1, block_hashes=[103], sliding_group=0))
    assert device_blocks(longer) == -1
    m = router.metrics()
    assert (m.index_blocks, m.index_sliding_blocks) == (4, 1)
    assert (m.sliding_events_applied, m.sliding_events_rejected) == (2, 1)

    # The same store through an event batch (FlatBuffers) brings the hit back.
    batch = kvrouter.EventBatch()
    batch.add_stored(StoredEvent(worker_id=1, event_id=5, block_hashes=[103], sliding_window_tokens=32))
    router.apply_event_batch(batch.encode())
    assert device_blocks(longer) == 4
    assert router.metrics().index_sliding_blocks == 2
    # And a removal through one takes it away again.
    batch = kvrouter.EventBatch()
    batch.add_removed(kvrouter.RemovedEvent(worker_id=1, event_id=6, block_hashes=[103], sliding_group=0))
    router.apply_event_batch(batch.encode())
    assert device_blocks(longer) == -1
    assert router.metrics().index_blocks == 4


def test_local_hashes_tiers_and_overlaps(router):
    p = prompt(2000, 3)
    local = kvrouter.compute_block_hashes(p, 16)
    router.apply_stored(StoredEvent(worker_id=2, block_hashes=[1, 2], local_hashes=local[:2]))
    router.apply_stored(StoredEvent(worker_id=2, block_hashes=[3], local_hashes=local[2:], parent_hash=2,
                                    tier=kvrouter.Tier.HOST_PINNED))
    (o,) = router.overlap_scores(p)
    assert (o.worker_id, o.device_blocks, o.host_blocks) == (2, 2, 1)
    assert router.overlap_scores_hashed(local) == [o]
    assert router.overlap_scores_hashed(array.array("Q", local)) == [o]
    with pytest.raises(ValueError, match="local_hashes"):
        router.apply_stored(StoredEvent(worker_id=2, block_hashes=[1, 2], local_hashes=[5]))
    loads = router.potential_loads(p)
    assert sorted(l.worker_id for l in loads) == [1, 2, 3, 4]


def test_find_matches_is_the_walk_of_overlap_scores(router):
    """The same ranks, tiers and tree sizes as overlap_scores_hashed, without the cost figures."""
    p = prompt(2000, 3)
    local = kvrouter.compute_block_hashes(p, 16)
    # Worker 1: two blocks on the device; worker 2: three on host memory; worker 3: two on the
    # device continued by one on disk; worker 4 holds nothing.
    store(router, 1, p[:32], first_hash=0x100)
    store(router, 2, p, first_hash=0x200, tier=kvrouter.Tier.HOST_PINNED)
    store(router, 3, p[:32], first_hash=0x300)
    router.apply_stored(StoredEvent(worker_id=3, block_hashes=[0x302], token_ids=p[32:48], parent_hash=0x301,
                                    tier=kvrouter.Tier.DISK))
    overlaps = {o.worker_id: o for o in router.overlap_scores_hashed(local)}
    matches = router.find_matches(local)
    assert all(isinstance(m, kvrouter.Match) for m in matches)
    assert sorted(m.worker_id for m in matches) == sorted(overlaps) == [1, 2, 3]
    for m in matches:
        o = overlaps[m.worker_id]
        assert m == (o.worker_id, o.dp_rank, o.device_blocks, o.host_blocks, o.disk_blocks, o.external_blocks,
                     o.tree_size)
    by_worker = {m.worker_id: m for m in matches}
    assert by_worker[1] == kvrouter.Match((1, 0, 2, 0, 0, 0, 2))
    assert (by_worker[2].device_blocks, by_worker[2].host_blocks, by_worker[2].tree_size) == (0, 3, 3)
    assert (by_worker[3].device_blocks, by_worker[3].disk_blocks, by_worker[3].tree_size) == (2, 1, 3)
    assert list(kvrouter.Match.__match_args__) == ["worker_id", "dp_rank", "device_blocks", "host_blocks",
                                                   "disk_blocks", "external_blocks", "tree_size"]
    # Integer buffers are read as for overlap_scores_hashed.
    assert sorted(router.find_matches(array.array("Q", local))) == sorted(matches)
    # Nothing matches nothing; bad hashes are refused as for overlap_scores_hashed.
    assert router.find_matches([]) == []
    assert router.find_matches([0xDEAD, 0xBEEF]) == []
    assert router.find_matches(local[1:]) == []
    for bad, exc in [(None, TypeError), ("abc", TypeError), (5, TypeError), ([1, -1], OverflowError),
                     ([1 << 64], OverflowError), ([1.5], TypeError)]:
        with pytest.raises(exc):
            router.find_matches(bad)
        with pytest.raises(exc):
            router.overlap_scores_hashed(bad)
    router.close()
    with pytest.raises(kvrouter.ClosedError):
        router.find_matches(local)


def test_find_matches_grows_its_buffer():
    """40 ranks: more than a thread's first buffer of 16 rows; the count is then remembered."""
    p = prompt(3000, 2)
    local = kvrouter.compute_block_hashes(p, 16)
    with kvrouter.Router(block_size=16) as r:
        for w in range(1, 41):
            r.add_worker(w)
            store(r, w, p[: 16 * (1 + w % 2)], first_hash=w << 8)
        got = []
        # A fresh thread: the extension's per-thread row count starts at 16.
        t = threading.Thread(target=lambda: got.extend([r.find_matches(local), r.find_matches(local)]))
        t.start()
        t.join()
        assert len(got) == 2, "find_matches failed on its thread"
        for matches in got:
            assert sorted(m.worker_id for m in matches) == list(range(1, 41))
            for m in matches:
                assert (m.device_blocks, m.tree_size) == (1 + m.worker_id % 2, 1 + m.worker_id % 2)
        assert sorted(got[0]) == sorted(got[1])


def test_hashing_matches_dynamos_vectors():
    import json
    import os
    from conftest import ROOT

    path = os.path.join(ROOT, "data", "vectors", "dynamo_block_hash_vectors.json")
    if not os.path.exists(path):
        pytest.skip("no data/vectors in this tree")
    with open(path) as f:
        vectors = json.load(f)["vectors"]
    assert vectors
    for v in vectors:
        local = kvrouter.compute_block_hashes(v["tokens"], v["block_size"], lora_name=v.get("lora") or None,
                                              cache_namespace=v.get("ns") or None, mm_hashes=v.get("mm"),
                                              eagle=v.get("eagle", False))
        assert local == [int(x) for x in v["local_hashes"]], v["name"]
        assert kvrouter.compute_sequence_hashes(local) == [int(x) for x in v["sequence_hashes"]], v["name"]
    with pytest.raises(kvrouter.InvalidArgumentError):
        kvrouter.compute_block_hashes([1, 2], 0)


def test_snapshot_restore_and_event_batches(router):
    p = prompt(3000, 4)
    batch = kvrouter.EventBatch()
    batch.add_stored(StoredEvent(worker_id=3, block_hashes=[7, 8, 9, 10], token_ids=p))
    batch.add_removed(kvrouter.RemovedEvent(worker_id=3, block_hashes=[10]))
    batch.add_cleared(4)
    assert len(batch) == 3
    data = batch.encode()
    router.apply_event_batch(data)
    assert router.overlap_scores(p)[0].device_blocks == 3
    with pytest.raises(kvrouter.InvalidArgumentError):
        router.apply_event_batch(b"not flatbuffers")
    snap = router.snapshot()
    with kvrouter.Router(block_size=16) as other:
        other.restore(snap)
        assert other.overlap_scores(p) == router.overlap_scores(p)
        with pytest.raises(kvrouter.FailedPreconditionError):
            other.restore(snap)
    batch.clear()
    assert len(batch) == 0
    batch.close()
    with pytest.raises(kvrouter.ClosedError):
        len(batch)


def test_approximate_mode():
    with kvrouter.Router(block_size=16, approximate=True) as r:
        r.add_worker(1)
        r.add_worker(2)
        p = prompt(1, 4)
        first = r.find_best_match(p, request_id="a")
        r.free_request("a")
        assert r.find_best_match(p).worker_id == first.worker_id
        with pytest.raises(kvrouter.FailedPreconditionError):
            store(r, 1, p)


def test_metrics_prometheus_and_digest(router):
    text = router.metrics_prometheus()
    assert "kvrouter_kv_events_total" in text
    d = router.state_digest()
    router.find_best_match(prompt(1, 2))
    assert router.state_digest() == d
    router.find_best_match(prompt(1, 2), request_id="x")
    assert router.state_digest() != d


def test_refused_for_memory_counters_are_zero_without_a_refusal(router):
    # What the heap refused (kvr_metrics' last fields): 0 on a router never short of memory,
    # also after events, a rejected one and a booking published to a replica bus.
    sent = []
    router.set_replica_publisher("gw-a", sent.append)
    store(router, 1, prompt(5, 2))
    with pytest.raises(kvrouter.KvRouterError):
        router.apply_stored(StoredEvent(worker_id=1, parent_hash=999, block_hashes=[7],
                                        token_ids=prompt(9, 1)))
    router.find_best_match(prompt(5, 2), request_id="booked")
    assert len(sent) > 2  # the announcement, then the booking
    m = router.metrics()
    assert (m.events_refused_for_memory, m.replica_changes_unpublished) == (0, 0)
    assert "events_refused_for_memory" in m.__match_args__
    assert "replica_changes_unpublished" in m.__match_args__
    assert m.decisions_priced_again == 0  # one caller at a time
    # No hybrid model here: no sliding-window group's events, nor blocks.
    assert (m.sliding_events_applied, m.sliding_events_rejected, m.index_sliding_blocks) == (0, 0, 0)
    assert m.__match_args__[-3:] == ("sliding_events_applied", "sliding_events_rejected",
                                     "index_sliding_blocks")
    text = router.metrics_prometheus()
    for line in ("# TYPE kvrouter_events_refused_for_memory_total counter\n",
                 "\nkvrouter_events_refused_for_memory_total 0\n",
                 "# TYPE kvrouter_replica_changes_unpublished_total counter\n",
                 "\nkvrouter_replica_changes_unpublished_total 0\n",
                 "# TYPE kvrouter_decisions_priced_again_total counter\n",
                 "\nkvrouter_decisions_priced_again_total 0\n",
                 "# TYPE kvrouter_sliding_window_events_applied_total counter\n",
                 "\nkvrouter_sliding_window_events_applied_total 0\n",
                 "# TYPE kvrouter_sliding_window_events_rejected_total counter\n",
                 "\nkvrouter_sliding_window_events_rejected_total 0\n",
                 "# TYPE kvrouter_index_sliding_blocks gauge\n",
                 "\nkvrouter_index_sliding_blocks 0\n"):
        assert line in text
    router.set_replica_publisher("gw-a", None)


def test_index_digest_is_the_blocks_alone(router):
    # Replicas compare index digests: two routers holding the same blocks agree, and a
    # booking moves the state digest but not the index digest.
    p = prompt(3, 4)
    store(router, 1, p)
    store(router, 2, p[:32])
    with kvrouter.Router(block_size=16) as other:
        for worker in (4, 3, 2, 1):
            other.add_worker(worker)
        store(other, 2, p[:32])  # the other order
        store(other, 1, p)
        digest = router.index_digest()
        assert other.index_digest() == digest
    state = router.state_digest()
    router.find_best_match(p, request_id="booked")
    assert router.state_digest() != state
    assert router.index_digest() == digest


def test_enums_and_helpers():
    assert kvrouter.tier_from_medium("CPU_PINNED") is kvrouter.Tier.HOST_PINNED
    assert kvrouter.tier_from_medium(None) is kvrouter.Tier.DEVICE
    assert kvrouter.status_str(5) == "KVR_NOT_FOUND"
    e = kvrouter.KvRouterError(77, "x")
    assert e.status == 77 and "status 77" in str(e)
    import pickle
    e2 = pickle.loads(pickle.dumps(kvrouter.NotFoundError(5, "gone")))
    assert isinstance(e2, kvrouter.NotFoundError) and isinstance(e2, LookupError) and e2.message == "gone"


def test_close_is_idempotent_and_context_managers_close():
    with kvrouter.Router() as r:
        pass
    assert r.closed
    r.close()
    with pytest.raises(kvrouter.ClosedError):
        r.find_best_match([1, 2, 3])
    r2 = kvrouter.Router()
    ref = weakref.ref(r2)
    del r2
    gc.collect()
    assert ref() is None


def test_admission_queue_blocks_without_the_gil_and_times_out():
    with kvrouter.Router(block_size=16, queue_threshold=0.0) as r:
        r.add_worker(kvrouter.WorkerConfig(1, max_num_batched_tokens=16))
        p = prompt(1, 4)
        r.find_best_match(p, request_id="busy")  # the only rank is now over the threshold
        results = []

        def waiter():
            results.append(r.find_best_match(p, request_id="waiting"))

        t = threading.Thread(target=waiter)
        t.start()
        wait_for("the request to queue", lambda: r.metrics().queue_pending == 1)
        # The waiting thread holds no GIL: this thread keeps running Python and the router.
        assert r.find_best_match(p).worker_id == 1
        r.mark_prefill_completed("busy")
        t.join(10)
        assert results and results[0].queued == 1
        r.free_request("busy")
        r.free_request("waiting")
        with pytest.raises(kvrouter.DeadlineExceededError):
            r.find_best_match(p, request_id="a")  # admitted at once: empty
            r.find_best_match(p, RequestOptions(queue_timeout=0.05), request_id="b")
        r.free_request("a")


def test_threads_share_one_router(router):
    errors = []

    def worker(n):
        try:
            for i in range(200):
                rid = f"t{n}-{i}"
                router.find_best_match(prompt(i * 16, 4), request_id=rid)
                router.mark_prefill_completed(rid)
                router.free_request(rid)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert router.metrics().requests_active == 0


def test_publishers_set_from_two_threads_leave_the_router_calling_the_one_kept(router):
    # 3,000 rounds: two threads each install a fresh publisher at once. The callable the library
    # calls must be the one the Router object keeps a reference to: the library once got A then
    # B while the Router object stored B then A and released B, which the library went on
    # calling. Every publisher is kept alive here, so that such a mismatch shows in the
    # reference counts rather than as a crash.
    rounds = 3000
    calls = []

    class Publish:
        def __call__(self, change: bytes) -> None:
            calls.append(self)

    start, done = threading.Barrier(3), threading.Barrier(3)

    def install(mine) -> None:
        try:
            for _ in range(rounds):
                start.wait()
                router.set_replica_publisher("gw", mine[-1])
                done.wait()
        except threading.BrokenBarrierError:  # the test failed
            pass

    mine = ([], [])
    threads = [threading.Thread(target=install, args=(m,)) for m in mine]
    for t in threads:
        t.start()
    try:
        for _ in range(rounds):
            for m in mine:
                m.append(Publish())
            start.wait()
            done.wait()
            del calls[:]
            router.replica_heartbeat(1000)  # through the publisher the library has
            assert len(calls) == 1
            called = calls.pop()
            other = mine[1][-1] if called is mine[0][-1] else mine[0][-1]
            assert called in (mine[0][-1], mine[1][-1])
            assert sys.getrefcount(called) == sys.getrefcount(other) + 1  # the router's reference
            kept = called
            del called, other
    except BaseException:
        start.abort()  # the threads too stop waiting
        done.abort()
        raise
    finally:
        for t in threads:
            t.join()
    router.find_best_match(prompt(1, 4), request_id="booked")  # a booking goes to it too
    assert calls and all(c is kept for c in calls)
    router.free_request("booked")
    router.set_replica_publisher("gw", None)


def queueing_router_with_one_busy_rank(p):
    """A router whose only rank is over its queue threshold (0): an admitted call waits."""
    r = kvrouter.Router(block_size=16, queue_threshold=0.0)
    r.add_worker(kvrouter.WorkerConfig(1, max_num_batched_tokens=16))
    busy = r.find_best_match(p, request_id="busy")
    assert busy.booked and not busy.queued
    return r


def test_close_queue_cancels_its_waiters_for_good():
    # A shutdown closes the queue: a call waiting there with no timeout (which nothing else would
    # end) is cancelled, and so is every later one that would wait, at once; previews and
    # requests admitted at once go on.
    p = prompt(1, 4)
    with queueing_router_with_one_busy_rank(p) as r:
        t, out = in_thread(lambda: r.find_best_match(p, request_id="waiting"))
        wait_for("the request to queue", lambda: r.metrics().queue_pending == 1)
        assert r.close_queue() == 1
        cancelled_within(t, out)
        assert r.metrics().queue_pending == 0

        start = time.monotonic()
        with pytest.raises(kvrouter.RequestCancelledError):  # not after its timeout
            r.find_best_match(p, RequestOptions(queue_timeout=30.0), request_id="late")
        assert time.monotonic() - start < 10

        preview = r.find_best_match(p)
        assert preview.worker_id == 1 and not preview.booked
        assert r.preview_route(p).worker_id == 1
        r.free_request("busy")
        fresh = r.find_best_match(p, request_id="fresh")  # admitted at once: room again
        assert fresh.booked and not fresh.queued
        r.free_request("fresh")

        assert r.close_queue() == 0
        assert r.metrics().requests_active == 0


def test_expire_requests_drops_a_lost_request_and_admits_its_waiter():
    # A request whose free was lost ("busy", never freed) holds the only rank, and with a queue
    # threshold every later request waits behind it. expire_requests leaves it alone until it is
    # older than request_expiry_seconds; then it drops it and admits the waiter, with no routing
    # call coming meanwhile to do it.
    p = prompt(3, 4)
    expiry = kvrouter.RouterOptions().request_expiry_seconds  # the default, which the router has
    with queueing_router_with_one_busy_rank(p) as r:
        r.set_time(0)  # the router's time goes on from "busy"'s booking, by hand from now
        t, out = in_thread(lambda: r.find_best_match(p, request_id="waiting"))
        wait_for("the request to queue", lambda: r.metrics().queue_pending == 1)
        assert r.expire_requests() == 0
        r.set_time(int((expiry + 1) * 1e9))
        assert r.expire_requests() == 1
        t.join(10)
        assert not t.is_alive(), "the waiting call was not admitted"
        ((kind, waiter),) = out
        assert kind == "ok" and waiter.booked and waiter.queued, out
        m = r.metrics()
        assert (m.requests_active, m.queue_pending) == (1, 0)  # the waiter's booking alone
        assert r.expire_requests() == 0
        # "busy"'s load is gone: once the waiter is freed the rank admits at once, and the lost
        # request's id books again (no AlreadyExistsError).
        r.free_request("waiting")
        again = r.find_best_match(p, request_id="busy")
        assert again.booked and not again.queued
    with pytest.raises(kvrouter.ClosedError):
        r.expire_requests()


def test_expire_requests_from_a_publisher_is_refused():
    # A replica publisher runs under its router's lock: the library refuses a call into that
    # router from it (FailedPreconditionError), rather than block the thread for good.
    seen = []

    def publish(change: bytes) -> None:
        try:
            seen.append(("ok", r.expire_requests()))
        except kvrouter.KvRouterError as e:
            seen.append(("raised", e))

    with kvrouter.Router(block_size=16) as r:
        r.add_worker(1)
        r.set_replica_publisher("gw-a", publish)
        r.find_best_match(prompt(1, 4), request_id="r1")
        assert seen and all(kind == "raised" and isinstance(e, kvrouter.FailedPreconditionError)
                            for kind, e in seen), seen
        r.set_replica_publisher("gw-a", None)
        assert r.expire_requests() == 0


def test_close_while_another_thread_waits_cancels_it_and_frees_after_it():
    # The waiting call has no timeout: close() closes the queue first, so the call is cancelled
    # (before, it waited for good, and with it the router, freed by the last call in flight).
    p = prompt(1, 4)
    r = queueing_router_with_one_busy_rank(p)
    t, out = in_thread(lambda: r.find_best_match(p, request_id="w"))
    wait_for("the request to queue", lambda: r.metrics().queue_pending == 1)
    closer, closed = in_thread(r.close)
    closer.join(10)
    assert not closer.is_alive() and closed == [("ok", None)]
    assert r.closed
    cancelled_within(t, out)
    with pytest.raises(kvrouter.ClosedError):
        r.metrics()
    with pytest.raises(kvrouter.ClosedError):
        r.close_queue()


def test_leaving_a_with_block_cancels_a_call_waiting_in_the_queue():
    p = prompt(2, 4)
    with queueing_router_with_one_busy_rank(p) as r:
        t, out = in_thread(lambda: r.find_best_match(p, request_id="w"))
        wait_for("the request to queue", lambda: r.metrics().queue_pending == 1)
    assert r.closed
    cancelled_within(t, out)


def test_queue_timeout_rounds_up_to_milliseconds():
    from kvrouter._options import _queue_timeout_ms
    assert _queue_timeout_ms(None) == -1
    assert _queue_timeout_ms(math.inf) == -1
    assert _queue_timeout_ms(0.0004) == 1  # not 0: that gives up at once
    assert _queue_timeout_ms(0.25) == 250
    assert _queue_timeout_ms(2.007) == 2007  # not 2008: 2.007 * 1000 is 2007.0000000000002
    assert all(_queue_timeout_ms(ms / 1000) == ms for ms in range(0, 100000, 7))
    assert _queue_timeout_ms(-1.0) == 0
    assert _queue_timeout_ms(1e300) == (1 << 63) - 1
    assert _queue_timeout_ms(1.7e308) == (1 << 63) - 1
    with pytest.raises(ValueError):
        _queue_timeout_ms(math.nan)


def test_find_best_match_arguments(router):
    p = prompt(1000, 3)
    opts = RequestOptions(allowed_worker_ids=[4])
    assert router.find_best_match(p, opts).worker_id == 4
    assert router.find_best_match(p, options=opts).worker_id == 4
    assert router.find_best_match(p, opts, request_id="kw").booked == 1
    router.free_request("kw")
    with pytest.raises(TypeError, match="RequestOptions"):
        router.find_best_match(p, {"allowed_worker_ids": [4]})
    with pytest.raises(TypeError, match="request_id must be a str"):
        router.find_best_match(p, request_id=5)
    with pytest.raises(TypeError, match="unexpected keyword"):
        router.find_best_match(p, nope=1)
    with pytest.raises(TypeError):
        router.find_best_match()
    with pytest.raises(TypeError):
        router.free_request(5)
    assert isinstance(router, kvrouter.Router) and isinstance(router, kvrouter._native.Router)
    assert "Picks the worker rank" in kvrouter.Router.find_best_match.__doc__
