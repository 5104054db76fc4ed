#!/usr/bin/env bash
# The Go binding's tests (bindings/go): builds libkvrouter, installs it into a staging prefix
# (build/go/stage), then, against that install through pkg-config, runs go vet, the example
# program, a consumer project (tests/go-consumer, shared and static), the Prometheus
# collector's tests (bindings/go/kvrouterprom), the gateway example's tests (examples/go), and
# the binding's go test with the race detector. Ends with go test's own ok/FAIL summary line.
# Needs Go >= 1.21 (on PATH, in /usr/local/go or Debian's /usr/lib/go-1.2x); the NATS test
# uses nats-server if present.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/lib/go.sh
find_go test-go.sh

source scripts/staged-library.sh
use_staged_library go
export CGO_ENABLED=1
# Go's build cache does not hash the headers a cgo package #includes from outside its directory
# (golang/go#24355): after kvrouter.h changes, a package whose Go files did not (internal/cbench)
# would be reused as built against the old header, with the old struct sizes (a stack overrun
# when the new library fills a struct). The header's hash in CGO_CFLAGS, which is part of the
# cache key, rebuilds them. ("-O2 -g" is go's default when CGO_CFLAGS is unset.)
header=$(pkg-config --variable=includedir kvrouter)/kvrouter.h
export CGO_CFLAGS="${CGO_CFLAGS:--O2 -g} -DKVR_GO_HEADER_SHA256=$(sha256sum "$header" | cut -c1-16)"

root=$PWD
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

cd bindings/go
echo "== go: $("$go" version), libkvrouter $(pkg-config --modversion kvrouter) =="
echo "== go vet =="
"$go" vet ./...
echo "== example: go run ./examples/route =="
"$go" run ./examples/route

# A consumer project (tests/go-consumer: its own module, the binding through a replace
# directive, the library through pkg-config), linked with libkvrouter.so and with libkvrouter.a
# (-tags kvrouter_static: then no libkvrouter.so is needed at run time), and run against a
# library reporting another major.minor (a preloaded kvr_version), which it must refuse.
echo "== consumer project: tests/go-consumer, shared and static =="
(
  cd "$root/tests/go-consumer"
  GOPROXY=off "$go" build -o "$tmp/consumer" .
  "$tmp/consumer"
  GOPROXY=off "$go" build -tags kvrouter_static -o "$tmp/consumer-static" .
  if readelf -d "$tmp/consumer-static" | grep -q 'NEEDED.*libkvrouter'; then
    echo "the static build still needs libkvrouter.so" >&2
    exit 1
  fi
  env -u LD_LIBRARY_PATH "$tmp/consumer-static"
  printf '%s\n' '#include <stdint.h>' 'uint32_t kvr_version(void) { return 300; }' \
    'const char *kvr_version_string(void) { return "0.3.0"; }' >"$tmp/fake_version.c"
  cc -shared -fPIC -o "$tmp/libfake_version.so" "$tmp/fake_version.c"
  if LD_PRELOAD="$tmp/libfake_version.so" "$tmp/consumer" 2>"$tmp/refused"; then
    echo "the consumer ran against a library reporting 0.3.0" >&2
    exit 1
  fi
  grep -q 'libkvrouter 0.3.0 is loaded, but this Go package .* accepts libkvrouter 0.2.x only' "$tmp/refused" || {
    cat "$tmp/refused" >&2
    exit 1
  }
  echo "with a library reporting 0.3.0: $(cat "$tmp/refused")"
)

# The Prometheus collector (its own module, bindings/go/kvrouterprom: promlint over the
# library's text) and the gateway example (examples/go, against fake engines). Their
# client_golang dependency comes from the Go module proxy (or the module cache).
echo "== kvrouterprom: go vet, go test =="
(cd kvrouterprom && "$go" vet ./... && "$go" test -count=1 ./...)
echo "== examples/go (gateway): go vet, go test -race =="
(cd "$root/examples/go" && "$go" vet ./... && "$go" test -race -count=1 ./...)
echo "== go test -race =="
# -v lists every test; its RUN/PAUSE/CONT lines are dropped. go test's ok/FAIL lines come last,
# one per package, and pipefail carries its exit code.
"$go" test -race -count=1 -v ./... 2>&1 | grep -v -E '^=== (RUN|PAUSE|CONT)'
