#!/usr/bin/env bash
# The main job: build kvrouter (Release) and replay the bundled Mooncake conversation trace (one
# hour of real chat traffic, data/mooncake/) on 8 simulated H100 workers under every routing
# policy at three loads (the trace as recorded, 1.5x and 2x as fast), printing each load's
# comparison table and the load sweep: hit rate, TTFT mean and p99 per policy against load
# (docs/replay.md). Files and the plot go to build/replay/.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${KVR_JOBS:-$(nproc)}
cmake -S . -B build/main -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/main -j "$jobs" --target kvrouter_cli
build/main/tools/replay/kvrouter replay \
  --trace data/mooncake/conversation_trace.jsonl \
  --workers 8 \
  --policies all \
  --time-scale 1,1.5,2 \
  --seed 42 \
  --output-dir build/replay \
  "$@"
