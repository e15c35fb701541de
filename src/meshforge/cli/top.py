"""`meshforge top RUN_DIR`: a live view of a run from its run directory (report/top.py).

It redraws every `--interval` seconds until the run ends, then leaves the last frame;
`--once` draws one frame. Nothing connects to the job, so it works from any machine
that sees the run directory, while the run goes on or after it ended."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from meshforge.cli.app import app


@app.command("top", rich_help_panel="Inspect")
def top(
    run_dir: Annotated[Path, typer.Argument(help="Run directory of a `meshforge train` run.")],
    interval: Annotated[
        float, typer.Option("--interval", min=0.1, help="Seconds between frames.")
    ] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Draw one frame and exit.")] = False,
) -> None:
    """A live terminal view of a run: status, step and ETA, loss, tokens/s and MFU; each
    rank's step, phase, step time, memory and record age (stale ones flagged); each
    host's CPU, memory, network and GPUs; for a mixture-of-experts run, the worst
    layer's max/mean expert load, the dropped fraction and the auxiliary loss. Exits
    when the run ends, or on Ctrl-C."""
    from meshforge.report.top import check_run_dir, watch

    raise typer.Exit(watch(check_run_dir(run_dir), interval_s=interval, once=once))
