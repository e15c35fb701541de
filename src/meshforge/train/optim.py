"""The optimizer side of a run: one AdamW per model part (per local pipeline stage;
torchtitan's OptimizersContainer), or ZeRO-1's sharded AdamW; the learning rate
as a pure function of the step; the fp16 loss scaler; and their state as flat,
name-keyed dicts that `torch.distributed.checkpoint` can reshard.

The learning rate is `lr * lr_factor(step, warmup, lr_horizon, min_lr_ratio)`
(train/schedule.py), set before every optimizer step, so resuming needs only the step
number and the horizon, never a scheduler object. The horizon is fixed when a run starts
(its first segment's `train.steps`) and kept in every checkpoint: a run extended or
shortened later keeps its schedule, and steps past the horizon train at the learning
rate of the schedule's last step (about `lr * min_lr_ratio` once it has decayed), so an
extension never makes the learning rate jump.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.optim import ZeroRedundancyOptimizer

from meshforge.config import JobConfig
from meshforge.parallel.data_parallel import param_groups
from meshforge.parallel.parallelize import ModelParts
from meshforge.train.schedule import lr_factor

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Optimizers:
    def __init__(
        self, cfg: JobConfig, parts: ModelParts, dp_mesh: DeviceMesh, device: torch.device
    ) -> None:
        t = cfg.train
        self.cfg, self.parts = cfg, parts
        # the schedule's length: this run's first train.steps (a resume sets it back)
        self.lr_horizon = t.steps
        adam: dict[str, Any] = {"lr": t.lr, "betas": (t.beta1, t.beta2)}
        if device.type == "cuda":
            adam["fused"] = True
        self.zero1 = cfg._parallel().zero == 1
        self.optimizers: list[torch.optim.Optimizer] = []
        for m in parts.modules:
            # a parameter server's shard may hold no matrix, or nothing but matrices:
            # torch's flat optimizer state cannot load into an empty group
            groups = [g for g in param_groups(m, t.weight_decay) if g["params"]]
            if self.zero1:
                opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(
                    groups,
                    optimizer_class=torch.optim.AdamW,
                    process_group=dp_mesh.get_group(),
                    **adam,
                )
            else:
                opt = torch.optim.AdamW(groups, **adam)
            self.optimizers.append(opt)
        self.scaler: torch.amp.GradScaler | None = None
        if cfg.precision.dtype == "fp16":
            init = cfg.precision.initial_loss_scale
            if parts.wrapper in ("fsdp", "replicate"):  # DTensor grads: inf checks all-reduced
                self.scaler = ShardedGradScaler(device.type, init_scale=init)
            else:
                self.scaler = torch.amp.GradScaler(device.type, init_scale=init)
        self._names = {p: n for n, p in parts.named_parameters()}

    # -- the step --------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        t = self.cfg.train
        return t.lr * lr_factor(step, t.warmup, self.lr_horizon, t.min_lr_ratio)

    def set_lr(self, step: int) -> None:
        lr = self.lr_at(step)
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["lr"] = lr

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self) -> None:
        if self.scaler is not None:
            for opt in self.optimizers:
                self.scaler.unscale_(opt)

    def step(self) -> None:
        if self.scaler is not None:
            for opt in self.optimizers:
                self.scaler.step(opt)
            self.scaler.update()
        else:
            for opt in self.optimizers:
                opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    # -- state -----------------------------------------------------------------------------
    def _local(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt

    def ensure_state(self) -> None:
        """Materialise AdamW's lazily created state (so a checkpoint can load into it):
        one step with zero gradients at learning rate 0 leaves the parameters unchanged,
        and the loaded state then overwrites the step count."""
        if any(self._local(o).state for o in self.optimizers):
            return
        for opt in self.optimizers:
            lrs = [g["lr"] for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] = 0.0
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)
            opt.step()
            for g, lr in zip(opt.param_groups, lrs, strict=True):
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)

    def state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model, optimizer) state of this rank, keyed by the full model's parameter
        names (DTensors where sharded), as `get_state_dict` flattens them."""
        model_sd: dict[str, Any] = {}
        optim_sd: dict[str, Any] = {}
        for module, opt in zip(self.parts.modules, self.optimizers, strict=True):
            if self.zero1:
                model_sd.update(module.state_dict())
                optim_sd.update(self._zero1_state(opt))
                continue
            msd, osd = get_state_dict(module, opt, options=_FLAT)
            model_sd.update(msd)
            optim_sd.update(osd)
        experts = self.parts.local_experts
        if experts:  # expert shards held as plain tensors: saved as the global DTensors
            return experts.state_to_global(model_sd), experts.state_to_global(optim_sd)
        return model_sd, optim_sd

    def load_state_dicts(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        """Put loaded (model, optimizer) state back into the parts and optimizers."""
        experts = self.parts.local_experts
        if experts:
            model_sd, optim_sd = experts.state_to_local(model_sd), experts.state_to_local(optim_sd)
        for module, opt in zip(self.parts.modules, self.optimizers, strict=True):
            if self.zero1:
                own = {k: model_sd[k] for k in module.state_dict()}
                module.load_state_dict(own)
                for p, state in self._local(opt).state.items():
                    for key in state:
                        state[key].copy_(optim_sd[f"state.{self._names[p]}.{key}"])
                continue
            names = set(module.state_dict())
            set_state_dict(
                module,
                opt,
                model_state_dict={k: v for k, v in model_sd.items() if k in names},
                optim_state_dict=self._for(opt, optim_sd),
                options=_FLAT,
            )
        for m in self.parts.modules:  # a loaded state dict may have split a tied pair
            if hasattr(m, "tie_weights"):
                m.tie_weights()

    def _for(self, opt: torch.optim.Optimizer, optim_sd: dict[str, Any]) -> dict[str, Any]:
        mine = {self._names[p] for g in opt.param_groups for p in g["params"]}
        return {k: v for k, v in optim_sd.items() if _param_of(k) in mine}

    def _zero1_state(self, opt: ZeroRedundancyOptimizer) -> dict[str, Any]:
        """ZeRO-1: the state of the parameters this rank owns, in get_state_dict's
        flat format, so ZeRO-1 checkpoints load under every other layout and back."""
        out: dict[str, Any] = {}
        for p, state in opt.optim.state.items():
            for key, value in state.items():
                out[f"state.{self._names[p]}.{key}"] = value
        for group in opt.optim.param_groups:
            for p in group["params"]:
                for key, value in group.items():
                    if key != "params":
                        out[f"param_groups.{self._names[p]}.{key}"] = value
        return out

    def state_bytes(self) -> list[torch.Tensor]:
        return [
            t
            for o in self.optimizers
            for s in self._local(o).state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        ]

    def owned_param_count(self) -> int:
        """Parameters whose optimizer state this rank is designed to hold."""
        n = 0
        for o in self.optimizers:
            for g in self._local(o).param_groups:
                for p in g["params"]:
                    n += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
        return n


def _param_of(flat_key: str) -> str:
    """'state.blocks.0.attn.q.weight.exp_avg' -> 'blocks.0.attn.q.weight'."""
    kind, rest = flat_key.split(".", 1)
    return rest.rsplit(".", 1)[0]
