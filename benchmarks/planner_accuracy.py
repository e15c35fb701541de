"""How well the planner predicts meshforge's own runs on this machine.

For each layout the CPU machine can run at world 1, 2 and 4 (ZeRO 0-3, with and
without gradient accumulation, activation checkpointing none and full; tensor
parallel 2 and pipeline parallel 2, alone, beside data parallel 2 and together; the
four pipeline schedules), one real
`meshforge train` run of a small GPT, and side by side:

* step time: measured median (report.json step_time_s) vs `predicted.step_time_s`
* model states per rank: measured (the largest rank) vs predicted, bytes
* peak memory: measured peak RSS (largest rank) vs the predicted total (planner's
  total + the process's own runtime baseline, see docs/planner.md)

each as a ratio measured / predicted. The prediction is the one the run itself made
(report.json `predicted`), on the profile it measured of this machine at its start.

Goals (issue 13): step time within 1.3x for every row, memory within 10%.

The per-data-parallel-rank batch stays 8 sequences (global batch 8·dp);
"accumulation" splits it into 2 micro-batches of 4. At world 1 only ZeRO-0 runs
(sharding over one rank changes nothing the planner models). A few rows of the
narrower d_model=32 GPT show how far a tiny model's step (a few milliseconds) is
predicted. A run times its own step with one and two layers per
stage at its start, so for the two-layer GPTs the prediction is close to a measurement;
the rows of a six-layer GPT (data parallel, ZeRO-1/3, pipelines: six, three or one and
two layers per stage) show the extrapolation. About 15 minutes on a 2-core machine.

    python benchmarks/planner_accuracy.py [--steps 12] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

SMALL_GPT = {"vocab_size": 256, "d_model": 128, "n_layers": 2, "n_heads": 4, "seq_len": 64}
TINY_GPT = {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32}
# six layers: beyond the one and two layers (per stage) a run times at its start, so its
# prediction is an extrapolation
DEEP_GPT = {**SMALL_GPT, "n_layers": 6}
MODELS = {"small": SMALL_GPT, "tiny": TINY_GPT, "deep": DEEP_GPT}
PER_RANK_BATCH = 8


def cases(quick: bool) -> list[dict]:
    """(model, world, zero, accumulation, checkpointing) combinations to run."""
    out = []

    def add(world, zero, accum, ckpt, model="small", tp=1, pp=1, schedule="1f1b"):
        out.append({"model": model, "world": world, "zero": zero, "accum": accum, "ckpt": ckpt,
                    "tp": tp, "pp": pp, "schedule": schedule})  # fmt: skip

    for accum in (False, True):
        for ckpt in ("none", "full"):
            add(1, 0, accum, ckpt)
    for zero in range(4):
        add(2, zero, False, "none")
        add(2, zero, True, "none")
        add(2, zero, False, "full")
    for zero in range(4):
        add(4, zero, False, "none")
    for zero in (0, 3):
        add(4, zero, True, "none")
        add(4, zero, False, "full")
    # tensor and pipeline parallel (pp: 1F1B over 2 micro-batches of 4), alone and with dp 2
    for world in (2, 4):
        add(world, 0, False, "none", tp=2)
        add(world, 0, True, "none", pp=2)
    add(2, 0, False, "none", "tiny")
    add(2, 3, False, "none", "tiny")
    # six layers: the prediction extrapolates from the one and two layers (per stage) a
    # run times at its start, across data-parallel, sharded and pipelined layouts
    add(2, 0, False, "none", "deep")
    add(2, 3, True, "none", "deep")
    add(4, 1, False, "none", "deep")
    add(4, 3, False, "none", "deep")
    for world in (2, 4):
        add(world, 0, True, "none", "deep", pp=2)
    # the other pipeline schedules (two stages per rank: the six layers over four stages),
    # and tensor-parallel stages of a pipeline
    add(2, 0, True, "none", pp=2, schedule="gpipe")
    add(2, 0, True, "none", "deep", pp=2, schedule="interleaved_1f1b")
    add(2, 0, True, "none", "deep", pp=2, schedule="zbv")
    add(4, 0, True, "none", tp=2, pp=2)
    if quick:
        keep = {(2, 0, False, "none", "small"), (2, 3, False, "none", "small")}
        out = [c for c in out if (c["world"], c["zero"], c["accum"], c["ckpt"], c["model"]) in keep]
    return out


def job(case: dict, steps: int) -> dict:
    micro = PER_RANK_BATCH // 2 if case["accum"] else PER_RANK_BATCH
    tp, pp = case.get("tp", 1), case.get("pp", 1)
    model = dict(MODELS[case["model"]])
    parallel: dict = {"zero": case["zero"], "tp": tp, "pp": pp}
    if pp > 1:  # the head and the embedding live on different stages
        model["tie_embeddings"] = False
        parallel["pp_schedule"] = case.get("schedule", "1f1b")
        if parallel["pp_schedule"] == "interleaved_1f1b":
            parallel["virtual_stages"] = 2
    return {
        "name": "planner-accuracy",
        "model": model,
        "parallel": parallel,
        "precision": {"dtype": "fp32"},
        "train": {
            "steps": steps,
            "global_batch": PER_RANK_BATCH * case["world"] // (tp * pp),
            "micro_batch": micro,
            "warmup": 2,
            "eval_every": 0,
            "activation_checkpointing": case["ckpt"],
        },
        "checkpoint": {"every": 0},
        "observe": {"log_every": 1},
    }


def run(case: dict, steps: int, root: Path) -> dict:
    name = f"{case['model']}-w{case['world']}-z{case['zero']}-a{int(case['accum'])}-{case['ckpt']}"
    name += f"-tp{case.get('tp', 1)}-pp{case.get('pp', 1)}-{case.get('schedule', '1f1b')}"
    config = root / f"{name}.yaml"
    config.write_text(yaml.safe_dump(job(case, steps)))
    run_dir = root / name
    cmd = [sys.executable, "-m", "meshforge", "train", str(config)]
    cmd += ["--nproc", str(case["world"]), "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        error = (proc.stderr.strip().splitlines() or ["?"])[-1]
        print(f"{name} failed; stderr:\n" + proc.stderr[-4000:], file=sys.stderr)
        for log in sorted((run_dir / "logs").glob("rank-*.log")):
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            print(f"{name} {log.name}: " + " | ".join(tail), file=sys.stderr)
        return {**case, "error": error}
    report = json.loads((run_dir / "report.json").read_text())
    predicted = report["predicted"]
    if not predicted or "error" in predicted:
        return {**case, "error": f"no prediction: {predicted}"}
    states = max(r["total"] for r in report["model_state_bytes"])
    return {
        **case,
        "micro": report["layout"]["micro_batch"],
        "grad_accum": report["layout"]["grad_accum"],
        "step": report["step_time_s"],
        "step_pred": predicted["step_time_s"],
        "states": states,
        "states_pred": predicted["model_state_bytes"]["total"],
        "peak": max(report["peak_memory_bytes"]),
        "peak_pred": predicted["memory_total_bytes"],
        "runtime": predicted["runtime_bytes"],
    }


SHORT = {"interleaved_1f1b": "inter"}  # a schedule's name in the layout column


def table(rows: list[dict]) -> str:
    head = (
        f"{'model':<6}{'N':>2} {'layout':>13} {'accum':>5} {'ckpt':>5} | {'step ms':>8} "
        f"{'pred':>7} {'ratio':>6} | {'states KiB':>10} {'pred':>8} {'ratio':>6} | "
        f"{'peak MiB':>8} {'pred':>7} {'ratio':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        layout = f"zero{r['zero']}"
        if r.get("tp", 1) > 1 or r.get("pp", 1) > 1:
            layout = f"tp{r.get('tp', 1)}pp{r.get('pp', 1)}"
            if r.get("pp", 1) > 1 and r.get("schedule", "1f1b") != "1f1b":
                layout += "-" + SHORT.get(r["schedule"], r["schedule"])
        lead = f"{r['model']:<6}{r['world']:>2} {layout:>13} {r.get('grad_accum', '-'):>5} "
        lead += f"{r['ckpt']:>5} | "
        if "error" in r:
            lines.append(lead + f"failed: {r['error']}")
            continue
        lines.append(
            lead
            + f"{1e3 * r['step']:>8.1f} {1e3 * r['step_pred']:>7.1f} "
            + f"{r['step'] / r['step_pred']:>6.2f} | "
            + f"{r['states'] / 1024:>10.1f} {r['states_pred'] / 1024:>8.1f} "
            + f"{r['states'] / r['states_pred']:>6.3f} | "
            + f"{r['peak'] / 2**20:>8.1f} {r['peak_pred'] / 2**20:>7.1f} "
            + f"{r['peak'] / r['peak_pred']:>6.2f}"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    out = []
    for model in MODELS:
        ok = [r for r in rows if "error" not in r and r["model"] == model]
        if not ok:
            continue
        ratios = [r["step"] / r["step_pred"] for r in ok]
        geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        within = sum(1 for x in ratios if 1 / 1.5 <= x <= 1.5)
        close = sum(1 for x in ratios if 1 / 1.3 <= x <= 1.3)
        states = [r["states"] / r["states_pred"] for r in ok]
        peaks = [r["peak"] / r["peak_pred"] for r in ok]
        out.append(
            f"{model}: {len(ok)} runs; step time measured/predicted: geometric mean "
            f"{geo:.2f}, range {min(ratios):.2f}-{max(ratios):.2f}, {close}/{len(ok)} within "
            f"1.3x, {within}/{len(ok)} within 1.5x; model states: range "
            f"{min(states):.3f}-{max(states):.3f}; peak memory: range {min(peaks):.2f}-"
            f"{max(peaks):.2f}, {sum(1 for x in peaks if 1 / 1.1 <= x <= 1.1)}/{len(ok)} "
            "within 10%"
        )
    failed = [r for r in rows if "error" in r]
    if failed:
        out.append(f"{len(failed)} run(s) failed")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument(
        "--quick", action="store_true", help="three runs only (DDP, ZeRO-3 and tp 2 at world 2)"
    )
    args = ap.parse_args()
    todo = cases(args.quick)
    rows = []
    load = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="planner-accuracy-") as tmp:
        for i, case in enumerate(todo, 1):
            t0 = time.perf_counter()
            rows.append(run(case, args.steps, Path(tmp)))
            print(
                f"[{i}/{len(todo)}] {case} {time.perf_counter() - t0:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    from importlib.metadata import version

    from meshforge.plan.jobs.auto import cpu_model_name

    print(
        f"machine: {cpu_model_name()}, {os.cpu_count()} cores, torch {version('torch')}; "
        f"load average before/after: {load[0]:.2f}/{os.getloadavg()[0]:.2f} "
        "(the machine is shared: other jobs' load shows in the measured times)"
    )
    print(
        f"planner accuracy: {len(rows)} runs of `meshforge train`, {args.steps} steps each, "
        f"{time.perf_counter() - started:.0f} s; small GPT d_model=128 n_layers=2 seq=64, "
        "tiny GPT d_model=32 n_layers=2 seq=32, deep GPT the small one with n_layers=6; "
        f"fp32, gloo, {PER_RANK_BATCH} sequences per rank per step; "
        "ratio = measured / predicted"
    )
    print(table(rows))
    print(summary(rows))


if __name__ == "__main__":
    main()
