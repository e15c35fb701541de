"""Context parallelism (`parallel.cp`): each of the cp ranks of a sequence holds 1/cp
of its tokens, and attention sees the keys and values of the whole sequence. The
models (models/gpt.py, models/llama.py) never see it.

Head-tail split. Causal attention costs a token in proportion to its position, so
a contiguous split would give the last rank most of the work. The sequence is cut
into 2 x cp chunks of S / (2 cp) tokens and cp rank r keeps chunks r and 2cp-1-r
(Megatron-LM's and Llama 3's balanced split): every rank then holds the same share
of the causal work.

    S = 8, cp = 2:   chunks  [0 1] [2 3] [4 5] [6 7]
                     rank 0   x                 x       positions 0 1 6 7
                     rank 1         x     x             positions 2 3 4 5

The split (`ContextSplit.shard`, called by the step with the full micro-batch every
cp rank of a data-parallel rank reads): this rank's tokens of x and y, and the
`Documents` the model takes -- the positions of its tokens in the whole sequence (or,
with data.document_masking, inside their documents: document ids are found on the
full sequence first), and a mask of its queries against every key (causal by global
position, within the same document). Learned position embeddings and rotary angles
are those of world 1; the loss over this rank's tokens is the mean of S/cp of them,
and the mean over the cp ranks (all holding S/cp) is world 1's mean over all S.

Attention, `parallel.cp_method: allgather` (Llama 3's method, `AllGatherAttend`): K
and V are all-gathered over the cp group with autograd (torch's functional
`all_gather_single_autograd`, whose backward is a reduce-scatter with sum: each rank
gets the gradients every rank's queries sent to its keys and values), in one
collective per layer; then this rank's queries attend all S keys:
- plain causal attention (no document masking), on CPU: block by block
  (`_CausalBlocks`): the keys put in sequence order, chunk i's queries attend chunks
  0..i-1 in full and chunk i causally, each block one flash-attention call, merged
  by their log-sum-exps; backward runs each block's flash backward. No S/cp x S mask
  exists, so a rank saves for backward its S/cp share of every activation plus the
  whole sequence's K and V (0.58x world 1's at seq 1024 for the tests' tiny GPT);
- with document masking (and elsewhere than on CPU, or with attention dropout):
  SDPA under the mask (b or 1, 1, S/cp, S) of the local queries against the keys in
  the order they were gathered (rank 0's two chunks, then rank 1's, ...;
  `key_positions`), causal by global position and within the same document.

Attention, `parallel.cp_method: alltoall` (DeepSpeed Ulysses, `AllToAllAttend`): one
all-to-all over the cp group (torch's functional `all_to_all_single_autograd`, whose
backward is the reverse all-to-all) trades heads for sequence: each rank sends head
group j of its S/cp tokens' q, k and v to cp rank j and gets back its own h/cp heads
over the whole sequence, in the order gathered (rank 0's two chunks, rank 1's, ...).
Put in sequence order, those heads attend as at world 1: SDPA with `is_causal=True`,
or with document masking under the whole sequence's mask (b, 1, S, S), same document
and causal (`ContextDocuments.sequence_mask`, from the whole sequence's document ids
that `ContextSplit.shard` keeps). The output goes back to gathered order and through
the reverse all-to-all to this rank's tokens with all h heads. Grouped-query
attention: where the cp ranks divide the key/value heads, the fewer heads travel
(query head group j needs exactly key/value head group j) and are repeated after;
else they are repeated first. A rank holds whole heads, so the layout rules ask cp to
divide the heads of a tensor-parallel rank (model.n_heads / parallel.tp). Each layer
moves q, k, v and the output once, forward and backward, whatever cp; a rank saves
its heads' share of the whole sequence's attention inputs.

Attention, `parallel.cp_method: ring` (ring attention, `RingAttend`): no collective;
each rank's K and V (its two chunks, grouped-query heads unrepeated) go round the cp
ranks, each rank sending to rank + 1 and receiving from rank - 1
(`dist.batch_isend_irecv`, in `RingAttend.rotate`), cp - 1 times a layer. Each
exchange is posted before the rank attends the block it holds, so the transfer
overlaps the compute. This rank's query chunks attend a visiting rank's key chunks by chunk index:
in full where the key chunk comes first, causally where it is the same chunk, not at
all after; each pair one flash-attention call, merged by log-sum-exp as
`_CausalBlocks` merges (`_RingBlocks`). Backward sends K and V round again, and behind
them float32 accumulators of their gradients, to which every rank adds its queries'
share; after cp sends each rank's accumulator is back with it; dq never moves. A
rank saves for backward only its own q, K, V, output and log-sum-exp, and holds two
blocks of K and V at a time (the one it attends, the one arriving), never the whole
sequence's. Plain causal attention only: document masking and attention dropout are
refused (layout rules). The kernels are picked by device (`_Flash`): aten's flash
kernel for CPU (what the tests run, the cp ranks as threads and over gloo) or, on
CUDA, the flash kernel (fp16/bf16) or the memory-efficient one (fp32), untested here.
Users get ring on CUDA devices only: the layout rules refuse it elsewhere.

Gradients. Every cp rank computes the gradient of its own loss, plus (through the
reduce-scatter, the reverse all-to-all or ring's accumulators) what the other ranks'
losses owe its keys and values; summed over the cp ranks that is cp times the
gradient of their mean loss, so averaging over the dp x cp ranks ("dp_cp",
parallel/mesh.py) gives world 1's gradient. The data-parallel wrappers (DDP, FSDP2,
replicate) run over "dp_cp" for that reason.

Mixture of experts. A MoE layer's auxiliary loss E x sum_e f_e P_e is that of the
whole micro-batch at world 1; here each cp rank routes S/cp of its tokens.
`apply_context_parallel` hands every `MoE` layer a `SequenceSum` over the cp group
(its `sequence_sum`): the layer sums its per-expert assignment counts and score sums
over the cp ranks in one all-reduce, so that every cp rank computes world 1's
auxiliary loss. That all-reduce's backward is an all-reduce (sum) too: each cp rank
adds its loss's auxiliary term, so the score sums of rank r owe every rank's term its
gradient, cp times world 1's in all, and the average over "dp_cp" gives world 1's,
as for the main loss. The routing counts the trainer sums (train/moe_load.py) stay
each rank's own tokens'; `load_balance: bias` moves the bias by the step's load over
the dp x cp ranks. A capacity factor (token dropping, first come first served in the
order of the whole micro-batch's tokens) is not built under cp: the layout rules
refuse it. Expert parallelism borrows its ranks from dp as without cp: an expert's
gradient comes from the tokens of the cp ranks at the same cp coordinate in its
expert group, and is summed over the ranks that hold the same experts, edp x cp
(parallel/parallelize.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshforge.models.attention import Documents, attend, document_ids, repeat_kv
from meshforge.models.moe import MoE

try:  # the name of newer torch (the older one warns there that it is deprecated)
    from torch.distributed._functional_collectives import (
        all_gather_single_autograd as all_gather_autograd,
    )
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._functional_collectives import (
        all_gather_tensor_autograd as all_gather_autograd,
    )
from torch.distributed._functional_collectives import all_to_all_single_autograd


def chunk_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions in the whole sequence (int64, S/cp) of the tokens cp rank `rank`
    keeps: chunks `rank` and `2cp-1-rank` of 2cp, in that order."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp}")
    c = seq_len // (2 * cp)
    head = torch.arange(rank * c, (rank + 1) * c)
    tail = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)
    return torch.cat((head, tail))


def key_positions(seq_len: int, cp: int) -> torch.Tensor:
    """The positions in the whole sequence (int64, S) of the keys an all-gather over the
    cp ranks returns: rank 0's tokens, then rank 1's, ..."""
    return torch.cat([chunk_positions(seq_len, cp, r) for r in range(cp)])


@dataclass(frozen=True)
class ContextDocuments(Documents):
    """The `Documents` of this rank's tokens under context parallelism (`positions`
    (b, S/cp)). `mask` (b, 1, S/cp, S) with data.document_masking; None for plain
    causal attention, which `AllGatherAttend` then runs block by block without one.
    `sequence_ids` (b, S): the document ids of the whole sequence, in sequence order
    (None without document masking), for `AllToAllAttend`'s `sequence_mask`."""

    rank: int = 0
    size: int = 1
    sequence_ids: torch.Tensor | None = None

    @functools.cached_property
    def sequence_mask(self) -> torch.Tensor | None:
        """(b, 1, S, S): every query of the whole sequence against every key, in sequence
        order, causal and within the same document (None without document masking).
        Built on first use and shared by the layers."""
        if self.sequence_ids is None:
            return None
        ids = self.sequence_ids
        s = ids.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
        return ((ids[:, :, None] == ids[:, None, :]) & causal).unsqueeze(1)


class ContextSplit:
    """This rank's share of each micro-batch under context parallelism (module
    docstring): `shard` keeps its tokens and builds the `Documents` its attention
    needs."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    @classmethod
    def of(cls, cp_mesh: DeviceMesh) -> ContextSplit:
        return cls(cp_mesh.get_local_rank(), cp_mesh.size())

    def shard(
        self, x: torch.Tensor, y: torch.Tensor, eot_id: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, ContextDocuments]:
        """This rank's tokens of the full micro-batch x, y (b, S): (x, y) of shape
        (b, S/cp) and their ContextDocuments. `eot_id`: data.document_masking's
        separator (None: one causal sequence a row, and no mask)."""
        b, s = x.shape
        mine, keys = _positions(s, self.size, self.rank, x.device)
        doc_ids = None
        if eot_id is None:
            positions = mine.expand(b, -1)
            ids, mask = torch.zeros_like(positions), None
        else:
            doc_ids, doc_positions = document_ids(x, eot_id)  # on the whole sequence
            ids, positions = doc_ids[:, mine], doc_positions[:, mine]
            causal = keys[None, :] <= mine[:, None]  # (S/cp, S)
            same = ids[:, :, None] == doc_ids[:, keys][:, None, :]
            mask = (same & causal).unsqueeze(1)
        docs = ContextDocuments(
            ids,
            positions,
            mask,  # type: ignore[arg-type]
            rank=self.rank,
            size=self.size,
            sequence_ids=doc_ids,
        )
        return x[:, mine], y[:, mine], docs

    def causal_documents(self, rows: int, local_len: int, device: torch.device) -> ContextDocuments:
        """The ContextDocuments of `rows` rows of this rank's `local_len` tokens of one
        causal sequence each (no document masking): what a pipeline stage, handed hidden
        states only, gives its attention."""
        mine, _ = _positions(local_len * self.size, self.size, self.rank, device)
        positions = mine.expand(rows, -1)
        return ContextDocuments(torch.zeros_like(positions), positions, None,  # type: ignore[arg-type]
                                rank=self.rank, size=self.size)  # fmt: skip


class ContextStage(nn.Module):
    """A pipeline stage's module under context parallelism: the schedule hands it this
    rank's tokens (or hidden states) alone, and it passes its model part the
    ContextDocuments of their positions in the whole sequence."""

    def __init__(self, part: nn.Module, split: ContextSplit) -> None:
        super().__init__()
        self.part, self.split = part, split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.part(x, docs=self.split.causal_documents(x.shape[0], x.shape[1], x.device))


@functools.lru_cache(maxsize=64)
def _positions(
    seq_len: int, cp: int, rank: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's positions (S/cp), the gathered keys' positions (S)) on `device`."""
    return (
        chunk_positions(seq_len, cp, rank).to(device),
        key_positions(seq_len, cp).to(device),
    )


@functools.lru_cache(maxsize=64)
def _sequence_order(seq_len: int, cp: int, device: torch.device) -> torch.Tensor:
    """The gathered keys' indices in sequence order: gathered[order] is sequence order."""
    return torch.argsort(key_positions(seq_len, cp)).to(device)


class _ContextAttend:
    """What the cp methods' attends share: the cp group, and the `ContextDocuments` of
    `ContextSplit.shard` required before `attend` runs on this rank's tokens."""

    needs = "the queries' positions"  # what the method reads of the ContextDocuments

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        docs: Documents | None = None,
        dropout_p: float = 0.0,
    ) -> torch.Tensor:
        if not isinstance(docs, ContextDocuments):
            raise RuntimeError(
                f"context-parallel attention needs the ContextDocuments of "
                f"ContextSplit.shard ({self.needs})"
            )
        return self.attend_local(q, k, v, docs, dropout_p)

    def attend_local(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: ContextDocuments,
        dropout_p: float,
    ) -> torch.Tensor:  # fmt: skip
        raise NotImplementedError


class AllGatherAttend(_ContextAttend):
    """`parallel.cp_method: allgather`: an attention module's attend (models/attention.py)
    that all-gathers K and V over the cp group, then attends this rank's queries against
    all keys (module docstring): with documents under their mask; plain causal
    attention block by block (`_CausalBlocks`, on CPU) or under a causal mask."""

    needs = "the queries' positions, their mask"

    def attend_local(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: ContextDocuments,
        dropout_p: float,
    ) -> torch.Tensor:  # fmt: skip
        # one collective for K and V: (b, h, s, d) x 2 -> (s, 2, b, h, d), gathered along
        # the sequence (dim 0, so the ranks' blocks simply follow each other); under
        # grouped-query attention their fewer heads travel, repeated after the gather
        kv = torch.stack((k, v)).permute(3, 0, 1, 2, 4).contiguous()
        full = self.gather(kv)
        seq_len, cp, rank = full.shape[0], docs.size, docs.rank
        mask = docs.mask
        if mask is None and dropout_p == 0.0 and _CausalBlocks.runs_on(q):
            order = _sequence_order(seq_len, cp, full.device)
            k_seq, v_seq = full.index_select(0, order).permute(1, 2, 3, 0, 4).unbind(0)
            return _CausalBlocks.apply(q, k_seq, v_seq, rank, cp)
        if mask is None:  # plain causal, by global position
            mine, keys = _positions(seq_len, cp, rank, full.device)
            mask = (keys[None, :] <= mine[:, None])[None, None]
        k_all, v_all = (repeat_kv(q, t) for t in full.permute(1, 2, 3, 0, 4).unbind(0))
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, dropout_p=dropout_p)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """`t` of every cp rank, concatenated along dim 0 in rank order; its backward
        sums each rank's gradients of this rank's block (a reduce-scatter)."""
        return all_gather_autograd(t, 0, self.group)


class AllToAllAttend(_ContextAttend):
    """`parallel.cp_method: alltoall` (DeepSpeed Ulysses): an attention module's attend
    (models/attention.py) that trades heads for sequence by an all-to-all over the cp
    group, attends its h/cp heads over the whole sequence as at world 1, and trades
    back (module docstring)."""

    needs = "the queries' positions, the documents' ids"

    def attend_local(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: ContextDocuments,
        dropout_p: float,
    ) -> torch.Tensor:  # fmt: skip
        cp = docs.size
        b, h, s, d = q.shape
        if h % cp:  # the layout rules refuse this first
            raise ValueError(
                f"cp_method alltoall: {h} heads on this rank, not divisible by cp {cp}"
            )
        if k.shape[1] % cp:  # too few key/value heads to split: repeat them first
            k, v = repeat_kv(q, k), repeat_kv(q, v)
        kv_heads = k.shape[1]
        # one collective for q, k and v: each (b, heads, s, d) -> (cp, b, heads/cp, s, d),
        # head group j to rank j, concatenated along the heads
        sent = torch.cat([_by_rank(t, cp, dim=1) for t in (q, k, v)], dim=2)
        got = self.exchange(sent)  # (cp, b, (h + 2 kv_heads)/cp, s, d): rank i's tokens
        full = got.permute(1, 2, 0, 3, 4).reshape(b, -1, cp * s, d)  # gathered order
        seq_len = cp * s
        full = full.index_select(2, _sequence_order(seq_len, cp, full.device))
        qs, ks, vs = full.split((h // cp, kv_heads // cp, kv_heads // cp), dim=1)
        mask = docs.sequence_mask
        ks, vs = repeat_kv(qs, ks), repeat_kv(qs, vs)
        if mask is None:
            out = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=dropout_p, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, dropout_p=dropout_p)
        # back to gathered order, then token block i to rank i
        out = out.index_select(2, _positions(seq_len, cp, docs.rank, out.device)[1])
        back = self.exchange(_by_rank(out, cp, dim=2))  # (cp, b, h/cp, s, d): head group j
        return back.permute(1, 0, 2, 3, 4).reshape(b, h, s, d)

    def exchange(self, t: torch.Tensor) -> torch.Tensor:
        """All-to-all of `t` (cp, ...) over the cp group: block j goes to cp rank j, and
        block i of the result came from cp rank i; its backward is the reverse."""
        return all_to_all_single_autograd(t, None, None, self.group)


def _by_rank(t: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """`t` with dimension `dim` cut into cp blocks, the blocks moved to a new leading
    dimension (contiguous, for the all-to-all)."""
    shape = t.shape[:dim] + (cp, t.shape[dim] // cp) + t.shape[dim + 1 :]
    return t.reshape(shape).movedim(dim, 0).contiguous()


class _CausalBlocks(torch.autograd.Function):
    """Causal attention of this cp rank's two chunks (head i = rank, tail j = 2cp-1-rank)
    against the keys of the whole sequence, in sequence order, without an S/cp x S mask:
    chunk i attends chunks 0..i-1 in full and chunk i causally (a square block, where
    SDPA's causal mask is the right one). Each block is one flash-attention call
    returning its output and log-sum-exp; the blocks merge by their log-sum-exps, and
    backward runs each block's flash backward with the merged output and log-sum-exp
    (the blockwise attention of ring attention). Memory: q, the whole K and V (with
    their own heads: grouped-query heads are repeated in forward and again in
    backward, not kept), the output and the log-sum-exp.
    CPU only here (aten's flash kernel for CPU); elsewhere attention takes the mask."""

    @staticmethod
    def runs_on(q: torch.Tensor) -> bool:
        return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)

    @staticmethod
    def blocks(rank: int, cp: int, c: int) -> list[tuple[slice, list[tuple[slice, bool]]]]:
        """(the chunk's rows of q, [(keys, causal), ...]) for the head and tail chunks."""
        out = []
        for n, i in enumerate((rank, 2 * cp - 1 - rank)):
            keys = [(slice(0, i * c), False)] if i > 0 else []
            keys.append((slice(i * c, (i + 1) * c), True))
            out.append((slice(n * c, (n + 1) * c), keys))
        return out

    @staticmethod
    def forward(ctx, q, k, v, rank: int, cp: int):  # type: ignore[override]
        c = q.shape[2] // 2
        scale = 1.0 / math.sqrt(q.shape[-1])
        kr, vr = repeat_kv(q, k), repeat_kv(q, v)
        outs, lses = [], []
        for rows, keys in _CausalBlocks.blocks(rank, cp, c):
            qc, out, lse = q[:, :, rows], None, None
            for ks, causal in keys:
                block, block_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    qc, kr[:, :, ks], vr[:, :, ks], 0.0, causal, scale=scale
                )
                block, block_lse = block.float(), block_lse.float()
                if out is None:
                    out, lse = block, block_lse
                else:  # merge by log-sum-exp
                    new = torch.logaddexp(lse, block_lse)
                    out = (out * (lse - new).exp()[..., None]
                           + block * (block_lse - new).exp()[..., None])  # fmt: skip
                    lse = new
            outs.append(out)
            lses.append(lse)
        out = torch.cat(outs, dim=2).to(q.dtype)
        lse = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.rank, ctx.cp, ctx.scale = rank, cp, scale
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        kr, vr = repeat_kv(q, k), repeat_kv(q, v)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kr), torch.zeros_like(vr)
        for rows, keys in _CausalBlocks.blocks(ctx.rank, ctx.cp, q.shape[2] // 2):
            g, qc, oc, lc = grad[:, :, rows], q[:, :, rows], out[:, :, rows], lse[:, :, rows]
            for ks, causal in keys:
                gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    g, qc, kr[:, :, ks], vr[:, :, ks], oc, lc, 0.0, causal, scale=ctx.scale
                )
                dq[:, :, rows] += gq
                dk[:, :, ks] += gk
                dv[:, :, ks] += gv
        if dk.shape[1] != k.shape[1]:  # each key/value head served a group of query heads
            b, _, s, d = k.shape
            dk = dk.view(b, k.shape[1], -1, s, d).sum(2)
            dv = dv.view(b, v.shape[1], -1, s, d).sum(2)
        return dq, dk, dv, None, None


class RingAttend(_ContextAttend):
    """`parallel.cp_method: ring` (ring attention): an attention module's attend
    (models/attention.py) that passes this rank's keys and values around the cp ranks,
    one neighbour to the next, while it attends each visiting rank's block (module
    docstring; `_RingBlocks`). Plain causal attention only: with document masking or
    attention dropout it refuses (the layout rules refuse document masking first).
    The exchange is one method, `rotate`, so that tests can substitute it."""

    needs = "the queries' positions"

    def attend_local(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: ContextDocuments,
        dropout_p: float,
    ) -> torch.Tensor:  # fmt: skip
        if docs.mask is not None:  # the layout rules refuse this first
            raise ValueError(
                "cp_method ring: document masking is not yet built; use allgather or alltoall"
            )
        if dropout_p:
            raise ValueError(
                f"cp_method ring: attention dropout ({dropout_p}) is not built; use "
                "allgather or alltoall, or model.dropout=0"
            )
        return _RingBlocks.apply(q, k, v, docs.rank, docs.size, self)

    def rotate(self, tensors: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
        """Start sending `tensors` to the next cp rank (rank + 1, around the ring) and
        receiving the previous rank's (rank - 1) in their place, in one
        `batch_isend_irecv`; returns the wait, which hands back the received tensors
        (same shapes and dtypes). Not differentiable: `_RingBlocks` rotates gradients
        itself. The posting and the wait run under profiler ranges named `cp_ring::...`,
        which the trainer's exposed-communication profile counts (observe/comm_time.py)
        as it counts the other methods' functional collectives."""
        cp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        dst = dist.get_global_rank(self.group, (rank + 1) % cp)
        src = dist.get_global_rank(self.group, (rank - 1) % cp)
        got = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), dst, self.group, tag=i)
               for i, t in enumerate(tensors)]  # fmt: skip
        ops += [dist.P2POp(dist.irecv, g, src, self.group, tag=i) for i, g in enumerate(got)]
        with torch.profiler.record_function("cp_ring::exchange"):
            requests = dist.batch_isend_irecv(ops)

        def wait() -> list[torch.Tensor]:
            with torch.profiler.record_function("cp_ring::wait"):
                for request in requests:
                    request.wait()
            return got

        return wait


class _Flash:
    """One flash-attention block, forward (output and log-sum-exp, float32 (b, h, s))
    and backward (given the merged output and log-sum-exp), by device: on CPU aten's
    flash kernel for CPU (what `_CausalBlocks` uses, tested here)."""

    @staticmethod
    def of(device: torch.device) -> type[_Flash]:
        return _CudaFlash if device.type == "cuda" else _Flash

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse.float()

    @staticmethod
    def backward(g, q, k, v, out, lse, causal: bool, scale: float):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g, q, k, v, out, lse, 0.0, causal, scale=scale
        )


class _CudaFlash(_Flash):
    """`_Flash` on CUDA devices: aten's flash kernel for fp16/bf16, its memory-efficient
    kernel for fp32 (whose log-sum-exp is padded to a multiple of 32). UNTESTED HERE (no
    GPU on the machines that built it): scripts/gpu_check.sh runs the ring unit tests on
    a GPU. No dropout, so the kernels' random state is never read."""

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        if q.dtype in (torch.float16, torch.bfloat16):
            out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False, scale=scale
            )
        else:
            out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, 0.0, causal, scale=scale
            )
        return out, lse[..., : q.shape[2]].float()

    @staticmethod
    def backward(g, q, k, v, out, lse, causal: bool, scale: float):
        empty = torch.empty(0, dtype=torch.uint64, device=q.device)  # dropout's, unread
        if q.dtype in (torch.float16, torch.bfloat16):
            return torch.ops.aten._scaled_dot_product_flash_attention_backward(
                g, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0,
                causal, empty, empty, scale=scale,
            )  # fmt: skip
        padded = F.pad(lse, (0, -q.shape[2] % 32)).contiguous()
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            g, q, k, v, None, out, padded, empty, empty, 0.0, [True, True, True, False], causal,
            scale=scale,
        )  # fmt: skip
        return dq, dk, dv


def _ring_pairs(rank: int, src: int, cp: int) -> list[tuple[int, int, bool]]:
    """(this rank's query chunk n, the visiting rank `src`'s key chunk m, causal) for the
    blocks that attend: chunk indices (rank, 2cp-1-rank) against (src, 2cp-1-src), in
    full where the key chunk comes before the query chunk, causally where it is the
    same one, not at all after."""
    pairs = []
    for n, i in enumerate((rank, 2 * cp - 1 - rank)):
        for m, j in enumerate((src, 2 * cp - 1 - src)):
            if j <= i:
                pairs.append((n, m, j == i))
    return pairs


class _RingBlocks(torch.autograd.Function):
    """Ring attention of this cp rank's two chunks (module docstring). Forward: cp steps;
    at step t this rank holds the keys and values of cp rank (rank - t) % cp (its own at
    step 0), and posts the next rotation (`RingAttend.rotate`) before it attends the
    block it holds, so that the transfer overlaps the compute; its query chunks attend
    the visiting key chunks by chunk index (`_ring_pairs`), each pair one flash call
    (`_Flash`), merged by their log-sum-exps as in `_CausalBlocks`. Backward: the keys
    and values go round again, and behind them accumulators of their gradients (float32)
    to which each rank adds its queries' share; after cp rotations each rank's own
    accumulator is back with it. dq stays here. Grouped-query heads travel unrepeated
    and are repeated for each block. Memory: q, this rank's K and V, the output and the
    log-sum-exp (and, while it runs, one visiting block and the one arriving)."""

    @staticmethod
    def forward(ctx, q, k, v, rank: int, cp: int, ring: RingAttend):  # type: ignore[override]
        c = q.shape[2] // 2
        scale = 1.0 / math.sqrt(q.shape[-1])
        flash = _Flash.of(q.device)
        kv = torch.stack((k, v))  # one message of (2, b, kv_heads, S/cp, d)
        out: list[torch.Tensor | None] = [None, None]
        lse: list[torch.Tensor | None] = [None, None]
        for step in range(cp):
            wait = ring.rotate([kv]) if step < cp - 1 else None
            src = (rank - step) % cp
            kr, vr = repeat_kv(q, kv[0]), repeat_kv(q, kv[1])
            for n, m, causal in _ring_pairs(rank, src, cp):
                rows, keys = slice(n * c, (n + 1) * c), slice(m * c, (m + 1) * c)
                block, block_lse = flash.forward(
                    q[:, :, rows], kr[:, :, keys], vr[:, :, keys], causal, scale
                )
                block = block.float()
                if out[n] is None:
                    out[n], lse[n] = block, block_lse
                else:  # merge by log-sum-exp
                    new = torch.logaddexp(lse[n], block_lse)  # type: ignore[arg-type]
                    out[n] = (out[n] * (lse[n] - new).exp()[..., None]  # type: ignore[operator]
                              + block * (block_lse - new).exp()[..., None])  # fmt: skip
                    lse[n] = new
            if wait is not None:
                (kv,) = wait()
        merged = torch.cat(out, dim=2).to(q.dtype)  # type: ignore[arg-type]
        merged_lse = torch.cat(lse, dim=2)  # type: ignore[arg-type]
        ctx.save_for_backward(q, k, v, merged, merged_lse)
        ctx.rank, ctx.cp, ctx.scale, ctx.ring = rank, cp, scale, ring
        return merged

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        rank, cp, ring = ctx.rank, ctx.cp, ctx.ring
        grad = grad.contiguous()
        c = q.shape[2] // 2
        flash = _Flash.of(q.device)
        b, kv_heads, s, d = k.shape
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        arriving = None  # the wait for the gradient accumulator the previous rank sent
        for step in range(cp):
            wait_kv = ring.rotate([kv]) if step < cp - 1 else None
            src = (rank - step) % cp
            kr, vr = repeat_kv(q, kv[0]), repeat_kv(q, kv[1])
            dkv = torch.zeros((2, b, q.shape[1], s, d), dtype=torch.float32, device=q.device)
            for n, m, causal in _ring_pairs(rank, src, cp):
                rows, keys = slice(n * c, (n + 1) * c), slice(m * c, (m + 1) * c)
                gq, gk, gv = flash.backward(
                    grad[:, :, rows], q[:, :, rows], kr[:, :, keys], vr[:, :, keys],
                    out[:, :, rows], lse[:, :, rows].contiguous(), causal, ctx.scale,
                )  # fmt: skip
                dq[:, :, rows] += gq
                dkv[0, :, :, keys] += gk
                dkv[1, :, :, keys] += gv
            if dkv.shape[2] != kv_heads:  # each key/value head served a group of query heads
                dkv = dkv.view(2, b, kv_heads, -1, s, d).sum(3)
            if arriving is not None:  # src's accumulator, from the ranks before this one
                (so_far,) = arriving()
                dkv += so_far
            arriving = ring.rotate([dkv])  # on to the next rank
            if wait_kv is not None:
                (kv,) = wait_kv()
        (dkv,) = arriving()  # type: ignore[misc]  # after cp rotations: this rank's own
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def attention_modules(module: nn.Module) -> list[nn.Module]:
    """The modules of `module` that compute attention through models.attention.attend
    (the models' `attend` attribute)."""
    return [m for m in module.modules() if getattr(m, "attend", None) is attend]


def apply_context_parallel(module: nn.Module, cp_mesh: DeviceMesh, method: str) -> None:
    """Give every attention module of `module` the context-parallel attend of `method`
    over `cp_mesh` (in place; nothing is communicated)."""
    methods = {"allgather": AllGatherAttend, "alltoall": AllToAllAttend, "ring": RingAttend}
    if method not in methods:  # the layout rules refuse the others first
        raise ValueError(f"parallel.cp_method={method} is not built")
    layers = attention_modules(module)
    if not layers:
        raise ValueError("context parallelism found no attention module using models.attention")
    attend_all = methods[method](cp_mesh.get_group())
    for m in layers:
        m.attend = attend_all
    sequence_sum = SequenceSum(cp_mesh.get_group())
    for moe in (m for m in module.modules() if isinstance(m, MoE)):
        if moe.args.capacity_factor is not None:  # the layout rules refuse it first
            raise ValueError("model.moe.capacity_factor with parallel.cp > 1 is not yet built")
        moe.sequence_sum = sequence_sum


class SequenceSum:
    """A mixture-of-experts layer's `sequence_sum` (models/moe.py) under context
    parallelism: the sum of a tensor over the cp group, with autograd (module
    docstring, Mixture of experts)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return _SumOverGroup.apply(t, self.group)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over `group`; backward all-reduces the gradient (sum) too: each
    rank's input reaches every rank's loss."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = t.detach().clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None
