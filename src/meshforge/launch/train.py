"""`meshforge train`: validate everything cheap before a worker starts, then launch."""

from __future__ import annotations

import sys
from pathlib import Path

from meshforge.config import JobConfig, load_config, save_config
from meshforge.data.corpus import check_source
from meshforge.launch.local import NodeSpec
from meshforge.plan.auto import resolve_parallel_auto


def validate_job(cfg: JobConfig, world_size: int) -> None:
    cfg.check_trainable()
    cfg.dims(world_size)
    check_source(cfg.data.source)


def launch_training(
    config_path: Path,
    overrides: list[str],
    nproc: int,
    node: NodeSpec,
    run_dir: Path | None,
) -> int:
    cfg = load_config(config_path, overrides)
    world = nproc * node.nnodes
    cfg, auto_line = resolve_parallel_auto(cfg, world, nproc, node.nnodes)
    if auto_line:
        print(auto_line, flush=True)
    validate_job(cfg, world)
    run_dir = Path(run_dir or Path("runs") / cfg.name)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    resolved = run_dir / "config.yaml"
    save_config(cfg, resolved)
    dims = cfg.dims(world)
    pp = f" ({dims.pp_schedule})" if dims.pp_enabled else ""
    print(
        f"meshforge: training {cfg.name!r} on {world} worker(s): dp={dims.dp} tp={dims.tp} "
        f"pp={dims.pp}{pp} zero={dims.zero} micro-batches={dims.microbatches} "
        f"dtype={cfg.precision.dtype} -> {run_dir}",
        flush=True,
    )
    from meshforge.launch.local import run_workers  # imports torch: only once input is valid

    diagnosis = run_workers(
        ["worker", str(resolved), "--run-dir", str(run_dir)], nproc, node, run_dir
    )
    if diagnosis is None:
        return 0
    from meshforge.train.report import write_failure_report

    first = diagnosis["first_failure"]
    write_failure_report(run_dir, diagnosis)
    print(
        f"meshforge: rank {first['rank']} failed ({first['exit']}): {first['error']} "
        f"[log: {first['log']}]",
        file=sys.stderr,
    )
    return 1
