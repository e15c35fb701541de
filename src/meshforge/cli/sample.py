"""`meshforge sample RUN_DIR --prompt TEXT`: generate text from a run's checkpoint.

One CPU process, no process group: the model is read back whatever layout wrote
its checkpoint (train/saved_run.py).

The prompt is encoded and the output decoded with the run's tokenizer: the one
recorded in the index of its ``data.source`` shard directory (byte-level for the
built-in corpus and for old indexes), or a ``tokenizer.json`` given by
``--tokenizer`` (for sources that record none, e.g. nanoGPT ``.bin`` files)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from meshforge.cli.app import app
from meshforge.errors import ConfigError
from meshforge.train.saved_run import (
    checkpoint_of,
    load_model,
    load_saved,
    run_config,
    run_tokenizer,
)

__all__ = ["load_model", "run_tokenizer", "sample"]


@app.command("sample", rich_help_panel="Inspect")
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
    tokenizer_file: Annotated[
        Path | None,
        typer.Option(
            "--tokenizer",
            help="A tokenizer.json to use instead of the one recorded with data.source.",
        ),
    ] = None,
) -> None:
    """Generate text from the newest valid checkpoint of a run (any layout)."""
    if not prompt:
        raise ConfigError("--prompt must not be empty")
    tokenizer = run_tokenizer(run_dir, tokenizer_file)  # before the model: bad input answers fast
    cfg = run_config(run_dir)
    if cfg.model.is_factory:
        raise ConfigError(
            f"model.name={cfg.model.name} is a user's factory: sample generates with "
            "meshforge's own models (gpt, llama); `meshforge export` takes the weights out"
        )
    found_step, path = checkpoint_of(run_dir, step)
    model = load_saved(cfg, found_step, path, command="sample").model

    import torch

    torch.manual_seed(seed)
    ids = tokenizer.encode(prompt)
    if not len(ids):
        raise ConfigError("--prompt encodes to no tokens")
    if int(ids.max()) >= model.cfg.vocab_size:
        raise ConfigError(
            f"the prompt has token ids outside model.vocab_size={model.cfg.vocab_size} "
            f"(the {tokenizer.kind} tokenizer has {tokenizer.vocab_size})"
        )
    idx = torch.from_numpy(ids.astype("int64")).unsqueeze(0)
    out = model.generate(idx, tokens, temperature=temperature, top_k=top_k)[0].tolist()
    # A model with a larger vocabulary than its tokenizer may emit ids it never saw.
    print(tokenizer.decode([t for t in out if t < tokenizer.vocab_size]))
