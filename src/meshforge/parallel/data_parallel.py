"""Data parallelism and ZeRO stages for a user's own module (the Fabric API), on a
one-dimensional DeviceMesh, all from torch.distributed. meshforge's own GPT is
placed by parallel/parallelize.py, which composes the same stages with TP and PP.

zero=0  DDP: parameters, gradients and optimizer states replicated; gradients
        all-reduced in buckets (parallel.bucket_mb) overlapped with backward.
zero=1  DDP + ZeroRedundancyOptimizer: AdamW states sharded across dp ranks;
        each rank updates the parameters it owns and broadcasts them.
zero=2  FSDP2 fully_shard per block with reshard_after_forward=False: gradients
        and optimizer states sharded, parameters gathered once per step and
        kept unsharded from forward to the end of backward.
zero=3  FSDP2 fully_shard per block, resharded after forward: parameters,
        gradients and optimizer states sharded; a block is gathered when used.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from meshforge.observe.memory import tensor_bytes

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    fused: bool = False


def build_mesh(device: torch.device, dp: int) -> DeviceMesh:
    return init_device_mesh(device.type, (dp,), mesh_dim_names=("dp",))


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
        opt: OptimizerSettings,
        dtype: str = "fp32",
        bucket_mb: float = 25.0,
        shard_units: list[nn.Module] | None = None,
    ) -> None:
        """shard_units: submodules sharded as their own FSDP units under ZeRO-2/3
        (a GPT's blocks); the root module is always a unit. Defaults to `module.blocks`
        when the module has one."""
        self.module = module
        self.zero = zero
        self.mesh = mesh
        self.dtype = dtype
        device = next(module.parameters()).device
        if zero <= 1:
            self.model: nn.Module = DistributedDataParallel(
                module,
                device_ids=[device.index] if device.type == "cuda" else None,
                process_group=mesh.get_group(),
                bucket_cap_mb=bucket_mb,
                gradient_as_bucket_view=True,
            )
        else:
            mp = None
            if dtype != "fp32":
                mp = MixedPrecisionPolicy(param_dtype=_DTYPES[dtype], reduce_dtype=torch.float32)
            kwargs = {"mesh": mesh, "reshard_after_forward": zero == 3}
            if mp is not None:
                kwargs["mp_policy"] = mp
            if shard_units is None:
                blocks = getattr(module, "blocks", [])
                shard_units = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
            for unit in shard_units:
                fully_shard(unit, **kwargs)
            fully_shard(module, **kwargs)
            self.model = module
        groups = param_groups(module, opt.weight_decay)
        adam = {"lr": opt.lr, "betas": opt.betas}
        if opt.fused:
            adam["fused"] = True
        if zero == 1:
            self.optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(
                groups, optimizer_class=torch.optim.AdamW, process_group=mesh.get_group(), **adam
            )
        else:
            self.optimizer = torch.optim.AdamW(groups, **adam)
        self._names = {p: n for n, p in module.named_parameters()}

    # -- the training step ------------------------------------------------------
    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """Autocast for DDP stages; FSDP stages cast through their mixed-precision policy."""
        if self.dtype == "fp32" or self.zero >= 2:
            return None
        return _DTYPES[self.dtype]

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Skip gradient reduction on all but the last micro-batch of a step."""
        if enabled:
            yield
            return
        if isinstance(self.model, DistributedDataParallel):
            with self.model.no_sync():
                yield
            return
        assert isinstance(self.module, FSDPModule)
        self.module.set_requires_gradient_sync(False)
        if self.zero == 2:
            self.module.set_reshard_after_backward(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)
            if self.zero == 2:
                self.module.set_reshard_after_backward(True)

    def grad_norm_and_clip(self, max_norm: float) -> torch.Tensor:
        """The global L2 norm of the gradients; clips them to max_norm when max_norm > 0.

        Under DDP/ZeRO-1 each rank holds full, identical gradients. Under FSDP the
        norm of the sharded DTensor gradients is reduced across ranks first."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total

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
        """Materialise AdamW's lazily created state (so a checkpoint can load into it).

        Runs one step with zero gradients and learning rate 0, which leaves the
        parameters unchanged; the loaded state then overwrites the step count."""
        if self.optimizer_state():
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
        """sha256 over every parameter gathered to a full fp32 tensor, in name order.

        Collective under FSDP: every rank must call it."""
        h = hashlib.sha256()
        for name, p in sorted(self.module.named_parameters()):
            full = p.full_tensor() if isinstance(p, DTensor) else p
            h.update(name.encode())
            h.update(full.detach().float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    def full_state_dict_on_cpu(self) -> dict[str, torch.Tensor]:
        """Full parameters (collective under FSDP)."""
        out = {}
        for name, t in self.module.state_dict().items():
            out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def all_reduce_mean(value: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value / dist.get_world_size(group)
