"""What Fabric.setup makes of its arguments: the optimizer, the scheduler, and the
values of a model built on the meta device.

The optimizer is AdamW unless the user gives one, as a callable `params -> Optimizer`
or as an optimizer built over the model's parameters, which DataParallelModel builds
again over the placed (possibly sharded) parameters by name (`OptimizerRecipe`). A
scheduler is a callable `optimizer -> LRScheduler`, since the optimizer it steers is
made in `setup`.

A model built inside `init_module(empty_init=True)` is on the meta device;
DataParallelModel shards it (zero2/zero3) before any rank allocates it, then
`initialise_meta_model` gives this rank's part its values: the model's
`init_weights(seed)` when it has one, else every submodule's `reset_parameters()`
after seeding torch alike on every rank. Without `init_weights` the values are not
those a normal build would have drawn (each shard is drawn on its own), only
distributed alike.
"""

from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from meshforge.errors import ConfigError

if TYPE_CHECKING:
    from meshforge.parallel.data_parallel import OptimizerRecipe, OptimizerSettings


def optimizer_spec(
    optimizer: Any,
    model: nn.Module,
    device: torch.device,
    lr: float | None,
    weight_decay: float | None,
    betas: tuple[float, float] | None,
) -> OptimizerSettings | OptimizerRecipe | Any:
    """What DataParallelModel builds the optimizer from: AdamW's settings when
    `optimizer` is None, the recipe of a user's optimizer (taken by parameter name,
    before placement), or the user's callable `params -> Optimizer`."""
    from meshforge.parallel.data_parallel import OptimizerRecipe, OptimizerSettings

    adam = {"lr": lr, "weight_decay": weight_decay, "betas": betas}
    given = [k for k, v in adam.items() if v is not None]
    if optimizer is None:
        return OptimizerSettings(
            1e-3 if lr is None else lr,
            0.0 if weight_decay is None else weight_decay,
            (0.9, 0.999) if betas is None else betas,
            fused=device.type == "cuda",
        )
    if given:
        raise ConfigError(
            f"setup: {', '.join(given)} configure the default AdamW; with your own "
            "optimizer, set them on it instead"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        return OptimizerRecipe.of(optimizer, model)  # by name, before placement
    if callable(optimizer):
        return optimizer
    raise ConfigError(
        f"optimizer must be a torch.optim.Optimizer or a callable params -> "
        f"Optimizer, not {type(optimizer).__name__}"
    )


def check_scheduler(scheduler: Any) -> None:
    """Refuse a scheduler that is not a callable `optimizer -> LRScheduler`."""
    if scheduler is None:
        return
    is_instance = not isinstance(scheduler, type) and callable(getattr(scheduler, "step", None))
    if is_instance or not callable(scheduler):
        raise ConfigError(
            f"scheduler must be a callable optimizer -> LRScheduler (e.g. lambda opt: "
            f"StepLR(opt, step_size=10)), not a {type(scheduler).__name__} instance: setup "
            "builds the optimizer it steers"
        )


def build_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """The user's scheduler callable applied to the optimizer setup built."""
    sched = scheduler(optimizer)
    if not (callable(getattr(sched, "step", None)) and hasattr(sched, "state_dict")):
        raise ConfigError(
            f"the scheduler callable returned {type(sched).__name__}, not an LR scheduler"
        )
    return sched


def initialise_meta_model(module: nn.Module, seed: int, rank: int, per_rank_seed: bool) -> None:
    """Values for a module just materialised from the meta device (see Fabric.init_module).

    per_rank_seed: this rank's shards are CPU DTensors. They have no distributed RNG
    (DTensor's offset-based one is for CUDA-like devices): a random fill draws each
    shard from the generator as it is here, so one seed everywhere would make every
    shard a copy of rank 0's, and the copies would stay alike in training. Such shards
    get a seed per rank."""
    with warnings.catch_warnings():
        # random fills of CPU DTensors draw each shard on its own: documented above
        warnings.filterwarnings("ignore", "DTensor random operators", UserWarning)
        torch.manual_seed(seed + 1_000_003 * rank if per_rank_seed else seed)
        _initialise_values(module, seed)


def _initialise_values(module: nn.Module, seed: int) -> None:
    from torch.distributed.fsdp import FSDPModule

    init_weights = getattr(module, "init_weights", None)
    if callable(init_weights):
        params = inspect.signature(init_weights).parameters.values()
        takes_seed = any(
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params
        )
        init_weights(seed) if takes_seed else init_weights()
        return
    uninitialised = []
    for name, m in reversed(list(module.named_modules())):  # children before parents
        reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
        if callable(reset):
            reset()
        elif any(True for _ in m.parameters(recurse=False)) or any(
            True for _ in m.buffers(recurse=False)
        ):
            kind = type(m).__name__
            if isinstance(m, FSDPModule) and kind.startswith("FSDP"):
                kind = kind[4:]  # fully_shard's subclass FSDP<Class>
            uninitialised.append(f"{name or '(the model)'} ({kind})")
    if uninitialised:
        raise ConfigError(
            f"init_module(empty_init=True): {', '.join(uninitialised[:3])} hold parameters "
            "or buffers but have no reset_parameters() to give them values, and the "
            f"model ({type(module).__name__}) has no init_weights(seed): add one, or "
            "build the model without empty_init"
        )
