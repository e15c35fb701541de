"""A Python API for your own model and dataset: one object, a strategy by name.

    fabric = Fabric(strategy="zero2", precision="bf16")
    fabric.launch(train, nproc=2)          # train(fabric) runs on every rank

    def train(fabric):
        model, optimizer, scheduler = fabric.setup(
            MyNet(),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=100),
        )
        loader = fabric.setup_dataloader(dataset, batch_size=32)
        for x, y in loader:
            with fabric.autocast():
                loss = F.cross_entropy(model(fabric.to_device(x)), fabric.to_device(y))
            fabric.backward(loss)
            fabric.clip_grad_norm(1.0)
            fabric.step()
            fabric.zero_grad()
            scheduler.step()
        fabric.save("ckpt", {"model": model, "optimizer": optimizer, "step": 100})

The strategies are those of the job config (`parallel.zero`), applied by
`DataParallelModel`; the process group comes from `runtime.dist.distributed` (or is
the one already initialised in this process, which Fabric then leaves alone).

This module is the object and its training step; the rest lives beside it:
fabric/setup.py (the optimizer, the scheduler and a meta-built model's values that
`setup` makes), fabric/checkpoint.py (`save`/`load` through torch.distributed.checkpoint,
atomic, any strategy and world size from any other, data only) and fabric/launch.py
(`launch`: in this process under torchrun, srun or mpirun, else workers started
through the torch elastic agent, and a failed worker's one-line FabricWorkerError).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from meshforge.errors import ConfigError
from meshforge.fabric import checkpoint as fabric_checkpoint
from meshforge.fabric import launch as fabric_launch
from meshforge.fabric import setup as fabric_setup
from meshforge.fabric.launch import FabricSettings, FabricWorkerError

if TYPE_CHECKING:
    from meshforge.parallel.data_parallel import DataParallelModel
    from meshforge.runtime.dist import Runtime

__all__ = ["PRECISIONS", "STRATEGIES", "Fabric", "FabricWorkerError"]

T = TypeVar("T")

STRATEGIES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
PRECISIONS = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


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
        self._settings = FabricSettings(
            strategy, precision, device, backend, timeout_s, seed, bucket_mb
        )
        self.zero = STRATEGIES[strategy]
        self.precision = PRECISIONS[precision]
        self._stack: contextlib.ExitStack | None = None
        self._rt = None
        self._mesh = None
        self._par = None
        self._pars: list[DataParallelModel] = []
        self._scaler = None
        self._unscaled = False

    # -- process life cycle ---------------------------------------------------------
    def __enter__(self) -> Fabric:
        """Join the process group of the launcher that started this process (torchrun,
        ...), or use the one this process has initialised already (left as it is)."""
        from meshforge.parallel.mesh import data_parallel_mesh
        from meshforge.runtime.dist import Runtime, choose_device, distributed
        from meshforge.runtime.env import detect_env

        s = self._settings
        stack = contextlib.ExitStack()
        if dist.is_initialized():
            env = dataclasses.replace(
                detect_env(), rank=dist.get_rank(), world_size=dist.get_world_size()
            )
            device = choose_device(s.device, env.local_rank)
            self._rt = Runtime(env=env, device=device, backend=dist.get_backend())
        else:
            self._rt = stack.enter_context(distributed(s.device, s.backend, s.timeout_s))
        self._stack = stack
        try:
            self._mesh = data_parallel_mesh(self._rt.device, self._rt.world_size)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        torch.manual_seed(s.seed)
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        self._rt = self._mesh = self._par = self._scaler = None
        self._pars = []
        self._unscaled = False
        if stack is not None:
            stack.close()  # destroys a group it made, also when training raised

    def launch(self, fn: Callable[[Fabric], T], nproc: int = 1) -> T | None:
        """Run fn(fabric) on every rank.

        Under torchrun, a task of an `srun` step or OpenMPI's mpirun (one process per
        rank already) fn runs here and its result is returned; nproc is not used (an
        srun step of one task with nproc > 1 starts nproc workers, as below).
        Otherwise (plain `python`, the shell of an sbatch batch script or of salloc)
        nproc workers are started through the torch elastic agent and rank 0's result
        is returned; fn must then be importable (top level of a module, or of a script
        guarded by `if __name__ == "__main__":`). A failed worker raises
        FabricWorkerError naming the rank whose own error came first."""
        from meshforge.runtime.env import detect_env

        if nproc < 1:
            raise ConfigError(f"nproc must be at least 1, got {nproc}")
        env = detect_env()
        one_task_step = env.launcher == "slurm" and env.world_size == 1 and nproc > 1
        if env.launcher != "single" and not one_task_step:
            return fabric_launch.run(self._settings, fn, Fabric)
        return fabric_launch.spawn(self._settings, fn, nproc, Fabric)

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

    @contextlib.contextmanager
    def init_module(self, empty_init: bool = False) -> Iterator[None]:
        """Build a model inside this block: on the meta device with empty_init=True (no
        memory; `setup` shards it first under zero2/zero3, then materialises and
        initialises this rank's part), else directly on this rank's device.

        A meta-built model gets its values in `setup`: its `init_weights(seed)` if it
        has one (every rank passes the Fabric's seed), else each submodule's
        `reset_parameters()`, children before parents, after seeding torch with the
        Fabric's seed on every rank. Those values differ from a normal build's unless
        init_weights makes them equal; a module holding parameters or buffers without a
        reset_parameters() (and no init_weights on the model) is refused in setup."""
        with torch.device("meta") if empty_init else torch.device(self.device):
            yield

    def setup(
        self,
        model: nn.Module,
        optimizer: Any = None,
        scheduler: Any = None,
        *,
        lr: float | None = None,
        weight_decay: float | None = None,
        betas: tuple[float, float] | None = None,
        shard_units: list[nn.Module] | None = None,
    ) -> tuple[Any, ...]:
        """Place the model under the strategy; returns (model to call, its optimizer),
        and the scheduler too, (model, optimizer, scheduler), when one is given.

        optimizer: None for AdamW (lr, weight_decay on matrices only, betas; defaults
        1e-3, 0.0, (0.9, 0.999)); a callable `params -> Optimizer`, called with the
        placed model's parameters; or an Optimizer built over `model.parameters()`,
        built again here with its class, defaults and per-group options, by parameter
        name (use the optimizer returned, not the one passed). Under zero1 the class
        runs inside ZeroRedundancyOptimizer.
        scheduler: a callable `optimizer -> LRScheduler` (e.g.
        `lambda opt: StepLR(opt, step_size=10)`); you call scheduler.step() yourself.
        shard_units: submodules that become FSDP units of their own under zero2/zero3
        (e.g. the layers of a deep network; default: `model.blocks` when it exists);
        the root module is always one."""
        from meshforge.parallel.data_parallel import DataParallelModel, is_on_meta

        rt = self._runtime()
        if not isinstance(model, nn.Module):
            raise ConfigError(f"setup takes an nn.Module, not {type(model).__name__}")
        fabric_setup.check_scheduler(scheduler)
        opt = fabric_setup.optimizer_spec(optimizer, model, rt.device, lr, weight_decay, betas)
        meta = is_on_meta(model)
        init = None
        if meta:
            init = functools.partial(
                fabric_setup.initialise_meta_model,
                seed=self._settings.seed,
                rank=rt.rank,
                per_rank_seed=self.zero >= 2 and rt.device.type == "cpu",
            )
        par = DataParallelModel(
            model if meta else model.to(rt.device),
            self.zero,
            self._mesh,
            opt,
            self.precision,
            self._settings.bucket_mb,
            shard_units=shard_units,
            device=rt.device,
            init=init,
        )
        self._par = par
        self._pars.append(par)
        if self.precision == "fp16":
            if self.zero >= 2:  # sharded gradients: the inf check is all-reduced
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self._scaler = ShardedGradScaler(rt.device.type)
            else:
                self._scaler = torch.amp.GradScaler(rt.device.type)
        if scheduler is None:
            return par.model, par.optimizer
        return par.model, par.optimizer, fabric_setup.build_scheduler(scheduler, par.optimizer)

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

    # -- checkpoints (fabric/checkpoint.py) -------------------------------------------
    def save(self, path: str | os.PathLike, state: dict[str, Any]) -> Path:
        """Write `state` to the checkpoint directory `path` (collective: every rank calls
        it with the same keys). Returns the path.

        Values: the model and optimizer that setup returned (saved sharded, with the
        full model's parameter names, so any strategy and world size loads them), any
        object with state_dict()/load_state_dict() (a scheduler), and tensors and plain
        values (numbers, strings, lists, dicts: data, as a load reads only data).

        Atomic: every rank writes into a temporary directory beside `path`, rank 0 adds
        a manifest with each file's sha256 and renames it into place; a save that fails
        anywhere raises the same CheckpointError on every rank and leaves what was at
        `path` as it was. An existing `path` is replaced only if it is a Fabric
        checkpoint."""
        self._runtime()
        return fabric_checkpoint.save(
            path, state, self._pars, self._scaler, self._settings.strategy
        )

    def load(
        self, path: str | os.PathLike, state: dict[str, Any] | None = None, *, strict: bool = True
    ) -> dict[str, Any]:
        """Read the checkpoint at `path` (collective: every rank calls it).

        The objects in `state` (model, optimizer, scheduler: what save took) are filled
        in place from the entries of the same names, whatever strategy and world size
        wrote them; plain values saved (tensors, numbers, ...) are returned as a dict,
        and where `state` names them they are replaced in `state` too. strict: an entry
        of `state` that the checkpoint lacks is an error (else it is left as it is).

        A missing, incomplete or damaged checkpoint (its manifest's checksums) is
        refused with one CheckpointError line naming `path`; values are read as data
        only (no pickled code runs)."""
        self._runtime()
        return fabric_checkpoint.load(path, state, strict, self._pars, self._scaler)

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
