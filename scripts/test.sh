#!/usr/bin/env bash
# Builds kvrouter and runs every test suite: once as a plain optimised build (then the packaging
# test: the Debian packages by dpkg-buildpackage, lintian, installs and consumers; and the
# routing-only library, without transports), once under
# AddressSanitizer + UndefinedBehaviorSanitizer, the concurrency tests once more under
# ThreadSanitizer, and the libFuzzer harnesses of every input surface for a bounded time (clang).
# Each ctest run ends with ctest's own summary line.
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

build() {  # build DIR [cmake args...]
  local dir=$1; shift
  cmake -S . -B "$dir" -G Ninja -DKVR_BUILD_BENCH=OFF "$@" >/dev/null
  cmake --build "$dir" -j "$jobs"
}

stage "generated FFI: the bindings' declarations still match include/kvrouter.h"
python3 -m unittest discover -s tools/ffigen -t tools/ffigen
python3 tools/ffigen/ffigen.py --check

stage "plain build: every test"
build build/test -DCMAKE_BUILD_TYPE=RelWithDebInfo
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
# -O1, as AddressSanitizer's authors advise: the library and tools run the long trace replays
# several times faster than at -O0, with reports as precise (the tests stay -O0: tests/).
build build/asan -DCMAKE_BUILD_TYPE=Debug -DKVR_SANITIZE=address,undefined \
  -DCMAKE_C_FLAGS_DEBUG="-g -O1" -DCMAKE_CXX_FLAGS_DEBUG="-g -O1"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build/asan -j "$jobs" --timeout 900

stage "ThreadSanitizer: concurrency tests"
# Only what the concurrency tests need: the TSan build is the slowest of the three. The ingest
# suite (label concurrency too) runs the loop thread against the callers' and libzmq's threads.
cmake -S . -B build/tsan -G Ninja -DKVR_BUILD_BENCH=OFF -DKVR_BUILD_TOOLS=OFF \
  -DKVR_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVR_SANITIZE=thread >/dev/null
cmake --build build/tsan -j "$jobs" --target core_concurrency_tests capi_concurrency_test \
  router_model_concurrency_test ingest_tests
# libzmq is not instrumented: its internal hand-overs are suppressed (tests/ingest/tsan.supp).
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/ingest/tsan.supp \
  ctest --test-dir build/tsan -L concurrency -j "$jobs" --timeout 900

stage "libFuzzer: every input surface, ${KVR_FUZZ_SECONDS:-20} s each"
# A build of its own: coverage instrumentation makes the libraries need the fuzzer runtime.
CC=clang-14 CXX=clang++-14 cmake -S . -B build/fuzz -G Ninja -DKVR_BUILD_FUZZERS=ON \
  -DKVR_BUILD_BENCH=OFF -DKVR_BUILD_TOOLS=ON -DKVR_BUILD_EXAMPLES=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVR_FUZZ_SECONDS="${KVR_FUZZ_SECONDS:-20}" >/dev/null
cmake --build build/fuzz -j "$jobs" --target kvr_fuzzers
ctest --test-dir build/fuzz -L fuzz -j "$jobs" --timeout 300
