"""What a launcher does with a run directory that holds a run already.

A run directory keeps one run's whole history, and a launch never overwrites it
unasked. Before anything is written (`prepare_job` calls `check_earlier_run`), the
directory is read (its newest committed checkpoint, segments.jsonl, report.json,
config.yaml; never report.json alone, which may be missing or stale) and decided:

- a file, not a directory: refused (exit 2);
- a job there now (its run lock is held): left to the lock, which refuses the launch;
- nothing of a run there (absent, empty, or only files meshforge does not write): a
  new run;
- not a meshforge run (its config.yaml is not a job config, or it holds metrics.jsonl
  or report.json without one): refused, exit 2, one line; `--fresh` takes it over;
- `--fresh`: what meshforge wrote there is removed, under the run lock, and a new run
  starts (rundir/files.py `remove_earlier_run`, one line says what went and what stayed);
- another model (any `model.*` field differs from the run's config.yaml): refused,
  exit 2, one line naming the fields; the checkpoints could not load into it. Except
  `model.seq_len` of a Llama (rotary positions, no weight sized by it): the run goes on
  at the new length, and a line says so;
- nothing to train (its newest checkpoint is at or past `train.steps`: a finished run,
  or one stopped past a smaller `train.steps`): one line says the step the run reached,
  where its results are and how to extend it or start over; nothing is written and the
  launch exits 0;
- otherwise the run goes on from its newest checkpoint (none: from step 0): a resume
  after a crash or a stop, or, when `train.steps` grew past a finished run's, an
  extension (a line says so, with what the learning rate does). The learning rate
  keeps the schedule the run started with (train/schedule.py): past its horizon it
  stays at its value at the horizon's last step, so it never jumps. Layout changes
  (dp, zero, tp, pp) are allowed: the checkpoints reshard.

A checkpoint counts when it is committed: its manifest is there and names files that
are there with their sizes. Their checksums are the workers' to verify when they load
it (hashing a large checkpoint here would slow every launch).

The run directory's files, the earlier run as they say it and `--fresh`'s removal
are meshforge.rundir's (rundir/files.py); the decisions, which need the job config,
are here. Plain Python (no torch): it runs in the launcher before any worker starts.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshforge.config import JobConfig, ModelConfig
from meshforge.errors import ConfigError
from meshforge.rundir.files import EarlierRun, earlier_run, is_job_config
from meshforge.rundir.outputs import recorded_outputs
from meshforge.rundir.report import REPORT_FILE, REPORT_TMP, report_path
from meshforge.rundir.segments import SEGMENTS_FILE
from meshforge.runtime import runlock
from meshforge.train.schedule import lr_factor


@dataclass
class Decision:
    """What `check_earlier_run` decided: `finished`, the one line to print and exit 0
    with (nothing to train; nothing was written); `note`, a line about the run going
    on (an extension, or a resume past the schedule's horizon); `warning`, a line about
    the schedule (a warm-up as long as it)."""

    finished: str | None = None
    note: str | None = None
    warning: str | None = None


def model_changes(earlier: dict[str, Any], cfg: JobConfig) -> list[str]:
    """`model.FIELD old -> new` for each model field that differs from the earlier
    config (its defaults filled in, as config.yaml always has them), down to the
    fields of model.moe. A preset's name is not compared: the fields it fills are."""
    before = earlier.get("model")
    if not isinstance(before, dict):
        return []
    try:
        before = ModelConfig.model_validate(before).model_dump(mode="json")
    except ValueError:
        pass  # written by another version: compare the fields as they are
    now = cfg.model.model_dump(mode="json")
    before = {k: v for k, v in before.items() if k != "preset"}  # a preset is its fields
    now.pop("preset", None)
    return _changes("model", before, now)


def _changes(where: str, before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """`WHERE.KEY old -> new` per differing key; a section on both sides (model.moe)
    names the fields within that differ, not the whole section."""
    out = []
    for key in dict.fromkeys([*now, *before]):
        old, new = before.get(key), now.get(key)
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            out += _changes(f"{where}.{key}", old, new)
        else:
            out.append(f"{where}.{key} {_shown(old)} -> {_shown(new)}")
    return out


def _shown(value: Any) -> str:
    """A value as a change names it; a section given on one side only is `set`."""
    return "set" if isinstance(value, dict) else repr(value)


def outputs_of(cfg: JobConfig) -> list[str]:
    """The top-level entries of the run directory a run of CFG may write (its workers,
    sinks, report and launcher): a launch claims them before it writes anything
    (rundir/outputs.py), so that `--fresh` knows them as meshforge's."""
    names = ["config.yaml", "metrics.jsonl", SEGMENTS_FILE, REPORT_FILE, REPORT_TMP,
             "report.html", "checkpoints", "logs", "health", "system"]  # fmt: skip
    o = cfg.observe
    if o.trace_steps:
        names += ["trace.json", ".trace"]
    if o.tensorboard:
        names.append("tensorboard")
    if o.wandb is not None:
        names.append("wandb")
    return names


def check_run_dir_path(run_dir: Path) -> None:
    """A run directory that names a file is refused before anything else."""
    if Path(run_dir).exists() and not Path(run_dir).is_dir():
        raise ConfigError(f"--run-dir {run_dir} is a file, not a directory")


def check_earlier_run(cfg: JobConfig, run_dir: Path, fresh: bool) -> Decision:
    """What a launch of CFG into RUN_DIR does with the run there, decided before
    anything is written (the module's docstring has the rules). Raises ConfigError
    (exit 2) for a file, a folder that is not a meshforge run, or a run of another
    model."""
    run_dir = Path(run_dir)
    check_run_dir_path(run_dir)
    if runlock.is_held(run_dir):  # a job there now: its lock refuses this launch
        return Decision()
    earlier = None if fresh else earlier_run(run_dir)
    if earlier is None:
        return Decision(warning=warmup_warning(cfg, cfg.train.steps))
    check_is_a_run(earlier)
    changed = model_changes(earlier.config, cfg)
    longer = _context_change(changed, cfg)
    if longer is not None:
        changed.remove(longer)
    if changed:
        why = ""
        if any(c.startswith("model.seq_len ") for c in changed) and cfg.model.name == "gpt":
            why = (
                " (the GPT's learned position table is sized by model.seq_len; a llama, "
                "with rotary positions, goes on at another length)"
            )
        raise ConfigError(
            f"run directory {run_dir} holds a run of another model (the run's -> this "
            f"job's: {', '.join(changed)}){why}; "
            "start over there with --fresh, or use another --run-dir"
        )
    t, reached = cfg.train, earlier.reached
    horizon = earlier.lr_horizon(t.steps)
    if reached is not None and reached >= t.steps:
        return Decision(finished=_nothing_to_train(earlier, t.steps))
    warning = warmup_warning(cfg, horizon)
    if reached is None:
        return Decision(warning=warning)
    span = f"in {run_dir} from step {reached} to {t.steps}"
    if earlier.completed:
        note = f"meshforge: extending the finished run {span}"
    elif t.steps > horizon:
        note = f"meshforge: resuming the run {span}"
    elif longer is None:
        return Decision(warning=warning)  # the workers say they resumed
    else:
        note = f"meshforge: resuming the run {span}"
    if longer is not None:
        note += (
            f" at another sequence length ({longer}): rotary positions, so the weights "
            "do not depend on it; the data windows are cut at the new length"
        )
    return Decision(note=note + lr_past_horizon(cfg, horizon), warning=warning)


def _context_change(changed: list[str], cfg: JobConfig) -> str | None:
    """The `model.seq_len` change among `changed` when the model can take it: meshforge's
    Llama (rotary positions: no weight is sized by the sequence; a run trained at short
    context goes on at a long one, as long-context training does in stages). The GPT's
    learned position table is sized by it, and a user's model is unknown: for those it
    stays a change of model."""
    change = next((c for c in changed if c.startswith("model.seq_len ")), None)
    if change is None or cfg.model.name != "llama":
        return None
    return change


def check_is_a_run(earlier: EarlierRun) -> None:
    """Refuse a folder that is not a meshforge run (a launch would overwrite its
    config.yaml and report.html and append to its metrics.jsonl): its config.yaml is
    not a job config, or it holds metrics.jsonl (with rows: an empty one loses nothing)
    or report.json with neither a config.yaml nor a committed checkpoint."""
    run_dir = earlier.run_dir
    config = run_dir / "config.yaml"
    fresh = (
        ", or --fresh to start a run there (it replaces the files a run writes: "
        "config.yaml, metrics.jsonl, report.*)"
    )
    if config.exists() and not is_job_config(earlier.config):
        has = "a config.yaml that is not a meshforge job config"
        fresh = ""  # --fresh removes only what a run wrote: it would refuse too
    elif not config.exists() and not earlier.checkpoints:
        found = [n for n in ("metrics.jsonl", "report.json") if _has_data(run_dir / n)]
        if not found:
            return
        has = f"{' and '.join(found)} but no config.yaml"
        if not recorded_outputs(run_dir):  # --fresh removes only what a run wrote
            fresh = ""
    else:
        return
    raise ConfigError(
        f"run directory {run_dir} is not a meshforge run directory (it holds {has}); use "
        f"another --run-dir{fresh}"
    )


def _has_data(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def _nothing_to_train(earlier: EarlierRun, steps: int) -> str:
    run_dir, reached = earlier.run_dir, earlier.reached
    where = shlex.quote(str(run_dir))
    report = report_path(run_dir)
    results = f"results: {report}, meshforge report {where}" if report.is_file() else (
        f"results: meshforge report {where}")  # fmt: skip
    if earlier.completed:
        what = f"has finished its {reached} steps"
    else:
        what = (
            f"has trained to step {reached} already (its newest checkpoint), past "
            f"train.steps={steps}: nothing to train"
        )
    return (
        f"meshforge: {run_dir} {what} ({results}); to train on: --set train.steps=N with "
        f"N > {reached}; to start over: --fresh"
    )


def lr_past_horizon(cfg: JobConfig, horizon: int) -> str:
    """What the learning rate does for a run going on to `train.steps` whose schedule
    ends at `horizon` (train/schedule.py: its value at the last step, ever after)."""
    t = cfg.train
    if t.steps <= horizon:
        return f"; the learning rate follows the schedule the run started with (to step {horizon})"
    final = t.lr * lr_factor(horizon - 1, t.warmup, horizon, t.min_lr_ratio)
    return (
        f"; past step {horizon}, the end of its learning-rate schedule (fixed when the run "
        f"started), the learning rate stays at its value at step {horizon}, {final:.3g}"
    )


def warmup_warning(cfg: JobConfig, horizon: int) -> str | None:
    """A schedule whose warm-up is as long as it never decays: say so once, at launch."""
    t = cfg.train
    if t.warmup < horizon:
        return None
    top = t.lr * lr_factor(horizon - 1, t.warmup, horizon, t.min_lr_ratio)
    return (
        f"meshforge: warning: train.warmup={t.warmup} is not below the learning-rate "
        f"schedule's {horizon} steps: the learning rate warms up to {top:.3g} and never "
        "decays (the cosine never runs); a warm-up shorter than train.steps decays it"
    )
