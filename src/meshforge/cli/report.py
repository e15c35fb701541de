"""`meshforge report RUN_DIR [RUN_DIR_B]`: the run's self-contained HTML page, or two runs
overlaid; prints where it wrote it. The page is report/html.py's."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from meshforge.cli.app import app


@app.command("report", rich_help_panel="Inspect")
def report_command(
    run_dir: Annotated[Path, typer.Argument(help="Run directory of a `meshforge train` run.")],
    run_dir_b: Annotated[
        Path | None, typer.Argument(help="A second run directory, to compare with the first.")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Where to write the page (RUN_DIR/report.html; two runs: "
            "RUN_DIR/compare-<RUN_DIR_B's name>.html).",
        ),
    ] = None,
    cluster: Annotated[
        Path | None, typer.Option("--cluster", help="Cluster file (YAML): adds the run's cost.")
    ] = None,
    png: Annotated[
        bool,
        typer.Option(
            "--png", help="Also draw RUN_DIR/report.png (loss, throughput, memory, time)."
        ),
    ] = False,
) -> None:
    """Write the run's report.html: headline figures, layout, loss, throughput and MFU,
    memory per rank, time breakdown, network, step time per rank, and its config. With two
    run directories, one page with both runs overlaid and the ratio B/A."""
    from meshforge.report.html import default_out, write_html
    from meshforge.rundir.outputs import claim, holds_a_run

    runs = [run_dir] if run_dir_b is None else [run_dir, run_dir_b]
    # the page is meshforge's, for --fresh, in a run's directory only: in a folder of
    # the user's own (a metrics.jsonl of theirs) nothing is adopted as meshforge's
    if out is None and holds_a_run(run_dir):
        claim(run_dir, default_out(runs).name)
    print(write_html(runs, out, cluster))
    if png:
        from meshforge.report.plots import plot_report
        from meshforge.rundir.records import read_jsonl

        for run in runs:
            rows, reason = [], "its metrics.jsonl has no rows"
            try:
                rows = read_jsonl(run / "metrics.jsonl")
            except FileNotFoundError:
                reason = "it has no metrics.jsonl (no step was logged)"
            except (OSError, ValueError) as exc:
                reason = f"cannot read its metrics.jsonl: {getattr(exc, 'strerror', None) or exc}"
            if not rows:  # the page says what the run has; a plot of nothing would not
                print(f"meshforge: no {run / 'report.png'}: {reason}", file=sys.stderr)
                continue
            claim(run, "report.png")
            plot_report(rows, run / "report.png")
            print(run / "report.png")
