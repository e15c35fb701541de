"""Which model a job builds: meshforge's GPT (`model.name: gpt`), the Llama-style
decoder (`llama`), or a user's factory (`model.name: package.module:function`,
called with `model.kwargs`).

A factory's contract: it returns an `nn.Module` whose forward maps token ids
(b, s) to logits (b, s, model.vocab_size). Data parallel and ZeRO place it as they
are; its `blocks` (an nn.ModuleDict or nn.ModuleList, when it has one) become FSDP
units and activation-checkpointing units. Tensor parallelism needs `model.tp_plan`,
a function called as `plan(model, tp_mesh, sequence_parallel=..., loss_parallel=...)`
that shards the model in place (DTensor's `parallelize_module`), as
models/tensor_parallel.py does for meshforge's own models. Pipeline parallelism
needs meshforge's stage layout: attributes `embed`, `blocks` (nn.ModuleDict keyed
by layer index), `ln_f` and `head`, any of which a stage may set to None, and a
forward that skips what is None.

Factories are imported from the directory meshforge runs in (or PYTHONPATH).

meshforge's own models take their own arguments (GPTArgs, LlamaArgs); `model_args`
is the one place that translates a job's `model:` section into them.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshforge.config import JobConfig, ModelConfig
from meshforge.errors import ConfigError
from meshforge.models.gpt import GPT, DecoderLM, GPTArgs
from meshforge.models.llama import Llama, LlamaArgs
from meshforge.models.moe import MoEArgs


def model_args(cfg: ModelConfig) -> GPTArgs | LlamaArgs:
    """The arguments of the meshforge model that `cfg` names."""
    if cfg.is_factory:
        raise ConfigError(f"model.name={cfg.name} is a user's factory, not a meshforge model")
    if cfg.name == "llama":
        return LlamaArgs(
            vocab_size=cfg.vocab_size,
            d_model=cfg.d_model,
            n_layers=cfg.n_layers,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.kv_heads,
            seq_len=cfg.seq_len,
            ffn_hidden=cfg.mlp_hidden,
            rope_theta=cfg.rope_theta,
            norm_eps=cfg.norm_eps,
            tie_embeddings=cfg.tie_embeddings,
            head_dim=cfg.head_dim,
            moe=MoEArgs(**cfg.moe.model_dump()) if cfg.moe is not None else None,
        )
    return GPTArgs(
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        seq_len=cfg.seq_len,
        mlp_ratio=cfg.mlp_ratio,
        dropout=cfg.dropout,
        tie_embeddings=cfg.tie_embeddings,
    )


def family_model(cfg: ModelConfig) -> DecoderLM:
    """The meshforge model (GPT or Llama) that `cfg` names, built on the current
    default device; ConfigError for a user's factory."""
    args = model_args(cfg)
    return Llama(args) if isinstance(args, LlamaArgs) else GPT(args)


def import_object(spec: str, field: str) -> Any:
    """`package.module:attribute`, imported; ConfigError naming `field` otherwise."""
    module_name, _, attr = spec.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path:  # a console script's sys.path lacks the working directory
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raised on import
        raise ConfigError(
            f"{field}={spec}: cannot import {module_name} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{field}={spec}: {module_name} has no {attr}") from None


def build_factory(cfg: ModelConfig) -> nn.Module:
    """Call the user's factory with model.kwargs; ConfigError (one line) if it cannot
    be imported, raises, or returns anything but an nn.Module."""
    factory = import_object(cfg.name, "model.name")
    if not callable(factory):
        raise ConfigError(f"model.name={cfg.name} is not callable")
    try:
        model = factory(**(cfg.kwargs or {}))
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(
            f"model.name={cfg.name} raised {type(exc).__name__}: {first} "
            f"(called with model.kwargs={cfg.kwargs or {}})"
        ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.name={cfg.name} returned {type(model).__name__}, not a torch nn.Module"
        )
    return model


def build_model(cfg: ModelConfig) -> nn.Module:
    """The job's model, built on the current default device (meta is fine for
    meshforge's own models: they initialise later with `init_weights`)."""
    if cfg.is_factory:
        return build_factory(cfg)
    return family_model(cfg)


def check_factory(cfg: JobConfig) -> None:
    """Before any worker starts, so that bad input answers in one line: import and
    call the factory on the meta device (no memory), check that a pipeline can cut
    what it returns when parallel.pp > 1, and run one forward pass on meta tensors
    to check it maps token ids (1, seq_len) to logits (1, seq_len, vocab_size)."""
    m = cfg.model
    if not m.is_factory:
        return
    with torch.device("meta"):
        model = build_factory(m)
        pp = cfg._parallel().pp
        if pp > 1 and not has_stage_layout(model):
            raise ConfigError(
                f"parallel.pp={pp}: model.name={m.name} lacks the stage layout a pipeline "
                "cuts (embed, blocks as an nn.ModuleDict keyed by layer index, ln_f, head)"
            )
        idx = torch.zeros((1, m.seq_len), dtype=torch.long)
        try:
            out = model(idx)
        except Exception:  # noqa: BLE001 - a forward that needs values (not meta tensors):
            out = None  # not conclusive here; the first step runs it for real
    want = (1, m.seq_len, m.vocab_size)
    if out is not None and (got := _shape_or_type(out)) != want:
        raise ConfigError(
            f"model.name={m.name}: forward must return logits of shape {want} "
            f"(batch, model.seq_len, model.vocab_size) for token ids (1, {m.seq_len}); "
            f"it returned {got}"
        )
    if m.tp_plan is not None:
        tensor_parallel_plan(m)


def _shape_or_type(out: object) -> object:
    return tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__


def tensor_parallel_plan(cfg: ModelConfig) -> Callable[..., None]:
    """The function that shards the model over the tensor-parallel mesh."""
    if not cfg.is_factory:
        from meshforge.models.tensor_parallel import apply_tensor_parallel

        return apply_tensor_parallel
    if cfg.tp_plan is None:
        raise ConfigError(
            f"parallel.tp > 1 with model.name={cfg.name}: name the model's tensor-parallel "
            "plan in model.tp_plan ('package.module:function')"
        )
    plan = import_object(cfg.tp_plan, "model.tp_plan")
    if not callable(plan):
        raise ConfigError(f"model.tp_plan={cfg.tp_plan} is not callable")
    return plan


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The model's repeated layers (`blocks`), or [] when it names none."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    return []


def has_stage_layout(model: nn.Module) -> bool:
    """Whether a pipeline split can cut `model` (see the module docstring)."""
    return isinstance(getattr(model, "blocks", None), nn.ModuleDict) and all(
        hasattr(model, a) for a in ("embed", "ln_f", "head")
    )
