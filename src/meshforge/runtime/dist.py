"""Device selection and the process group's life cycle.

The device is chosen at run time: CUDA with NCCL when a GPU is present, else CPU
with gloo. The group is created with a configurable timeout and always
destroyed on exit, also when training raises.

The group's store is made here rather than by init_process_group's env://, so that
global rank 0's store listens on one address (MASTER_ADDR's own, runtime/listen.py),
not on every interface; when every rank of the job is on this host and meets on
loopback, gloo's and NCCL's listeners are kept on loopback too (docs/cluster.md,
"Trust model").

A finished run leaves in this order (`leave_together`), so that a rank that has
finished exits 0. gloo runs each collective on a worker thread of its own, which drops
its reference to the finished work only after the caller has moved on; when that
reference is the last one to a tensor whose Python object the caller has let go, the
drop takes the GIL. If it is still waiting for the GIL when the interpreter finalises,
Python ends the thread with pthread_exit inside a noexcept destructor: "terminate called
without an active exception", SIGABRT, exit -6 (seen under FSDP2, whose groups stay
alive to the very end: DTensor's caches hold their mesh). So, before the group goes:

1. the run's objects that still hold groups or works through reference cycles
   (FSDP2's modules and their last step's collectives) are collected;
2. every rank waits for the others (`barrier`). Issuing it takes gloo's queue lock,
   which a worker thread holds while it drops a finished work, and waiting holds no
   GIL: the pending drops finish here, in a whole interpreter;
3. the group is destroyed; a gloo group that nothing else holds joins its threads."""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from meshforge.errors import ConfigError
from meshforge.runtime import listen, netif
from meshforge.runtime.env import DistEnv, detect_env


@dataclass(frozen=True)
class Runtime:
    env: DistEnv
    device: torch.device
    backend: str
    up_at: float = field(default_factory=time.time)  # when the process group was up

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
    exits_at_once: bool = False,
) -> Iterator[Runtime]:
    """Initialise torch.distributed from the detected environment; tear it down on exit.

    exits_at_once: the process ends with os._exit right after (a `meshforge worker`):
    no interpreter finalises, so the collection of step 1 below is skipped (a tenth
    of a second or more of every run's exit, on a large heap)."""
    env = detect_env()
    env.export()
    if threads is None and "OMP_NUM_THREADS" not in os.environ:
        # Share the cores between the workers of this node instead of oversubscribing.
        threads = max(1, (os.cpu_count() or 1) // max(1, env.local_world_size))
    if threads is not None:
        torch.set_num_threads(threads)
    dev = choose_device(device, env.local_rank)
    bk = choose_backend(backend, dev)
    timeout = timedelta(seconds=timeout_s)
    if env.world_size == env.local_world_size and netif.is_loopback(env.master_addr):
        # every rank is on this host and meets on loopback: so do gloo's and NCCL's
        # listeners (they would take the host name's address), unless the user chose
        os.environ.setdefault("GLOO_SOCKET_IFNAME", listen.loopback_interface())
        os.environ.setdefault("NCCL_SOCKET_IFNAME", listen.loopback_interface())
    dist.init_process_group(
        backend=bk,
        store=group_store(env, timeout),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        device_id=dev if dev.type == "cuda" else None,
    )
    try:
        yield Runtime(env=env, device=dev, backend=bk)
        leave_together(collect=not exits_at_once)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def group_store(env: DistEnv, timeout: timedelta) -> dist.Store:
    """The default group's store, as init_process_group's env:// makes it, except that
    global rank 0's server listens on one address (runtime/listen.py), not on every
    interface. Under the elastic agent with a shared store (TORCHELASTIC_USE_AGENT_STORE)
    every rank is a client of the agent's store."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    if env.rank == 0 and not agent_store:
        addr = listen.store_address(env.master_addr)
        try:
            store = listen.tcp_store_server(addr, env.master_port, timeout, env.world_size)
        except OSError as exc:
            raise RuntimeError(
                f"global rank 0 cannot listen on {addr}:{env.master_port} "
                f"(MASTER_ADDR={env.master_addr}, MASTER_PORT): {exc.strerror or exc}"
            ) from None
    else:
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            False,
            timeout,
            multi_tenant=not agent_store,
        )
    store.set_timeout(timeout)
    # what init_process_group puts in front of a store it made itself
    return dist.PrefixStore("default_pg", store)


def leave_together(collect: bool = True) -> None:
    """The end of a finished run, before the group is destroyed (steps 1 and 2 above).

    The barrier also keeps a rank from tearing down while a peer still finishes its
    report, which would break the peer's connections."""
    if collect:
        gc.collect()
    dist.barrier()
