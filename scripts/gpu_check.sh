#!/usr/bin/env bash
# GPU readiness check: one command, under 5 minutes on one GPU.
# Trains a ~124M-parameter GPT in bf16 for 100 steps (fused AdamW, SDPA flash
# attention) with meshforge's own trainer and prints tokens/s and MFU; then the
# same with torch.compile; then a small mixture of experts in bf16 (grouped GEMM);
# then document masking through FlexAttention against the explicit mask; then cp's
# ring attention kernels. Output: stdout, and OUT_DIR/gpu_check.txt.
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
  # document masking through FlexAttention (models/attention.py): compiled flex_attention
  # with a block mask vs SDPA with the explicit mask, a tiny Llama (GQA) on packed
  # documents, fp32: logits and gradients; then the unit tests (their CUDA-only gradient
  # tests included)
  echo "-- document masking: flex_attention vs explicit mask"
  timeout 240 "$PY" - <<'PYEOF' || echo "flex check failed: $?"
import os, time, torch
from meshforge.models.attention import ATTENTION_ENV, documents_of
from meshforge.models.llama import Llama, LlamaArgs
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
args = LlamaArgs(vocab_size=256, d_model=256, n_layers=2, n_heads=8, n_kv_heads=2,
                 seq_len=1024, ffn_hidden=512)
model = Llama(args).to(dev)
idx = torch.randint(1, 256, (2, 1024), device=dev)
idx[idx < 8] = 0  # ~3% separators: dozens of documents a row, EOT id 0
def run(path):
    os.environ[ATTENTION_ENV] = path
    model.zero_grad(set_to_none=True)
    with torch.enable_grad() if dev == "cuda" else torch.no_grad():  # no CPU flex backward
        t = time.perf_counter()
        logits = model(idx, docs=documents_of(idx, 0))
        if dev == "cuda":
            logits.float().square().mean().backward()
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return logits.detach(), grads, dt
run("mask"), run("flex")  # warm-up: flex_attention and create_block_mask compile
want, gwant, t_mask = run("mask")
got, ggot, t_flex = run("flex")
diff = (got - want).abs().max().item()
gdiff = max([(a - b).abs().max().item() for a, b in zip(ggot, gwant)], default=float("nan"))
ok = diff < 1e-4 and (dev != "cuda" or (len(ggot) == len(gwant) and gdiff < 1e-4))
print(f"RESULT flex device={dev} max_abs_diff={diff:.2e} grad_max_abs_diff={gdiff:.2e} "
      f"step_flex={t_flex*1e3:.1f}ms step_mask={t_mask*1e3:.1f}ms {'OK' if ok else 'MISMATCH'}")
PYEOF
  timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_flex_document_masking.py \
    || echo "flex unit tests failed: $?"
  # context parallelism's ring attention with CUDA kernels (flash in bf16, memory-efficient
  # in fp32), the cp ranks as threads on the one GPU (NCCL cannot run two ranks on one
  # GPU: the real exchange needs two), against world 1's attention
  echo "-- cp ring attention: CUDA kernels"
  OMP_NUM_THREADS=1 timeout 240 "$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/unit/test_context_split.py -k "cuda_device or cuda_kernels or ring" \
    || echo "ring unit tests failed: $?"
} 2>&1 | tee "$log"
rm -rf "$RUNS"
