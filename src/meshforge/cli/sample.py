"""`meshforge sample RUN_DIR --prompt TEXT`: generate text from a run's checkpoint.

One CPU process, no process group: torch.distributed.checkpoint reads the model
shards whatever layout wrote them (DDP's plain tensors or FSDP's DTensor shards)
and reassembles them into the full tensors of a freshly built GPT.

The prompt is encoded and the output decoded with the run's tokenizer: the one
recorded in the index of its ``data.source`` shard directory (byte-level for the
built-in corpus and for old indexes), or a ``tokenizer.json`` given by
``--tokenizer`` (for sources that record none, e.g. nanoGPT ``.bin`` files)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from meshforge.cli.app import app
from meshforge.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from meshforge.data.tokenizer import Tokenizer
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


def _run_config(run_dir: Path) -> Path:
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory not found: {run_dir}")
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise ConfigError(f"{run_dir} has no config.yaml (is it a meshforge run directory?)")
    return config


def run_tokenizer(run_dir: Path, tokenizer_file: Path | None = None) -> Tokenizer:
    """The tokenizer of a run: ``tokenizer_file`` when given, else the one recorded in
    the index of its ``data.source`` (a URL source: its local cache copy, no download),
    else bytes when the model has no more than 256 ids (a source moved away since)."""
    from meshforge.config import load_config
    from meshforge.data.corpus import BUILTIN_PREFIX, is_url, remote_cache_path
    from meshforge.data.shards import INDEX_NAME, read_index
    from meshforge.data.tokenizer import (
        VOCAB_SIZE,
        ByteTokenizer,
        load_tokenizer_file,
        tokenizer_from_index,
    )

    if tokenizer_file is not None:
        return load_tokenizer_file(tokenizer_file)
    cfg = load_config(_run_config(run_dir))
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
    raise ConfigError(
        f"data.source {source} of {run_dir}/config.yaml has no {INDEX_NAME} here "
        "(not a local shard directory), so its tokenizer is unknown; "
        "pass --tokenizer PATH/tokenizer.json"
    )


def load_model(run_dir: Path, step: int | None = None) -> tuple[GPT, int]:
    """(GPT on CPU with the checkpoint's weights, the step it was saved at)."""
    from meshforge.config import load_config

    cfg = load_config(_run_config(run_dir))
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
    model, _ = load_model(run_dir, step)

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
