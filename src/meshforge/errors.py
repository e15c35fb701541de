"""Errors the user can act on. The CLI prints them as one line and exits 2."""

from __future__ import annotations

import re
import reprlib
from typing import Any

from meshforge.redact import redact_text

# An error line is read by a person in a terminal or a scheduler's log: a few hundred
# characters say what is wrong. Longer ones come from quoting user input (a value of
# megabytes, an alias bomb expanded), so they are cut in the middle, keeping the start
# (what is wrong) and the end (the advice).
MAX_ERROR_CHARS = 2000
# A value quoted back to the user: enough to recognise it, never the whole of it.
MAX_QUOTED_CHARS = 80

_quoter = reprlib.Repr()
_quoter.maxlevel = 2
_quoter.maxstring = _quoter.maxother = MAX_QUOTED_CHARS
_quoter.maxlist = _quoter.maxtuple = _quoter.maxdict = _quoter.maxset = 6


def shorten(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """TEXT if it has at most LIMIT characters, else its start and end with the number
    of characters left out between them."""
    if len(text) <= limit:
        return text
    cut = f" ...[{len(text) - limit} characters left out]... "
    keep = max(limit - len(cut), 2)
    head = keep * 2 // 3
    return text[:head] + cut + text[len(text) - (keep - head) :]


def quote(value: Any, limit: int = MAX_QUOTED_CHARS) -> str:
    """repr(VALUE) for an error line, of at most about LIMIT characters however large
    the value is (containers are summarised, long strings cut, without a full repr)."""
    return shorten(_quoter.repr(value), limit)


# a quoted run (a repr in a message) longer than a quoted value may be
_LONG_QUOTED = re.compile(rf"'[^'\n]{{{MAX_QUOTED_CHARS},}}'|\"[^\"\n]{{{MAX_QUOTED_CHARS},}}\"")


def shorten_quoted(text: str) -> str:
    """TEXT with each quoted run longer than MAX_QUOTED_CHARS cut short: for messages
    that quote user input themselves (f"model.name={name!r}: ...")."""
    return _LONG_QUOTED.sub(lambda m: shorten(m.group(0), MAX_QUOTED_CHARS), text)


class MeshforgeError(Exception):
    """Base class for errors caused by the user's input (exit code 2). Its message is
    printed, logged and written to diagnosis.json, so a URL's credential in it is redacted
    here, once for every error (`s3://user:***@bucket/...`), and a message longer than
    MAX_ERROR_CHARS is shortened (see `shorten`)."""

    def __init__(self, *args: object) -> None:
        args = tuple(redact_text(a) if isinstance(a, str) else a for a in args)
        if len(args) == 1 and isinstance(args[0], str):
            args = (shorten(args[0]),)
        super().__init__(*args)


class ConfigError(MeshforgeError):
    """A job config, override or cluster file is invalid."""


class DataError(MeshforgeError):
    """Input data is missing or malformed."""


class CheckpointError(MeshforgeError):
    """A checkpoint cannot be used."""


class ExportError(MeshforgeError):
    """An export of a model cannot be written."""
