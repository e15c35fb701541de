"""Fabric's processes: running a training function on every rank, and its failures.

`Fabric.launch` either runs the function in this process (`run`: a launcher such as
torchrun, srun or mpirun made one process per rank already) or starts `nproc` local
workers through the torch elastic agent (`spawn`). The agent pickles what a worker
runs by its qualified name, so `_run_recorded` and `FabricSettings` live at the top level
of this module, which a spawned worker imports before it builds its Fabric again.

A failed worker becomes one `FabricWorkerError` line: the rank whose own error came
first is the root cause, the other failed ranks its consequences, chosen as
`meshforge train` chooses (launch/local.py's `choose_first_failure`).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from meshforge.fabric.api import Fabric

T = TypeVar("T")


@dataclass(frozen=True)
class FabricSettings:
    """What a worker needs to rebuild the Fabric (picklable: crosses the process spawn)."""

    strategy: str
    precision: str
    device: str
    backend: str
    timeout_s: float
    seed: int
    bucket_mb: float


class FabricWorkerError(RuntimeError):
    """A worker started by `Fabric.launch` failed. The message is one line: the rank
    that caused the failure first, the others as its consequences. `rank` is the
    root-cause rank; `failures` one dict per failed rank (rank, exit, error)."""

    def __init__(self, message: str, rank: int, failures: list[dict]) -> None:
        super().__init__(message)
        self.rank = rank
        self.failures = failures

    def __reduce__(self):  # pickles (crosses process boundaries) with its fields
        return (type(self), (str(self), self.rank, self.failures))


def run(settings: FabricSettings, fn: Callable[[Fabric], T], make: type[Fabric]) -> T:
    """One rank: rebuild the Fabric (MAKE, the class, given by api.py: this module does
    not import it), join the group, run fn, always leave the group."""
    fabric = make(**vars(settings))
    with fabric:
        return fn(fabric)


def _run_recorded(
    settings: FabricSettings, fn: Callable[[Fabric], T], make: type[Fabric], record_dir: str
) -> T:
    """One spawned rank: as run, and an error of its own is recorded (with its time)
    before the group goes, so the launcher can tell the cause from its consequences.
    MAKE (the Fabric class) crosses the spawn pickled by its qualified name."""
    fabric = make(**vars(settings))
    with fabric:
        try:
            return fn(fabric)
        except BaseException as exc:
            with contextlib.suppress(Exception):  # never hides the error itself
                from meshforge.rundir.failures import record_failure

                record_failure(Path(record_dir), fabric.rank, exc)
            raise


def spawn(
    settings: FabricSettings, fn: Callable[[Fabric], T], nproc: int, make: type[Fabric]
) -> T | None:
    """Run fn on nproc local workers through the elastic agent (the machinery of torchrun)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from meshforge.launch.local import NodeSpec, launch_config

    for name in ["torch.distributed.elastic", *logging.Logger.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="meshforge-fabric-") as work:
        config = launch_config(nproc, NodeSpec(), Path(work) / "elastic")
        try:
            results = elastic_launch(config, _run_recorded)(settings, fn, make, work)
        except ChildFailedError as exc:
            raise _worker_error(exc, Path(work) / "health") from None
        except SignalException as exc:  # Ctrl-C or SIGTERM: the agent stopped the workers
            raise KeyboardInterrupt(f"stopped by signal {exc.sigval}") from None
    return results.get(0)


def _worker_error(exc: Any, health: Path) -> FabricWorkerError:
    """One line naming the root-cause rank first (launch.local.choose_first_failure, as
    `meshforge train` picks it: the earliest error a rank recorded itself that is not
    a peer's broken connection, else a rank killed by a signal nobody in the job sent)
    and the other failed ranks as its consequences."""
    from meshforge.launch.local import (
        choose_first_failure,
        describe_exit,
        failure_message,
        recorded_failures,
    )

    failures = [
        {
            "rank": r,
            "exitcode": f.exitcode,
            "exit": describe_exit(f.exitcode),
            # the agent's logs go with its temporary directory; the output stays
            "error": failure_message(f).replace("(see its log)", "(see its output)"),
            "time": f.timestamp,
        }
        for r, f in sorted(exc.failures.items())
    ]
    recorded = {r["rank"]: r for r in recorded_failures(health)}
    for f in failures:  # a rank's own record says more than the agent's
        if f["rank"] in recorded:
            f["error"] = recorded[f["rank"]]["error"]
    first = choose_first_failure(list(recorded.values()), failures, exc.get_first_failure()[0])
    first_rank = first["rank"]
    if all(f is not first for f in failures):  # recorded its error, not seen exiting
        failures.append(first)
    if first["exit"] == "killed by SIGTERM" and first_rank in recorded:
        first["exit"] = "stopped by the agent after failing"
    line = f"rank {first_rank} failed ({first['exit']}): {first['error']} (the root cause)"
    others = []
    for f in sorted(failures, key=lambda f: (f.get("time", 0), f["rank"])):
        if f["rank"] == first_rank:
            continue
        if f["exit"] == "killed by SIGTERM" and f["rank"] not in recorded:
            others.append(f"rank {f['rank']} stopped by the agent")
        else:
            others.append(f"rank {f['rank']} failed ({f['exit']}): {f['error']}")
    if others:
        line += "; as its consequence: " + "; ".join(others)
    return FabricWorkerError(line, first_rank, failures)
