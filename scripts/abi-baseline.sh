#!/usr/bin/env bash
# The ABI record of libkvrouter, which scripts/test-packaging.sh holds every build to:
#  - abi/libkvrouter-<M.m>.abi: the abidw (libabigail) description of the public ABI of
#    libkvrouter.so.<M.m>, as the library of the last release has it; the packaging test runs
#    abidiff between it and the freshly built library;
#  - debian/libkvrouter<M.m>.symbols: the Debian symbols file of the runtime package
#    libkvrouter<M.m> (deb-symbols(5)): every exported symbol, its version node and the release
#    that introduced it; dh_makeshlibs packages it as DEBIAN/symbols and fails the build when
#    it and the library differ (dpkg-gensymbols -c4, debian/rules), and the packaging test
#    checks it again.
#
# When to run it, and commit what it writes:
#  - when cutting a release, on the release commit: the baseline becomes that release's ABI, so
#    that what the release added (functions, fields appended to structs) is promised from then
#    on, and new symbols are recorded with the release's version;
#  - in the change that bumps the SONAME (project(VERSION)'s major.minor, with the version node
#    of src/capi/kvrouter.map): the packaging test refuses a baseline of another SONAME, so the
#    bump carries the new baseline, and a symbols file for the new package is written from
#    scratch (the old SONAME's baseline and symbols file are removed). Rename the runtime
#    package in debian/control first (libkvrouter<M.m>, and the -dev package's Depends on it)
#    with its debian/libkvrouter<M.m>.* files: the build refuses a package not named after the
#    SONAME.
# Never to make the packaging test pass after an incompatible change within a released SONAME:
# such a change needs a SONAME bump (docs/api-stability.md).
#
# Usage:
#   scripts/abi-baseline.sh            builds the Debian packages with dpkg-buildpackage
#                                      (build/deb) as the packaging test does, then writes the
#                                      baseline and the symbols file from the library it built
#   scripts/abi-baseline.sh --symbols  the same, but only records new symbols in the symbols file
#                                      (after adding a function: they get project(VERSION), so
#                                      set that to the release that will ship them first)
#   scripts/abi-baseline.sh --dump LIB OUT
#                                      only describes LIB into OUT with the baseline's abidw
#                                      options (the packaging test describes each build with it,
#                                      so that both sides of its abidiff are made alike)
#
# What abidw records, and why (the baseline must not depend on the machine or the checkout):
#   --headers-dir include          the types of include/kvrouter.h (kvrouter_version.h declares
#   --drop-private-types           none); the library's own C++ types behind the opaque handles
#                                  (struct kvr_router, ...) are left out
#   --exported-interfaces-only     the exported kvr_* functions only, not the hidden C++ code
#   --no-corpus-path --no-comp-dir-path   no path of the build machine
#   --no-elf-needed                the DT_NEEDED list names Debian's library versions
#                                  (libabsl_*.so.20220623, libnats.so.3.4): not kvrouter's ABI
#   --drop-undefined-syms          what the library imports is not its ABI either
#   --no-show-locs                 no header line numbers, which move with every comment
#   --type-id-style hash           type ids that do not renumber when a type is added, so that a
#                                  refreshed baseline differs from the old one only where the ABI
#                                  does
# abidw reads the DWARF of the unstripped library in the CMake build tree that dpkg-buildpackage
# leaves behind (the package's copy is stripped; its debug information is in the -dbgsym
# package). dpkg-buildflags compile with -g and -ffile-prefix-map=<source tree>=., so the
# translation units are named ./src/capi/*.cc and not by where the checkout is. Needs
# abigail-tools, dpkg-dev and the packages' build dependencies (scripts/install-deps.sh installs
# them).
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/.."

abi_dump() {  # abi_dump LIB OUT
  abidw --headers-dir include --drop-private-types --exported-interfaces-only \
    --no-corpus-path --no-comp-dir-path --no-elf-needed --drop-undefined-syms --no-show-locs \
    --type-id-style hash --out-file "$2" "$1"
}

mode=all
case "${1:-}" in
  --dump)
    [ $# -eq 3 ] || { echo "usage: $0 --dump LIB OUT" >&2; exit 2; }
    lib=$2 out=$3
    [[ $lib == /* ]] || lib=$caller/$lib
    [[ $out == /* ]] || out=$caller/$out
    abi_dump "$lib" "$out"
    exit 0
    ;;
  --symbols) mode=symbols ;;
  "") ;;
  *) echo "usage: $0 [--symbols | --dump LIB OUT]" >&2; exit 2 ;;
esac
for tool in abidw dpkg-gensymbols; do
  command -v "$tool" >/dev/null ||
    { echo "abi-baseline: no $tool: install abigail-tools and dpkg-dev" >&2; exit 1; }
done
dirty=$(git status --porcelain -- include src CMakeLists.txt 2>/dev/null || true)
if [ "$mode" = all ] && [ -n "$dirty" ]; then
  echo "abi-baseline: warning: include/, src/ or CMakeLists.txt has uncommitted changes; the" \
    "baseline should describe a commit (the release's)" >&2
fi

# As scripts/test-packaging.sh builds it, but with the symbols check off: the point is to record
# the symbols the library has and the file lacks.
src=$PWD
source scripts/package-build.sh
build_debian_packages --record-symbols
lib=$src/$build/src/capi/libkvrouter.so.$version
package=libkvrouter$soversion

tmp=$(mktemp -d /tmp/abi-baseline.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

# The symbols file, first, so that nothing is written when it fails: new symbols get $version,
# and every known one keeps the version recorded for it. A new package's file starts with the
# Build-Depends-Package field, and replaces the old SONAME's.
symbols=debian/$package.symbols
if [ -f "$symbols" ]; then
  # dpkg-gensymbols counts a symbol as lost only when -v is newer than the version that
  # introduced it: so the check runs with the Debian version, as dpkg-buildpackage passes it
  # (a symbol may have been introduced by a revision: 0.2.0-3~, docs/api-stability.md).
  if ! (cd "$tmp" && dpkg-gensymbols -v"$deb_version" -p"$package" -e"$lib" \
    -I"$src/$symbols" -O"$tmp/check" -c1) >"$tmp/check.log" 2>&1; then
    cat "$tmp/check.log" >&2
    echo "abi-baseline: symbols of $symbols are missing from the library; nothing written:" \
      "removing a symbol needs a SONAME bump" >&2
    exit 1
  fi
  # Written with -v$version so that new symbols get the upstream version; dpkg-gensymbols
  # lowers to it any recorded version above it (0.2.0-3~ > 0.2.0), so those are put back.
  (cd "$tmp" && dpkg-gensymbols -v"$version" -p"$package" -e"$lib" -I"$src/$symbols" \
    -O"$tmp/written" -c0 -q)
  awk 'NR == FNR { if (/^ /) recorded[$1] = $2; next }
       /^ / && ($1 in recorded) { print " " $1 " " recorded[$1]; next } { print }' \
    "$src/$symbols" "$tmp/written" >"$tmp/symbols"
else
  (cd "$tmp" && dpkg-gensymbols -v"$version" -p"$package" -e"$lib" -O"$tmp/new" -c0 -q)
  sed "1a * Build-Depends-Package: libkvrouter-dev" "$tmp/new" >"$tmp/symbols"
fi

if [ "$mode" = all ]; then
  baseline=abi/libkvrouter-$soversion.abi
  mkdir -p abi
  abi_dump "$lib" "$tmp/baseline.abi"
  cp "$tmp/baseline.abi" "$baseline"
  for old in abi/libkvrouter-*.abi; do
    [ "$old" = "$baseline" ] || rm -v "$old"
  done
  echo "abi-baseline: $baseline: the ABI of libkvrouter.so.$soversion as of $version" \
    "($(grep -c '<elf-symbol ' "$baseline") functions)"
fi

if cmp -s "$tmp/symbols" "$symbols"; then
  echo "abi-baseline: $symbols: up to date"
else
  [ ! -f "$symbols" ] || diff -u "$symbols" "$tmp/symbols" || true
  for old in debian/libkvrouter*.symbols; do
    [ ! -e "$old" ] || [ "$old" = "$symbols" ] || rm -v "$old"
  done
  cp "$tmp/symbols" "$symbols"
  echo "abi-baseline: $symbols: written ($(grep -c '^ ' "$symbols") symbols)"
fi
