"""What a launcher does with a run directory that holds a run already.

A run directory keeps one run's whole history, and a launch never overwrites it
unasked. Before anything is written (`prepare_job` calls `check_earlier_run`):

- nothing of a run there yet: a new run;
- `--fresh`: the earlier run's files are removed, under the run lock, and a new run
  starts (`remove_earlier_run`, one line says so);
- another model (any `model.*` field differs from the run's config.yaml): refused,
  exit 2, one line naming the fields; the checkpoints could not load into it;
- finished (its report says completed, and its final checkpoint is at or past
  `train.steps`): one line says where the results are and how to extend it or start
  over; nothing is written and the launch exits 0;
- otherwise the run goes on from its newest checkpoint: a resume after a crash or a
  stop, or, when `train.steps` grew past a finished run's, an extension. The learning
  rate keeps the schedule the run started with (train/optim.py): past its horizon it
  stays at `lr * min_lr_ratio`. Layout changes (dp, zero, tp, pp) are allowed: the
  checkpoints reshard.

Plain Python (no torch): it runs in the launcher before any worker starts.
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from meshforge.config import JobConfig, ModelConfig
from meshforge.errors import ConfigError
from meshforge.runtime import runlock

# What meshforge writes into a run directory (`--fresh` removes these, and only these).
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "segments.jsonl",
    "report.json",
    "report.json.tmp",
    "report.png",
    "report.html",
    "trace.json",
    ".trace",
    ".launch",
    "checkpoints",
    "logs",
    "health",
    "system",
    "tensorboard",
    "wandb",
    "export",
)
RUN_FILE_PATTERNS = ("compare-*.html", ".*.tmp")
_MARKERS = ("config.yaml", "metrics.jsonl", "report.json", "checkpoints", "segments.jsonl")


@dataclass
class EarlierRun:
    """What a run directory says about the run it holds."""

    run_dir: Path
    config: dict[str, Any]  # config.yaml as written ({} when absent or unreadable)
    report: dict[str, Any]  # report.json ({} when absent or unreadable)
    checkpoints: list[int]  # steps of the committed checkpoints

    @property
    def finished_at(self) -> int | None:
        """The step a completed run ended at, when its final checkpoint is there."""
        steps = self.report.get("steps")
        if self.report.get("status") != "completed" or not isinstance(steps, int):
            return None
        return steps if steps in self.checkpoints else None

    @property
    def lr_horizon(self) -> int | None:
        horizon = self.report.get("lr_horizon")
        return horizon if isinstance(horizon, int) else None


def _read(path: Path, parse) -> dict[str, Any]:
    try:
        value = parse(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return value if isinstance(value, dict) else {}


def earlier_run(run_dir: Path) -> EarlierRun | None:
    """The run RUN_DIR holds, or None when it holds none (absent, empty, or only a lock)."""
    run_dir = Path(run_dir)
    if not any((run_dir / name).exists() for name in _MARKERS):
        return None
    steps = []
    root = run_dir / "checkpoints"
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith("step-") and (p / "manifest.json").is_file():
                try:
                    steps.append(int(p.name[5:]))
                except ValueError:
                    continue
    return EarlierRun(
        run_dir,
        _read(run_dir / "config.yaml", yaml.safe_load),
        _read(run_dir / "report.json", json.loads),
        sorted(steps),
    )


def model_changes(earlier: dict[str, Any], cfg: JobConfig) -> list[str]:
    """`model.FIELD old -> new` for each model field that differs from the earlier
    config (its defaults filled in, as config.yaml always has them). A preset's name
    is not compared: the fields it fills are."""
    before = earlier.get("model")
    if not isinstance(before, dict):
        return []
    try:
        before = ModelConfig.model_validate(before).model_dump(mode="json")
    except ValueError:
        pass  # written by another version: compare the fields as they are
    now = cfg.model.model_dump(mode="json")
    return [
        f"model.{key} {before.get(key)!r} -> {now.get(key)!r}"
        for key in dict.fromkeys([*now, *before])
        if key != "preset" and before.get(key) != now.get(key)  # a preset is its fields
    ]


def check_earlier_run(cfg: JobConfig, run_dir: Path, fresh: bool) -> tuple[str | None, str | None]:
    """(finished, note) for a launch of CFG into RUN_DIR, deciding before anything is
    written: `finished` is the one line to print and exit 0 with when the run there is
    complete; `note` a line to print when the launch extends a finished run. Raises
    ConfigError (exit 2) when RUN_DIR holds a run of another model."""
    earlier = None if fresh else earlier_run(run_dir)
    if earlier is None:
        return None, None
    changed = model_changes(earlier.config, cfg)
    if changed:
        raise ConfigError(
            f"run directory {run_dir} holds a run of another model ({', '.join(changed)}); "
            "start over there with --fresh, or use another --run-dir"
        )
    done = earlier.finished_at
    if done is None or runlock.is_held(run_dir):  # a job there now: the lock answers
        return None, None
    if done >= cfg.train.steps:
        where = shlex.quote(str(run_dir))
        return (
            f"meshforge: {run_dir} has finished its {done} steps (results: "
            f"{run_dir / 'report.json'}, meshforge report {where}); to train on: "
            f"--set train.steps=N with N > {done}; to start over: --fresh"
        ), None
    t, horizon = cfg.train, earlier.lr_horizon
    note = f"meshforge: extending the finished run in {run_dir} from step {done} to {t.steps}"
    if horizon is None:  # a run from before horizons were recorded
        return None, note
    return None, (
        f"{note}; past step {horizon}, the end of its schedule, the learning rate stays at "
        f"lr x min_lr_ratio = {t.lr * t.min_lr_ratio:.3g}"
    )


def remove_earlier_run(run_dir: Path) -> str | None:
    """`--fresh`: remove what meshforge wrote into RUN_DIR (its lock file stays: the
    caller holds it); files meshforge does not write are left. The line to print, or
    None when there was nothing to remove."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    found = [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
    for pattern in RUN_FILE_PATTERNS:
        found += [p for p in run_dir.glob(pattern) if p not in found]
    if not found:
        return None
    earlier = earlier_run(run_dir)
    reached = max(earlier.checkpoints, default=None) if earlier else None
    for path in found:
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError as exc:
            raise ConfigError(f"--fresh: cannot remove {path}: {exc.strerror or exc}") from None
    kept = [p.name for p in run_dir.iterdir() if p.name != runlock.LOCK_FILE]
    what = f"checkpoints up to step {reached}, " if reached is not None else ""
    line = f"meshforge: --fresh: removed the earlier run in {run_dir} ({what}{len(found)} entries)"
    if kept:
        line += f"; kept {len(kept)} entr{'y' if len(kept) == 1 else 'ies'} meshforge did not write"
    return line + "; starting over"
