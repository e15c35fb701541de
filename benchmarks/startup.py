"""Start fast, stop fast: meshforge train against a plain torchrun loop of the same job.

Per case (2 ranks; DDP against torch DDP, ZeRO-3 against FSDP2), alternating in each
round so that machine noise hits both alike:

  to first step   the command's start (just before it is spawned) to the first
                  training step (meshforge: report.json timing.first_step_at; the
                  plain loop: the time its rank 0 enters the first step)
  after last      the end of the last step to the command's exit
  final ckpt      meshforge's final checkpoint write (timing.final_checkpoint_s);
                  the plain loop writes none

Beside them, meshforge with its workers started as fresh interpreters (no zygote:
MESHFORGE_ZYGOTE=0; launch/zygote.py), and, for DDP, the gap of an elastic restart
(rank 1 killed after step 12, max_restarts 1, resumed from the step-10 checkpoint:
report.json timing.restart_gaps_s) with and without the zygote.

Goals (issue 14): meshforge's time to first step at most 1.1x the plain loop's, and
its time after the last step at most its final checkpoint's write time plus 0.3 s.
The machine profile is measured once beforehand (a run with --recalibrate), as a
second run on the same machine finds it: this measures the steady state of a machine
meshforge has seen, not its first run there.

    python benchmarks/startup.py [--rounds 5] [--steps 20] [--out FILE]
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

HERE = Path(__file__).resolve().parent
CASES = (("ddp", 0), ("fsdp", 3))  # (plain loop strategy, meshforge parallel.zero)


def job(steps: int, zero: int) -> dict:
    return {
        "name": "startup",
        "model": {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128},
        "parallel": {"zero": zero},
        "precision": {"dtype": "fp32"},
        "train": {"steps": steps, "global_batch": 16, "micro_batch": 8, "warmup": 5,
                  "eval_every": 0, "grad_clip": 0.0},
        "checkpoint": {"every": 0},
        "observe": {"log_every": 10},
    }  # fmt: skip


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "MESHFORGE_FAULT"))}


def run_meshforge(
    cfg: Path, run_dir: Path, extra: tuple[str, ...] = (), env: dict | None = None
) -> dict:
    cmd = [sys.executable, "-m", "meshforge", "train", str(cfg), "--nproc", "2",
           "--run-dir", str(run_dir), *extra]  # fmt: skip
    t0 = time.time()
    subprocess.run(cmd, check=True, capture_output=True, timeout=600, env={**_env(), **(env or {})})
    t1 = time.time()
    timing = json.loads((run_dir / "report.json").read_text())["timing"]
    return {
        "first_step_s": timing["first_step_at"] - t0,
        "after_last_s": t1 - timing["last_step_at"],
        "final_checkpoint_s": timing["final_checkpoint_s"],
        "restart_gaps_s": timing["restart_gaps_s"],
    }


FRESH = {"MESHFORGE_ZYGOTE": "0"}


def restart_job(steps: int) -> dict:
    spec = job(max(steps, 20), 0)
    spec["train"]["max_restarts"] = 1
    spec["checkpoint"] = {"every": 5}
    return spec


def run_plain(strategy: str, steps: int, timeline: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(HERE / "plain_loop.py"), "--strategy", strategy, "--steps", str(steps),
           "--log-every", "10", "--global-batch", "16", "--timeline", str(timeline)]  # fmt: skip
    t0 = time.time()
    subprocess.run(cmd, check=True, capture_output=True, timeout=600, env=_env())
    t1 = time.time()
    marks = json.loads(timeline.read_text())
    return {
        "first_step_s": marks["first_step_start"] - t0,
        "after_last_s": t1 - marks["last_step_end"],
        "final_checkpoint_s": None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    started = time.time()
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        configs = {}
        for strategy, zero in CASES:
            configs[strategy] = tmp / f"{strategy}.yaml"
            configs[strategy].write_text(yaml.safe_dump(job(args.steps, zero)))
        configs["restart"] = tmp / "restart.yaml"
        configs["restart"].write_text(yaml.safe_dump(restart_job(args.steps)))
        # the machine measured once, as any later run on this machine finds it
        for strategy, _ in CASES:
            run_meshforge(configs[strategy], tmp / f"calibrate-{strategy}", ("--recalibrate",))
        for rnd in range(args.rounds):
            for strategy, _ in CASES:
                whos = ["meshforge", "fresh", "plain"]
                order = whos[rnd % 3 :] + whos[: rnd % 3]
                for who in order:
                    if who == "plain":
                        r = run_plain(strategy, args.steps, tmp / f"plain-{strategy}-{rnd}.json")
                    else:
                        env = FRESH if who == "fresh" else None
                        run_dir = tmp / f"run-{strategy}-{who}-{rnd}"
                        r = run_meshforge(configs[strategy], run_dir, env=env)
                    results.setdefault((strategy, who), []).append(r)
                    first, last = r["first_step_s"], r["after_last_s"]
                    print(f"round {rnd} {strategy:4s} {who:9s}: first step {first:.2f} s, "
                          f"after last {last:.2f} s", file=sys.stderr, flush=True)  # fmt: skip
            for who in ("meshforge", "fresh") if rnd % 2 == 0 else ("fresh", "meshforge"):
                env = {"MESHFORGE_FAULT": "kill:12:1", **(FRESH if who == "fresh" else {})}
                run_dir = tmp / f"restart-{who}-{rnd}"
                r = run_meshforge(configs["restart"], run_dir, env=env)
                results.setdefault(("restart", who), []).append(r)
                print(f"round {rnd} restart {who:9s}: gap {r['restart_gaps_s']}",
                      file=sys.stderr, flush=True)  # fmt: skip

    def med(strategy: str, who: str, key: str) -> float:
        return statistics.median(r[key] for r in results[(strategy, who)])

    lines = [
        f"# benchmarks/startup.py, {time.strftime('%Y-%m-%d')}, torch {version('torch')}, "
        f"{os.cpu_count()} cores, load average before/after {load0:.2f}/{os.getloadavg()[0]:.2f}",
        f"# GPT d128 L4 s128, 2 ranks, {args.steps} steps, {args.rounds} alternating rounds, "
        f"{time.time() - started:.0f} s; medians over rounds; ratio = meshforge / plain "
        "(median of per-round ratios)",
        f"{'layout':22s} {'first step: mf':>15s} {'no zygote':>9s} {'plain':>7s} {'ratio':>6s}   "
        f"{'after last: mf':>15s} {'plain':>7s} {'final ckpt':>10s} {'mf - ckpt':>9s}",
    ]
    for strategy, zero in CASES:
        mf, plain = results[(strategy, "meshforge")], results[(strategy, "plain")]
        ratio = statistics.median(
            m["first_step_s"] / p["first_step_s"] for m, p in zip(mf, plain, strict=True)
        )
        excess = statistics.median(m["after_last_s"] - m["final_checkpoint_s"] for m in mf)
        name = f"zero={zero} vs {'torch DDP' if strategy == 'ddp' else 'FSDP2'}"
        lines.append(
            f"{name:22s} {med(strategy, 'meshforge', 'first_step_s'):14.2f}s "
            f"{med(strategy, 'fresh', 'first_step_s'):8.2f}s "
            f"{med(strategy, 'plain', 'first_step_s'):6.2f}s {ratio:6.3f}   "
            f"{med(strategy, 'meshforge', 'after_last_s'):14.2f}s "
            f"{med(strategy, 'plain', 'after_last_s'):6.2f}s "
            f"{med(strategy, 'meshforge', 'final_checkpoint_s'):9.2f}s {excess:8.2f}s"
        )
    gaps = {
        who: statistics.median(r["restart_gaps_s"][0] for r in results[("restart", who)])
        for who in ("meshforge", "fresh")
    }
    lines.append(
        f"restart gap (zero=0, rank 1 killed after step 12, resumed from step 10): "
        f"{gaps['meshforge']:.2f} s with the zygote, {gaps['fresh']:.2f} s without "
        f"({gaps['meshforge'] / gaps['fresh']:.2f}x)"
    )
    lines.append("# goals: first-step ratio <= 1.1; after last - final ckpt <= 0.3 s")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
