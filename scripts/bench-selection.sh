#!/usr/bin/env bash
# The whole routing decision with booking and release, kvrouter against Dynamo's selection core
# (bench/selection: the published crate dynamo-kv-router =1.6.1 as a dependency, with its
# standalone-selection and bench features, nothing of it copied). Builds libkvrouter and the
# bench, then prints the table of BENCHMARKS.md ("Routing decision against Dynamo's
# SelectionCore"):
#   scripts/bench-selection.sh [flags...]      a minute or two once built
# Extra flags go to the bench binary (bench/selection/src/main.rs lists them, e.g. --workers 64,
# --rounds 3, --iters 1024, --short-tokens 0, --dynamo-indexer-threads 1, --callers 1,2,4: after
# the one-caller rounds, rounds of 2 and of 4 threads calling each router at once, and their
# table).
#
# Not part of CI: bench/selection is a workspace of its own, apart from bench/peers (which
# scripts/bench-peers.sh --check builds in CI), because Dynamo's selection features pull in
# axum, reqwest (rustls) and zmq, several minutes more to compile. It links the system's
# libzmq (zmq-sys through pkg-config: libzmq3-dev on Debian).
#
# The library: the prefix in KVR_STAGE or, without it, the same Release build as
# scripts/bench-peers.sh, in the same place (build/peers, staged in build/peers/stage: the two
# benches share it); scripts/staged-library.sh then points pkg-config and the loader at it.
# Cargo builds into build/selection-target; bench/selection/Cargo.lock pins Dynamo's dependency
# tree (started from bench/peers' lockfile, so the crates both use are at the same versions).
# KVR_JOBS sets the parallel jobs (default: the core count).
set -euo pipefail
cd "$(dirname "$0")/.."

jobs=${KVR_JOBS:-$(nproc)}
root=$PWD
command -v cargo >/dev/null || PATH=$HOME/.cargo/bin:$PATH

source scripts/staged-library.sh
use_release_library_for_dynamo_benches bench/selection

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/build/selection-target}
export CARGO_BUILD_JOBS=$jobs
echo "== bench/selection: cargo build --release (dynamo-kv-router 1.6.1 from crates.io) =="
if ! (cd bench/selection && cargo build --release); then
  echo "bench/selection did not build; it needs crates.io (or those crates in CARGO_HOME's cache) and libzmq's pkg-config file" >&2
  exit 1
fi
bench=$CARGO_TARGET_DIR/release/kvrouter-selection-bench

echo "== side by side: checkout $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src include || echo ' (src/ or include/ modified)'), library $stage, $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, load average $(cut -d ' ' -f 1-3 /proc/loadavg) =="
"$bench" "$@"
