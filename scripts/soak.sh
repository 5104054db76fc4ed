#!/usr/bin/env bash
# The soak (tests/soak/soak.cc): the router fed the bundled Mooncake conversation trace in a loop
# with churn for SECONDS (default 1800), resident memory and the index's heap bytes sampled;
# fails if either ends more than the tolerance above its warm-up peak. Builds kvr_soak in
# build/test (the plain build of scripts/test.sh). Figures: docs/testing.md.
#
#   scripts/soak.sh [SECONDS] [more kvr_soak flags, e.g. --tolerance-percent 5]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-1800}
shift || true
cmake -S . -B build/test -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVR_BUILD_BENCH=OFF >/dev/null
cmake --build build/test -j "${KVR_JOBS:-$(nproc)}" --target kvr_soak >/dev/null
build/test/tests/soak/kvr_soak --seconds "$seconds" --sample-seconds "$((seconds >= 600 ? 60 : 5))" "$@"
