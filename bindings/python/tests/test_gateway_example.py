"""examples/python/gateway.py against two fake engines (examples/python/fake_engine.py), all on
127.0.0.1: routing by cached prefix learned from the engines' KV events, streaming, prefill
marked and requests freed, a client disconnecting mid-stream, /metrics."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from typing import Dict, List, Tuple

import pytest

from conftest import ROOT, free_port, prompt, wait_for

EXAMPLES = os.path.join(ROOT, "examples", "python")


class StartFailed(AssertionError):
    pass


def start(args: List[str]) -> Tuple[subprocess.Popen, Dict]:
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait(5)
        raise StartFailed(f"{args[0]} did not start: {proc.stderr.read()}")
    return proc, json.loads(line)


def get(url: str, path: str) -> Tuple[int, Dict[str, str], bytes]:
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", path)
    r = conn.getresponse()
    return r.status, dict(r.getheaders()), r.read()


def complete(url: str, tokens: List[int], max_tokens: int = 4, stream: bool = False) -> Tuple[Dict[str, str], bytes]:
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/v1/completions", json.dumps({"model": "m", "prompt": tokens, "max_tokens": max_tokens,
                                                        "stream": stream}), {"content-type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    return dict(r.getheaders()), r.read()


def metric(url: str, name: str) -> float:
    _, _, body = get(url, "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name}")


def start_fleet(procs: List[subprocess.Popen]) -> Tuple[str, List[str]]:
    kv_port = free_port()
    # The gateway first (it owns the KV listener), pointed at the engines' ports.
    ports = [free_port(), free_port()]
    gw, info = start([os.path.join(EXAMPLES, "gateway.py"), "--port", "0", "--kv-listen",
                      f"tcp://127.0.0.1:{kv_port}", "--engine", f"1=http://127.0.0.1:{ports[0]}",
                      "--engine", f"2=http://127.0.0.1:{ports[1]}"])
    procs.append(gw)
    engines = []
    for worker, port in zip((1, 2), ports):
        proc, einfo = start([os.path.join(EXAMPLES, "fake_engine.py"), "--port", str(port), "--worker-id",
                             str(worker), "--kv-endpoint", info["kv_endpoint"], "--token-delay", "0.01"])
        procs.append(proc)
        engines.append(einfo["listening"])
    return info["listening"], engines


def stop(procs: List[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
    procs.clear()


@pytest.fixture
def fleet():
    # The engines' ports are picked before the gateway that must know them starts, so another
    # process can take one in between ("address already in use"): start again on fresh ports.
    procs: List[subprocess.Popen] = []
    try:
        for attempt in range(3):
            try:
                yield start_fleet(procs)
                return
            except StartFailed as e:
                stop(procs)
                if "in use" not in str(e) or attempt == 2:
                    raise
    finally:
        stop(procs)


def test_routes_by_cached_prefix_and_streams(fleet):
    gateway, engines = fleet
    assert get(gateway, "/health")[0] == 200
    shared = prompt(10_000, 8)  # 128 tokens: 8 blocks
    headers, body = complete(gateway, shared + [1, 2, 3], max_tokens=5)
    first = int(headers["x-kvrouter-worker"])
    result = json.loads(body)
    assert result["choices"][0]["text"] == " t0 t1 t2 t3 t4"
    # The engine published the 8 blocks it cached; once applied, a prompt sharing the prefix
    # goes to the same engine and finds them cached.
    wait_for("the engine's KV events", lambda: metric(gateway, "kvrouter_index_blocks") >= 8)
    for i in range(3):
        headers, body = complete(gateway, shared + [7, 7, i], max_tokens=3, stream=True)
        assert int(headers["x-kvrouter-worker"]) == first
        assert int(headers["x-kvrouter-cached-tokens"]) == 128
        events = [l for l in body.decode().split("\n\n") if l.startswith("data: ")]
        assert len(events) == 4 and events[-1] == "data: [DONE]"
    # A different prompt goes to the other (idle, equally uncached) engine.
    headers, _ = complete(gateway, prompt(50_000, 8), max_tokens=1)
    assert int(headers["x-kvrouter-worker"]) != first
    assert metric(gateway, "kvrouter_requests_active") == 0
    assert metric(gateway, "kvrouter_gateway_completed_total") == 5


def test_a_client_disconnecting_frees_its_request(fleet):
    gateway, engines = fleet
    host, port = gateway.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)))
    body = json.dumps({"prompt": prompt(1, 4), "max_tokens": 1000, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    received = b""
    while b"data: " not in received:
        received += s.recv(4096)
    assert metric(gateway, "kvrouter_requests_active") == 1
    s.close()  # mid-stream
    wait_for("the request freed", lambda: metric(gateway, "kvrouter_requests_active") == 0)
    assert metric(gateway, "kvrouter_gateway_disconnects_total") == 1
    # The gateway dropped its engine connection too: the engine stops generating.
    def cancelled() -> bool:
        return sum(json.loads(get(e, "/stats")[2])["cancelled"] for e in engines) == 1
    wait_for("the engine to notice", cancelled)


def test_bad_requests(fleet):
    gateway, _ = fleet
    host, port = gateway.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/v1/completions", b'{"prompt": "text, not tokens"}')
    r = conn.getresponse()
    assert r.status == 400 and b"token ids" in r.read()
    assert get(gateway, "/nope")[0] == 404
