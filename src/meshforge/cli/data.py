"""`meshforge data prepare SRC OUT`: text files -> token shards (see meshforge.data.shards)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from meshforge.cli.app import data_app
from meshforge.errors import DataError

_COUNT = re.compile(r"^\s*(\d+)\s*([kKmMgG]?)\s*$")
_SUFFIX = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_token_count(text: str) -> int:
    """``"16M"`` -> 16 * 2**20; the K/M/G suffixes are powers of 1024."""
    match = _COUNT.match(text)
    value = int(match.group(1)) * _SUFFIX[match.group(2).lower()] if match else 0
    if value < 1:
        raise DataError(f"--shard-tokens: expected a positive count such as 16M, got {text!r}")
    return value


@data_app.command("prepare")
def prepare_command(
    src: Annotated[Path, typer.Argument(help="A text file, or a directory read recursively.")],
    out: Annotated[Path, typer.Argument(help="Directory to write shards and index.json to.")],
    shard_tokens: Annotated[
        str, typer.Option("--shard-tokens", help="Tokens per shard file (K/M/G = 2^10/20/30).")
    ] = "16M",
    glob: Annotated[
        str | None,
        typer.Option(
            "--glob", help="Only files whose relative path or name matches, e.g. '*.txt'."
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing index in OUT.")
    ] = False,
) -> None:
    """Tokenize text files (byte level) into token shards for `data.source`."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from meshforge.data.shards import prepare

    count = parse_token_count(shard_tokens)
    console = Console(stderr=True)
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,  # piped or in CI: no bar, stderr stays for errors
    ) as bar:
        task = bar.add_task("tokenizing", total=None)
        index = prepare(
            src,
            out,
            count,
            pattern=glob,
            force=force,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    n_shards = len(index["shards"])
    print(
        f"wrote {index['total_tokens']:,} tokens from {index['documents']} file(s) "
        f"in {n_shards} shard{'s' if n_shards != 1 else ''} to {out}"
    )
