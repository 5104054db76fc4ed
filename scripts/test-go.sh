#!/usr/bin/env bash
# The Go binding's tests (bindings/go): builds libkvrouter, installs it into a staging prefix
# (build/go/stage), then, against that install through pkg-config, runs go vet, the example
# program, and go test with the race detector. Ends with go test's own ok/FAIL summary line.
# Needs Go >= 1.21 (on PATH, in /usr/local/go or Debian's /usr/lib/go-1.2x); the NATS test
# uses nats-server if present.
set -euo pipefail
cd "$(dirname "$0")/.."

# On PATH, the official tarball's place, or Debian's golang-1.2x-go (scripts/install-deps.sh).
go=$(command -v go || ls /usr/local/go/bin/go /usr/lib/go-1.2*/bin/go 2>/dev/null | tail -n1 || true)
if [[ -z $go ]]; then
  echo "test-go.sh: no Go toolchain found (need go >= 1.21 on PATH or in /usr/local/go)" >&2
  exit 1
fi

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

cd bindings/go
echo "== go: $("$go" version), libkvrouter $(pkg-config --modversion kvrouter) =="
echo "== go vet =="
"$go" vet ./...
echo "== example: go run ./examples/route =="
"$go" run ./examples/route
echo "== go test -race =="
# -v lists every test; its RUN/PAUSE/CONT lines are dropped. go test's ok/FAIL lines come last,
# one per package, and pipefail carries its exit code.
"$go" test -race -count=1 -v ./... 2>&1 | grep -v -E '^=== (RUN|PAUSE|CONT)'
