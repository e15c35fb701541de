"""Small file helpers shared across layers (no torch import)."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` so that readers see the old file or the new one, never half of it.
    The temporary name is unique per host and process: several nodes may write the same
    file on shared storage."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
