"""The pieces around the training step, each on its own: the checkpoint cadence, the
fault hooks, validation's schedule, and report.json built from a RunSummary (no
trainer, no process group)."""

from __future__ import annotations

import json

import pytest

from meshforge.config import build_config
from meshforge.observe.flight import FlightRecorder
from meshforge.observe.peak import PeakFlops
from meshforge.observe.straggler import StragglerWatch
from meshforge.plan.core.flops import ParamCount
from meshforge.rundir.segments import close_segment, open_segment
from meshforge.train.cadence import CheckpointCadence
from meshforge.train.faults import FAULT_ENV, FaultHooks
from meshforge.train.report import RunSummary, build_report
from meshforge.train.timing import RunTiming
from meshforge.train.validation import Validation


class Saves:
    """Records what the cadence asked to save (the real Checkpointer needs a group)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.states: list[dict] = []

    def save(self, step: int, state: dict) -> None:
        self.steps.append(step)
        self.states.append(state)


def _cadence(tmp_path, every: int, steps: int) -> tuple[CheckpointCadence, Saves, RunTiming]:
    saves, timing = Saves(), RunTiming(0.0, 0.0, 0.0)
    flight = FlightRecorder(tmp_path, 0, 1, enabled=False)
    cadence = CheckpointCadence(
        saves,  # type: ignore[arg-type]
        every,
        steps,
        lambda step, loss: {"step": step, "loss": loss},
        StragglerWatch(1, 0.2, 3),
        timing,
        flight,
    )
    return cadence, saves, timing


def test_the_cadence_saves_every_n_steps_and_after_the_last(tmp_path):
    cadence, saves, timing = _cadence(tmp_path, every=3, steps=7)
    saved = [done for done in range(1, 8) if cadence.after_step(done, False, 1.5)]
    assert saved == saves.steps == [3, 6, 7]
    assert saves.states[-1] == {"step": 7, "loss": 1.5}
    assert cadence.last_saved == 7
    assert timing.last_step_at is not None and timing.final_checkpoint_s is not None


def test_a_stop_saves_at_once_and_every_zero_saves_only_the_last(tmp_path):
    cadence, saves, timing = _cadence(tmp_path, every=0, steps=10)
    assert not cadence.after_step(1, False, None)
    assert timing.last_step_at is None
    assert cadence.after_step(2, True, None)  # asked to stop: the step is kept
    assert saves.steps == [2] and timing.final_checkpoint_s is not None


def test_fault_hooks_strike_only_their_rank_and_step(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "crash:3:1,slow:0:3")
    FaultHooks(0).after_step(3)  # rank 0: not the crash's
    FaultHooks(1).after_step(2)  # rank 1, another step
    with pytest.raises(RuntimeError, match="injected crash at step 3 on rank 1"):
        FaultHooks(1).after_step(3)
    assert FaultHooks(0).slow == 3.0 and FaultHooks(1).slow == 1.0
    monkeypatch.delenv(FAULT_ENV)
    FaultHooks(1).after_step(3)  # unset: nothing at all


def test_validation_is_due_every_eval_every_steps():
    cfg = build_config({"train": {"steps": 10, "eval_every": 4}})
    v = Validation(cfg, None, None, 0, None)  # type: ignore[arg-type]
    assert [s for s in range(1, 11) if v.due(s)] == [4, 8]
    # the last step logged a validation loss: the run's is that one, not measured again
    assert v.final([{"step": 10, "val_loss": 2.5}], stopped=False) == 2.5
    never = Validation(build_config({"train": {"eval_every": 0}}), None, None, 0, None)  # type: ignore[arg-type]
    assert not any(never.due(s) for s in range(1, 11))
    assert never.final([{"step": 3}], stopped=False) is None


def _summary(tmp_path, **changes) -> RunSummary:
    cfg = build_config({"name": "unit", "train": {"steps": 4}})
    fields = dict(
        cfg=cfg,
        run_dir=tmp_path,
        world_size=2,
        device="cpu",
        backend="gloo",
        layout={"dp": 2, "tp": 1, "pp": 1},
        dims=cfg.dims(2),
        params=ParamCount(1000, 10, 990),
        flops_per_token=6000.0,
        flops_convention="6N",
        peak=PeakFlops(1e9, "measured:cpu", "test cpu"),
        comm_method="none",
        memory_advice=["advice"],
        stragglers={1: 1.7},
        lr_horizon=4,
        attempt=0,
        timing=RunTiming(1.0, 1.5, 2.0),
    )
    fields.update(changes)
    return RunSummary(**fields)


def _rows() -> list[dict]:
    return [
        {"step": s, "loss": 3.0 - s / 4, "tokens_per_s": 100.0 * s, "mfu": 0.1,
         "step_time_s": 0.5, "data_s": 0.0, "compute_s": 0.4, "comm_s": 0.05,
         "bubble_s": None, "other_s": 0.05, "data_wait_fraction": 0.0, "segment": 0}
        for s in (2, 4)
    ]  # fmt: skip


def _per_rank() -> list[dict]:
    state = {"params": 8, "grads": 8, "optimizer": 16, "total": 32}
    return [
        {"host": {"host": "h", "addr": "127.0.0.1"}, "state": state, "peak": 100 + r,
         "pipeline": None, "parameter_server": None, "comm": None, "cuda_memory": None}
        for r in range(2)
    ]  # fmt: skip


def test_the_report_is_built_from_a_summary_without_a_trainer(tmp_path):
    segment = open_segment(tmp_path, start_step=0, steps=4, lr_horizon=4, world_size=2,
                           layout={"dp": 2}, run_id="r", attempt=0)  # fmt: skip
    close_segment(tmp_path, segment, 4, "completed", wall_s=3.0)
    report = build_report(
        _summary(tmp_path),
        rows=_rows(),
        per_rank=_per_rank(),
        resumed_from=None,
        last_checkpoint=4,
        val_loss=1.25,
        digest="abc",
        wall_s=3.0,
        data_wait_s=0.0,
        segment=segment,
    )
    json.dumps(report)  # plain data, as report.json holds it
    assert report["status"] == "completed" and report["name"] == "unit"
    assert (report["world_size"], report["device"], report["backend"]) == (2, "cpu", "gloo")
    assert report["model_params"] == 1000 and report["model_params_non_embedding"] == 990
    assert report["peak_flops"] == {"flops_per_s": 1e9, "source": "measured:cpu",
                                    "device": "test cpu"}  # fmt: skip
    assert report["memory_health"] == {"advice": ["advice"], "cuda": None}
    assert report["stragglers"] == [{"rank": 1, "host": "h", "slowdown": 1.7}]
    assert report["communication"]["method"] == "none"
    assert report["predicted"] is None  # no machine profile was measured
    assert report["pipeline"] is None  # pp = 1
    assert (report["val_loss"], report["last_checkpoint"]) == (1.25, 4)
    assert report["final_loss"] == 2.0 and report["steps_trained"] == 4


def test_a_stopped_summary_makes_a_stopped_report(tmp_path):
    stopped = {"step": 2, "signal": "SIGTERM"}
    report = build_report(
        _summary(tmp_path, stopped=stopped),
        rows=_rows()[:1],
        per_rank=_per_rank(),
        resumed_from=None,
        last_checkpoint=2,
        val_loss=None,
        digest="abc",
        wall_s=1.0,
        data_wait_s=0.0,
    )
    assert report["status"] == "stopped" and report["stopped"] == stopped
