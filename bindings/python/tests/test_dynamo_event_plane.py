"""A Dynamo fleet's KV events routed by kvrouter: the ai-dynamo-runtime 1.6.1 wheel's own
KvEventPublisher (a DistributedRuntime with in-memory discovery and the NATS event plane)
publishes to a nats-server on 127.0.0.1, and kvrouter's NATS subscription applies what it says
(docs/ingest.md, "Dynamo's event plane"). Nothing of Dynamo is copied: its publisher runs.

Skipped without the wheel unless KVR_REQUIRE_DYNAMO=1 (scripts/test-python.sh sets it)."""

from __future__ import annotations

import asyncio
import os
from typing import List, Tuple

import pytest

import kvrouter


try:
    from dynamo import llm as dl
    from dynamo._core import DistributedRuntime
except ImportError:  # pragma: no cover - depends on the venv
    if os.environ.get("KVR_REQUIRE_DYNAMO") == "1":
        raise
    pytest.skip("ai-dynamo-runtime (dynamo.llm) is not installed", allow_module_level=True)

BLOCK = 4
WORKER, RANK = 7, 1


def depths(router: kvrouter.Router, tokens: List[int], **options) -> Tuple[int, int]:
    """(device blocks, tree size) of (WORKER, RANK) for `tokens` hashed with `options`."""
    hashes = kvrouter.compute_block_hashes(tokens, BLOCK, **options)
    for m in router.find_matches(hashes):
        if (m.worker_id, m.dp_rank) == (WORKER, RANK):
            return m.device_blocks, m.tree_size
    return 0, 0


async def applied(ingest: kvrouter.Ingest, source: int, events: int) -> None:
    """Waits (without blocking the event loop Dynamo's runtime was given) until `events`."""
    for _ in range(1000):
        if ingest.stats(source).events_applied >= events:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{events} events not applied: {ingest.stats(source)}")


def test_a_dynamo_workers_events_reach_the_index(nats_url, monkeypatch):
    monkeypatch.setenv("NATS_SERVER", nats_url)
    base = list(range(100, 100 + 3 * BLOCK))
    lora = list(range(500, 500 + 2 * BLOCK))
    with kvrouter.Router(block_size=BLOCK) as router, kvrouter.Ingest(router) as ingest:
        ingest.start()
        source = ingest.subscribe_nats(nats_url, "namespace.kvr.>")

        async def publish() -> None:
            runtime = DistributedRuntime(asyncio.get_running_loop(), "mem", "tcp", event_plane="nats")
            publisher = dl.KvEventPublisher(runtime.endpoint("kvr.worker.generate"), worker_id=WORKER,
                                            kv_block_size=BLOCK, dp_rank=RANK)
            try:
                # Engine hashes are the publisher's business; kvrouter keys on the local hashes
                # Dynamo computes from the tokens (its tokens_hash), which must be kvrouter's own.
                publisher.publish_stored(base, [BLOCK] * 3, [11, 12, 13])
                publisher.publish_stored(lora, [BLOCK] * 2, [21, 22], lora_name="adapter-a")
                await applied(ingest, source, 2)
                assert depths(router, base) == (3, 5)
                assert depths(router, lora, lora_name="adapter-a") == (2, 5)
                assert depths(router, lora) == (0, 0)  # the base model's hashes of those tokens
                publisher.publish_removed([13, 22])
                await applied(ingest, source, 3)
                assert depths(router, base) == (2, 3)
                assert depths(router, lora, lora_name="adapter-a") == (1, 3)
            finally:
                publisher.shutdown()
                runtime.shutdown()

        asyncio.run(publish())
        stats = ingest.stats(source)
        assert (stats.gaps, stats.missed_messages) == (0, 0)
        assert not any(stats.rejected)
