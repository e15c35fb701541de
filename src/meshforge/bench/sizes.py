"""Sizes on the command line: '4096', '64K', '4M', '1G', '256MiB', '8KB' -> bytes (K, M, G,
T are powers of 1024, as in nccl-tests' -b/-e). No torch import: `bench io` uses it too."""

from __future__ import annotations

import re

from meshforge.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str, flag: str = "size") -> int:
    """Bytes from a size such as 1024, 64K or 4M; ConfigError naming `flag` otherwise."""
    match = _SIZE.match(str(text))
    if not match:
        raise ConfigError(f"{flag} {text!r}: expected a size in bytes such as 1024, 64K or 4M")
    return int(float(match.group(1)) * 1024 ** " kmgt".index(match.group(2).lower() or " "))
