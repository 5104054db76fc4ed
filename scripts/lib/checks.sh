# Helpers of the check scripts (scripts/test-packaging.sh, scripts/test-routing-only.sh), sourced
# by them after `set -eEuo pipefail`. Each passed check is counted in $checks, which the script
# reports at its end; the first failure ends the script. Messages name the script ($0).

checks=0
checks_script=$(basename "$0" .sh)

ok() {  # ok WHAT...: one more check passed
  checks=$((checks + 1))
  echo "  ok: $*"
}

fail() {  # fail WHAT...: says what failed and exits 1
  echo "$checks_script: FAILED: $*" >&2
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
