"""`meshforge submit mpi CONFIG -np N`: run the job's workers under OpenMPI's mpirun."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from meshforge.cli.submit import submit_app


@submit_app.command("mpi")
def submit_mpi(
    config: Annotated[Path, typer.Argument(help="Job config (YAML).")],
    np: Annotated[int, typer.Option("-np", "--np", help="MPI ranks (worker processes).")],
    hostfile: Annotated[
        Path | None,
        typer.Option("--hostfile", help="OpenMPI hostfile (`host slots=N` a line)."),
    ] = None,
    run_dir: Annotated[
        Path | None,
        typer.Option("--run-dir", help="Run directory, on storage every host sees."),
    ] = None,
    overrides: Annotated[
        list[str] | None, typer.Option("--set", help="Override a config key: KEY.PATH=VALUE.")
    ] = None,
    master_addr: Annotated[
        str | None,
        typer.Option(
            "--master-addr", help="Rank 0's address (default: the hostfile's first host)."
        ),
    ] = None,
    master_port: Annotated[
        int | None,
        typer.Option("--master-port", min=1, max=65535, help="Rendezvous port (default: free)."),
    ] = None,
    iface: Annotated[
        str | None,
        typer.Option("--iface", help="Network interface for gloo/NCCL traffic."),
    ] = None,
    oversubscribe: Annotated[
        bool, typer.Option("--oversubscribe", help="Allow more ranks than cores or slots.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the mpirun command; run nothing.")
    ] = False,
    mpirun: Annotated[
        str | None, typer.Option("--mpirun", help="The mpirun to use (default: on PATH).")
    ] = None,
) -> None:
    """Run the job under mpirun: one worker per rank; rank, size and local rank come from
    OpenMPI, MASTER_ADDR/PORT and the environment the workers need are passed with -x."""
    from meshforge.launch.mpi import MpiLaunch, submit_mpi

    launch = MpiLaunch(
        np=np,
        hostfile=hostfile,
        master_addr=master_addr,
        master_port=master_port,
        iface=iface,
        oversubscribe=oversubscribe,
    )
    rc = submit_mpi(
        config, overrides or [], launch, run_dir=run_dir, mpirun=mpirun, dry_run=dry_run
    )
    sys.stdout.flush()
    raise typer.Exit(rc)
