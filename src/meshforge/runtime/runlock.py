"""A run directory belongs to one job at a time.

A job holds an exclusive `flock` on RUN_DIR/.lock for as long as it runs, and writes
into that file who holds it (host, pid, job id, since when), so a second job on the
same directory is refused in one line that names the first. The kernel drops the lock
when the holding process ends, however it ends, so a crashed job leaves no stale lock:
the text left in the file is then only history. The check comes before anything is
written; a refused job changes nothing in the directory. The lock files are opened
through fileio (never through a symbolic link, created with the user's umask): a link
planted at .lock is refused in one line, and the file it points to is left alone.

Who holds it:
- A launcher that runs the whole job from one process (`meshforge train` on one node,
  `meshforge submit mpi`) takes it before it writes anything (config.yaml included) and
  keeps it while its workers run. It tells them with MESHFORGE_RUN_LOCK_HELD=<run dir>
  (`mark_held_for_workers`), which they inherit; mpirun forwards MESHFORGE_* to every
  host. Its workers outlive it by up to `runtime.grace_s` when it is killed (they
  checkpoint and stop), so its global rank 0 holds RUN_DIR/.lock-workers as long as
  it lives (a worker cannot inherit the launcher's descriptor: the elastic agent
  closes them); whoever takes .lock then also checks that .lock-workers is free, and
  `is_held` answers for both.
- Otherwise (one `meshforge train` agent per node on a shared run directory, srun,
  Kubernetes, plain torchrun) global rank 0's worker takes it (`worker_run_lock`).
  After an elastic restart the new rank 0 takes it again; if its dead predecessor of
  the same job still holds it (an NFS lock outlives a lost node by the lease time), it
  waits for it a bounded time. The agents of such a job only check that no *other* job
  holds the directory (`check_run_dir_free`), so they never refuse each other.

Across nodes the run directory is on shared storage; on NFS, Linux emulates flock with
whole-file POSIX locks, which the server arbitrates. With those, closing any other
descriptor of the lock file in the holding process would drop the lock, so the holder
reads and writes the file only through the descriptor it locked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from meshforge.errors import ConfigError, MeshforgeError
from meshforge.fileio import SymlinkRefused, open_lock_file, read_text_nofollow
from meshforge.rundir.files import LOCK_FILE, LOCK_FILES, WORKERS_LOCK_FILE

RUN_LOCK_HELD_ENV = "MESHFORGE_RUN_LOCK_HELD"
JOB_ID_ENV = "MESHFORGE_JOB_ID"

# A peer may hold the lock for an instant while it checks (`check_run_dir_free`), or may
# have taken it and not yet written its name: contention shorter than this is retried.
CONTENTION_GRACE_S = 0.5
# How long a new rank 0 waits for a dead predecessor of its own job to let go: more
# than NFSv4's default 90 s lease, after which the server drops a lost client's locks.
SAME_JOB_WAIT_S = 120.0
_POLL_S = 0.05

# flock on a file system that cannot lock: warn and run unlocked rather than refuse.
_LOCKS_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunDirInUse(MeshforgeError):
    """The run directory is held by another job."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run directory, as written into its lock file."""

    host: str
    pid: int
    job_id: str
    since: float  # time.time() when it took the lock

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on host {self.host} since {when}"

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            d = json.loads(text)
            return cls(str(d["host"]), int(d["pid"]), str(d["job_id"]), float(d["since"]))
        except (ValueError, KeyError, TypeError):
            return None


def job_id_from_env(environ: Mapping[str, str] | None = None) -> str:
    """This process's job, the same on every rank and node of one job: the id its
    launcher exported (MESHFORGE_JOB_ID), else the elastic agent's rendezvous id, Slurm's
    job id or OpenMPI's namespace, else host:pid (a job of its own)."""
    env = os.environ if environ is None else environ
    if env.get(JOB_ID_ENV):
        return env[JOB_ID_ENV]
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":  # torchrun's static rendezvous has run id "none"
        return torchrun_job_id(run_id, None, None)
    for key in ("SLURM_JOB_ID", "PMIX_NAMESPACE"):
        if env.get(key):
            return f"{key}={env[key]}"
    return f"{socket.gethostname()}:{os.getpid()}"


def torchrun_job_id(rdzv_id: str | None, master_addr: str | None, master_port: int | None) -> str:
    """A multi-node `meshforge train` job's id, the same on every node: the rendezvous id,
    or, under a static rendezvous (run id "none"), the master's address and port, which
    no two live jobs share. Its launchers export it (`export_job_id`) so that the workers
    name the same job whatever the rendezvous."""
    if rdzv_id and rdzv_id != "none":
        return f"rdzv={rdzv_id}"
    return f"static={master_addr or '127.0.0.1'}:{master_port or 29500}"


def export_job_id(job_id: str, environ: MutableMapping[str, str] | None = None) -> None:
    env = os.environ if environ is None else environ
    env[JOB_ID_ENV] = job_id


def _key(run_dir: Path) -> str:
    return os.path.realpath(run_dir)


def _warn_stderr(message: str) -> None:
    print(f"meshforge: warning: {message}", file=sys.stderr, flush=True)


def _in_use(run_dir: Path, holder: Holder | None, name: str = LOCK_FILE) -> RunDirInUse:
    who = holder.describe() if holder else "holder unknown"
    if name == WORKERS_LOCK_FILE:  # .lock itself was free: their launcher is gone
        return RunDirInUse(
            f"run directory {run_dir} is in use by another job (its workers: {who}; their "
            "launcher has exited and they are stopping with a checkpoint); wait for them to "
            "exit or use another run directory"
        )
    return RunDirInUse(
        f"run directory {run_dir} is in use by another job ({who}); "
        "use another run directory or wait for that job to end"
    )


class RunDirLock:
    """An exclusive hold on a run directory (its lock file NAME: .lock, or .lock-workers
    for the workers of a launcher that holds .lock); a context manager once acquired."""

    def __init__(
        self,
        run_dir: Path,
        job_id: str | None = None,
        warn: Callable[[str], None] = _warn_stderr,
        name: str = LOCK_FILE,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.name = name
        self.path = self.run_dir / name
        self.job_id = job_id or job_id_from_env()
        self.warn = warn
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _open(self) -> int:
        """The lock file's descriptor (created if need be, with the user's umask; nothing
        else is written). A symbolic link planted at the lock path is refused: locking
        and truncating through it would write the file it points to."""
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise ConfigError(
                f"cannot use run directory {self.run_dir}: it is a file, not a directory"
            )
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            return open_lock_file(self.path)
        except SymlinkRefused as exc:
            raise ConfigError(f"cannot use run directory {self.run_dir}: {exc}") from None
        except OSError as exc:
            raise ConfigError(
                f"cannot use run directory {self.run_dir}: {exc.strerror or exc}"
            ) from None

    def _lock(self, fd: int, wait_same_job_s: float) -> bool:
        """flock FD; False where the file system cannot lock."""
        start = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                holder = read_holder(self.run_dir, self.name)
                waited = time.monotonic() - start
                same_job = holder is not None and holder.job_id == self.job_id
                if waited < CONTENTION_GRACE_S or (same_job and waited < wait_same_job_s):
                    time.sleep(_POLL_S)
                    continue
                raise _in_use(self.run_dir, holder, self.name) from None
            except OSError as exc:
                if exc.errno not in _LOCKS_UNSUPPORTED:
                    raise
                self.warn(
                    f"cannot lock run directory {self.run_dir} ({exc.strerror}): "
                    "make sure no other job uses it"
                )
                return False

    def acquire(self, wait_same_job_s: float = 0.0) -> RunDirLock:
        """Take the lock or raise RunDirInUse naming its holder. A holder of this same job
        (a dead predecessor whose lock has not yet been dropped) is waited for up to
        `wait_same_job_s`. Taking .lock also needs .lock-workers free: the workers of a
        killed launcher may still be stopping there."""
        if self._fd is not None:
            return self
        fd = self._open()
        try:
            locked = self._lock(fd, wait_same_job_s)
        except BaseException:
            os.close(fd)
            raise
        if not locked:
            os.close(fd)
            return self
        if self.name == LOCK_FILE:
            try:
                _check_free(self.run_dir, WORKERS_LOCK_FILE, self.job_id)
            except BaseException:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                raise
        self._fd = fd
        holder = Holder(socket.gethostname(), os.getpid(), self.job_id, time.time())
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(asdict(holder)).encode(), 0)
        except OSError as exc:  # a full disk must not stop the job: the lock itself holds
            self.warn(f"cannot record the holder of {self.path}: {exc.strerror}")
        return self

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # before unlocking: the next holder's text is never cut
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def hold_run_dir(
    run_dir: Path,
    job_id: str | None = None,
    *,
    wait_same_job_s: float = 0.0,
    warn: Callable[[str], None] = _warn_stderr,
) -> RunDirLock:
    """Take RUN_DIR for this job, before anything is written into it; raises RunDirInUse
    (exit 2, one line) when another job holds it. Release with `.release()` or use the
    returned lock as a context manager: `with hold_run_dir(run_dir, job_id): ...`."""
    return RunDirLock(run_dir, job_id, warn).acquire(wait_same_job_s)


# A holder record is one short JSON line; a lock file is never read further than this.
_HOLDER_MAX_BYTES = 4096


def read_holder(run_dir: Path, name: str = LOCK_FILE) -> Holder | None:
    """Who holds (or last held) RUN_DIR, from its lock file NAME; None if unknown (also
    when NAME is a symbolic link, which is never read through)."""
    try:
        return Holder.parse(read_text_nofollow(Path(run_dir) / name, _HOLDER_MAX_BYTES))
    except OSError:
        return None


def check_run_dir_free(run_dir: Path, job_id: str | None = None) -> None:
    """Raise RunDirInUse if a job other than `job_id` holds RUN_DIR (any job, without
    one): its launcher, or the workers of a launcher that was killed. For those who
    write into RUN_DIR without holding it: the agents of a multi-node job (whose global
    rank 0 holds it) and a submitter whose job runs later (`meshforge submit slurm`
    writes config.yaml). Writes nothing."""
    for name in LOCK_FILES:
        _check_free(Path(run_dir), name, job_id)


def _check_free(run_dir: Path, name: str, job_id: str | None) -> None:
    """Raise RunDirInUse if a job other than `job_id` holds the lock file NAME."""
    try:
        fd = open_lock_file(run_dir / name, create=False)
    except OSError:
        # no lock file: nobody has ever held it (or it cannot be locked at all); a
        # symbolic link there holds nothing, and whoever takes the lock refuses it
        return
    try:
        start = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return  # free; closing the descriptor drops our instant's hold
            except BlockingIOError:
                holder = read_holder(run_dir, name)
                if holder is not None and holder.job_id == job_id:
                    return  # this job's global rank 0 holds it
                if time.monotonic() - start < CONTENTION_GRACE_S:
                    time.sleep(_POLL_S)
                    continue
                raise _in_use(run_dir, holder, name) from None
            except OSError:
                return  # locks unsupported here; the holder warns
    finally:
        os.close(fd)


def is_held(run_dir: Path) -> bool | None:
    """Whether some process holds RUN_DIR now (its launcher's .lock, or .lock-workers,
    which the workers of a killed launcher hold until they exit); None where that cannot
    be told (no lock file, or a file system that cannot lock). For watchers (`meshforge
    top`): a shared lock tried for an instant on a read-only descriptor of its own, then
    let go; it needs no write permission and writes nothing (a job starting in that
    instant retries, see CONTENTION_GRACE_S). Never call it from a holding process: on
    NFS, closing this descriptor would drop that process's own lock."""
    answers = [_probe(Path(run_dir) / name) for name in LOCK_FILES]
    if True in answers:
        return True
    return False if False in answers else None


def _probe(path: Path) -> bool | None:
    try:
        fd = open_lock_file(path, readonly=True, create=False)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    else:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def mark_held_for_workers(run_dir: Path, environ: MutableMapping[str, str] | None = None) -> None:
    """Tell the workers (through the environment they inherit) that the launcher holds
    RUN_DIR, so that their rank 0 does not try to take it too."""
    env = os.environ if environ is None else environ
    env[RUN_LOCK_HELD_ENV] = _key(run_dir)


def held_by_launcher(run_dir: Path, environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(RUN_LOCK_HELD_ENV) == _key(run_dir)


def worker_run_lock(
    run_dir: Path,
    rank: int,
    environ: Mapping[str, str] | None = None,
    wait_same_job_s: float = SAME_JOB_WAIT_S,
) -> contextlib.AbstractContextManager[Any]:
    """What a worker holds for its lifetime: global rank 0 holds RUN_DIR's .lock, or,
    when its launcher holds that, .lock-workers (so that the directory stays held while
    it stops after its launcher was killed); other ranks hold nothing. Enter it before
    the worker writes anything into RUN_DIR."""
    if rank != 0:
        return contextlib.nullcontext()
    job_id = job_id_from_env(environ)
    if held_by_launcher(run_dir, environ):
        lock = RunDirLock(run_dir, job_id, name=WORKERS_LOCK_FILE)
        return lock.acquire(wait_same_job_s)
    return hold_run_dir(run_dir, job_id, wait_same_job_s=wait_same_job_s)
