"""``meshforge data inspect DIR``: what a shard directory holds, with every checksum verified.

:func:`inspect_shards` reads the index (a missing or malformed one is a
DataError), then reads every byte of every shard: a shard is *damaged* when it is
missing, has another size than its token count says, or its sha256 differs from
the index's. The tokenizer file (BPE: ``tokenizer.json``) is checked against its
sha256 the same way. This is the full check that training leaves out at each
start (``load_shards`` checks sizes and each shard's first and last MiB only), so
a changed byte in the middle of a shard is found here. The report is a plain
dict (``--json`` prints it); :func:`format_report` is the table a person reads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshforge.data.shards import DTYPES, INDEX_FORMAT, INDEX_NAME, read_index, sha256_file
from meshforge.units import format_bytes

ProgressFn = Callable[[int, int], None]  # (bytes verified, bytes in all)
_LISTED_SOURCES = 10  # sources named in the table; --json has them all


def _tokenizer_summary(entry: dict[str, Any] | str, vocab_size: int) -> dict[str, Any]:
    if isinstance(entry, str):
        return {"kind": entry, "vocab_size": vocab_size, "file": None}
    return {
        "kind": entry.get("kind"),
        "vocab_size": entry.get("vocab_size", vocab_size),
        "file": entry.get("file"),
        "eod_id": entry.get("eod_id"),
    }


def _check_file(
    path: Path, expected_bytes: int | None, sha256: str, tick: Callable[[int], None]
) -> str | None:
    """None when ``path`` has the expected size and sha256, else what is wrong."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"missing (listed in {INDEX_NAME})"
    except OSError as exc:
        return f"cannot read ({exc.strerror})"
    if expected_bytes is not None and size != expected_bytes:
        return f"has {size} bytes, {INDEX_NAME} says {expected_bytes}"
    try:
        digest = sha256_file(path, tick)
    except OSError as exc:
        return f"cannot read ({exc.strerror})"
    if digest != sha256:
        return f"sha256 does not match {INDEX_NAME}"
    return None


def inspect_shards(
    directory: str | os.PathLike[str], progress: ProgressFn | None = None
) -> dict[str, Any]:
    """Summary of a shard directory and the result of verifying every checksum.

    ``report["damaged"]`` lists ``{"file", "problem"}`` for each damaged shard or
    tokenizer file; ``report["ok"]`` is True when there is none.
    """
    root = Path(directory)
    index = read_index(root, f"data inspect {root}")
    itemsize = DTYPES[index["dtype"]].itemsize
    entry = index["tokenizer"]
    tokenizer_file = entry.get("file") if isinstance(entry, dict) else None
    files: list[tuple[str, int | None, str]] = [
        (s["file"], s["tokens"] * itemsize, s["sha256"]) for s in index["shards"]
    ]
    if isinstance(tokenizer_file, str):
        files.append((tokenizer_file, None, str(entry.get("sha256", ""))))
    total_bytes = sum(size or 0 for _, size, _ in files)
    if tokenizer_file and (root / tokenizer_file).is_file():
        total_bytes += (root / tokenizer_file).stat().st_size

    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total_bytes)

    damaged: list[dict[str, str]] = []
    shards: list[dict[str, Any]] = []
    for name, expected, sha256 in files:
        problem = _check_file(root / name, expected, sha256, tick)
        if problem is not None:
            damaged.append({"file": name, "problem": problem})
        if expected is not None:
            row = {"file": name, "tokens": expected // itemsize, "bytes": expected}
            shards.append(row | {"ok": problem is None})
    return {
        "directory": str(root),
        "format": INDEX_FORMAT,
        "dtype": index["dtype"],
        "vocab_size": index["vocab_size"],
        "tokenizer": _tokenizer_summary(entry, index["vocab_size"]),
        "total_tokens": index["total_tokens"],
        "bytes": sum(row["bytes"] for row in shards),
        "documents": index.get("documents"),
        "sources": index.get("sources"),
        "shards": shards,
        "verified": sum(row["ok"] for row in shards),
        "damaged": damaged,
        "ok": not damaged,
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as a short table: one fact per line, damage named last."""
    tok = report["tokenizer"]
    n_shards = len(report["shards"])
    lines = [
        f"directory  {report['directory']} ({report['format']})",
        f"tokens     {report['total_tokens']:,} in {n_shards} shard{'s' * (n_shards != 1)}, "
        f"{format_bytes(report['bytes'])}, {report['dtype']}",
    ]
    described = f"{tok['kind']}, {tok['vocab_size']:,} ids"
    if tok.get("file"):
        described += f", {tok['file']}"
    if tok.get("eod_id") is not None:
        described += f" (end of document: id {tok['eod_id']})"
    lines.append(f"tokenizer  {described}")
    sources = report["sources"]
    if sources is None:
        lines.append(f"documents  {report['documents']} (index made before sources were listed)")
    else:
        lines.append(f"documents  {report['documents']:,} from {len(sources):,} source(s)")
        for i, source in enumerate(sources[:_LISTED_SOURCES]):
            docs = source.get("documents", 0)
            lines.append(
                f"{'sources' if i == 0 else '':<10} {source.get('path')} ({source.get('format')}, "
                f"{docs:,} document{'s' * (docs != 1)}, {source.get('tokens', 0):,} tokens)"
            )
        if len(sources) > _LISTED_SOURCES:
            lines.append(
                f"{'':<10} ... and {len(sources) - _LISTED_SOURCES} more (--json lists all)"
            )
    checked = f"{report['verified']} of {n_shards} shards verified (sha256 of every byte)"
    if tok.get("file"):
        bad_tokenizer = any(d["file"] == tok["file"] for d in report["damaged"])
        checked += f", {tok['file']} {'DAMAGED' if bad_tokenizer else 'verified'}"
    lines.append(f"checksums  {checked}")
    for item in report["damaged"]:
        lines.append(f"DAMAGED    {item['file']}: {item['problem']}")
    return "\n".join(lines)


def damage_summary(report: dict[str, Any]) -> str:
    """One line naming every damaged file (the CLI's error message)."""
    damaged = report["damaged"]
    named = "; ".join(f"{d['file']} {d['problem']}" for d in damaged)
    return (
        f"data inspect {report['directory']}: {len(damaged)} damaged file"
        f"{'s' * (len(damaged) != 1)}: {named} (re-create them with "
        "`meshforge data prepare --force`)"
    )


__all__ = ["damage_summary", "format_report", "inspect_shards"]
