#!/usr/bin/env bash
# The routing-only library: configured with -DKVR_WITH_ZMQ=OFF -DKVR_WITH_NATS=OFF (Release, the
# library alone, in build/routing-only), then checked:
#  - the configure step looked for no transport (libuv, libzmq, libnats, msgpack);
#  - libkvrouter.so needs none of libuv, libzmq, libnats (readelf: only Abseil and the C and
#    C++ runtimes, xxHash being inlined and FlatBuffers header-only; ldd: nothing of
#    theirs comes in indirectly either), and exports the same kvr_* functions as any build;
#  - installed into a staging prefix, kvrouter.pc's static flags name no transport;
#  - tests/package/consumer.c, built with -DKVR_CONSUMER_ROUTING_ONLY against it (shared and
#    static), routes, and gets KVR_UNIMPLEMENTED naming the options from the ingest functions.
# Ends with "routing-only: N checks passed".
set -eEuo pipefail
cd "$(dirname "$0")/.."
unset PKG_CONFIG_PATH CMAKE_PREFIX_PATH LD_LIBRARY_PATH
build=build/routing-only
tmp=$(mktemp -d /tmp/routing-only.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
trap 'echo "test-routing-only: FAILED at line $LINENO: $BASH_COMMAND" >&2' ERR

# ok, fail, run_logged; $checks counts the passed checks.
source scripts/lib/checks.sh

echo "== build: libkvrouter without transports (Release) in $build =="
run_logged "$tmp/configure.log" cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DKVR_WITH_ZMQ=OFF -DKVR_WITH_NATS=OFF -DKVR_BUILD_TESTS=OFF -DKVR_BUILD_BENCH=OFF \
  -DKVR_BUILD_TOOLS=OFF -DKVR_BUILD_EXAMPLES=OFF
looked=$(grep -E '^(LIBUV|LIBZMQ|NATS)_[A-Z_]*:|^KVR_MSGPACK_INCLUDE_DIR:' "$build/CMakeCache.txt" ||
  true)
[ -z "$looked" ] || fail "the routing-only configure looked for a transport: $looked"
ok "the configure step looked for no libuv, libzmq, libnats or msgpack"
cmake --build "$build" -j "${KVR_JOBS:-$(nproc)}" --target kvrouter kvrouter_static

lib=$(readlink -f "$build/src/capi/libkvrouter.so")
needed=$(readelf -d "$lib" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | LC_ALL=C sort)
others=$(grep -vE '^(libabsl_[a-z0-9_]+|libstdc\+\+|libm|libgcc_s|libc|ld-linux-[a-z0-9_-]+)\.so(\.[0-9.]+)?$' \
  <<<"$needed" || true)
[ -z "$others" ] || fail "libkvrouter.so needs more than Abseil and the runtimes: $others"
# (xxHash is inlined, XXH_INLINE_ALL; of FlatBuffers only headers are used.)
ok "readelf: libkvrouter.so needs only Abseil, libstdc++, libm, libgcc_s, libc, ld-linux" \
  "($(wc -l <<<"$needed") NEEDED)"
transports=$(ldd "$lib" | grep -E 'libuv|libzmq|libnats' || true)
[ -z "$transports" ] || fail "ldd: libkvrouter.so loads a transport library: $transports"
ok "ldd: no libuv, libzmq or libnats, directly or indirectly"
exported=$(nm -D --defined-only "$lib" | awk '$3 ~ /^kvr_/ {sub(/@.*/, "", $3); print $3}' |
  LC_ALL=C sort)
declared=$(grep -oE 'KVR_API[^(]*\<kvr_[a-z0-9_]+\(' include/kvrouter.h |
  grep -oE 'kvr_[a-z0-9_]+\($' | tr -d '(' | LC_ALL=C sort -u)
[ "$exported" = "$declared" ] || {
  diff <(echo "$declared") <(echo "$exported") >&2 || true
  fail "the routing-only library does not export exactly the header's kvr_* functions"
}
ok "every kvr_* function of the header is exported ($(wc -l <<<"$exported")): the ABI is whole"

stage=$tmp/stage
run_logged "$tmp/install.log" cmake --install "$build" --prefix "$stage"
pcdir=$(dirname "$(find "$stage" -name kvrouter.pc)")
pc=(env PKG_CONFIG_PATH="$pcdir" pkg-config)
static_flags=$("${pc[@]}" --static --libs kvrouter | sed 's/ *$//')
for dep in -luv -lzmq -lnats; do
  [[ " $static_flags " != *" $dep "* ]] || fail "pkg-config --static --libs kvrouter has $dep"
done
ok "pkg-config --static --libs kvrouter names no transport: $static_flags"

cflags=$("${pc[@]}" --cflags kvrouter)
# shellcheck disable=SC2086  # pkg-config's flags are meant to be split
run_logged "$tmp/cc.log" cc -std=c11 -pedantic -Wall -Wextra -Werror -DKVR_CONSUMER_ROUTING_ONLY \
  tests/package/consumer.c $cflags $("${pc[@]}" --libs kvrouter) -o "$tmp/consumer-shared"
# shellcheck disable=SC2086
run_logged "$tmp/cc-static.log" cc -std=c11 -pedantic -Wall -Wextra -Werror \
  -DKVR_CONSUMER_ROUTING_ONLY tests/package/consumer.c $cflags \
  ${static_flags/-lkvrouter /-l:libkvrouter.a } -o "$tmp/consumer-static"
ok "consumer.c (-DKVR_CONSUMER_ROUTING_ONLY) built against the shared and the static library"
for exe in consumer-shared consumer-static; do
  output=$(env LD_LIBRARY_PATH="$pcdir/.." "$tmp/$exe") ||
    fail "$exe exited non-zero: $output"
  [[ $output == *"KVR_UNIMPLEMENTED"*"-DKVR_WITH_ZMQ=OFF"*": OK" ]] ||
    fail "$exe printed '$output'"
  ok "$exe routes and is told KVR_UNIMPLEMENTED: $(tr '\n' ' ' <<<"$output")"
done
if ldd "$tmp/consumer-static" | grep -F libkvrouter; then
  fail "consumer-static loads libkvrouter.so"
fi
ok "consumer-static holds the library's code (no libkvrouter.so loaded)"

echo "routing-only: $checks checks passed"
