"""`meshforge scale`: a job at several world sizes, its speedup and scaling efficiency."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from meshforge.cli.app import app


@app.command("scale", rich_help_panel="Run")
def scale(
    config: Annotated[Path, typer.Argument(help="Job config (YAML).")],
    nproc: Annotated[
        str, typer.Option("--nproc", help="World sizes to run, comma-separated: 1,2,4.")
    ] = "1,2",
    mode: Annotated[
        str, typer.Option("--mode", help="strong: fixed global batch; weak: it grows with N.")
    ] = "strong",
    overrides: Annotated[
        list[str] | None, typer.Option("--set", help="Override a config key: KEY.PATH=VALUE.")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Output directory (runs/NAME-scale).")
    ] = None,
) -> None:
    """Train CONFIG at each world size; print speedup, scaling efficiency and the
    communication overhead; write scale.json and scale.png."""
    from rich.console import Console
    from rich.table import Table

    from meshforge.bench.scaling import parse_nproc_list, run_scaling, write_outputs

    sizes = parse_nproc_list(nproc)
    console = Console()
    if not console.is_terminal:  # logs and pipes: wide enough for every column
        console = Console(width=132)
    result = run_scaling(
        config, sizes, mode, overrides or [], out, progress=lambda m: console.print(m)
    )
    out_dir = Path(result.rows[0].run_dir).parent
    json_path, png_path = write_outputs(result, out_dir)

    def fmt(value: float | None, pattern: str) -> str:
        return "n/a" if value is None else pattern.format(value)

    table = Table(title=f"scaling ({mode}; efficiency = speedup / workers, per sample)")
    for column in ("workers", "global batch", "step time", "tokens/s", "speedup", "efficiency",
                   "comm overhead", "status"):  # fmt: skip
        table.add_column(column, justify="right")
    for r in result.rows:
        table.add_row(
            str(r.world_size),
            str(r.global_batch),
            fmt(r.step_time_s and 1e3 * r.step_time_s, "{:.1f} ms"),
            fmt(r.tokens_per_s, "{:,.0f}"),
            fmt(r.speedup, "{:.2f}x"),
            fmt(r.efficiency and 100 * r.efficiency, "{:.0f}%"),
            fmt(r.comm_overhead_fraction and 100 * r.comm_overhead_fraction, "{:.0f}%"),
            r.status if not r.error else f"{r.status}: {r.error}",
        )
    console.print(table)
    console.print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""))
    raise typer.Exit(0 if result.ok else 1)
