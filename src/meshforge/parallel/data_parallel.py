"""A user's own module placed for data parallelism under one ZeRO stage, with its
optimizer and its state for checkpoints (the Fabric API), on a one-dimensional
DeviceMesh. The placing is the trainer's: parallel/parallelize.py `wrap_data_parallel`
wraps it (DDP, FSDP2 units) and its `ModelParts` controls the gradient sync and
computes the gradient norm; this module adds what a user's training loop needs around
it (the optimizer, ZeroRedundancyOptimizer under zero=1, the state dicts).

zero=0  DDP: parameters, gradients and optimizer states replicated; gradients
        all-reduced in buckets (parallel.bucket_mb) overlapped with backward.
zero=1  DDP + ZeroRedundancyOptimizer: AdamW states sharded across dp ranks;
        each rank updates the parameters it owns and broadcasts them.
zero=2  FSDP2 fully_shard per block with reshard_after_forward=False: gradients
        and optimizer states sharded, parameters gathered once per step and
        kept unsharded from forward to the end of backward (over the micro-batches
        of an accumulated step too).
zero=3  FSDP2 fully_shard per block, resharded after forward: parameters,
        gradients and optimizer states sharded; a block is gathered when used
        (the root, whose forward ends where backward starts, stays gathered).

The optimizer is AdamW from `OptimizerSettings` (meshforge's default), or the user's
own: a callable `params -> Optimizer` called with the placed model's parameters, or an
`OptimizerRecipe` (class, constructor defaults and parameter groups by name, taken
from an optimizer the user built over the unplaced model) built again over the placed
parameters, since FSDP2 replaces the Parameter objects. Under zero=1 the user's class
becomes ZeroRedundancyOptimizer's `optimizer_class`.

A module built on the meta device is materialised here (`to_empty` on `device`, then
the caller's `init`): under zero=2/3 after sharding, so no rank ever holds it whole.

State for torch.distributed.checkpoint: `model_state_dict` / `optimizer_state_dict`
in get_state_dict's flat, name-keyed form under every stage (ZeRO-1 included, each
rank its own parameters' state), so any stage and world size loads any other.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from meshforge.config import CommConfig
from meshforge.errors import ConfigError
from meshforge.observe.memory import tensor_bytes
from meshforge.parallel import parallelize

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

# A user's optimizer as a callable: the placed model's parameters -> an Optimizer.
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    fused: bool = False


@dataclass(frozen=True)
class OptimizerRecipe:
    """What it takes to build a user's optimizer again over other Parameter objects of
    the same model: its class, its constructor defaults, and its parameter groups as
    (parameter names, the group's options)."""

    cls: type[torch.optim.Optimizer]
    defaults: dict[str, Any]
    groups: tuple[tuple[tuple[str, ...], dict[str, Any]], ...]

    @classmethod
    def of(
        cls,
        optimizer: torch.optim.Optimizer,
        module: nn.Module,
        over: str = "model.parameters() of the model given to setup",
    ) -> OptimizerRecipe:
        """The recipe of `optimizer`, whose parameters must all be `module`'s (`over`:
        what to build it over instead, for the refusal)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer must be a torch.optim.Optimizer or a callable params -> "
                f"Optimizer, not {type(optimizer).__name__}"
            )
        if any(state for state in optimizer.state.values()):
            raise ConfigError(
                f"optimizer {type(optimizer).__name__} already has state (it has stepped): "
                "meshforge builds it anew over the placed model; pass it before training, "
                "or a callable params -> Optimizer"
            )
        names = {id(p): n for n, p in module.named_parameters()}
        foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
        if foreign:
            shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:3])
            more = ", ..." if len(foreign) > 3 else ""
            raise ConfigError(
                f"optimizer {type(optimizer).__name__} holds {len(foreign)} parameter(s) that "
                f"are not the model's (shapes {shapes}{more}): build it over {over}"
            )
        groups = tuple(
            (
                tuple(names[id(p)] for p in g["params"]),
                {k: v for k, v in g.items() if k != "params"},
            )
            for g in optimizer.param_groups
        )
        return cls(type(optimizer), dict(optimizer.defaults), groups)

    def build(
        self, module: nn.Module, zero: int, group: dist.ProcessGroup | None
    ) -> torch.optim.Optimizer:
        """The optimizer over `module`'s parameters of the same names (ZeroRedundancy-
        Optimizer around the class under zero=1)."""
        by_name = dict(module.named_parameters())
        groups = [
            {**options, "params": [by_name[n] for n in names]} for names, options in self.groups
        ]
        accepted = inspect.signature(self.cls.__init__).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
        kwargs = {k: v for k, v in self.defaults.items() if takes_any or k in accepted}
        try:
            if zero == 1:
                return ZeroRedundancyOptimizer(
                    groups, optimizer_class=self.cls, process_group=group, **kwargs
                )
            return self.cls(groups, **kwargs)
        except TypeError as exc:
            raise ConfigError(
                f"cannot build optimizer {self.cls.__name__} again from its defaults ({exc}); "
                "pass a callable params -> Optimizer instead"
            ) from None


def _user_optimizer(
    factory: OptimizerFactory, module: nn.Module, zero: int, group: dist.ProcessGroup | None
) -> torch.optim.Optimizer:
    """The optimizer `factory` builds over the placed module's parameters; under zero=1
    its class, defaults and groups go into ZeroRedundancyOptimizer."""
    built = factory(list(module.parameters()))
    if not isinstance(built, torch.optim.Optimizer):
        raise ConfigError(
            f"the optimizer callable returned {type(built).__name__}, not a torch.optim.Optimizer"
        )
    # checks that its parameters are the module's
    recipe = OptimizerRecipe.of(built, module, over="the parameters the callable is given")
    return recipe.build(module, zero, group) if zero == 1 else built


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices only; biases and norm weights are not decayed."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class DataParallelModel:
    """A model placed for training under one ZeRO stage, with its optimizer.

    `model` is what the training loop calls; `module` is the underlying network
    (parameter names are those of the unwrapped model under every stage)."""

    def __init__(
        self,
        module: nn.Module,
        zero: int,
        mesh: DeviceMesh,
        opt: OptimizerSettings | OptimizerRecipe | OptimizerFactory,
        dtype: str = "fp32",
        bucket_mb: float = 25.0,
        shard_units: list[nn.Module] | None = None,
        *,
        device: torch.device | None = None,
        init: Callable[[nn.Module], None] | None = None,
    ) -> None:
        """shard_units: submodules sharded as their own FSDP units under ZeRO-2/3
        (a GPT's blocks); the root module is always a unit. Defaults to `module.blocks`
        when the module has one.

        opt: AdamW's settings, or the user's optimizer (see the module's doc).
        device, init: where and how a module on the meta device is materialised:
        `to_empty(device=device)` (after sharding under ZeRO-2/3), then `init(module)`
        under no_grad, which must give every parameter and buffer its value."""
        self.module = module
        self.zero = zero
        self.mesh = mesh
        self.dtype = dtype
        meta = is_on_meta(module)
        if meta and device is None:
            raise ValueError("a module on the meta device needs the device to materialise it on")
        if meta and init is None:
            raise ValueError("a module on the meta device needs an init function")
        at = device if device is not None else next(module.parameters()).device
        if shard_units is None:  # the module's blocks, as parallelize places a GPT's
            blocks = getattr(module, "blocks", [])
            shard_units = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
        kind = parallelize.data_parallel_kind(zero, mesh.size(), model_parallel=False)
        self.parts = parallelize.wrap_data_parallel(
            [module],
            kind,
            zero,
            mesh,
            dtype,
            CommConfig(bucket_mb=bucket_mb),
            at,
            # under zero=2/3 after sharding: only this rank's shards are ever allocated
            materialise=functools.partial(_materialise, device=at, init=init) if meta else None,
            units=shard_units,
        )
        self.model: nn.Module = self.parts.callables[0]
        self.optimizer: torch.optim.Optimizer = self._build_optimizer(opt)
        self._names = {p: n for n, p in module.named_parameters()}

    def _build_optimizer(
        self, opt: OptimizerSettings | OptimizerRecipe | OptimizerFactory
    ) -> torch.optim.Optimizer:
        group = self.mesh.get_group()
        if isinstance(opt, OptimizerRecipe):
            return opt.build(self.module, self.zero, group)
        if not isinstance(opt, OptimizerSettings):
            return _user_optimizer(opt, self.module, self.zero, group)
        groups = param_groups(self.module, opt.weight_decay)
        adam = {"lr": opt.lr, "betas": opt.betas}
        if opt.fused:
            adam["fused"] = True
        if self.zero == 1:
            return ZeroRedundancyOptimizer(
                groups, optimizer_class=torch.optim.AdamW, process_group=group, **adam
            )
        return torch.optim.AdamW(groups, **adam)

    # -- the training step ------------------------------------------------------
    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """Autocast for DDP stages; FSDP stages cast through their mixed-precision policy."""
        return self.parts.autocast_dtype

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Skip gradient reduction on all but the last micro-batch of a step; under
        zero=2 the gathered parameters are kept over those micro-batches."""
        keep = not enabled and self.zero == 2 and isinstance(self.module, FSDPModule)
        if keep:
            self.module.set_reshard_after_backward(False)
        try:
            with self.parts.gradient_sync(enabled):
                yield
        finally:
            if keep:
                self.module.set_reshard_after_backward(True)

    def grad_norm_and_clip(self, max_norm: float) -> torch.Tensor:
        """The global L2 norm of the gradients; clips them to max_norm when max_norm > 0
        (the trainer's: DTensor gradients reduce their norm over their mesh)."""
        return parallelize.grad_norm_and_clip(self.parts, max_norm, None)

    # -- state --------------------------------------------------------------------
    def _local_optimizer(self) -> torch.optim.Optimizer:
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            return self.optimizer.optim
        return self.optimizer

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Optimizer state this rank holds, keyed by parameter name (DTensors under FSDP)."""
        local = self._local_optimizer()
        return {self._names[p]: state for p, state in local.state.items() if state}

    def ensure_optimizer_state(self) -> None:
        """Materialise the optimizer's lazily created state (AdamW's moments, SGD's
        momentum buffers) so a checkpoint can load into it.

        Runs one step with zero gradients and learning rate 0, which leaves the
        parameters unchanged; the loaded state then overwrites the step count. Under
        ZeRO-1 the ranks decide together (a rank may own no parameter, hence no state,
        and ZeRO's step is collective)."""
        has_state = bool(self.optimizer_state())
        if self.zero == 1:
            flag = torch.tensor([float(has_state)], device=next(self.module.parameters()).device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.mesh.get_group())
            has_state = bool(flag.item())
        if has_state:
            return
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        for p in self.module.parameters():
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)

    def model_state_dict(self) -> dict[str, Any]:
        """The model's state keyed by the unwrapped model's names (DTensors under
        FSDP): get_state_dict's view. Its tensors are the model's own, so a checkpoint
        read into them in place loads the model (then call load_model_state_dict)."""
        return get_model_state_dict(self.module)

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's state in get_state_dict's flat form: `state.NAME.KEY` (this
        rank's shard under FSDP; under ZeRO-1 only the parameters this rank owns) and
        `param_groups.NAME.KEY`. Creates the lazily made state first, as torch's
        get_optimizer_state_dict does (collective)."""
        if self.zero != 1:
            return get_optimizer_state_dict(self.module, self.optimizer, options=_FLAT)
        self.ensure_optimizer_state()
        out: dict[str, Any] = {}
        for p, state in self._local_optimizer().state.items():
            for key, value in state.items():
                out[f"state.{self._names[p]}.{key}"] = value
        for group in self.optimizer.param_groups:  # ZeRO's groups: every parameter
            for p in group["params"]:
                for key, value in group.items():
                    if key != "params":
                        out[f"param_groups.{self._names[p]}.{key}"] = value
        return out

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.module, state)

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        """Put a loaded optimizer_state_dict back (a group's options are taken from its
        first parameter's entries, where the checkpoint has them)."""
        if self.zero != 1:
            set_optimizer_state_dict(self.module, self.optimizer, state, options=_FLAT)
            return
        for p, pstate in self._local_optimizer().state.items():
            for key, value in pstate.items():
                loaded = state[f"state.{self._names[p]}.{key}"]
                if isinstance(value, torch.Tensor) and isinstance(loaded, torch.Tensor):
                    if loaded is not value:
                        value.copy_(loaded)
                else:
                    pstate[key] = loaded
        for group in self.optimizer.param_groups:
            first = self._names[group["params"][0]] if group["params"] else None
            for key in list(group):
                flat = f"param_groups.{first}.{key}"
                if key != "params" and flat in state:
                    group[key] = state[flat]

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state resident on this rank now."""
        params = list(self.module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        opt = [t for s in self._local_optimizer().state.values() for t in s.values()]
        opt = [t for t in opt if isinstance(t, torch.Tensor)]
        out = {"params": tensor_bytes(params), "grads": tensor_bytes(grads)}
        out["optimizer"] = tensor_bytes(opt)
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        return out

    def owned_param_count(self) -> int:
        """Parameters whose optimizer state this rank is designed to hold."""
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            return sum(p.numel() for g in self.optimizer.optim.param_groups for p in g["params"])
        return sum(_local(p).numel() for p in self.module.parameters())

    def param_digest(self) -> str:
        """sha256 over every parameter gathered to a full fp32 tensor, in name order
        (parallelize.digest_of, the report's formula). Collective under FSDP."""
        return parallelize.digest_of(
            (name, p.full_tensor() if isinstance(p, DTensor) else p)
            for name, p in self.module.named_parameters()
        )

    def full_state_dict_on_cpu(self) -> dict[str, torch.Tensor]:
        """Full parameters (collective under FSDP)."""
        out = {}
        for name, t in self.module.state_dict().items():
            out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
        return out


def is_on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _materialise(
    module: nn.Module, device: torch.device, init: Callable[[nn.Module], None]
) -> None:
    """Allocate a meta module's (local) storage on `device` and fill it with `init`."""
    module.to_empty(device=device)
    with torch.no_grad():
        init(module)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def all_reduce_mean(value: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value / dist.get_world_size(group)
