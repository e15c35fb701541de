"""meshforge's training throughput as a ratio of a plain hand-written torch loop.

Same GPT, same data, same layout, 2 gloo workers on this machine; meshforge and the
plain loop alternate in one run so machine noise hits both alike. Layouts:

  DDP     meshforge zero=0                 vs torch DDP
  ZeRO-3  meshforge zero=3                 vs torch FSDP2
  TP      meshforge tp=N (dp=1)            vs DTensor parallelize_module + loss_parallel
  PP      meshforge pp=N, 1f1b, m=4        vs PipelineStage + Schedule1F1B driven by hand

(N = --nproc). Per layout both sides see the same per-rank batch: 8 sequences per
rank under DDP/ZeRO-3, the whole global batch of 16 as one micro-batch under TP, and
4 micro-batches of 4 under PP (untied head on both sides, as PP needs).
Goal: ratio >= 0.97.

    python benchmarks/overhead.py [--reps 3] [--steps 80] [--nproc 2] [--layouts ddp,fsdp,tp,pp]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import yaml

from meshforge.launch.local import free_port
from meshforge.plan.jobs.auto import cpu_model_name

HERE = Path(__file__).resolve().parent
GLOBAL_BATCH = 16
PP_MICRO_BATCH = 4  # 4 pipeline micro-batches per step


def layouts(nproc: int) -> dict[str, dict]:
    """plain strategy -> the table's name, meshforge's parallel section and micro-batch."""
    return {
        "ddp": {"name": "zero=0 vs DDP", "parallel": {"zero": 0}, "micro": 8},
        "fsdp": {"name": "zero=3 vs FSDP2", "parallel": {"zero": 3}, "micro": 8},
        "tp": {"name": f"tp={nproc} vs plain TP", "parallel": {"tp": nproc}, "micro": 16},
        "pp": {
            "name": f"pp={nproc} vs plain PP",
            "parallel": {"pp": nproc, "pp_schedule": "1f1b"},
            "micro": PP_MICRO_BATCH,
        },
    }


def job(steps: int, layout: dict) -> dict:
    pp = layout["parallel"].get("pp", 1) > 1
    return {
        "name": "overhead",
        "model": {
            "d_model": 128,
            "n_layers": 4,
            "n_heads": 4,
            "seq_len": 128,
            "tie_embeddings": not pp,
        },
        "parallel": layout["parallel"],
        "train": {
            "steps": steps,
            "global_batch": GLOBAL_BATCH,
            "micro_batch": layout["micro"],
            "grad_clip": 0.0,
            "warmup": 5,
            "eval_every": 0,
        },
        "checkpoint": {"every": 0},
        "observe": {"log_every": 10},
    }


def run_meshforge(
    tmp: Path, steps: int, strategy: str, layout: dict, nproc: int, rep: int
) -> tuple[float, float]:
    cfg = tmp / f"mf-{strategy}-{rep}.yaml"
    cfg.write_text(yaml.safe_dump(job(steps, layout)))
    run_dir = tmp / f"run-{strategy}-{rep}"
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
    report = json.loads((run_dir / "report.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r["tokens_per_s"] for r in rows[1:]] or [report["tokens_per_s"]]
    return report["tokens_per_s"], max(steady)


def run_plain(strategy: str, steps: int, nproc: int, layout: dict) -> tuple[float, float]:
    for attempt in range(2):
        cmd = [
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
            "--global-batch",
            str(GLOBAL_BATCH),
            "--micro-batch",
            str(layout["micro"]),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        lines = out.stdout.strip().splitlines()
        if lines and lines[-1].startswith("{"):
            if out.returncode != 0:
                # seen with plain torch too: a rank aborts at interpreter exit ("terminate
                # called without an active exception") after rank 0 printed its result
                print(
                    f"plain {strategy}: rc {out.returncode} at exit, after its result",
                    file=sys.stderr,
                    flush=True,
                )
            res = json.loads(lines[-1])
            return res["tokens_per_s"], res["best"]
        # no result: say why, then retry once (e.g. a rendezvous port taken meanwhile)
        errors = [ln for ln in out.stderr.splitlines() if "Error" in ln] or out.stderr.splitlines()
        print(
            f"plain {strategy} failed (attempt {attempt + 1}, rc {out.returncode}): "
            + " | ".join(errors[-3:]),
            file=sys.stderr,
            flush=True,
        )
    raise RuntimeError(f"plain {strategy} failed twice")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--layouts", default="ddp,fsdp,tp,pp", help="plain strategies to compare")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "overhead.txt")
    args = ap.parse_args()
    all_layouts = layouts(args.nproc)
    chosen = {s: all_layouts[s] for s in args.layouts.split(",")}
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0]))] + sys.argv[1:])
    load = os.getloadavg()
    started = time.perf_counter()
    lines: list[str] = []

    def emit(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    # per layout, per repetition: ((meshforge median, best), (plain median, best))
    results: dict[str, list[tuple[tuple[float, float], tuple[float, float]]]] = {
        s: [] for s in chosen
    }
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for rep in range(args.reps):
            for strategy, layout in chosen.items():
                # Alternate which goes first, so warm caches favour neither side.
                if rep % 2 == 0:
                    mf = run_meshforge(tmp, args.steps, strategy, layout, args.nproc, rep)
                    plain = run_plain(strategy, args.steps, args.nproc, layout)
                else:
                    plain = run_plain(strategy, args.steps, args.nproc, layout)
                    mf = run_meshforge(tmp, args.steps, strategy, layout, args.nproc, rep)
                results[strategy].append((mf, plain))
                emit(
                    f"rep {rep} {strategy:4s}: meshforge {mf[0]:9.0f} tok/s  plain "
                    f"{plain[0]:9.0f} tok/s  ratio {mf[0] / plain[0]:.3f}  (best intervals "
                    f"{mf[1]:.0f} / {plain[1]:.0f} = {mf[1] / plain[1]:.3f})"
                )
    emit("")
    emit(
        f"{'layout':20s} {'meshforge tok/s':>16s} {'plain tok/s':>12s} {'ratio':>7s} "
        f"{'best-interval ratio':>20s}"
    )
    for strategy, layout in chosen.items():
        pairs = results[strategy]
        mf = statistics.median(p[0][0] for p in pairs)
        plain = statistics.median(p[1][0] for p in pairs)
        ratio = statistics.median(p[0][0] / p[1][0] for p in pairs)
        best = statistics.median(p[0][1] / p[1][1] for p in pairs)
        emit(f"{layout['name']:20s} {mf:16.0f} {plain:12.0f} {ratio:7.3f} {best:20.3f}")
    emit(
        f"\n{args.nproc} workers, {args.steps} steps, {args.reps} alternating repetitions, "
        f"{time.perf_counter() - started:.0f} s; ratio = median of per-repetition "
        "meshforge/plain throughput (median of the steady logging intervals each); "
        "best-interval ratio: the same with each run's fastest steady interval, the one "
        "least disturbed by other load on this shared machine; goal >= 0.97"
    )
    header = [
        f"machine: {cpu_model_name()}, {os.cpu_count()} cores, torch {version('torch')}; "
        f"load average before/after: {load[0]:.2f}/{os.getloadavg()[0]:.2f} "
        "(the machine is shared: other jobs' load shows in the measured times)",
        f"command: {command}",
        "GPT d_model=128 n_layers=4 heads=4 seq=128, fp32, gloo, global batch "
        f"{GLOBAL_BATCH}; tp/pp: dp=1; pp: {GLOBAL_BATCH // PP_MICRO_BATCH} micro-batches "
        f"of {PP_MICRO_BATCH}, untied head",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(header + lines) + "\n")
    print(f"written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
