"""The session's gloo worker pools (tests/gloo.py): results, collectives, errors, hangs."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from gloo import GlooPool


def _whoami(tag: str, *, scale: int = 1) -> tuple[str, int, int, str, int]:
    pooled = os.environ["MESHFORGE_IN_POOL"]
    return tag, dist.get_rank() * scale, dist.get_world_size(), pooled, torch.get_num_threads()


def _all_reduce_sum() -> float:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank_1() -> int:
    if dist.get_rank() == 1:
        raise ValueError(f"boom on rank {dist.get_rank()}")
    return dist.get_rank()


def _dp_tp_mesh() -> tuple[tuple[int, ...], tuple[int, ...], float]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=mesh.get_group("tp"))
    tp_ranks = tuple(dist.get_process_group_ranks(mesh.get_group("tp")))
    dp_ranks = tuple(dist.get_process_group_ranks(mesh.get_group("dp")))
    return dp_ranks, tp_ranks, t.item()


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_results_come_back_in_rank_order(gloo: GlooPool) -> None:
    results = gloo.run(4, _whoami, "hi", scale=10)
    assert results == [("hi", 10 * r, 4, "1", 1) for r in range(4)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_sums_over_the_world(gloo: GlooPool, world_size: int) -> None:
    expected = world_size * (world_size + 1) / 2
    assert gloo.run(world_size, _all_reduce_sum) == [expected] * world_size


def test_a_device_mesh_per_call_does_not_leak_into_the_next(gloo: GlooPool) -> None:
    expected = [((0, 2), (0, 1), 1.0), ((1, 3), (0, 1), 1.0), ((0, 2), (2, 3), 5.0),
                ((1, 3), (2, 3), 5.0)]  # fmt: skip
    assert gloo.run(4, _dp_tp_mesh) == expected
    pids = gloo.pids()[4]
    assert gloo.run(4, _dp_tp_mesh) == expected
    assert gloo.pids()[4] == pids  # the same workers served both calls


def test_an_exception_on_rank_1_surfaces_with_its_message(gloo: GlooPool) -> None:
    with pytest.raises(ValueError, match="boom on rank 1") as info:
        gloo.run(2, _raise_on_rank_1)
    notes = "\n".join(info.value.__notes__)
    assert "rank 1 of 2" in notes and "Traceback" in notes and "_raise_on_rank_1" in notes
    assert 2 not in gloo.pids()  # stopped; the next call starts a new pool
    assert gloo.run(2, _all_reduce_sum) == [3.0, 3.0]


def test_a_hang_fails_the_test_within_the_timeout(gloo: GlooPool) -> None:
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="did not finish within 1s"):
        gloo.run(1, _sleep, 60, timeout=1)
    assert time.monotonic() - start < 30
    assert gloo.run(1, _whoami, "again") == [("again", 0, 1, "1", 1)]
