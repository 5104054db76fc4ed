#!/usr/bin/env bash
# The endpoint picker's tests (service/epp, kvrouter-epp): go vet, then go test with the race
# detector, against a fake kvrouterd and a gRPC client in Envoy's place, all on 127.0.0.1.
# Pure Go: no libkvrouter needed. Ends with go test's own ok/FAIL summary line.
# Needs Go >= 1.21 (on PATH, in /usr/local/go or Debian's /usr/lib/go-1.2x) and a C compiler
# (the race detector); gRPC and go-control-plane come from the Go module proxy (or the module
# cache). The module needs Go 1.26: an older go fetches that toolchain itself (GOTOOLCHAIN).
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/lib/go.sh
find_go test-epp.sh
# auto: a go older than go.mod's directive downloads and runs that toolchain (cached in the
# module cache), even where a distribution's go.env says local (which refuses the module).
export GOTOOLCHAIN=${GOTOOLCHAIN:-auto}
export CGO_ENABLED=1

cd service/epp
echo "== epp: $("$go" version) =="
echo "== go vet =="
"$go" vet ./...
echo "== go test -race =="
# -v lists every test; its RUN/PAUSE/CONT lines are dropped. go test's ok/FAIL lines come last,
# one per package, and pipefail carries its exit code.
"$go" test -race -count=1 -v ./... 2>&1 | grep -v -E '^=== (RUN|PAUSE|CONT)'
