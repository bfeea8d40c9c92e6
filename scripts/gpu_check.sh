#!/usr/bin/env bash
# Everything zb checks on a GPU machine, in one go (about 8 minutes on one H100/H200):
#
#   bash scripts/gpu_check.sh [OUT_DIR]        # default: $OUT, else /tmp/zb-gpu-check
#
# 1. the machine (nvidia-smi, torch, CUDA, whether flash-attn imports);
# 2. scripts/gpu_smoke.py (every stage), the README's default `zb train` (which picks the GPU), and
#    beside them the test files whose code paths change when a GPU is visible;
# 3. scripts/bench_gpu.py diloco: two DiLoCo nodes sharing GPU 0, int8, params hashes compared, the
#    outer step split into device-to-host, all-reduce and host-to-device;
# 4. scripts/bench_gpu.py throughput: zb train against a plain PyTorch loop, 150M and 1B, with and
#    without torch.compile;
# 5. features (not in the default steps, about 6 minutes): scripts/bench_gpu.py features (int4 and int2
#    with error feedback, eager and streaming overlap, streaming under a round budget, a run secret
#    with clipping) and a DiLoCo-SWARM grid of 2 stages x 2 workers on the GPU, beside the test files.
# Each step writes one file to OUT_DIR (env.txt, smoke.txt, pytest.txt, diloco.txt, throughput.txt,
# features.txt)
# and the logs go into OUT_DIR/logs.tgz. GPU_CHECK_STEPS="smoke diloco" runs only those steps.
# Runs from the checkout with the machine's python3 (no install: PYTHONPATH), offline.
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-/tmp/zb-gpu-check}}
WORK=$(mktemp -d /tmp/zb-gpu-check.XXXXXX)
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
STEPS=${GPU_CHECK_STEPS:-"env smoke diloco throughput"}
TESTS="tests/test_train_gpu_paths.py tests/test_laptops.py tests/test_train_memory.py tests/test_dependencies.py
       tests/test_gpu_smoke.py tests/test_kernels.py tests/test_docmask.py tests/test_models.py tests/test_data.py"

want() { [[ " $STEPS " == *" $1 "* ]]; }
stamp() { echo "== $(date +%T) $*"; }
tests="" tests_ran=""
# The test files run once, on the CPUs beside the first step that checks correctness (smoke or features),
# and are over before a step whose timings count (diloco, throughput) starts.
start_tests() {
  [ -n "$tests_ran" ] && return
  ( stamp pytest; timeout 280 "$PY" -m pytest -q -p no:cacheprovider --timeout 120 $TESTS; echo "pytest rc=$?" ) \
    > "$OUT_DIR/pytest.txt" 2>&1 &
  tests=$! tests_ran=1
}
finish_tests() { if [ -n "$tests" ]; then wait "$tests"; tests=""; fi; }

if want env; then
  { stamp env; nvidia-smi; "$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))";
    "$PY" -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>&1 | tail -1;
    "$PY" -m pip list 2>/dev/null | grep -iE "^(torch|triton|numpy|safetensors|tokenizers|rich|click|pytest) "; } \
    > "$OUT_DIR/env.txt" 2>&1
fi

if want smoke; then
  start_tests
  { stamp smoke; timeout 300 "$PY" scripts/gpu_smoke.py --keep "$WORK/smoke"; echo "gpu_smoke rc=$?";
    stamp "default zb train"; timeout 120 "$PY" -m zb train --log.progress plain --log.dir "$WORK/default" \
      > "$WORK/default.log" 2>&1; echo "default zb train rc=$?"; grep -E "device|held-out|bf16" "$WORK/default.log" | head -8
  } > "$OUT_DIR/smoke.txt" 2>&1
fi

finish_tests
if want diloco; then
  { stamp diloco; timeout 240 "$PY" scripts/bench_gpu.py diloco --keep "$WORK/diloco"; echo "diloco rc=$?"; } \
    > "$OUT_DIR/diloco.txt" 2>&1
fi

if want throughput; then
  { stamp throughput; timeout 360 "$PY" scripts/bench_gpu.py throughput; echo "throughput rc=$?"; } \
    > "$OUT_DIR/throughput.txt" 2>&1
fi

if want features; then
  start_tests
  { stamp features; timeout 480 "$PY" scripts/bench_gpu.py features --seq 512 --inner-steps 8 --timeout 150 \
      --keep "$WORK/features"; echo "features rc=$?";
    stamp swarm; ZB_SIM_LOGDIR="$WORK/swarm" timeout 150 bash scripts/simulate_swarm.sh 2 2 @configs/debug/swarm.toml \
      --train.device cuda --optim.total_steps 60 --eval.interval -1; echo "swarm rc=$?"; } > "$OUT_DIR/features.txt" 2>&1
fi

finish_tests

stamp done >> "$OUT_DIR/env.txt"
tar czf "$OUT_DIR/logs.tgz" -C "$WORK" --exclude='*.safetensors' --exclude='*.pt' --exclude='*-ckpt' --exclude='*-ram' . 2>/dev/null
tail -n 25 "$OUT_DIR"/*.txt
