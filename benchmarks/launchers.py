"""The same 2-rank job through each way meshforge launches it, side by side.

  one host, train --nproc 2           the elastic agent starts both workers (reference)
  one host, submit mpi -np 2          mpirun starts them
  two hosts, train --nnodes 2         two network-namespace hosts joined by a veth pair,
                                      one agent each, c10d rendezvous, --iface
  two hosts, 1 Gbit/s  (tbf)          the same, every host's link capped
  two hosts, 200 Mbit/s (tbf)

Per case: wall time from the command to its exit (start-up, training, report) and the
training throughput from report.json, each as a ratio of the reference measured in the
same round. Rounds alternate the cases so machine noise hits all alike. What it shows:
launching through another path costs nothing once training runs, and how much of a
data-parallel step a slower link takes (DDP all-reduces every gradient each step).

Needs root (namespaces, tc) and mpirun; a case that cannot run is reported as skipped.

    python benchmarks/launchers.py [--reps 3] [--steps 40] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
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
sys.path.insert(0, str(HERE.parent / "tests"))  # the namespace-host helper


def job(steps: int) -> dict:
    return {
        "name": "launchers",
        "model": {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128},
        "parallel": {"zero": 0},
        "precision": {"dtype": "fp32"},
        "train": {"steps": steps, "global_batch": 16, "micro_batch": 8, "warmup": 5,
                  "eval_every": 0},
        "checkpoint": {"every": 0},
        "observe": {"log_every": 5},
    }  # fmt: skip


def _env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PET_", "GLOO_", "NCCL_", "MESHFORGE_FAULT"))
    }


def _result(run_dir: Path, wall_s: float) -> dict:
    report = json.loads((run_dir / "report.json").read_text())
    return {"wall_s": wall_s, "tokens_per_s": report["tokens_per_s"], "nodes": report["nodes"]}


def run_local(cfg: Path, run_dir: Path) -> dict:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "meshforge", "train", str(cfg), "--nproc", "2",
         "--run-dir", str(run_dir)],
        check=True, capture_output=True, timeout=600, env=_env(),
    )  # fmt: skip
    return _result(run_dir, time.perf_counter() - t0)


def run_mpi(cfg: Path, run_dir: Path) -> dict:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "meshforge", "submit", "mpi", str(cfg), "-np", "2",
         "--run-dir", str(run_dir)],
        check=True, capture_output=True, timeout=600, env=_env(),
    )  # fmt: skip
    return _result(run_dir, time.perf_counter() - t0)


def run_two_hosts(cfg: Path, run_dir: Path, hosts, port: int) -> dict:
    # Both "hosts" share this machine's cores: one thread per worker, as the one-host
    # cases get (a real node would give its worker all of its own cores).
    env = {**_env(), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            h.exec_argv(
                [
                    sys.executable,
                    "-m",
                    "meshforge",
                    "train",
                    str(cfg),
                    "--run-dir",
                    str(run_dir),
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "1",
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"{hosts[0].addr}:{port}",
                    "--rdzv-id",
                    f"bench{port}",
                    "--iface",
                    h.iface,
                ]
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for h in hosts
    ]
    try:
        errors = [p.communicate(timeout=600)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"two-host run failed: {errors[0][-500:]} {errors[1][-500:]}")
    return _result(run_dir, time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args()

    from cluster import netns_hosts

    cases = ["one host, train --nproc 2", "one host, submit mpi -np 2",
             "two hosts, train --nnodes 2", "two hosts, 1 Gbit/s (tbf)",
             "two hosts, 200 Mbit/s (tbf)"]  # fmt: skip
    results: dict[str, list[dict]] = {c: [] for c in cases}
    skipped: dict[str, str] = {}
    if shutil.which("mpirun") is None:
        skipped[cases[1]] = "mpirun not installed"
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        cfg = tmp / "job.yaml"
        cfg.write_text(yaml.safe_dump(job(args.steps)))
        nets = {}
        for case, rate in zip(cases[2:], (None, "1gbit", "200mbit"), strict=True):
            try:
                nets[case] = stack.enter_context(netns_hosts(2, rate=rate, prefix="bn"))
            except BaseException as exc:  # pytest.skip raises a BaseException subclass
                skipped[case] = f"no namespace hosts: {exc}"
        port = 29000 + os.getpid() % 500
        for rep in range(args.reps):
            for i, case in enumerate(cases):
                if case in skipped:
                    continue
                run_dir = tmp / f"run-{i}-{rep}"
                if i == 0:
                    r = run_local(cfg, run_dir)
                elif i == 1:
                    r = run_mpi(cfg, run_dir)
                else:
                    port += 1
                    r = run_two_hosts(cfg, run_dir, nets[case], port)
                results[case].append(r)
                print(f"rep {rep} {case}: {r['wall_s']:.1f} s, "
                      f"{r['tokens_per_s']:,.0f} tok/s, nodes {r['nodes']}",
                      file=sys.stderr, flush=True)  # fmt: skip

    ref = results[cases[0]]
    lines = [
        f"# benchmarks/launchers.py, {time.strftime('%Y-%m-%d')}, torch {version('torch')}, "
        f"{os.cpu_count()} cores, {args.steps} steps, DDP GPT d128 L4 s128, world 2, "
        f"{args.reps} rounds; ratios are medians of per-round ratios to the reference",
        f"{'case':32s} {'nodes':>5s} {'wall s':>8s} {'wall ratio':>10s} {'tok/s':>9s} "
        f"{'tok/s ratio':>11s}",
    ]
    for case in cases:
        if case in skipped:
            lines.append(f"{case:32s} skipped: {skipped[case]}")
            continue
        rs = results[case]
        wall = statistics.median(r["wall_s"] for r in rs)
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        wall_ratio = statistics.median(
            r["wall_s"] / b["wall_s"] for r, b in zip(rs, ref, strict=True)
        )
        tps_ratio = statistics.median(
            r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rs, ref, strict=True)
        )
        lines.append(
            f"{case:32s} {rs[0]['nodes']:>5d} {wall:>8.1f} {wall_ratio:>10.2f} {tps:>9,.0f} "
            f"{tps_ratio:>11.2f}"
        )
    emit(lines, args.out)


if __name__ == "__main__":
    main()
