#!/usr/bin/env bash
# The whole GPU verification, in as few device calls as possible (docs/gpu.md).
#
# Here, once (this machine has the package registries; the GPU machine has none):
#     bash bench/gpu_run.sh wheels        # .whl/: FlashInfer and what the GPU image lacks
# There, in the repository root, with .whl (and .fi-aot, once a run has built the kernels)
# carried along, any stages in order:
#     bash bench/gpu_run.sh setup warm aot tests serve bench-small bench-8b serving
# Every stage writes $OUT/<stage>.log (OUT defaults to /tmp/gpu-out) and prints its tail;
# a stage that fails or runs out of time does not stop the next.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
SITE=/tmp/tandem-site
FLASHINFER_VERSION=0.6.13
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$SITE:$PWD/server:$PWD/operator:$PWD"
export FLASHINFER_WORKSPACE_BASE="$PWD/.fi-cache" MAX_JOBS="${MAX_JOBS:-16}"

wheels() {
  # The GPU image's python3 is 3.12 with torch, transformers, numpy, httpx, jinja2 and more;
  # these are what it lacks (versions as the test extra resolves them here).
  local platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl \
    "flashinfer-python==$FLASHINFER_VERSION" "apache-tvm-ffi==0.1.15.post2" \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
    fastapi==0.165.0 starlette==1.10.0 opentelemetry-api uvicorn==0.54.0 httptools==0.9.0 \
    pyzmq==27.3.0 gguf==0.19.0 xgrammar==0.2.8 "openai<3" jiter distro sniffio \
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
    rpds-py==2026.9.1 kubernetes==37.0.2 durationpy==0.11 oauthlib==4.0.1 \
    requests-oauthlib==2.0.0 websocket-client==1.9.2 aiohttp-retry
  du -sh .whl
}

setup() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
  nvcc --version | tail -2
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl || return 1
  if [ -d .fi-aot ]; then  # kernels a former run built: FlashInfer loads them as AOT modules
    local aot="$SITE/flashinfer/data/aot"
    mkdir -p "$aot"
    for f in .fi-aot/*.tar.gz; do tar -xzf "$f" -C "$aot"; done
    ls "$aot"
  fi
  python3 -c "import flashinfer, xgrammar, fastapi; print('flashinfer', flashinfer.__version__)"
}

warm() {
  # Build the kernels the tests and benchmarks use, one process per module (head size 128;
  # bf16 and fp16; the plain decode kernel and FA2 prefill, which tensor-core decode shares;
  # the fused RMSNorm, rotary and SiLU * up). Modules already carried as AOT are not rebuilt.
  local pids=() jobs=(norm rope act)
  for dtype in bfloat16 float16; do jobs+=("$dtype:decode" "$dtype:prefill"); done
  for job in "${jobs[@]}"; do
    # shellcheck disable=SC2086
    MAX_JOBS=6 python3 bench/gpu_warm.py ${job/:/ } &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  return $rc
}

aot() {
  # The built modules in one archive, to come back in $OUT and be carried as .fi-aot next time.
  local ops
  ops=$(find .fi-cache -type d -name cached_ops | head -1)
  [ -n "$ops" ] || { echo "no built modules"; return 1; }
  (cd "$ops" && tar -czf "$OUT/fi-aot.tar.gz" */*.so && tar -tzf "$OUT/fi-aot.tar.gz")
  ls -la "$OUT/fi-aot.tar.gz"
}

tests() {
  python3 -m pytest -p no:cacheprovider -q -rs -m cuda -o addopts="" \
    tests/engine/test_flashinfer_backend.py tests/engine/test_cuda_graphs.py tests/engine/test_gpu_exactness.py \
    tests/api/test_update_weights.py tests/test_bench_gpu.py tests/engine/test_cuda_ops.py
}

serve() {
  # The API tests against `tandem serve`, the proxy over prefill + decode, and `tandem up`,
  # on the GPU: bf16 models at head size 128, FlashInfer, CUDA graphs.
  TANDEM_TEST_GPU=1 python3 -m pytest -p no:cacheprovider -q -rs -o addopts="" \
    tests/api/test_structured_output.py tests/api/test_lifecycle.py tests/disagg/test_http_flow.py \
    tests/test_local_up.py
}

serving() {
  python3 bench/gpu_serve.py "$@"
}

bench() {
  python3 bench/gpu.py "$@"
}

run_stage() {
  local name=$1 stage=$2 limit=$3
  shift 3
  echo "=== $name (limit ${limit}s) $(date +%T)"
  local start=$SECONDS
  timeout "$limit" bash -c "$(declare -f "$stage"); $(declare -p SITE FLASHINFER_VERSION OUT); $stage $*" \
    >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.log"
  echo "=== $name: rc=$rc in $((SECONDS - start))s"
}

for stage in "$@"; do
  case "$stage" in
    wheels) wheels ;;
    setup) run_stage setup setup 120 ;;
    warm) run_stage warm warm 300 ;;
    aot) run_stage aot aot 60 ;;
    tests) run_stage tests tests 240 ;;
    serve) run_stage serve serve 240 ;;
    bench-small) run_stage bench-small bench 300 --models qwen3-0.6b ;;
    bench-8b) run_stage bench-8b bench 420 --models llama-3.1-8b ;;
    steps-small) run_stage steps-small bench 200 --models qwen3-0.6b --steps-only --profile-batches 1 8 ;;
    steps-8b) run_stage steps-8b bench 300 --models llama-3.1-8b --steps-only --profile-batches 1 8 ;;
    serving) run_stage serving serving 420 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
