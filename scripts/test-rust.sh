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

# KVR_STAGE: an install prefix of libkvrouter to test against (scripts/test.sh passes the one
# it staged from its own build); otherwise the library is built and staged here.
stage=${KVR_STAGE:-}
if [[ -z $stage ]]; then
  stage=$root/build/rust/stage
  echo "== libkvrouter: build and stage in build/rust/stage =="
  cmake -S . -B build/rust -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVR_BUILD_TESTS=OFF \
    -DKVR_BUILD_BENCH=OFF -DKVR_BUILD_TOOLS=OFF -DKVR_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build build/rust -j "$jobs" --target kvrouter
  cmake --install build/rust --prefix "$stage" >/dev/null
fi

export PKG_CONFIG_PATH=$stage/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
export LD_LIBRARY_PATH=$stage/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
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
