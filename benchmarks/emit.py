"""What every benchmark does last: print its table and, with --out, keep it in a file
(benchmarks/results/NAME.txt by convention). Imported by the scripts beside it."""

from __future__ import annotations

from pathlib import Path


def emit(lines: list[str], out: Path | None) -> None:
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
