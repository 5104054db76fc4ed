#!/usr/bin/env python3
"""A fake LLM engine for the gateway example and its test: an OpenAI-style completions server
that "generates" one token every --token-delay seconds and, like a real engine with prefix
caching, publishes KV events for the blocks it caches.

    python fake_engine.py --port 9001 --worker-id 1 --kv-endpoint tcp://127.0.0.1:5557

Before its first token it caches the prompt's complete blocks and publishes a stored event for
the blocks it did not hold yet (engine hashes: the chained sequence hashes; parent: the last
block it held), through kvrouter's native stream publisher. With --capacity it evicts the
least recently used blocks (deepest first) and publishes removed events. It counts the
requests a client abandoned (the gateway closing the connection) under GET /stats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections import OrderedDict
from typing import Dict, List, Optional

import kvrouter


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.worker_id = args.worker_id
        self.block_size = args.block_size
        self.delay = args.token_delay
        self.capacity = args.capacity
        self.publisher = kvrouter.Publisher(args.kv_endpoint) if args.kv_endpoint else None
        self.cache: "OrderedDict[int, None]" = OrderedDict()  # engine hash -> (LRU order)
        self.parents: Dict[int, Optional[int]] = {}
        self.stats = {"requests": 0, "completed": 0, "cancelled": 0, "stored_blocks": 0, "removed_blocks": 0}
        self.lock = asyncio.Lock()

    async def cache_prompt(self, prompt: List[int]) -> None:
        local = kvrouter.compute_block_hashes(prompt, self.block_size)
        engine = kvrouter.compute_sequence_hashes(local)
        held = 0
        while held < len(engine) and engine[held] in self.cache:
            self.cache.move_to_end(engine[held])
            held += 1
        new = list(range(held, len(engine)))
        if not new or self.publisher is None:
            return
        batch = kvrouter.EventBatch()
        batch.add_stored(kvrouter.StoredEvent(
            worker_id=self.worker_id, block_hashes=[engine[i] for i in new],
            token_ids=prompt[held * self.block_size:len(engine) * self.block_size],
            parent_hash=engine[held - 1] if held else None))
        for i in new:
            self.cache[engine[i]] = None
            self.parents[engine[i]] = engine[i - 1] if i else None
        self.stats["stored_blocks"] += len(new)
        if self.capacity and len(self.cache) > self.capacity:
            evict: List[int] = []
            for h in list(self.cache):  # least recently used first, leaves only
                if len(self.cache) - len(evict) <= self.capacity:
                    break
                if not any(p == h and c not in evict for c, p in self.parents.items() if c in self.cache):
                    evict.append(h)
            for h in evict:
                del self.cache[h]
                self.parents.pop(h, None)
            if evict:
                batch.add_removed(kvrouter.RemovedEvent(worker_id=self.worker_id, block_hashes=evict))
                self.stats["removed_blocks"] += len(evict)
        async with self.lock:  # one send at a time on the connection
            await asyncio.to_thread(self.publisher.send, batch)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            method, path, _ = line.decode().split(" ", 2)
            length = 0
            while True:
                h = await reader.readline()
                if h in (b"\r\n", b"\n", b""):
                    break
                name, _, value = h.decode().partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            body = await reader.readexactly(length) if length else b""
            if path == "/stats":
                data = json.dumps(self.stats).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(data)).encode() + b"\r\nconnection: close\r\n\r\n" + data)
                await writer.drain()
                return
            req = json.loads(body)
            self.stats["requests"] += 1
            await self.cache_prompt(req["prompt"])
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
            n = int(req.get("max_tokens", 16))
            try:
                for i in range(n):
                    await asyncio.sleep(self.delay)
                    chunk = {"id": "cmpl", "object": "text_completion", "created": int(time.time()),
                             "model": f"fake-{self.worker_id}",
                             "choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}]}
                    writer.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    await writer.drain()
                writer.write(b"data: [DONE]\n\n")
                await writer.drain()
                self.stats["completed"] += 1
            except ConnectionError:
                self.stats["cancelled"] += 1
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()


async def serve(args: argparse.Namespace) -> None:
    engine = Engine(args)
    server = await asyncio.start_server(engine.handle, "127.0.0.1", args.port)
    print(json.dumps({"listening": f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"}), flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()
    if engine.publisher:
        engine.publisher.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--worker-id", type=int, required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-endpoint", default=None, help="the gateway's KV event listener")
    p.add_argument("--token-delay", type=float, default=0.005)
    p.add_argument("--capacity", type=int, default=0, help="blocks cached before evicting (0: no limit)")
    asyncio.run(serve(p.parse_args()))


if __name__ == "__main__":
    main()
