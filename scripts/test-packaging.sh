#!/usr/bin/env bash
# Packaging test: kvrouter as Debian packages. dpkg-buildpackage builds the source package and
# the binary packages (debian/: libkvrouter<M.m>, libkvrouter-dev, kvrouter and their -dbgsym)
# from a clean copy of the checkout in build/deb (scripts/package-build.sh), then:
#  (a) the library's CMake install components (Runtime, Development, and Tools: the kvrouter
#      command) are installed from that build tree into a staging prefix; the files and the
#      exported CMake target are checked, and tests/package/consumer.c is built against the
#      prefix twice, through pkg-config and through CMake's find_package, and run;
#  (a2) the component Static likewise: libkvrouter.a must be self-contained (every kvrouter
#      symbol it refers to, it defines; the header's kvr_* functions), pkg-config --static must
#      list its private dependencies, and the consumer, linked statically through pkg-config
#      --static and through CMake's kvrouter::kvrouter_static, must load no libkvrouter.so and
#      run; the same static consumers are built against the packages in (e) and (f);
#  (b) the library must export exactly the kvr_* functions of include/kvrouter.h, under the
#      version node of its SONAME;
#  (c) abidiff compares the library's ABI with the committed baseline of the last release
#      (abi/libkvrouter-<major.minor>.abi): any change but new functions and fields appended to
#      versioned structs fails, and so does a baseline of another SONAME (after a SONAME bump,
#      scripts/abi-baseline.sh records the new one);
#  (d) the packages: lintian reports no error, warning or informational tag that the overrides in
#      debian/ do not justify; the source package unpacks to exactly the tree that was built;
#      every binary package has the expected fields, dependencies, control files (the symbols file
#      checked against the library with dpkg-gensymbols, the ldconfig trigger, no maintainer
#      scripts; libkvrouter-dev depends on the static library's -dev packages), contents
#      (libkvrouter.a self-contained) and hardening, and each -dbgsym package the debug
#      information of its binary;
#  (e) the binary packages are installed with dpkg --root into a fresh root that holds nothing
#      else; the consumer (pkg-config and CMake; shared and static) and the installed C examples
#      are built against it and run, and so is its kvrouter command; then the packages are purged
#      and nothing may be left but dpkg's empty database;
#  (f) scripts/apt-repo.sh makes the apt repository (build/apt). As root with
#      KVR_PACKAGE_INSTALL=1 (CI, on a throwaway machine), apt-get installs libkvrouter-dev and
#      kvrouter from it into the system; the consumer (shared and static) is built against /usr
#      and run, and /usr/bin/kvrouter replays a slice of the bundled trace; then apt-get purges
#      them and the system must be as before. Otherwise apt-get only simulates that installation
#      from the repository.
#  (g) kvrouterd's package: its fields, files, conffile, maintainer scripts (the system user
#      from its sysusers.d file, the systemd unit enabled), hardening and -dbgsym; then the
#      unit's ExecStart is run as the unit says (its User and Group, its RuntimeDirectory, the
#      packaged configuration with a free port): the API answers /healthz and routes, SIGHUP
#      (ExecReload) reloads, SIGTERM stops it with status 0. As root with KVR_PACKAGE_INSTALL=1
#      that is the package apt-get installed (systemd-analyze verify checks the unit; then it is
#      purged); otherwise the extracted package, as the calling user.
# Ends with "packaging: N checks passed". Needs dpkg-dev, debhelper, lintian, apt-utils, file,
# pkg-config, binutils and abigail-tools, and the Build-Depends of debian/control
# (scripts/install-deps.sh installs them all).
set -eEuo pipefail
cd "$(dirname "$0")/.."
if [ "${KVR_PACKAGE_INSTALL:-0}" = 1 ] && [ "$(id -u)" != 0 ]; then
  echo "test-packaging: KVR_PACKAGE_INSTALL=1 installs into the system: run as root" >&2
  exit 1
fi

src=$PWD
# Only what this script passes decides where the consumer finds kvrouter.
unset PKG_CONFIG_PATH CMAKE_PREFIX_PATH LD_LIBRARY_PATH kvrouter_DIR kvrouter_ROOT

tmp=$(mktemp -d /tmp/pkg-test.XXXXXX)
installed_by_us=0
packages=()
cleanup() {
  if [ "$installed_by_us" = 1 ]; then
    echo "test-packaging: removing ${packages[*]} again" >&2
    dpkg --purge "${packages[@]}" >/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'echo "test-packaging: FAILED at line $LINENO: $BASH_COMMAND" >&2' ERR

# ok, fail, expect_eq, expect_same_lines, run_logged; $checks counts the passed checks.
source scripts/lib/checks.sh

echo "== build: dpkg-buildpackage (source and binary packages) in build/deb =="
source scripts/package-build.sh
start=$SECONDS
build_debian_packages  # sets deb_dir, source_dir, build, version, soversion, deb_version, ...
echo "-- built in $((SECONDS - start)) s: $(cd "$deb_dir" && ls -- *.dsc *.deb | tr '\n' ' ')"
runtime_pkg=libkvrouter$soversion
dev_pkg=libkvrouter-dev
tool_pkg=kvrouter
data_pkg=kvrouter-data
# The library's and the tool's packages; kvrouterd's (a service, with maintainer scripts) is
# checked on its own in (g).
packages=("$tool_pkg" "$data_pkg" "$dev_pkg" "$runtime_pkg")
service_pkg=kvrouterd
libdir=lib/$multiarch
echo "kvrouter $version: SONAME libkvrouter.so.$soversion, packages $runtime_pkg, $dev_pkg," \
  "$tool_pkg and $data_pkg $deb_version ($arch), libdir $libdir"

# What each CMake install component installs, relative to the prefix, as debian/rules configures
# the build (the documentation in share/doc/libkvrouter-dev, CMAKE_BUILD_TYPE None).
runtime_files="$libdir/libkvrouter.so.$soversion
$libdir/libkvrouter.so.$version"
# The header, and what it cites: the README, docs/ and the schemas (sorted as files_under does).
docs=$(cd "$src" && ls README.md docs/*.md | sed 's|^docs/||')
dev_files=$(LC_ALL=C sort <<LIST
include/kvrouter.h
include/kvrouter_version.h
$(sed 's|^|share/doc/libkvrouter-dev/|' <<<"$docs")
$(cd "$src" && ls schema/*.fbs | sed 's|^|share/kvrouter/|')
$libdir/cmake/kvrouter/kvrouterConfig.cmake
$libdir/cmake/kvrouter/kvrouterConfigVersion.cmake
$libdir/cmake/kvrouter/kvrouterTargets-none.cmake
$libdir/cmake/kvrouter/kvrouterTargets.cmake
$libdir/libkvrouter.so
$libdir/pkgconfig/kvrouter.pc
LIST
)
# The component Static: the archive and its CMake target (in libkvrouter-dev, with Development).
static_files="$libdir/cmake/kvrouter/kvrouterStaticTargets-none.cmake
$libdir/cmake/kvrouter/kvrouterStaticTargets.cmake
$libdir/libkvrouter.a"
# Every bundled trace (data/<dir>/*.jsonl or *.csv) is installed with the kvrouter command
# (component Tools; the package kvrouter-data).
traces=$(cd data && ls -- */*.jsonl */*.csv | LC_ALL=C sort)
data_files=$(LC_ALL=C sort <<LIST
share/kvrouter/data/README.md
$(sed 's|^|share/kvrouter/data/|' <<<"$traces")
LIST
)
tools_files=$(LC_ALL=C sort <<LIST
bin/kvrouter
share/man/man1/kvrouter.1
$data_files
LIST
)
# What each binary package holds under /usr: its components' files, and what debhelper adds
# (changelog, copyright, the lintian overrides of a package that has debian/PACKAGE.lintian-
# overrides, compressed manual pages; the documentation pages may be compressed too, and are
# compared without .gz).
debian_files() {  # debian_files PACKAGE
  printf '%s\n' "share/doc/$1/changelog.Debian.gz" "share/doc/$1/copyright"
  [ ! -f "debian/$1.lintian-overrides" ] || printf '%s\n' "share/lintian/overrides/$1"
}
runtime_deb_files=$(LC_ALL=C sort <<<"$runtime_files
$(debian_files "$runtime_pkg")")
dev_deb_files=$(LC_ALL=C sort <<<"$dev_files
$static_files
$(debian_files "$dev_pkg")
$(sed 's|^examples/c/|share/doc/libkvrouter-dev/examples/|' debian/libkvrouter-dev.examples)")
tool_deb_files=$(LC_ALL=C sort <<<"bin/kvrouter
share/man/man1/kvrouter.1.gz
$(debian_files "$tool_pkg")
$(sed 's|^docs/|share/doc/kvrouter/|' debian/kvrouter.docs)")
data_deb_files=$(LC_ALL=C sort <<<"$data_files
$(debian_files "$data_pkg")")
all_deb_files=$(LC_ALL=C sort <<<"$runtime_deb_files
$dev_deb_files
$tool_deb_files
$data_deb_files")
files_under() {  # files_under DIR: every non-directory below DIR, relative, sorted
  (cd "$1" && find . ! -type d | sed 's|^\./||' | LC_ALL=C sort)
}

# consumers LABEL PREFIX: builds tests/package/consumer.c against the kvrouter installed in
# PREFIX (which holds include/ and lib/<multiarch>/), through pkg-config and through CMake, checks
# that each build found that installation and loads its library, and runs both. The packages'
# kvrouter.pc says prefix=/usr: installed elsewhere (a dpkg --root), pkg-config is told the real
# prefix.
consumers() {
  local label=$1 prefix=$2
  local lib=$prefix/$libdir out=$tmp/consumer-$1
  local -a pc=(pkg-config) cmake_args=() run=()
  if [ "$prefix" != /usr ]; then
    pc=(env PKG_CONFIG_PATH="$lib/pkgconfig" pkg-config)
    [ "$label" = staged ] || pc+=(--define-variable=prefix="$prefix")
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

# static_consumers LABEL PREFIX: builds tests/package/consumer.c against the static library
# libkvrouter.a installed in PREFIX, through pkg-config --static (with -l:libkvrouter.a in place
# of -lkvrouter, since libkvrouter.so is beside it) and through CMake's
# find_package(kvrouter COMPONENTS Static) + kvrouter::kvrouter_static; checks that neither
# program loads a libkvrouter.so, and runs both. Abseil, xxHash, libuv, libzmq and libnats come
# from the machine's development libraries (libkvrouter-dev depends on their packages).
static_consumers() {
  local label=$1 prefix=$2
  local lib=$prefix/$libdir out=$tmp/consumer-static-$1
  local -a pc=(pkg-config) cmake_args=()
  if [ "$prefix" != /usr ]; then
    pc=(env PKG_CONFIG_PATH="$lib/pkgconfig" pkg-config)
    [ "$label" = staged ] || pc+=(--define-variable=prefix="$prefix")
    cmake_args=(-DCMAKE_PREFIX_PATH="$prefix")
  fi
  mkdir -p "$out"
  local flags dep
  flags=$("${pc[@]}" --static --libs kvrouter | sed 's/ *$//')
  for dep in -labsl_status -lxxhash -luv -lzmq -lnats -lstdc++; do
    [[ " $flags " == *" $dep "* ]] ||
      fail "$label: pkg-config --static --libs kvrouter lacks $dep: $flags"
  done
  ok "$label: pkg-config --static --libs kvrouter lists the private dependencies (Abseil," \
    "xxHash, libuv, libzmq, libnats, the C++ runtime)"
  # shellcheck disable=SC2086,SC2046  # pkg-config's flags are meant to be split
  run_logged "$out/cc.log" cc -std=c11 -pedantic -Wall -Wextra -Werror tests/package/consumer.c \
    $("${pc[@]}" --cflags kvrouter) ${flags/-lkvrouter /-l:libkvrouter.a } \
    -o "$out/consumer-pkgconfig"
  ok "$label: static consumer built with cc \$(pkg-config --static --libs kvrouter)," \
    "-l:libkvrouter.a"
  run_logged "$out/cmake.log" cmake -S tests/package -B "$out/cmake" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DKVR_REQUIRED_VERSION="$soversion" -DKVR_LINK_STATIC=ON \
    "${cmake_args[@]}"
  expect_eq "$label: find_package(kvrouter $soversion COMPONENTS Static) found" \
    "$(sed -n 's/^kvrouter_DIR:PATH=//p' "$out/cmake/CMakeCache.txt")" "$lib/cmake/kvrouter"
  run_logged "$out/cmake-build.log" cmake --build "$out/cmake"
  ok "$label: static consumer built with find_package(kvrouter COMPONENTS Static) +" \
    "kvrouter::kvrouter_static"
  local exe output
  for exe in "$out/consumer-pkgconfig" "$out/cmake/consumer"; do
    if ldd "$exe" | grep -F libkvrouter; then
      fail "$label: ${exe#"$out"/} loads libkvrouter.so: it should hold the archive's code"
    fi
    output=$("$exe") || fail "$label: ${exe#"$out"/} (static) exited non-zero"
    [[ $output == *": OK" ]] || fail "$label: ${exe#"$out"/} (static) printed '$output'"
    ok "$label: ${exe#"$out"/}, linked statically (no libkvrouter.so loaded), runs: $output"
  done
}

# static_archive LABEL ARCHIVE: libkvrouter.a is self-contained: every kvrouter symbol it refers
# to, it defines (the core, wire and ingest objects are inside), and so are exactly the kvr_*
# functions the header declares.
static_archive() {
  local label=$1 archive=$2 defined missing
  defined=$(nm -g --defined-only "$archive" 2>/dev/null | awk 'NF == 3 {print $3}' |
    LC_ALL=C sort -u)
  missing=$(nm -g --undefined-only "$archive" 2>/dev/null | awk '{print $NF}' |
    grep -E '^(_ZN8kvrouter|_ZNK8kvrouter|kvr_)' | LC_ALL=C sort -u |
    LC_ALL=C comm -23 - <(echo "$defined"))
  [ -z "$missing" ] || fail "$label: libkvrouter.a refers to kvrouter symbols it lacks: $missing"
  ok "$label: libkvrouter.a defines every kvrouter symbol it refers to"
  expect_same_lines "$label: kvr_* functions defined by libkvrouter.a" \
    "$(grep -E '^kvr_' <<<"$defined")" "$declared_api"
}

# replay_tool LABEL PREFIX: the kvrouter command installed in PREFIX (bin/, with the library in
# lib/<multiarch>/ and the traces in share/kvrouter/data/) reports the library's version and
# replays the first 300 requests of each bundled trace under two policies.
replay_tool() {
  local label=$1 prefix=$2
  local -a run=()
  [ "$prefix" = /usr ] || run=(env LD_LIBRARY_PATH="$prefix/$libdir")
  local exe=$prefix/bin/kvrouter data=$prefix/share/kvrouter/data out=$tmp/replay-$1
  local loaded
  loaded=$("${run[@]}" ldd "$exe" | awk '$1 == "libkvrouter.so.'"$soversion"'" {print $3}')
  expect_eq "$label: kvrouter loads" "$(realpath "$loaded")" \
    "$(realpath "$prefix/$libdir/libkvrouter.so.$version")"
  expect_eq "$label: kvrouter version" "$("${run[@]}" "$exe" version)" "kvrouter $version"
  local trace
  while read -r trace; do
    run_logged "$out.log" "${run[@]}" "$exe" replay --trace="$data/$trace" \
      --policies=kvrouter,round-robin --max-requests=300 --workers=4 --jobs=1 \
      --progress=false --azure-shared-prefix-groups=4
    grep -qE '^kvrouter +[0-9.]+ %' "$out.log" && grep -qE '^round-robin +[0-9.]+ %' "$out.log" ||
      { cat "$out.log" >&2; fail "$label: kvrouter replay of $trace printed no results"; }
    ok "$label: kvrouter replay --trace=$data/$trace (300 requests): a row per policy"
  done <<<"$traces"
}

# The kvr_* functions the header declares (KVR_API), for the static archive and (b).
declared_api=$(grep -oE 'KVR_API[^(]*\<kvr_[a-z0-9_]+\(' include/kvrouter.h |
  grep -oE 'kvr_[a-z0-9_]+\($' | tr -d '(' | LC_ALL=C sort -u)

echo "== (a) CMake components installed into a staging prefix, consumed through pkg-config and CMake =="
stage=$tmp/stage
run_logged "$tmp/install-runtime.log" cmake --install "$build" --prefix "$stage" \
  --component Runtime
expect_same_lines "files of the Runtime component" "$(files_under "$stage")" "$runtime_files"
run_logged "$tmp/install-dev.log" cmake --install "$build" --prefix "$stage" \
  --component Development
expect_same_lines "files of Runtime + Development" "$(files_under "$stage")" \
  "$(LC_ALL=C sort <<<"$runtime_files
$dev_files")"
run_logged "$tmp/install-tools.log" cmake --install "$build" --prefix "$stage" \
  --component Tools
expect_same_lines "files of Runtime + Development + Tools" "$(files_under "$stage")" \
  "$(LC_ALL=C sort <<<"$runtime_files
$dev_files
$tools_files")"
while read -r trace; do
  cmp -s "$stage/share/kvrouter/data/$trace" "data/$trace" ||
    fail "the installed $trace is not data/$trace"
done <<<"$traces"
ok "the installed traces are those of data/"

staged_lib=$stage/$libdir/libkvrouter.so.$version
expect_eq "SONAME" "$(readelf -d "$staged_lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')" \
  "libkvrouter.so.$soversion"
for elf in "$staged_lib" "$stage/bin/kvrouter"; do
  if readelf -d "$elf" | grep -qE '\((RPATH|RUNPATH)\)'; then
    fail "the installed ${elf#"$stage"/} has an RPATH/RUNPATH"
  fi
done
ok "the installed library and kvrouter command have no RPATH/RUNPATH"
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

echo "== (a2) the static library (component Static): self-contained, consumed through pkg-config --static and CMake =="
run_logged "$tmp/install-static.log" cmake --install "$build" --prefix "$stage" --component Static
expect_same_lines "files of the Static component" \
  "$(files_under "$stage" | grep -vxF -f <(LC_ALL=C sort <<<"$runtime_files
$dev_files
$tools_files"))" "$static_files"
if grep -lF -e "$src" -e "$tmp" "$stage/$libdir"/cmake/kvrouter/kvrouterStaticTargets*.cmake; then
  fail "the static CMake targets name the source, build or staging tree"
fi
ok "no source, build or staging path in the static CMake targets"
static_archive staged "$stage/$libdir/libkvrouter.a"
static_consumers staged "$stage"

echo "== (b) exported symbols =="
# nm -D lists the version node of src/capi/kvrouter.map (KVR_<major.minor>, type A) and every
# function as name@@KVR_<major.minor>: the node must be the SONAME's, and the functions exactly
# those declared KVR_API in the header.
node=KVR_$soversion
exports=$(nm -D --defined-only "$staged_lib")
others=$(awk -v node="$node" '!($2 == "A" && $3 == node) &&
  !($3 ~ /^kvr_[a-z0-9_]+@@/ && substr($3, index($3, "@@") + 2) == node)' <<<"$exports")
[ -z "$others" ] || fail "the library exports more than kvr_* functions under $node: $others"
exported=$(awk '$3 ~ /^kvr_/ {sub(/@.*/, "", $3); print $3}' <<<"$exports" | LC_ALL=C sort)
expect_same_lines "kvr_* functions exported (all under $node, nothing else) and declared KVR_API" \
  "$exported" "$declared_api"

echo "== (c) ABI: abidiff against the baseline of the last release =="
for tool in abidw abidiff; do
  command -v "$tool" >/dev/null || fail "no $tool: install abigail-tools (scripts/install-deps.sh)"
done
# The new library, described with the baseline's abidw options (kept in $build to look at).
current=$build/libkvrouter-$soversion.abi
run_logged "$tmp/abidw.log" scripts/abi-baseline.sh --dump "$staged_lib" "$current"
suppressions=abi/libkvrouter.abignore
abi_attr() {  # abi_attr ATTRIBUTE FILE: an attribute of the abi-corpus element
  sed -n "1s/.*<abi-corpus [^>]*\<$1='\([^']*\)'.*/\1/p" "$2"
}
baseline=abi/libkvrouter-$soversion.abi
if [ ! -f "$baseline" ]; then
  # The SONAME changed since the baseline was recorded (or there never was one). An older
  # release's baseline says nothing about what this SONAME promises, and passing without a
  # baseline would leave the new SONAME unguarded until somebody noticed: so the bump has to
  # bring its baseline along. What changed since the old one is shown for the record (the list
  # of breaks in docs/api-stability.md), with the old SONAME and version node renamed to the new
  # ones: otherwise every function shows as removed and added again.
  for old in abi/libkvrouter-*.abi; do
    [ -f "$old" ] || continue
    old_node=$(grep -m1 -o "<elf-symbol [^>]* version='[^']*'" "$old" |
      sed "s/.*version='//; s/'$//")
    sed -e "s/'$old_node'/'$node'/g; s/@@$old_node'/@@$node'/g" \
      -e "1s/soname='[^']*'/soname='libkvrouter.so.$soversion'/" "$old" >"$tmp/old-renamed.abi"
    echo "-- abidiff $old $current (the ABI changes since that baseline, $old_node taken as $node)"
    { abidiff "$tmp/old-renamed.abi" "$current" || true; } >"$tmp/since-old.txt" 2>&1
    [ -s "$tmp/since-old.txt" ] || echo "(no change)" >"$tmp/since-old.txt"
    sed 's/^/   /' "$tmp/since-old.txt"
    fail "the ABI baseline is $old (SONAME $(abi_attr soname "$old")), this library is" \
      "libkvrouter.so.$soversion: after a SONAME bump, record its ABI with" \
      "scripts/abi-baseline.sh and commit $baseline"
  done
  fail "no ABI baseline $baseline: record it with scripts/abi-baseline.sh (on the release commit)"
fi
expect_eq "SONAME in $baseline" "$(abi_attr soname "$baseline")" "libkvrouter.so.$soversion"
if [ "$(abi_attr architecture "$baseline")" != "$(abi_attr architecture "$current")" ]; then
  # Type sizes and offsets are per architecture; the baseline is recorded on CI's.
  echo "-- not compared: $baseline describes $(abi_attr architecture "$baseline"), this build" \
    "is $(abi_attr architecture "$current")"
else
  # Fields appended to a versioned struct (one that begins with struct_size in the baseline) are
  # compatible: cut each such struct of the new description back to its baseline size, so that
  # abidiff sees an unchanged struct exactly when the old layout is a prefix of the new one.
  # (libabigail's has_data_member_inserted_at = end would let in-place changes pass too:
  # abi/libkvrouter.abignore.) Relies on abidw's one element per line; should that change, the
  # appended fields show up as insertions and fail, never the other way round.
  prefix=$tmp/current-prefix.abi
  awk -v appended="$tmp/appended.txt" '
    function attr(line, name) {
      if (!match(line, name "=\047[^\047]*\047")) return ""
      return substr(line, RSTART + length(name) + 2, RLENGTH - length(name) - 3)
    }
    FNR == NR {  # the baseline: the size of every versioned struct
      if ($0 ~ /^ *<class-decl / && $0 !~ /\/> *$/) {
        cls = attr($0, "name"); size = attr($0, "size-in-bits"); first = 0
      } else if (cls != "" && $0 ~ /^ *<data-member /) {
        first = (attr($0, "layout-offset-in-bits") == "0")
      } else if (cls != "" && first && $0 ~ /^ *<var-decl /) {
        if (attr($0, "name") == "struct_size") versioned[cls] = size
        first = 0
      } else if ($0 ~ /^ *<\/class-decl>/) cls = ""
      next
    }
    $0 ~ /^ *<class-decl / && $0 !~ /\/> *$/ {
      cls = attr($0, "name"); cut = ""; names = ""
      if ((cls in versioned) && attr($0, "size-in-bits") + 0 > versioned[cls] + 0) {
        cut = versioned[cls]; grown = attr($0, "size-in-bits")
        sub(/size-in-bits=\047[0-9]+\047/, "size-in-bits=\047" cut "\047")
      }
    }
    cut != "" && $0 ~ /^ *<data-member / && attr($0, "layout-offset-in-bits") + 0 >= cut + 0 {
      skip = 1
    }
    skip {
      if ($0 ~ /^ *<var-decl /) names = names " " attr($0, "name")
      if ($0 ~ /^ *<\/data-member>/) skip = 0
      next
    }
    $0 ~ /^ *<\/class-decl>/ {
      if (cut != "")
        printf "struct %s: %d -> %d bytes, appended:%s\n", cls, cut / 8, grown / 8, names >appended
      cls = ""; cut = ""
    }
    { print }
  ' "$baseline" "$current" >"$prefix"
  # abidiff's exit status is a bit field: 1 ABIDIFF_ERROR, 2 ABIDIFF_USAGE_ERROR, 4
  # ABIDIFF_ABI_CHANGE, 8 ABIDIFF_ABI_INCOMPATIBLE_CHANGE. Libabigail 2.2 sets 8 only for a
  # removed function or variable; a changed parameter type or struct layout is 4 alone ("a
  # human needs to review"). With additions suppressed and appends cut, nothing compatible is
  # left, so 4 fails too. (Both inputs are abidw's descriptions, already limited to the public
  # header, so --headers-dir1/2 would add nothing.)
  status=0
  abidiff --suppressions "$suppressions" "$baseline" "$prefix" >"$tmp/abidiff.txt" 2>&1 ||
    status=$?
  if [ "$status" != 0 ]; then
    if ((status & 1)); then
      sed 's/^/   /' "$tmp/abidiff.txt" >&2
      fail "abidiff could not compare $baseline with $current (exit $status)"
    fi
    # The report against the uncut description shows each struct as it changed (cut, a field
    # that a change pushed past the struct's old end would show as deleted).
    { abidiff --suppressions "$suppressions" "$baseline" "$current" || true; } 2>&1 |
      sed 's/^/   /' >&2
    ((status & 8)) && fail "incompatible ABI change (abidiff exit $status: a function or" \
      "variable removed) with the SONAME still libkvrouter.so.$soversion: restore it, or bump" \
      "the SONAME (docs/api-stability.md)"
    fail "ABI change (abidiff exit $status) with the SONAME still libkvrouter.so.$soversion:" \
      "a changed function or a struct changed other than by fields appended to a versioned" \
      "struct; undo it, or bump the SONAME (docs/api-stability.md)"
  fi
  ok "abidiff: libkvrouter.so.$soversion keeps the ABI of $baseline" \
    "($(grep -c '<elf-symbol ' "$baseline") functions)"
  # What is new since the baseline, compatibly: for the record until the next release records it.
  abidiff "$baseline" "$prefix" >"$tmp/additions.txt" 2>&1 || true
  if grep -q '^ *\[A\]' "$tmp/additions.txt" || [ -s "$tmp/appended.txt" ]; then
    echo "-- compatible additions since $baseline (recorded at the next release by" \
      "scripts/abi-baseline.sh):"
    { grep '^ *\[A\]' "$tmp/additions.txt" || true; } |
      sed "s/^ *\[A\] 'function \(.*\)'  *{\(.*\)}$/   function \1 (\2)/"
    { cat "$tmp/appended.txt" 2>/dev/null || true; } | sed 's/^/   /'
  fi
fi

echo "== (d) the Debian packages =="
echo "-- lintian $(lintian --version | awk '{print $2}') on $(basename "$changes") (source, binary" \
  "and -dbgsym packages)"
# Every override must say why: each group of override lines follows a comment.
for overrides in debian/*.lintian-overrides debian/source/lintian-overrides; do
  [ -f "$overrides" ] || continue
  unjustified=$(awk '/^#/ {c = 1; next} /^[[:space:]]*$/ {c = 0; next} !c {print FILENAME ":" FNR ": " $0}' \
    "$overrides")
  [ -z "$unjustified" ] || fail "lintian overrides without a comment saying why: $unjustified"
done
ok "every lintian override in debian/ comes with a comment that justifies it"
# An error (E:), a warning (W:) or an informational tag (I:) fails, unless an override (with its
# reason) covers it; pedantic tags (P:) are shown. Overridden tags are listed too (O:, with the
# override's comment as N: lines), for the record; since lintian then counts them against
# --fail-on, the verdict is read from the tags it prints, and its exit status only says
# whether it ran.
lintian --fail-on none --display-info --pedantic --show-overrides "$changes" \
  >"$tmp/lintian.log" 2>&1 || fail "lintian could not check $changes: $(cat "$tmp/lintian.log")"
grep -v '^running with root privileges is not recommended!$' "$tmp/lintian.log" |
  sed 's/^/   /' || true
if grep -qE '^[EWI]: ' "$tmp/lintian.log"; then
  fail "lintian: the errors (E:), warnings (W:) or informational tags (I:) above; fix them, or" \
    "override one only with a comment saying why (debian/*lintian-overrides)"
fi
ok "lintian: no error, warning or informational tag but the" \
  "$(grep -c '^O: ' "$tmp/lintian.log" || true) overridden (and justified) ones"

# The source package.
dsc=$deb_dir/kvrouter_$deb_version.dsc
expect_eq "source package format" "$(sed -n 's/^Format: //p' "$dsc")" "3.0 (quilt)"
expect_eq "source package binaries" "$(sed -n 's/^Binary: //p' "$dsc")" \
  "$runtime_pkg, $dev_pkg, $tool_pkg, $data_pkg, $service_pkg"
orig=$deb_dir/kvrouter_$version.orig.tar.xz
in_orig=$(tar -tJf "$orig" | grep -c "^kvrouter-$version/debian/" || true)
expect_eq "files under debian/ in $(basename "$orig")" "$in_orig" 0
run_logged "$tmp/dpkg-source.log" dpkg-source --no-check -x "$dsc" "$tmp/source"
# The unpacked source against the checkout that was exported (git's view of the working tree).
manifest() {  # manifest DIR: "mode checksum path" of every file the checkout has, in DIR
  (cd "$1" && git -C "$src" ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do
      [[ -e $src/$f || -L $src/$f ]] || continue
      if [[ -e $f || -L $f ]]; then
        printf '%s %s %s\n' "$(stat -c %a "$f")" "$(sha256sum <"$f" | cut -d' ' -f1)" "$f"
      else
        printf 'missing %s\n' "$f"
      fi
    done)
}
expect_same_lines "files of the source package (mode, sha256) and of the checkout" \
  "$(manifest "$tmp/source")" "$(manifest "$src")"
extra=$(cd "$tmp/source" && find . ! -type d ! -path './.pc/*' | sed 's|^\./||' | LC_ALL=C sort |
  comm -23 - <(git -C "$src" ls-files --cached --others --exclude-standard | LC_ALL=C sort))
[ -z "$extra" ] || fail "the source package has files the checkout has not: $extra"
ok "the source package unpacks (dpkg-source -x) to exactly the checkout's files"

# The binary packages.
runtime_deb=$deb_dir/${runtime_pkg}_${deb_version}_$arch.deb
dev_deb=$deb_dir/${dev_pkg}_${deb_version}_$arch.deb
tool_deb=$deb_dir/${tool_pkg}_${deb_version}_$arch.deb
data_deb=$deb_dir/${data_pkg}_${deb_version}_all.deb
debs=("$runtime_deb" "$dev_deb" "$tool_deb" "$data_deb")
for deb in "${debs[@]}"; do
  [ -f "$deb" ] || fail "dpkg-buildpackage did not make $deb"
  echo "-- dpkg-deb --field $(basename "$deb")"
  dpkg-deb --field "$deb" | sed '/^$/d; s/^/   /'
done
field() { dpkg-deb --field "$1" "$2"; }
for deb in "${debs[@]}"; do
  name=$(field "$deb" Package)
  expect_eq "$name Version" "$(field "$deb" Version)" "$deb_version"
  expect_eq "$name Architecture" "$(field "$deb" Architecture)" \
    "$([ "$deb" = "$data_deb" ] && echo all || echo "$arch")"
  # (No Source field: the source package has the binary package's name.)
  source_field=$(field "$deb" Source)
  expect_eq "$name Source" "${source_field:-$name}" kvrouter
  for f in Maintainer Homepage Description; do
    [ -n "$(field "$deb" "$f")" ] || fail "$name has no $f"
  done
  ok "$name has a Maintainer, a Homepage and a Description"
  # Policy 3.4.1: the synopsis stays under 80 characters, and so does every line of the
  # extended description (lintian only warns from 80 on).
  long=$(field "$deb" Description | awk 'length > 79')
  [ -z "$long" ] || fail "$name: description lines over 79 characters: $long"
  # No maintainer scripts: the ldconfig trigger replaces them (below).
  scripts=$(dpkg-deb --ctrl-tarfile "$deb" | tar -tf - |
    grep -E '^\./(preinst|postinst|prerm|postrm|config)$' || true)
  [ -z "$scripts" ] || fail "$name has maintainer scripts: $scripts"
  ok "$name: description lines under 80 characters, no maintainer scripts"
done
expect_eq "runtime Package" "$(field "$runtime_deb" Package)" "$runtime_pkg"
expect_eq "-dev Package" "$(field "$dev_deb" Package)" "$dev_pkg"
expect_eq "tool Package" "$(field "$tool_deb" Package)" "$tool_pkg"
expect_eq "data Package" "$(field "$data_deb" Package)" "$data_pkg"
expect_eq "runtime Section" "$(field "$runtime_deb" Section)" libs
expect_eq "-dev Section" "$(field "$dev_deb" Section)" libdevel
expect_eq "runtime Multi-Arch" "$(field "$runtime_deb" Multi-Arch)" same
expect_eq "-dev Multi-Arch" "$(field "$dev_deb" Multi-Arch)" same
expect_eq "tool Multi-Arch" "$(field "$tool_deb" Multi-Arch)" foreign
expect_eq "data Multi-Arch" "$(field "$data_deb" Multi-Arch)" foreign
expect_eq "tool Recommends" "$(field "$tool_deb" Recommends)" "$data_pkg (= $deb_version)"
# The static library's private dependencies come with their development packages (the -l flags
# of pkg-config --static and of kvrouter::kvrouter_static: Abseil, xxHash, libuv, libzmq, libnats).
expect_eq "-dev Depends" "$(field "$dev_deb" Depends)" \
  "libabsl-dev, $runtime_pkg (= $deb_version), libnats-dev, libuv1-dev, libxxhash-dev, libzmq3-dev"
runtime_depends=$(field "$runtime_deb" Depends)
for dep in 'libabsl[0-9]+' libuv1 libzmq5 'libnats[0-9.]+' 'libstdc\+\+6' libc6; do
  grep -qE "(^|, )$dep \(>= [^)]+\)(,|$)" <<<"$runtime_depends" ||
    fail "runtime Depends lacks $dep (from dpkg-shlibdeps): $runtime_depends"
done
ok "runtime Depends has libabsl, libuv1, libzmq5, libnats, libstdc++6, libc6 from dpkg-shlibdeps"
# What a package's programs need of the runtime package: the newest version the symbols file
# gives any kvr_ function they import (functions added after a package was built carry the
# revision that first shipped them, e.g. 0.2.0-3~, so that nothing is installed beside a
# library that lacks them).
needed_runtime_version() {  # needed_runtime_version DEB
  local dir needed="" sym v
  # (A command substitution runs without errexit: each step fails by itself.)
  dir=$(mktemp -d "$tmp/needed.XXXXXX") || fail "mktemp failed"
  dpkg-deb -x "$1" "$dir" || fail "dpkg-deb -x $1 failed"
  for sym in $(find "$dir" -type f -perm -u+x -exec nm -D --undefined-only {} + 2>/dev/null |
    sed -n "s/^ *U \(kvr_[a-z0-9_]*\)@$node\$/\1/p" | LC_ALL=C sort -u); do
    v=$(awk -v s="$sym@$node" '$1 == s {print $2}' "$src/debian/$runtime_pkg.symbols")
    [ -n "$v" ] || fail "$(basename "$1") imports $sym, which debian/$runtime_pkg.symbols lacks"
    [ -n "$needed" ] && dpkg --compare-versions "$v" le "$needed" || needed=$v
  done
  [ -n "$needed" ] || fail "$(basename "$1") imports no kvr_ function"
  echo "$needed"
}
# The tool links the library: dpkg-shlibdeps takes the version from the symbols file.
needed=$(needed_runtime_version "$tool_deb")
grep -qE "(^|, )$runtime_pkg \(>= $needed\)(,|$)" <<<"$(field "$tool_deb" Depends)" ||
  fail "kvrouter's Depends lacks $runtime_pkg (>= $needed): $(field "$tool_deb" Depends)"
ok "kvrouter depends on $runtime_pkg (>= $needed) (from the symbols file)"
expect_eq "runtime shlibs" "$(dpkg-deb --info "$runtime_deb" shlibs)" \
  "libkvrouter $soversion $runtime_pkg (>= $version)"
# The symbols file: debian/<runtime package>.symbols, as it is committed (checked against the
# library below).
control=$tmp/control-runtime
dpkg-deb --control "$runtime_deb" "$control"
symbols_file=debian/$runtime_pkg.symbols
[ -f "$control/symbols" ] ||
  fail "$runtime_pkg has no symbols file: write $symbols_file with scripts/abi-baseline.sh"
cmp -s "$control/symbols" "$symbols_file" || fail "$runtime_pkg's symbols file is not $symbols_file"
ok "$runtime_pkg's control file symbols is $symbols_file"
expect_eq "mode of $runtime_pkg's control file symbols" \
  "$(dpkg-deb --ctrl-tarfile "$runtime_deb" | tar -tvf - ./symbols | awk '{print $1}')" -rw-r--r--
grep -qx 'activate-noawait ldconfig' <(dpkg-deb --info "$runtime_deb" triggers) ||
  fail "the runtime package has no ldconfig trigger"
ok "the runtime package activates the ldconfig trigger"
# Documentation pages are compared without .gz: dh_compress compresses the larger ones.
uncompressed_docs() { sed -E 's|^(share/doc/[^/]+/[^/]+\.md)\.gz$|\1|'; }
deb_files() {  # deb_files DEB: its non-directory entries, without ./usr/
  dpkg-deb --contents "$1" | awk '$1 !~ /^d/ {print $6}' | sed 's|^\./usr/||' |
    uncompressed_docs | LC_ALL=C sort
}
expect_same_lines "files of $runtime_pkg" "$(deb_files "$runtime_deb")" "$runtime_deb_files"
expect_same_lines "files of $dev_pkg" "$(deb_files "$dev_deb")" "$dev_deb_files"
expect_same_lines "files of $tool_pkg" "$(deb_files "$tool_deb")" "$tool_deb_files"
expect_same_lines "files of $data_pkg" "$(deb_files "$data_deb")" "$data_deb_files"
# debian/copyright: DEP-5, and the licence of everything in data/ (the traces, the test vectors):
# each data/<dir> has one licence file, LICENSE-<id>.txt; the Files paragraph of data/<dir>/*
# names <id>; and the text is either in /usr/share/common-licenses (then the bundled file is that
# text, and the stand-alone License paragraph points there) or in the stand-alone paragraph
# itself. Texts are compared with spacing and line breaks squeezed.
grep -qx 'Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/' \
  debian/copyright || fail "debian/copyright is not in the machine-readable format (DEP-5)"
plain_text() { sed '1s/^\xEF\xBB\xBF//; s/\r$//' "$@" | tr -s ' \t\n' ' ' | sed 's/^ //; s/ $//'; }
licence_paragraph() {  # licence_paragraph ID: the text of debian/copyright's "License: ID"
  awk -v id="License: $1" 'f && /^[^ ]/ {exit}
    f {sub(/^ /, ""); if ($0 == ".") $0 = ""; print} $0 == id && blank {f = 1}
    {blank = ($0 == "")}' debian/copyright
}
licences=""
for dir in data/*/; do
  dir=${dir%/}
  license_files=("$dir"/LICENSE-*.txt)
  [ ${#license_files[@]} = 1 ] && [ -f "${license_files[0]}" ] ||
    fail "$dir has no licence file LICENSE-<id>.txt (or more than one): everything in data/" \
      "comes with its licence"
  license_file=${license_files[0]}
  named=${license_file##*/LICENSE-}
  named=${named%.txt}
  id=$(awk -v files="Files: $dir/*" '$0 == files {f = 1; next}
    f && /^License: / {print $2; exit} f && /^$/ {exit}' debian/copyright)
  # (Licence identifiers are case-insensitive.)
  [ -n "$id" ] && [ "${id,,}" = "${named,,}" ] ||
    fail "debian/copyright has no 'Files: $dir/*' paragraph with 'License: $named'"
  paragraph=$(licence_paragraph "$id")
  [ -n "$paragraph" ] || fail "debian/copyright has no stand-alone 'License: $id' paragraph"
  if [ -f "/usr/share/common-licenses/$id" ]; then
    [ "$(plain_text "$license_file")" = "$(plain_text "/usr/share/common-licenses/$id")" ] ||
      fail "$license_file is not /usr/share/common-licenses/$id"
    grep -qF "/usr/share/common-licenses/$id" <<<"$paragraph" ||
      fail "debian/copyright's License: $id does not point to /usr/share/common-licenses/$id"
  else
    [ "$(plain_text <<<"$paragraph")" = "$(plain_text "$license_file")" ] ||
      fail "debian/copyright's License: $id is not the text of $license_file"
  fi
  licences+=" $dir/* $id;"
done
ok "debian/copyright (DEP-5) gives each data/<dir> its licence, with its text:${licences%;}"

root=$tmp/extracted
for deb in "${debs[@]}"; do dpkg-deb -x "$deb" "$root"; done
packaged_lib=$root/usr/$libdir/libkvrouter.so.$version
expect_eq "the packaged kvrouter.pc's prefix" \
  "$(sed -n 's/^prefix=//p' "$root/usr/$libdir/pkgconfig/kvrouter.pc")" /usr
for elf in "$packaged_lib" "$root/usr/bin/kvrouter"; do
  name=${elf#"$root"/}
  [[ $(file -L "$elf") == *", stripped"* ]] || fail "$name is not stripped"
  dynamic=$(readelf -dW "$elf")
  grep -qE '\(FLAGS\).*BIND_NOW' <<<"$dynamic" && grep -qE '\(FLAGS_1\).*\bNOW\b' <<<"$dynamic" ||
    fail "$name is not linked with -z now (bindnow)"
  readelf -lW "$elf" | grep -q GNU_RELRO || fail "$name has no RELRO segment"
  imports=$(nm -D --undefined-only "$elf")
  grep -q ' __stack_chk_fail@' <<<"$imports" || fail "$name: no stack protector"
  grep -qE ' __[a-z]+_chk@' <<<"$imports" || fail "$name: no fortified function (_FORTIFY_SOURCE)"
  ok "$name: stripped; hardened: bindnow, RELRO, stack protector, _FORTIFY_SOURCE"
done
grep -qE '\(FLAGS_1\).*\bPIE\b' <(readelf -dW "$root/usr/bin/kvrouter") ||
  fail "usr/bin/kvrouter is not a position-independent executable"
ok "usr/bin/kvrouter is a position-independent executable"
# Each -dbgsym package: the debug information of its package's ELF file, found by build id.
for pair in "$runtime_pkg:$packaged_lib" "$tool_pkg:$root/usr/bin/kvrouter"; do
  pkg=${pair%%:*} elf=${pair#*:}
  dbgsym=$deb_dir/${pkg}-dbgsym_${deb_version}_$arch.deb
  [ -f "$dbgsym" ] || fail "dpkg-buildpackage did not make $dbgsym"
  expect_eq "${pkg}-dbgsym Depends" "$(field "$dbgsym" Depends)" "$pkg (= $deb_version)"
  id=$(readelf -n "$elf" 2>/dev/null | sed -n 's/^ *Build ID: //p')
  expect_same_lines "files of ${pkg}-dbgsym" "$(deb_files "$dbgsym")" \
    "lib/debug/.build-id/${id:0:2}/${id:2}.debug
share/doc/${pkg}-dbgsym"
  dpkg-deb -x "$dbgsym" "$tmp/dbgsym"
  sections=$(readelf -SW "$tmp/dbgsym/usr/lib/debug/.build-id/${id:0:2}/${id:2}.debug" 2>/dev/null)
  grep -q ' \.debug_info ' <<<"$sections" || fail "${pkg}-dbgsym's .debug file has no DWARF"
  ok "${pkg}-dbgsym holds the DWARF of ${elf#"$root"/} (build id $id)"
done
[ "$(nm -D --defined-only "$packaged_lib")" = "$exports" ] ||
  fail "the packaged library's dynamic symbols differ from the installed one's"
ok "the packaged library exports the same symbols as the installed one"
static_archive packaged "$root/usr/$libdir/libkvrouter.a"
# dpkg-gensymbols -c4 fails on any difference between the symbols file and the library: a symbol
# the file does not list (record it: scripts/abi-baseline.sh --symbols) or one the library lost.
# (dh_makeshlibs already ran it so while building, debian/rules; this states it.) -v is the
# package's version: a symbol counts as lost only when -v is newer than the version that
# introduced it, so with the bare 0.2.0 a symbol introduced in 0.2.0 could vanish unnoticed.
gensymbols=$tmp/gensymbols
mkdir -p "$gensymbols"
(cd "$gensymbols" && dpkg-gensymbols -v"$deb_version" -p"$runtime_pkg" -e"$packaged_lib" \
  -I"$src/$symbols_file" -O"$gensymbols/symbols" -c4) >"$tmp/gensymbols.log" 2>&1 || {
  sed 's/^/   /' "$tmp/gensymbols.log" >&2
  fail "$symbols_file does not list exactly the library's symbols (dpkg-gensymbols -c4, diff" \
    "above): record new ones with scripts/abi-baseline.sh --symbols; removing one needs a" \
    "SONAME bump"
}
ok "dpkg-gensymbols -c4: $symbols_file lists exactly the library's" \
  "$(grep -c '^ ' "$symbols_file") symbols, all under $node"
dpkg-deb -x "$deb_dir/${runtime_pkg}-dbgsym_${deb_version}_$arch.deb" "$root"
dpkg-deb -x "$deb_dir/${tool_pkg}-dbgsym_${deb_version}_$arch.deb" "$root"
if grep -rlF -e "$src" -e "$tmp" "$root"; then
  fail "the packages name the source or build tree"
fi
ok "no source or build path anywhere in the packages, -dbgsym included"

echo "== (e) the binary packages in a fresh root: dpkg --root, consumers, purge =="
# A root that holds only dpkg's empty database. The packages' dependencies (libabsl, libuv1, ...)
# are the build machine's: dpkg is told not to look for them in the root (--force-depends), and
# the programs built against the root find them in the machine's library directories.
root=$tmp/root
mkdir -p "$root/var/lib/dpkg/info" "$root/var/lib/dpkg/updates" "$root/var/lib/dpkg/triggers"
touch "$root/var/lib/dpkg/status" "$root/var/lib/dpkg/available"
dpkg_root=(dpkg --root="$root" --log=/dev/null --force-depends)
[ "$(id -u)" = 0 ] || dpkg_root+=(--force-not-root)
run_logged "$tmp/dpkg-root-install.log" "${dpkg_root[@]}" -i "${debs[@]}"
for p in "${packages[@]}"; do
  expect_eq "dpkg --root: $p" \
    "$(dpkg-query --root="$root" -W -f='${db:Status-Status} ${Version}' "$p")" \
    "installed $deb_version"
done
expect_same_lines "files in the root" \
  "$(files_under "$root/usr" | uncompressed_docs | LC_ALL=C sort)" \
  "$all_deb_files"
consumers root "$root/usr"
static_consumers root "$root/usr"
# The C examples libkvrouter-dev installs, built against the root as its documentation says.
for example in $(sed 's|^examples/c/||' debian/libkvrouter-dev.examples); do
  src_file=$root/usr/share/doc/$dev_pkg/examples/$example
  # shellcheck disable=SC2046  # pkg-config's flags are meant to be split
  run_logged "$tmp/example.log" cc -std=c11 -Wall -Wextra -Werror "$src_file" \
    $(PKG_CONFIG_PATH="$root/usr/$libdir/pkgconfig" pkg-config \
      --define-variable=prefix="$root/usr" --cflags --libs kvrouter) -o "$tmp/${example%.c}"
  run_logged "$tmp/example-run.log" env LD_LIBRARY_PATH="$root/usr/$libdir" "$tmp/${example%.c}"
  ok "root: the installed example $example builds against the root and runs"
done
replay_tool root "$root/usr"
run_logged "$tmp/dpkg-root-purge.log" "${dpkg_root[@]}" --purge "${packages[@]}"
for p in "${packages[@]}"; do
  state=$(dpkg-query --root="$root" -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [ -z "$state" ] || [ "$state" = not-installed ] || fail "$p is still known to dpkg: $state"
done
left=$(cd "$root" && find . -mindepth 1 ! -path './var' ! -path './var/lib' \
  ! -path './var/lib/dpkg' ! -path './var/lib/dpkg/*' | sed 's|^\./||')
[ -z "$left" ] || fail "left in the root after dpkg --purge: $left"
left=$(cd "$root/var/lib/dpkg" && find info -type f ! -name format)
[ -z "$left" ] || fail "dpkg's info directory still has: $left"
ok "packages purged from the root: unknown to dpkg, no file or directory left but dpkg's database"

echo "== (f) the apt repository (scripts/apt-repo.sh) and apt-get install from it =="
repo=build/apt
run_logged "$tmp/apt-repo.log" scripts/apt-repo.sh --debs "$deb_dir" "$repo"
sed 's/^/   /' "$tmp/apt-repo.log"
for f in Packages Packages.gz Sources Sources.gz Release kvrouter.sources; do
  [ -s "$repo/$f" ] || fail "the repository has no $f"
done
expect_same_lines "packages in the repository's Packages" \
  "$(sed -n 's/^Package: //p' "$repo/Packages" | LC_ALL=C sort)" \
  "$(printf '%s\n' "${packages[@]}" "$runtime_pkg-dbgsym" "$tool_pkg-dbgsym" "$service_pkg" \
    "$service_pkg-dbgsym" | LC_ALL=C sort)"
expect_eq "source package in the repository's Sources" \
  "$(sed -n 's/^Package: //p; s/^Version: //p' "$repo/Sources" | tr '\n' ' ')" \
  "kvrouter $deb_version "
# apt with a state of its own: only this repository as a source, its own lists and cache, and
# the machine's dpkg database (where the packages' dependencies are installed).
apt_dir=$tmp/apt
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/sources.list.d"
cp "$repo/kvrouter.sources" "$apt_dir/sources.list.d/"
apt_opts=(-o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts="$apt_dir/sources.list.d"
  -o Dir::State::Lists="$apt_dir/lists" -o Dir::Cache="$apt_dir/cache"
  -o Dir::Cache::Archives="$apt_dir/cache/archives" -o APT::Sandbox::User=root
  -o Debug::NoLocking=1 -o quiet=1)
run_logged "$tmp/apt-update.log" apt-get "${apt_opts[@]}" update
expect_eq "apt-cache policy: candidate of $dev_pkg" \
  "$(apt-cache "${apt_opts[@]}" policy "$dev_pkg" | sed -n 's/^ *Candidate: //p')" "$deb_version"

if [ "${KVR_PACKAGE_INSTALL:-0}" = 1 ]; then
  echo "-- apt-get install $dev_pkg $tool_pkg from $repo into the system ($runtime_pkg as a" \
    "dependency, $data_pkg as a recommendation)"
  for p in "${packages[@]}"; do
    state=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
    [ -z "$state" ] || [ "$state" = not-installed ] ||
      fail "$p is already on this machine ($state); remove it first (apt-get purge $p)"
  done
  while read -r f; do
    [ ! -e "/usr/$f" ] && [ ! -L "/usr/$f" ] ||
      fail "/usr/$f exists already; installing would overwrite it, and removing would delete it"
  done <<<"$all_deb_files"
  ok "none of the packages nor any of their files is on the machine yet"
  installed_by_us=1
  run_logged "$tmp/apt-install.log" env DEBIAN_FRONTEND=noninteractive \
    apt-get "${apt_opts[@]}" install -y "$dev_pkg" "$tool_pkg"
  for p in "${packages[@]}"; do
    expect_eq "apt-get install: $p" \
      "$(dpkg-query -W -f='${db:Status-Status} ${Version}' "$p")" "installed $deb_version"
  done
  # (Output captured first: with pipefail, grep -q ending early would fail the pipeline.)
  cache=$(ldconfig -p)
  grep -qF "libkvrouter.so.$soversion (" <<<"$cache" ||
    fail "ldconfig's cache does not list libkvrouter.so.$soversion"
  ok "ldconfig's cache lists libkvrouter.so.$soversion (the trigger ran)"

  consumers system /usr
  static_consumers system /usr
  replay_tool system /usr

  echo "-- removing them again (apt-get purge)"
  run_logged "$tmp/apt-purge.log" env DEBIAN_FRONTEND=noninteractive \
    apt-get "${apt_opts[@]}" purge -y "${packages[@]}"
  installed_by_us=0
  for p in "${packages[@]}"; do
    state=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
    [ -z "$state" ] || [ "$state" = not-installed ] || fail "$p is still known to dpkg: $state"
  done
  while read -r f; do
    [ ! -e "/usr/$f" ] && [ ! -L "/usr/$f" ] || fail "/usr/$f is left after apt-get purge"
  done <<<"$all_deb_files"
  for d in share/doc/libkvrouter-dev share/kvrouter "$libdir/cmake/kvrouter"; do
    [ ! -e "/usr/$d" ] || fail "/usr/$d is left after apt-get purge"
  done
  cache=$(ldconfig -p)
  if grep -qF "libkvrouter.so.$soversion (" <<<"$cache"; then
    fail "ldconfig's cache still lists libkvrouter.so.$soversion"
  fi
  ok "packages purged: unknown to dpkg, no file or directory left, not in ldconfig's cache"
else
  echo "-- not installing into the system (that needs root and KVR_PACKAGE_INSTALL=1):" \
    "apt-get only simulates it"
  run_logged "$tmp/apt-simulate.log" apt-get "${apt_opts[@]}" install -s "$dev_pkg" "$tool_pkg"
  expect_same_lines "packages apt-get would install from $repo" \
    "$(sed -n 's/^Inst \([^ ]*\) .*/\1/p' "$tmp/apt-simulate.log" | LC_ALL=C sort)" \
    "$(printf '%s\n' "${packages[@]}" | LC_ALL=C sort)"
fi

echo "== (g) kvrouterd: the service package and its systemd unit's ExecStart =="
service_deb=$deb_dir/${service_pkg}_${deb_version}_$arch.deb
[ -f "$service_deb" ] || fail "dpkg-buildpackage did not make $service_deb"
expect_eq "$service_pkg Section" "$(field "$service_deb" Section)" net
needed=$(needed_runtime_version "$service_deb")
grep -qE "(^|, )$runtime_pkg \(>= $needed\)(,|$)" <<<"$(field "$service_deb" Depends)" ||
  fail "$service_pkg's Depends lacks $runtime_pkg (>= $needed): $(field "$service_deb" Depends)"
ok "$service_pkg depends on $runtime_pkg (>= $needed) (from the symbols file)"
long=$(field "$service_deb" Description | awk 'length > 79')
[ -z "$long" ] || fail "$service_pkg: description lines over 79 characters: $long"
# What it holds: the daemon, its manual page, its configuration (a conffile), the unit, the
# sysusers.d file, the API documentation and the example configuration.
service_files=$(dpkg-deb --contents "$service_deb" | awk '$1 !~ /^d/ {print $6}' |
  sed 's|^\./||' | uncompressed_docs | sed -E 's|^usr/(share/doc/[^/]+/[^/]+\.md)\.gz$|usr/\1|' |
  LC_ALL=C sort)
expect_same_lines "files of $service_pkg" "$service_files" "$(LC_ALL=C sort <<LIST
etc/kvrouterd/kvrouterd.conf
lib/systemd/system/kvrouterd.service
usr/lib/sysusers.d/kvrouterd.conf
usr/sbin/kvrouterd
usr/share/doc/kvrouterd/changelog.Debian.gz
usr/share/doc/kvrouterd/copyright
usr/share/doc/kvrouterd/examples/kvrouterd.conf.example
usr/share/doc/kvrouterd/kvrouterd.md
usr/share/lintian/overrides/kvrouterd
usr/share/man/man8/kvrouterd.8.gz
LIST
)"
expect_eq "$service_pkg conffiles" "$(dpkg-deb --info "$service_deb" conffiles)" \
  /etc/kvrouterd/kvrouterd.conf
control=$tmp/control-service
dpkg-deb --control "$service_deb" "$control"
grep -q 'systemd-sysusers' "$control/postinst" ||
  fail "$service_pkg's postinst does not create its user with systemd-sysusers"
grep -q 'deb-systemd-helper' "$control/postinst" ||
  fail "$service_pkg's postinst does not enable its unit (deb-systemd-helper)"
ok "$service_pkg's postinst creates the system user (systemd-sysusers) and enables the unit"
extracted=$tmp/service
dpkg-deb -x "$service_deb" "$extracted"
daemon=$extracted/usr/sbin/kvrouterd
[[ $(file -L "$daemon") == *", stripped"* ]] || fail "usr/sbin/kvrouterd is not stripped"
grep -qE '\(FLAGS_1\).*\bNOW\b.*\bPIE\b|\(FLAGS_1\).*\bPIE\b' <(readelf -dW "$daemon") ||
  fail "usr/sbin/kvrouterd is not a position-independent executable linked with -z now"
readelf -lW "$daemon" | grep -q GNU_RELRO || fail "usr/sbin/kvrouterd has no RELRO segment"
grep -q ' __stack_chk_fail@' <(nm -D --undefined-only "$daemon") ||
  fail "usr/sbin/kvrouterd: no stack protector"
ok "usr/sbin/kvrouterd: stripped, PIE, bindnow, RELRO, stack protector"
id=$(readelf -n "$daemon" 2>/dev/null | sed -n 's/^ *Build ID: //p')
[ -n "$(dpkg-deb --contents "$deb_dir/${service_pkg}-dbgsym_${deb_version}_$arch.deb" |
  grep -F "${id:0:2}/${id:2}.debug")" ] || fail "$service_pkg-dbgsym lacks the daemon's debug file"
ok "$service_pkg-dbgsym holds the daemon's debug information (build id $id)"
# The manual page lists every option --help prints.
man_page=$tmp/kvrouterd.8
gunzip -c "$extracted/usr/share/man/man8/kvrouterd.8.gz" >"$man_page"
# (help2man writes each option as \fB\-\-name\fR; the page's dashes are all escaped first.)
packaged_libs=$tmp/extracted/usr/$libdir  # (d)'s extracted packages
escaped_page=$(sed 's/\\-/-/g; s/-/\\-/g' "$man_page")
for option in $(LD_LIBRARY_PATH=$packaged_libs "$daemon" --help | grep -oE '^  --[a-z-]+'); do
  grep -qF -- "\\fB${option//-/\\-}" <<<"$escaped_page" ||
    fail "the manual page does not document $option"
done
ok "the manual page documents every option of kvrouterd --help"

unit=$extracted/lib/systemd/system/kvrouterd.service
unit_value() { sed -n "s/^$1=//p" "$unit"; }  # unit_value KEY: the unit's setting
exec_start=$(unit_value ExecStart)
expect_eq "the unit's ExecStart" "$exec_start" \
  "/usr/sbin/kvrouterd --config /etc/kvrouterd/kvrouterd.conf"
expect_eq "the unit's User" "$(unit_value User)" kvrouterd
expect_eq "the unit's sysusers.d user" \
  "$(awk '$1 == "u" {print $2}' "$extracted/usr/lib/sysusers.d/kvrouterd.conf")" kvrouterd

# free_port: a port on 127.0.0.1 nothing listens on now.
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
# http METHOD URL [BODY]: the response's status and body ("000" when nothing answers).
http() {
  python3 - "$@" <<'PY'
import sys, urllib.request, urllib.error
method, url = sys.argv[1], sys.argv[2]
data = sys.argv[3].encode() if len(sys.argv) > 3 else None
request = urllib.request.Request(url, data=data, method=method)
try:
    with urllib.request.urlopen(request, timeout=5) as r:
        print(r.status, r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode())
except OSError:
    print("000")
PY
}
# run_unit LABEL CONFIG COMMAND...: runs the daemon as COMMAND (the unit's ExecStart, with its
# user) with CONFIG's API on a free port; checks /healthz, a worker added and a route, SIGHUP
# (ExecReload) and SIGTERM (exit status 0).
run_unit() {
  local label=$1 config=$2 port pid status answer
  shift 2
  port=$(free_port)
  sed -i "s/^listen = .*/listen = 127.0.0.1:$port/" "$config"
  "$@" 2>"$tmp/kvrouterd-$label.log" &
  pid=$!
  for _ in $(seq 100); do
    answer=$(http GET "http://127.0.0.1:$port/healthz")
    [[ $answer == 200* ]] && break
    sleep 0.1
  done
  [[ $answer == 200* ]] || fail "$label: /healthz did not answer 200: $answer" \
    "$(cat "$tmp/kvrouterd-$label.log")"
  ok "$label: kvrouterd started by the unit's ExecStart answers /healthz on 127.0.0.1:$port"
  answer=$(http POST "http://127.0.0.1:$port/v1/workers" '{"worker_id": 7, "address": "127.0.0.1:9"}')
  [[ $answer == 201* ]] || fail "$label: adding a worker: $answer"
  answer=$(http POST "http://127.0.0.1:$port/v1/route" '{"request_id": "r1", "token_ids": [1, 2, 3]}')
  [[ $answer == 200*'"worker_id":7'* ]] || fail "$label: routing: $answer"
  ok "$label: a worker added and a request routed to it over the API"
  kill -HUP "$pid"  # the unit's ExecReload
  sleep 0.5
  [[ $(http GET "http://127.0.0.1:$port/healthz") == 200* ]] ||
    fail "$label: not healthy after SIGHUP: $(cat "$tmp/kvrouterd-$label.log")"
  grep -q reload "$tmp/kvrouterd-$label.log" || fail "$label: SIGHUP logged no reload"
  kill -TERM "$pid"
  status=0
  wait "$pid" || status=$?
  expect_eq "$label: exit status after SIGTERM" "$status" 0
}

if [ "${KVR_PACKAGE_INSTALL:-0}" = 1 ]; then
  echo "-- apt-get install $service_pkg from $repo into the system"
  [ ! -e /usr/sbin/kvrouterd ] || fail "/usr/sbin/kvrouterd exists already"
  installed_by_us=1
  packages=("$service_pkg" "$runtime_pkg")  # what cleanup() purges if this fails
  run_logged "$tmp/apt-install-service.log" env DEBIAN_FRONTEND=noninteractive \
    apt-get "${apt_opts[@]}" install -y "$service_pkg"
  user=$(getent passwd kvrouterd) || fail "the package did not create the user kvrouterd"
  IFS=: read -r _ _ uid _ _ home shell <<<"$user"
  [ "$uid" -lt 1000 ] && [ "$home" = /nonexistent ] && [[ $shell == */nologin ]] ||
    fail "kvrouterd is not a system user without home or shell: $user"
  ok "the system user kvrouterd exists (uid $uid, home $home, shell $shell)"
  run_logged "$tmp/systemd-analyze.log" systemd-analyze verify /lib/systemd/system/kvrouterd.service
  ok "systemd-analyze verify accepts the installed unit"
  # As systemd would: RuntimeDirectory= made for the user, then ExecStart as User/Group.
  install -d -o kvrouterd -g kvrouterd /run/kvrouterd
  read -r -a command <<<"$exec_start"
  run_unit installed /etc/kvrouterd/kvrouterd.conf \
    setpriv --reuid=kvrouterd --regid=kvrouterd --init-groups --no-new-privs -- "${command[@]}"
  rmdir /run/kvrouterd
  run_logged "$tmp/apt-purge-service.log" env DEBIAN_FRONTEND=noninteractive \
    apt-get "${apt_opts[@]}" purge -y "$service_pkg" "$runtime_pkg"
  installed_by_us=0
  for f in /usr/sbin/kvrouterd /etc/kvrouterd /lib/systemd/system/kvrouterd.service; do
    [ ! -e "$f" ] || fail "$f is left after apt-get purge"
  done
  ok "kvrouterd purged: its files and its configuration are gone"
else
  echo "-- not installing into the system (that needs root and KVR_PACKAGE_INSTALL=1): the" \
    "unit's ExecStart runs from the extracted package, as $(id -un)"
  config=$tmp/kvrouterd.conf
  cp "$extracted/etc/kvrouterd/kvrouterd.conf" "$config"
  read -r -a command <<<"${exec_start//\/etc\/kvrouterd\/kvrouterd.conf/$config}"
  command[0]=$extracted${command[0]}
  run_unit extracted "$config" env LD_LIBRARY_PATH="$packaged_libs" "${command[@]}"
fi

echo "packaging: $checks checks passed"
