"""The unit tier's rule: a test here starts no process. Starting one (subprocess, fork,
multiprocessing, torch.multiprocessing, or `meshforge train`/a worker run in-process)
fails the test, so that `make test-fast` stays fast and a slow test is moved, not hidden."""

from __future__ import annotations

import _posixsubprocess
import importlib
import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator

import pytest

RULE = (
    "tests/unit starts no process (no subprocess, fork, multiprocessing or training run); "
    "a test that needs one belongs in tests/integration"
)

# meshforge's in-process training entry points, "module:attribute"; test_guard.py checks
# that each still resolves, so that moving one breaks loudly rather than the guard.
TRAINING_ENTRY_POINTS = (
    "meshforge.launch.local:launch_training",
    "meshforge.train.worker:run_worker",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "guard_selftest: a test of the guard itself (tests/unit/test_guard.py)"
    )


class ProcessStartRefused(RuntimeError):
    """A unit test tried to start a process."""


def _refuse(what: str, attempts: list[str]):
    def refused(*args, **kwargs):
        attempts.append(what)
        raise ProcessStartRefused(f"{what}: {RULE}")

    return refused


def _install(mp: pytest.MonkeyPatch, attempts: list[str]) -> None:
    mp.setattr(subprocess.Popen, "_execute_child", _refuse("subprocess.Popen", attempts))
    mp.setattr(_posixsubprocess, "fork_exec", _refuse("fork_exec", attempts))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        mp.setattr(os, name, _refuse(f"os.{name}", attempts))
    mp.setattr(
        multiprocessing.process.BaseProcess, "start", _refuse("multiprocessing start", attempts)
    )
    for spec in TRAINING_ENTRY_POINTS:
        module, attr = spec.split(":")
        mp.setattr(importlib.import_module(module), attr, _refuse(spec, attempts))


def _guarded(item: pytest.Item) -> Iterator[None]:
    attempts: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        _install(mp, attempts)
        yield
    if attempts and not item.get_closest_marker("guard_selftest"):
        # Raised also when the code under test caught the refusal and carried on.
        raise ProcessStartRefused(f"{', '.join(attempts)}: {RULE}")


# Each phase of a unit test (its fixtures too, whatever their scope) runs under the guard;
# these hooks are this folder's, so tests elsewhere in the same session are not affected.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    return (yield from _guarded_phase(item))


def _guarded_phase(item: pytest.Item):
    guard = _guarded(item)
    next(guard)
    try:
        result = yield
    finally:
        for _ in guard:
            pass
    return result


@pytest.fixture
def meshforge(capsys):
    """`meshforge ARGS` in this process (tests/unit starts no process), as a
    CompletedProcess: exit code, stdout, stderr."""
    from meshforge.cli import main

    def run(args: list[str]) -> subprocess.CompletedProcess:
        with pytest.raises(SystemExit) as exit_:
            main(args)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, exit_.value.code, out.out, out.err)

    return run
