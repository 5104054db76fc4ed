# Sourced by the bindings' test scripts (test-go.sh, test-rust.sh, test-java.sh): the
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
