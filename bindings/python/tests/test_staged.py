"""Preview, plan, commit and abort; pins; sessions; disaggregated prefill and decode."""

from __future__ import annotations

import pytest

import kvrouter
from conftest import cancelled_within, in_thread, prompt, wait_for
from kvrouter import RequestOptions, RoutingHints


def test_preview_changes_nothing_then_plan_commit_free(router):
    p = prompt(1, 4)
    digest = router.state_digest()
    preview = router.preview_route(p)
    assert preview.booked == 0 and router.state_digest() == digest
    plan = router.plan_route(p, previewed=preview, request_id="r1")
    assert plan.booked == 1 and plan.moved == 0 and plan.worker_id == preview.worker_id
    assert router.plan_route(p, request_id="r1") == plan  # idempotent
    router.commit_route("r1")
    router.free_request("r1")
    with pytest.raises(kvrouter.NotFoundError):
        router.commit_route("r1")


def test_abort_and_deadline(router):
    p = prompt(1, 4)
    router.plan_route(p, request_id="r2")
    assert router.abort_route("r2") is True
    assert router.abort_route("r2") is False
    router.set_plan_deadline(0.01)
    router.plan_route(p, request_id="r3")
    import time
    time.sleep(0.05)
    assert router.expire_plans() == 1
    with pytest.raises(kvrouter.InvalidArgumentError):
        router.set_plan_deadline(0)


def test_pins(router):
    p = prompt(1, 4)
    assert router.preview_route(p, hints=RoutingHints(worker_id=3)).worker_id == 3
    with pytest.raises(kvrouter.NotFoundError):
        router.preview_route(p, hints=RoutingHints(worker_id=42))
    with pytest.raises(kvrouter.InvalidArgumentError):
        router.preview_route(p, RequestOptions(allowed_worker_ids=[1]), RoutingHints(worker_id=3))


def test_sessions(router):
    p = prompt(1, 4)
    hints = RoutingHints(session_id="s1")
    first = router.plan_route(p, hints=hints, request_id="a")
    router.commit_route("a")
    assert router.session_binding("s1") == (first.worker_id, first.dp_rank)
    for i in range(3):  # hard affinity: the session's requests follow the binding despite load
        assert router.plan_route(p, hints=hints, request_id=f"b{i}").worker_id == first.worker_id
        router.commit_route(f"b{i}")
    router.close_session("s1")
    assert router.session_binding("s1") is None
    assert router.reclaim_sessions() == 0


def test_disaggregated_prefill_and_decode():
    with kvrouter.Disagg(kvrouter.RouterOptions(block_size=16), kvrouter.RouterOptions(block_size=16)) as d:
        p = prompt(1, 8)
        res = d.route_prefill(p, request_id="r")
        assert res.remote == 0 and res.reason is kvrouter.PrefillReason.NO_PREFILL_WORKERS
        d.prefill_router.add_worker(10)
        d.decode_router.add_worker(20)
        res = d.route_prefill(p, request_id="r")
        assert (res.remote, res.worker_id, res.reason) == (1, 10, kvrouter.PrefillReason.REMOTE)
        assert res.bootstrap_room >= 0
        dec = d.route_decode(p, remote_prefill=True, request_id="r")
        assert dec.worker_id == 20 and dec.booked == 1
        assert d.prefill_worker_busy(p, 0.0) in (True, False)
        d.prefill_router.free_request("r")
        d.decode_router.free_request("r")
        with pytest.raises(TypeError):
            d.prefill_router.close()
    assert d.closed and d.prefill_router.closed
    with pytest.raises(kvrouter.ClosedError):
        d.prefill_router.metrics()


def test_closing_a_disagg_cancels_calls_waiting_in_either_pools_queue():
    # Disagg.close() closes both pools' queues first: a route_prefill waiting in the prefill
    # pool's and an admitted call waiting in the decode pool's (through its pool router), neither
    # with a timeout, are cancelled.
    queueing = kvrouter.RouterOptions(block_size=16, queue_threshold=0.0)
    d = kvrouter.Disagg(queueing, queueing)
    d.prefill_router.add_worker(kvrouter.WorkerConfig(10, max_num_batched_tokens=16))
    d.decode_router.add_worker(kvrouter.WorkerConfig(20, max_num_batched_tokens=16))
    p = prompt(3, 4)
    assert d.route_prefill(p, request_id="p-busy").remote  # each pool's only rank over threshold
    assert d.route_decode(p, remote_prefill=False, request_id="d-busy").booked
    prefill = in_thread(lambda: d.route_prefill(p, request_id="p-w"))
    decode = in_thread(lambda: d.decode_router.find_best_match(p, request_id="d-w"))
    wait_for("both to queue", lambda: d.prefill_router.metrics().queue_pending == 1
             and d.decode_router.metrics().queue_pending == 1)
    closer, closed = in_thread(d.close)
    closer.join(10)
    assert not closer.is_alive() and closed == [("ok", None)]
    cancelled_within(*prefill)
    cancelled_within(*decode)
    assert d.closed and d.prefill_router.closed and d.decode_router.closed
