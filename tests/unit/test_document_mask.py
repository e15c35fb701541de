"""Document masking (data.document_masking): a token of a packed sequence sees only
its own document, at positions counted from that document's start."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshforge.models.attention import attend, documents_of
from meshforge.models.gpt import GPT, GPTArgs
from meshforge.models.llama import Llama, LlamaArgs

EOT = 9


def test_documents_of_counts_separators_before_each_token_and_restarts_positions():
    #              a  b EOT c EOT EOT d  e
    idx = torch.tensor([[1, 2, EOT, 3, EOT, EOT, 4, 5], [EOT, 1, 2, 3, 4, 5, 6, 7]])
    docs = documents_of(idx, EOT)
    assert docs.ids.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert docs.positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert docs.mask.shape == (2, 1, 8, 8)
    # causal within a document: token 4 (the separator ending doc 1) sees 3 and 4 only
    assert docs.mask[0, 0, 4].tolist() == [False, False, False, True, True] + [False] * 3


def test_a_sequence_without_separators_is_one_causal_document():
    docs = documents_of(torch.arange(6).view(1, 6), EOT)
    assert docs.ids.tolist() == [[0] * 6]
    assert docs.positions.tolist() == [list(range(6))]
    assert torch.equal(docs.mask[0, 0], torch.ones(6, 6, dtype=torch.bool).tril())


def test_attention_of_a_later_document_equals_that_document_alone():
    torch.manual_seed(0)
    idx = torch.tensor([[1, 2, EOT, 3, 4, EOT, 5, 6, 7]])  # doc 2 is tokens 6..8
    q, k, v = (torch.randn(1, 2, 9, 4) for _ in range(3))
    packed = attend(q, k, v, documents_of(idx, EOT))
    alone = attend(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:])
    torch.testing.assert_close(packed[:, :, 6:], alone, rtol=0, atol=1e-6)
    # and the mask does change what the earlier-document-blind tokens would see
    assert not torch.allclose(attend(q, k, v)[:, :, 6:], alone, atol=1e-3)


def test_without_documents_attention_is_plain_causal_sdpa():
    q, k, v = (torch.randn(2, 2, 5, 4) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(attend(q, k, v), want)


def _gpt() -> GPT:
    return GPT(GPTArgs(vocab_size=16, d_model=32, n_layers=2, n_heads=2, seq_len=16))


def _llama() -> Llama:
    args = LlamaArgs(
        vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16, ffn_hidden=64
    )
    return Llama(args)


def _token_losses(model, idx: torch.Tensor, docs=None) -> torch.Tensor:
    """Per-token cross-entropy of predicting idx[t+1] from idx[..t]."""
    logits = model(idx[:, :-1]) if docs is None else model(idx[:, :-1], docs=docs)
    return F.cross_entropy(logits.flatten(0, 1), idx[0, 1:], reduction="none")


@pytest.mark.parametrize("build", [_gpt, _llama], ids=["gpt", "llama"])
def test_each_packed_token_has_the_loss_of_its_document_alone(build):
    torch.manual_seed(1234)
    model = build().eval()
    doc_a = torch.tensor([1, 2, 3, 4, 5])
    doc_b = torch.tensor([6, 7, 8, 2, 1, 3])
    eot = torch.tensor([EOT])
    # inputs [docA, EOT, docB[:-1]] predict [docA[1:], EOT, docB]
    packed = torch.cat([doc_a, eot, doc_b]).view(1, -1)
    alone_a = torch.cat([doc_a, eot]).view(1, -1)
    with torch.no_grad():
        got = _token_losses(model, packed, documents_of(packed[:, :-1], EOT))
        want_a = _token_losses(model, alone_a)
        want_b = _token_losses(model, doc_b.view(1, -1))
        plain = _token_losses(model, packed)
    n_a = len(doc_a)  # targets docA[1:] and EOT: one per token of docA
    torch.testing.assert_close(got[:n_a], want_a, rtol=0, atol=1e-5)
    # the separator predicts docB's first token: no document-alone counterpart; the rest do
    torch.testing.assert_close(got[n_a + 1 :], want_b, rtol=0, atol=1e-5)
    # without documents, docB's tokens see docA: the losses differ
    assert not torch.allclose(plain[n_a + 1 :], want_b, atol=1e-4)


@pytest.mark.parametrize("build", [_gpt, _llama], ids=["gpt", "llama"])
def test_a_row_without_separators_gives_the_same_logits_as_no_documents(build):
    """One document covering the row gives the same logits as no documents."""
    torch.manual_seed(7)
    model = build().eval()
    idx = torch.randint(0, 8, (2, 12))  # ids below EOT: no separator
    with torch.no_grad():
        plain = model(idx)
        masked = model(idx, docs=documents_of(idx, EOT))
    torch.testing.assert_close(masked, plain, rtol=0, atol=1e-5)
