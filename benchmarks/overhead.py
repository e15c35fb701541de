"""meshforge's training throughput as a ratio of a plain hand-written torch loop.

Same GPT, same data, same layout, 2 gloo workers on this machine; meshforge and the
plain loop alternate in one run so machine noise hits both alike. Layouts: DDP
(meshforge zero=0 vs torch DDP) and ZeRO-3 (meshforge zero=3 vs torch FSDP2).
Goal: ratio >= 0.97.

    python benchmarks/overhead.py [--reps 3] [--steps 60] [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from meshforge.launch.local import free_port

HERE = Path(__file__).resolve().parent
LAYOUTS = {"ddp": 0, "fsdp": 3}  # plain strategy -> meshforge ZeRO stage


def job(steps: int, zero: int) -> dict:
    return {
        "name": "overhead",
        "model": {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128},
        "parallel": {"zero": zero},
        "train": {
            "steps": steps,
            "global_batch": 16,
            "micro_batch": 8,
            "grad_clip": 0.0,
            "warmup": 5,
            "eval_every": 0,
        },
        "checkpoint": {"every": 0},
        "observe": {"log_every": 10},
    }


def run_meshforge(tmp: Path, steps: int, zero: int, nproc: int, rep: int) -> float:
    cfg = tmp / f"mf-{zero}-{rep}.yaml"
    cfg.write_text(yaml.safe_dump(job(steps, zero)))
    run_dir = tmp / f"run-{zero}-{rep}"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "meshforge",
            "train",
            str(cfg),
            "--nproc",
            str(nproc),
            "--run-dir",
            str(run_dir),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return json.loads((run_dir / "report.json").read_text())["tokens_per_s"]


def run_plain(strategy: str, steps: int, nproc: int) -> float:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            # A fresh rendezvous port each run (--standalone's fixed port can collide).
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            f"--nproc_per_node={nproc}",
            str(HERE / "plain_loop.py"),
            "--strategy",
            strategy,
            "--steps",
            str(steps),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    results: dict[str, list[tuple[float, float]]] = {s: [] for s in LAYOUTS}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for rep in range(args.reps):
            for strategy, zero in LAYOUTS.items():
                # Alternate which goes first, so warm caches favour neither side.
                if rep % 2 == 0:
                    mf = run_meshforge(tmp, args.steps, zero, args.nproc, rep)
                    plain = run_plain(strategy, args.steps, args.nproc)
                else:
                    plain = run_plain(strategy, args.steps, args.nproc)
                    mf = run_meshforge(tmp, args.steps, zero, args.nproc, rep)
                results[strategy].append((mf, plain))
                print(
                    f"rep {rep} {strategy:4s}: meshforge {mf:9.0f} tok/s  plain {plain:9.0f} "
                    f"tok/s  ratio {mf / plain:.3f}",
                    flush=True,
                )
    print()
    print(f"{'layout':18s} {'meshforge tok/s':>16s} {'plain tok/s':>12s} {'ratio':>7s}")
    for strategy, zero in LAYOUTS.items():
        pairs = results[strategy]
        mf = statistics.median(p[0] for p in pairs)
        plain = statistics.median(p[1] for p in pairs)
        ratio = statistics.median(p[0] / p[1] for p in pairs)
        name = f"zero={zero} vs {'DDP' if strategy == 'ddp' else 'FSDP2'}"
        print(f"{name:18s} {mf:16.0f} {plain:12.0f} {ratio:7.3f}")
    print(
        f"\n{args.nproc} workers, {args.steps} steps, {args.reps} alternating repetitions; "
        "ratio = median of per-repetition meshforge/plain throughput; goal >= 0.97"
    )


if __name__ == "__main__":
    main()
