"""Workers that start with torch already imported (issue 14: start fast, restart fast).

Importing torch and meshforge's trainer takes a worker 1.5-2.5 s, at every launch and
at every elastic restart, and on a node of 8 GPUs eight processes pay it at once.
`meshforge train` therefore starts one *zygote* next to the elastic agent, as early as
it can: a process that imports what a worker needs once and then waits. The agent
still starts, watches, signals and restarts its workers as ever, but the command it
starts is this module's small client (no torch import): the client passes its
arguments, environment, working directory and standard streams to the zygote over a
Unix socket, the zygote forks, and the child becomes the worker in a session of its
own, exactly as `python -m meshforge worker ...` would have run.

The client stands in for its worker: signals the agent sends it (SIGTERM, SIGINT, ...)
are passed on, and it exits as the worker did (the same code, or the same signal). If
the client dies (the agent's SIGKILL after its shutdown timeout) the zygote kills the
worker. The zygote leaves once its launcher is gone and no worker of its is left.

Anything unexpected (no zygote, one that could not preload, a refused connection)
makes the client run the worker itself: the start is slower, never different.
`MESHFORGE_ZYGOTE=0` turns the zygote off.

Why fork is safe here: the zygote only imports; it runs no torch operation, so no
OpenMP or intra-op thread pool, CUDA context or process group exists when it forks,
and it serves only with no Python thread but its own. (numpy's OpenBLAS starts idle
threads when imported; it re-initialises its pool in a forked child, as it does in
every forked DataLoader worker.) Each worker sets its own
thread count, seeds and devices after the fork, as a fresh process does.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from meshforge.runtime.parent import signal_on_parent_death

ENV = "MESHFORGE_ZYGOTE"  # the socket's path in a worker's environment; "0": off
_PRELOAD = (
    "torch",
    "torch.distributed",
    "meshforge.train.worker",
    "meshforge.train.trainer",
    # what the first checkpoint would import (DCP looks for an fsspec path): not on
    # the critical path of the first save
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint._fsspec_filesystem",
    "torch.utils.serialization.config",
)
_RELAYED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCONT")
_HEADER = struct.Struct("!I")
_worker_main: Callable[[list[str]], object] | None = None  # serve(): the given entry point


def enabled() -> bool:
    return os.environ.get(ENV, "") != "0" and sys.platform == "linux"


# -- the launcher's side -------------------------------------------------------------------


class Zygote:
    """The zygote process a launcher starts, and its socket."""

    def __init__(self, entry: str) -> None:
        """`entry`: the worker's `module:function`, called with its arguments (the
        launcher's caller names it: this module imports nothing above the launcher)."""
        _entry_point(entry)  # a malformed name fails here, not in every forked worker
        self.dir = Path(tempfile.mkdtemp(prefix="meshforge-zygote-"))
        self.path = self.dir / "sock"
        # a session of its own: a Ctrl-C in the terminal reaches the launcher only
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshforge.launch.zygote", "--serve", str(self.path),
             str(os.getpid()), entry],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip

    def worker_command(self, cmd_args: list[str]) -> list[str]:
        """torchrun's `-u -m meshforge ARGS` with the client in meshforge's place."""
        if "-m" not in cmd_args or cmd_args[cmd_args.index("-m") + 1 :][:1] != ["meshforge"]:
            return cmd_args
        i = cmd_args.index("-m") + 1
        os.environ[ENV] = f"{self.path}:{self.proc.pid}"
        return [*cmd_args[:i], "meshforge.launch.zygote", *cmd_args[i + 1 :]]

    def stop(self) -> None:
        """The launcher is done: the zygote leaves now, or once its last worker has."""
        with contextlib.suppress(OSError):
            self.proc.terminate()
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)
            self.dir.rmdir()


def _entry_point(entry: str) -> tuple[str, str]:
    module, sep, function = entry.partition(":")
    if not (module and sep and function.isidentifier()):
        raise ValueError(f"a worker entry point is module:function, not {entry!r}")
    return module, function


def start(entry: str) -> Zygote | None:
    """A zygote for this launcher's workers, unless turned off."""
    if not enabled():
        return None
    try:
        return Zygote(entry)
    except OSError:
        return None


# -- the zygote ----------------------------------------------------------------------------


def _send(conn: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    conn.sendall(_HEADER.pack(len(data)) + data)


def _recv(conn: socket.socket, fds: bool = False) -> tuple[dict | None, list[int]]:
    """One length-prefixed JSON message (and the descriptors sent with it)."""
    got: list[int] = []
    if fds:
        data, got, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    else:
        data = conn.recv(1 << 16)
    if not data:
        return None, got
    while len(data) < _HEADER.size:
        more = conn.recv(1 << 16)
        if not more:
            return None, got
        data += more
    (size,) = _HEADER.unpack_from(data)
    while len(data) < _HEADER.size + size:
        more = conn.recv(1 << 16)
        if not more:
            return None, got
        data += more
    return json.loads(data[_HEADER.size : _HEADER.size + size]), got


def serve(path: str, launcher_pid: int, entry: str) -> None:
    global _worker_main
    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # optional (fsspec): the worker imports it when it needs it
            continue
    module, function = _entry_point(entry)
    _worker_main = getattr(importlib.import_module(module), function)
    import threading

    if threading.active_count() != 1:  # a Python thread could hold a lock at the fork
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # clients connect only once preloading is done
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("listen", None))
    live: dict[int, tuple[socket.socket, int]] = {}  # worker pid -> (client conn, pidfd)
    stopping = False

    def on_term(*_) -> None:  # the launcher's stop: leave now, or once the workers have
        nonlocal stopping
        stopping = True
        if not live:
            os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    while True:
        for key, _ in sel.select(timeout=0.5):
            kind, data = key.data
            if kind == "listen":
                conn, _ = listener.accept()
                sel.register(conn, selectors.EVENT_READ, ("request", None))
            elif kind == "request":
                conn = key.fileobj
                sel.unregister(conn)
                request, fds = _recv(conn, fds=True)
                if request is None or len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                pid = _fork_worker(request, fds, listener, conn, live)
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                live[pid] = (conn, pidfd)
                _send(conn, {"pid": pid})
                sel.register(conn, selectors.EVENT_READ, ("client", pid))
                sel.register(pidfd, selectors.EVENT_READ, ("exited", pid))
            elif kind == "client":  # the client went away while its worker runs
                with contextlib.suppress(OSError):
                    if not key.fileobj.recv(1):
                        sel.unregister(key.fileobj)
                        os.kill(data, signal.SIGKILL)
            elif kind == "exited":
                conn, pidfd = live.pop(data)
                _, status = os.waitpid(data, 0)
                sel.unregister(pidfd)
                os.close(pidfd)
                with contextlib.suppress(KeyError, ValueError):
                    sel.unregister(conn)
                with contextlib.suppress(OSError):
                    _send(conn, {"status": status})
                conn.close()
        if os.getppid() != launcher_pid or stopping:
            stopping = True  # the launcher is gone: no new workers; leave once idle
            if not live:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    os.rmdir(os.path.dirname(path))  # the launcher could not (killed)
                return


def _fork_worker(request: dict, fds: list[int], *keep_out) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        listener, conn, live = keep_out
        listener.close()
        conn.close()
        for other, pidfd in live.values():
            other.close()
            os.close(pidfd)
        _become_worker(request, fds)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a worker's crash is reported as python would
        sys.excepthook(*sys.exc_info())  # the worker's own one-line hook (train/worker.py)
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    return 0  # not reached


def _become_worker(request: dict, fds: list[int]) -> None:
    """In the forked child: become `python -u -m meshforge ARGS` as the client was."""
    import random

    os.setsid()
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCHLD"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout.reconfigure(write_through=True)  # python -u
    sys.stderr.reconfigure(write_through=True)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ["MESHFORGE_PRELOADED"] = "1"  # train/timing.py: report.json says so
    # the process whose death the worker must notice (train/worker.py): the zygote,
    # which outlives its launcher only while it has workers
    os.environ["MESHFORGE_EXPECTED_PARENT"] = str(os.getppid())
    sys.argv = ["meshforge", *request["args"]]
    sys.path[0] = request["cwd"]
    random.seed()
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        import torch  # OpenMP read the zygote's environment when torch was imported

        torch.set_num_threads(int(threads))
    assert _worker_main is not None  # serve() resolved it before it accepted anyone
    _worker_main(request["args"])


# -- the client the elastic agent starts ---------------------------------------------------


def _run_directly(args: list[str]) -> None:
    python = sys.executable
    os.execv(python, [python, "-u", "-m", "meshforge", *args])


def _connect(spec: str) -> socket.socket | None:
    """Connected to the zygote once it has preloaded; None if there is none to wait for."""
    path, _, pid = spec.rpartition(":")
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
        try:
            os.kill(int(pid), 0)
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return None  # it exited (it would not fork with threads)
        except (OSError, ValueError, IndexError):
            return None
        time.sleep(0.01)
    return None


def _quiet_exit(signum: int, frame) -> None:  # noqa: ARG001 - signal API
    os._exit(128 + signum)  # stopped before its worker exists: nothing to pass on


def client(args: list[str]) -> None:
    # Until its worker exists a stop ends the client at once, quietly (no traceback from
    # a sleep); it also ends when the launcher dies (SIGTERM), or has died already.
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), _quiet_exit)
    # SIGTERM (passed on to the worker) when the launcher dies, as a worker started by
    # the agent itself gets (train/worker.py)
    if not signal_on_parent_death(signal.SIGTERM, os.environ.get("MESHFORGE_LAUNCHER_PID")):
        os._exit(1)
    spec = os.environ.get(ENV, "")
    sock = _connect(spec) if spec and spec != "0" else None
    if sock is None:
        _run_directly(args)
    request = {"args": args, "env": dict(os.environ), "cwd": os.getcwd()}
    data = json.dumps(request).encode()
    try:
        socket.send_fds(sock, [_HEADER.pack(len(data)) + data], [0, 1, 2])
        reply, _ = _recv(sock)
    except OSError:
        reply = None
    if reply is None:  # refused before it forked anything: start the worker here
        sock.close()
        _run_directly(args)
    pid = reply["pid"]

    def relay(signum: int, frame) -> None:  # noqa: ARG001 - signal API
        with contextlib.suppress(OSError):
            os.kill(pid, signum)

    for name in _RELAYED:
        signal.signal(getattr(signal, name), relay)
    try:
        reply, _ = _recv(sock)
    except OSError:
        reply = None
    if reply is None:  # the zygote died with its worker
        print(f"meshforge: worker {pid} lost with its zygote", file=sys.stderr, flush=True)
        os._exit(1)
    status = reply["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        client(sys.argv[1:])
