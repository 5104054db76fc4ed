# Sourced by scripts/test-packaging.sh, scripts/abi-baseline.sh and scripts/apt-repo.sh: the
# Debian packages, built from source by dpkg-buildpackage, once the same way for all three, so
# that the library the packaging test checks, the one the ABI baseline records and the one the
# apt repository serves are made alike. Run from the repository's root.
#
# build_debian_packages: builds the source package and every binary package (debian/) in
# build/deb, from a clean copy of the checkout:
#  - the tree is the checkout as git sees it: every tracked file as it is in the working tree,
#    plus untracked files that .gitignore does not exclude (so a new file counts before it is
#    committed, and build/ or any other ignored output never gets in), copied into
#    build/deb/kvrouter-<version>;
#  - the upstream tarball kvrouter_<version>.orig.tar.xz is that tree without debian/, made
#    reproducibly (sorted, owner 0, every mtime the changelog's date);
#  - dpkg-buildpackage -us -uc -sa (source and binaries, unsigned; -sa: the .changes lists the
#    upstream tarball whatever the Debian revision, so that the apt repository, which takes the
#    files the .changes names, can serve the source package) runs there with an empty
#    environment but for PATH (no /usr/local), HOME (an empty directory), LC_ALL=C.UTF-8 and
#    DEB_BUILD_OPTIONS (parallel=KVR_JOBS or nproc, and whatever the caller's DEB_BUILD_OPTIONS
#    adds); it checks the Build-Depends first, so a dependency missing from debian/control
#    fails when its package is not installed.
# The log is build/deb/dpkg-buildpackage.log. Sets:
#   deb_dir     build/deb: .dsc, .orig.tar.xz, .debian.tar.xz, the .deb files (-dbgsym ones
#               too), .buildinfo, .changes
#   source_dir  build/deb/kvrouter-<version>, the tree that was built
#   build       the CMake build tree dpkg-buildpackage used (left in place: the packaging test
#               installs components from it and describes its unstripped library)
#   version (x.y.z, project(VERSION) of CMakeLists.txt), soversion (x.y: the SONAME while at
#   0.x), deb_version (debian/changelog's, x.y.z-r), arch, multiarch, changes (the .changes)
# Fails, saying what to do, when debian/changelog's upstream version is not CMakeLists.txt's or
# the runtime package in debian/control is not named after the SONAME.
# With --record-symbols (scripts/abi-baseline.sh), a symbol the library has and the symbols file
# does not list, or the other way round, does not fail the build (DPKG_GENSYMBOLS_CHECK_LEVEL=0;
# debian/rules otherwise has dh_makeshlibs fail on any difference).
build_debian_packages() {
  local jobs=${KVR_JOBS:-$(nproc)} src=$PWD name=kvrouter
  local -a check_symbols=()
  [[ ${1:-} != --record-symbols ]] || check_symbols=(DPKG_GENSYMBOLS_CHECK_LEVEL=0)
  version=$(sed -n 's/^project(kvrouter VERSION \([0-9.]*\) .*/\1/p' CMakeLists.txt)
  soversion=${version%.*}
  deb_version=$(dpkg-parsechangelog -S Version)
  arch=$(dpkg-architecture -qDEB_HOST_ARCH)
  multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH)
  if [[ -z $version || ${deb_version%-*} != "$version" ]]; then
    echo "package-build: debian/changelog is at $deb_version, CMakeLists.txt at '$version':" \
      "add a changelog entry for $version-1 (dch -v $version-1)" >&2
    return 1
  fi
  if ! grep -qx "Package: lib$name$soversion" debian/control; then
    echo "package-build: debian/control has no package lib$name$soversion, named after the" \
      "SONAME libkvrouter.so.$soversion: rename the runtime package (and its .install and" \
      ".symbols files; scripts/abi-baseline.sh writes the symbols file)" >&2
    return 1
  fi

  deb_dir=build/deb
  source_dir=$deb_dir/$name-$version
  rm -rf "$deb_dir"
  mkdir -p "$source_dir" "$deb_dir/home"
  # The checkout as git sees it (deleted files, still in the index, are skipped).
  git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do
      [[ -e $f || -L $f ]] && printf '%s\0' "$f"
    done | tar --null -T - -cf - | tar -xf - -C "$source_dir"
  local epoch
  epoch=$(dpkg-parsechangelog -S Timestamp)
  tar --sort=name --mtime="@$epoch" --owner=0 --group=0 --numeric-owner \
    --exclude="$name-$version/debian" -C "$deb_dir" -cf - "$name-$version" |
    xz -6 -T1 >"$deb_dir/${name}_$version.orig.tar.xz"

  echo "-- dpkg-buildpackage -us -uc -sa in $source_dir (log: $deb_dir/dpkg-buildpackage.log)"
  (cd "$source_dir" && env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME="$src/$deb_dir/home" \
    LC_ALL=C.UTF-8 DEB_BUILD_OPTIONS="parallel=$jobs${DEB_BUILD_OPTIONS:+ $DEB_BUILD_OPTIONS}" \
    "${check_symbols[@]}" dpkg-buildpackage -us -uc -sa) >"$deb_dir/dpkg-buildpackage.log" 2>&1 || {
    tail -n 60 "$deb_dir/dpkg-buildpackage.log" >&2
    echo "package-build: dpkg-buildpackage failed (the last lines above; the whole log is" \
      "$deb_dir/dpkg-buildpackage.log)" >&2
    return 1
  }
  build=$source_dir/obj-$multiarch
  changes=$deb_dir/${name}_${deb_version}_$arch.changes
  [[ -f $changes ]] || { echo "package-build: no $changes" >&2; return 1; }
}
