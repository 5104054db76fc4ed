#!/usr/bin/env bash
# Packaging test: libkvrouter as a system library. Builds only the library (Release) in
# build/package, configured for /usr as the Debian packages are, then:
#  (a) installs it into a staging prefix, component by component, checks the files and the
#      exported CMake target, and builds and runs tests/package/consumer.c against it twice:
#      through pkg-config and through CMake's find_package;
#  (b) checks that the library exports exactly the kvr_* functions of include/kvrouter.h;
#  (c) builds the Debian packages with cpack and checks their fields, dependencies, control
#      files and contents; then builds and runs the consumer against them: installed into the
#      system with dpkg -i and removed again afterwards when run as root with
#      KVR_PACKAGE_INSTALL=1 (CI, on a throwaway machine), otherwise extracted into a
#      temporary root with dpkg-deb -x.
# Ends with "packaging: N checks passed". Needs dpkg-dev, file, pkg-config and binutils
# (scripts/install-deps.sh installs them).
set -eEuo pipefail
cd "$(dirname "$0")/.."
if [ "${KVR_PACKAGE_INSTALL:-0}" = 1 ] && [ "$(id -u)" != 0 ]; then
  echo "test-packaging: KVR_PACKAGE_INSTALL=1 installs into the system: run as root" >&2
  exit 1
fi

jobs=${KVR_JOBS:-$(nproc)}
build=build/package
src=$PWD
# Only what this script passes decides where the consumer finds kvrouter.
unset PKG_CONFIG_PATH CMAKE_PREFIX_PATH LD_LIBRARY_PATH kvrouter_DIR kvrouter_ROOT

tmp=$(mktemp -d /tmp/pkg-test.XXXXXX)
installed_by_us=0
runtime_pkg=""
dev_pkg=libkvrouter-dev
cleanup() {
  if [ "$installed_by_us" = 1 ]; then
    echo "test-packaging: removing $dev_pkg and $runtime_pkg again" >&2
    dpkg --purge "$dev_pkg" "$runtime_pkg" >/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'echo "test-packaging: FAILED at line $LINENO: $BASH_COMMAND" >&2' ERR

checks=0
ok() {
  checks=$((checks + 1))
  echo "  ok: $*"
}
fail() {
  echo "test-packaging: FAILED: $*" >&2
  exit 1
}
expect_eq() {  # expect_eq WHAT ACTUAL EXPECTED
  [ "$2" = "$3" ] || fail "$1: got '$2', expected '$3'"
  ok "$1: $2"
}
expect_same_lines() {  # expect_same_lines WHAT ACTUAL EXPECTED (newline-separated lists)
  if [ "$2" != "$3" ]; then
    diff <(echo "$3") <(echo "$2") >&2 || true
    fail "$1 differ from what is expected (- expected, + got)"
  fi
  ok "$1 ($(echo "$2" | wc -l) as expected)"
}
run_logged() {  # run_logged LOG COMMAND...: quiet unless it fails
  local log=$1
  shift
  "$@" >"$log" 2>&1 || {
    cat "$log" >&2
    fail "$*"
  }
}

echo "== build: libkvrouter (Release, for /usr) in $build =="
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/usr \
  -DKVR_BUILD_TESTS=OFF -DKVR_BUILD_BENCH=OFF -DKVR_BUILD_TOOLS=OFF -DKVR_BUILD_EXAMPLES=OFF \
  >/dev/null
cmake --build "$build" -j "$jobs" --target kvrouter

version=$(sed -n 's/^#define KVR_VERSION_STRING "\(.*\)"$/\1/p' "$build/include/kvrouter_version.h")
soversion=${version%.*}  # 0.x: the SONAME carries major.minor
deb_release=$(sed -n 's/^set(CPACK_DEBIAN_PACKAGE_RELEASE "\(.*\)")$/\1/p' \
  "$build/CPackConfig.cmake")
deb_version=$version-$deb_release
runtime_pkg=libkvrouter$soversion
arch=$(dpkg --print-architecture)
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH)
libdir=lib/$multiarch
echo "kvrouter $version: SONAME libkvrouter.so.$soversion, packages $runtime_pkg and $dev_pkg" \
  "$deb_version ($arch), libdir $libdir"

# What each component installs, relative to the prefix.
runtime_files="$libdir/libkvrouter.so.$soversion
$libdir/libkvrouter.so.$version"
dev_files="include/kvrouter.h
include/kvrouter_version.h
$libdir/cmake/kvrouter/kvrouterConfig.cmake
$libdir/cmake/kvrouter/kvrouterConfigVersion.cmake
$libdir/cmake/kvrouter/kvrouterTargets-release.cmake
$libdir/cmake/kvrouter/kvrouterTargets.cmake
$libdir/libkvrouter.so
$libdir/pkgconfig/kvrouter.pc"
files_under() {  # files_under DIR: every non-directory below DIR, relative, sorted
  (cd "$1" && find . ! -type d | sed 's|^\./||' | LC_ALL=C sort)
}

# consumers LABEL PREFIX: builds tests/package/consumer.c against the kvrouter installed in
# PREFIX (which holds include/ and lib/<multiarch>/), through pkg-config and through CMake, checks
# that each build found that installation and loads its library, and runs both. The packages'
# kvrouter.pc says prefix=/usr: extracted elsewhere, pkg-config is told the real prefix.
consumers() {
  local label=$1 prefix=$2
  local lib=$prefix/$libdir out=$tmp/consumer-$1
  local -a pc=(pkg-config) cmake_args=() run=()
  if [ "$prefix" != /usr ]; then
    pc=(env PKG_CONFIG_PATH="$lib/pkgconfig" pkg-config)
    [ "$label" != extracted ] || pc+=(--define-variable=prefix="$prefix")
    cmake_args=(-DCMAKE_PREFIX_PATH="$prefix")
    run=(env LD_LIBRARY_PATH="$lib")
  fi
  mkdir -p "$out"

  expect_eq "$label: pkg-config --modversion kvrouter" "$("${pc[@]}" --modversion kvrouter)" \
    "$version"
  expect_eq "$label: kvrouter.pc libdir" \
    "$(realpath "$("${pc[@]}" --variable=libdir kvrouter)")" "$(realpath "$lib")"
  local flags
  flags=$("${pc[@]}" --cflags --libs kvrouter | sed 's/ *$//')
  if [ "$prefix" = /usr ]; then
    # Only the library: -I/usr/include and -L/usr/lib/<multiarch> are the compiler's own.
    expect_eq "$label: pkg-config --cflags --libs kvrouter" "$flags" "-lkvrouter"
  fi
  # shellcheck disable=SC2086  # pkg-config's flags are meant to be split
  run_logged "$out/cc.log" cc -std=c11 -pedantic -Wall -Wextra -Werror \
    tests/package/consumer.c $flags -o "$out/consumer-pkgconfig"
  ok "$label: consumer built with cc \$(pkg-config --cflags --libs kvrouter) = $flags"

  run_logged "$out/cmake.log" cmake -S tests/package -B "$out/cmake" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DKVR_REQUIRED_VERSION="$soversion" "${cmake_args[@]}"
  expect_eq "$label: find_package(kvrouter $soversion) found" \
    "$(sed -n 's/^kvrouter_DIR:PATH=//p' "$out/cmake/CMakeCache.txt")" "$lib/cmake/kvrouter"
  run_logged "$out/cmake-build.log" cmake --build "$out/cmake"
  ok "$label: consumer built with find_package + kvrouter::kvrouter"

  local exe loaded output
  for exe in "$out/consumer-pkgconfig" "$out/cmake/consumer"; do
    loaded=$("${run[@]}" ldd "$exe" | awk '$1 == "libkvrouter.so.'"$soversion"'" {print $3}')
    expect_eq "$label: ${exe#"$out"/} loads" "$(realpath "$loaded")" \
      "$(realpath "$lib/libkvrouter.so.$version")"
    output=$("${run[@]}" "$exe") || fail "$label: ${exe#"$out"/} exited non-zero"
    [[ $output == *": OK" ]] || fail "$label: ${exe#"$out"/} printed '$output'"
    ok "$label: ${exe#"$out"/} runs: $output"
  done
}

echo "== (a) install into a staging prefix, consume it through pkg-config and CMake =="
stage=$tmp/stage
run_logged "$tmp/install-runtime.log" cmake --install "$build" --prefix "$stage" \
  --component Runtime
expect_same_lines "files of the Runtime component" "$(files_under "$stage")" "$runtime_files"
run_logged "$tmp/install-dev.log" cmake --install "$build" --prefix "$stage" \
  --component Development
expect_same_lines "files of Runtime + Development" "$(files_under "$stage")" \
  "$(LC_ALL=C sort <<<"$runtime_files
$dev_files")"

staged_lib=$stage/$libdir/libkvrouter.so.$version
expect_eq "SONAME" "$(readelf -d "$staged_lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')" \
  "libkvrouter.so.$soversion"
dynamic=$(readelf -d "$staged_lib")
if grep -qE '\((RPATH|RUNPATH)\)' <<<"$dynamic"; then
  fail "the installed library has an RPATH/RUNPATH"
fi
ok "the installed library has no RPATH/RUNPATH"
if grep -rlF -e "$src" -e "$tmp" "$stage/include" "$stage/$libdir/cmake" \
  "$stage/$libdir/pkgconfig"; then
  fail "installed headers, CMake or pkg-config files name the source, build or staging tree"
fi
ok "no source, build or staging path in the installed headers, CMake and pkg-config files"
# The exported target: the library and its include directory, and nothing a consumer would have
# to find first (no link dependency, no find_dependency).
private='INTERFACE_LINK_LIBRARIES|LINK_DEPENDENT|LINK_INTERFACE|absl|PkgConfig|libuv|zmq|nats'
private+='|xxhash|Threads|kvrouter_core|kvrouter_ingest'
leaks=$(grep -iE "$private" "$stage/$libdir"/cmake/kvrouter/kvrouterTargets*.cmake || true)
[ -z "$leaks" ] || fail "the exported target carries link dependencies: $leaks"
ok "kvrouter::kvrouter exports no link dependency (all private to the shared library)"
if grep -v '^ *#' "$stage/$libdir/cmake/kvrouter/kvrouterConfig.cmake" |
  grep 'find_dependency(' >/dev/null; then
  fail "kvrouterConfig.cmake calls find_dependency"
fi
ok "kvrouterConfig.cmake needs no other package"

# The version rule (SameMinorVersion while at 0.x), through CMake's own protocol for version files.
cat >"$tmp/version-rule.cmake" <<'EOF'
string(REPLACE "." ";" parts "${PACKAGE_FIND_VERSION}")
list(GET parts 0 PACKAGE_FIND_VERSION_MAJOR)
list(GET parts 1 PACKAGE_FIND_VERSION_MINOR)
include("${VERSION_FILE}")
if(PACKAGE_VERSION_COMPATIBLE)
  message(NOTICE "compatible")
else()
  message(NOTICE "incompatible")
endif()
EOF
major=${version%%.*}
minor=${soversion#*.}
for request in "$soversion:compatible" "$major.$((minor + 1)):incompatible" \
  "$((major + 1)).0:incompatible"; do
  expect_eq "find_package(kvrouter ${request%%:*}) against $version" \
    "$(cmake -DPACKAGE_FIND_VERSION="${request%%:*}" \
      -DVERSION_FILE="$stage/$libdir/cmake/kvrouter/kvrouterConfigVersion.cmake" \
      -P "$tmp/version-rule.cmake" 2>&1)" "${request#*:}"
done

consumers staged "$stage"

echo "== (b) exported symbols =="
# nm -D lists the version node of src/capi/kvrouter.map (KVR_<n>, type A) and every function
# as name@@KVR_<n>: the functions must be exactly those declared KVR_API in the header.
exports=$(nm -D --defined-only "$staged_lib")
others=$(awk '!($2 == "A" && $3 ~ /^KVR_[0-9]+$/) && $3 !~ /^kvr_[a-z0-9_]+@@KVR_[0-9]+$/' \
  <<<"$exports")
[ -z "$others" ] || fail "the library exports more than kvr_* functions: $others"
exported=$(awk '$3 ~ /^kvr_/ {sub(/@.*/, "", $3); print $3}' <<<"$exports" | LC_ALL=C sort)
declared=$(grep -oE 'KVR_API[^(]*\<kvr_[a-z0-9_]+\(' include/kvrouter.h |
  grep -oE 'kvr_[a-z0-9_]+\($' | tr -d '(' | LC_ALL=C sort -u)
expect_same_lines "kvr_* functions exported (all versioned, nothing else) and declared KVR_API" \
  "$exported" "$declared"

echo "== (c) Debian packages =="
rm -f "$build"/*.deb
run_logged "$tmp/cpack.log" bash -c "cd '$build' && cpack -G DEB"
runtime_deb=$build/${runtime_pkg}_${deb_version}_$arch.deb
dev_deb=$build/${dev_pkg}_${deb_version}_$arch.deb
for deb in "$runtime_deb" "$dev_deb"; do
  [ -f "$deb" ] || fail "cpack did not make $deb"
  echo "-- dpkg-deb --field $deb"
  dpkg-deb --field "$deb" | sed '/^$/d; s/^/   /'
done
field() { dpkg-deb --field "$1" "$2"; }
expect_eq "runtime Package" "$(field "$runtime_deb" Package)" "$runtime_pkg"
expect_eq "-dev Package" "$(field "$dev_deb" Package)" "$dev_pkg"
for deb in "$runtime_deb" "$dev_deb"; do
  name=$(field "$deb" Package)
  expect_eq "$name Version" "$(field "$deb" Version)" "$deb_version"
  expect_eq "$name Architecture" "$(field "$deb" Architecture)" "$arch"
  for f in Maintainer Homepage Description; do
    [ -n "$(field "$deb" "$f")" ] || fail "$name has no $f"
  done
  ok "$name has a Maintainer, a Homepage and a Description"
done
expect_eq "runtime Section" "$(field "$runtime_deb" Section)" libs
expect_eq "-dev Section" "$(field "$dev_deb" Section)" libdevel
expect_eq "-dev Depends" "$(field "$dev_deb" Depends)" "$runtime_pkg (= $deb_version)"
runtime_depends=$(field "$runtime_deb" Depends)
for dep in 'libabsl[0-9]+' libuv1 libzmq5 'libnats[0-9.]+' 'libstdc\+\+6' libc6; do
  grep -qE "(^|, )$dep \(>= [^)]+\)(,|$)" <<<"$runtime_depends" ||
    fail "runtime Depends lacks $dep (from dpkg-shlibdeps): $runtime_depends"
done
ok "runtime Depends has libabsl, libuv1, libzmq5, libnats, libstdc++6, libc6 from dpkg-shlibdeps"
expect_eq "runtime shlibs" "$(dpkg-deb --info "$runtime_deb" shlibs)" \
  "libkvrouter $soversion $runtime_pkg (>= $deb_version)"
grep -qx 'activate-noawait ldconfig' <(dpkg-deb --info "$runtime_deb" triggers) ||
  fail "the runtime package has no ldconfig trigger"
ok "the runtime package activates the ldconfig trigger"
deb_files() {  # deb_files DEB: its non-directory entries, without ./usr/
  dpkg-deb --contents "$1" | awk '$1 !~ /^d/ {print $6}' | sed 's|^\./usr/||' | LC_ALL=C sort
}
expect_same_lines "files of $runtime_pkg" "$(deb_files "$runtime_deb")" "$runtime_files"
expect_same_lines "files of $dev_pkg" "$(deb_files "$dev_deb")" "$dev_files"

root=$tmp/root
dpkg-deb -x "$runtime_deb" "$root"
dpkg-deb -x "$dev_deb" "$root"
packaged_lib=$root/usr/$libdir/libkvrouter.so.$version
expect_eq "the packaged kvrouter.pc's prefix" \
  "$(sed -n 's/^prefix=//p' "$root/usr/$libdir/pkgconfig/kvrouter.pc")" /usr
[[ $(file -L "$packaged_lib") == *", stripped"* ]] || fail "the packaged library is not stripped"
ok "the packaged library is stripped"
[ "$(nm -D --defined-only "$packaged_lib")" = "$exports" ] ||
  fail "the packaged library's dynamic symbols differ from the installed one's"
ok "the packaged library exports the same symbols as the installed one"
if grep -rlF -e "$src" -e "$tmp" "$root"; then
  fail "the packages name the source or build tree"
fi
ok "no source or build path anywhere in the packages"

if [ "${KVR_PACKAGE_INSTALL:-0}" = 1 ]; then
  echo "-- installing $runtime_pkg and $dev_pkg into the system (dpkg -i)"
  for p in "$runtime_pkg" "$dev_pkg"; do
    state=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
    [ -z "$state" ] || [ "$state" = not-installed ] ||
      fail "$p is already on this machine ($state); remove it first (dpkg --purge $p)"
  done
  while read -r f; do
    [ ! -e "/usr/$f" ] && [ ! -L "/usr/$f" ] ||
      fail "/usr/$f exists already; dpkg -i would overwrite it, and removing would delete it"
  done <<<"$runtime_files
$dev_files"
  ok "neither package nor any of their files is on the machine yet"
  installed_by_us=1
  run_logged "$tmp/dpkg-install.log" dpkg -i "$runtime_deb" "$dev_deb"
  for p in "$runtime_pkg" "$dev_pkg"; do
    expect_eq "dpkg: $p" "$(dpkg-query -W -f='${db:Status-Status} ${Version}' "$p")" \
      "installed $deb_version"
  done
  # (Output captured first: with pipefail, grep -q ending early would fail the pipeline.)
  cache=$(ldconfig -p)
  grep -qF "libkvrouter.so.$soversion (" <<<"$cache" ||
    fail "ldconfig's cache does not list libkvrouter.so.$soversion"
  ok "ldconfig's cache lists libkvrouter.so.$soversion"

  consumers system /usr

  # --purge, not -r: a package with maintainer scripts (the runtime's postrm) stays known to
  # dpkg after -r, in state config-files; purging leaves dpkg's database as it was.
  echo "-- removing them again (dpkg --purge)"
  run_logged "$tmp/dpkg-remove.log" dpkg --purge "$dev_pkg" "$runtime_pkg"
  installed_by_us=0
  for p in "$runtime_pkg" "$dev_pkg"; do
    state=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
    [ -z "$state" ] || [ "$state" = not-installed ] || fail "$p is still known to dpkg: $state"
  done
  while read -r f; do
    [ ! -e "/usr/$f" ] && [ ! -L "/usr/$f" ] || fail "/usr/$f is left after dpkg --purge"
  done <<<"$runtime_files
$dev_files"
  cache=$(ldconfig -p)
  if grep -qF "libkvrouter.so.$soversion (" <<<"$cache"; then
    fail "ldconfig's cache still lists libkvrouter.so.$soversion"
  fi
  ok "packages purged: unknown to dpkg, no file left, not in ldconfig's cache"
else
  echo "-- not installing into the system (that needs root and KVR_PACKAGE_INSTALL=1):" \
    "consuming the packages extracted into $root"
  consumers extracted "$root/usr"
fi

echo "packaging: $checks checks passed"
