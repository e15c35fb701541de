"""Ways to synchronise gradients on a slow link, side by side: throughput and scaling
efficiency of one GPT on two hosts for each communication mode.

  ddp              DDP, bucketed all-reduce overlapped with backward (the default)
  ddp no-overlap   DDP, gradients all-reduced after backward
  bf16 hook        DDP with gradients compressed to bf16 for the all-reduce
  powersgd r4      DDP with PowerSGD rank 4 (after 2 plain steps)
  ps sync          parameter server, 2 servers + 2 workers, one averaged update per step
  ps async K=2     parameter server, updates applied on arrival, staleness at most 2

Two hosts are network namespaces joined by a veth pair whose ends are capped with
`tbf` (1 Gbit/s, then 200 Mbit/s); one worker per host. meshforge launches the same
number of processes on every node, and servers are the last ranks, so the
parameter-server runs put both workers on one host and both servers on the other:
every push and pull crosses the link. Each worker gets one thread, so the workers
together use the machine's two cores. The per-host
batch is fixed (weak scaling): scaling efficiency is tokens/s on two hosts over twice
the tokens/s of one worker alone on one host, measured in the same run. Needs root.

    python benchmarks/comm_modes.py [--steps 10] [--reps 1] [--out FILE]
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
sys.path.insert(0, str(HERE.parent / "tests"))  # the namespace-host helpers

# ~10.8M parameters: 43 MB of fp32 gradients per step
MODEL = {"vocab_size": 256, "d_model": 384, "n_layers": 6, "n_heads": 6, "seq_len": 128}
PER_HOST_BATCH = 8

MODES: dict[str, dict] = {
    "ddp": {"zero": 0},
    "ddp no-overlap": {"zero": 0, "comm": {"overlap": False}},
    "bf16 hook": {"zero": 0, "comm": {"compression": "bf16"}},
    "powersgd r4": {"zero": 0, "comm": {"compression": "powersgd", "powersgd_rank": 4,
                                         "powersgd_warmup": 2}},
    "ps sync": {"mode": "parameter_server", "ps": {"servers": 2, "sync": True}},
    "ps async K=2": {"mode": "parameter_server",
                     "ps": {"servers": 2, "sync": False, "max_staleness": 2}},
}  # fmt: skip


def job(steps: int, hosts: int, parallel: dict) -> dict:
    return {
        "name": "comm-modes",
        "model": MODEL,
        "parallel": parallel,
        "train": {"steps": steps, "global_batch": PER_HOST_BATCH * hosts, "micro_batch": 4,
                  "warmup": 2, "eval_every": 0},
        "checkpoint": {"every": 0},
        "observe": {"log_every": 2, "flight": False},
        "runtime": {"threads_per_worker": 1},
    }  # fmt: skip


def _report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def one_host(tmp: Path, steps: int) -> dict:
    cfg = tmp / "one.yaml"
    cfg.write_text(yaml.safe_dump(job(steps, 1, {"zero": 0})))
    run_dir = tmp / f"one-{time.monotonic_ns()}"
    subprocess.run(
        [sys.executable, "-m", "meshforge", "train", str(cfg), "--nproc", "1",
         "--run-dir", str(run_dir)],
        check=True, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    return _report(run_dir)


def two_hosts(tmp: Path, steps: int, hosts, name: str, parallel: dict) -> dict:
    from cluster import train_on_hosts

    cfg = tmp / "two.yaml"
    cfg.write_text(yaml.safe_dump(job(steps, 2, parallel)))
    run_dir = tmp / f"two-{time.monotonic_ns()}"
    # 2 workers + 2 servers: two processes per node
    nproc = 2 if parallel.get("mode") == "parameter_server" else 1
    train_on_hosts(hosts, cfg, run_dir, nproc_per_node=nproc, timeout_s=900)
    return _report(run_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--rates", default="1gbit,200mbit")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args()
    from cluster import netns_hosts

    rates = args.rates.split(",")
    modes = [m.strip() for m in args.modes.split(",")]
    tps: dict[tuple[str, str], list[float]] = {}
    eff: dict[tuple[str, str], list[float]] = {}
    exposed: dict[tuple[str, str], list[float]] = {}
    failed: dict[tuple[str, str], str] = {}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        for rep in range(args.reps):
            for rate in rates:
                with netns_hosts(2, rate=rate, prefix="bc") as hosts:
                    for mode in modes:
                        base = one_host(tmp, args.steps)["tokens_per_s"]
                        key = (rate, mode)
                        try:
                            r = two_hosts(tmp, args.steps, hosts, mode, MODES[mode])
                        except Exception as exc:  # a mode that fails is reported, not fatal
                            failed[key] = str(exc).strip().splitlines()[-1][:120]
                            print(f"{rate} {mode}: failed: {failed[key]}", file=sys.stderr)
                            continue
                        tps.setdefault(key, []).append(r["tokens_per_s"])
                        eff.setdefault(key, []).append(r["tokens_per_s"] / (2 * base))
                        frac = (r.get("time_breakdown") or {}).get("exposed_comm")
                        if frac is not None:
                            exposed.setdefault(key, []).append(frac)
                        print(f"rep {rep} {rate} {mode}: {r['tokens_per_s']:,.0f} tok/s, "
                              f"one host {base:,.0f}", file=sys.stderr, flush=True)  # fmt: skip

    lines = [
        f"# benchmarks/comm_modes.py, {time.strftime('%Y-%m-%d')}, torch {version('torch')}, "
        f"{os.cpu_count()} cores, GPT d{MODEL['d_model']} L{MODEL['n_layers']} "
        f"s{MODEL['seq_len']} (~10.8M params, 43 MB fp32 gradients), {PER_HOST_BATCH} "
        f"sequences per host per step, {args.steps} steps, {args.reps} round(s), 2 namespace "
        f"hosts (tbf cap), 1 thread per worker",
        f"{'link':8s} {'mode':15s} {'tok/s':>8s} {'vs ddp':>7s} {'scaling eff':>11s} "
        f"{'exposed comm':>12s}",
    ]
    for rate in rates:
        ddp = tps.get((rate, "ddp"))
        for mode in modes:
            key = (rate, mode)
            if key in failed:
                lines.append(f"{rate:8s} {mode:15s} failed: {failed[key]}")
                continue
            t = statistics.median(tps[key])
            vs = f"{t / statistics.median(ddp):.2f}x" if ddp else "n/a"
            e = statistics.median(eff[key])
            x = f"{statistics.median(exposed[key]):.0%}" if exposed.get(key) else "n/a"
            lines.append(f"{rate:8s} {mode:15s} {t:8,.0f} {vs:>7s} {e:11.0%} {x:>12s}")
        best = max((statistics.median(tps[(rate, m)]), m) for m in modes if (rate, m) in tps)
        if ddp:
            lines.append(
                f"{rate:8s} best: {best[1]}, {best[0] / statistics.median(ddp):.2f}x plain DDP"
            )
    emit(lines, args.out)


if __name__ == "__main__":
    main()
