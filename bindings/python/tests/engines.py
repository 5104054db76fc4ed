"""The engines' own KV event publishers, loaded without torch, and a lossy link to put between
a publisher and kvrouter's ingest.

- SGLang: the `sglang` wheel installed with --no-deps (scripts/test-python.sh). Its package
  inits import torch, so the packages on the way are empty stand-ins whose __path__ is the
  installed directory, and the few modules the publisher and the event recorder import but do
  not use here are stubs. sglang/srt/disaggregation/kv_events.py (ZmqEventPublisher, the event
  classes) and sglang/srt/mem_cache/events.py (KVCacheEventRecorder, which turns radix tree
  nodes into events) are SGLang's own files.
- vLLM: vllm/distributed/kv_events.py alone, extracted from the vllm wheel by
  scripts/test-python.sh (KVR_VLLM_KV_EVENTS is its path). Its imports of the rest of vLLM are
  stubs.

Nothing of either engine is copied here: a stub only names what the engine file imports."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import struct
import sys
import threading
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Set

from contextlib import contextmanager

SGLANG_VERSION = "0.5.23"
VLLM_VERSION = "0.33.0"


def _unused(name: str) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{name} is stubbed in the engine publisher tests")

    return fail


@contextmanager
def _modules(stubs: Dict[str, types.ModuleType]) -> Iterator[None]:
    """Installs stand-in modules for the import, then takes the engine's modules (stand-ins and
    loaded files alike) out of sys.modules again; the loaded modules keep their references."""
    import msgspec  # noqa: F401  (imported here first, so that they stay imported)
    import zmq  # noqa: F401

    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] in ("sglang", "vllm")]:
            del sys.modules[name]


def _package(name: str, path: Optional[str]) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [path] if path else []  # type: ignore[attr-defined]
    return module


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def load_sglang() -> types.SimpleNamespace:
    """SGLang's kv_events and mem_cache.events modules; ImportError if the wheel is missing or
    not the pinned version."""
    version = importlib.metadata.version("sglang")
    if version != SGLANG_VERSION:
        raise ImportError(f"sglang {version} is installed, the tests pin {SGLANG_VERSION}")
    dist = importlib.metadata.distribution("sglang")
    root = str(dist.locate_file("sglang"))
    stubs: Dict[str, types.ModuleType] = {}
    for pkg in ("", "srt", "srt/disaggregation", "srt/mem_cache", "srt/utils"):
        name = "sglang" + ("." + pkg.replace("/", ".") if pkg else "")
        stubs[name] = _package(name, os.path.join(root, pkg) if pkg else root)
    # Imported by kv_events.py for what a scheduler does with the publisher (which ranks
    # publish, parsing advertised addresses): not used by ZmqEventPublisher itself.
    stubs["sglang.srt.runtime_context"] = _module("sglang.srt.runtime_context",
                                                  get_parallel=_unused("get_parallel"))
    stubs["sglang.srt.utils.network"] = _module("sglang.srt.utils.network",
                                                NetworkAddress=_unused("NetworkAddress"))
    # Imported by mem_cache/events.py to compute a node's page digests. The fake nodes carry
    # theirs (hash_value; event_hash_value for a namespaced node, which is what SGLang's
    # compute_node_event_hash_values returns once a node has them), so nothing is computed;
    # hash_str_to_int64 turns a hex digest into the published signed int64 (first 16 hex
    # digits). The hashes are opaque to kvrouter, which hashes the tokens itself.
    def hash_str_to_int64(hash_str: str) -> int:
        value = int(hash_str[:16], 16)
        return value - (1 << 64) if value >= 1 << 63 else value

    stubs["sglang.srt.mem_cache.utils"] = _module(
        "sglang.srt.mem_cache.utils",
        compute_node_hash_values=_unused("compute_node_hash_values"),
        compute_node_event_hash_values=lambda node, page_size: node.event_hash_value,
        hash_str_to_int64=hash_str_to_int64)
    with _modules(stubs):
        kv_events = importlib.import_module("sglang.srt.disaggregation.kv_events")
        events = importlib.import_module("sglang.srt.mem_cache.events")
    return types.SimpleNamespace(kv_events=kv_events, events=events, version=version)


def load_vllm(path: str) -> types.ModuleType:
    """vLLM's vllm/distributed/kv_events.py from `path`."""

    @dataclasses.dataclass
    class KVEventsConfig:  # the publisher reports its configuration in one
        enable_kv_cache_events: bool = False
        publisher: Optional[str] = None
        endpoint: str = ""
        replay_endpoint: Optional[str] = None
        buffer_steps: int = 0
        hwm: int = 0
        max_queue_size: int = 0
        topic: str = ""

    stubs = {
        "vllm": _package("vllm", None),
        "vllm.config": _package("vllm.config", None),
        "vllm.config.kv_events": _module("vllm.config.kv_events", KVEventsConfig=KVEventsConfig),
        "vllm.logger": _module("vllm.logger", init_logger=logging.getLogger),
        # Used only to bind tcp://*:0 to the node's address.
        "vllm.utils": _package("vllm.utils", None),
        "vllm.utils.network_utils": _module(
            "vllm.utils.network_utils", get_ip=_unused("get_ip"), get_tcp_uri=_unused("get_tcp_uri"),
            is_valid_ipv6_address=_unused("is_valid_ipv6_address"),
            split_zmq_path=_unused("split_zmq_path")),
        "vllm.v1": _package("vllm.v1", None),
        "vllm.v1.core": _package("vllm.v1.core", None),
        # The type of the hashes in events (vllm/v1/core/kv_cache_utils.py: bytes | int).
        "vllm.v1.core.kv_cache_utils": _module("vllm.v1.core.kv_cache_utils",
                                               ExternalBlockHash=bytes | int),
        "vllm.distributed": _package("vllm.distributed", os.path.dirname(path)),
    }
    with _modules(stubs):
        spec = importlib.util.spec_from_file_location("vllm.distributed.kv_events", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


class Link(threading.Thread):
    """A ZMQ forwarder between an engine's PUB socket and kvrouter's SUB socket: SUB connected
    to the engine, PUB bound on 127.0.0.1, every message passed on unless told to drop it (a
    lossy network). Counts what it forwarded."""

    def __init__(self, zmq: Any, engine_endpoint: str, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.zmq = zmq
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RECONNECT_IVL, 20)
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sub.connect(engine_endpoint)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(endpoint)
        self.drop: Set[int] = set()  # sequence numbers to drop
        self.forwarded: List[int] = []
        self.dropped: List[int] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.start()

    def run(self) -> None:
        poller = self.zmq.Poller()
        poller.register(self.sub, self.zmq.POLLIN)
        while not self.stopping.is_set():
            if not poller.poll(20):
                continue
            frames = self.sub.recv_multipart()
            seq = struct.unpack(">Q", frames[1])[0] if len(frames) == 3 and len(frames[1]) == 8 else -1
            with self.lock:
                if seq in self.drop:
                    self.drop.discard(seq)
                    self.dropped.append(seq)
                    continue
                self.forwarded.append(seq)
            self.pub.send_multipart(frames)

    def handshakes(self, timeout: float) -> int:
        """Connections (re)established to the engine's PUB socket within `timeout` s."""
        n = 0
        while self.monitor.poll(int(timeout * 1000)):
            self.monitor.recv_multipart()
            n += 1
            timeout = 0.05
        return n

    def close(self) -> None:
        self.stopping.set()
        self.join(5)
        self.sub.disable_monitor()
        self.monitor.close(0)
        self.sub.close(0)
        self.pub.close(0)
        self.ctx.term()
