# Sourced by the bindings' test scripts (test-go.sh, test-rust.sh, test-java.sh) and the benches
# against Dynamo (bench-peers.sh, bench-selection.sh): the
# libkvrouter install they build and test against. `use_staged_library NAME` takes KVR_STAGE
# (scripts/test.sh passes the prefix it staged from its own build) or, when that is unset,
# builds the library and installs it into build/NAME/stage; then it sets $stage and exports
# PKG_CONFIG_PATH and LD_LIBRARY_PATH for it. Run from the repository's root.
use_staged_library() {
  local name=$1 pcdir
  stage=${KVR_STAGE:-}
  if [[ -z $stage ]]; then
    stage=$PWD/build/$name/stage
    echo "== libkvrouter: build and stage in build/$name/stage =="
    cmake -S . -B "build/$name" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVR_BUILD_TESTS=OFF \
      -DKVR_BUILD_BENCH=OFF -DKVR_BUILD_TOOLS=OFF -DKVR_BUILD_EXAMPLES=OFF >/dev/null
    cmake --build "build/$name" -j "${KVR_JOBS:-$(nproc)}" --target kvrouter kvrouter_static
    cmake --install "build/$name" --prefix "$stage" >/dev/null
  fi
  pcdir=$(find "$stage" -name kvrouter.pc -path '*/pkgconfig/*' -printf '%h\n' | head -n 1)
  if [[ -z $pcdir ]]; then
    echo "no kvrouter.pc under $stage" >&2
    return 1
  fi
  export PKG_CONFIG_PATH=$pcdir${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export LD_LIBRARY_PATH=$(dirname "$pcdir")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}

# For the benches against Dynamo (scripts/bench-peers.sh, bench-selection.sh): checks that cargo
# can build dynamo-kv-router (edition 2024: Rust 1.85 or later), then stages the library they
# link: the prefix in KVR_STAGE, or a Release build in build/peers staged in build/peers/stage
# (the benches share it), and points pkg-config and the loader at it (use_staged_library).
use_release_library_for_dynamo_benches() {
  local name=$1 cargo_version
  cargo_version=$(cargo --version | awk '{print $2}')
  if [[ $(printf '%s\n' 1.85.0 "$cargo_version" | sort -V | head -n 1) != 1.85.0 ]]; then
    echo "$name needs Rust >= 1.85 (dynamo-kv-router is edition 2024); cargo is $cargo_version" >&2
    exit 1
  fi
  if [[ -z ${KVR_STAGE:-} ]]; then
    echo "== libkvrouter: Release build, staged in build/peers/stage =="
    cmake -S . -B build/peers -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVR_BUILD_TESTS=OFF \
      -DKVR_BUILD_BENCH=OFF -DKVR_BUILD_TOOLS=OFF -DKVR_BUILD_EXAMPLES=OFF -DKVR_BUILD_SERVICE=OFF \
      >/dev/null
    cmake --build build/peers -j "${KVR_JOBS:-$(nproc)}" --target kvrouter kvrouter_static
    cmake --install build/peers --prefix build/peers/stage >/dev/null
    export KVR_STAGE=$PWD/build/peers/stage
  fi
  use_staged_library peers
}
