"""Everything a launcher does before a worker starts: read the job, decide what can be
decided once, validate it, and lay out the run directory.

Every launcher goes through `prepare_job`: `meshforge train` (the elastic agent on
each node), `meshforge submit mpi` and `meshforge submit slurm`."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshforge.config import JobConfig, load_config, save_config
from meshforge.data.corpus import BUILTIN_PREFIX, check_source, end_of_text_id, load_tokens
from meshforge.errors import ConfigError
from meshforge.launch.rundir import check_earlier_run, outputs_of
from meshforge.plan.jobs.auto import launch_device, resolve_parallel_auto
from meshforge.rundir.files import remove_earlier_run
from meshforge.rundir.outputs import claim_all
from meshforge.runtime.runlock import LOCK_FILE


def validate_job(cfg: JobConfig, world_size: int, device: str | None = None) -> None:
    """`device`: the workers' device type where the launcher knows it (the layout rules
    that need one, e.g. parallel.cp_method=ring's CUDA, wait for the workers' else)."""
    cfg.check_trainable()
    cfg.dims(world_size, device)
    check_data(cfg)
    check_model(cfg)


def check_model(cfg: JobConfig) -> None:
    """A user's factory model is imported and built on the meta device here, once, so
    that a wrong name or a factory that fails answers before any worker starts."""
    if not cfg.model.is_factory:
        return
    from meshforge.models.registry import check_factory

    check_factory(cfg)


def check_data(cfg: JobConfig) -> None:
    """data.source can be read, and the model has an id for every token in it (a shard
    directory's index says how many its tokenizer has; no shard is opened); with
    data.document_masking, its first tokens hold the end-of-text token."""
    check_source(cfg.data.source)
    if cfg.data.document_masking:  # its end-of-text token is known, and in the data
        end_of_text_id(cfg.data.source, cfg.data.cache_dir)
    path = Path(cfg.data.source).expanduser()
    if not (path / "index.json").is_file():
        if cfg.data.source.startswith(BUILTIN_PREFIX):
            return
        # a .bin file or a URL: its ids are checked against model.vocab_size, and a URL's
        # shards fetched into the cache, here once rather than by every worker
        d = cfg.data
        load_tokens(d.source, d.val_fraction, seq_len=cfg.model.seq_len,
                    vocab_size=cfg.model.vocab_size, cache_dir=d.cache_dir)  # fmt: skip
        return
    from meshforge.data.shards import read_index

    vocab = read_index(path, f"data.source {cfg.data.source}").get("vocab_size")
    if isinstance(vocab, int) and vocab > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the vocabulary of the "
            f"tokenizer of data.source {cfg.data.source} ({vocab})"
        )


def check_worlds(cfg: JobConfig, worlds: list[int], device: str | None = None) -> None:
    """The layout must fit every world size the job can run at: an elastic job that
    grows to a size its batch does not divide would fail when the node joins.
    `parallel: auto` is left for global rank 0, which resolves it for the world it has."""
    if cfg.parallel == "auto":
        return
    cfg.check_trainable()
    for world in sorted(set(worlds)):
        try:
            cfg.dims(world, device)
        except ConfigError as exc:
            if len(set(worlds)) == 1:
                raise
            raise ConfigError(
                f"at {world} ranks (this elastic job runs at {min(worlds)}..{max(worlds)}): {exc}"
            ) from None


def validate_for_worlds(cfg: JobConfig, worlds: list[int], device: str | None = None) -> None:
    check_data(cfg)
    check_model(cfg)
    check_worlds(cfg, worlds, device)


@dataclass
class PreparedJob:
    cfg: JobConfig
    run_dir: Path
    config_file: Path  # the file the workers read
    world: int | None  # None while elastic (min < max nodes)
    auto_line: str | None = None
    run_lock: Any = None  # what `lock` returned: a held RunDirLock keeps the directory
    # launch/rundir.py: the line to exit 0 with when the run there has nothing to train
    # (then nothing was written), a line about the earlier run (removed, extended, or
    # resumed past its schedule's horizon) and a warning about the schedule
    finished: str | None = None
    history_line: str | None = None
    schedule_warning: str | None = None


def prepare_job(
    config_path: Path,
    overrides: list[str],
    *,
    nproc_per_node: int,
    min_nodes: int = 1,
    max_nodes: int = 1,
    run_dir: Path | None = None,
    config_name: str = "config.yaml",
    config_file: Path | None = None,
    lock: Callable[[Path], Any] | None = None,
    fresh: bool = False,
    workers_here: bool = False,
) -> PreparedJob:
    """Load, resolve and validate the job; create the run directory; write the config the
    workers read.

    With a fixed world size (one node, or mpirun's -np) `parallel: auto` is resolved
    here. Across nodes it is left for global rank 0 to resolve once the world is known;
    rank 0 then shares its config with every rank (train/worker.py), so two nodes can
    never train different layouts. The workers' config is written to `config_file`, else
    to RUN_DIR/`config_name`.

    A run directory that holds a run already is decided first (launch/rundir.py): a
    run with nothing to train writes nothing and returns `finished`; another model, or
    a folder that is not a meshforge run, is refused; `fresh` removes the earlier run
    once the directory is held.

    `workers_here`: this node runs the workers (`meshforge train`), so the device they
    will use is known here (plan/jobs/auto.py's launch_device) and the layout rules that
    need it (parallel.cp_method=ring: CUDA) refuse before any starts; a submission's
    host may not be the workers', whose own check then refuses."""
    cfg = load_config(config_path, overrides)
    worlds = [n * nproc_per_node for n in range(max_nodes, min_nodes - 1, -1)]
    world = worlds[0] if min_nodes == max_nodes else None
    auto_line = None
    if max_nodes == 1:
        cfg, auto_line = resolve_parallel_auto(cfg, nproc_per_node, nproc_per_node, 1)
    device = launch_device(cfg)[0] if workers_here else None
    if world is not None and cfg.parallel != "auto":
        validate_job(cfg, world, device)
    else:
        validate_for_worlds(cfg, worlds, device)
    run_dir = Path(run_dir or Path("runs") / cfg.name)
    decision = check_earlier_run(cfg, run_dir, fresh)
    history_line = decision.note
    target = Path(config_file) if config_file is not None else run_dir / config_name
    if decision.finished is not None:
        return PreparedJob(cfg, run_dir, target, world, auto_line, finished=decision.finished)
    # After validation (bad input writes nothing), before anything is written: another
    # job's run directory is refused here (runtime/runlock.py).
    lock_file = run_dir / LOCK_FILE
    made_lock = not lock_file.exists()
    run_lock = lock(run_dir) if lock is not None else None
    if fresh:
        try:
            history_line = remove_earlier_run(run_dir)
        except BaseException:  # refused (not a run): leave the folder as it was found
            if run_lock is not None:
                run_lock.release()
            if made_lock:
                lock_file.unlink(missing_ok=True)
            raise
    try:
        # what the run will write is claimed before anything is (rundir/outputs.py)
        claim_all(run_dir, [*outputs_of(cfg), *_entry_of(run_dir, target)])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "logs").mkdir(exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create run directory {run_dir}: {exc.strerror}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    save_config(cfg, target)
    return PreparedJob(cfg, run_dir, target, world, auto_line, run_lock, None, history_line,
                       decision.warning)  # fmt: skip


def _entry_of(run_dir: Path, path: Path) -> list[str]:
    """The top-level entry of RUN_DIR that PATH is in ([] when it is elsewhere)."""
    try:
        return [Path(os.path.abspath(path)).relative_to(os.path.abspath(run_dir)).parts[0]]
    except (ValueError, IndexError):
        return []


def layout_line(cfg: JobConfig, world: int, run_dir: Path) -> str:
    dims = cfg.dims(world)
    if dims.parameter_server:
        kind = "synchronous" if dims.ps_sync else f"asynchronous, staleness <= {dims.max_staleness}"
        return (
            f"meshforge: training {cfg.name!r} on {world} process(es): {dims.dp} worker(s) + "
            f"{dims.servers} parameter server(s) ({kind}) micro-batches={dims.microbatches} "
            f"dtype={cfg.precision.dtype} -> {run_dir}"
        )
    pp = f" ({dims.pp_schedule})" if dims.pp_enabled else ""
    pp += f" ep={dims.ep}" if dims.ep_enabled else ""
    pp += f" cp={dims.cp} ({dims.cp_method})" if dims.cp_enabled else ""
    comm = cfg._parallel().comm
    extra = f" compression={comm.compression}" if comm.compression != "none" else ""
    extra += "" if comm.overlap else " overlap=off"
    extra += f" prefetch={comm.prefetch}" if comm.prefetch is not None else ""
    extra += f" reduce={comm.reduce_dtype}" if comm.reduce_dtype != "fp32" else ""
    return (
        f"meshforge: training {cfg.name!r} on {world} worker(s): dp={dims.dp} tp={dims.tp} "
        f"pp={dims.pp}{pp} zero={dims.zero} micro-batches={dims.microbatches}{extra} "
        f"dtype={cfg.precision.dtype} -> {run_dir}"
    )


def report_failure(run_dir: Path, diagnosis: dict) -> int:
    """Write the failure report and print the one line naming the rank that failed."""
    from meshforge.train.report import write_failure_report

    first = diagnosis["first_failure"]
    write_failure_report(run_dir, diagnosis)
    print(
        f"meshforge: rank {first['rank']} failed ({first['exit']}): {first['error']} "
        f"[log: {first['log']}]",
        file=sys.stderr,
    )
    if diagnosis.get("summary") and diagnosis.get("verdict") not in (None, "unknown"):
        print(
            f"meshforge: diagnosis ({diagnosis['verdict']}): {diagnosis['summary']} "
            f"[details: meshforge diagnose {shlex.quote(str(run_dir))}]",
            file=sys.stderr,
        )
    return 1
