#!/usr/bin/env bash
# kvrouter's index side by side with Dynamo's indexers (bench/peers: the published crate
# dynamo-kv-router =1.6.1 as a dependency, nothing of it copied). Builds libkvrouter and the
# bench, then:
#   scripts/bench-peers.sh [flags...]          the table of BENCHMARKS.md ("Index against
#                                              Dynamo's indexers"): a few minutes
#   scripts/bench-peers.sh --check [flags...]  only the differential check (300 queries per
#                                              phase, 64 and 1,000 workers) and the probes of
#                                              where the rules differ: under a minute warm
# Extra flags go to the bench binary (bench/peers/src/main.rs lists them, e.g. --workers 64,
# --rounds 3, --trace-requests 2000, --kvr-index-shards 2); KVR_PEERS_CHECK_QUERIES sets the
# check's queries per phase.
#
# The library: the prefix in KVR_STAGE (scripts/test.sh passes its plain build's, as to the
# bindings) or, without it, a Release build of this checkout staged in build/peers/stage; then
# scripts/staged-library.sh points pkg-config and the loader at it. Cargo downloads the crates
# once into its own cache (CARGO_HOME) and builds into build/peers-target; the lockfile
# (bench/peers/Cargo.lock) pins Dynamo's dependency tree (cargo only rewrites the entries of the
# path crates, kvrouter and kvrouter-sys, when their version changes).
set -euo pipefail
cd "$(dirname "$0")/.."

jobs=${KVR_JOBS:-$(nproc)}
root=$PWD
command -v cargo >/dev/null || PATH=$HOME/.cargo/bin:$PATH

mode=table
if [[ ${1:-} == --check ]]; then
  mode=check
  shift
fi

source scripts/staged-library.sh
use_release_library_for_dynamo_benches bench/peers

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/build/peers-target}
export CARGO_BUILD_JOBS=$jobs
# The check builds with the `differential` profile (release at opt-level 1: quicker to compile,
# bench/peers/Cargo.toml); the timed table with --release.
profile=release
[[ $mode == check ]] && profile=differential
echo "== bench/peers: cargo build --profile $profile (dynamo-kv-router 1.6.1 from crates.io) =="
if ! (cd bench/peers && cargo build --profile "$profile"); then
  echo "bench/peers did not build; it needs crates.io (or those crates in CARGO_HOME's cache)" >&2
  exit 1
fi
bench=$CARGO_TARGET_DIR/$profile/kvrouter-peers-bench

if [[ $mode == check ]]; then
  echo "== bench/peers: unit tests =="
  (cd bench/peers && cargo test --profile "$profile" --quiet)
  echo "== differential check: kvrouter against Dynamo's RadixTree and ConcurrentRadixTreeCompressed =="
  "$bench" --check "${KVR_PEERS_CHECK_QUERIES:-300}" --probes "$@"
else
  echo "== side by side: checkout $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src include || echo ' (src/ or include/ modified)'), library $stage, $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, load average $(cut -d ' ' -f 1-3 /proc/loadavg) =="
  "$bench" "$@"
fi
