"""`parallel.comm` applied to the wrappers torch provides (docs/comm.md).

DDP (zero 0/1, tp = pp = 1):
  compression   a DDP communication hook: torch's `bf16_compress_hook` /
                `fp16_compress_hook` (each bucket cast, all-reduced, cast back) or
                `powerSGD_hook` (rank-r factorisation with error feedback, after
                `powersgd_warmup` optimizer steps of plain all-reduce).
  overlap=false every micro-batch runs under `no_sync`; after backward the gradients
                are averaged in flat all-reduces of `bucket_mb` each
                (`FlatGradReduction`), so nothing overlaps with compute.
FSDP (zero 2/3):
  prefetch      each block gathers the next N blocks' parameters in forward and the
                previous N in backward (`set_modules_to_{forward,backward}_prefetch`).
  reduce_dtype  the dtype of the gradient reduce-scatter (`MixedPrecisionPolicy`).

The config (config.py `check_comm`) refuses a setting on a layout it does not apply
to, so every function here may assume its layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel

from meshforge.config import CommConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def register_compression(
    ddp: DistributedDataParallel, comm: CommConfig, group: dist.ProcessGroup
) -> None:
    """Register the DDP communication hook that `comm.compression` names (none: DDP's
    own averaging all-reduce). Hooks run only when DDP synchronises: on the last
    micro-batch of an accumulated step, so PowerSGD counts optimizer steps."""
    if comm.compression == "none":
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if comm.compression == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=comm.powersgd_rank,
            # torch needs >= 2 with error feedback and warm start (DDP rebuilds its
            # buckets after the first iteration); config.py asks the same
            start_powerSGD_iter=comm.powersgd_warmup,
            random_seed=0,  # every rank draws the same initial factors
        )
        hook = powerSGD_hook.powerSGD_hook
        if dist.get_backend(group) == "gloo":
            hook = _powersgd_bucket_by_bucket
        ddp.register_comm_hook(state, hook)
        return
    hook = {
        "bf16": default_hooks.bf16_compress_hook,
        "fp16": default_hooks.fp16_compress_hook,
    }[comm.compression]
    if comm.compression == "bf16" and dist.get_backend(group) == "gloo":
        hook = _bf16_compress_hook_on_gloo
    ddp.register_comm_hook(group, hook)


# No annotations: DDP compares the hook's signature annotations with dist.GradBucket and
# Future[Tensor] objects, and this module's annotations are strings.
def _bf16_compress_hook_on_gloo(process_group, bucket):
    """torch's own bf16_compress_hook. DDP refuses that hook by name unless CUDA with
    NCCL >= 2.10 (NCCL's first bf16 all-reduce) is present, also for a gloo group;
    gloo all-reduces bf16 on CPU, so there the same hook goes by another name."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)


def _powersgd_bucket_by_bucket(state, bucket):
    """torch's powerSGD_hook, one bucket at a time. PowerSGD all-reduces P, and then
    Q from P's completion callback, which runs on a gloo thread; with several buckets
    in flight, one rank may start bucket 0's Q before bucket 1's P while its peer does
    the reverse. gloo matches collectives by their order, so the two all-reduces of
    different sizes meet and gloo aborts the process (`op.preamble.length <=
    op.nbytes`). Waiting for each bucket before backward hands over the next keeps
    every rank's order the same; backward stalls for the bucket's communication."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    fut = powerSGD_hook.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


class FlatGradReduction:
    """Gradient averaging after backward (parallel.comm.overlap: false): the gradients
    are packed in order into flat buffers of at most `bucket_bytes` (one dtype each),
    each divided by the group size and all-reduced, as DDP's buckets are, but with
    nothing left to overlap."""

    def __init__(self, group: dist.ProcessGroup, bucket_mb: float) -> None:
        self.group = group
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))

    def buckets(self, params: list[nn.Parameter]) -> list[list[torch.Tensor]]:
        """The gradients of `params`, packed into buckets in order."""
        out: list[list[torch.Tensor]] = []
        size = 0
        for g in (p.grad for p in params if p.grad is not None):
            last = out[-1] if out else None
            fits = last is not None and size + _nbytes(g) <= self.bucket_bytes
            if fits and last[0].dtype == g.dtype and last[0].device == g.device:
                last.append(g)
                size += _nbytes(g)
            else:
                out.append([g])
                size = _nbytes(g)
        return out

    @torch.no_grad()
    def __call__(self, params: list[nn.Parameter]) -> None:
        world = dist.get_world_size(self.group)
        for grads in self.buckets(params):
            flat = torch.cat([g.reshape(-1) for g in grads])
            flat.div_(world)  # before the sum, as DDP does (no overflow in low precision)
            dist.all_reduce(flat, group=self.group)
            for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def mixed_precision(dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy | None:
    """FSDP's policy for precision.dtype and parallel.comm.reduce_dtype; None when both
    are fp32 (torch's default: no casts at all). Parameters stay fp32 under fp32."""
    if dtype == "fp32" and reduce_dtype == "fp32":
        return None
    return MixedPrecisionPolicy(
        param_dtype=None if dtype == "fp32" else DTYPES[dtype],
        reduce_dtype=DTYPES[reduce_dtype],
    )


def set_prefetch(root: FSDPModule, blocks: list[FSDPModule], n: int) -> None:
    """Explicit all-gather prefetch of `n` blocks ahead: in forward block i gathers
    blocks i+1..i+n, in backward blocks i-1..i-n; the root (whose forward starts and
    whose output starts backward) gathers the first n, and in backward the last n."""
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + n])
        # in the order backward reaches them; block 0's empty list keeps torch's default
        block.set_modules_to_backward_prefetch(blocks[max(0, i - n) : i][::-1])
    if blocks:
        root.set_modules_to_forward_prefetch(blocks[:n])
        root.set_modules_to_backward_prefetch(blocks[-n:][::-1])
