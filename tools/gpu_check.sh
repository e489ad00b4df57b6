#!/usr/bin/env bash
# make gpu-check: everything kvchat needs to know from a machine with an NVIDIA GPU and no network,
# in one run of a few minutes. Each step writes under $OUT (default /tmp/kvchat-gpu-check) and the
# run goes on when one fails; the exit status says whether all passed.
#   tools/gpu_check.sh               on the GPU machine (its python3 holds torch, triton, transformers)
#   tools/gpu_check.sh --device cpu  the rehearsal here, on a tiny shape
# Wheels the GPU machine lacks come from .whl/ (make gpu-wheels).
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
[ "${1:-}" = "--device" ] && DEVICE=${2:-cuda}
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/kvchat-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVCHAT_HOME=${KVCHAT_HOME:-/tmp/kvchat-gpu-home}
failed=()

# The project without its GUI and server dependencies: wheels onto a path, the three packages by link.
SITE=/tmp/kvchat-site
mkdir -p "$SITE/kvchat"
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || failed+=(wheels)
fi
touch "$SITE/kvchat/__init__.py"
for p in app engine kernels; do ln -sfn "$PWD/$p" "$SITE/kvchat/$p"; done
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME SECONDS COMMAND...: output to $OUT/NAME.log, the JSON a bench prints to $OUT/NAME.json
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "== $name"
    if timeout "$limit" "$@" >"$OUT/$name.json" 2>"$OUT/$name.log"; then
        echo "   ok in $((SECONDS - t0)) s"
    else
        echo "   FAILED ($?) in $((SECONDS - t0)) s; last lines:"
        tail -n 15 "$OUT/$name.log"
        failed+=("$name")
    fi
    [ -s "$OUT/$name.json" ] || rm -f "$OUT/$name.json"
}
kv() { $PY -m kvchat.engine.cli "$@"; }

if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.txt" 2>&1
    cat "$OUT/gpu.txt"
    SHAPE=engine/shapes/llama-3.1-8b.json DTYPE=bfloat16 TRITON_INTERPRET=0
else
    SHAPE=engine/shapes/tiny-llama.json DTYPE=float32 TRITON_INTERPRET=1
fi
export TRITON_INTERPRET
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

step kernel_tests 240 $PY -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_decode_step.py \
    -k "not starter and not falls_back" --junitxml="$OUT/kernel_tests.xml"
[ "$DEVICE" = cuda ] && step bench_kernels 120 kv bench kernels --json
step decode_bf16 200 kv bench decode --random-weights "$SHAPE" --device "$DEVICE" --dtype "$DTYPE" --repeats 2 --json
for ctx in 8192 32768; do
    [ "$DEVICE" = cpu ] && [ "$ctx" = 32768 ] && continue
    for p in fp16 int8 int4; do
        step "kv_${p}_${ctx}" 120 kv bench decode --random-weights "$SHAPE" --device "$DEVICE" --dtype "$DTYPE" \
            --kv-precision "$p" --prompt-len "$ctx" --new-tokens 64 --repeats 1 --paths eager,compiled --json
    done
done
if [ "$DEVICE" = cuda ] && $PY -c "import bitsandbytes" 2>/dev/null; then
    step decode_nf4 150 kv bench decode --random-weights "$SHAPE" --device cuda --dtype bfloat16 --weights nf4 \
        --repeats 1 --paths eager,compiled,transformers --json
fi

# one line per bench, so the closing note can quote it
$PY - "$OUT" <<'EOF'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())
    if "paths" not in r:
        continue
    paths = ", ".join(f"{k} {v['decode_tok_s']:.1f} tok/s ({v['roofline_fraction']:.0%})" for k, v in r["paths"].items())
    print(f"{f.stem}: roofline {r['roofline_tok_s']:.1f} tok/s at {r['bandwidth_gb_s']:.0f} GB/s; {paths}")
EOF
if [ ${#failed[@]} -gt 0 ]; then echo "gpu-check: FAILED: ${failed[*]}"; exit 1; fi
echo "gpu-check: all steps passed"
