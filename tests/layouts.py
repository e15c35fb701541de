"""The training engine run in-process on the shared gloo pool: one function per rank
that trains a job for some steps under any layout, optionally saving or resuming a
checkpoint, and returns the losses and parameter digests. Used by the layout tests
(no CLI, no run directory: the loop below is the trainer's, minus its I/O)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# The tiny GPT of the parity tests: 4 layers, so pp=2 (x2 virtual stages) splits it.
TINY4: dict[str, Any] = {
    "model": {"vocab_size": 256, "d_model": 32, "n_layers": 4, "n_heads": 4, "seq_len": 32,
              "tie_embeddings": False},
    "data": {"source": "builtin:python-stdlib"},
    "precision": {"dtype": "fp32"},
    "train": {"global_batch": 8, "micro_batch": 2, "lr": 3.0e-3, "warmup": 5, "seed": 7,
              "steps": 20, "eval_every": 0},
}  # fmt: skip

_TOKENS: dict[str, Any] = {}


def job(parallel: dict[str, Any], **sections: dict[str, Any]) -> dict[str, Any]:
    raw = copy.deepcopy(TINY4)
    raw["parallel"] = dict(parallel)
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def assert_same_losses(got: dict[int, float], ref: dict[int, float], what: str, rel: float):
    """Every step of `ref` in `got`, within `rel` (relative)."""
    import pytest

    assert sorted(got) == sorted(ref), what
    for step in sorted(ref):
        assert got[step] == pytest.approx(ref[step], rel=rel), (
            f"{what} step {step}: {got[step]} vs world-1 {ref[step]}"
        )


def _tokens(source: str):
    if source not in _TOKENS:  # the workers live for the session: load the corpus once
        from meshforge.data.corpus import load_tokens

        _TOKENS[source] = load_tokens(source, 0.05).train
    return _TOKENS[source]


def step_batches(cfg: Any, engine: Any, step: int) -> list[Any]:
    """This rank's micro-batches of `step`, as the trainer's loader hands them."""
    from meshforge.data.loader import rank_micro_batches

    t = cfg.train
    return rank_micro_batches(
        _tokens(cfg.data.source), seq_len=cfg.model.seq_len, global_batch=t.global_batch,
        micro_batch=t.micro_batch, dp_rank=engine.dp_rank, dp_size=engine.dims.dp,
        seed=t.seed, step=step,
    )  # fmt: skip


def train_layout(
    raw: dict[str, Any],
    steps: int,
    ckpt_root: str | None = None,
    save_at: int | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Run on every rank of the pool. Returns (on every rank) the mean loss of each
    step trained, and on rank 0 the parameter digests after loading / when saving."""
    from meshforge.config import build_config
    from meshforge.train.checkpoint import Checkpointer
    from meshforge.train.engine import Engine

    cfg = build_config(raw)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.train.seed)
    engine = Engine.build(cfg, rank, world, torch.device("cpu"))
    dims = engine.dims
    checkpointer = None
    if ckpt_root is not None:
        checkpointer = Checkpointer(Path(ckpt_root), engine.optimizers, keep=3)
    out: dict[str, Any] = {
        "losses": {},
        "layout": dims.as_dict(),
        "microbatches": dims.microbatches,
    }
    start = 0
    if resume:
        assert checkpointer is not None
        state = checkpointer.resume(rank == 0)
        assert state is not None, "no checkpoint to resume from"
        start = int(state["step"])
        out["digest_loaded"] = engine.param_digest()
    for step in range(start, steps):
        micro_batches = []  # a parameter server reads no data
        if engine.reads_data:
            micro_batches = step_batches(cfg, engine, step)
        result = engine.strategy.step(step, micro_batches, measure=False)
        loss = engine.strategy.reduce_loss(result.loss_sum / dims.microbatches).item()
        if step + 1 == steps:  # what the trainer reports: the states held after a step
            out["state_bytes"] = _state_bytes(engine)
        engine.optimizers.zero_grad()
        out["losses"][step + 1] = loss
        if checkpointer is not None and save_at == step + 1:
            checkpointer.save(step + 1, {"step": step + 1, "world_size": world})
            out["digest_saved"] = engine.param_digest()
    out["digest_final"] = engine.param_digest()
    out["param_names"] = sorted(name for name, _ in engine.parts.named_parameters())
    out["server_counters"] = engine.strategy.server_counters()  # a parameter server's
    return out


def _state_bytes(engine: Any) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer states (as
    Trainer.model_state_bytes counts them), and the model's parameter count."""
    from meshforge.observe.memory import tensor_bytes

    params = list(engine.parts.parameters())
    out = {
        "params": tensor_bytes(params),
        "grads": tensor_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer": tensor_bytes(engine.optimizers.state_bytes()),
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    out["n_params"] = engine.parts.n_params
    return out


def activation_bytes(raw: dict[str, Any]) -> int:
    """Bytes autograd saves for backward in one micro-batch's forward under `raw`'s
    layout (this rank's), measured with SavedActivations."""
    from meshforge.config import build_config
    from meshforge.data.loader import rank_micro_batches
    from meshforge.observe.memory import SavedActivations
    from meshforge.train.engine import Engine
    from meshforge.train.step import cross_entropy

    cfg = build_config(raw)
    torch.manual_seed(cfg.train.seed)
    engine = Engine.build(cfg, dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    (x, y), *_ = rank_micro_batches(
        _tokens(cfg.data.source),
        seq_len=cfg.model.seq_len,
        global_batch=cfg.train.global_batch,
        micro_batch=cfg.train.micro_batch,
        dp_rank=engine.dp_rank,
        dp_size=engine.dims.dp,
        seed=cfg.train.seed,
        step=0,
    )
    strategy = engine.strategy
    with strategy.loss_context():
        with SavedActivations() as saved:
            loss = cross_entropy(engine.parts.callables[0](x), y)
        loss.backward()
    return saved.bytes


def build_peak_bytes(raw: dict[str, Any], full_model: bool) -> int:
    """Peak growth of this process's resident memory while building the model: the
    engine's way (meta device, cut, shard, then initialise this rank's slice), or
    (full_model) a whole GPT built and initialised on the CPU (helpers.peak_rss_growth)."""
    from helpers import peak_rss_growth
    from meshforge.config import build_config
    from meshforge.models.gpt import GPT
    from meshforge.models.registry import model_args
    from meshforge.parallel.mesh import build_mesh
    from meshforge.parallel.parallelize import build_model_parts

    cfg = build_config(raw)
    # warm up on a tiny model: the first build imports modules and makes groups, whose
    # memory is not the model's
    tiny = build_config({**raw, "model": {**raw["model"], "d_model": 32, "n_layers": 2,
                                          "n_heads": 2}})  # fmt: skip
    dims = tiny.dims(dist.get_world_size())
    build_model_parts(tiny, dims, build_mesh(dims, torch.device("cpu")), torch.device("cpu"))
    GPT(model_args(tiny.model))
    grown: list[int] = []
    with peak_rss_growth(grown):
        if full_model:
            model = GPT(model_args(cfg.model))
        else:
            dims = cfg.dims(dist.get_world_size())
            model = build_model_parts(
                cfg, dims, build_mesh(dims, torch.device("cpu")), torch.device("cpu")
            )
    del model
    return grown[0]


def digest_at_build(raw: dict[str, Any], measure: bool = False) -> tuple[str, int | None]:
    """The engine's parameter digest right after the build (every layout initialises
    the same parameters from the seed), and with `measure` the growth of this process's
    peak resident memory while it is computed (helpers.peak_rss_growth)."""
    from helpers import peak_rss_growth
    from meshforge.config import build_config
    from meshforge.train.engine import Engine

    cfg = build_config(raw)
    torch.manual_seed(cfg.train.seed)
    engine = Engine.build(cfg, dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    if not measure:
        return engine.param_digest(), None
    grown: list[int] = []
    with peak_rss_growth(grown):
        digest = engine.param_digest()
    return digest, grown[0]
