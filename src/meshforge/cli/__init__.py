"""Command-line entry point. Each command lives in its own module and stays thin.

Exit codes: 0 success, 1 a run failed, 2 invalid input (one line on stderr)."""

from __future__ import annotations

import signal
import sys

import typer

from meshforge.cli.app import CtrlC, app
from meshforge.cli.stdout import stdout_may_close
from meshforge.errors import MeshforgeError

try:  # typer >= 0.22 vendors click; older releases use the click package
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover
    from click import exceptions as click_exc

# Command modules register themselves on `app` when imported.
from meshforge.cli import bench as _bench  # noqa: E402,F401
from meshforge.cli import cost as _cost  # noqa: E402,F401
from meshforge.cli import data as _data  # noqa: E402,F401
from meshforge.cli import diagnose as _diagnose  # noqa: E402,F401
from meshforge.cli import export as _export  # noqa: E402,F401
from meshforge.cli import plan as _plan  # noqa: E402,F401
from meshforge.cli import preflight as _preflight  # noqa: E402,F401
from meshforge.cli import report as _report  # noqa: E402,F401
from meshforge.cli import sample as _sample  # noqa: E402,F401
from meshforge.cli import scale as _scale  # noqa: E402,F401
from meshforge.cli import submit as _submit  # noqa: E402,F401
from meshforge.cli import submit_k8s as _submit_k8s  # noqa: E402,F401
from meshforge.cli import submit_mpi as _submit_mpi  # noqa: E402,F401
from meshforge.cli import submit_slurm as _submit_slurm  # noqa: E402,F401
from meshforge.cli import top as _top  # noqa: E402,F401
from meshforge.cli import train as _train  # noqa: E402,F401


def _fail_usage(message: str) -> None:
    # pydantic's wording for a validator's ValueError, passed through by typer
    message = " ".join(str(message).split()).replace("Value error, ", "")
    print(f"meshforge: error: {message}", file=sys.stderr)
    sys.exit(2)


def _on_sigint(signum, frame) -> None:  # noqa: ARG001 - signal API
    CtrlC.pressed = True
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        with stdout_may_close():  # `meshforge train ... | head` must not end the run
            _main(argv)
    finally:  # called in-process (tests, the zygote's workers): as it found it
        if signal.getsignal(signal.SIGINT) is _on_sigint:
            signal.signal(signal.SIGINT, previous)


def _main(argv: list[str] | None) -> None:
    CtrlC.pressed = CtrlC.reported = False
    try:
        rc = app(args=argv, standalone_mode=False)
    except click_exc.NoArgsIsHelpError as exc:
        print(exc.ctx.get_help())  # `meshforge` or `meshforge submit` alone: their help
        sys.exit(0)
    except click_exc.UsageError as exc:
        _fail_usage(exc.format_message())
    except click_exc.ClickException as exc:
        _fail_usage(exc.format_message())
    except typer.Abort:
        print("meshforge: aborted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except MeshforgeError as exc:
        _fail_usage(str(exc))
    if rc == 130 and CtrlC.pressed and not CtrlC.reported:
        print("meshforge: interrupted (Ctrl-C)", file=sys.stderr)
    sys.exit(rc if isinstance(rc, int) else 0)
