#!/usr/bin/env python3
"""What the Python binding adds to a routing decision, on the setup of bench/router_bench.cc.

The Mooncake conversation trace (data/mooncake/conversation_trace.jsonl) is loaded into the
index through the binding: each request's prompt expanded at block size 16 (each hash id is 512
deterministic tokens, as the Java and C++ benchmarks expand it) and stored on one of 64 workers,
round-robin, as only the blocks new to that worker. Queries: the first 1,024 prompts of at least
512 blocks, cut to 8,192 tokens, held as numpy uint32 arrays (read in place).

Each iteration times, interleaved on the same query and the same index (alternating which goes
first, since the first call on a query warms the caches for the second):
  py   router.find_best_match(tokens, request_id=...) through the binding (perf_counter_ns
       around the Python call), then free_request;
  c    the same kvr_find_best_match call timed in C around the library call alone
       (Router._time_find_best_match), then free_request;
and likewise for previews (no request id). The difference of the p50s is the binding's cost per
call: argument conversion, the GIL released and taken back, the result object. Also timed: a
bare call into the extension (kvrouter.version()), free_request, and the same admitted call with
the prompt as a list, an array.array('I') and a numpy array (rotating their order).

    python bench_find_best_match.py [--trace PATH] [--workers 64] [--iterations 20000] [--repetitions 5]

Needs numpy (to expand the trace quickly).
"""

from __future__ import annotations

import argparse
import array
import gc
import json
import os
import statistics
import sys
import time

import numpy as np

import kvrouter

BLOCK = 16
QUERY_TOKENS = 8192
MAX_QUERIES = 1024
TRACE_BLOCK_TOKENS = 512
M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def expand(input_length: int, hash_ids) -> np.ndarray:
    """Each hash id is 512 deterministic tokens (in pairs), truncated to input_length."""
    length = min(input_length, len(hash_ids) * TRACE_BLOCK_TOKENS)
    pairs = (length + 1) // 2
    pos = np.arange(pairs, dtype=np.uint64) * np.uint64(2)
    ids = np.asarray(hash_ids, dtype=np.uint64)[(pos // np.uint64(TRACE_BLOCK_TOKENS)).astype(np.int64)]
    with np.errstate(over="ignore"):
        pair = mix64(ids * np.uint64(TRACE_BLOCK_TOKENS // 2) + (pos % np.uint64(TRACE_BLOCK_TOKENS)) // np.uint64(2))
    out = np.empty(pairs * 2, dtype=np.uint32)
    out[0::2] = (pair & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    out[1::2] = (pair >> np.uint64(32)).astype(np.uint32)
    return out[:length]


def load_trace(router: kvrouter.Router, path: str, workers: int):
    held = [set() for _ in range(workers)]
    queries = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            rec = json.loads(line)
            tokens = expand(rec["input_length"], rec["hash_ids"])
            local = kvrouter.compute_block_hashes(tokens, BLOCK)
            engine = kvrouter.compute_sequence_hashes(local)
            w = i % workers
            mine = held[w]
            first = 0
            while first < len(engine) and engine[first] in mine:
                first += 1
            if first < len(engine):
                router.apply_stored(kvrouter.StoredEvent(
                    worker_id=w, event_id=i, block_hashes=engine[first:], local_hashes=local[first:],
                    parent_hash=engine[first - 1] if first else None))
                mine.update(engine[first:])
            if len(queries) < MAX_QUERIES and len(local) >= QUERY_TOKENS // BLOCK:
                queries.append(np.ascontiguousarray(tokens[:QUERY_TOKENS]))
    return queries


def pct(samples, q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] / 1000.0


def main() -> None:
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=os.path.join(root, "data", "mooncake", "conversation_trace.jsonl"))
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--iterations", type=int, default=20000)
    p.add_argument("--repetitions", type=int, default=5)
    args = p.parse_args()

    print(f"kvrouter {kvrouter.version_string()} ({os.path.dirname(kvrouter.__file__)}), Python "
          f"{sys.version.split()[0]}, numpy {np.__version__}, {args.workers} workers, {args.iterations} iterations x "
          f"{args.repetitions} repetitions, load average {os.getloadavg()[0]:.1f}")
    router = kvrouter.Router(block_size=BLOCK, random_seed=1)
    for w in range(args.workers):
        router.add_worker(kvrouter.WorkerConfig(w, max_num_batched_tokens=16384))
    start = time.perf_counter()
    queries = load_trace(router, args.trace, args.workers)
    m = router.metrics()
    print(f"index: {m.index_blocks:,} blocks, {m.index_nodes:,} nodes, loaded in {time.perf_counter() - start:.1f} s; "
          f"{len(queries)} queries of {QUERY_TOKENS} tokens")
    lists = [q.tolist() for q in queries]
    arrays = [array.array("I", q.tobytes()) for q in queries]
    ids = [f"request-{i}" for i in range(4096)]
    native = router
    find = router.find_best_match
    free = router.free_request
    ns = time.perf_counter_ns
    n = args.iterations
    summary = {k: [] for k in ("py_admit", "c_admit", "py_preview", "c_preview", "free", "bare", "list", "array",
                                "numpy")}
    gc.disable()
    for rep in range(args.repetitions):
        t = {k: [] for k in summary}
        for i in range(-n // 10, n):  # the first tenth warms up
            q = queries[i % len(queries)]
            rid = ids[i % len(ids)]
            # The first call on a query warms the caches for the second: alternate the order.
            for first in ((True, False) if i % 2 == 0 else (False, True)):
                if first:
                    t0 = ns()
                    find(q, request_id=rid)
                    t1 = ns()
                    free(rid)
                    t2 = ns()
                    py_admit, free_ns = t1 - t0, t2 - t1
                else:
                    c_admit = native._time_find_best_match(q, None, rid)
                    free(rid)
            for first in ((True, False) if i % 2 == 0 else (False, True)):
                if first:
                    t3 = ns()
                    find(q)
                    t4 = ns()
                    py_preview = t4 - t3
                else:
                    c_preview = native._time_find_best_match(q, None, None)
            t5 = ns()
            kvrouter.version()
            t6 = ns()
            if i >= 0:
                t["py_admit"].append(py_admit)
                t["free"].append(free_ns)
                t["c_admit"].append(c_admit)
                t["py_preview"].append(py_preview)
                t["c_preview"].append(c_preview)
                t["bare"].append(t6 - t5)
        for i in range(-n // 20, n // 2):  # other input types, half as many; rotating order
            k = i % len(queries)
            rid = ids[i % len(ids)]
            inputs = [("list", lists[k]), ("array", arrays[k]), ("numpy", queries[k])]
            for name, tokens in inputs[i % 3:] + inputs[:i % 3]:
                t0 = ns()
                find(tokens, request_id=rid)
                t1 = ns()
                free(rid)
                if i >= 0:
                    t[name].append(t1 - t0)
        gc.collect()
        for k in summary:
            summary[k].append(pct(t[k], 0.5))
        print(f"rep {rep + 1}: admit py p50 {pct(t['py_admit'], .5):.2f} us (p99 {pct(t['py_admit'], .99):.1f}) | "
              f"C {pct(t['c_admit'], .5):.2f} us (p99 {pct(t['c_admit'], .99):.1f}) | preview py {pct(t['py_preview'], .5):.2f} / "
              f"C {pct(t['c_preview'], .5):.2f} us | free {pct(t['free'], .5):.2f} us | bare call {pct(t['bare'], .5):.3f} us | "
              f"list {pct(t['list'], .5):.2f} / array.array {pct(t['array'], .5):.2f} / numpy {pct(t['numpy'], .5):.2f} us")
    gc.enable()
    med = {k: statistics.median(v) for k, v in summary.items()}
    print(f"median of {args.repetitions} p50s: admitted {med['py_admit']:.2f} us through Python, "
          f"{med['c_admit']:.2f} us in C (added {med['py_admit'] - med['c_admit']:.2f} us); preview "
          f"{med['py_preview']:.2f} / {med['c_preview']:.2f} us (added {med['py_preview'] - med['c_preview']:.2f} us); "
          f"free_request {med['free']:.2f} us; bare extension call {med['bare']:.3f} us; admitted with a list "
          f"{med['list']:.2f} us, an array.array {med['array']:.2f} us, a numpy array {med['numpy']:.2f} us")
    router.close()


if __name__ == "__main__":
    main()
