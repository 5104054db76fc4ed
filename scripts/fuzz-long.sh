#!/usr/bin/env bash
# The libFuzzer harnesses (tests/fuzz) for a long time each, keeping every harness's corpus in
# build/fuzz-corpus/<harness> from run to run, so that long runs add up. Each run is recorded as
# a line of tests/fuzz/ledger.tsv (committed with the corpus scripts/fuzz-keep.sh keeps, so that
# the runs of every machine add up), and the line printed per harness gives this run's
# executions, coverage (edges and features), corpus size, what it found (crash, leak, timeout or
# out-of-memory files are left in build/fuzz-findings) and the executions of every run so far.
# Figures of the runs so far: docs/testing.md.
#
#   scripts/fuzz-long.sh [SECONDS_EACH] [HARNESS...]     (default: 3600 s, every harness)
#
# KVR_FUZZ_PARALLEL=N runs N harnesses at a time (default 1: two cores are shared by everything
# here); KVR_FUZZ_JOBS=N runs N processes per harness (libFuzzer's -fork); KVR_FUZZ_RUNS=N
# stops a harness after N executions if its time is not up first; KVR_FUZZ_AIM=N stops it once
# the ledger's runs of it add up to N executions (a harness already there is skipped). A run
# stopped early with SIGINT to its fuzzer process (not to this script) is recorded like a
# finished one; with KVR_FUZZ_JOBS, SIGTERM to the fuzzer parent (it ignores SIGINT, and
# counts the job the stop interrupts as a crash, writing no input).
#
# KVR_FUZZ_SANITIZERS=LIST builds the harnesses with those sanitizers instead of CI's
# address,undefined, in a build directory of their own (build/fuzz-<list>); KVR_FUZZ_ARGS adds
# libFuzzer flags; KVR_FUZZ_TRACE_CMP=0 builds the library without libFuzzer's comparison
# tracing (build directory suffix -no-trace-cmp). All are recorded in the ledger's last column.
# For a harness whose findings are its own model's verdicts, e.g. index_model_fuzzer's volume
# runs (docs/testing.md):
#   KVR_FUZZ_SANITIZERS=undefined KVR_FUZZ_TRACE_CMP=0 KVR_FUZZ_ARGS="-entropic=0 -max_len=256" \
#     scripts/fuzz-long.sh 3600 index_model_fuzzer
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-3600}
shift || true
sanitizers=${KVR_FUZZ_SANITIZERS:-address,undefined}
trace_cmp=${KVR_FUZZ_TRACE_CMP:-1}
build=build/fuzz
[ "$sanitizers" = address,undefined ] || build=build/fuzz-${sanitizers//,/-}
# The run's build and flags, as the ledger records them (empty: CI's).
flags="${KVR_FUZZ_ARGS:-}"
[ "$build" = build/fuzz ] || flags="-fsanitize=$sanitizers${flags:+ $flags}"
trace_cmp_option=ON
if [ "$trace_cmp" = 0 ]; then
  trace_cmp_option=OFF
  build=$build-no-trace-cmp
  flags="-fno-sanitize-coverage=trace-cmp${flags:+ $flags}"
fi
CC=clang-14 CXX=clang++-14 cmake -S . -B "$build" -G Ninja -DKVR_BUILD_FUZZERS=ON \
  -DKVR_BUILD_BENCH=OFF -DKVR_BUILD_TOOLS=ON -DKVR_BUILD_EXAMPLES=OFF \
  -DKVR_FUZZ_SANITIZERS="$sanitizers" -DKVR_FUZZ_TRACE_CMP="$trace_cmp_option" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null

harnesses=("$@")
targets=("$@")
if [ ${#harnesses[@]} -eq 0 ]; then
  mapfile -t harnesses < <(ls tests/fuzz/seeds)
  targets=(kvr_fuzzers)
fi
cmake --build "$build" -j "${KVR_JOBS:-$(nproc)}" --target "${targets[@]}" >/dev/null
mkdir -p build/fuzz-findings build/fuzz-corpus
ledger=tests/fuzz/ledger.tsv
[ -f "$ledger" ] ||
  printf 'finished\tharness\tseconds\texecutions\tedges\tfeatures\tcorpus\tfindings\tcommit\tflags\n' >"$ledger"

# The executions of every run of a harness recorded in the ledger.
ledger_total() { awk -F'\t' -v n="$1" '$2 == n { s += $4 } END { print s + 0 }' "$ledger"; }

# The last figure a libFuzzer log gives for a field ("cov: 123" -> 123).
last_figure() { grep -o "$1: [0-9]*" "$2" | tail -1 | awk '{print $2}'; }

fuzz_one() {
  local name=$1 corpus=build/fuzz-corpus/$1 log=build/fuzz-findings/$1.log
  local fork=() runs=() status=0 commit started=$SECONDS
  commit=$(git rev-parse --short HEAD)  # what the harness was built from (this script builds)
  mkdir -p "$corpus"
  [ -z "${KVR_FUZZ_RUNS:-}" ] || runs=(-runs="$KVR_FUZZ_RUNS")
  if [ -n "${KVR_FUZZ_AIM:-}" ]; then
    local recorded left
    recorded=$(ledger_total "$name")
    left=$((KVR_FUZZ_AIM - recorded))
    if [ "$left" -le 0 ]; then
      echo "$name: $recorded executions recorded, the aim of $KVR_FUZZ_AIM reached"
      return 0
    fi
    # The fewer of KVR_FUZZ_RUNS and what the aim still needs.
    if [ -z "${KVR_FUZZ_RUNS:-}" ] || [ "$left" -lt "$KVR_FUZZ_RUNS" ]; then
      runs=(-runs="$left")
    fi
  fi
  [ "${KVR_FUZZ_JOBS:-1}" -le 1 ] || fork=(-fork="$KVR_FUZZ_JOBS" -ignore_crashes=1)
  local kept=()  # what earlier long runs kept (scripts/fuzz-keep.sh), on any machine
  [ ! -d "tests/fuzz/corpus/$name" ] || kept=("tests/fuzz/corpus/$name")
  local extra=()
  read -r -a extra <<<"${KVR_FUZZ_ARGS:-}"
  "$build/tests/fuzz/$name" -max_total_time="$seconds" -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="build/fuzz-findings/$name-" "${fork[@]}" "${runs[@]}" \
    "${extra[@]}" "$corpus" "tests/fuzz/seeds/$name" "${kept[@]}" >"$log" 2>&1 || status=$?
  local execs cov ft findings size total
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  # In fork mode the parent runs no input itself (its stat is 0): its progress lines count the
  # jobs' executions.
  [ -n "$execs" ] && [ "$execs" != 0 ] || execs=$(grep -o '^#[0-9]*' "$log" | tail -1 | tr -d '#')
  cov=$(last_figure cov "$log")
  ft=$(last_figure ft "$log")
  # Crashes, leaks, timeouts, out-of-memory; not slow-unit-* (inputs over 10 s of wall time,
  # which a starved background run writes too).
  findings=$(ls build/fuzz-findings | grep -Ec "^$name-(crash|leak|timeout|oom)-" || true)
  # 72: libFuzzer's exit when interrupted (SIGINT to the fuzzer): the executions so far count.
  [ "$status" -eq 0 ] || [ "$status" -eq 72 ] || findings="$findings (exit $status: $log)"
  size=$(ls "$corpus" | wc -l)
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$(date -u +%FT%TZ)" "$name" \
    "$((SECONDS - started))" "${execs:-0}" "${cov:-?}" "${ft:-?}" "$size" "$findings" \
    "$commit" "$flags" >>"$ledger"
  total=$(ledger_total "$name")
  printf '%-28s %12s %8s %8s %8s %14s  %s\n' "$name" "${execs:-?}" "${cov:-?}" "${ft:-?}" \
    "$size" "$total" "$findings"
}
export -f fuzz_one last_figure ledger_total
export seconds ledger build flags

printf '%-28s %12s %8s %8s %8s %14s  %s\n' harness executions edges features corpus \
  'all runs' findings
printf '%s\n' "${harnesses[@]}" | xargs -P "${KVR_FUZZ_PARALLEL:-1}" -I{} bash -c 'fuzz_one {}'
