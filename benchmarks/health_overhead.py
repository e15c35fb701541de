"""The flight record's cost: the same 2-rank job with `observe.flight` on and off,
alternating in one run so machine noise hits both alike.

With the record on, every phase change and every torch.distributed call updates a few
attributes, and a background thread writes RUN_DIR/health/flight-rank-K.json every
`--every` seconds. Printed: median step time and tokens/s per setting, and the ratio
on/off per round (goal: overhead under 1%).

    python benchmarks/health_overhead.py [--reps 5] [--steps 200] [--every 5] [--zero 0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import yaml
from emit import emit


def job(steps: int, zero: int, flight: bool, every: float) -> dict:
    return {
        "name": "health-overhead",
        "model": {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128},
        "parallel": {"zero": zero},
        "precision": {"dtype": "fp32"},
        "train": {"steps": steps, "global_batch": 16, "micro_batch": 8, "warmup": 5,
                  "eval_every": 0},
        "checkpoint": {"every": 0},
        "observe": {"log_every": 20, "flight": flight, "flight_every_s": every},
    }  # fmt: skip


def run(tmp: Path, name: str, cfg: dict) -> dict:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = tmp / f"run-{name}"
    env = {k: v for k, v in os.environ.items() if k != "MESHFORGE_FAULT"}
    subprocess.run(
        [sys.executable, "-m", "meshforge", "train", str(path), "--nproc", "2",
         "--run-dir", str(run_dir)],
        check=True, capture_output=True, timeout=900, env=env,
    )  # fmt: skip
    report = json.loads((run_dir / "report.json").read_text())
    flights = list((run_dir / "health").glob("flight-rank-*.json"))
    return {
        "step_time_s": report["step_time_s"],
        "tokens_per_s": report["tokens_per_s"],
        "flight_files": len(flights),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=float, default=5.0, help="observe.flight_every_s")
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    on, off = [], []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        for rep in range(args.reps):
            for flight, store in ((True, on), (False, off))[:: 1 if rep % 2 == 0 else -1]:
                r = run(tmp, f"{'on' if flight else 'off'}-{rep}",
                        job(args.steps, args.zero, flight, args.every))  # fmt: skip
                assert (r["flight_files"] == 2) == flight, r
                store.append(r)
                print(f"rep {rep} flight {'on ' if flight else 'off'}: step "
                      f"{1e3 * r['step_time_s']:.2f} ms, {r['tokens_per_s']:,.0f} tok/s",
                      file=sys.stderr, flush=True)  # fmt: skip
    ratio_step = statistics.median(
        a["step_time_s"] / b["step_time_s"] for a, b in zip(on, off, strict=True)
    )
    ratio_tps = statistics.median(
        a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(on, off, strict=True)
    )
    lines = [
        f"# benchmarks/health_overhead.py, {time.strftime('%Y-%m-%d')}, torch {version('torch')}, "
        f"{os.cpu_count()} cores, GPT d128 L4 s128, world 2, zero={args.zero}, "
        f"{args.steps} steps, flight_every_s={args.every}, {args.reps} rounds",
        f"{'flight':8s} {'step ms (median)':>17s} {'tok/s (median)':>15s}",
        f"{'on':8s} {1e3 * statistics.median(r['step_time_s'] for r in on):>17.2f} "
        f"{statistics.median(r['tokens_per_s'] for r in on):>15,.0f}",
        f"{'off':8s} {1e3 * statistics.median(r['step_time_s'] for r in off):>17.2f} "
        f"{statistics.median(r['tokens_per_s'] for r in off):>15,.0f}",
        f"step time on/off (median of per-round ratios): {ratio_step:.3f}  "
        f"(overhead {100 * (ratio_step - 1):+.1f}%)",
        f"tokens/s on/off (median of per-round ratios): {ratio_tps:.3f}",
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
