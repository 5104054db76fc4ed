#!/usr/bin/env python3
"""The choice of the Python binding's FFI: cffi (ABI mode, no compiler) against this package's
CPython extension, per routing call, on one library in one process.

Two routers with the same content (64 workers; 256 prompts of 8,192 tokens stored as chains of
local hashes, half of each prompt on one worker): one through kvrouter, the other created
through cffi and filled with the first one's snapshot (and the same workers). Each iteration times, alternating which goes first, a preview of the same prompt
(a numpy uint32 array) returning (worker_id, cached_tokens, cost) through:
  cffi   the thinnest useful wrapper: ffi.from_buffer on the array, a kvr_request_options kept
         from a sized _init, kvr_find_best_match, the fields read from the result struct;
  ext    kvrouter.Router.find_best_match (the extension; a struct sequence comes back).
Also the 16-token prompt on a one-worker router, where the library's work is smallest.

    python bench_cffi.py [--iterations 20000]

Needs cffi and numpy. Declarations are the header's, restated for cffi's ABI mode (the
struct layouts are checked against kvrouter's generated _abi.STRUCTS first).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from cffi import FFI

import kvrouter
from kvrouter import _abi

CDEF = """
typedef int32_t kvr_status;
typedef struct kvr_router kvr_router;
typedef struct kvr_error kvr_error;
typedef struct kvr_request_options {
  uint32_t struct_size; uint32_t flags; const char *request_id; const char *lora_name;
  const char *cache_namespace; const uint64_t *mm_hashes; const size_t *mm_counts; size_t mm_num_blocks;
  const uint64_t *allowed_worker_ids; size_t num_allowed_worker_ids; double overlap_score_credit;
  double prefill_load_scale; double host_cache_hit_weight; double disk_cache_hit_weight; double temperature;
  int32_t assume_kv_reuse; int32_t track_prefill_tokens; double priority_jump; uint32_t expected_output_tokens;
  uint32_t reserved; int64_t queue_timeout_ms; double overlap_score_credit_decay;
  double decode_active_request_weight;
} kvr_request_options;
typedef struct kvr_route_result {
  uint32_t struct_size; uint32_t dp_rank; uint64_t worker_id; uint32_t prompt_blocks;
  uint32_t device_overlap_blocks; double effective_overlap_blocks; uint64_t cached_tokens;
  uint64_t prompt_tokens; double cost; uint32_t booked; uint32_t queued;
} kvr_route_result;
typedef struct kvr_candidate kvr_candidate;
typedef struct kvr_worker_config { uint32_t struct_size; uint32_t block_size; uint64_t worker_id;
  uint32_t dp_start; uint32_t dp_size; uint64_t total_kv_blocks; uint64_t max_num_batched_tokens; } kvr_worker_config;
kvr_status kvr_worker_config_init(kvr_worker_config *config, size_t size);
kvr_status kvr_router_add_worker(kvr_router *router, const kvr_worker_config *config, kvr_error **err);
kvr_status kvr_router_restore(kvr_router *router, const void *data, size_t size, kvr_error **err);
kvr_status kvr_request_options_init(kvr_request_options *options, size_t size);
kvr_status kvr_route_result_init(kvr_route_result *result, size_t size);
kvr_status kvr_router_new(const void *opts, kvr_router **out, kvr_error **err);
kvr_status kvr_find_best_match(kvr_router *router, const uint32_t *tokens, size_t num_tokens,
                               const kvr_request_options *opts, kvr_route_result *out,
                               kvr_candidate *candidates, size_t cap, size_t *num_candidates, kvr_error **err);
void kvr_router_free(kvr_router *router);
"""


class CffiRouter:
    """Just enough of a router over cffi to route: the hot path as thin as cffi allows."""

    def __init__(self, ffi: FFI, lib, router) -> None:
        self.ffi, self.lib, self.r = ffi, lib, router
        self.opts = ffi.new("kvr_request_options *")
        lib.kvr_request_options_init(self.opts, ffi.sizeof("kvr_request_options"))
        self.size = ffi.sizeof("kvr_route_result")

    def find_best_match(self, tokens: np.ndarray):
        ffi, lib = self.ffi, self.lib
        out = ffi.new("kvr_route_result *")
        lib.kvr_route_result_init(out, self.size)
        buf = ffi.from_buffer("uint32_t[]", tokens)
        st = lib.kvr_find_best_match(self.r, buf, len(tokens), self.opts, out, ffi.NULL, 0, ffi.NULL, ffi.NULL)
        if st != 0:
            raise kvrouter.KvRouterError(st, "")
        return (out.worker_id, out.cached_tokens, out.cost)


def check_layouts(ffi: FFI) -> None:
    for name in ("kvr_request_options", "kvr_route_result", "kvr_worker_config"):
        size, fields = _abi.STRUCTS[name]
        assert ffi.sizeof(name) == size, name
        for f, off, _ in fields:
            assert ffi.offsetof(name, f) == off, (name, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=20000)
    args = p.parse_args()
    ffi = FFI()
    ffi.cdef(CDEF)
    check_layouts(ffi)
    lib = ffi.dlopen(os.path.join(os.path.dirname(kvrouter.__file__), "libkvrouter.so.0.2"))
    print(f"kvrouter {kvrouter.version_string()}, cffi ABI mode, {args.iterations} iterations, "
          f"load average {os.getloadavg()[0]:.1f}")

    results = {}
    for label, workers, prompts, tokens_per in (("8,192 tokens, 64 workers", 64, 256, 8192),
                                                 ("16 tokens, 1 worker", 1, 1, 16)):
        rng = np.random.default_rng(1)
        ext = kvrouter.Router(block_size=16, random_seed=1)
        for w in range(workers):
            ext.add_worker(w)
        queries = [rng.integers(0, 50000, tokens_per, dtype=np.uint32) for _ in range(prompts)]
        for i, q in enumerate(queries):
            local = kvrouter.compute_block_hashes(q, 16)
            half = local[: max(1, len(local) // 2)]
            ev = kvrouter.StoredEvent(worker_id=i % workers, block_hashes=kvrouter.compute_sequence_hashes(half),
                                      local_hashes=half)
            ext.apply_stored(ev)
        cffi_router = build_cffi_router(ffi, lib, ext, workers)
        t = {"cffi": [], "ext": []}
        ns = time.perf_counter_ns
        for i in range(-args.iterations // 10, args.iterations):
            q = queries[i % len(queries)]
            for first in (("cffi", "ext") if i % 2 == 0 else ("ext", "cffi")):
                if first == "cffi":
                    t0 = ns()
                    a = cffi_router.find_best_match(q)
                    t1 = ns()
                else:
                    t0 = ns()
                    b = ext.find_best_match(q)
                    t1 = ns()
                if i >= 0:
                    t[first].append(t1 - t0)
            if i < 0:
                assert a == (b.worker_id, b.cached_tokens, b.cost), (a, b)
        results[label] = {k: statistics.median(v) / 1000 for k, v in t.items()}
        print(f"{label}: cffi p50 {results[label]['cffi']:.2f} us, extension p50 {results[label]['ext']:.2f} us "
              f"(cffi - extension: {results[label]['cffi'] - results[label]['ext']:+.2f} us)")
        lib.kvr_router_free(cffi_router.r)
        ext.close()


def build_cffi_router(ffi: FFI, lib, source: kvrouter.Router, workers: int) -> CffiRouter:
    """A router created and filled through cffi alone: the source's snapshot restored, its
    workers registered (the snapshot holds the index, not the registry)."""
    ptr = ffi.new("kvr_router **")
    assert lib.kvr_router_new(ffi.NULL, ptr, ffi.NULL) == 0
    snap = source.snapshot()
    assert lib.kvr_router_restore(ptr[0], snap, len(snap), ffi.NULL) == 0
    cfg = ffi.new("kvr_worker_config *")
    for w in range(workers):
        lib.kvr_worker_config_init(cfg, ffi.sizeof("kvr_worker_config"))
        cfg.worker_id = w
        assert lib.kvr_router_add_worker(ptr[0], cfg, ffi.NULL) == 0
    return CffiRouter(ffi, lib, ptr[0])


if __name__ == "__main__":
    main()
