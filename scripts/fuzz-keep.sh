#!/usr/bin/env bash
# Keeps what long fuzz runs found: merges each harness's working corpus (build/fuzz-corpus/
# <harness>, grown by scripts/fuzz-long.sh) with what the repository already keeps
# (tests/fuzz/corpus/<harness>) into the smallest set of inputs that reaches the same coverage
# (libFuzzer's -merge=1), and writes that set to tests/fuzz/corpus/<harness>, to be committed.
# CI's bounded runs replay it before fuzzing, and long runs on another machine start from it
# instead of from the seeds alone (build/ does not move between machines).
#
#   scripts/fuzz-keep.sh [HARNESS...]     (default: every harness with a working corpus)
#
# Uses the harnesses scripts/fuzz-long.sh built (build/fuzz).
set -euo pipefail
cd "$(dirname "$0")/.."

harnesses=("$@")
if [ ${#harnesses[@]} -eq 0 ]; then
  mapfile -t harnesses < <(ls build/fuzz-corpus 2>/dev/null | grep '_fuzzer$' || true)
fi

# The bytes of the inputs in a directory (0 if it is missing or empty).
bytes_in() { { find "$1" -type f -printf '%s\n' 2>/dev/null || true; } | awk '{ s += $1 } END { print s + 0 }'; }

for name in "${harnesses[@]}"; do
  fuzzer=build/fuzz/tests/fuzz/$name
  [ -x "$fuzzer" ] || { echo "$name: $fuzzer not built (scripts/fuzz-long.sh builds it)" >&2; exit 1; }
  kept=tests/fuzz/corpus/$name
  merged=$(mktemp -d)
  sources=()
  for dir in "build/fuzz-corpus/$name" "$kept"; do
    [ ! -d "$dir" ] || sources+=("$dir")
  done
  [ ${#sources[@]} -gt 0 ] || { echo "$name: nothing to keep"; continue; }
  before=$(bytes_in "$kept")
  "$fuzzer" -merge=1 -rss_limit_mb=2048 "$merged" "${sources[@]}" >"build/fuzz-keep-$name.log" 2>&1
  rm -rf "$kept"
  mkdir -p "$kept"
  cp "$merged"/* "$kept"/ 2>/dev/null || true
  rm -rf "$merged"
  printf '%-28s %6s inputs, %9s bytes (kept before: %s bytes)\n' "$name" \
    "$(ls "$kept" | wc -l)" "$(bytes_in "$kept")" "$before"
done
