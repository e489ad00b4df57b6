#!/usr/bin/env bash
# make gpu-check: everything kvchat needs to know from a machine with an NVIDIA GPU and no network,
# in one run of a few minutes. Logs go to $OUT/log.txt (default OUT=/tmp/kvchat-gpu-check), each
# bench's JSON to one line of $OUT/results.jsonl, the tests' report to $OUT/kernel_tests.xml (few
# files: at most 8 come back from the GPU machine). The run goes on when a step fails; the exit
# status says whether all passed.
#   tools/gpu_check.sh               on the GPU machine (its python3 holds torch, triton, transformers)
#   tools/gpu_check.sh --device cpu  the rehearsal here, on a tiny shape
#   STEPS="kernel_tests decode_bf16" tools/gpu_check.sh   only those steps
# Wheels the GPU machine lacks come from .whl/ (make gpu-wheels).
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
[ "${1:-}" = "--device" ] && DEVICE=${2:-cuda}
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/kvchat-gpu-check}
mkdir -p "$OUT"
rm -f "$OUT/log.txt" "$OUT/results.jsonl"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVCHAT_HOME=${KVCHAT_HOME:-/tmp/kvchat-gpu-home}
failed=()

# The project without its GUI and server dependencies: wheels onto a path, the source tree (src/) on it.
SITE=/tmp/kvchat-site
mkdir -p "$SITE"
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || failed+=(wheels)
fi
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
KV="$PY -m kvchat.cli.main"

step() {  # step NAME SECONDS COMMAND...; STEPS="a b" runs only the steps named
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]] && return 0
    echo "== $name" | tee -a "$OUT/log.txt"
    if timeout "$limit" "$@" >"$OUT/stdout.tmp" 2>>"$OUT/log.txt"; then
        echo "   ok in $((SECONDS - t0)) s" | tee -a "$OUT/log.txt"
    else
        echo "   FAILED ($?) in $((SECONDS - t0)) s; last lines:" | tee -a "$OUT/log.txt"
        tail -n 15 "$OUT/log.txt"
        failed+=("$name")
    fi
    $PY tools/gpu_check_collect.py step "$name" "$OUT"
}

if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$OUT/log.txt"
    SHAPE=src/kvchat/bench/shapes/llama-3.1-8b.json DTYPE=bfloat16 TRITON_INTERPRET=0
else
    SHAPE=src/kvchat/bench/shapes/tiny-llama.json DTYPE=float32 TRITON_INTERPRET=1
fi
export TRITON_INTERPRET
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/log.txt"

# Most important first: a run cut off by its time limit loses only what comes after, and each step's
# results are filed as it ends. Tests that need the starter model (not on the GPU machine) carry
# "starter" in their names; -k matches names only.
step kernel_tests 240 $PY -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_decode_step.py \
    tests/engine/test_cuda_path.py -k "not starter and not falls_back" --junitxml="$OUT/kernel_tests.xml"
LONG=32768 MID=8192
[ "$DEVICE" = cpu ] && LONG=2048 MID=1024
kv() {  # kv PRECISION CONTEXT: the captured step only (eager at long context told little last time)
    step "kv_$1_$2" 90 $KV bench decode --random-weights "$SHAPE" --device "$DEVICE" --dtype "$DTYPE" \
        --kv-precision "$1" --prompt-len "$2" --new-tokens 32 --repeats 1 --paths compiled --json
}
kv int4 $LONG
kv fp16 $LONG
step bench_kernels 120 $KV bench kernels --json
kv int8 $LONG
kv fp8 $LONG  # issue 30's bar: within 5% of int8's at 32k
kv int4 $MID
kv fp16 $MID
# a 24 GB RTX card on the big GPU: Auto's pool, a 16k and a 32k prompt, then the full pool to int8
CAPPED="--memory 24GiB --prompts 16384,32768"
[ "$DEVICE" = cpu ] && CAPPED="--memory 2GiB --prompts 1024,2048"
step capped_24gb 150 $KV bench capped --random-weights "$SHAPE" --device "$DEVICE" --dtype "$DTYPE" $CAPPED --json
step decode_bf16 150 $KV bench decode --random-weights "$SHAPE" --device "$DEVICE" --dtype "$DTYPE" --repeats 2 \
    --paths eager,compiled --json

$PY tools/gpu_check_collect.py summary "$OUT" | tee -a "$OUT/log.txt"
if [ ${#failed[@]} -gt 0 ]; then echo "gpu-check: FAILED: ${failed[*]}"; exit 1; fi
echo "gpu-check: all steps passed"
