#!/usr/bin/env bash
# Installs every Debian package kvrouter needs to build, test and benchmark.
# Idempotent: packages already installed are skipped, and apt is not touched at all
# when nothing is missing. Run as root on Debian 12.
set -euo pipefail

packages=(
  # build tools
  build-essential cmake ninja-build pkg-config clang-format
  # core
  libabsl-dev libxxhash-dev nlohmann-json3-dev
  # wire formats and ingestion
  libflatbuffers-dev flatbuffers-compiler libuv1-dev libnats-dev nats-server
  libzmq3-dev cppzmq-dev libmsgpack-cxx-dev
  # tests and benchmarks
  googletest libgtest-dev libcmocka-dev libbenchmark-dev
  # fuzzing and sanitizer runtimes
  clang-14 libclang-rt-14-dev
  # plots for the replay tool
  gnuplot-nox
  # Debian packages and their test (scripts/test-packaging.sh): cpack runs dpkg-shlibdeps
  # (dpkg-dev) and file; nm and readelf (binutils) inspect the library
  dpkg-dev file binutils
)

missing=()
for pkg in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages already installed"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: missing packages (${missing[*]}); run this script as root" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
