"""`meshforge train` (launch N local workers) and `meshforge worker` (one process)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from meshforge.cli.app import app


@app.command("train")
def train(
    config: Annotated[Path, typer.Argument(help="Job config (YAML).")],
    nproc: Annotated[
        int, typer.Option("--nproc", min=1, help="Worker processes on this node.")
    ] = 1,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Run directory.")] = None,
    overrides: Annotated[
        list[str] | None, typer.Option("--set", help="Override a config key: KEY.PATH=VALUE.")
    ] = None,
    nnodes: Annotated[int, typer.Option("--nnodes", min=1)] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", min=0)] = 0,
    master_addr: Annotated[str | None, typer.Option("--master-addr")] = None,
    master_port: Annotated[int | None, typer.Option("--master-port", min=1, max=65535)] = None,
    rdzv_endpoint: Annotated[str | None, typer.Option("--rdzv-endpoint")] = None,
    rdzv_backend: Annotated[str | None, typer.Option("--rdzv-backend")] = None,
    rdzv_id: Annotated[str | None, typer.Option("--rdzv-id")] = None,
    local_addr: Annotated[str | None, typer.Option("--local-addr")] = None,
    max_restarts: Annotated[int, typer.Option("--max-restarts", min=0)] = 0,
) -> None:
    """Train a job with N worker processes on this node (multi-node: torchrun's flags)."""
    from meshforge.launch.local import NodeSpec
    from meshforge.launch.train import launch_training

    node = NodeSpec(
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_backend=rdzv_backend,
        rdzv_id=rdzv_id,
        local_addr=local_addr,
        max_restarts=max_restarts,
    )
    rc = launch_training(config, overrides or [], nproc, node, run_dir)
    raise typer.Exit(rc)


@app.command("worker")
def worker(
    config: Annotated[Path, typer.Argument(help="Resolved job config (YAML).")],
    run_dir: Annotated[Path, typer.Option("--run-dir", help="Run directory.")] = Path("runs/job"),
) -> None:
    """One training process; rank and world size come from torchrun, Slurm or MPI."""
    from meshforge.train.worker import run_worker

    run_worker(config, run_dir)
    sys.stdout.flush()
