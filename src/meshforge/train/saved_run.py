"""A run directory read back in one CPU process, with no process group: its resolved
config, its newest valid checkpoint (or a chosen step), the full model loaded from it,
and the tokenizer its data was made with. Used by `meshforge sample` and `meshforge
export`.

torch.distributed.checkpoint reads the model shards whatever layout wrote them (DDP's
plain tensors, FSDP's or tensor parallel's DTensor shards, one pipeline stage per
rank), keyed by the full model's parameter names, and reassembles them into the full
tensors of a freshly built model. meshforge's own models are built on the meta device
and only allocated, never initialised (every tensor is then read from the checkpoint);
a user's factory model is built as its factory builds it.

A run directory is data, never code: its config.yaml may name a user's factory
(`model.name: package.module:function`, `model.tp_plan`), and a run directory can come
from anyone. Building that model imports and runs the code it names, so it is done only
when the caller says the user trusts it (`trust_model_code`, the commands'
`--trust-model-code`); otherwise a one-line ConfigError names the code and the flag.

Bad input raises one-line errors before torch is imported: a missing run directory or
checkpoint is a CheckpointError, a missing or invalid config.yaml a ConfigError."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from meshforge.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from torch import nn

    from meshforge.config import JobConfig
    from meshforge.data.tokenizer import Tokenizer


@dataclass
class SavedModel:
    """A run's model as one checkpoint holds it, on the CPU in eval mode."""

    cfg: JobConfig  # the run's resolved config
    model: nn.Module  # a DecoderLM, or a factory's module
    step: int  # the step the checkpoint was saved at
    checkpoint: Path  # its directory


def run_config(run_dir: Path) -> JobConfig:
    """The resolved config a run saved (config.yaml)."""
    from meshforge.config import load_config

    if not run_dir.is_dir():
        raise CheckpointError(f"run directory not found: {run_dir}")
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no config.yaml (is it a meshforge run directory?)")
    return load_config(path)


TRUST_FLAG = "--trust-model-code"


def model_code(cfg: JobConfig) -> list[str]:
    """The fields of CFG that name code to import (`model.name=pkg.mod:fn`, ...)."""
    m = cfg.model
    named = [("model.name", m.name)] if m.is_factory else []
    named += [("model.tp_plan", m.tp_plan)] if m.tp_plan is not None else []
    return [f"{field}={spec}" for field, spec in named]


def check_code_trusted(cfg: JobConfig, run_dir: Path, trusted: bool, command: str) -> None:
    """ConfigError (one line, exit 2) when RUN_DIR's config names code and the user has
    not said to trust it: a run directory is data (the module docstring)."""
    code = model_code(cfg)
    if code and not trusted:
        raise ConfigError(
            f"{Path(run_dir) / 'config.yaml'} names code to import ({', '.join(code)}): a "
            f"run directory is data, so `meshforge {command}` imports it only with "
            f"{TRUST_FLAG} (trust the run directory's sender)"
        )


def checkpoint_of(run_dir: Path, step: int | None = None) -> tuple[int, Path]:
    """(step, directory) of the newest valid checkpoint, or of `step`, checked."""
    from meshforge.train.checkpoint import (
        find_latest_valid,
        list_checkpoints,
        step_dir_name,
        verify,
    )

    root = run_dir / "checkpoints"
    if step is None:
        found = find_latest_valid(root, warn=lambda _msg: None)
        if found is None:
            raise CheckpointError(f"no valid checkpoint in {root}")
        return found
    path = root / step_dir_name(step)
    if not path.is_dir():
        steps = ", ".join(str(s) for s, _ in list_checkpoints(root)) or "none"
        raise CheckpointError(f"no checkpoint of step {step} in {root} (steps: {steps})")
    problem = verify(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} is not usable: {problem}")
    return step, path


def load_saved(
    cfg: JobConfig,
    step: int,
    checkpoint: Path,
    trust_model_code: bool = False,
    command: str = "export",
) -> SavedModel:
    """The model of `cfg` with the weights of `checkpoint` (from `checkpoint_of`). A
    user's factory model is built (its code imported and run) only with
    `trust_model_code`: ConfigError otherwise."""
    check_code_trusted(cfg, checkpoint.parent.parent, trust_model_code, command)
    import torch

    from meshforge.models.registry import build_factory, family_model
    from meshforge.train.checkpoint import read_dcp

    if cfg.model.is_factory:
        model = build_factory(cfg.model)
    else:
        with torch.device("meta"):  # no initialisation: the checkpoint fills every tensor
            model = family_model(cfg.model)
        model.to_empty(device="cpu")
        model.tie_weights()
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # DCP warns that it runs without a process group
        warnings.simplefilter("ignore")
        read_dcp(state, checkpoint)  # tensors and plain data only; CheckpointError otherwise
    model.load_state_dict(state["model"])
    return SavedModel(cfg, model.eval(), step, checkpoint)


def load_model(
    run_dir: Path, step: int | None = None, trust_model_code: bool = False
) -> tuple[nn.Module, int]:
    """(the run's model on CPU with the checkpoint's weights, the step it was saved at);
    a user's factory model only with `trust_model_code` (see `load_saved`)."""
    cfg = run_config(run_dir)
    found_step, path = checkpoint_of(run_dir, step)
    saved = load_saved(cfg, found_step, path, trust_model_code)
    return saved.model, saved.step


def recorded_tokenizer(cfg: JobConfig) -> Tokenizer | None:
    """The tokenizer recorded in the index of the run's ``data.source`` (a URL source:
    its local cache copy, no download); bytes for the built-in corpus, or when the model
    has no more than 256 ids (a source moved away since); None when it is unknown."""
    from meshforge.data.corpus import BUILTIN_PREFIX, is_url, remote_cache_path
    from meshforge.data.shards import INDEX_NAME, read_index
    from meshforge.data.tokenizer import VOCAB_SIZE, ByteTokenizer, tokenizer_from_index

    source = cfg.data.source
    if source.startswith(BUILTIN_PREFIX):
        return ByteTokenizer()
    if is_url(source):
        directory = remote_cache_path(source, cfg.data.cache_dir)
    else:
        directory = Path(source).expanduser()
    if (directory / INDEX_NAME).is_file():
        index = read_index(directory, context=f"data.source {source}")
        return tokenizer_from_index(index["tokenizer"], directory)
    if cfg.model.vocab_size <= VOCAB_SIZE:  # no BPE fits in 256 ids: bytes it was
        return ByteTokenizer()
    return None


def run_tokenizer(run_dir: Path, tokenizer_file: Path | None = None) -> Tokenizer:
    """The tokenizer of a run: ``tokenizer_file`` when given, else the recorded one
    (`recorded_tokenizer`); ConfigError when neither is known."""
    from meshforge.data.shards import INDEX_NAME
    from meshforge.data.tokenizer import load_tokenizer_file

    if tokenizer_file is not None:
        return load_tokenizer_file(tokenizer_file)
    cfg = run_config(run_dir)
    tokenizer = recorded_tokenizer(cfg)
    if tokenizer is None:
        raise ConfigError(
            f"data.source {cfg.data.source} of {run_dir}/config.yaml has no {INDEX_NAME} here "
            "(not a local shard directory), so its tokenizer is unknown; "
            "pass --tokenizer PATH/tokenizer.json"
        )
    return tokenizer
