#!/usr/bin/env bash
# Fails on any #include in src/ that points up a layer, or outside src/ past what it tests (below). The layers, lowest first:
#
#   core (src/core)  <-  wire (src/wire)  <-  ingest (src/ingest)  <-  capi (src/capi)
#
# A file of a layer may include its own layer's headers and those of the layers below it
# ("core/router.h" from src/wire), never those above; no "../" path; and only the C layer
# includes the public header (kvrouter.h, kvrouter_version.h). The build enforces the same where
# it can (each layer's target exposes only its own include directory, cmake/Layers.cmake); this
# reads the sources, so it also catches what a relative path or a directory the compiler happens
# to see would let through. Run by ctest (layers.include_direction).
#
# Usage: scripts/check-layers.sh [ROOT]   (ROOT: the directory holding src/; default: this
# checkout)
set -euo pipefail
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
layers=(core wire ingest capi)

rank_of() {  # rank_of LAYER: its position in $layers, or -1
  local i
  for i in "${!layers[@]}"; do
    [ "${layers[$i]}" = "$1" ] && { echo "$i"; return; }
  done
  echo -1
}

violations=0
checked=0
report() {  # report WHERE MESSAGE...
  echo "$1: ${*:2}" >&2
  violations=$((violations + 1))
}

# includes_of DIR: "FILE:LINE TARGET" for every #include of the C and C++ files under DIR.
includes_of() {
  local file rel lineno line
  while IFS= read -r -d '' file; do
    rel=${file#"$root"/}
    lineno=0
    while IFS= read -r line; do
      lineno=$((lineno + 1))
      [[ $line =~ ^[[:space:]]*#[[:space:]]*include[[:space:]]*[\"\<]([^\"\>]+)[\"\>] ]] &&
        echo "$rel:$lineno ${BASH_REMATCH[1]}"
    done <"$file"
  done < <(find "$1" -type f \( -name '*.h' -o -name '*.hpp' -o -name '*.cc' -o -name '*.cpp' \
    -o -name '*.c' -o -name '*.inc' \) -print0 | sort -z)
}

for layer in "${layers[@]}"; do
  [ -d "$root/src/$layer" ] || continue
  rank=$(rank_of "$layer")
  while read -r where target; do
    checked=$((checked + 1))
    if [[ $target == *../* || $target == ../* ]]; then
      report "$where" "#include \"$target\": no relative path out of the directory"
      continue
    fi
    if [[ $target == kvrouter.h || $target == kvrouter_version.h ]]; then
      [ "$layer" = capi ] ||
        report "$where" "#include \"$target\": only src/capi includes the public C header"
      continue
    fi
    first=${target%%/*}
    [ "$first" != "$target" ] || continue  # a header beside this file, or a system one
    target_rank=$(rank_of "$first")
    [ "$target_rank" -ge 0 ] || continue  # absl/..., flatbuffers/..., nats/..., ...
    if [ "$target_rank" -gt "$rank" ]; then
      report "$where" "#include \"$target\": $layer may not include $first (a layer above it;" \
        "the order is ${layers[*]})"
    fi
  done < <(includes_of "$root/src/$layer")
done

# Outside src/: what uses the library sees the layers it tests and no more. A layer's tests may
# include that layer and those below it (tests/capi_internal: the C ABI's white-box tests, which
# reach behind a handle to bring about what only the insides can); everything that stands for a user of the library (the
# C ABI's tests, the model test, the fault tests, the soak, the replay tool and its tests,
# kvrouterd and its tests, the examples, the header and packaging tests) goes through the public
# header only. Benchmarks and fuzzers measure and attack internals wherever they are: not listed.
declare -A consumers=(
  [tests/core]=core [tests/wire]=wire [tests/ingest]=ingest [tests/capi_internal]=capi
  [tests/capi]=none [tests/model]=none [tests/fault]=none [tests/soak]=none [tests/replay]=none
  [tests/headers]=none [tests/abi]=none [tests/package]=none [tools/replay]=none [examples]=none
  [service/kvrouterd]=none [tests/service]=none
)
for dir in "${!consumers[@]}"; do
  [ -d "$root/$dir" ] || continue
  top=${consumers[$dir]}
  top_rank=$([ "$top" = none ] && echo -1 || rank_of "$top")
  while read -r where target; do
    first=${target%%/*}
    [ "$first" != "$target" ] || continue
    target_rank=$(rank_of "$first")
    [ "$target_rank" -ge 0 ] || continue
    checked=$((checked + 1))
    if [ "$target_rank" -gt "$top_rank" ]; then
      if [ "$top" = none ]; then
        report "$where" "#include \"$target\": $dir uses the library as a user does," \
          "through kvrouter.h only"
      else
        report "$where" "#include \"$target\": tests of $top may not include $first"
      fi
    fi
  done < <(includes_of "$root/$dir")
done

if [ "$violations" -gt 0 ]; then
  echo "layers: $violations include(s) point up a layer (of $checked checked)" >&2
  exit 1
fi
echo "layers: $checked includes checked, none points up a layer (${layers[*]}), and none" \
  "outside src/ reaches past what it tests"
