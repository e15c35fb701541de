"""`meshforge export`'s work: a run's newest valid checkpoint (or a chosen step), read
back whole whatever layout wrote it (train/saved_run.py), written out in one of
models/export.py's formats.

The output is a directory (by default RUN_DIR/export/step-NNNNNNNN-FORMAT). It is
filled under a temporary name beside it and renamed into place when complete, so a
failure leaves no half-written export; an existing one is refused unless
`replace`, and then it is swapped out only once the new one is complete. The torch
and safetensors formats hold meshforge's parameter names, with the run's
config.yaml beside them (it rebuilds the model); their parameters' digest is that of
report.json's `final_param_digest` (parallel/parallelize.py `digest_of`).

Bad input is refused before the checkpoint is read, each with one line: a missing run
directory or config.yaml, no valid checkpoint (or none of `step`), an unknown format,
`hf` for a user's factory model or for a mixture of experts that no transformers class
computes (models/export.py `hf_refusal`: Mixtral is the only one), a factory model
without `trust_model_code` (a run directory is data: its code is imported only when the
user says so, train/saved_run.py), an existing output.

`replace` (`--force`) replaces an earlier export only: a directory that holds nothing but
what an export writes (`is_export`: a torch or safetensors export's weights beside a job
config.yaml, or an hf export's config.json, which names `meshforge_export`). Anything else
at the output (your files, a symlink, a run directory) is refused and kept."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from meshforge.errors import ConfigError, ExportError
from meshforge.rundir.outputs import claim
from meshforge.train.saved_run import (
    check_code_trusted,
    checkpoint_of,
    load_saved,
    recorded_tokenizer,
    run_config,
)

if TYPE_CHECKING:
    from meshforge.config import JobConfig
    from meshforge.models.export import Tokenizer

FORMATS = ("torch", "safetensors", "hf")
FORMAT_NAMES = {"torch": "a torch state dict", "safetensors": "safetensors", "hf": "Hugging Face"}


@dataclass
class Exported:
    """What an export wrote."""

    fmt: str
    step: int
    out: Path  # the directory
    files: list[str]  # the names of the files in it
    digest: str | None = None  # torch, safetensors: the parameters' final_param_digest
    architecture: str | None = None  # hf: the transformers class
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: what was written where."""
        what = FORMAT_NAMES[self.fmt]
        if self.architecture is not None:
            what = f"a Hugging Face {self.architecture} directory"
        line = f"exported step {self.step} as {what} to {self.out} ({', '.join(self.files)})"
        if self.digest is not None:
            line += f"; final_param_digest {self.digest}"
        return "; ".join([line, *self.notes])


def default_out(run_dir: Path, step: int, fmt: str) -> Path:
    from meshforge.train.checkpoint import step_dir_name

    return run_dir / "export" / f"{step_dir_name(step)}-{fmt}"


def export_run(
    run_dir: Path,
    fmt: str,
    out: Path | None = None,
    step: int | None = None,
    replace: bool = False,
    tokenizer_file: Path | None = None,
    trust_model_code: bool = False,
) -> Exported:
    """Write the model of `run_dir`'s checkpoint (the newest valid one, or `step`'s) as
    `fmt` into the directory `out`; `tokenizer_file` (hf only) stands in for the
    tokenizer the run's data records; `trust_model_code` lets a user's factory that the
    run's config.yaml names be imported and run."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}: use {', '.join(FORMATS)}")
    cfg = run_config(run_dir)
    if fmt == "hf" and cfg.model.is_factory:
        raise ConfigError(
            f"model.name={cfg.model.name} is a user's factory: --format hf writes meshforge's "
            "gpt (GPT2LMHeadModel) and llama (LlamaForCausalLM; MixtralForCausalLM with "
            "model.moe) only; use --format torch or safetensors"
        )
    if fmt == "hf":
        from meshforge.models.export import hf_refusal

        problem = hf_refusal(cfg.model)
        if problem is not None:
            raise ConfigError(problem)
    check_code_trusted(cfg, run_dir, trust_model_code, "export")
    if tokenizer_file is not None and fmt != "hf":
        raise ConfigError(f"--tokenizer applies to --format hf, not {fmt}")
    found_step, checkpoint = checkpoint_of(run_dir, step)
    out = Path(out) if out is not None else default_out(run_dir, found_step, fmt)
    if out.exists() or out.is_symlink():
        if not replace:
            raise ConfigError(f"{out} exists; pass --force to replace it")
        check_replaceable(out)
    notes: list[str] = []
    tokenizer = None
    if fmt == "hf":
        tokenizer = _hf_tokenizer(cfg, tokenizer_file, notes)

    saved = load_saved(cfg, found_step, checkpoint, trust_model_code)  # the slow part
    if out == default_out(run_dir, found_step, fmt):
        claim(run_dir, "export")  # RUN_DIR/export is meshforge's for --fresh (rundir/outputs)
    from meshforge.fileio import staged_directory
    from meshforge.models import export as formats

    result = Exported(fmt, found_step, out, [], notes=notes)
    try:
        with staged_directory(out, replace=replace) as stage:
            if fmt == "hf":
                result.files = formats.write_hf(saved.model, cfg.model, stage, tokenizer)
                result.architecture = formats.hf_architecture(cfg.model)
                result.notes.extend(formats.hf_notes(cfg.model))
            else:
                if fmt == "torch":
                    result.files = formats.write_torch(saved.model, stage)
                else:
                    result.files = formats.write_safetensors(saved.model, stage, {})
                shutil.copyfile(run_dir / "config.yaml", stage / "config.yaml")
                result.files.append("config.yaml")
            if replace and (out.exists() or out.is_symlink()):
                check_replaceable(out)  # again, just before the swap: it may have changed
    except FileExistsError:  # made by someone else while this export ran
        raise ConfigError(f"{out} exists; pass --force to replace it") from None
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from None
    if fmt != "hf":
        from meshforge.parallel.parallelize import digest_of

        result.digest = digest_of(saved.model.named_parameters())
    return result


# What an export writes into its directory: any of these names, and nothing else.
EXPORT_FILES = ("config.yaml", "model.pt", "model.safetensors", "config.json",
                "generation_config.json", "tokenizer.json", "tokenizer_config.json")  # fmt: skip
EXPORT_MARK = "meshforge_export"  # the key an hf export's config.json carries


def is_export(path: Path) -> bool:
    """Whether PATH is a directory an earlier `meshforge export` wrote: a real directory
    (not a symlink) holding only names an export writes, with its weights beside a job
    config.yaml (torch, safetensors) or a config.json naming `meshforge_export` (hf)."""
    import json

    import yaml

    from meshforge.rundir.files import is_job_config

    if path.is_symlink() or not path.is_dir():
        return False
    names = {p.name for p in path.iterdir()}
    if not names or not names <= set(EXPORT_FILES):
        return False
    if any((path / n).is_symlink() or not (path / n).is_file() for n in names):
        return False
    try:
        if "config.yaml" in names and names & {"model.pt", "model.safetensors"}:
            config = yaml.safe_load((path / "config.yaml").read_text())
            return isinstance(config, dict) and is_job_config(config)
        if "config.json" in names and "model.safetensors" in names:
            config = json.loads((path / "config.json").read_text())
            return isinstance(config, dict) and EXPORT_MARK in config
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return False


def check_replaceable(out: Path) -> None:
    """`--force` replaces an earlier export only: anything else at OUT is refused (and
    kept), in one line."""
    if not is_export(out):
        what = "a symlink" if out.is_symlink() else "a file" if not out.is_dir() else (
            "a directory that is not an earlier export")  # fmt: skip
        raise ConfigError(
            f"--out {out} is {what}: --force replaces only an earlier `meshforge export` "
            "(its files and nothing else); it is kept: choose another --out"
        )


def _hf_tokenizer(
    cfg: JobConfig, tokenizer_file: Path | None, notes: list[str]
) -> Tokenizer | None:
    """The tokenizer an hf export carries (a note says why when there is none)."""
    from meshforge.data.tokenizer import load_tokenizer_file

    if tokenizer_file is not None:
        tokenizer = load_tokenizer_file(tokenizer_file)
        origin = f"--tokenizer {tokenizer_file}"
    else:
        tokenizer = recorded_tokenizer(cfg)
        origin = f"data.source {cfg.data.source}"
    if tokenizer is None:
        notes.append(
            f"no tokenizer written: {origin} records none (pass --tokenizer PATH/tokenizer.json)"
        )
        return None
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer of {origin} has {tokenizer.vocab_size} ids, more than "
            f"model.vocab_size={cfg.model.vocab_size}"
        )
    if tokenizer.kind == "byte":
        notes.append("tokenizer: byte-level (one token per UTF-8 byte), as tokenizer.json")
    return tokenizer
