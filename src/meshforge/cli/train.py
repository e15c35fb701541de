"""`meshforge train` (the elastic agent on this node) and `meshforge worker` (one process).

`train` takes torchrun's launch flags exactly as torchrun does (launch/torchrun.py
builds its parser from torch's own), so the command line is parsed by argparse rather
than by typer: `meshforge train --help` lists them all."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from meshforge.cli.app import app

# What every worker runs (`python -m meshforge worker ...`), handed to the launcher and
# its zygote: they import nothing of the CLI themselves.
WORKER_ENTRY = "meshforge.cli:main"

log = logging.getLogger(__name__)


@app.command(
    "train",
    rich_help_panel="Run",
    context_settings={
        "allow_extra_args": True,
        "ignore_unknown_options": True,
        "help_option_names": [],
    },
    add_help_option=False,
)
def train(ctx: typer.Context) -> None:
    """Train a job on this node: CONFIG [--run-dir D] [--set K=V] [--fresh] [--trace STEPS]
    [torchrun's flags] (--nproc-per-node N, --nnodes MIN:MAX, --rdzv-*, --standalone,
    --max-restarts, --iface NAME, ...). See `meshforge train --help`."""
    from meshforge.launch.local import launch_training

    code = launch_training(list(ctx.args), WORKER_ENTRY)
    # The run is over and recorded: leave without the interpreter's teardown of torch
    # and the elastic agent (a few tenths of a second of the command's exit).
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


@app.command("worker", rich_help_panel="Run")
def worker(
    config: Annotated[Path, typer.Argument(help="Resolved job config (YAML).")],
    run_dir: Annotated[Path, typer.Option("--run-dir", help="Run directory.")] = Path("runs/job"),
) -> None:
    """One training process; rank and world size come from torchrun, Slurm or MPI."""
    from meshforge.train.worker import run_worker

    run_worker(config, run_dir, after_report=_write_page)
    # A finished rank ends here, without the interpreter's teardown: a gloo work thread
    # still dropping its last reference then would abort the process ("terminate called
    # without an active exception"; runtime/dist.py leaves the group in the order that
    # makes that rare). Everything the run wrote is flushed first.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


def _write_page(run_dir: Path) -> None:
    """report.html beside report.json as the run ends (rank 0): its plots are SVG
    (milliseconds); report.png (matplotlib: about a second) is drawn on demand by
    `meshforge report RUN_DIR --png`, off the run's exit."""
    try:
        # lazy: keeps the viewer's imports off the worker's start (it draws at the end)
        from meshforge.report.html import write_html

        write_html([run_dir])
    except Exception as exc:  # the page too: `meshforge report RUN_DIR` draws it again
        log.warning("could not write report.html: %s", exc)
