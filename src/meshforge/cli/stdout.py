"""A reader of meshforge's output that goes away is not an error.

`meshforge train ... | head` closes the pipe after a few lines, while the launcher and
rank 0 (which share its stdout) go on printing. Python raises BrokenPipeError on the
next write, and rich's console turns that into SystemExit(1): the run failed because
nobody was reading. Here the first broken write points stdout at /dev/null (the
descriptor too, so that the interpreter's own flush at exit succeeds) and the program
goes on, silently, as it would have with `> /dev/null`."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO


class StdoutThatMayClose:
    """A text stream over `stream` that swallows the broken pipe of a reader that left."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._reader_left()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._reader_left()

    def _reader_left(self) -> None:
        self.gone = True
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self._stream, name)


@contextlib.contextmanager
def stdout_may_close() -> Iterator[None]:
    """sys.stdout wrapped for the duration (restored after: main() also runs in-process)."""
    previous = sys.stdout
    if previous is None or isinstance(previous, StdoutThatMayClose):
        yield
        return
    sys.stdout = StdoutThatMayClose(previous)  # type: ignore[assignment]
    try:
        yield
    finally:
        if isinstance(sys.stdout, StdoutThatMayClose):
            sys.stdout = previous
