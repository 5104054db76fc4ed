#!/usr/bin/env bash
# The main job. Until the trace replay (`kvrouter replay`) lands, this builds what exists and
# runs it for real: the core test suite, then the core benchmarks (hashing, index ingestion,
# find_matches on the Mooncake conversation trace, memory per cached block).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${KVR_JOBS:-$(nproc)}
cmake -S . -B build/main -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/main -j "$jobs"
ctest --test-dir build/main -L core -j "$jobs"
for bench in build/main/bench/*_bench; do
  [ -x "$bench" ] || continue
  echo "== $(basename "$bench") =="
  "$bench" --benchmark_min_time=0.2
done
