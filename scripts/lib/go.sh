# Sourced by the scripts that run Go: sets $go to a Go toolchain, on PATH, in the official
# tarball's place or Debian's golang-1.2x-go (scripts/install-deps.sh), or exits saying so.
# Usage: find_go NAME (NAME: the calling script, for the message).
find_go() {
  go=$(command -v go || ls /usr/local/go/bin/go /usr/lib/go-1.2*/bin/go 2>/dev/null | tail -n1 || true)
  if [[ -z $go ]]; then
    echo "$1: no Go toolchain found (need go >= 1.21 on PATH or in /usr/local/go)" >&2
    exit 1
  fi
}
