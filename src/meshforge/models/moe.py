"""A mixture-of-experts feed-forward for the Llama family (Mixtral, Qwen3-MoE,
DeepSeek-V3 style): a router picks `top_k` of `experts` SwiGLU experts for each token,
optionally beside `shared` experts every token passes through.

The model knows nothing of how its experts are spread. `GroupedExperts` holds all of
a layer's experts as three stacked weights (experts, ...) and computes the tokens
given to it, sorted by expert, with the number of tokens per expert; expert
parallelism (parallel/expert_parallel.py) shards those weights along the expert
dimension and wraps `GroupedExperts` in an all-to-all that brings each token to the
rank holding its expert and back. The only thing the experts look at is how many
experts their weights hold (a DTensor's local shard is read with `to_local`).

Routing, in fp32 whatever the model's dtype (autocast included); the experts compute
in autocast's dtype where it is on:
- scores: softmax of the router logits (Mixtral, Qwen3) or their sigmoid (DeepSeek-V3);
- top-k over the scores (plus a per-expert bias under `load_balance: bias`, which
  steers the choice only), the chosen scores renormalised to sum to 1;
- with a capacity factor c each expert takes at most ceil(c x tokens x top_k / experts)
  of the micro-batch's token assignments, first come first served in token order; the
  rest are dropped (the token keeps its residual and its other experts).

Load balance: the auxiliary loss E x sum_e f_e P_e (f_e: the share of the token
assignments expert e got, P_e: its mean normalised score; 1 when perfectly balanced,
Switch Transformer / DeepSeek-V3's normalisation) times `aux_loss_coeff`, added to the
training loss through the layer's output (`AuxLossInjector`), so that it also reaches
the gradients under a pipeline whose last stage never sees it; or DeepSeek-V3's
auxiliary-loss-free bias, moved after each step by `update_bias` from the step's load.

Each training forward adds its routing counts to `load` (tokens routed to each
expert, before any drop), `dropped` and `aux_sum`; the trainer takes them with
`take_stats`.

A layer whose micro-batch is spread over several ranks (context parallelism: each
holds some tokens of every sequence) is handed `sequence_sum` (parallel code installs
it; the model never learns how it is spread): the sum of a tensor over those ranks,
with autograd. The auxiliary loss then reads the whole micro-batch's f_e and P_e (the
per-expert assignment counts and score sums, summed over them), as one rank holding
every token would; `load`, `dropped` stay this rank's tokens' own (the trainer sums
them over the ranks), `aux_sum` the whole micro-batch's value.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.models.gpt import SwiGLU


@dataclass(frozen=True)
class MoEArgs:
    experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int = 0
    dense_layers: int = 0
    router: str = "softmax"  # softmax | sigmoid
    load_balance: str = "aux_loss"  # aux_loss | bias | none
    aux_loss_coeff: float = 0.01
    bias_update_rate: float = 0.001
    capacity_factor: float | None = None


class _AuxScale:
    """What the training loss is multiplied by before backward (1 / micro-batches per
    step): the auxiliary loss's gradient is scaled the same way."""

    value = 1.0


def set_aux_loss_scale(scale: float) -> None:
    """Set by the step before its backward passes: the factor the main loss of each
    micro-batch is multiplied by."""
    _AuxScale.value = float(scale)


class _Counting:
    enabled = True


@contextlib.contextmanager
def counting_routes(enabled: bool) -> Iterator[None]:
    """Whether training forwards add to the routing statistics: off for a forward that
    is not a micro-batch's (a pipeline's shape inference on placeholder tensors)."""
    before, _Counting.enabled = _Counting.enabled, enabled
    try:
        yield
    finally:
        _Counting.enabled = before


class AuxLossInjector(torch.autograd.Function):
    """Identity on `out`; in backward, gives `aux` the gradient it would get had it
    been added to the (scaled) training loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, _AuxScale.value)


class ExpertWeight(nn.Module):
    """One stacked weight of a layer's experts, (experts, out, in); a module of its own
    so that it is named `experts.gate.weight` etc. like a Linear's."""

    def __init__(self, experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))

    def local(self) -> torch.Tensor:
        w = self.weight
        return w.to_local() if hasattr(w, "to_local") else w


class GroupedExperts(nn.Module):
    """`experts` SwiGLU experts: gate and up (experts, ffn, d), proj (experts, d, ffn).
    forward(x, counts): x holds the tokens sorted by expert, `counts[e]` of them for
    the e-th expert these weights hold; one grouped GEMM per matrix where the device
    has `torch._grouped_mm` (CUDA, bf16), a loop over the experts elsewhere."""

    def __init__(self, experts: int, d_model: int, ffn: int) -> None:
        super().__init__()
        self.gate = ExpertWeight(experts, ffn, d_model)
        self.up = ExpertWeight(experts, ffn, d_model)
        self.proj = ExpertWeight(experts, d_model, ffn)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # in autocast's dtype where it is on (autocast does not reach _grouped_mm), else
        # in x's: weights outside a mixed-precision wrapper stay fp32
        dtype = _compute_dtype(x)
        x = x.to(dtype)
        gate, up, proj = (w.local().to(dtype) for w in (self.gate, self.up, self.proj))
        if _grouped_mm_applies(x, gate):
            offs = counts.cumsum(0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x, gate.transpose(-2, -1), offs=offs))
            h = h * torch._grouped_mm(x, up.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(h, proj.transpose(-2, -1), offs=offs)
        out, start = [], 0
        for e, n in enumerate(counts.tolist()):
            xe = x[start : start + n]
            start += n
            out.append(F.linear(F.silu(F.linear(xe, gate[e])) * F.linear(xe, up[e]), proj[e]))
        return torch.cat(out)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _grouped_mm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and w.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )


class MoE(nn.Module):
    def __init__(self, d_model: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.router = nn.Linear(d_model, args.experts, bias=False)
        self.experts = GroupedExperts(args.experts, d_model, args.expert_ffn)
        self.shared = (
            SwiGLU(d_model, args.shared_experts * args.expert_ffn)  # the shared experts
            if args.shared_experts
            else None
        )
        if args.load_balance == "bias":
            self.register_buffer("expert_bias", torch.zeros(args.experts))
        else:
            self.expert_bias = None
        self.load: torch.Tensor | None = None  # tokens routed per expert since take_stats
        self.dropped: torch.Tensor | None = None
        self.aux_sum: torch.Tensor | None = None
        self.forwards = 0
        # the sum over the ranks holding the other tokens of this rank's micro-batch,
        # with autograd (module docstring); None: this rank holds all of them
        self.sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None

    def reset_buffers(self) -> None:
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    # -- routing ------------------------------------------------------------------------
    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(chosen experts (T, k), their weights (T, k) in fp32, normalised scores (T, E))."""
        a = self.args
        with torch.autocast(flat.device.type, enabled=False):  # fp32 under autocast too
            logits = F.linear(flat.float(), self.router.weight.float())
        scores = logits.softmax(dim=-1) if a.router == "softmax" else logits.sigmoid()
        choose = scores if self.expert_bias is None else scores + self.expert_bias.float()
        chosen = choose.topk(a.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        probs = scores if a.router == "softmax" else scores / scores.sum(-1, keepdim=True)
        return chosen, weights, probs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        n_tokens = flat.shape[0]
        chosen, weights, probs = self.route(flat)
        experts = chosen.flatten()  # token-major: token t's k choices at t*k ... t*k+k-1
        routed = torch.bincount(experts, minlength=a.experts)
        order = torch.argsort(experts, stable=True)  # by expert, token order within one
        counts = routed
        dropped = torch.zeros((), dtype=torch.long, device=flat.device)
        if a.capacity_factor is not None:
            cap = math.ceil(a.capacity_factor * n_tokens * a.top_k / a.experts)
            starts = routed.cumsum(0) - routed
            slot = torch.arange(order.numel(), device=flat.device) - starts[experts[order]]
            keep = slot < cap
            order = order[keep]
            counts = routed.clamp(max=cap)
            dropped = (~keep).sum()
        token = torch.div(order, a.top_k, rounding_mode="floor")
        y_sorted = self.experts(flat[token], counts)
        w = weights.flatten()[order].unsqueeze(-1).to(y_sorted.dtype)
        out = torch.zeros_like(flat, dtype=y_sorted.dtype).index_add_(0, token, y_sorted * w)
        if self.shared is not None:
            out = out + self.shared(flat)
        aux = None
        if a.load_balance == "aux_loss":
            aux = self._aux_loss(routed, probs, n_tokens)
            if self.training and torch.is_grad_enabled() and a.aux_loss_coeff > 0:
                out = AuxLossInjector.apply(out, aux * a.aux_loss_coeff)
        # not a recompute under activation checkpointing, not a shape inference
        if self.training and _Counting.enabled and torch._C._current_graph_task_id() == -1:
            self._record(routed, dropped, aux)
        return out.reshape(shape)

    def _aux_loss(self, routed: torch.Tensor, probs: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """E x sum_e f_e P_e over the micro-batch (all of it under `sequence_sum`)."""
        a = self.args
        if self.sequence_sum is None:
            share = routed.float() / (n_tokens * a.top_k)
            return a.experts * (share * probs.mean(dim=0)).sum()
        # one collective: the assignment counts (no gradient) beside the score sums
        both = self.sequence_sum(torch.cat((routed.float(), probs.sum(dim=0))))
        counts, score_sums = both[: a.experts], both[a.experts :]
        assignments = counts.sum()  # the micro-batch's tokens x top_k, before any drop
        share = counts / assignments
        return a.experts * (share * score_sums / (assignments / a.top_k)).sum()

    # -- statistics and the bias ----------------------------------------------------------
    @torch.no_grad()
    def _record(
        self, routed: torch.Tensor, dropped: torch.Tensor, aux: torch.Tensor | None
    ) -> None:
        aux_v = aux.detach().float() if aux is not None else torch.zeros((), device=routed.device)
        if self.load is None:
            self.load, self.dropped, self.aux_sum = routed.clone(), dropped.clone(), aux_v
        else:
            self.load += routed
            self.dropped += dropped
            self.aux_sum = self.aux_sum + aux_v
        self.forwards += 1

    def take_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        """(tokens routed per expert, dropped assignments, sum of the auxiliary loss,
        forward passes) since the last call; None if no training forward ran."""
        if self.load is None:
            return None
        out = (self.load, self.dropped, self.aux_sum, self.forwards)
        self.load = self.dropped = self.aux_sum = None
        self.forwards = 0
        return out

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's auxiliary-loss-free balance: raise the bias of an expert that
        got fewer tokens than the mean over the step (over every data-parallel rank),
        lower it for one that got more."""
        if self.expert_bias is None:
            return
        load = load.float()
        self.expert_bias += self.args.bias_update_rate * torch.sign(load.mean() - load)
