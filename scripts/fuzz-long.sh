#!/usr/bin/env bash
# The libFuzzer harnesses (tests/fuzz) for a long time each, one after another, keeping every
# harness's corpus in build/fuzz-corpus/<harness> from run to run, so that long runs add up.
# Prints one line per harness: executions, coverage (edges and features), corpus size, and what
# it found (crash, leak, timeout or out-of-memory files are left in build/fuzz-findings).
# Figures of the runs so far: docs/testing.md.
#
#   scripts/fuzz-long.sh [SECONDS_EACH] [HARNESS...]     (default: 3600 s, every harness)
#
# KVR_FUZZ_JOBS=N runs N processes per harness (libFuzzer's -fork; default 1: two cores are
# shared by everything here).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-3600}
shift || true
CC=clang-14 CXX=clang++-14 cmake -S . -B build/fuzz -G Ninja -DKVR_BUILD_FUZZERS=ON \
  -DKVR_BUILD_BENCH=OFF -DKVR_BUILD_TOOLS=OFF -DKVR_BUILD_EXAMPLES=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/fuzz -j "${KVR_JOBS:-$(nproc)}" --target kvr_fuzzers >/dev/null

harnesses=("$@")
if [ ${#harnesses[@]} -eq 0 ]; then
  mapfile -t harnesses < <(ls tests/fuzz/seeds)
fi
mkdir -p build/fuzz-findings
printf '%-28s %12s %8s %8s %8s  %s\n' harness executions edges features corpus findings
for name in "${harnesses[@]}"; do
  corpus=build/fuzz-corpus/$name
  log=build/fuzz-findings/$name.log
  mkdir -p "$corpus"
  fork=()
  [ "${KVR_FUZZ_JOBS:-1}" -le 1 ] || fork=(-fork="$KVR_FUZZ_JOBS" -ignore_crashes=1)
  status=0
  "build/fuzz/tests/fuzz/$name" -max_total_time="$seconds" -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="build/fuzz-findings/$name-" "${fork[@]}" "$corpus" "tests/fuzz/seeds/$name" \
    >"$log" 2>&1 || status=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  [ -n "$execs" ] || execs=$(grep -o '^#[0-9]*' "$log" | tail -1 | tr -d '#')
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | awk '{print $2}')
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | awk '{print $2}')
  findings=$(ls build/fuzz-findings | grep -c "^$name-" || true)
  [ "$status" -eq 0 ] || findings="$findings (exit $status: $log)"
  printf '%-28s %12s %8s %8s %8s  %s\n' "$name" "${execs:-?}" "${cov:-?}" "${ft:-?}" \
    "$(ls "$corpus" | wc -l)" "$findings"
done
