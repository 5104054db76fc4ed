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

# KVR_STAGE: an install prefix of libkvrouter to test against (as scripts/test.sh passes to
# the other bindings); otherwise the library is built and staged here.
stage=${KVR_STAGE:-}
if [[ -z $stage ]]; then
  echo "== kvrouter: build, stage in build/java/stage =="
  cmake -S . -B build/java -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVR_BUILD_TESTS=OFF \
    -DKVR_BUILD_BENCH=OFF -DKVR_BUILD_TOOLS=OFF -DKVR_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build build/java -j "$jobs" --target kvrouter
  stage=$PWD/build/java/stage
  cmake --install build/java --prefix "$stage" >/dev/null
fi

pcdir=$(find "$stage" -name kvrouter.pc -path '*/pkgconfig/*' -printf '%h\n' | head -n 1)
if [[ -z $pcdir ]]; then
  echo "test-java.sh: no kvrouter.pc under $stage" >&2
  exit 1
fi
export PKG_CONFIG_PATH=$pcdir${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
export LD_LIBRARY_PATH=$(dirname "$pcdir")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

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
