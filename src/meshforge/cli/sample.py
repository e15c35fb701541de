"""`meshforge sample RUN_DIR --prompt TEXT`: generate text from a run's checkpoint.

One CPU process, no process group: torch.distributed.checkpoint reads the model
shards whatever layout wrote them (DDP's plain tensors or FSDP's DTensor shards)
and reassembles them into the full tensors of a freshly built GPT."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from meshforge.cli.app import app
from meshforge.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from meshforge.models.gpt import GPT


def _checkpoint_dir(run_dir: Path, step: int | None) -> tuple[int, Path]:
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


def load_model(run_dir: Path, step: int | None = None) -> tuple[GPT, int]:
    """(GPT on CPU with the checkpoint's weights, the step it was saved at)."""
    from meshforge.config import load_config

    if not run_dir.is_dir():
        raise CheckpointError(f"run directory not found: {run_dir}")
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise ConfigError(f"{run_dir} has no config.yaml (is it a meshforge run directory?)")
    cfg = load_config(config)
    found_step, path = _checkpoint_dir(run_dir, step)

    from meshforge.models.gpt import GPT  # after the checks: bad input answers fast
    from meshforge.train.checkpoint import read_dcp

    model = GPT(cfg.model)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # DCP warns that it runs without a process group
        warnings.simplefilter("ignore")
        read_dcp(state, path)  # tensors and plain data only; CheckpointError otherwise
    model.load_state_dict(state["model"])
    return model.eval(), found_step


@app.command("sample")
def sample(
    run_dir: Annotated[Path, typer.Argument(help="Run directory of a `meshforge train` run.")],
    prompt: Annotated[str, typer.Option("--prompt", help="Text to continue.")],
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="Tokens to generate.")] = 200,
    temperature: Annotated[
        float, typer.Option("--temperature", min=0.0, help="0 picks the likeliest token.")
    ] = 0.8,
    top_k: Annotated[
        int, typer.Option("--top-k", min=0, help="Sample from the K likeliest (0: all).")
    ] = 50,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed.")] = 0,
    step: Annotated[
        int | None, typer.Option("--step", min=0, help="Checkpoint step (default: newest).")
    ] = None,
) -> None:
    """Generate text from the newest valid checkpoint of a run (any layout)."""
    if not prompt:
        raise ConfigError("--prompt must not be empty")
    model, _ = load_model(run_dir, step)

    import torch

    from meshforge.data.tokenizer import VOCAB_SIZE, decode, encode

    torch.manual_seed(seed)
    idx = torch.from_numpy(encode(prompt).astype("int64")).unsqueeze(0)
    if int(idx.max()) >= model.cfg.vocab_size:
        raise ConfigError(f"the prompt has bytes outside model.vocab_size={model.cfg.vocab_size}")
    out = model.generate(idx, tokens, temperature=temperature, top_k=top_k)[0].tolist()
    # A model with a larger vocabulary than the byte tokenizer may emit ids it never saw.
    print(decode([t for t in out if t < VOCAB_SIZE]))
