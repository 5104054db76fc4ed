"""Closing from inside a replica publisher: the callable runs on the thread that changed a
booking, under the router's lock, and that thread may be an Ingest's own loop thread (its
heartbeats, once Router.set_replica_publisher replaced the sync's publisher). Every scenario runs
in a child process, so that an abort (kvr_ingest_free joining the thread it runs on) or a
deadlock fails its test only."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Optional

import pytest

_SCENARIO = r"""
import gc, sys, threading, time, weakref
import kvrouter

mode, url = sys.argv[1], sys.argv[2]


def eventually(what, cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for " + what)
        time.sleep(0.005)


def refused(call):
    try:
        call()
    except kvrouter.FailedPreconditionError:
        return True
    return False


def router_closes(r):
    # Refused while the ingest still feeds it; the deferred free ends that.
    def attempt():
        try:
            r.close()
            return True
        except kvrouter.FailedPreconditionError:
            return False
    eventually("Router.close() to succeed once the ingest is freed", attempt)
    assert r.closed


# The names of the threads started (the extension looks threading.Thread up at each use).
started = []


class _NamedThread(threading.Thread):
    def start(self):
        started.append(self.name)
        super().start()


threading.Thread = _NamedThread


def started_one(name):
    assert name in started, (name, started)


r = kvrouter.Router(block_size=16)
r.add_worker(1)
holder = []
done = threading.Event()
armed = [False]
seen = {}


def on_publish(inside):
    def publish(change):
        if armed[0]:
            armed[0] = False
            seen["thread"] = threading.current_thread().name
            try:
                inside()
            except BaseException as e:
                seen["raised"] = e
            done.set()
    return publish


if mode.startswith("loop-"):
    # The publisher set_replica_publisher put in place of the sync's runs on the ingest's loop
    # thread: its heartbeats, every 10 ms.
    ingest = kvrouter.Ingest(r, kvrouter.IngestOptions(replica_heartbeat_ms=10))
    ingest.start()
    ingest.sync_replicas(url, "kv.replicas", "gw-a")
    holder.append(ingest)
    ref = weakref.ref(ingest)
    del ingest
    if mode == "loop-close":
        inside = lambda: holder[0].close()
    elif mode == "loop-drop":  # the last reference goes there: the object's dealloc
        inside = holder.clear
    elif mode == "loop-collect":  # the object is garbage in a cycle, collected there
        cycle = [holder.pop()]
        cycle.append(cycle)
        holder.append(cycle)
        del cycle

        def inside():
            holder.clear()
            gc.collect()
    elif mode == "loop-local":
        # The last reference moves into a threading.local of the loop thread, whose Python
        # thread state is the trampoline's temporary one: the object's dealloc runs when
        # PyGILState_Release clears it, still in the publisher.
        local = threading.local()

        def inside():
            local.ingest = holder.pop()
    elif mode == "loop-stop":
        inside = lambda: holder[0].stop()
    elif mode == "loop-last-call":
        # Calls until this thread closes the ingest: the close comes while a call is in flight
        # (it releases the GIL), whose end in the publisher is then the free.
        calling = threading.Event()

        def inside():
            ingest = holder[0]
            calling.set()
            try:
                while True:
                    ingest.stats()
            except kvrouter.ClosedError:
                pass
    else:
        raise SystemExit("unknown mode " + mode)
    r.set_replica_publisher("gw-a", on_publish(inside))
    armed[0] = True  # from now on only the loop calls the publisher: its heartbeats
    if mode == "loop-last-call":
        assert calling.wait(60), "no heartbeat reached the publisher in a minute"
        holder.pop().close()
    assert done.wait(60), "no heartbeat reached the publisher in a minute"
    assert seen["thread"] != threading.main_thread().name, seen
    assert "raised" not in seen, seen
    if mode == "loop-stop":
        started_one("kvr-ingest-stop")
        ingest = holder[0]
        # Stopped soon after: the calls that add a source are then refused.
        eventually("the ingest to stop", lambda: refused(lambda: ingest.listen("tcp://127.0.0.1:0")))
        ingest.close()
    elif mode == "loop-close":
        started_one("kvr-ingest-close")
        ingest = holder[0]
        assert ingest.closed
        ingest.close()  # a no-op
        try:
            ingest.stats()
            raise AssertionError("stats() on an ingest closed from its publisher")
        except kvrouter.ClosedError:
            pass
    router_closes(r)
    if mode in ("loop-drop", "loop-collect", "loop-last-call", "loop-local"):
        assert ref() is None
elif mode == "routing-close":
    # A publisher a routing call runs (on this thread) closes an ingest feeding the router.
    ingest = kvrouter.Ingest(r)
    ingest.start()
    r.set_replica_publisher("gw-a", on_publish(ingest.close))
    armed[0] = True
    r.find_best_match(list(range(64)), request_id="r1")
    assert done.is_set() and "raised" not in seen, seen
    started_one("kvr-ingest-close")
    assert ingest.closed
    ingest.close()
    router_closes(r)
elif mode == "routing-stop":
    ingest = kvrouter.Ingest(r)
    ingest.start()
    r.set_replica_publisher("gw-a", on_publish(ingest.stop))
    armed[0] = True
    r.find_best_match(list(range(64)), request_id="r1")
    assert done.is_set() and "raised" not in seen, seen
    started_one("kvr-ingest-stop")
    eventually("the ingest to stop", lambda: refused(lambda: ingest.listen("tcp://127.0.0.1:0")))
    ingest.close()
    router_closes(r)
elif mode in ("router-close", "router-close-queue", "disagg-close"):
    # These close an admission queue, under the lock the publisher runs under: refused.
    d = kvrouter.Disagg() if mode == "disagg-close" else None
    target = d.decode_router if d else r
    if d:
        target.add_worker(1)
    call = {"router-close": r.close, "router-close-queue": r.close_queue, "disagg-close": d and d.close}[mode]
    target.set_replica_publisher("gw-a", on_publish(call))
    armed[0] = True
    if d:
        d.route_decode(list(range(64)), remote_prefill=False, request_id="r1")
    else:
        r.find_best_match(list(range(64)), request_id="r1")
    assert done.is_set(), seen
    assert isinstance(seen.get("raised"), kvrouter.FailedPreconditionError), seen
    assert not target.closed
    call()  # after the publisher it goes through
    assert target.closed == (mode != "router-close-queue")
    r.close()
elif mode == "set-publisher-announcement":
    # The publisher clears itself on its first message: the announcement's Reset, which runs
    # inside set_replica_publisher, on this thread.
    first = [True]

    def clearing(change):
        if first[0]:
            first[0] = False
            try:
                r.set_replica_publisher("gw-a", None)
            except BaseException as e:
                seen["raised"] = e
            done.set()
        seen["calls"] = seen.get("calls", 0) + 1

    r.set_replica_publisher("gw-a", clearing)
    assert done.is_set(), seen
    assert isinstance(seen.get("raised"), kvrouter.FailedPreconditionError), seen
    calls = seen["calls"]
    r.find_best_match(list(range(64)), request_id="r1")  # still its publisher
    assert seen["calls"] > calls, seen
    r.set_replica_publisher("gw-a", None)  # after the publisher it goes through
    calls = seen["calls"]  # the farewell counted
    r.find_best_match(list(range(64, 128)), request_id="r2")
    assert seen["calls"] == calls, seen
    r.close()
elif mode == "set-publisher-routing":
    # From a publisher a routing call runs (the library refused this one already).
    r.set_replica_publisher("gw-a", on_publish(lambda: r.set_replica_publisher("gw-b", None)))
    armed[0] = True
    r.find_best_match(list(range(64)), request_id="r1")
    assert done.is_set(), seen
    assert isinstance(seen.get("raised"), kvrouter.FailedPreconditionError), seen
    r.close()
elif mode == "set-publisher-cross":
    # Another thread's set_replica_publisher takes the binding's publish lock, then waits in C
    # for the router's lock, which this thread's routing call holds while it runs the
    # publisher; the publisher's own set_replica_publisher must not wait for that publish lock.
    other = {}

    def elsewhere():
        try:
            r.set_replica_publisher("gw-b", None)
            other["returned"] = True
        except BaseException as e:
            other["raised"] = e

    t = threading.Thread(target=elsewhere, daemon=True)

    def inside():
        t.start()
        time.sleep(0.5)  # t now holds the publish lock, waiting in C for the router's lock
        r.set_replica_publisher("gw-c", None)

    r.set_replica_publisher("gw-a", on_publish(inside))
    armed[0] = True
    r.find_best_match(list(range(64)), request_id="r1")
    assert done.is_set(), seen
    assert isinstance(seen.get("raised"), kvrouter.FailedPreconditionError), seen
    t.join(60)
    assert not t.is_alive() and other == {"returned": True}, other
    r.close()
elif mode == "pool-dropped-in-its-publisher":
    # The last reference to a Disagg pool's Router object goes inside that pool's publisher: its
    # finalizer would stop the C router's publisher, which the library refuses there. The
    # publisher is disarmed instead, and kept (C still calls it) until the Disagg goes.
    d = kvrouter.Disagg()
    d.decode_router.add_worker(1)
    calls = [0]

    def dropping(change):
        calls[0] += 1
        if armed[0]:
            armed[0] = False
            d._decode = None  # the only reference to the pool's Router object
            done.set()

    d.decode_router.set_replica_publisher("gw-a", dropping)
    armed[0] = True
    d.route_decode(list(range(64)), remote_prefill=False, request_id="r1")
    assert done.is_set(), seen
    gc.collect()
    n = calls[0]
    # Booking again publishes through the disarmed publisher: nothing reaches the callable.
    d.route_decode(list(range(64, 128)), remote_prefill=False, request_id="r2")
    d.route_decode(list(range(128, 192)), remote_prefill=False, request_id="r3")
    assert calls[0] == n, (calls, n)
    d.close()
    del d
    gc.collect()
    r.close()
else:
    raise SystemExit("unknown mode " + mode)
print("ok")
"""


def _run(mode: str, url: str = "") -> None:
    try:
        child = subprocess.run([sys.executable, "-c", _SCENARIO, mode, url],
                               capture_output=True, text=True, timeout=100)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{mode}: the child still runs after 100 s (a deadlock)\n{e.stdout!r}\n{e.stderr!r}")
    signame: Optional[str] = None
    if child.returncode < 0:
        signame = signal.Signals(-child.returncode).name
    assert child.returncode == 0 and child.stdout == "ok\n", (
        f"{mode}: exit status {child.returncode} ({signame})\n{child.stdout}{child.stderr}")


@pytest.mark.parametrize("mode", ["loop-close", "loop-drop", "loop-collect", "loop-last-call", "loop-stop",
                                  "loop-local"])
def test_an_ingest_closed_from_a_publisher_on_its_own_loop_thread(nats_url, mode):
    # close(), the last reference dropped (the object's dealloc), a collection of the object in
    # a cycle, the last call in flight after a close() elsewhere, or stop(), in a publisher that
    # the ingest's own heartbeats call, on its loop thread: the object is closed (or stopping)
    # at once, and a new thread stops and frees it once the publisher has returned; the router
    # then closes. (Before, all but stop() freed it there: kvr_ingest_free joined its own
    # thread, and the process aborted, SIGABRT.) loop-local: the last reference kept in a
    # threading.local of the loop thread, dropped when the trampoline's PyGILState_Release
    # clears that thread's temporary thread state (before, after the thread's "in a publisher"
    # mark had been taken down: SIGABRT).
    _run(mode, nats_url)


@pytest.mark.parametrize("mode", ["routing-close", "routing-stop"])
def test_an_ingest_closed_from_a_publisher_a_routing_call_runs(mode):
    # There the publisher holds the router's lock, which the loop that a stop joins may need:
    # close() and stop() return at once, and the ingest is stopped and freed soon after.
    _run(mode)


@pytest.mark.parametrize("mode", ["router-close", "router-close-queue", "disagg-close"])
def test_closing_a_queue_from_a_publisher_is_refused(mode):
    # Router.close(), Router.close_queue() and Disagg.close() close an admission queue, which
    # takes the router's lock the publisher runs under: FailedPreconditionError, the router
    # staying open. (Before, the thread blocked for good, and every call on the router with it.)
    _run(mode)


@pytest.mark.parametrize("mode", ["set-publisher-announcement", "set-publisher-routing", "set-publisher-cross"])
def test_setting_a_publisher_from_a_publisher_is_refused(mode):
    # Router.set_replica_publisher takes the binding's publish lock, then the router's lock in
    # C: from a publisher it raises FailedPreconditionError before taking either, as the
    # library refuses a call into its own router there. (Before: a publisher clearing itself
    # during its announcement waited for the publish lock its own thread held, and one whose
    # router another thread was setting a publisher on waited for that thread's publish lock
    # while that thread waited for the router's lock: both deadlocked. From a routing call's
    # publisher the library refused it already.)
    _run(mode)


def test_a_pool_router_dropped_in_its_own_publisher():
    # A Disagg pool's Router object whose last reference goes inside that pool's publisher:
    # its finalizer's kvr_router_set_replica_publisher(NULL) is not made there (the library
    # refuses it, under the router's lock); the publisher is disarmed, C calling it with no
    # effect until the Disagg frees the pool. (Before: the refusal was ignored and the
    # publisher's memory freed, so the next booking published through freed memory: SIGSEGV.)
    _run("pool-dropped-in-its-publisher")
