#!/usr/bin/env bash
# GPU readiness check: one command, under 5 minutes on one GPU.
# Trains a ~124M-parameter GPT in bf16 for 100 steps (fused AdamW, SDPA flash
# attention) with meshforge's own trainer and prints tokens/s and MFU; then the
# same with torch.compile; then a small mixture of experts in bf16 (grouped GEMM). Output: stdout, and OUT_DIR/gpu_check.txt.
#   scripts/gpu_check.sh [OUT_DIR]          (PYTHON=... to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
RUNS=$(mktemp -d)
log="$OUT/gpu_check.txt"
{
  echo "== meshforge GPU check $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  for compile in false true; do
    echo "-- torch.compile=$compile"
    timeout 200 "$PY" -m meshforge train examples/gpt-125m-gpu.yaml --nproc 1 \
      --run-dir "$RUNS/compile-$compile" --set train.compile=$compile || echo "run failed: $?"
    "$PY" - "$RUNS/compile-$compile/report.json" <<'PYEOF' || true
import json, sys
r = json.load(open(sys.argv[1]))
mfu = r["mfu"]
print(f"RESULT compile={r['layout']} params={r['model_params']/1e6:.1f}M "
      f"tokens/s={r['tokens_per_s']:.0f} MFU={'unknown' if mfu is None else f'{mfu:.1%}'} "
      f"step={r['step_time_s']:.3f}s peak_mem={max(r['peak_memory_bytes'])/2**30:.1f}GiB "
      f"peak={r['peak_flops']}")
PYEOF
  done
  # a mixture of experts in bf16: torch._grouped_mm's forward and backward (sm90+),
  # which no CPU runs; one GPU cannot hold two NCCL ranks, so ep stays 1 here
  echo "-- mixture of experts (moe-tiny preset, bf16, grouped GEMM)"
  timeout 120 "$PY" -m meshforge train examples/moe-tiny.yaml --nproc 1 \
    --run-dir "$RUNS/moe" --set parallel.ep=1 --set precision.dtype=bf16 \
    --set train.steps=30 --set train.eval_every=0 || echo "run failed: $?"
  "$PY" - "$RUNS/moe/report.json" <<'PYEOF' || true
import json, sys
r = json.load(open(sys.argv[1]))
print(f"RESULT moe first_loss={r['first_loss']:.3f} final_loss={r['final_loss']:.3f} "
      f"tokens/s={r['tokens_per_s']:.0f} dropped={r['moe'].get('dropped')}")
PYEOF
} 2>&1 | tee "$log"
rm -rf "$RUNS"
