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
down to every block; it holds the boolean mask (causal AND same document) so that
layers share it. Attention is then SDPA with that explicit mask, on every device: a
FlexAttention block mask would skip the masked tiles on CUDA, but is not used here
(it needs torch.compile to run well and cannot be tested on CPU).

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

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def documents_of(idx: torch.Tensor, eot_id: int) -> Documents:
    """The documents of token ids `idx` (b, s), cut after each `eot_id` token."""
    s = idx.shape[1]
    ids, positions = document_ids(idx, eot_id)
    causal = torch.ones(s, s, dtype=torch.bool, device=idx.device).tril()
    mask = (ids[:, :, None] == ids[:, None, :]) & causal
    return Documents(ids=ids, positions=positions, mask=mask.unsqueeze(1))


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
    its group of query heads (`repeat_kv`)."""
    k, v = repeat_kv(q, k), repeat_kv(q, v)
    if docs is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=docs.mask, dropout_p=dropout_p)


def repeat_kv(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Key or value heads `kv` (b, kv_heads, s, d) repeated for the query heads of `q`
    (b, heads, s, d): head j serves query heads j*g .. j*g+g-1, g = heads / kv_heads."""
    group = q.shape[1] // kv.shape[1]  # query heads per key/value head
    return kv.repeat_interleave(group, dim=1) if group > 1 else kv
