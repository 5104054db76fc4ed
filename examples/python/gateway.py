#!/usr/bin/env python3
"""An asyncio LLM gateway routed by kvrouter: OpenAI-style completions with token-id prompts.

    python gateway.py --port 8000 --block-size 16 \\
        --engine 1=http://127.0.0.1:9001 --engine 2=http://127.0.0.1:9002 \\
        --kv-listen tcp://127.0.0.1:5557                # engines publish KV events here
        [--engine-zmq 1=tcp://10.0.0.5:5557 ...]        # or: vLLM/SGLang ZMQ KV publishers

For each ``POST /v1/completions`` (``{"prompt": [token ids], "max_tokens": N, "stream": bool}``)
the gateway asks the router for the worker that holds the longest cached prefix of the prompt
at the lowest load and books the request there (``find_best_match`` with a request id), sends
it to that engine, and streams the engine's server-sent events through to the client. The
request's first token marks its prefill completed; the end of the stream, an engine failure or
the client disconnecting frees it. Engines' KV events reach the router through an ingest loop
(native stream listener, or ZMQ subscriptions to vLLM/SGLang publishers), so the index follows
what every engine caches. ``GET /metrics`` serves the router's Prometheus metrics and the
gateway's own counters; ``GET /health`` answers ok.

Standard library and kvrouter only. tests/test_gateway_example.py (bindings/python) runs it
against fake engines (fake_engine.py).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import signal
import sys
import time
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import urlsplit

import kvrouter

log = logging.getLogger("gateway")


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           413: "Payload Too Large", 502: "Bad Gateway", 503: "Service Unavailable"}


async def read_request(reader: asyncio.StreamReader) -> Tuple[str, str, Dict[str, str], bytes]:
    """One HTTP/1.1 request: method, path, headers (lower-case names), body."""
    line = await reader.readline()
    if not line:
        raise ConnectionResetError("no request")
    try:
        method, target, _ = line.decode("latin-1").split(" ", 2)
    except ValueError:
        raise HttpError(400, "bad request line") from None
    headers: Dict[str, str] = {}
    while True:
        h = await reader.readline()
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0") or 0)
    if length > 64 << 20:
        raise HttpError(413, "body too large")
    body = await reader.readexactly(length) if length else b""
    return method, target, headers, body


def response_head(status: int, headers: Dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, '')}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class Gateway:
    def __init__(self, args: argparse.Namespace) -> None:
        self.engines: Dict[int, str] = {}
        for spec in args.engine:
            worker, _, url = spec.partition("=")
            self.engines[int(worker)] = url.rstrip("/")
        self.router = kvrouter.Router(block_size=args.block_size, queue_threshold=args.queue_threshold)
        for worker in self.engines:
            self.router.add_worker(worker)
        self.queueing = args.queue_threshold >= 0
        self.ingest = kvrouter.Ingest(self.router)
        self.kv_endpoint: Optional[str] = None
        if args.kv_listen:
            self.kv_endpoint = self.ingest.listen(args.kv_listen).endpoint
        for spec in args.engine_zmq:
            worker, _, endpoint = spec.partition("=")
            self.ingest.add_engine_worker(kvrouter.EngineWorker(endpoint, int(worker), block_size=args.block_size))
        self.ingest.start()
        self.ids = itertools.count(1)
        self.counters = {"requests": 0, "completed": 0, "disconnects": 0, "engine_errors": 0}
        self.first_token_seconds = 0.0

    def close(self) -> None:
        self.ingest.close()
        self.router.close()

    # ---- HTTP

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, target, headers, body = await read_request(reader)
            path = urlsplit(target).path
            if path == "/v1/completions":
                if method != "POST":
                    raise HttpError(405, "POST only")
                await self.completions(reader, writer, body)
            elif path == "/metrics" and method == "GET":
                text = self.router.metrics_prometheus() + self.gateway_metrics()
                await self.send(writer, 200, text.encode(), "text/plain; version=0.0.4")
            elif path == "/health":
                await self.send(writer, 200, b'{"status":"ok"}', "application/json")
            else:
                raise HttpError(404, f"no route {path}")
        except HttpError as e:
            await self.send(writer, e.status, json.dumps({"error": {"message": str(e)}}).encode(), "application/json")
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def send(self, writer: asyncio.StreamWriter, status: int, body: bytes, ctype: str,
                   extra: Optional[Dict[str, str]] = None) -> None:
        head = {"content-type": ctype, "content-length": str(len(body)), "connection": "close", **(extra or {})}
        writer.write(response_head(status, head) + body)
        await writer.drain()

    def gateway_metrics(self) -> str:
        c = self.counters
        return (
            "# HELP kvrouter_gateway_requests_total Completion requests received.\n"
            "# TYPE kvrouter_gateway_requests_total counter\n"
            f"kvrouter_gateway_requests_total {c['requests']}\n"
            "# HELP kvrouter_gateway_completed_total Requests streamed to their end.\n"
            "# TYPE kvrouter_gateway_completed_total counter\n"
            f"kvrouter_gateway_completed_total {c['completed']}\n"
            "# HELP kvrouter_gateway_disconnects_total Requests whose client went away first.\n"
            "# TYPE kvrouter_gateway_disconnects_total counter\n"
            f"kvrouter_gateway_disconnects_total {c['disconnects']}\n"
            "# HELP kvrouter_gateway_engine_errors_total Requests an engine failed.\n"
            "# TYPE kvrouter_gateway_engine_errors_total counter\n"
            f"kvrouter_gateway_engine_errors_total {c['engine_errors']}\n"
            "# HELP kvrouter_gateway_first_token_seconds_total Time to first token, summed.\n"
            "# TYPE kvrouter_gateway_first_token_seconds_total counter\n"
            f"kvrouter_gateway_first_token_seconds_total {self.first_token_seconds:.6f}\n"
        )

    # ---- completions

    async def completions(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
        try:
            req = json.loads(body)
            prompt = req["prompt"]
            if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
                raise ValueError("prompt must be a list of token ids")
        except (ValueError, KeyError, TypeError) as e:
            raise HttpError(400, f"bad completion request: {e}") from None
        self.counters["requests"] += 1
        request_id = f"gw-{next(self.ids)}"
        started = time.monotonic()
        try:
            if self.queueing:  # an admitted call may wait in the admission queue: off the loop
                decision = await asyncio.to_thread(self.router.find_best_match, prompt, request_id=request_id)
            else:  # a decision takes microseconds (and releases the GIL)
                decision = self.router.find_best_match(prompt, request_id=request_id)
        except kvrouter.KvRouterError as e:
            raise HttpError(503, f"no worker: {e}") from None
        worker = decision.worker_id
        log.info("%s: %d tokens -> worker %d (%d cached)", request_id, len(prompt), worker, decision.cached_tokens)
        routing = {"x-kvrouter-worker": str(worker), "x-kvrouter-cached-tokens": str(decision.cached_tokens),
                   "x-request-id": request_id}
        stream = bool(req.get("stream", False))
        proxy = asyncio.create_task(self.proxy(req, worker, request_id, writer, stream, routing, started))
        gone = asyncio.create_task(reader.read(1))  # the client sends nothing more: EOF = it left
        try:
            done, _ = await asyncio.wait({proxy, gone}, return_when=asyncio.FIRST_COMPLETED)
            if proxy not in done:
                proxy.cancel()
                self.counters["disconnects"] += 1
                log.info("%s: client disconnected, request freed", request_id)
                try:
                    await proxy
                except (asyncio.CancelledError, ConnectionError):
                    pass
            else:
                try:
                    proxy.result()
                except ConnectionError:
                    self.counters["disconnects"] += 1
        finally:
            gone.cancel()
            self.router.free_request(request_id)  # ended, failed or abandoned: no longer load

    async def proxy(self, req: Dict[str, Any], worker: int, request_id: str, writer: asyncio.StreamWriter, stream: bool,
                    routing: Dict[str, str], started: float) -> None:
        url = urlsplit(self.engines[worker])
        try:
            er, ew = await asyncio.open_connection(url.hostname, url.port or 80)
        except OSError as e:
            self.counters["engine_errors"] += 1
            raise HttpError(502, f"engine {worker} unreachable: {e}") from None
        try:
            payload = json.dumps(dict(req, stream=True)).encode()
            ew.write(
                f"POST /v1/completions HTTP/1.1\r\nhost: {url.netloc}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(payload)}\r\nx-request-id: {request_id}\r\nconnection: close\r\n\r\n".encode()
                + payload
            )
            await ew.drain()
            status_line = await er.readline()
            if b" 200 " not in status_line:
                self.counters["engine_errors"] += 1
                raise HttpError(502, f"engine {worker}: {status_line.decode(errors='replace').strip()}")
            while (await er.readline()) not in (b"\r\n", b"\n", b""):
                pass
            if stream:
                writer.write(response_head(200, {"content-type": "text/event-stream", "cache-control": "no-cache",
                                                 "connection": "close", **routing}))
                await writer.drain()
            first = True
            text: List[str] = []
            finish = None
            while True:
                line = await er.readline()
                if not line:
                    break
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if first:
                    first = False
                    self.router.mark_prefill_completed(request_id)  # the first token is out
                    self.first_token_seconds += time.monotonic() - started
                if data == b"[DONE]":
                    if stream:
                        writer.write(b"data: [DONE]\n\n")
                        await writer.drain()
                    break
                if stream:
                    writer.write(b"data: " + data + b"\n\n")
                    await writer.drain()  # raises when the client is gone
                else:
                    chunk = json.loads(data)
                    text.append(chunk["choices"][0].get("text", ""))
                    finish = chunk["choices"][0].get("finish_reason") or finish
            if not stream:
                body = json.dumps({"id": request_id, "object": "text_completion", "model": req.get("model", ""),
                                   "choices": [{"index": 0, "text": "".join(text), "finish_reason": finish}]})
                await self.send(writer, 200, body.encode(), "application/json", routing)
            self.counters["completed"] += 1
        finally:
            ew.close()


async def serve(args: argparse.Namespace) -> None:
    gateway = Gateway(args)
    server = await asyncio.start_server(gateway.handle, args.host, args.port)
    port = server.sockets[0].getsockname()[1]
    # One line for whoever started us (the tests read it): where we listen.
    print(json.dumps({"listening": f"http://{args.host}:{port}", "kv_endpoint": gateway.kv_endpoint}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()
    gateway.close()


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--engine", action="append", default=[], metavar="ID=URL", help="an engine and its worker id")
    p.add_argument("--kv-listen", default=None, metavar="ENDPOINT",
                   help="native KV event stream listener (tcp://HOST:PORT or unix://PATH)")
    p.add_argument("--engine-zmq", action="append", default=[], metavar="ID=ENDPOINT",
                   help="a vLLM/SGLang ZMQ KV event publisher of worker ID")
    p.add_argument("--queue-threshold", type=float, default=-1.0,
                   help="admission queue threshold (negative: never queue)")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if not args.engine:
        p.error("at least one --engine ID=URL")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
