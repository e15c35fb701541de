"""Causal attention, optionally kept inside documents (`data.document_masking`).

A packed training sequence holds several documents, each ended by the data's
end-of-text token. With document masking no token attends across a boundary and
positions restart at 0 in each document, so every token sees what it would see if
its document ran alone. Convention: the separator belongs to the document it ends;
the next document starts right after it.

    tokens     a  b  |  c  d  |  e
    doc id     0  0  0  1  1  1  2      separators strictly before t
    position   0  1  2  0  1  2  0      t - the first index of t's document

`Documents` is built once per forward from the input ids (`documents_of`) and handed
down to every block, so that layers share what it holds: the boolean mask (causal AND
same document) and, where the "flex" path below is taken, FlexAttention's block mask
of the same rule (`Documents.block_mask`, built by `documents_of` outside the blocks,
which train.compile may compile). Which of the two a layer's attention uses is
`attention_path`'s choice:

- "flex": `torch.nn.attention.flex_attention` with the block mask, which skips the
  tiles that are masked entirely (a token never computes scores against other
  documents). The default on CUDA, where flex_attention runs compiled
  (`torch.compile`, once per process, on first use).
- "mask": SDPA with the explicit (b, 1, s, s) mask. The default elsewhere (CPU), and
  always with attention dropout (flex_attention has none).

The environment variable `MESHFORGE_ATTENTION` overrides the default: "mask" takes
the explicit mask on every device, "flex" takes flex_attention on every device (off
CUDA it runs eagerly, unfused, and forward only -- torch has no CPU backward for it:
for checking its numerics, as the tests do), "auto" (or unset) is the default above.
Both paths compute the same attention (tests/unit/test_flex_document_masking.py).

Without documents (`docs=None`) attention is SDPA with `is_causal=True`, exactly as
before: the default path is unchanged.

The attention modules of the models call `self.attend(q, k, v, docs, ...)`, which is
`attend` below unless a parallel layer gave the module its own (context parallelism,
parallel/context_parallel.py: the keys and values of the whole sequence gathered from
the other ranks). Such a layer builds the `Documents` too: `positions` those of the
tokens this rank holds, `mask` their queries against every key that its attend sees.
The models read `docs.positions` only, and hand `docs` on to attention.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

ATTENTION_ENV = "MESHFORGE_ATTENTION"  # flex | mask | auto: overrides attention_path


@dataclass(frozen=True)
class Documents:
    """The documents of a batch of packed sequences: `ids` (b, s) the document index of
    each token within its row, `positions` (b, s) its position inside its document,
    `mask` (b, 1, s, s) True where query t may attend key u (u <= t, same document).

    Under context parallelism (parallel/context_parallel.py) the s tokens are those of
    this rank, `positions` are theirs in the whole sequence (or in their document), and
    `mask` is (b or 1, 1, s, S): their queries against the S keys of the whole
    sequence, in the order the context-parallel attend gathers them."""

    ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor

    @functools.cached_property
    def block_mask(self) -> BlockMask:
        """FlexAttention's block mask of `ids` (`block_mask_of`): what `mask` says, by
        tiles. Built once, by `documents_of` on the "flex" path (else on first use, not
        under torch.compile), and shared by the layers. Not for `ContextDocuments`,
        whose attention is context parallelism's own attend."""
        return block_mask_of(self.ids)


def documents_of(idx: torch.Tensor, eot_id: int) -> Documents:
    """The documents of token ids `idx` (b, s), cut after each `eot_id` token. Their
    block mask is built too where attention takes the "flex" path (`attention_path`;
    with attention dropout it is then built but not used)."""
    s = idx.shape[1]
    ids, positions = document_ids(idx, eot_id)
    causal = torch.ones(s, s, dtype=torch.bool, device=idx.device).tril()
    mask = (ids[:, :, None] == ids[:, None, :]) & causal
    docs = Documents(ids=ids, positions=positions, mask=mask.unsqueeze(1))
    if attention_path(idx.device) == "flex":
        # built here, once, outside the blocks: a block compiled by train.compile reads it
        # (torch.compile cannot build a cached_property)
        _ = docs.block_mask
    return docs


def document_ids(idx: torch.Tensor, eot_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, positions), each (b, s): the document index of each token of `idx` (b, s)
    within its row, and its position inside its document (module docstring)."""
    b, s = idx.shape
    sep = (idx == eot_id).long()
    ids = sep.cumsum(dim=1) - sep  # separators strictly before t
    t = torch.arange(s, device=idx.device).expand(b, s)
    # a document starts at 0 and right after a separator; its first index, carried forward
    starts_here = torch.ones_like(sep, dtype=torch.bool)
    starts_here[:, 1:] = sep[:, :-1].bool()
    first = torch.where(starts_here, t, torch.zeros_like(t)).cummax(dim=1).values
    return ids, t - first


def block_mask_of(ids: torch.Tensor) -> BlockMask:
    """The FlexAttention block mask of document ids `ids` (b, s): query t may attend key
    u when u <= t and both are in the same document, as `Documents.mask`; one for all
    heads. On CUDA `create_block_mask` runs compiled (as torch advises for long
    sequences), elsewhere eagerly."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q_idx, kv_idx):  # flex_attention's mask_mod
        return (kv_idx <= q_idx) & (ids[b, q_idx] == ids[b, kv_idx])

    b, s = ids.shape
    build = _compiled("create_block_mask") if ids.is_cuda else create_block_mask
    return build(same_document_causal, B=b, H=None, Q_LEN=s, KV_LEN=s, device=ids.device)


def attention_path(device: torch.device, dropout_p: float = 0.0) -> str:
    """How `attend` computes attention with documents on `device` (module docstring):
    "flex" (flex_attention with `Documents.block_mask`) or "mask" (SDPA with
    `Documents.mask`). "mask" with attention dropout, which flex_attention lacks;
    otherwise `MESHFORGE_ATTENTION` ("flex", "mask", or "auto"/unset) and, for "auto",
    "flex" on CUDA where flex_attention imports, "mask" elsewhere."""
    choice = os.environ.get(ATTENTION_ENV, "auto") or "auto"
    if choice not in ("auto", "flex", "mask"):
        raise ValueError(f"{ATTENTION_ENV}={choice!r}: expected flex, mask or auto")
    if dropout_p > 0 or choice == "mask":
        return "mask"
    if choice == "flex":
        return "flex"
    return "flex" if torch.device(device).type == "cuda" and _flex_importable() else "mask"


@functools.cache
def _flex_importable() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _compiled(name: str) -> Callable:
    """flex_attention's `name` (flex_attention, create_block_mask) under torch.compile:
    compiled once per process, on first use (CUDA only)."""
    from torch.nn.attention import flex_attention as flex

    return torch.compile(getattr(flex, name))


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: Documents | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal scaled dot-product attention of q, k, v (b, heads, s, head_dim); with
    `docs`, each token attends only to earlier tokens of its own document. Grouped-query
    attention: k and v may have fewer heads (a divisor of q's); each is repeated for
    its group of query heads (`repeat_kv`), or, on the "flex" path, served in place
    (flex_attention's `enable_gqa`). With `docs`, `attention_path` picks flex_attention
    with the documents' block mask or SDPA with their explicit mask."""
    if docs is not None and attention_path(q.device, dropout_p) == "flex":
        return flex_attend(q, k, v, docs.block_mask)
    k, v = repeat_kv(q, k), repeat_kv(q, v)
    if docs is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=docs.mask, dropout_p=dropout_p)


def flex_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask
) -> torch.Tensor:
    """flex_attention of q, k, v (b, heads, s, head_dim; k and v may have fewer heads, a
    divisor of q's) under `block_mask`: compiled on CUDA, eager (unfused, forward only)
    elsewhere."""
    if q.is_cuda:
        flex_attention = _compiled("flex_attention")
    else:
        from torch.nn.attention.flex_attention import flex_attention
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


def repeat_kv(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Key or value heads `kv` (b, kv_heads, s, d) repeated for the query heads of `q`
    (b, heads, s, d): head j serves query heads j*g .. j*g+g-1, g = heads / kv_heads."""
    group = q.shape[1] // kv.shape[1]  # query heads per key/value head
    return kv.repeat_interleave(group, dim=1) if group > 1 else kv
