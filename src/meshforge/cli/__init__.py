"""Command-line entry point. Each command lives in its own module and stays thin.

Exit codes: 0 success, 1 a run failed, 2 invalid input (one line on stderr)."""

from __future__ import annotations

import sys

import click

from meshforge.cli.app import app
from meshforge.errors import MeshforgeError

# Command modules register themselves on `app` when imported.
from meshforge.cli import data as _data  # noqa: E402,F401
from meshforge.cli import train as _train  # noqa: E402,F401


def _fail_usage(message: str) -> None:
    message = " ".join(str(message).split())
    print(f"meshforge: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    try:
        rc = app(args=argv, standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError:
        sys.exit(0)
    except click.exceptions.UsageError as exc:
        _fail_usage(exc.format_message())
    except click.exceptions.Abort:
        print("meshforge: aborted", file=sys.stderr)
        sys.exit(130)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except MeshforgeError as exc:
        _fail_usage(str(exc))
    sys.exit(rc if isinstance(rc, int) else 0)
