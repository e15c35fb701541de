"""Context parallelism's split (parallel/context_parallel.py) and its layout rules: each
cp rank keeps a chunk from each end of every sequence, and its queries against the
gathered keys, under its mask, give exactly world 1's attention at its positions; so
does alltoall (Ulysses), each rank's heads over the whole sequence. The cp ranks run
as threads here; the collectives themselves run in
tests/integration/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshforge.config import build_config
from meshforge.errors import ConfigError
from meshforge.layout import JOB_NAMES, LayoutRequest, ModelShape, check, derive
from meshforge.models.attention import documents_of
from meshforge.models.gpt import GPT, GPTArgs
from meshforge.parallel.context_parallel import (
    ContextSplit,
    apply_context_parallel,
    attention_modules,
    chunk_positions,
    key_positions,
)

EOT = 9
SHAPE = ModelShape(n_layers=4, d_model=64, n_heads=4, kv_heads=4, mlp_hidden=256,
                   vocab_size=256, seq_len=32)  # fmt: skip


def test_head_tail_chunks_cover_every_position_once_with_balanced_causal_work():
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert key_positions(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    for cp in (1, 2, 4):
        ranks = [chunk_positions(64, cp, r) for r in range(cp)]
        assert sorted(torch.cat(ranks).tolist()) == list(range(64))
        # causal work of a query at position t: t + 1 keys; the same on every rank
        work = {int((pos + 1).sum()) for pos in ranks}
        assert len(work) == 1, (cp, work)
    with pytest.raises(ValueError, match="not divisible by 2 x cp = 4"):
        chunk_positions(10, 2, 0)


def _tokens(b: int, s: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 12, (b, s), generator=g)  # EOT=9 appears: several documents


class _GivenKV:
    """An AllGatherAttend whose all-gather hands back `kv`, every rank's K and V."""

    def __new__(cls, kv: torch.Tensor):
        from meshforge.parallel.context_parallel import AllGatherAttend

        class Given(AllGatherAttend):
            def gather(self, t):
                assert t.shape[0] * self.size == kv.shape[0]
                return kv

        attend = Given(group=None)  # type: ignore[arg-type]
        return attend


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("masking", [False, True], ids=["causal", "documents"])
def test_local_queries_against_gathered_keys_equal_world_1_attention(cp, masking):
    torch.manual_seed(0)
    b, h, s, d = 2, 3, 16, 8
    x = _tokens(b, s, seed=1)
    y = torch.roll(x, -1, dims=1)
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    if masking:
        ref_docs = documents_of(x, EOT)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=ref_docs.mask)
        ref_positions = ref_docs.positions
    else:
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ref_positions = torch.arange(s).expand(b, s)
    w = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    keys = key_positions(s, cp)
    seen = torch.zeros(b, s, dtype=torch.long)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(cp):
        xs, ys, docs = ContextSplit(rank, cp).shard(x, y, EOT if masking else None)
        mine = chunk_positions(s, cp, rank)
        assert torch.equal(xs, x[:, mine]) and torch.equal(ys, y[:, mine])
        assert torch.equal(docs.positions, ref_positions[:, mine])
        assert (docs.mask is not None) == masking  # plain causal: no mask at all
        # what the all-gather hands every rank: (S, 2, b, h, d), the keys in rank order
        attend = _GivenKV(torch.stack((k, v)).permute(3, 0, 1, 2, 4)[keys])
        attend.size = cp
        out = attend(q[:, :, mine], k[:, :, mine], v[:, :, mine], docs)
        torch.testing.assert_close(out, ref[:, :, mine], rtol=1e-5, atol=1e-6)
        mine_grads = torch.autograd.grad((out * w[:, :, mine]).sum(), (q, k, v))
        for total, g in zip(grads, mine_grads, strict=True):
            total += g
        seen[:, mine] += 1
    assert torch.equal(seen, torch.ones(b, s, dtype=torch.long))  # the loss covers each once
    for g, ref_g in zip(grads, ref_grads, strict=True):  # block by block, or masked
        torch.testing.assert_close(g, ref_g, rtol=1e-4, atol=1e-5)


def test_the_model_keeps_its_attend_until_context_parallelism_swaps_it():
    model = GPT(GPTArgs(vocab_size=32, d_model=16, n_layers=2, n_heads=2, seq_len=8))
    layers = attention_modules(model)
    assert len(layers) == 2  # one per block; the model itself names no cp

    class FakeMesh:
        def get_group(self):
            return "cp-group"

    apply_context_parallel(model, FakeMesh(), "allgather")  # type: ignore[arg-type]
    assert all(m.attend.group == "cp-group" for m in layers)
    assert attention_modules(model) == []  # swapped
    ulysses = GPT(GPTArgs(vocab_size=32, d_model=16, n_layers=2, n_heads=2, seq_len=8))
    apply_context_parallel(ulysses, FakeMesh(), "alltoall")  # type: ignore[arg-type]
    assert {type(m.attend).__name__ for m in ulysses.modules() if hasattr(m, "attend")} == {
        "AllToAllAttend"
    }
    with pytest.raises(ValueError, match="cp_method=ring is not built"):
        apply_context_parallel(ulysses, FakeMesh(), "ring")  # type: ignore[arg-type]
    fresh = GPT(GPTArgs(vocab_size=32, d_model=16, n_layers=2, n_heads=2, seq_len=8))
    assert len(attention_modules(fresh)) == 2  # an instance's attend, not the class's


# -- the layout rules ------------------------------------------------------------------------


def test_cp_is_a_mesh_dimension_of_its_own_between_dp_and_tp():
    req = LayoutRequest(cp=2, tp=2, global_batch=8, micro_batch=2)
    dims = derive(req, SHAPE, world_size=8)
    assert (dims.dp, dims.cp, dims.tp, dims.world_size, dims.microbatches) == (2, 2, 2, 8, 2)
    assert dims.mesh_layout() == (("pp", "dp", "cp", "tp"), (1, 2, 2, 2))
    # rank = tp + tp * (cp + cp * dp)
    assert dims.coords(5) == {"tp": 1, "cp": 0, "dp": 1, "pp": 0}
    assert dims.coords(2) == {"tp": 0, "cp": 1, "dp": 0, "pp": 0}
    assert dims.as_dict()["cp"] == 2 and dims.as_dict()["cp_method"] == "allgather"
    plain = derive(LayoutRequest(global_batch=8, micro_batch=2), SHAPE, world_size=2)
    assert "cp" not in plain.as_dict() and plain.mesh_layout() == (("pp", "dp", "tp"), (1, 2, 1))
    with pytest.raises(ConfigError, match="world size 6 is not divisible by parallel.tp=2 x "
                                          "parallel.pp=1 x parallel.cp=2 = 4"):  # fmt: skip
        derive(req, SHAPE, world_size=6)


@pytest.mark.parametrize(
    ("req", "shape", "words"),
    [
        (LayoutRequest(cp=3), SHAPE, ["parallel.cp=3 needs model.seq_len=32", "2 x cp = 6"]),
        (LayoutRequest(cp=2, cp_method="ring"), SHAPE, ["parallel.cp_method=ring", "CUDA"]),
        (
            LayoutRequest(cp=4, tp=2, cp_method="alltoall"),
            SHAPE,
            [
                "parallel.cp_method=alltoall needs model.n_heads=4 / parallel.tp=2 divisible by "
                "parallel.cp=4"
            ],
        ),  # fmt: skip
        (
            LayoutRequest(cp=4, cp_method="alltoall"),
            ModelShape(**{**SHAPE.__dict__, "n_heads": 2, "kv_heads": 1}),
            ["parallel.cp_method=alltoall needs model.n_heads=2 divisible by parallel.cp=4"],
        ),
        (LayoutRequest(cp=2, servers=1), SHAPE, ["parallel.cp=2 with parallel.mode"]),
        (LayoutRequest(cp=2, compile=True), SHAPE, ["train.compile=true", "parallel.cp=2"]),
        (
            LayoutRequest(cp=2),
            ModelShape(**{**SHAPE.__dict__, "experts": 4}),
            ["parallel.cp=2 with a mixture-of-experts model"],
        ),
        (LayoutRequest(cp=2), ModelShape(factory="m:f"), ["parallel.cp=2 needs meshforge's"]),
    ],
    ids=[
        "seq-len",
        "ring",
        "alltoall-tp-heads",
        "alltoall-heads",
        "parameter-server",
        "compile",
        "moe",
        "factory",
    ],
)
def test_what_cp_cannot_run_is_refused_naming_the_fields(req, shape, words):
    problems = check(req, shape, JOB_NAMES)
    assert any(all(w in p for w in words) for p in problems), problems


def test_cp_under_a_pipeline_is_accepted():
    problems = check(LayoutRequest(cp=2, pp=2), SHAPE, JOB_NAMES, world_size=4)
    assert not [p for p in problems if "cp" in p], problems


@pytest.mark.parametrize(
    ("req", "kv_heads"),
    [
        (LayoutRequest(cp=2, cp_method="alltoall"), 4),
        (LayoutRequest(cp=4, cp_method="alltoall"), 1),  # kv heads repeated before the exchange
        (LayoutRequest(cp=2, tp=2, cp_method="alltoall"), 2),
    ],
    ids=["cp2", "cp4-gqa1", "tp2xcp2"],
)
def test_alltoall_runs_where_cp_divides_a_tensor_parallel_ranks_heads(req, kv_heads):
    shape = ModelShape(**{**SHAPE.__dict__, "kv_heads": kv_heads})
    assert check(req, shape, JOB_NAMES) == []


def test_the_job_file_carries_cp_and_its_method():
    raw = {
        "model": {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 32},
        "train": {"global_batch": 8, "micro_batch": 2},
        "parallel": {"cp": 2},
    }
    cfg = build_config(raw)
    assert (cfg.parallel.cp, cfg.parallel.cp_method) == (2, "allgather")
    dims = cfg.dims(4)
    assert (dims.dp, dims.cp) == (2, 2)
    ulysses = build_config({**raw, "parallel": {"cp": 2, "cp_method": "alltoall"}}).dims(2)
    assert ulysses.as_dict()["cp_method"] == "alltoall"
    with pytest.raises(ConfigError, match="parallel.cp_method=ring runs on CUDA"):
        build_config({**raw, "parallel": {"cp": 2, "cp_method": "ring"}}).dims(2)


# -- the whole model, its cp ranks as threads --------------------------------------------------


class _ThreadGroup:
    """cp ranks as threads of this process: an all-gather (and, backward, a reduce-
    scatter) exchanging tensors through a barrier, as the gloo collective would."""

    def __init__(self, size: int) -> None:
        import threading

        self.size = size
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size)

    def exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.barrier.wait()  # everyone has read the previous exchange
        self.slots[rank] = t
        self.barrier.wait()
        return list(self.slots)  # type: ignore[arg-type]


class _ThreadGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group, rank):
        ctx.group, ctx.rank = group, rank
        return torch.cat(group.exchange(rank, t.detach().clone()))

    @staticmethod
    def backward(ctx, grad):
        blocks = ctx.group.exchange(ctx.rank, grad.detach().clone())
        mine = [b.chunk(ctx.group.size)[ctx.rank] for b in blocks]
        return torch.stack(mine).sum(0), None, None


class _ThreadAllToAll(torch.autograd.Function):
    """All-to-all of (cp, ...) blocks: block j to rank j; backward, the reverse."""

    @staticmethod
    def forward(ctx, t, group, rank):
        ctx.group, ctx.rank = group, rank
        return torch.stack([b[rank] for b in group.exchange(rank, t.detach().clone())])

    @staticmethod
    def backward(ctx, grad):
        blocks = ctx.group.exchange(ctx.rank, grad.detach().clone())
        return torch.stack([b[ctx.rank] for b in blocks]), None, None


def _threaded_attend(group: _ThreadGroup, rank: int, method: str = "allgather"):
    from meshforge.parallel.context_parallel import AllGatherAttend, AllToAllAttend

    class ThreadGatherAttend(AllGatherAttend):
        def gather(self, t):
            return _ThreadGather.apply(t, group, rank)

    class ThreadAllToAllAttend(AllToAllAttend):
        def exchange(self, t):
            assert t.shape[0] == group.size
            return _ThreadAllToAll.apply(t, group, rank)

    cls = {"allgather": ThreadGatherAttend, "alltoall": ThreadAllToAllAttend}[method]
    return cls(group=None)  # type: ignore[arg-type]


def _run_threads(cp: int, rank_main) -> None:
    """rank_main(rank, group) on cp threads; the first error of any is raised."""
    import threading

    group = _ThreadGroup(cp)
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            rank_main(rank, group)
        except BaseException as exc:  # reported below
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa2", "gqa1"])
@pytest.mark.parametrize("masking", [False, True], ids=["causal", "documents"])
def test_alltoall_attention_on_cp_threads_equals_world_1_attention(cp, kv_heads, masking):
    """Ulysses: each rank's h/cp heads over the whole sequence, exchanged and back, give
    world 1's attention at its tokens, and (summed over the ranks) its gradients;
    grouped-query heads travel unrepeated where cp divides them (gqa2 under cp 2),
    repeated first where not (gqa2 under cp 4, gqa1)."""
    torch.manual_seed(0)
    b, h, s, d = 2, 4, 16, 8
    x = _tokens(b, s, seed=1)
    y = torch.roll(x, -1, dims=1)
    q = torch.randn(b, h, s, d, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, s, d, requires_grad=True) for _ in range(2))
    group_size = h // kv_heads
    k_rep, v_rep = (t.repeat_interleave(group_size, dim=1) for t in (k, v))
    if masking:
        ref = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=documents_of(x, EOT).mask)
    else:
        ref = F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)
    w = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    outs: dict[int, torch.Tensor] = {}
    grads: dict[int, tuple[torch.Tensor, ...]] = {}

    def rank_main(rank: int, group: _ThreadGroup) -> None:
        _, _, docs = ContextSplit(rank, cp).shard(x, y, EOT if masking else None)
        mine = chunk_positions(s, cp, rank)
        attend = _threaded_attend(group, rank, "alltoall")
        out = attend(q[:, :, mine], k[:, :, mine], v[:, :, mine], docs)
        outs[rank] = out.detach()
        grads[rank] = torch.autograd.grad((out * w[:, :, mine]).sum(), (q, k, v))

    _run_threads(cp, rank_main)
    for rank in range(cp):
        mine = chunk_positions(s, cp, rank)
        torch.testing.assert_close(outs[rank], ref[:, :, mine], rtol=1e-5, atol=1e-6)
    for i, ref_g in enumerate(ref_grads):
        total = sum(grads[rank][i] for rank in range(cp))
        torch.testing.assert_close(total, ref_g, rtol=1e-4, atol=1e-5)


def test_alltoall_refuses_heads_the_cp_ranks_cannot_split():
    from meshforge.models.attention import Documents
    from meshforge.parallel.context_parallel import AllToAllAttend

    attend = AllToAllAttend(group=None)  # type: ignore[arg-type]
    x = _tokens(1, 8, seed=0)
    _, _, docs = ContextSplit(0, 4).shard(x, x)
    q = torch.randn(1, 2, 2, 4)
    with pytest.raises(ValueError, match="2 heads on this rank, not divisible by cp 4"):
        attend(q, q, q, docs)
    with pytest.raises(RuntimeError, match="ContextDocuments"):
        attend(q, q, q, Documents(x, x, None))  # type: ignore[arg-type]


def _models():
    from meshforge.models.llama import Llama, LlamaArgs

    gpt = GPTArgs(
        vocab_size=16, d_model=16, n_layers=2, n_heads=2, seq_len=16, tie_embeddings=False
    )
    llama = LlamaArgs(vocab_size=16, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                      seq_len=16, ffn_hidden=32)  # fmt: skip
    return {"gpt": lambda: GPT(gpt), "llama": lambda: Llama(llama)}


@pytest.mark.parametrize("method", ["allgather", "alltoall"])
@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("masking", [False, True], ids=["causal", "documents"])
def test_cp_ranks_as_threads_give_world_1s_loss_and_gradients(model, masking, method):
    from meshforge.train.step import cross_entropy

    cp, s = 2, 16
    build = _models()[model]
    x = _tokens(2, s, seed=3)
    y = _tokens(2, s, seed=4)
    torch.manual_seed(0)
    ref_model = build()
    eot = EOT if masking else None
    docs = documents_of(x, EOT) if masking else None
    ref_loss = cross_entropy(ref_model(x, docs=docs), y)
    ref_loss.backward()

    results: dict[int, tuple[float, dict[str, torch.Tensor]]] = {}

    def rank_main(rank: int, group: _ThreadGroup) -> None:
        torch.manual_seed(0)
        m = build()
        for layer in attention_modules(m):
            layer.attend = _threaded_attend(group, rank, method)
        xs, ys, d = ContextSplit(rank, cp).shard(x, y, eot)
        loss = cross_entropy(m(xs, docs=d), ys)
        loss.backward()
        results[rank] = (loss.item(), {n: p.grad for n, p in m.named_parameters()})

    _run_threads(cp, rank_main)
    # the mean of the ranks' losses is world 1's; so is the mean of their gradients
    mean_loss = sum(results[r][0] for r in range(cp)) / cp
    assert mean_loss == pytest.approx(ref_loss.item(), rel=1e-5)
    for name, p in ref_model.named_parameters():
        mean_grad = sum(results[r][1][name] for r in range(cp)) / cp
        torch.testing.assert_close(mean_grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
