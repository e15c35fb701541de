"""Expert parallelism: each rank of an expert group (`parallel.ep` data-parallel ranks,
layout/dims.py) holds experts/ep of every mixture-of-experts layer, and the tokens go
to the rank of their expert and back by all-to-all (torchtitan's and Megatron-Core's
dispatch and combine). The model (models/moe.py) never sees it.

`apply_expert_parallel` shards each layer's stacked expert weights along the expert
dimension (a DTensor, Shard(0) over the "ep" mesh, so checkpoints reshard to any
layout) and wraps the layer's `GroupedExperts`:

  dispatch  the routed tokens arrive sorted by global expert with the count for each;
            the counts are exchanged (a small all-to-all), then the tokens themselves
            (`all_to_all_single_autograd`: variable splits, with autograd, on gloo and
            NCCL), and reordered from (source rank, expert) to (expert, source rank)
            so that each local expert's tokens are contiguous;
  compute   the local experts, as the model computes them (one grouped GEMM or a loop);
  combine   the reverse: reorder back, all-to-all back to the ranks the tokens came from.

Training works on plain tensors. Once initialised (with world 1's values, through the
DTensor's global shape), each expert weight not sharded further by FSDP becomes a
plain parameter holding this rank's experts (`localise_expert_weights`): the experts'
compute, the gradient reduction and AdamW then run on ordinary tensors, as a
hand-written loop would, with none of DTensor's per-operation dispatch.
`LocalExperts` turns them back into DTensors wherever a global view is needed: the
checkpoint's state dicts (so a checkpoint still reshards to any layout), the gradient
norm and the parameter digest. Under ZeRO-2/3 with edp > 1 FSDP shards the expert
DTensors over edp and they stay DTensors.

Gradients. An expert weight's gradient already sums the contributions of every rank
of the expert group (the all-to-all's backward brings them home); data parallelism
must then sum it over the `edp` ranks that hold the same experts and divide by dp,
the average it takes of every other gradient. Under DDP and FSDP2's `replicate`
(ZeRO 0) the expert weights are ignored parameters of the wrapper and
`ExpertGradSync` all-reduces them over edp; under ZeRO-2/3 with edp > 1 they are FSDP
units of their own on the edp mesh (sharded there too: each rank keeps
experts / ep / edp of them), whose reduce-scatter averages over edp, and
`ExpertGradSync` divides by ep. Under context parallelism the cp ranks hold the same
experts too (each routes its share of the sequences' tokens): the expert weights stay
plain tensors of this rank's experts under every ZeRO stage (FSDP cannot shard a
DTensor over ("edp", "cp"), no slice of the mesh beside "ep"), and `ExpertGradSync`
all-reduces them over "edp_cp" (edp x cp ranks, parallel/mesh.py) and divides by
dp x cp.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from meshforge.models.moe import GroupedExperts


def expert_layers(module: nn.Module) -> list[GroupedExperts]:
    return [m for m in module.modules() if isinstance(m, GroupedExperts)]


def expert_parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    return [p for m in modules for g in expert_layers(m) for p in g.parameters()]


def apply_expert_parallel(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every `GroupedExperts` of `module` over `ep_mesh` in place (meta tensors
    are fine: nothing is communicated) and route its tokens by all-to-all."""
    for experts in expert_layers(module):
        for holder in (experts.gate, experts.up, experts.proj):
            w = holder.weight
            holder.weight = nn.Parameter(
                distribute_tensor(w, ep_mesh, [Shard(0)], src_data_rank=None),
                requires_grad=w.requires_grad,
            )
        experts.forward = _Dispatch(experts.forward, ep_mesh.get_group(), ep_mesh.size())


class LocalExperts:
    """The expert weights `localise_expert_weights` made plain: this rank holds rows
    [rank x n, (rank + 1) x n) of each along its expert dimension, n = experts / ep."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.names: set[str] = set()  # the full model's parameter names
        self.params: set[nn.Parameter] = set()

    def __bool__(self) -> bool:
        return bool(self.names)

    def global_view(self, local: torch.Tensor) -> DTensor:
        """The DTensor whose shard on this rank is `local` (no copy, no communication)."""
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False)

    def state_to_global(self, sd: dict[str, Any]) -> dict[str, Any]:
        """A flat model or optimizer state dict (`name` or `state.name.key`) with every
        expert entry as its DTensor: what a checkpoint saves and loads into."""
        return {k: self.global_view(v) if self._is_expert(k, v) else v for k, v in sd.items()}

    def state_to_local(self, sd: dict[str, Any]) -> dict[str, Any]:
        return {
            k: v.to_local() if isinstance(v, DTensor) and self._owner(k) else v
            for k, v in sd.items()
        }

    def _owner(self, key: str) -> bool:
        if key in self.names:
            return True
        if key.startswith("state."):
            return key[len("state.") :].rsplit(".", 1)[0] in self.names
        return False

    def _is_expert(self, key: str, value: Any) -> bool:
        # optimizer entries of an expert: its moments (tensors shaped like it), not "step"
        return (
            isinstance(value, torch.Tensor)
            and not isinstance(value, DTensor)
            and value.dim() > 0
            and self._owner(key)
        )


def localise_expert_weights(module: nn.Module, experts: LocalExperts) -> None:
    """Replace every expert DTensor weight of `module` by a plain parameter holding its
    local shard (the same storage), recorded in `experts`."""
    for prefix, layer in module.named_modules():
        if not isinstance(layer, GroupedExperts):
            continue
        for attr in ("gate", "up", "proj"):
            holder = getattr(layer, attr)
            w = holder.weight
            if not isinstance(w, DTensor):
                continue
            holder.weight = nn.Parameter(w.to_local().detach(), requires_grad=w.requires_grad)
            experts.names.add(f"{prefix}.{attr}.weight")
            experts.params.add(holder.weight)


class _Dispatch:
    """GroupedExperts.forward behind the dispatch and combine all-to-alls."""

    def __init__(self, compute, group: dist.ProcessGroup, ep: int) -> None:
        self.compute, self.group, self.ep = compute, group, ep

    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep = self.ep
        local = counts.numel() // ep
        # counts[r * local + e]: tokens for expert e of rank r; exchange so that
        # received[r * local + e] = tokens rank r sends to this rank's expert e
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts.contiguous(), group=self.group)
        send_splits = counts.view(ep, local).sum(1).tolist()
        recv_splits = received.view(ep, local).sum(1).tolist()
        got = all_to_all_single_autograd(x.contiguous(), recv_splits, send_splits, self.group)
        got = _wait(got)
        order = _expert_major(received.view(ep, local))
        y = self.compute(got[order], received.view(ep, local).sum(0))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        out = all_to_all_single_autograd(y[back].contiguous(), send_splits, recv_splits, self.group)
        return _wait(out)


def _wait(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def _expert_major(sizes: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder a buffer laid out by (source rank, expert) chunks of
    `sizes` (ep, local) into (expert, source rank) order."""
    flat = sizes.flatten()
    starts = flat.cumsum(0) - flat
    by_expert = sizes.t().flatten()
    start_by_expert = starts.view(sizes.shape).t().flatten()
    total = int(flat.sum())
    # position within the new order, minus the start of its chunk there, plus the
    # chunk's start in the received buffer
    new_starts = by_expert.cumsum(0) - by_expert
    shift = torch.repeat_interleave(start_by_expert - new_starts, by_expert, output_size=total)
    return torch.arange(total, device=sizes.device) + shift


class ExpertGradSync:
    """After the step's last backward: sum each expert weight's gradient over the ranks
    that hold the same experts (`edp_group`; None when there is only one, or when FSDP
    has reduce-scattered them already) and divide by `divide` (the data-parallel
    degree; ep after FSDP's average over edp)."""

    def __init__(self, params: list[nn.Parameter], edp_group, divide: int) -> None:
        self.params, self.group, self.dp = params, edp_group, divide

    def __call__(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if self.group is not None:
                dist.all_reduce(g, op=dist.ReduceOp.SUM, group=self.group)
            g.div_(self.dp)
