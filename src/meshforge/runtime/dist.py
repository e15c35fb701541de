"""Device selection and the process group's life cycle.

The device is chosen at run time: CUDA with NCCL when a GPU is present, else CPU
with gloo. The group is created with a configurable timeout and always
destroyed on exit, also when training raises."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from meshforge.errors import ConfigError
from meshforge.runtime.env import DistEnv, detect_env


@dataclass(frozen=True)
class Runtime:
    env: DistEnv
    device: torch.device
    backend: str

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0


def choose_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("runtime.device=cuda but no CUDA device is visible")
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def choose_backend(requested: str, device: torch.device) -> str:
    if requested != "auto":
        if requested == "nccl" and device.type != "cuda":
            raise ConfigError("runtime.backend=nccl needs a CUDA device")
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


@contextlib.contextmanager
def distributed(
    device: str = "auto",
    backend: str = "auto",
    timeout_s: float = 300.0,
    threads: int | None = None,
) -> Iterator[Runtime]:
    """Initialise torch.distributed from the detected environment; tear it down on exit."""
    env = detect_env()
    env.export()
    if threads is None and "OMP_NUM_THREADS" not in os.environ:
        # Share the cores between the workers of this node instead of oversubscribing.
        threads = max(1, (os.cpu_count() or 1) // max(1, env.local_world_size))
    if threads is not None:
        torch.set_num_threads(threads)
    dev = choose_device(device, env.local_rank)
    bk = choose_backend(backend, dev)
    dist.init_process_group(
        backend=bk,
        init_method="env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=dev if dev.type == "cuda" else None,
    )
    try:
        yield Runtime(env=env, device=dev, backend=bk)
        # Leave together: a rank that tears down while a peer still finishes its
        # report breaks the peer's connections (seen as aborts at exit under gloo).
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
