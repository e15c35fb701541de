"""Fabric.save and Fabric.load: a user's training state as one checkpoint directory.

The directory holds the torch.distributed.checkpoint (DCP) shards of the entries of
the user's `state` dict, `fabric.json` (what kind each entry is, the strategy and world
size that wrote it) and train/checkpoint.py's `manifest.json` (each file's sha256).
An entry is one of:

    module     a model setup placed (or any nn.Module): get_state_dict's full parameter
               names, so a checkpoint written under any strategy and world size loads
               under any other (DCP reshards)
    optimizer  an optimizer setup returned, its state under the same names
    stateful   anything with state_dict()/load_state_dict() (a scheduler)
    value      tensors and plain data; `load` returns them
    scaler     the fp16 loss scaler's state, under a key of meshforge's own

A save follows train/checkpoint.py's commit protocol: every rank writes into a
temporary sibling directory and hashes its own files, rank 0 writes the manifest and
renames the directory into place, and each stage ends with the ranks agreeing on
whether any failed, so a failed save raises the same CheckpointError on every rank and
leaves what was at `path` as it was. A load reads data only, never code.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from meshforge.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from meshforge.parallel.data_parallel import DataParallelModel

FABRIC_INDEX = "fabric.json"  # what each top-level entry of a Fabric checkpoint is
_SCALER_KEY = "_meshforge_scaler"  # the fp16 loss scaler's state, saved alongside


def save(
    path: str | os.PathLike,
    state: dict[str, Any],
    pars: list[DataParallelModel],
    scaler: Any,
    strategy: str,
) -> Path:
    """Fabric.save: write `state` to the checkpoint directory `path` (collective).
    `pars`: the models fabric.setup placed; `scaler`: its fp16 loss scaler or None;
    `strategy`: the one named, recorded in the index."""
    from meshforge.train.checkpoint import (
        commit_checkpoint_dir,
        problem_from_rank0,
        why_write_failed,
        write_and_hash,
    )

    if not isinstance(state, dict):
        raise ConfigError(f"fabric.save takes a dict of named values, not {type(state).__name__}")
    path = Path(path).absolute()
    entries: dict[str, str] = {}
    to_write: dict[str, Any] = {}
    for key, obj in state.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"fabric.save: key {key!r} must be a non-empty str")
        if key == _SCALER_KEY:
            raise ConfigError(f"fabric.save: key {key!r} is meshforge's own (the fp16 scaler)")
        kind = _kind(pars, key, obj)
        entries[key] = kind
        to_write[key] = obj if kind == "value" else _state_of(pars, kind, obj)
        if kind != "module":  # a module's state is tensors; the rest must be data
            _check_plain_data(to_write[key], key)
    if scaler is not None:
        entries[_SCALER_KEY] = "scaler"
        to_write[_SCALER_KEY] = scaler.state_dict()
    rank = dist.get_rank()
    parent = path.parent
    tmp = parent / f".tmp-{path.name}"

    def fail_all(problem: str | None) -> None:
        if problem is not None:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"cannot save checkpoint {path}: {problem}")

    # 1. rank 0 makes the empty temporary directory
    problem = None
    if rank == 0:
        try:
            _prepare_save(path, tmp)
        except Exception as exc:
            problem = why_write_failed(exc, parent)
    fail_all(problem_from_rank0(problem))
    # 2. every rank writes its shards (DCP's save is collective) and hashes them
    merged = write_and_hash(to_write, tmp, parent, fail_all)
    # 3. rank 0 commits: the index, the manifest, the rename into place
    problem = None
    if rank == 0:
        index = {
            "format": "meshforge-fabric-v1",
            "entries": entries,
            "strategy": strategy,
            "world_size": dist.get_world_size(),
        }
        step = state.get("step")
        try:
            (tmp / FABRIC_INDEX).write_text(json.dumps(index, indent=1))
            commit_checkpoint_dir(parent, tmp, path, step if isinstance(step, int) else 0, merged)
        except Exception as exc:
            problem = why_write_failed(exc, parent)
    fail_all(problem_from_rank0(problem))
    return path


def load(
    path: str | os.PathLike,
    state: dict[str, Any] | None,
    strict: bool,
    pars: list[DataParallelModel],
    scaler: Any,
) -> dict[str, Any]:
    """Fabric.load: fill `state`'s objects from the checkpoint at `path` (collective);
    returns the plain values saved. `pars`, `scaler`: as for `save`."""
    from meshforge.train.checkpoint import SafeFileSystemReader, problem_from_rank0, read_dcp

    path = Path(path).absolute()
    state = {} if state is None else state
    problem = problem_from_rank0(_load_problem(path) if dist.get_rank() == 0 else None)
    if problem is not None:
        raise CheckpointError(f"cannot load checkpoint {path}: {problem}")
    try:
        entries = json.loads((path / FABRIC_INDEX).read_text())["entries"]
        metadata = SafeFileSystemReader(str(path)).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"cannot load checkpoint {path}: {_first_line(exc)}") from None
    stored = set(metadata.state_dict_metadata)

    template: dict[str, Any] = {}
    objects: dict[str, tuple[str, Any]] = {}
    for key, obj in state.items():
        kind = _kind(pars, key, obj)
        if kind == "value":
            continue  # plain values come back from what the checkpoint holds
        saved = entries.get(key)
        if saved is None:
            if strict:
                held = ", ".join(k for k in entries if k != _SCALER_KEY) or "nothing"
                raise CheckpointError(
                    f"cannot load checkpoint {path}: it has no {key!r} (it holds {held})"
                )
            continue
        if saved != kind:
            raise CheckpointError(
                f"cannot load checkpoint {path}: {key!r} is a {saved} there, given a {kind}"
            )
        part = _state_of(pars, kind, obj)
        if kind == "optimizer":  # options a checkpoint lacks (initial_lr) stay as they are
            part = {
                k: v
                for k, v in part.items()
                if not k.startswith("param_groups.") or f"{key}.{k}" in stored
            }
        template[key] = part
        objects[key] = (kind, obj)
    if entries.get(_SCALER_KEY) == "scaler" and scaler is not None:
        template[_SCALER_KEY] = scaler.state_dict()
    values = [k for k, kind in entries.items() if kind == "value"]
    _plain_value_templates(template, metadata, values)

    read_dcp(template, path)

    for key, (kind, obj) in objects.items():
        if kind == "module":
            par = _placed(pars, obj)
            if par is not None:
                par.load_model_state_dict(template[key])
            else:
                from torch.distributed.checkpoint.state_dict import set_model_state_dict

                set_model_state_dict(obj, template[key])
        elif kind == "optimizer":
            _placed(pars, obj).load_optimizer_state_dict(template[key])
        else:
            obj.load_state_dict(template[key])
    if _SCALER_KEY in template:
        scaler.load_state_dict(template[_SCALER_KEY])
    out = {k: template[k] for k in values if k in template}
    for key in out:
        if key in state:
            state[key] = out[key]
    return out


def _placed(pars: list[DataParallelModel], obj: Any) -> DataParallelModel | None:
    """The placed model that `obj` (its model, module or optimizer) belongs to."""
    for par in pars:
        if obj is par.model or obj is par.module or obj is par.optimizer:
            return par
    return None


def _kind(pars: list[DataParallelModel], key: str, obj: Any) -> str:
    if isinstance(obj, nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        if _placed(pars, obj) is None:
            raise ConfigError(
                f"state[{key!r}]: an optimizer that fabric.setup did not return (use the "
                "one it returned)"
            )
        return "optimizer"
    if callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    ):
        return "stateful"
    return "value"


def _state_of(pars: list[DataParallelModel], kind: str, obj: Any) -> Any:
    """What is written for an object of `kind` (and read back into, in place)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if kind == "module":
        par = _placed(pars, obj)
        return par.model_state_dict() if par is not None else get_model_state_dict(obj)
    if kind == "optimizer":
        return _placed(pars, obj).optimizer_state_dict()
    return obj.state_dict()


def _strip_tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, dict):
        return {k: _strip_tensors(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_strip_tensors(v) for v in value)
    return value


def _check_plain_data(value: Any, key: str) -> None:
    """Refuse at save what a load could not read back as data (torch's weights_only)."""
    buffer = io.BytesIO()
    try:
        torch.save(_strip_tensors(value), buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as exc:
        raise ConfigError(
            f"fabric.save: state[{key!r}] holds more than tensors and plain values "
            f"({_first_line(exc)}): a checkpoint stores data only"
        ) from None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _prepare_save(path: Path, tmp: Path) -> None:
    if path.exists() and not (path / FABRIC_INDEX).is_file():
        raise FileExistsError(f"{path} exists and is not a Fabric checkpoint; not replaced")
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()


def _load_problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be loaded, or None."""
    from meshforge.train.checkpoint import verify

    if not path.exists():
        return "no such directory"
    if not path.is_dir():
        return "not a directory"
    problem = verify(path)
    if problem is not None:
        return problem
    if not (path / FABRIC_INDEX).is_file():
        return f"no {FABRIC_INDEX}: not a checkpoint written by Fabric.save"
    return None


def _plain_value_templates(template: dict[str, Any], metadata: Any, keys: list[str]) -> None:
    """Slots to read the plain values `keys` into, rebuilt from the DCP metadata (each
    stored item's path in the saved dict, its tensor's shape and dtype)."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    wanted = set(keys)
    paths = metadata.planner_data or {}
    for flat, md in metadata.state_dict_metadata.items():
        item_path = paths.get(flat, (flat,))
        if item_path[0] not in wanted:
            continue
        slot = None
        if isinstance(md, TensorStorageMetadata):
            slot = torch.empty(md.size, dtype=md.properties.dtype)
        if len(item_path) == 1:
            template[item_path[0]] = slot
        else:
            set_element(template, item_path, slot)
