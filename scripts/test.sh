#!/usr/bin/env bash
# Builds kvrouter and runs every test suite: once as a plain optimised build (then the packaging
# test: the Debian packages by dpkg-buildpackage, lintian, installs and consumers; and the
# routing-only library, without transports), once under
# AddressSanitizer + UndefinedBehaviorSanitizer, the concurrency tests once more under
# ThreadSanitizer, and the libFuzzer harnesses of every input surface for a bounded time (clang).
# Each ctest run ends with ctest's own summary line. The sanitizer and fuzzer builds run in the
# background while the plain build's tests, packaging, bindings and peers run (see below).
set -euo pipefail
cd "$(dirname "$0")/.."

jobs=${KVR_JOBS:-$(nproc)}
export CTEST_OUTPUT_ON_FAILURE=1

# stage TITLE: a section's heading, with the time since the start (what CI's time goes to).
began=$SECONDS
stage() {
  local spent=$((SECONDS - began))
  echo "== $* == (at $((spent / 60)) min $((spent % 60)) s)"
}

# Line tables only (-g1, clang's -gline-tables-only): all that the tests' and sanitizers' stack
# traces use, and every object compiles about 20 % faster than with full debug information (-g)
# (radix_index.cc: 12.1 -> 9.4 s plain, 23.8 -> 17.9 s under ASan). The packages' builds
# (debian/rules) keep dpkg's -g: abidiff reads their DWARF.
optimised=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG"
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG")

build() {  # build DIR [cmake args...]
  local dir=$1; shift
  cmake -S . -B "$dir" -G Ninja -DKVR_BUILD_BENCH=OFF "$@" >/dev/null
  cmake --build "$dir" -j "$jobs"
}

# The sanitizer and fuzzer builds need nothing from the stages between the plain build and their
# own tests (packaging, bindings, peers), and those stages leave a core idle most of the time
# (the bindings' tests used 0.4-1 of the two): the three builds run in the background meanwhile,
# one after another, niced so that the stages in front keep their timing. Each build's output
# goes to build/<dir>.log, shown when its tests start (await_build).
configure_sanitizer_and_fuzz_builds() {
  # -O1 for ASan, as AddressSanitizer's authors advise: the library and tools run the long
  # trace replays several times faster than at -O0, with reports as precise (the tests stay
  # -O0: tests/).
  cmake -S . -B build/asan -G Ninja -DKVR_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=Debug \
    -DKVR_SANITIZE=address,undefined -DCMAKE_C_FLAGS_DEBUG="-g1 -O1" \
    -DCMAKE_CXX_FLAGS_DEBUG="-g1 -O1" >/dev/null
  # Only what the concurrency tests need: the TSan build is the slowest of the three.
  cmake -S . -B build/tsan -G Ninja -DKVR_BUILD_BENCH=OFF -DKVR_BUILD_TOOLS=OFF \
    -DKVR_BUILD_EXAMPLES=OFF "${optimised[@]}" -DKVR_SANITIZE=thread >/dev/null
  # A build of its own: coverage instrumentation makes the libraries need the fuzzer runtime.
  CC=clang-14 CXX=clang++-14 cmake -S . -B build/fuzz -G Ninja -DKVR_BUILD_FUZZERS=ON \
    -DKVR_BUILD_BENCH=OFF -DKVR_BUILD_TOOLS=ON -DKVR_BUILD_EXAMPLES=OFF \
    "${optimised[@]}" -DKVR_FUZZ_SECONDS="${KVR_FUZZ_SECONDS:-10}" >/dev/null
}
background_build() {  # background_build DIR [cmake --build args...]: records its exit status
  local dir=$1 status=0
  shift
  nice -n 10 cmake --build "build/$dir" -j "$jobs" "$@" >"build/$dir.log" 2>&1 || status=$?
  echo "$status" >"build/$dir.status"
  return "$status"
}
background_builds() {  # stops at a failed build: its stage reports it
  background_build asan &&
    background_build tsan --target core_concurrency_tests capi_concurrency_test \
      router_model_concurrency_test ingest_tests kvrouterd_concurrency_tests &&
    background_build fuzz --target kvr_fuzzers
}
await_build() {  # await_build DIR: waits for the background build of DIR, shows its end
  local dir=$1
  while [ ! -f "build/$dir.status" ]; do
    kill -0 "$background" 2>/dev/null || { echo "the background builds stopped early" >&2; exit 1; }
    sleep 2
  done
  tail -n 3 "build/$dir.log"
  [ "$(cat "build/$dir.status")" -eq 0 ] || { cat "build/$dir.log"; exit 1; }
}

stage "generated FFI: the bindings' declarations still match include/kvrouter.h"
python3 -m unittest discover -s tools/ffigen -t tools/ffigen
python3 tools/ffigen/ffigen.py --check

stage "plain build: every test"
build build/test "${optimised[@]}"
rm -f build/asan.status build/tsan.status build/fuzz.status
configure_sanitizer_and_fuzz_builds
set -m  # the background builds in a process group of their own, stopped if this script stops
background_builds &
background=$!
set +m
trap 'kill -- -"$background" 2>/dev/null || true' EXIT
ctest --test-dir build/test -j "$jobs" --timeout 600

stage "packaging: Debian packages (dpkg-buildpackage, lintian), installs, pkg-config and CMake consumers (shared and static)"
# As root (CI's throwaway machine) the packages are really installed with apt-get from the local
# apt repository, then purged.
KVR_PACKAGE_INSTALL="${KVR_PACKAGE_INSTALL:-$([ "$(id -u)" = 0 ] && echo 1 || echo 0)}" \
  scripts/test-packaging.sh

stage "routing-only library: no transport, no libuv/libzmq/libnats; KVR_UNIMPLEMENTED"
scripts/test-routing-only.sh

stage "bindings: against the library of the plain build, staged in build/stage"
rm -rf build/stage
cmake --install build/test --prefix build/stage >/dev/null
KVR_STAGE=$PWD/build/stage scripts/test-go.sh
stage "the endpoint picker (service/epp)"
scripts/test-epp.sh
stage "bindings: Rust"
KVR_STAGE=$PWD/build/stage scripts/test-rust.sh
stage "bindings: Java"
KVR_STAGE=$PWD/build/stage scripts/test-java.sh
stage "bindings: Python"
KVR_STAGE=$PWD/build/stage scripts/test-python.sh

stage "peers: differential check against Dynamo's indexers"
KVR_STAGE=$PWD/build/stage scripts/bench-peers.sh --check

stage "AddressSanitizer + UndefinedBehaviorSanitizer: every test"
await_build asan
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build/asan -j "$jobs" --timeout 900

stage "ThreadSanitizer: concurrency tests"
# The ingest suite (label concurrency too) runs the loop thread against the callers' and
# libzmq's threads.
await_build tsan
# libzmq is not instrumented: its internal hand-overs are suppressed (tests/ingest/tsan.supp).
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/ingest/tsan.supp \
  ctest --test-dir build/tsan -L concurrency -j "$jobs" --timeout 900

stage "libFuzzer: every input surface, ${KVR_FUZZ_SECONDS:-10} s each"
await_build fuzz
wait "$background"
ctest --test-dir build/fuzz -L fuzz -j "$jobs" --timeout 300
