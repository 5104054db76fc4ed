"""Fixtures shared by the binding's tests: a router, free ports, a nats-server, fake engines."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from typing import Any, Callable, Iterator, List, Optional, Tuple

import pytest

import kvrouter

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def prompt(start: int, blocks: int, block_size: int = 16) -> List[int]:
    """block_size * blocks distinct token ids from `start`."""
    return list(range(start, start + blocks * block_size))


def wait_for(what: str, cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def in_thread(call: Callable[[], Any]) -> Tuple[threading.Thread, List[Tuple[str, Any]]]:
    """Runs `call` on a daemon thread (one that never returns cannot hold up the interpreter's
    exit); the list gets ("ok", its result) or ("raised", its exception)."""
    out: List[Tuple[str, Any]] = []

    def run() -> None:
        try:
            out.append(("ok", call()))
        except BaseException as e:  # noqa: B902 - reported to the test
            out.append(("raised", e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def cancelled_within(t: threading.Thread, out: List[Tuple[str, Any]], timeout: float = 10.0) -> BaseException:
    """The call `in_thread` runs ends within `timeout` raising RequestCancelledError (returned)."""
    t.join(timeout)
    assert not t.is_alive(), "the waiting call was not woken"
    ((kind, value),) = out
    assert kind == "raised" and isinstance(value, kvrouter.RequestCancelledError), out
    assert value.status == kvrouter.Status.CANCELLED
    return value


def ephemeral_ports() -> int:
    """Where the kernel's ephemeral ports start (outgoing connections' local ports)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_next_port: List[int] = []


def free_port() -> int:
    """A free port on 127.0.0.1 below the ephemeral range, as tests/ingest/nats_server.h picks:
    a port the kernel chose for a bind to port 0 may be handed out again at once (the local port
    of a reconnecting ZMQ socket, say), and the server meant for it then fails to bind. Each
    process walks its own stretch, from a start drawn from its pid."""
    top = ephemeral_ports()
    bottom = max(1024, top - 12000)
    if not _next_port:
        _next_port.append(bottom + os.getpid() * 997 % (top - bottom))
    for _ in range(top - bottom):
        port = _next_port[0]
        _next_port[0] = bottom if port + 1 >= top else port + 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


@pytest.fixture
def router() -> Iterator[kvrouter.Router]:
    with kvrouter.Router(block_size=16, random_seed=7) as r:
        for worker in (1, 2, 3, 4):
            r.add_worker(worker)
        yield r


def _nats_server(jetstream: bool, config: Optional[str] = None) -> Iterator[str]:
    """A nats-server on 127.0.0.1, with JetStream (its store in a temporary directory) if
    asked, and `config` (a configuration file's text, written into that directory and passed
    with -c) if given; skips when none is installed."""
    binary = shutil.which("nats-server") or next(
        (p for p in ("/usr/sbin/nats-server", "/usr/bin/nats-server") if os.path.exists(p)), None
    )
    if binary is None:
        pytest.skip("no nats-server installed")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvr-py-js-") as store:
        argv = [binary, "-a", "127.0.0.1", "-p", str(port)] + (["-js", "-sd", store] if jetstream else [])
        if config is not None:
            path = os.path.join(store, "nats.conf")
            with open(path, "w") as f:
                f.write(config)
            argv += ["-c", path]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def accepting() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return True
            except OSError:
                return False

        try:
            wait_for("nats-server", accepting)
            yield f"nats://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(10)


@pytest.fixture
def nats_url() -> Iterator[str]:
    """A nats-server on 127.0.0.1 (skips when none is installed)."""
    yield from _nats_server(False)


@pytest.fixture
def nats_jetstream_url() -> Iterator[str]:
    """A nats-server on 127.0.0.1 with JetStream on (skips when none is installed)."""
    yield from _nats_server(True)


@pytest.fixture
def nats_4k_url() -> Iterator[str]:
    """A nats-server on 127.0.0.1 whose messages are at most 4 KiB (max_payload 4096, the least
    replica sync accepts; the default is 1 MiB); skips when none is installed."""
    yield from _nats_server(False, "max_payload: 4096\n")
