"""The typer application that every command module registers on."""

from __future__ import annotations

import typer
from typer.core import TyperGroup

from meshforge.version import __version__

try:  # typer >= 0.22 vendors click; older releases use the click package
    from typer import _click as click
except ImportError:  # pragma: no cover
    import click

# The groups of `meshforge --help`, in this order; each command names its own with
# `rich_help_panel=` (typer's name for it) where it is registered.
PANELS = ("Run", "Inspect", "Plan", "Cluster")


class PanelGroup(TyperGroup):
    """Lists the commands under their groups in plain `--help` text. typer draws its
    panels only with rich markup, which this CLI leaves off (`rich_markup_mode=None`) so
    that help stays plain text, unboxed and uncoloured, also when piped."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups: dict[str, list[tuple[str, click.Command]]] = {}
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is None or cmd.hidden:
                continue
            groups.setdefault(getattr(cmd, "rich_help_panel", None) or "Commands", []).append(
                (name, cmd)
            )
        if not groups:
            return
        width = max(len(name) for rows in groups.values() for name, _ in rows)
        limit = formatter.width - 6 - width
        order = [p for p in PANELS if p in groups] + sorted(set(groups) - set(PANELS))
        for panel in order:
            # padded to one width, so the help columns line up across the groups
            rows = [(n.ljust(width), c.get_short_help_str(limit)) for n, c in groups[panel]]
            with formatter.section(panel):
                formatter.write_dl(rows, col_max=width)


app = typer.Typer(
    name="meshforge",
    cls=PanelGroup,
    help="Distributed deep-learning training on PyTorch: train, plan, cost, sample.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        print(f"meshforge {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        help="Print meshforge's version and exit.",
        is_eager=True,
        callback=_print_version,
    ),
) -> None:
    """Distributed deep-learning training on PyTorch: train, plan, cost, sample."""


data_app = typer.Typer(
    help="Token shards: prepare them from text, JSONL, Parquet or datasets; inspect them.",
    no_args_is_help=True,
)
app.add_typer(data_app, name="data", rich_help_panel="Run")


class CtrlC:
    """Whether Ctrl-C ended a command: typer turns the KeyboardInterrupt into exit code
    130 without a word, so `main` says it, unless the command said what the stop left
    behind itself (`CtrlC.reported = True`). Commands with their own SIGINT handling
    (train's launcher) replace the handler and are not counted."""

    pressed = False
    reported = False
