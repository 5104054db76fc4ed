"""Closing from inside a replica publisher: the callable runs on the thread that changed a
booking, under the router's lock. Every scenario runs in a child process, so that a deadlock
fails its test only."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Optional

import pytest

_SCENARIO = r"""
import sys, threading
import kvrouter

mode, url = sys.argv[1], sys.argv[2]

r = kvrouter.Router(block_size=16)
r.add_worker(1)
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


if mode in ("router-close", "router-close-queue", "disagg-close"):
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


@pytest.mark.parametrize("mode", ["router-close", "router-close-queue", "disagg-close"])
def test_closing_a_queue_from_a_publisher_is_refused(mode):
    # Router.close(), Router.close_queue() and Disagg.close() close an admission queue, which
    # takes the router's lock the publisher runs under: FailedPreconditionError, the router
    # staying open. (Before, the thread blocked for good, and every call on the router with it.)
    _run(mode)
