"""One pool of gloo worker processes per world size, shared by a whole pytest session.

Multi-process tests that do not need the CLI run a function on every rank of an
already-initialised gloo group instead of launching `meshforge train`:

    # tests/integration/test_something.py
    import torch
    import torch.distributed as dist

    def _sum_of_ranks() -> float:  # module level: the workers import it by name
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    def test_all_reduce(gloo):  # `gloo` is the session fixture in conftest.py
        assert gloo.run(4, _sum_of_ranks) == [6.0] * 4

The pool for a world size (1, 2, 3 or 4) is started the first time a test asks for it
(each rank a `multiprocessing` spawn-context process with `OMP_NUM_THREADS=1`,
`torch.set_num_threads(1)`, `MESHFORGE_IN_POOL=1` and the torchrun variables RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, that has called
`dist.init_process_group("gloo", ..., init_method="tcp://127.0.0.1:PORT")` on a free
loopback port) and kept until the session ends.

What a function run in the pool may assume and must do:

- The default process group is initialised; never initialise or destroy it.
- It runs on every rank, so collectives and group creation match across ranks as usual.
- Create what it needs inside the call: DeviceMeshes, subgroups, models, optimizers.
  Building a DeviceMesh from the already-initialised default group works, also again
  in the next call: `init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))` finds
  the default group initialised and makes the mesh's subgroups with `dist.new_group`
  (a mesh dimension spanning the whole world reuses the default group), which every
  rank calls in the same order. Groups made by earlier calls stay alive (a few sockets
  each); don't keep them in module globals for a later call.
- After each call the pool runs `dist.barrier()` and restores the environment, the
  working directory, the default dtype and the thread count. Other global state (RNG
  seeds, module globals in the workers) carries over: seed what you rely on.
- It is defined at module level (the workers import its module by name), and it, its
  arguments and its return value pickle. `timeout` is the pool's own keyword; it is not
  passed on.
- What the function prints is shown under the test's captured output.

When a rank raises, the test gets the exception again (the same type when it pickles,
else `GlooWorkerError`) with the rank and the worker's traceback text as a note. A call
that does not finish within `timeout` seconds fails the test. In both cases the pool of
that world size is stopped (its ranks may be stuck in a collective) and the next call
starts a new one. The pool stops only the processes it started, by their PID.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from typing import Any

import pytest

from helpers import unused_port

SIZES = (1, 2, 3, 4)
START_TIMEOUT_S = 180.0  # spawning and importing torch on a loaded two-core machine
COLLECTIVE_TIMEOUT_S = 900  # a stuck worker gives up on its own eventually
ERROR_GRACE_S = 3.0  # after one rank raised, how long to wait for the others' replies
STOP_TIMEOUT_S = 10.0

# Set while the workers are spawned, so that they have it from their first instruction.
CHILD_ENV = {"MESHFORGE_IN_POOL": "1", "OMP_NUM_THREADS": "1"}


class GlooWorkerError(RuntimeError):
    """A worker raised an exception that could not be sent back as itself."""


class GlooPool:
    """Worker groups by world size, started on first use; see the module docstring."""

    def __init__(self) -> None:
        self._groups: dict[int, _Group] = {}
        atexit.register(self.shutdown)

    def run(
        self, world_size: int, fn: Callable[..., Any], /, *args: Any, timeout: float = 300, **kwargs
    ) -> list[Any]:
        """`fn(*args, **kwargs)` on every rank of the world-size pool; the results by rank."""
        __tracebackhide__ = True  # a failing test shows the worker's traceback, not the pool's
        if world_size not in SIZES:
            raise ValueError(f"gloo pool world sizes are {SIZES}, not {world_size}")
        try:
            payload = pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            exc.add_note("gloo.run: define the function at module level; it and its arguments "
                         "must pickle")  # fmt: skip
            raise
        group = self._groups.get(world_size)
        if group is None:
            group = self._groups[world_size] = _Group.start(world_size)
        try:
            return group.call(payload, _name(fn), timeout)
        except BaseException:
            group.stop(force=True)
            del self._groups[world_size]
            raise

    def pids(self) -> dict[int, list[int]]:
        """The worker PIDs of each running pool, by world size."""
        return {w: [p.pid for p in g.procs] for w, g in sorted(self._groups.items())}

    def shutdown(self) -> None:
        """Stop every pool: ask the workers to leave, then stop stragglers by PID."""
        groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            group.stop(force=False)


class _Group:
    """The W processes of one pool and a pipe to each."""

    def __init__(self, world_size: int, procs: list, conns: list[Connection]) -> None:
        self.world_size = world_size
        self.procs = procs
        self.conns = conns

    @classmethod
    def start(cls, world_size: int) -> _Group:
        failures = ""
        for _ in range(3):  # the free port may be taken before rank 0 binds it
            group = cls._spawn(world_size, unused_port())
            failures = group._wait_ready()
            if not failures:
                return group
            group.stop(force=True)
        raise RuntimeError(f"could not start a gloo pool of world size {world_size}:\n{failures}")

    @classmethod
    def _spawn(cls, world_size: int, port: int) -> _Group:
        ctx = get_context("spawn")
        procs, conns = [], []
        with _environ(CHILD_ENV):
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker,
                    args=(rank, world_size, port, child_end),
                    name=f"gloo-pool-w{world_size}-rank{rank}",
                )
                proc.start()
                child_end.close()
                procs.append(proc)
                conns.append(parent_end)
        return cls(world_size, procs, conns)

    def _wait_ready(self) -> str:
        """'' once every rank has joined the group, else what went wrong."""
        replies, _ = self._collect(time.monotonic() + START_TIMEOUT_S)
        problems = []
        for rank in range(self.world_size):
            reply = replies.get(rank)
            if reply is None:
                problems.append(f"rank {rank}: not ready after {START_TIMEOUT_S:.0f}s")
            elif reply[0] != "ready":
                problems.append(f"rank {rank}: {reply[-1]}")
        return "\n".join(problems)

    def call(self, payload: bytes, name: str, timeout: float) -> list[Any]:
        __tracebackhide__ = True
        for conn in self.conns:
            conn.send_bytes(payload)
        replies, in_barrier = self._collect(time.monotonic() + timeout)
        errors = [(r, reply) for r, reply in sorted(replies.items()) if reply[0] != "ok"]
        if errors:
            _raise_worker_error(errors, name, self.world_size)
        if len(replies) < self.world_size:
            ranks = range(self.world_size)
            running = [r for r in ranks if r not in replies and r not in in_barrier]
            waiting = [r for r in ranks if r not in replies and r in in_barrier]
            pytest.fail(
                f"gloo pool: {name} did not finish within {timeout:g}s at world size "
                f"{self.world_size}: ranks {running} still in the function, ranks {waiting} "
                f"past it, in the barrier after it, ranks {sorted(replies)} done (a hang, or "
                "collectives that not every rank called); the pool is stopped and the next "
                "call starts a new one",
                pytrace=False,
            )
        for rank in range(self.world_size):
            output = replies[rank][2]
            if output:
                sys.stdout.write(f"--- gloo rank {rank} of {self.world_size} ---\n{output}")
        return [replies[rank][1] for rank in range(self.world_size)]

    def _collect(self, deadline: float) -> tuple[dict[int, tuple], set[int]]:
        """The final reply of each rank until the deadline, and the ranks that have finished
        the function but not the barrier after it. Once a rank has failed, wait no longer
        than ERROR_GRACE_S, and only for ranks still in the function (those in the barrier
        wait for the failed rank, which never comes)."""
        pending = dict(zip(self.conns, range(self.world_size), strict=True))
        replies: dict[int, tuple] = {}
        in_barrier: set[int] = set()
        failed = False
        while pending and not (failed and set(pending.values()) <= in_barrier):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in wait(list(pending), timeout=remaining):
                rank = pending[conn]
                try:
                    reply = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self.procs[rank].join(1)
                    reply = ("died", f"worker exited (exit code {self.procs[rank].exitcode})")
                except Exception as exc:  # a reply that does not unpickle here
                    reply = ("error", None, f"its reply does not unpickle: {exc!r}", "", "")
                if reply[0] == "done":
                    in_barrier.add(rank)
                    continue
                del pending[conn]
                replies[rank] = reply
                if reply[0] not in ("ok", "ready") and not failed:
                    failed = True
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        return replies, in_barrier

    def stop(self, force: bool) -> None:
        """Stop this group's processes, and only those: a request to leave unless `force`,
        then SIGTERM and SIGKILL to each PID that is still there."""
        if not force:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(b"stop")
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()


def _raise_worker_error(errors: list[tuple[int, tuple]], name: str, world_size: int) -> None:
    __tracebackhide__ = True
    rank, reply = errors[0]
    if reply[0] == "died":
        raise GlooWorkerError(f"gloo pool: rank {rank} of {world_size} running {name}: {reply[1]}")
    _, exc, summary, tb, output = reply
    where = f"raised on rank {rank} of {world_size} in the gloo pool, running {name}"
    if not isinstance(exc, BaseException):
        exc = GlooWorkerError(summary)
    if tb:
        exc.add_note(f"{where}; the worker's traceback:\n{tb.rstrip()}")
    if output:
        exc.add_note(f"rank {rank} printed:\n{output.rstrip()}")
    others = [f"rank {r}: {rep[1] if rep[0] == 'died' else rep[2]}" for r, rep in errors[1:]]
    if others:
        exc.add_note("other ranks failed too:\n" + "\n".join(others))
    raise exc


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# -- in the worker processes ---------------------------------------------------


def _worker(rank: int, world_size: int, port: int, conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if sys.platform == "linux":  # die with the pytest process, even when it is SIGKILLed
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    os.environ.update(CHILD_ENV)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        dist.barrier()
    except BaseException:
        conn.send_bytes(pickle.dumps(("failed", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))

    baseline = (dict(os.environ), os.getcwd(), torch.get_default_dtype())
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the parent has gone
            break
        if message == b"stop":
            break
        conn.send_bytes(_call(message, dist, conn))
        _restore(baseline, torch)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a normal interpreter exit after gloo takes seconds


def _call(message: bytes, dist: Any, conn: Connection) -> bytes:
    output: list[str] = []
    try:
        with _captured_output(output):
            fn, args, kwargs = pickle.loads(message)
            result = fn(*args, **kwargs)
        conn.send_bytes(pickle.dumps(("done",)))  # tells the parent this rank is in the barrier
        dist.barrier()
        return pickle.dumps(("ok", result, output[0]))
    except BaseException as exc:
        summary = "".join(traceback.format_exception_only(exc)).strip()
        tb = traceback.format_exc()
        try:
            sent = pickle.dumps(exc)
            pickle.loads(sent)  # exceptions with custom __init__ signatures may not round-trip
        except Exception:
            exc = None
        return pickle.dumps(("error", exc, summary, tb, "".join(output)))


def _restore(baseline: tuple[dict[str, str], str, Any], torch: Any) -> None:
    environ, cwd, dtype = baseline
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    torch.set_default_dtype(dtype)
    torch.set_num_threads(1)


@contextlib.contextmanager
def _captured_output(output: list[str]) -> Iterator[None]:
    """Send file descriptors 1 and 2 (Python's prints and C++ warnings) to a temporary file;
    append what was written to `output`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            tmp.seek(0)
            output.append(tmp.read().decode(errors="replace"))
