"""What watching a run costs: the same 2-rank job with every sink and the system sampler
on, and with all of them off, alternating in one run so machine noise hits both alike.

  on   the system sampler (every --sample seconds), the flight record, TensorBoard,
       Weights & Biases (offline; when the wandb package is installed) and the
       Prometheus endpoint, scraped over loopback every --scrape seconds by this script
       for the whole run, as a Prometheus server would (--on picks some of them)
  off  none of them: only metrics.jsonl and the console

Printed: median step time and tokens/s per setting, and the per-round ratios on/off
(goal: overhead under 2%). Throughput is the run's median over its logged intervals
(report.json tokens_per_s), which counts every step, logged or not.

    python benchmarks/observe_overhead.py [--reps 5] [--steps 200] [--on LIST] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from importlib.metadata import version
from pathlib import Path

import yaml
from emit import emit

WANDB = importlib.util.find_spec("wandb") is not None


SINKS = ("sampler", "flight", "tensorboard", "prometheus", "wandb")


def job(steps: int, on: tuple[str, ...], port: int, sample_s: float) -> dict:
    observe: dict = {"log_every": 10, "flight": "flight" in on, "system": "sampler" in on}
    observe["sample_every_s"] = sample_s
    observe["tensorboard"] = "tensorboard" in on
    if "prometheus" in on:
        observe["prometheus_port"] = port
    if "wandb" in on:
        observe["wandb"] = {"project": "meshforge-bench", "mode": "offline"}
    return {
        "name": "observe-overhead",
        "model": {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128},
        "parallel": {"zero": 0},
        "precision": {"dtype": "fp32"},
        "train": {"steps": steps, "global_batch": 16, "micro_batch": 8, "warmup": 5,
                  "eval_every": 0},
        "checkpoint": {"every": 0},
        "observe": observe,
    }  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_until(url: str, every_s: float, done: threading.Event, count: list[int]) -> None:
    """Scrape like a Prometheus server until `done`; count the answered scrapes."""
    while not done.wait(every_s):
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                response.read()
            count[0] += 1
        except OSError:
            pass  # not up yet, or gone


def run(tmp: Path, name: str, cfg: dict, scrape_s: float) -> dict:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = tmp / f"run-{name}"
    env = {k: v for k, v in os.environ.items() if k != "MESHFORGE_FAULT"}
    env["WANDB_SILENT"] = "true"
    done, scrapes = threading.Event(), [0]
    port = cfg["observe"].get("prometheus_port")
    scraper = None
    if port:
        url = f"http://127.0.0.1:{port}/metrics"
        scraper = threading.Thread(target=scrape_until, args=(url, scrape_s, done, scrapes))
        scraper.start()
    try:
        subprocess.run(
            [sys.executable, "-m", "meshforge", "train", str(path), "--nproc", "2",
             "--run-dir", str(run_dir)],
            check=True, capture_output=True, timeout=900, env=env,
        )  # fmt: skip
    finally:
        done.set()
        if scraper is not None:
            scraper.join()
    report = json.loads((run_dir / "report.json").read_text())
    samples = sum(len(p.read_text().splitlines()) for p in run_dir.glob("system/*.jsonl"))
    return {
        "step_time_s": report["step_time_s"],
        "tokens_per_s": report["tokens_per_s"],
        "samples": samples,
        "scrapes": scrapes[0],
        "tensorboard": (run_dir / "tensorboard").is_dir(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sample", type=float, default=2.0, help="observe.sample_every_s")
    ap.add_argument("--scrape", type=float, default=1.0, help="seconds between scrapes")
    ap.add_argument(
        "--on",
        default=",".join(s for s in SINKS if s != "wandb" or WANDB),
        help=f"what 'on' turns on, comma-separated, of {','.join(SINKS)} (default: all)",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    chosen = tuple(s for s in args.on.split(",") if s)
    unknown = set(chosen) - set(SINKS)
    if unknown or ("prometheus" in chosen and "flight" not in chosen):
        ap.error(f"--on: choose from {','.join(SINKS)} (prometheus needs flight)")
    on, off = [], []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        for rep in range(args.reps):
            for watched, store in ((True, on), (False, off))[:: 1 if rep % 2 == 0 else -1]:
                cfg = job(args.steps, chosen if watched else (), free_port(), args.sample)
                r = run(tmp, f"{'on' if watched else 'off'}-{rep}", cfg, args.scrape)
                assert r["tensorboard"] == (watched and "tensorboard" in chosen), r
                assert (r["samples"] > 0) == (watched and "sampler" in chosen), r
                store.append(r)
                print(f"rep {rep} sinks {'on ' if watched else 'off'}: step "
                      f"{1e3 * r['step_time_s']:.2f} ms, {r['tokens_per_s']:,.0f} tok/s, "
                      f"{r['samples']} samples, {r['scrapes']} scrapes",
                      file=sys.stderr, flush=True)  # fmt: skip
    ratio_step = statistics.median(
        a["step_time_s"] / b["step_time_s"] for a, b in zip(on, off, strict=True)
    )
    ratio_tps = statistics.median(
        a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(on, off, strict=True)
    )
    sinks = ", ".join(chosen)
    lines = [
        f"# benchmarks/observe_overhead.py, {time.strftime('%Y-%m-%d')}, torch "
        f"{version('torch')}, {os.cpu_count()} cores, GPT d128 L4 s128, world 2, zero=0, "
        f"{args.steps} steps, log_every 10, {args.reps} rounds",
        f"# on = {sinks}; sample_every_s={args.sample}, scraped every {args.scrape} s",
        f"{'sinks':8s} {'step ms (median)':>17s} {'tok/s (median)':>15s} "
        f"{'samples':>8s} {'scrapes':>8s}",
    ]
    for label, runs in (("on", on), ("off", off)):
        lines.append(
            f"{label:8s} {1e3 * statistics.median(r['step_time_s'] for r in runs):>17.2f} "
            f"{statistics.median(r['tokens_per_s'] for r in runs):>15,.0f} "
            f"{statistics.median(r['samples'] for r in runs):>8.0f} "
            f"{statistics.median(r['scrapes'] for r in runs):>8.0f}"
        )
    lines += [
        f"step time on/off (median of per-round ratios): {ratio_step:.3f}  "
        f"(overhead {100 * (ratio_step - 1):+.1f}%)",
        f"tokens/s on/off (median of per-round ratios): {ratio_tps:.3f}  "
        f"(overhead {100 * (1 / ratio_tps - 1):+.1f}%)",
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
