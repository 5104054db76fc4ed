#!/usr/bin/env bash
# Packaging test: libkvrouter as a system library. Builds only the library (Release, with debug
# information for abidw; the packages are stripped) in build/package, configured for /usr as the
# Debian packages are, then:
#  (a) installs it into a staging prefix, component by component, checks the files and the
#      exported CMake target, and builds and runs tests/package/consumer.c against it twice:
#      through pkg-config and through CMake's find_package;
#  (b) checks that the library exports exactly the kvr_* functions of include/kvrouter.h, under
#      the version node of its SONAME;
#  (c) compares the library's ABI with the committed baseline of the last release
#      (abi/libkvrouter-<major.minor>.abi) with abidiff: any change but new functions and fields
#      appended to versioned structs fails, and so does a baseline of another SONAME (after a
#      SONAME bump, scripts/abi-baseline.sh records the new one);
#  (d) builds the Debian packages with cpack and checks their fields, dependencies, control
#      files (the symbols file against the library, with dpkg-gensymbols) and contents; then
#      builds and runs the consumer against them: installed into the system with dpkg -i and
#      removed again afterwards when run as root with KVR_PACKAGE_INSTALL=1 (CI, on a throwaway
#      machine), otherwise extracted into a temporary root with dpkg-deb -x.
# Ends with "packaging: N checks passed". Needs dpkg-dev, file, pkg-config, binutils and
# abigail-tools (scripts/install-deps.sh installs them).
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

echo "== build: libkvrouter (Release, for /usr) in build/package =="
source scripts/package-build.sh
build_package_library  # sets build, version and soversion (0.x: the SONAME carries major.minor)
# The static library as well (not packaged; installed as the component Static, checked in (a2)).
cmake --build "$build" -j "${KVR_JOBS:-$(nproc)}" --target kvrouter_static >/dev/null
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
# The header, and what it cites: the README, docs/ and the schemas (sorted as files_under does).
dev_files=$(LC_ALL=C sort <<LIST
include/kvrouter.h
include/kvrouter_version.h
$(cd "$src" && ls README.md docs/*.md | sed 's|^docs/||; s|^|share/doc/kvrouter/|')
$(cd "$src" && ls schema/*.fbs | sed 's|^|share/kvrouter/|')
$libdir/cmake/kvrouter/kvrouterConfig.cmake
$libdir/cmake/kvrouter/kvrouterConfigVersion.cmake
$libdir/cmake/kvrouter/kvrouterTargets-release.cmake
$libdir/cmake/kvrouter/kvrouterTargets.cmake
$libdir/libkvrouter.so
$libdir/pkgconfig/kvrouter.pc
LIST
)
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

# The kvr_* functions the header declares (KVR_API), for (a2) and (b).
declared_api=$(grep -oE 'KVR_API[^(]*\<kvr_[a-z0-9_]+\(' include/kvrouter.h |
  grep -oE 'kvr_[a-z0-9_]+\($' | tr -d '(' | LC_ALL=C sort -u)

echo "== (a2) the static library: self-contained, consumed through pkg-config --static and CMake =="
run_logged "$tmp/install-static.log" cmake --install "$build" --prefix "$stage" --component Static
static_lib=$stage/$libdir/libkvrouter.a
expect_same_lines "files of the Static component" \
  "$(files_under "$stage" | grep -vxF -f <(LC_ALL=C sort <<<"$runtime_files
$dev_files"))" \
  "$libdir/cmake/kvrouter/kvrouterStaticTargets-release.cmake
$libdir/cmake/kvrouter/kvrouterStaticTargets.cmake
$libdir/libkvrouter.a"
if grep -lF -e "$src" -e "$tmp" "$stage/$libdir"/cmake/kvrouter/kvrouterStaticTargets*.cmake; then
  fail "the static CMake targets name the source, build or staging tree"
fi
ok "no source, build or staging path in the static CMake targets"
# Self-contained: every kvrouter symbol the archive refers to, it defines (the core, wire and
# ingest objects are inside), and so are the kvr_* functions of the header.
static_defined=$(nm -g --defined-only "$static_lib" 2>/dev/null | awk 'NF == 3 {print $3}' |
  LC_ALL=C sort -u)
static_missing=$(nm -g --undefined-only "$static_lib" 2>/dev/null | awk '{print $NF}' |
  grep -E '^(_ZN8kvrouter|_ZNK8kvrouter|kvr_)' | LC_ALL=C sort -u |
  LC_ALL=C comm -23 - <(echo "$static_defined"))
[ -z "$static_missing" ] || fail "libkvrouter.a refers to kvrouter symbols it lacks: $static_missing"
expect_same_lines "kvr_* functions defined by libkvrouter.a" \
  "$(grep -E '^kvr_' <<<"$static_defined")" "$declared_api"
static_pc=(env PKG_CONFIG_PATH="$stage/$libdir/pkgconfig" pkg-config)
static_flags=$("${static_pc[@]}" --static --libs kvrouter | sed 's/ *$//')
for dep in -labsl_status -lxxhash -luv -lzmq -lnats -lstdc++; do
  [[ " $static_flags " == *" $dep "* ]] ||
    fail "pkg-config --static --libs kvrouter lacks $dep: $static_flags"
done
ok "pkg-config --static --libs kvrouter lists the private dependencies (Abseil, xxHash, libuv," \
  "libzmq, libnats, the C++ runtime)"
static_out=$tmp/consumer-static
mkdir -p "$static_out"
# -l:libkvrouter.a: the archive, although libkvrouter.so is beside it.
# shellcheck disable=SC2086,SC2046  # pkg-config's flags are meant to be split
run_logged "$static_out/cc.log" cc -std=c11 -pedantic -Wall -Wextra -Werror tests/package/consumer.c \
  $("${static_pc[@]}" --cflags kvrouter) ${static_flags/-lkvrouter /-l:libkvrouter.a } \
  -o "$static_out/consumer-pkgconfig"
ok "static consumer built with cc \$(pkg-config --static --libs kvrouter), -l:libkvrouter.a"
run_logged "$static_out/cmake.log" cmake -S tests/package -B "$static_out/cmake" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release -DKVR_REQUIRED_VERSION="$soversion" -DKVR_LINK_STATIC=ON \
  -DCMAKE_PREFIX_PATH="$stage"
run_logged "$static_out/cmake-build.log" cmake --build "$static_out/cmake"
ok "static consumer built with find_package(kvrouter COMPONENTS Static) + kvrouter::kvrouter_static"
for exe in "$static_out/consumer-pkgconfig" "$static_out/cmake/consumer"; do
  if ldd "$exe" | grep -F libkvrouter; then
    fail "${exe#"$static_out"/} loads libkvrouter.so: it should hold the archive's code"
  fi
  output=$("$exe") || fail "${exe#"$static_out"/} (static) exited non-zero"
  [[ $output == *": OK" ]] || fail "${exe#"$static_out"/} (static) printed '$output'"
  ok "${exe#"$static_out"/}, linked statically (no libkvrouter.so loaded), runs: $output"
done

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
declared=$(grep -oE 'KVR_API[^(]*\<kvr_[a-z0-9_]+\(' include/kvrouter.h |
  grep -oE 'kvr_[a-z0-9_]+\($' | tr -d '(' | LC_ALL=C sort -u)
expect_same_lines "kvr_* functions exported (all under $node, nothing else) and declared KVR_API" \
  "$exported" "$declared"

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

echo "== (d) Debian packages =="
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
# The symbols file: cmake/debian/<runtime package>.symbols, as it is committed (checked against
# the library below).
control=$tmp/control-runtime
dpkg-deb --control "$runtime_deb" "$control"
symbols_file=cmake/debian/$runtime_pkg.symbols
[ -f "$control/symbols" ] ||
  fail "$runtime_pkg has no symbols file: write $symbols_file with scripts/abi-baseline.sh"
cmp -s "$control/symbols" "$symbols_file" || fail "$runtime_pkg's symbols file is not $symbols_file"
ok "$runtime_pkg's control file symbols is $symbols_file"
expect_eq "mode of $runtime_pkg's control file symbols" \
  "$(dpkg-deb --ctrl-tarfile "$runtime_deb" | tar -tvf - ./symbols | awk '{print $1}')" -rw-r--r--
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
# dpkg-gensymbols -c4 fails on any difference between the symbols file and the library: a symbol
# the file does not list (record it: scripts/abi-baseline.sh --symbols) or one the library lost.
# -v is the package's version, as dpkg-buildpackage passes it: a symbol counts as lost only when
# -v is newer than the version that introduced it, so with the bare 0.2.0 a symbol introduced in
# 0.2.0 could vanish unnoticed.
gensymbols=$tmp/gensymbols
mkdir -p "$gensymbols"
(cd "$gensymbols" && dpkg-gensymbols -v"$deb_version" -p"$runtime_pkg" -e"$packaged_lib" \
  -I"$control/symbols" -O"$gensymbols/symbols" -c4) >"$tmp/gensymbols.log" 2>&1 || {
  sed 's/^/   /' "$tmp/gensymbols.log" >&2
  fail "$symbols_file does not list exactly the library's symbols (dpkg-gensymbols -c4, diff" \
    "above): record new ones with scripts/abi-baseline.sh --symbols; removing one needs a" \
    "SONAME bump"
}
ok "dpkg-gensymbols -c4: $symbols_file lists exactly the library's" \
  "$(grep -c '^ ' "$symbols_file") symbols, all under $node"
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
