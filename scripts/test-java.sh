#!/usr/bin/env bash
# Builds kvrouter and stages it in build/java/stage (or takes the install prefix in
# KVR_STAGE), then builds the Java binding (bindings/java: the JNI glue through CMake, the
# classes and jar through Maven) against it and runs its JUnit tests, every one of them with
# the JVM's JNI checks on (-Xcheck:jni).
# Maven's output goes to bindings/java/target/test-java.log; this prints the test results and
# ends with surefire's own summary line. Needs a JDK (17 or newer), Maven, CMake, pkg-config;
# the NATS tests run when nats-server is installed and are skipped otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

jobs=${KVR_JOBS:-$(nproc)}

source scripts/staged-library.sh
use_staged_library java

echo "== bindings/java: the C side of the binding benchmark still builds =="
# Not run here (BENCHMARKS.md says how); compiled so that it follows the header.
mkdir -p bindings/java/target
cc -std=c11 -O2 -Wall -Wextra -Werror -o bindings/java/target/capi_find_best_match_bench \
  bindings/java/src/test/c/capi_find_best_match_bench.c $(pkg-config --cflags --libs kvrouter) -lm

echo "== bindings/java: JNI glue, jar and tests (mvn verify, -Xcheck:jni) =="
cd bindings/java
mkdir -p target
log=target/test-java.log
status=0
mvn -B -ntp -Dstyle.color=never -Dkvr.jobs="$jobs" \
  -Dkvr.cmake.args="-DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVRJ_WERROR=ON" \
  verify >"$log" 2>&1 || status=$?

# Surefire's line per test class and per failing test, then its summary line last.
grep -E 'Tests run: .* -- in |<<< (FAILURE|ERROR)!' "$log" || true
summary=$(grep -E '^\[(INFO|WARNING|ERROR)\] Tests run: [0-9]+, Failures: [0-9]+, Errors: [0-9]+, Skipped: [0-9]+$' "$log" | tail -n 1 || true)
if [ "$status" -ne 0 ]; then
  echo "mvn failed (exit $status); the last lines of bindings/java/$log:" >&2
  tail -n 60 "$log" >&2
  echo >&2
fi
if [ -z "$summary" ]; then
  echo "no surefire summary in bindings/java/$log" >&2
  exit 1
fi
echo "$summary"
exit "$status"
