"""Document masking through FlexAttention (models/attention.py, `attention_path`): the
block-mask path computes what the explicit-mask path does, and is taken on CUDA only
unless MESHFORGE_ATTENTION says otherwise.

On CPU flex_attention runs eagerly (unfused) and forward only -- torch has no CPU
backward for it -- so the CPU tests compare outputs under no_grad; the gradient test
needs CUDA (scripts/gpu_check.sh runs the same comparison on a GPU)."""

from __future__ import annotations

import pytest
import torch
from test_document_mask import _gpt, _llama, _token_losses

from meshforge.models.attention import (
    ATTENTION_ENV,
    attend,
    attention_path,
    documents_of,
)
from meshforge.models.registry import blocks_of

EOT = 9

# eager flex_attention off CUDA says once that it is unfused: expected here
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# two rows of several documents each (one row starts with a separator), 37 tokens: not a
# multiple of flex_attention's 128-token tiles
ROWS = torch.tensor(
    [
        [1, 2, 3, EOT, 4, 5, 6, 7, 8, EOT, EOT, 1, 2] + [3, 4, 5, 6, 7, EOT] * 4,
        [EOT, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, EOT] + [1, 2, 3] * 6,
    ]
)


def _qkv(heads: int, kv_heads: int, device: str = "cpu", grad: bool = False):
    g = torch.Generator().manual_seed(0)
    b, s, d = ROWS.shape[0], ROWS.shape[1], 8
    shapes = [(b, heads, s, d), (b, kv_heads, s, d), (b, kv_heads, s, d)]
    return [torch.randn(*sh, generator=g).to(device).requires_grad_(grad) for sh in shapes]


def test_the_explicit_mask_is_the_default_on_cpu_and_flex_on_cuda(monkeypatch):
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    assert attention_path(torch.device("cpu")) == "mask"
    assert attention_path(torch.device("cuda")) == "flex"
    assert attention_path(torch.device("cuda"), dropout_p=0.1) == "mask"  # flex: no dropout


def test_the_environment_overrides_the_path_but_not_dropout(monkeypatch):
    monkeypatch.setenv(ATTENTION_ENV, "flex")
    assert attention_path(torch.device("cpu")) == "flex"
    assert attention_path(torch.device("cpu"), dropout_p=0.1) == "mask"
    monkeypatch.setenv(ATTENTION_ENV, "mask")
    assert attention_path(torch.device("cuda")) == "mask"
    monkeypatch.setenv(ATTENTION_ENV, "auto")
    assert attention_path(torch.device("cpu")) == "mask"
    monkeypatch.setenv(ATTENTION_ENV, "fast")
    with pytest.raises(ValueError, match="MESHFORGE_ATTENTION='fast'"):
        attention_path(torch.device("cpu"))


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_flex_attention_of_packed_documents_equals_the_explicit_mask(monkeypatch, kv_heads):
    docs = documents_of(ROWS, EOT)
    q, k, v = _qkv(4, kv_heads)
    with torch.no_grad():
        monkeypatch.setenv(ATTENTION_ENV, "mask")
        want = attend(q, k, v, docs)
        monkeypatch.setenv(ATTENTION_ENV, "flex")
        got = attend(q, k, v, docs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert docs.block_mask is docs.block_mask  # built once, shared by the layers


def test_documents_of_builds_the_block_mask_on_the_flex_path_only(monkeypatch):
    monkeypatch.setenv(ATTENTION_ENV, "flex")
    assert "block_mask" in vars(documents_of(ROWS, EOT))  # before any (compiled) block
    monkeypatch.setenv(ATTENTION_ENV, "mask")
    assert "block_mask" not in vars(documents_of(ROWS, EOT))


def test_attention_dropout_keeps_the_explicit_mask_under_flex(monkeypatch):
    docs = documents_of(ROWS, EOT)
    q, k, v = _qkv(4, 2)
    monkeypatch.setenv(ATTENTION_ENV, "mask")
    torch.manual_seed(3)
    want = attend(q, k, v, docs, dropout_p=0.5)
    monkeypatch.setenv(ATTENTION_ENV, "flex")
    torch.manual_seed(3)
    got = attend(q, k, v, docs, dropout_p=0.5)
    assert torch.equal(got, want)
    assert "block_mask" not in vars(docs)  # never built


@pytest.mark.parametrize("build", [_gpt, _llama], ids=["gpt", "llama"])
def test_under_flex_each_packed_token_has_the_loss_of_its_document_alone(monkeypatch, build):
    torch.manual_seed(1234)
    model = build().eval()
    doc_a = torch.tensor([1, 2, 3, 4, 5])
    doc_b = torch.tensor([6, 7, 8, 2, 1, 3])
    packed = torch.cat([doc_a, torch.tensor([EOT]), doc_b]).view(1, -1)
    alone_a = torch.cat([doc_a, torch.tensor([EOT])]).view(1, -1)
    with torch.no_grad():
        want_a = _token_losses(model, alone_a)  # no documents: plain causal SDPA
        want_b = _token_losses(model, doc_b.view(1, -1))
        monkeypatch.setenv(ATTENTION_ENV, "mask")
        masked = _token_losses(model, packed, documents_of(packed[:, :-1], EOT))
        monkeypatch.setenv(ATTENTION_ENV, "flex")
        got = _token_losses(model, packed, documents_of(packed[:, :-1], EOT))
    n_a = len(doc_a)
    torch.testing.assert_close(got[:n_a], want_a, rtol=0, atol=1e-5)
    torch.testing.assert_close(got[n_a + 1 :], want_b, rtol=0, atol=1e-5)
    torch.testing.assert_close(got, masked, rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's backward: CUDA")
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_flex_gradients_equal_the_explicit_mask_on_cuda(monkeypatch, kv_heads):
    docs = documents_of(ROWS.cuda(), EOT)
    grads = {}
    for path in ("mask", "flex"):
        monkeypatch.setenv(ATTENTION_ENV, path)
        q, k, v = _qkv(4, kv_heads, device="cuda", grad=True)
        out = attend(q, k, v, docs)
        out.backward(torch.ones_like(out))
        grads[path] = (out.detach(), q.grad, k.grad, v.grad)
    for got, want in zip(grads["flex"], grads["mask"], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_block_compiled_by_train_compile_takes_the_flex_path_in_one_graph(monkeypatch):
    """train.compile compiles each block: the flex path traces without a graph break
    (the block mask already built by documents_of). Dynamo's eager backend: no codegen."""
    monkeypatch.setenv(ATTENTION_ENV, "flex")
    torch.manual_seed(5)
    model = _llama().eval()
    idx = ROWS[:1, :16]
    with torch.no_grad():
        want = model(idx, docs=documents_of(idx, EOT))
        for block in blocks_of(model):  # as parallelize does under train.compile
            block.compile(backend="eager", fullgraph=True)
        got = model(idx, docs=documents_of(idx, EOT))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
