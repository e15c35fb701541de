"""`meshforge submit slurm CONFIG --nodes N ...`: write an sbatch script into the run
directory and submit it (launch/slurm.py says what the script does)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from meshforge.cli.app import CtrlC
from meshforge.cli.submit import submit_app


@submit_app.command("slurm")
def slurm(
    config: Annotated[Path, typer.Argument(help="Job config (YAML).")],
    nodes: Annotated[int, typer.Option("--nodes", min=1, help="Nodes to allocate.")],
    gpus_per_node: Annotated[
        int, typer.Option("--gpus-per-node", min=0, help="GPUs per node (--gres=gpu:G).")
    ] = 0,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            "--nproc-per-node", min=1, help="Workers per node [default: GPUs per node, or 1]."
        ),
    ] = None,
    cpus_per_task: Annotated[
        int | None, typer.Option("--cpus-per-task", min=1, help="CPUs for each node's task.")
    ] = None,
    partition: Annotated[str | None, typer.Option("--partition", help="Slurm partition.")] = None,
    time_limit: Annotated[
        str | None, typer.Option("--time", help="Time limit (e.g. 90, 4:00:00, 1-12:00:00).")
    ] = None,
    account: Annotated[str | None, typer.Option("--account", help="Slurm account.")] = None,
    run_dir: Annotated[
        Path | None,
        typer.Option("--run-dir", help="Run directory, on storage every node sees."),
    ] = None,
    overrides: Annotated[
        list[str] | None, typer.Option("--set", help="Override a config key: KEY.PATH=VALUE.")
    ] = None,
    iface: Annotated[
        str | None, typer.Option("--iface", help="Network interface the workers talk over.")
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(
            "--port",
            min=1,
            max=65535,
            help="Rendezvous port on the first node [default: 29500 + job id % 10000].",
        ),
    ] = None,
    python: Annotated[
        str | None,
        typer.Option("--python", help="Python on the nodes [default: this interpreter]."),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Write and print the script; submit nothing.")
    ] = False,
    wait: Annotated[
        bool, typer.Option("--wait", help="Follow the job; exit with its outcome.")
    ] = False,
) -> None:
    """Submit a job to Slurm: one elastic agent per node, c10d rendezvous on the first."""
    from meshforge.config import load_config
    from meshforge.launch import slurm as sl
    from meshforge.launch.train import prepare_job
    from meshforge.runtime.runlock import check_run_dir_free

    req = sl.SlurmRequest(
        nodes=nodes,
        nproc_per_node=nproc_per_node or (gpus_per_node or 1),
        gpus_per_node=gpus_per_node,
        cpus_per_task=cpus_per_task,
        partition=partition,
        time=time_limit,
        account=account,
        iface=iface,
        port=port,
        python=python or sys.executable,
    )
    req.check()
    if not dry_run:
        sl.require_client_tools(wait)  # before anything is written
    run_dir = run_dir or Path("runs") / load_config(config, overrides or []).name
    files = sl.job_files(run_dir)
    prepared = prepare_job(
        config,
        overrides or [],
        nproc_per_node=req.nproc_per_node,
        min_nodes=nodes,
        max_nodes=nodes,
        run_dir=files.run_dir,
        config_file=files.config,
        lock=check_run_dir_free,  # the job's global rank 0 takes it when it runs
    )
    if prepared.finished is not None:  # nothing to train: nothing written or submitted
        print(prepared.finished)
        return
    sbatch, node = sl.write_scripts(req, files, prepared.cfg.name)
    if dry_run:
        print(sbatch, end="")
        print(f"\n# ---- {files.node_script} (srun runs it on every node) ----")
        print(node, end="")
        print(f"meshforge: dry run: wrote {files.sbatch}; nothing submitted", file=sys.stderr)
        return
    job_id = sl.submit(files.sbatch)
    log = files.log(job_id)
    print(f"meshforge: submitted Slurm job {job_id} ({nodes} node(s)); log: {log}", flush=True)
    if not wait:
        return
    try:
        status = sl.wait_for_job(
            job_id, on_change=lambda s: print(f"meshforge: job {job_id} {s.state}", flush=True)
        )
    except KeyboardInterrupt:
        CtrlC.reported = True
        print(
            f"meshforge: stopped following job {job_id}; it goes on (scancel {job_id})",
            file=sys.stderr,
        )
        raise typer.Exit(130) from None
    if status.state == "COMPLETED":
        return
    print(
        f"meshforge: Slurm job {job_id} ended {status.state} (exit code {status.exit_code}); "
        f"log: {log}",
        file=sys.stderr,
    )
    raise typer.Exit(1)
