"""Memory accounting: what a rank holds, each byte counted once."""

from __future__ import annotations

import psutil
import pytest
import torch
from torch import nn

from meshforge.observe.memory import peak_memory_bytes, tensor_bytes


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage, two names


def test_tensor_bytes_counts_a_tied_weight_once() -> None:
    state = TiedLM().state_dict()
    assert set(state) == {"embed.weight", "head.weight"}
    assert tensor_bytes(state) == 50 * 8 * 4


def test_tensor_bytes_counts_distinct_tensors_by_dtype() -> None:
    tensors = [torch.zeros(10, dtype=torch.float32), torch.zeros(10, dtype=torch.bfloat16)]
    assert tensor_bytes(tensors) == 10 * 4 + 10 * 2


def test_views_of_one_buffer_count_the_bytes_they_cover() -> None:
    flat = torch.zeros(100)
    assert tensor_bytes([flat[:10], flat[5:20]]) == 20 * 4  # overlap counted once
    assert tensor_bytes([flat[:10], flat[50:60]]) == 20 * 4  # the rest of flat is not held here
    assert tensor_bytes([flat, flat[:10]]) == 100 * 4
    assert tensor_bytes(flat.view(10, 10).t()) == 100 * 4  # strided view spans the whole buffer


def test_tensor_bytes_walks_optimizer_state_and_skips_non_tensors() -> None:
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state_bytes = tensor_bytes(opt.state_dict()["state"])
    params = 4 * 3 + 3
    # exp_avg + exp_avg_sq in fp32, plus a 0-d fp32 step counter per parameter
    assert state_bytes == 2 * params * 4 + 2 * 4
    assert tensor_bytes({"note": "text", "n": 3, "none": None}) == 0


def test_meta_and_empty_tensors_hold_nothing() -> None:
    assert tensor_bytes([torch.empty(1000, device="meta"), torch.empty(0)]) == 0


def test_a_dtensor_counts_only_its_local_shard() -> None:
    dist = pytest.importorskip("torch.distributed")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        local = torch.ones(5, 4)
        sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        assert sharded.shape == (10, 4)
        assert tensor_bytes([sharded]) == 5 * 4 * 4
        assert tensor_bytes([sharded, local]) == 5 * 4 * 4  # same storage as its local tensor
    finally:
        dist.destroy_process_group()


def test_cpu_peak_memory_is_in_bytes_and_at_least_the_current_rss() -> None:
    current_rss = psutil.Process().memory_info().rss
    peak = peak_memory_bytes(torch.device("cpu"))
    assert peak >= current_rss - (1 << 20)  # RSS may shrink a little between the two reads
    assert peak < 1 << 50  # bytes, not a unit mix-up
