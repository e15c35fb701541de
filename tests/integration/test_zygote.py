"""The launcher's zygote (launch/zygote.py): workers forked with torch imported.

A whole training run through the zygote, and its equality with fresh interpreters,
is in test_faults (the restart test); here, the client's contract with any command:
the output, the exit code and the fallback when there is no zygote."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO

PLAN = ["plan", "--params", "7e9", "--gpus", "8", "--zero", "3", "--json"]


def _client(args: list[str], spec: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MESHFORGE_ZYGOTE": spec}
    return subprocess.run(
        [sys.executable, "-m", "meshforge.launch.zygote", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def zygote():
    from meshforge.launch import zygote as z

    started = z.Zygote("meshforge.cli:main")
    yield started
    started.stop()
    started.proc.wait(timeout=30)


def test_without_a_zygote_the_client_runs_the_command_itself(tmp_path):
    direct = subprocess.run([sys.executable, "-m", "meshforge", *PLAN], cwd=REPO,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    gone = _client(PLAN, f"{tmp_path / 'sock'}:{2**22 + 1}")  # no such socket or process
    assert gone.returncode == direct.returncode == 0, gone.stderr
    assert json.loads(gone.stdout) == json.loads(direct.stdout)


def test_a_forked_command_gives_its_output_and_its_exit_code(zygote):
    spec = f"{zygote.path}:{zygote.proc.pid}"
    done = _client(PLAN, spec)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["layout"]["zero"] == 3
    bad = _client(["plan", "--params", "7e9", "--gpus", "8", "--zero", "7"], spec)
    assert bad.returncode == 2 and "--zero" in bad.stderr, bad.stderr
    assert zygote.proc.poll() is None  # it serves the next worker (a restart) too
