# Sourced by scripts/test-packaging.sh and scripts/abi-baseline.sh: the library as the Debian
# packages ship it, built once the same way for both, so that the ABI the packaging test checks
# is the ABI the baseline records. Run from the repository's root.
#
# build_package_library: configures and builds libkvrouter (Release, for /usr) in
# build/package, and sets $build, $version (x.y.z) and $soversion (x.y: the SONAME at 0.x).
# -g is for abidw; -ffile-prefix-map makes the debug information name ./src/..., not this
# checkout, so that the ABI description is the same from any directory.
build_package_library() {
  local src=$PWD
  build=build/package
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/usr \
    -DKVR_BUILD_TESTS=OFF -DKVR_BUILD_BENCH=OFF -DKVR_BUILD_TOOLS=OFF -DKVR_BUILD_EXAMPLES=OFF \
    -DCMAKE_C_FLAGS="-g -ffile-prefix-map=$src=." -DCMAKE_CXX_FLAGS="-g -ffile-prefix-map=$src=." \
    >/dev/null
  cmake --build "$build" -j "${KVR_JOBS:-$(nproc)}" --target kvrouter
  version=$(sed -n 's/^#define KVR_VERSION_STRING "\(.*\)"$/\1/p' "$build/include/kvrouter_version.h")
  soversion=${version%.*}
}
