#!/usr/bin/env bash
# Builds the kvrouter CLI (Release) if needed and runs `kvrouter replay` with the given flags,
# e.g. scripts/replay.sh --trace data/azure_llm_2023/AzureLLMInferenceTrace_conv.csv \
#        --azure-shared-prefix-groups 20 --workers 4
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build/main -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/main -j "${KVR_JOBS:-$(nproc)}" --target kvrouter_cli >/dev/null
exec build/main/tools/replay/kvrouter replay "$@"
