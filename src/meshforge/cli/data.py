"""`meshforge data prepare SRC OUT` (documents -> token shards, see meshforge.data.shards)
and `meshforge data inspect DIR` (every checksum verified, see meshforge.data.inspect)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

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


@contextmanager
def _progress_bar(description: str, byte_columns: bool = True) -> Iterator[Any]:
    """A transient progress bar on stderr when it is a terminal (else nothing is drawn,
    so piped and CI runs keep stderr for errors). Yields ``update(done, total, phase)``."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    console = Console(stderr=True)
    columns = [BarColumn(), DownloadColumn(), TimeRemainingColumn()] if byte_columns else []
    with Progress(
        "[progress.description]{task.description}",
        *columns,
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int, phase: str | None = None) -> None:
            bar.update(task, completed=done, total=total, description=phase or description)

        yield update


def _index_or_none(out: Path) -> dict[str, Any] | None:
    from meshforge.data.shards import read_index

    try:
        return read_index(out, str(out))
    except DataError:
        return None


@data_app.command("prepare")
def prepare_command(
    src: Annotated[
        Path,
        typer.Argument(help="A file, a directory read recursively, or a saved `datasets` dataset."),
    ],
    out: Annotated[Path, typer.Argument(help="Directory to write shards and index.json to.")],
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="auto|text|jsonl|parquet|hf. auto: .jsonl/.ndjson are JSON Lines, .parquet "
            "Parquet, a save_to_disk directory a datasets dataset, the rest text.",
        ),
    ] = "auto",
    field: Annotated[
        str, typer.Option("--field", help="The text field of JSON Lines, Parquet and datasets.")
    ] = "text",
    tokenizer: Annotated[
        str | None,
        typer.Option(
            "--tokenizer",
            help="byte or bpe (default: byte, or the tokenizer of the shards already in OUT).",
        ),
    ] = None,
    vocab_size: Annotated[
        int | None,
        typer.Option("--vocab-size", help="Ids of the BPE tokenizer trained on SRC."),
    ] = None,
    tokenizer_file: Annotated[
        Path | None,
        typer.Option("--tokenizer-file", help="A tokenizer.json to use instead of training one."),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            help="Tokenizing processes (default: one per CPU for BPE over 8 MiB of input, else 1).",
        ),
    ] = None,
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
        bool,
        typer.Option("--force", help="Rebuild OUT from scratch instead of adding new files."),
    ] = False,
) -> None:
    """Tokenize documents into token shards for `data.source`; run again to add new files."""
    from meshforge.data.shards import prepare

    count = parse_token_count(shard_tokens)
    before = None if force else _index_or_none(out)
    with _progress_bar("tokenizing") as update:
        index = prepare(
            src,
            out,
            count,
            fmt=fmt,
            field=field,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            tokenizer_file=tokenizer_file,
            workers=workers,
            pattern=glob,
            force=force,
            progress=lambda phase, done, total: update(done, total, phase),
        )
    n_shards, n_sources = len(index["shards"]), len(index["sources"])
    kind = index["tokenizer"] if isinstance(index["tokenizer"], str) else index["tokenizer"]["kind"]
    if before is None:
        print(
            f"wrote {index['total_tokens']:,} tokens from {n_sources} file(s) "
            f"({index['documents']:,} documents, {kind} tokenizer, {index['vocab_size']:,} ids) "
            f"in {n_shards} shard{'s' if n_shards != 1 else ''} to {out}"
        )
        return
    added = n_sources - len(before.get("sources") or [])
    if added == 0:
        print(f"nothing new in {src}: {out} already holds its {n_sources} file(s)")
        return
    new_tokens = index["total_tokens"] - before["total_tokens"]
    new_shards = n_shards - len(before["shards"])
    print(
        f"appended {new_tokens:,} tokens from {added} new file(s) in {new_shards} new "
        f"shard{'s' if new_shards != 1 else ''} to {out} "
        f"(now {index['total_tokens']:,} tokens in {n_shards} shards)"
    )


@data_app.command("inspect")
def inspect_command(
    directory: Annotated[
        Path, typer.Argument(help="A directory made by `meshforge data prepare`.")
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")] = False,
) -> None:
    """Shards, tokens, bytes, tokenizer and sources of DIR, with every checksum verified.

    A damaged shard (missing, wrong size, wrong sha256) is named and the exit code is 2.
    """
    if not directory.is_dir():
        what = "not a directory" if directory.exists() else "no such directory"
        raise DataError(f"{directory}: {what}")
    from meshforge.data.inspect import damage_summary, format_report, inspect_shards

    with _progress_bar("verifying") as update:
        report = inspect_shards(directory, progress=lambda done, total: update(done, total))
    print(json.dumps(report, indent=2) if as_json else format_report(report), flush=True)
    if not report["ok"]:
        raise DataError(damage_summary(report))
