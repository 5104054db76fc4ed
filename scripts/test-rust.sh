#!/usr/bin/env bash
# The Rust binding (bindings/rust): builds libkvrouter, installs it into build/rust/stage, and
# runs the workspace's tests against that staged copy, found through its kvrouter.pc. The
# binding has no crates.io dependencies, so everything runs with --offline. Formatting and
# clippy are checked first when those cargo components are installed. Ends with cargo's own
# "test result:" lines.
set -euo pipefail
cd "$(dirname "$0")/.."

jobs=${KVR_JOBS:-$(nproc)}
root=$PWD
command -v cargo >/dev/null || PATH=$HOME/.cargo/bin:$PATH

source scripts/staged-library.sh
use_staged_library rust
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/build/rust-target}
export CARGO_BUILD_JOBS=$jobs
cd bindings/rust

if cargo fmt --version >/dev/null 2>&1; then
  echo "== cargo fmt --check =="
  cargo fmt --all -- --check
fi
if cargo clippy --version >/dev/null 2>&1; then
  echo "== cargo clippy (warnings are errors) =="
  cargo clippy --offline --workspace --all-targets -- -D warnings
fi
echo "== cargo test =="
cargo test --offline --workspace
