"""A Python API for your own model and dataset: one object, a strategy by name.

    fabric = Fabric(strategy="zero2", precision="bf16")
    fabric.launch(train, nproc=2)          # train(fabric) runs on every rank

    def train(fabric):
        model, optimizer = fabric.setup(MyNet(), lr=1e-3)
        loader = fabric.setup_dataloader(dataset, batch_size=32)
        for x, y in loader:
            with fabric.autocast():
                loss = F.cross_entropy(model(fabric.to_device(x)), fabric.to_device(y))
            fabric.backward(loss)
            fabric.clip_grad_norm(1.0)
            fabric.step()
            fabric.zero_grad()

The strategies are those of the job config (`parallel.zero`), applied by
`DataParallelModel`; the process group comes from `runtime.dist.distributed`.
From a plain `python script.py`, `launch` starts the workers through the torch
elastic agent; under torchrun, srun or mpirun it runs `train` in this process.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from meshforge.errors import ConfigError

if TYPE_CHECKING:
    from meshforge.parallel.data_parallel import DataParallelModel
    from meshforge.runtime.dist import Runtime

T = TypeVar("T")

STRATEGIES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
PRECISIONS = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


@dataclass(frozen=True)
class _Settings:
    """What a worker needs to rebuild the Fabric (picklable: crosses the process spawn)."""

    strategy: str
    precision: str
    device: str
    backend: str
    timeout_s: float
    seed: int
    bucket_mb: float


def _choice(kind: str, value: str, choices: dict[str, Any]) -> str:
    if value not in choices:
        raise ConfigError(f"unknown {kind} {value!r}; choose one of {', '.join(choices)}")
    return value


class Fabric:
    """Data parallel / ZeRO training of any nn.Module, chosen by name.

    strategy: ddp | zero1 | zero2 | zero3 (alias fsdp); precision: fp32 | bf16 | fp16
    (fp16 with dynamic loss scaling). Every rank seeds torch with `seed` before the
    training function runs, so models built there start identical on every rank."""

    def __init__(
        self,
        strategy: str = "ddp",
        precision: str = "fp32",
        *,
        device: str = "auto",
        backend: str = "auto",
        timeout_s: float = 300.0,
        seed: int = 0,
        bucket_mb: float = 25.0,
    ) -> None:
        _choice("strategy", strategy, STRATEGIES)
        _choice("precision", precision, PRECISIONS)
        self._settings = _Settings(strategy, precision, device, backend, timeout_s, seed, bucket_mb)
        self.zero = STRATEGIES[strategy]
        self.precision = PRECISIONS[precision]
        self._stack: contextlib.ExitStack | None = None
        self._rt = None
        self._mesh = None
        self._par = None
        self._scaler = None
        self._unscaled = False

    # -- process life cycle ---------------------------------------------------------
    def __enter__(self) -> Fabric:
        """Join the process group of the launcher that started this process (torchrun, ...)."""
        from meshforge.parallel.data_parallel import build_mesh
        from meshforge.runtime.dist import distributed

        s = self._settings
        stack = contextlib.ExitStack()
        self._rt = stack.enter_context(distributed(s.device, s.backend, s.timeout_s))
        self._stack = stack
        try:
            self._mesh = build_mesh(self._rt.device, self._rt.world_size)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        torch.manual_seed(s.seed)
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        self._rt = self._mesh = self._par = self._scaler = None
        self._unscaled = False
        if stack is not None:
            stack.close()  # destroys the process group, also when training raised

    def launch(self, fn: Callable[[Fabric], T], nproc: int = 1) -> T | None:
        """Run fn(fabric) on every rank.

        Under torchrun, srun or mpirun (one process per rank already) fn runs here and
        its result is returned. Otherwise nproc workers are started through the torch
        elastic agent and rank 0's result is returned; fn must then be importable
        (top level of a module, or of a script guarded by `if __name__ == "__main__":`)."""
        from meshforge.runtime.env import detect_env

        if detect_env().launcher != "single":
            return _run(self._settings, fn)
        if nproc < 1:
            raise ConfigError(f"nproc must be at least 1, got {nproc}")
        return _spawn(self._settings, fn, nproc)

    # -- placement ------------------------------------------------------------------
    def _runtime(self) -> Runtime:
        if self._rt is None:
            raise RuntimeError("Fabric is not running: use fabric.launch(fn) or `with fabric:`")
        return self._rt

    @property
    def rank(self) -> int:
        return self._runtime().rank

    @property
    def world_size(self) -> int:
        return self._runtime().world_size

    @property
    def device(self) -> torch.device:
        return self._runtime().device

    @property
    def is_main(self) -> bool:
        return self._runtime().is_main

    def setup(
        self,
        model: nn.Module,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        shard_units: list[nn.Module] | None = None,
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Place the model under the strategy; returns (model to call, its AdamW optimizer).

        shard_units: submodules that become FSDP units of their own under zero2/zero3
        (e.g. the layers of a deep network; default: `model.blocks` when it exists);
        the root module is always one."""
        from meshforge.parallel.data_parallel import DataParallelModel, OptimizerSettings

        rt = self._runtime()
        opt = OptimizerSettings(lr, weight_decay, betas, fused=rt.device.type == "cuda")
        par = DataParallelModel(
            model.to(rt.device),
            self.zero,
            self._mesh,
            opt,
            self.precision,
            self._settings.bucket_mb,
            shard_units=shard_units,
        )
        self._par = par
        if self.precision == "fp16":
            if self.zero >= 2:  # sharded gradients: the inf check is all-reduced
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self._scaler = ShardedGradScaler(rt.device.type)
            else:
                self._scaler = torch.amp.GradScaler(rt.device.type)
        return par.model, par.optimizer

    def setup_dataloader(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        drop_last: bool = True,
        **loader_kwargs: Any,
    ) -> DataLoader:
        """A DataLoader reading this rank's slice (DistributedSampler seeded with `seed`).

        Call `loader.sampler.set_epoch(epoch)` each epoch for a new shuffle."""
        rt = self._runtime()
        sampler = DistributedSampler(
            dataset,
            num_replicas=rt.world_size,
            rank=rt.rank,
            shuffle=shuffle,
            seed=self._settings.seed,
            drop_last=drop_last,
        )
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **loader_kwargs)

    def to_device(self, obj: Any) -> Any:
        """Tensors (also inside lists, tuples and dicts) moved to this rank's device."""
        if isinstance(obj, torch.Tensor):
            return obj.to(self.device, non_blocking=True)
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.to_device(o) for o in obj)
        if isinstance(obj, dict):
            return {k: self.to_device(v) for k, v in obj.items()}
        return obj

    # -- the training step ------------------------------------------------------------
    def _model(self) -> DataParallelModel:
        if self._par is None:
            raise RuntimeError("call fabric.setup(model) first")
        return self._par

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed-precision forward under DDP/ZeRO-1 (FSDP stages cast via their policy)."""
        dtype = self._model().autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), with the loss scaled under fp16."""
        self._model()
        (self._scaler.scale(loss) if self._scaler is not None else loss).backward()

    def no_backward_sync(self, enabled: bool = True) -> contextlib.AbstractContextManager:
        """Skip the gradient reduction of backward() while accumulating (enabled=True)."""
        return self._model().gradient_sync(not enabled)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global L2 gradient norm (true gradients under fp16); clips when max_norm > 0."""
        par = self._model()
        if self._scaler is not None and not self._unscaled:
            self._scaler.unscale_(par.optimizer)
            self._unscaled = True
        return par.grad_norm_and_clip(max_norm)

    def step(self) -> None:
        """Optimizer step (skipped by the loss scaler when fp16 gradients overflowed)."""
        par = self._model()
        if self._scaler is not None:
            self._scaler.step(par.optimizer)
            self._scaler.update()
        else:
            par.optimizer.step()
        self._unscaled = False

    def zero_grad(self) -> None:
        self._model().optimizer.zero_grad(set_to_none=True)

    # -- collectives and output ---------------------------------------------------------
    def all_reduce_mean(self, value: torch.Tensor | float) -> torch.Tensor:
        """The mean of `value` over all ranks (collective: every rank calls it)."""
        from meshforge.parallel.data_parallel import all_reduce_mean

        return all_reduce_mean(torch.as_tensor(value, dtype=torch.float32, device=self.device))

    def barrier(self) -> None:
        torch.distributed.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on rank 0 only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)


def _run(settings: _Settings, fn: Callable[[Fabric], T]) -> T:
    """One rank: rebuild the Fabric, join the group, run fn, always leave the group."""
    fabric = Fabric(**vars(settings))
    with fabric:
        return fn(fabric)


def _spawn(settings: _Settings, fn: Callable[[Fabric], T], nproc: int) -> T | None:
    """Run fn on nproc local workers through the elastic agent (the machinery of torchrun)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from meshforge.launch.local import NodeSpec, describe_exit, failure_message, launch_config

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="meshforge-fabric-") as log_dir:
        config = launch_config(nproc, NodeSpec(), Path(log_dir))
        try:
            results = elastic_launch(config, _run)(settings, fn)
        except ChildFailedError as exc:
            # Every failed rank, earliest first: the first one is often the cause, the
            # others (a peer's connection reset) its consequences.
            failures = sorted(exc.failures.items(), key=lambda rf: (rf[1].timestamp, rf[0]))
            raise RuntimeError(
                "; ".join(
                    f"worker rank {rank} failed ({describe_exit(f.exitcode)}): {failure_message(f)}"
                    for rank, f in failures
                )
            ) from None
    return results.get(0)
