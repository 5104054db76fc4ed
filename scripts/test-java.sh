#!/usr/bin/env bash
# Builds kvrouter and stages it in build/java/stage (or takes the install prefix in
# KVR_STAGE), then builds the Java binding (bindings/java: the JNI glue through CMake, the
# classes and jar through Maven) against it and runs its JUnit tests, every one of them with
# the JVM's JNI checks on (-Xcheck:jni). Then it checks the jar's native (linked with
# libkvrouter.a: no run path, JNI symbols only, no shared library but those the binding's README
# names) and runs a consumer from the jar alone (bindings/java/src/it/consumer), with no
# LD_LIBRARY_PATH, and the gateway example (examples/java) against fake engines. The jar carries
# the glue's shared dependencies too (its index, linux/x86_64/libkvrouter_jni.libs): checked for
# completeness, load order and run paths, and the consumer checks that the process maps them from
# the jar, not from the system, then runs again with the system's copies hidden (a private mount
# namespace, when unshare can make one).
# The jar is multi-release: on JDK 22+ the hot calls go through java.lang.foreign
# (META-INF/versions/22/io/kvrouter/HotPath): Maven compiles those sources with the javac of the
# JDK in KVR_FFM_JDK (default: Temurin 25 under /usr/lib/jvm), and its failsafe runs their tests
# (HotPathFfmIT: the FFM path against JNI on the same routers) on that JDK's java, against the
# jar; the consumer runs on it too and must load the FFM class.
# Maven's output goes to bindings/java/target/test-java.log; this prints the test results and
# ends with surefire's and failsafe's summary lines. Needs a JDK (17 or newer) for Maven, a JDK
# 22+ (KVR_FFM_JDK), Maven, CMake, pkg-config; the NATS tests run when nats-server is installed
# and are skipped otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

jobs=${KVR_JOBS:-$(nproc)}
ffm_jdk=${KVR_FFM_JDK:-/usr/lib/jvm/temurin-25-jdk-amd64}
ffm_feature=$("$ffm_jdk/bin/java" -XshowSettings:properties -version 2>&1 |
  sed -n 's/^ *java\.specification\.version = //p' || true)
ffm_args=(-Dkvr.ffm.jdk="$ffm_jdk")
if [[ -z $ffm_feature || $ffm_feature -lt 22 ]]; then
  if [[ -n ${KVR_FFM_JDK:-} ]]; then
    echo "KVR_FFM_JDK=$ffm_jdk: not a JDK 22 or newer (the jar's FFM path needs one to build and test)" >&2
    exit 1
  fi
  # Debian 12 packages no JDK 22+: without one (this machine kind has Temurin 25), the jar is
  # built and tested without its FFM path, which the JNI classes stand in for on every JDK.
  echo "note: no JDK 22 or newer at $ffm_jdk: the jar is built without its FFM path (META-INF/versions/22), whose tests are skipped"
  ffm_feature=
  ffm_args=(-Dkvr.ffm.skip=true)
fi

source scripts/staged-library.sh
use_staged_library java

echo "== bindings/java: the C side of the binding benchmark still builds =="
# Not run here (BENCHMARKS.md says how); compiled so that it follows the header.
mkdir -p bindings/java/target
cc -std=c11 -O2 -Wall -Wextra -Werror -o bindings/java/target/capi_find_best_match_bench \
  bindings/java/src/test/c/capi_find_best_match_bench.c $(pkg-config --cflags --libs kvrouter) -lm

echo "== bindings/java: JNI glue, jar and tests (mvn verify, -Xcheck:jni${ffm_feature:+, the FFM path on JDK $ffm_feature}) =="
cd bindings/java
mkdir -p target
log=target/test-java.log
status=0
mvn -B -ntp -Dstyle.color=never -Dkvr.jobs="$jobs" "${ffm_args[@]}" \
  -Dkvr.cmake.args="-DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVRJ_WERROR=ON" \
  verify >"$log" 2>&1 || status=$?

# Surefire's and failsafe's line per test class and per failing test, then their summary lines
# last (printed after the checks below, which run only when the build passed): surefire's (the
# JDK Maven runs on, the JNI classes), then failsafe's (KVR_FFM_JDK, the jar's FFM path).
grep -E 'Tests run: .* -- in |<<< (FAILURE|ERROR)!' "$log" || true
summaries=$(grep -E '^\[(INFO|WARNING|ERROR)\] Tests run: [0-9]+, Failures: [0-9]+, Errors: [0-9]+, Skipped: [0-9]+$' "$log" || true)
summary=$(head -n 1 <<<"$summaries")
if [[ $(wc -l <<<"$summaries") -ge 2 ]]; then
  summary="$summary (surefire, $(java -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java\.vm\.version = //p'))"$'\n'"$(tail -n 1 <<<"$summaries") (failsafe: the FFM path, $("$ffm_jdk/bin/java" -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java\.vm\.version = //p'))"
fi
if [ "$status" -ne 0 ]; then
  echo "mvn failed (exit $status); the last lines of bindings/java/$log:" >&2
  tail -n 60 "$log" >&2
  echo >&2
fi
if [ -z "$summary" ]; then
  echo "no surefire summary in bindings/java/$log" >&2
  exit 1
fi
if [ "$status" -ne 0 ]; then
  echo "$summary"
  exit "$status"
fi

echo "== bindings/java: the jar's native (linux/x86_64/libkvrouter_jni.so) =="
# Linked with libkvrouter.a: no run path, only the JNI entry points exported, and no shared
# library but glibc's and those README.md names (no static archive, or one that cannot go into a
# shared object: libnats, Debian's Abseil, libuv, libzmq).
jar=target/kvrouter-0.2.0.jar
native=target/classes/linux/x86_64/libkvrouter_jni.so
# (no grep -q after a pipe: with pipefail, the writer's SIGPIPE would fail the line)
if ! unzip -l "$jar" linux/x86_64/libkvrouter_jni.so >/dev/null; then
  echo "$jar has no linux/x86_64/libkvrouter_jni.so" >&2
  exit 1
fi
if readelf -d "$native" | grep -E 'R(UN)?PATH'; then
  echo "the glue has a run path" >&2
  exit 1
fi
needed=$(readelf -d "$native" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
allowed='^(libc\.so\.6|libm\.so\.6|libpthread\.so\.0|libdl\.so\.2|librt\.so\.1|ld-linux-x86-64\.so\.2|libnats\.so\..*|libzmq\.so\.5|libuv\.so\.1|libabsl_[a-z0-9_]+\.so\..*)$'
unexpected=$(grep -Ev "$allowed" <<<"$needed" || true)
if [ -n "$unexpected" ]; then
  echo "the glue needs shared libraries README.md does not name:" $unexpected >&2
  exit 1
fi
exported=$(nm -D --defined-only "$native" | awk '{print $3}' | grep -Ev '^(Java_io_kvrouter_|JNI_On(Load|Unload)$)' || true)
if [ -n "$exported" ]; then
  echo "the glue exports more than its JNI entry points:" $exported >&2
  exit 1
fi
echo "NEEDED:" $needed
echo "no run path; exports $(nm -D --defined-only "$native" | wc -l) symbols, all JNI entry points"

echo "== bindings/java: the shared libraries the jar carries for the glue (linux/x86_64/) =="
# What the jar holds (unzipped from it): the index lists, dependencies first, every library the
# glue needs directly or not, but glibc's and the C++ runtime (README.md says why those stay the
# system's); none of them has a run path; the notice names each one.
shipped=target/jar-natives
rm -rf "$shipped" && mkdir -p "$shipped"
unzip -q "$jar" 'linux/x86_64/*' 'META-INF/kvrouter-native-*' -d "$shipped"
index=$shipped/linux/x86_64/libkvrouter_jni.libs
notice=$shipped/META-INF/kvrouter-native-NOTICE
for f in "$index" "$notice"; do
  [[ -s $f ]] || { echo "$jar has no ${f#"$shipped"/}" >&2; exit 1; }
done
mapfile -t vendored < <(grep -Ev '^(#|$)' "$index")
system='^(libc\.so\.6|libm\.so\.6|libpthread\.so\.0|libdl\.so\.2|librt\.so\.1|libresolv\.so\.2|libutil\.so\.1|libanl\.so\.1|libmvec\.so\.1|ld-linux-x86-64\.so\.2|libstdc\+\+\.so\.6|libgcc_s\.so\.1)$'
placed=()
for lib in "${vendored[@]}" libkvrouter_jni.so; do
  file=$shipped/linux/x86_64/$lib
  [[ -f $file ]] || { echo "the index lists $lib, which the jar lacks" >&2; exit 1; }
  dynamic=$(readelf -d "$file")
  if grep -E 'R(UN)?PATH' <<<"$dynamic"; then
    echo "$lib has a run path" >&2
    exit 1
  fi
  for dep in $(sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' <<<"$dynamic"); do
    [[ $dep =~ $system ]] && continue
    if [[ " ${placed[*]} " != *" $dep "* ]]; then
      echo "$lib needs $dep, which the index does not list before it" >&2
      exit 1
    fi
  done
  if [[ $lib != libkvrouter_jni.so ]] && ! grep -qx "$lib" "$notice"; then
    echo "META-INF/kvrouter-native-NOTICE does not name $lib" >&2
    exit 1
  fi
  placed+=("$lib")
done
glibc=$(for lib in "${vendored[@]}" libkvrouter_jni.so; do
  readelf -V --wide "$shipped/linux/x86_64/$lib" | sed -n '/Version needs section/,/Version definition section/p'
done | grep -oE 'Name: (GLIBC|GLIBCXX)_[0-9.]+' | awk '{print $2}' | sort -u -V)
glibc_needed=$(grep '^GLIBC_' <<<"$glibc" | tail -n 1 | cut -d_ -f2)
# README.md promises glibc 2.36 (Debian 12's): a build on a newer glibc would need more.
if [[ $(printf '%s\n' "$glibc_needed" 2.36 | sort -V | tail -n 1) != 2.36 ]]; then
  echo "the jar's natives need glibc $glibc_needed; README.md says 2.36" >&2
  exit 1
fi
echo "${#vendored[@]} libraries, $(du -cb "${vendored[@]/#/$shipped/linux/x86_64/}" | tail -n 1 | cut -f1) bytes, in load order, no run path;" \
  "needs glibc $glibc_needed+, libstdc++ $(grep '^GLIBCXX_' <<<"$glibc" | tail -n 1)+"
echo "$jar: $(du -b "$jar" | cut -f1) bytes"

echo "== bindings/java: a consumer with the jar alone (module path, no LD_LIBRARY_PATH) =="
# src/it/consumer: compiled and run as a named module requiring io.kvrouter (the manifest's
# Automatic-Module-Name), in an environment without LD_LIBRARY_PATH, so that the glue and the
# library can only come from the jar. It reads /proc/self/maps: every library of the jar's index
# (libnats, libzmq, libuv, Abseil, ..., all installed on this machine too) must be mapped from
# the directory the glue was loaded from, and no system copy of any of them.
if [[ $(ldconfig -p) == *libkvrouter.so* ]]; then
  echo "note: a libkvrouter is installed on the system library path; Main checks it stays unmapped"
fi
consumer=target/consumer
rm -rf "$consumer" && mkdir -p "$consumer"
javac -d "$consumer" --module-path "$jar" $(find src/it/consumer/src -name '*.java')
env -u LD_LIBRARY_PATH -u PKG_CONFIG_PATH java -Djava.library.path=/nonexistent \
  --enable-native-access=io.kvrouter --module-path "$jar:$consumer" -m consumer/consumer.Main

if [[ -n $ffm_feature ]]; then
echo "== bindings/java: the consumer on JDK $ffm_feature: the jar's FFM path (META-INF/versions/22) =="
# The same, on KVR_FFM_JDK: the JVM must load the FFM implementation of io.kvrouter.HotPath (its
# nested HotPath$Buffer exists only there) and make a downcall.
classes=$(env -u LD_LIBRARY_PATH -u PKG_CONFIG_PATH "$ffm_jdk/bin/java" -Xlog:class+load=info \
  -Djava.library.path=/nonexistent --enable-native-access=io.kvrouter \
  --module-path "$jar:$consumer" -m consumer/consumer.Main)
grep -v '\[class,load\]' <<<"$classes"
for class in 'io\.kvrouter\.HotPath\$Buffer' 'jdk\.internal\.foreign\.abi\.DowncallLinker'; do
  if ! grep -qE "\\[class,load\\] $class " <<<"$classes"; then
    echo "JDK $ffm_feature did not load $class: the jar's FFM path was not used" >&2
    exit 1
  fi
done
echo "loaded io.kvrouter.HotPath from META-INF/versions/22 (FFM)"
fi

echo "== bindings/java: the consumer again, the system's copies of the jar's libraries hidden =="
# As on a machine without those packages: in a private mount namespace (unshare, as root or in an
# unprivileged user namespace), /dev/null is bind-mounted over the system's file of each library
# the index lists, so that the glue no longer loads with the system's libraries (ldd fails) and
# the consumer runs only if every one comes from the jar. Skipped where no mount namespace can be
# made (a container without the capability); the /proc/self/maps check above still ran.
hide=()
while read -r name path; do
  if [[ " ${vendored[*]} " == *" $name "* ]]; then hide+=("$(readlink -f "$path")"); fi
done < <(ldd "$native" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}')
userns=()
if unshare -m true 2>/dev/null; then
  userns=(unshare -m --propagation private)
elif unshare -rm true 2>/dev/null; then
  userns=(unshare -rm --propagation private)
fi
if [[ ${#hide[@]} -eq 0 ]]; then
  echo "skipped: the system has none of the jar's libraries"
elif [[ ${#userns[@]} -eq 0 ]]; then
  echo "skipped: unshare cannot make a mount namespace here"
else
  env -u LD_LIBRARY_PATH -u PKG_CONFIG_PATH "${userns[@]}" bash -euc '
    native=$1 jar=$2 consumer=$3; shift 3
    for f; do mount --bind /dev/null "$f"; done
    if ldd "$native" >/dev/null 2>&1; then
      echo "the glue still loads with the system libraries hidden" >&2
      exit 1
    fi
    echo "$# system files hidden; ldd: $(ldd "$native" 2>&1 | head -n 1 | sed "s/^[^:]*: //")"
    java -Djava.library.path=/nonexistent --enable-native-access=io.kvrouter \
      --module-path "$jar:$consumer" -m consumer/consumer.Main' \
    _ "$native" "$jar" "$consumer" "${hide[@]}"
fi

echo "== examples/java: the gateway against two fake engines (the jar alone, no LD_LIBRARY_PATH) =="
# GatewayExampleTest starts the gateway and two fake engines as processes on 127.0.0.1 and checks
# routing, prefix affinity from the engines' KV events, loads back to zero after complete answers
# and after a client leaving mid-stream, /metrics.
examples=target/examples
rm -rf "$examples" && mkdir -p "$examples"
javac -Xlint:all -Werror -d "$examples" -cp "$jar" \
  $(find ../../examples/java/src ../../examples/java/test -name '*.java')
env -u LD_LIBRARY_PATH -u PKG_CONFIG_PATH timeout 300 java --enable-native-access=ALL-UNNAMED \
  -cp "$jar:$examples" io.kvrouter.examples.GatewayExampleTest

echo "$summary"
