"""Fixtures only; what tests share otherwise is in helpers.py (`from helpers import ...`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster import two_hosts as two_hosts  # namespace hosts (tests/cluster.py)
from gloo import GlooPool
from helpers import Job


@pytest.fixture
def job_factory(tmp_path: Path):
    """Tiny training jobs in the test's temporary folder, run through `meshforge train`."""

    def make(overrides: dict | None = None, name: str = "job") -> Job:
        return Job(tmp_path, overrides, name)

    return make


@pytest.fixture(scope="session")
def gloo() -> Iterator[GlooPool]:
    """In-process gloo worker pools of world size 1, 2, 3 and 4, started on first use and
    kept for the session: `gloo.run(world_size, fn, *args, timeout=300, **kwargs)`."""
    pool = GlooPool()
    yield pool
    pool.shutdown()
