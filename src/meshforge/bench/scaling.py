"""`meshforge scale`: one job trained at several world sizes, and its scaling efficiency.

Each size is a real `meshforge train` run (a subprocess, its own run directory
OUT/world-N), so every figure comes from that run's report.json. Each `meshforge scale`
measures anew: its runs start with `--fresh`, so a run directory left by an earlier
scale of the same job is replaced, never resumed or extended.

Scaling efficiency is the brief's definition (REFERENCES.md):

    speedup    = single-node time ÷ (distributed time + communication overhead time)
    efficiency = speedup ÷ number of workers

mapped onto measured quantities as time per sample of work (a sample is one
sequence of the global batch), so that weak and strong scaling read the same way:

    T(N)              = step_time_s(N) ÷ global_batch(N)     (median step, report.json)
    comm overhead(N)  = exposed_comm(N) · T(N)                (time_breakdown.exposed_comm)
    distributed(N)    = T(N) − comm overhead(N)
    single-node time  = T(N0), N0 the smallest size run (normally 1)
    speedup(N)        = T(N0) ÷ (distributed(N) + comm overhead(N)) = T(N0) ÷ T(N)
    efficiency(N)     = speedup(N) ÷ (N ÷ N0)

With --mode strong the global batch stays as configured (speedup = step-time ratio);
with --mode weak it grows with the world size, global_batch(N) = B·N/N0, so each
worker keeps the same share (efficiency = step-time ratio).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from meshforge.config import apply_override, build_config, load_raw
from meshforge.errors import ConfigError
from meshforge.fileio import atomic_writer, write_text_atomic
from meshforge.rundir.report import read_report

MODES = ("weak", "strong")


@dataclass
class ScaleRow:
    world_size: int
    global_batch: int
    status: str  # completed | failed
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    time_per_sample_s: float | None = None
    comm_overhead_fraction: float | None = None  # report time_breakdown.exposed_comm
    comm_overhead_time_per_sample_s: float | None = None
    speedup: float | None = None
    efficiency: float | None = None
    layout: dict[str, Any] | None = None
    run_dir: str = ""
    error: str | None = None


@dataclass
class ScaleResult:
    config: str
    mode: str
    reference_world_size: int
    rows: list[ScaleRow]

    @property
    def ok(self) -> bool:
        return all(r.status == "completed" for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "mode": self.mode,
            "reference_world_size": self.reference_world_size,
            "definition": (
                "speedup = T(N0) / (distributed + comm overhead) per sample = T(N0)/T(N); "
                "efficiency = speedup / (N/N0); T = step_time_s / global_batch"
            ),
            "rows": [asdict(r) for r in self.rows],
        }


def parse_nproc_list(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; ConfigError on anything else."""
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or any(not p for p in parts):
        raise ConfigError(f"--nproc must be a comma-separated list of world sizes, got {text!r}")
    sizes = []
    for p in parts:
        try:
            n = int(p)
        except ValueError:
            raise ConfigError(f"--nproc: {p!r} is not a whole number (in {text!r})") from None
        if n < 1:
            raise ConfigError(f"--nproc: world sizes must be >= 1, got {n} (in {text!r})")
        sizes.append(n)
    if len(set(sizes)) != len(sizes):
        raise ConfigError(f"--nproc lists a world size twice: {text!r}")
    return sorted(sizes)


def global_batches(base: int, sizes: list[int], mode: str) -> dict[int, int]:
    """Global batch per world size: fixed (strong) or B·N/N0 (weak)."""
    if mode not in MODES:
        raise ConfigError(f"--mode must be weak or strong, got {mode!r}")
    if mode == "strong":
        return {n: base for n in sizes}
    n0 = sizes[0]
    out = {}
    for n in sizes:
        if (base * n) % n0:
            raise ConfigError(
                f"--mode weak: train.global_batch={base} x {n} is not divisible by the "
                f"smallest world size {n0}"
            )
        out[n] = base * n // n0
    return out


def plan_runs(
    config: Path, sizes: list[int], mode: str, overrides: list[str]
) -> tuple[dict[int, int], str]:
    """Validate the config at every size before any run starts; (global batch per
    size, job name)."""
    raw = load_raw(config)
    for assignment in overrides:
        apply_override(raw, assignment)
    cfg = build_config(raw)
    batches = global_batches(cfg.train.global_batch, sizes, mode)
    for n, gb in batches.items():
        sized = build_config({**raw, "train": {**raw.get("train", {}), "global_batch": gb}})
        if sized.parallel != "auto":
            try:
                sized.check_trainable()
                sized.resolve_dp(n)
            except ConfigError as exc:
                raise ConfigError(f"world size {n}: {exc}") from None
    return batches, cfg.name


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def row_from_report(n: int, gb: int, run_dir: Path, report: dict[str, Any]) -> ScaleRow:
    step = _number(report.get("step_time_s"))
    breakdown = report.get("time_breakdown") or {}
    comm = _number(breakdown.get("exposed_comm"))
    per_sample = step / gb if step is not None else None
    return ScaleRow(
        world_size=n,
        global_batch=gb,
        status=str(report.get("status", "completed")),
        step_time_s=step,
        tokens_per_s=_number(report.get("tokens_per_s")),
        time_per_sample_s=per_sample,
        comm_overhead_fraction=comm,
        comm_overhead_time_per_sample_s=(
            comm * per_sample if comm is not None and per_sample is not None else None
        ),
        layout=report.get("layout"),
        run_dir=str(run_dir),
    )


def add_speedups(rows: list[ScaleRow]) -> int:
    """Fill speedup and efficiency against the smallest completed size; returns it."""
    done = [r for r in rows if r.status == "completed" and r.time_per_sample_s]
    if not done:
        return rows[0].world_size if rows else 0
    ref = min(done, key=lambda r: r.world_size)
    for r in done:
        distributed = r.time_per_sample_s * (1.0 - (r.comm_overhead_fraction or 0.0))
        overhead = r.time_per_sample_s * (r.comm_overhead_fraction or 0.0)
        r.speedup = ref.time_per_sample_s / (distributed + overhead)
        r.efficiency = r.speedup / (r.world_size / ref.world_size)
    return ref.world_size


def _train(
    config: Path, n: int, run_dir: Path, overrides: list[str], timeout_s: float
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "meshforge", "train", str(config), "--nproc", str(n)]
    cmd += ["--run-dir", str(run_dir), "--fresh"]
    for assignment in overrides:
        cmd += ["--set", assignment]
    env = {k: v for k, v in os.environ.items() if k != "MESHFORGE_FAULT"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)


def run_scaling(
    config: Path,
    sizes: list[int],
    mode: str = "strong",
    overrides: list[str] | None = None,
    out_dir: Path | None = None,
    timeout_s: float = 3600.0,
    progress=None,
) -> ScaleResult:
    """Train `config` at each world size (one after the other) and collect the rows."""
    overrides = list(overrides or [])
    batches, name = plan_runs(config, sizes, mode, overrides)
    out_dir = Path(out_dir or Path("runs") / f"{name}-scale")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in sizes:
        run_dir = out_dir / f"world-{n}"
        if progress is not None:
            progress(f"world size {n}: global batch {batches[n]} -> {run_dir}")
        sets = [*overrides, f"train.global_batch={batches[n]}"]
        proc = _train(config, n, run_dir, sets, timeout_s)
        if proc.returncode == 2:  # bad input at this size: the train command said why
            message = (proc.stderr.strip().splitlines() or ["invalid input"])[-1]
            raise ConfigError(f"world size {n}: {message.removeprefix('meshforge: error: ')}")
        report = read_report(run_dir) or {}
        if proc.returncode != 0 or report.get("status") != "completed":
            tail = (proc.stderr.strip().splitlines() or ["no error output"])[-1]
            rows.append(ScaleRow(n, batches[n], "failed", run_dir=str(run_dir), error=tail))
            continue
        rows.append(row_from_report(n, batches[n], run_dir, report))
    ref = add_speedups(rows)
    return ScaleResult(str(config), mode, ref, rows)


def write_outputs(result: ScaleResult, out_dir: Path) -> tuple[Path, Path | None]:
    """scale.json (atomically) and scale.png; the plot is skipped if it cannot be drawn."""
    out_dir = Path(out_dir)
    path = out_dir / "scale.json"
    write_text_atomic(path, json.dumps(result.to_dict(), indent=2))
    png = out_dir / "scale.png"
    try:
        plot_scaling(result, png)
    except Exception:  # the JSON is the record; a plot is a convenience
        return path, None
    return path, png


def plot_scaling(result: ScaleResult, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in result.rows if r.speedup is not None]
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    sizes = [r.world_size for r in rows]
    ref = result.reference_world_size or 1
    ax1.plot(sizes, [n / ref for n in sizes], "--", color="#8c8c8c", label="ideal (linear)")
    ax1.plot(sizes, [r.speedup for r in rows], "o-", color="#4c72b0", label="measured")
    ax1.set_xticks(sizes)
    ax1.set_xlabel("workers")
    ax1.set_ylabel("speedup (time per sample)")
    ax1.set_title(f"speedup, {result.mode} scaling")
    ax1.legend()
    ax2.bar([str(n) for n in sizes], [100 * (r.efficiency or 0) for r in rows], color="#4c72b0")
    comm = [100 * (r.comm_overhead_fraction or 0) for r in rows]
    ax2.plot([str(n) for n in sizes], comm, "s-", color="#dd8452", label="exposed comm % of step")
    ax2.set_xlabel("workers")
    ax2.set_ylabel("%")
    ax2.set_title("scaling efficiency")
    ax2.axhline(100, color="#8c8c8c", linestyle="--", linewidth=1)
    ax2.legend()
    fig.tight_layout()
    with atomic_writer(path, "wb") as f:
        fig.savefig(f, format="png")
