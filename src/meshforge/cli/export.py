"""`meshforge export RUN_DIR --format torch|safetensors|hf`: a run's model taken out of
meshforge (train/run_export.py does the work; torch is imported only once the input
has been checked)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from meshforge.cli.app import app
from meshforge.train.run_export import FORMATS, export_run

Format = Enum("Format", {name: name for name in FORMATS}, type=str)


@app.command("export", rich_help_panel="Inspect")
def export(
    run_dir: Annotated[Path, typer.Argument(help="Run directory of a `meshforge train` run.")],
    fmt: Annotated[
        Format,
        typer.Option(
            "--format",
            help="torch: a torch.save state dict; safetensors: the same as safetensors "
            "(both with meshforge's names); hf: a Hugging Face model directory "
            "(GPT2LMHeadModel, LlamaForCausalLM or, for a mixture of experts, "
            "MixtralForCausalLM, with the tokenizer).",
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Directory to write (default RUN_DIR/export/step-N-FORMAT)."),
    ] = None,
    step: Annotated[
        int | None, typer.Option("--step", min=0, help="Checkpoint step (default: newest).")
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Replace an earlier export at --out (anything else there is refused and kept).",
        ),
    ] = False,
    tokenizer_file: Annotated[
        Path | None,
        typer.Option(
            "--tokenizer",
            help="hf: a tokenizer.json to write instead of the one recorded with data.source.",
        ),
    ] = None,
    trust_model_code: Annotated[
        bool,
        typer.Option(
            "--trust-model-code",
            help="Import and run the model factory (model.name: package.module:function) "
            "that the run's config.yaml names. A run directory is data: without this flag "
            "its code is never imported. Give it only for a run directory you trust.",
        ),
    ] = False,
) -> None:
    """Write the newest valid checkpoint of a run (any layout) as full tensors."""
    exported = export_run(run_dir, fmt.value, out, step, force, tokenizer_file, trust_model_code)
    print(exported.summary())
