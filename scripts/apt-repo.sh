#!/usr/bin/env bash
# A local apt repository of kvrouter's Debian packages, so that `apt install libkvrouter-dev`
# (or kvrouter, the replay tool) works on this machine, or on any that can read the directory
# (README.md, "Installing").
#
# Usage: scripts/apt-repo.sh [--debs DIR] [OUT]
#   OUT         the repository (default build/apt); whatever it held is replaced
#   --debs DIR  serve the packages already built in DIR (the one .changes file there says which
#               files make the build) instead of building them: without it, the packages are
#               built first with dpkg-buildpackage from this checkout (scripts/package-build.sh,
#               into build/deb)
#
# The repository is flat (every file in OUT; no dists/ tree): the binary packages with their
# -dbgsym packages (Packages), the source package (Sources: `apt-get source kvrouter`), and a
# Release file with their checksums, all made by apt-ftparchive (apt-utils). OUT/kvrouter.sources
# is the deb822 sources entry for it, to copy into /etc/apt/sources.list.d/. The Release file is
# not signed, so that entry says `Trusted: yes`: right for a directory on the machine that only
# root can write; a repository served to other machines would be signed (InRelease) and the
# entry would name the key with Signed-By instead.
set -euo pipefail
cd "$(dirname "$0")/.."

debs=""
out=build/apt
while [ $# -gt 0 ]; do
  case "$1" in
    --debs) debs=${2:?--debs needs a directory}; shift 2 ;;
    -h | --help) sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    -*) echo "usage: $0 [--debs DIR] [OUT]" >&2; exit 2 ;;
    *) out=$1; shift ;;
  esac
done
command -v apt-ftparchive >/dev/null ||
  { echo "apt-repo: no apt-ftparchive: install apt-utils (scripts/install-deps.sh)" >&2; exit 1; }

if [ -z "$debs" ]; then
  source scripts/package-build.sh
  build_debian_packages
  debs=$deb_dir
fi
shopt -s nullglob
changes_files=("$debs"/*.changes)
shopt -u nullglob
if [ ${#changes_files[@]} -ne 1 ]; then
  echo "apt-repo: expected one .changes file in $debs, found ${#changes_files[@]}" >&2
  exit 1
fi
changes=${changes_files[0]}

# The files of the build, as its .changes lists them ("Files:": md5 size section priority
# name), but the .buildinfo, which apt has no use for.
mapfile -t files < <(awk '/^[^ ]/ {files = ($1 == "Files:")} files && /^ / {print $5}' "$changes" |
  grep -v '\.buildinfo$')
[ ${#files[@]} -gt 0 ] || { echo "apt-repo: $changes lists no files" >&2; exit 1; }

rm -rf "$out"
mkdir -p "$out"
for f in "${files[@]}"; do
  cp "$debs/$f" "$out/"
done
out=$(cd "$out" && pwd)
source_name=$(sed -n 's/^Source: //p' "$changes")
architectures=$(sed -n 's/^Architecture: //p' "$changes")
(
  cd "$out"
  # (-qq: no warning that the packages have no override entries, which only archives with
  # sections and priorities of their own need)
  apt-ftparchive -qq packages . >Packages
  apt-ftparchive -qq sources . >Sources
  gzip -9n --keep Packages Sources
  apt-ftparchive \
    -o APT::FTPArchive::Release::Origin="$source_name" \
    -o APT::FTPArchive::Release::Label="$source_name" \
    -o APT::FTPArchive::Release::Architectures="$architectures" \
    -o APT::FTPArchive::Release::Description="$source_name packages built from its source tree" \
    release . >"$out/Release.new"
  mv Release.new Release
)
cat >"$out/$source_name.sources" <<EOF
Types: deb deb-src
URIs: file:$out
Suites: ./
Trusted: yes
EOF
echo "apt-repo: $out: $(grep -c '^Package: ' "$out/Packages") binary packages and" \
  "$(grep -c '^Package: ' "$out/Sources") source package from $(basename "$changes")"
echo "apt-repo: to install from it: cp $out/$source_name.sources /etc/apt/sources.list.d/ &&" \
  "apt update && apt install libkvrouter-dev"
