"""A job config seen by the planner (pure: no torch, no I/O).

`predict_for_job` is what `report.json`'s `predicted` says: a job config mapped onto
`plan.core.predict.predict_run`; on a CPU host with the trainer's own semantics for
data-parallel traffic (`plan.jobs.auto.host_step_time`). The profile is usually the one
the run measured of its own machine (`train.calibration.measure_profile`).

`plan_for_job` is what `meshforge plan --config` plans: the job's model, its training
and the layout fields it gives; the fields it leaves out (or sets to `auto`) are
searched, among the layouts the trainer accepts for this job.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from meshforge.config import JobConfig, ParallelConfig, check_comm
from meshforge.errors import ConfigError
from meshforge.plan.core.dp_traffic import rank_models
from meshforge.plan.core.flops import GPTShape, params_per_rank, shape_of
from meshforge.plan.core.layout import Layout, Training
from meshforge.plan.core.memory import model_state_bytes
from meshforge.plan.core.predict import Prediction, predict_run
from meshforge.plan.core.profile import MachineProfile
from meshforge.plan.core.search import CP_SEARCH_MIN_SEQ, LayoutChoice
from meshforge.plan.core.timing import HostCosts, host_step_time


def _collective_only(cfg: JobConfig) -> None:
    if cfg.parallel != "auto" and cfg.parallel.mode == "parameter_server":
        raise ConfigError("the planner models parallel.mode=collective only, not parameter_server")


def param_bytes_per_rank(cfg: JobConfig, world_size: int) -> float:
    """Bytes of the parameters one rank holds (the planner's count)."""
    _collective_only(cfg)
    p = cfg.parallel
    rank_params = params_per_rank(shape_of(cfg), p.tp, p.pp).total
    dp = cfg.resolve_dp(world_size)
    # ZeRO shards over the dp x cp ranks (the cp ranks hold the same weights)
    return model_state_bytes(rank_params, p.zero, dp * p.cp, cfg.precision.dtype)["params"]


def predict_for_job(
    cfg: JobConfig,
    world_size: int,
    profile: MachineProfile,
    runtime_bytes: float = 0.0,
    host: HostCosts | None = None,
) -> dict[str, Any]:
    """What the planner predicts for `cfg` at `world_size` ranks on `profile`.

    On a CPU host (`host` given, or a profile named cpu...) the data-parallel and
    optimizer terms follow meshforge's trainer on gloo (`plan.jobs.auto.host_step_time`:
    no overlap of FSDP's collectives, per-unit latency, DTensor optimizer); on a GPU
    the planner's own time model. The trainer's `activation_checkpointing: selective`
    recomputes every other block in full, which is not Korthikanti's selective
    recomputation: it is predicted as half the layers with `none` and half with
    `full` (memory and time are sums over layers). `memory_total_bytes` adds
    `runtime_bytes` (the process's own baseline on a CPU) to the planner's total."""
    _collective_only(cfg)
    dp = cfg.resolve_dp(world_size)
    p, t = cfg.parallel, cfg.train
    layout = Layout(dp=dp, tp=p.tp, pp=p.pp, zero=p.zero, virtual_stages=p.virtual_stages,
                    ep=p.ep, cp=p.cp, cp_method=p.cp_method)  # fmt: skip
    shape = shape_of(cfg)
    if host is None and profile.name.startswith("cpu"):
        host = HostCosts.from_profile(profile)
    cluster = profile.to_cluster(world_size)

    def run(recompute: str) -> tuple[Any, dict[str, float]]:
        pred = predict_run(
            shape, layout, t.global_batch, t.micro_batch, cfg.precision.dtype, recompute,
            profile, optimizer="adamw", sdpa=True, schedule=p.pp_schedule,
        )  # fmt: skip
        if host is None:
            return pred, pred.time.to_dict()
        times = host_step_time(pred, shape, cluster, host, p.comm.bucket_mb,
                               schedule=p.pp_schedule)  # fmt: skip
        if (recompute == "full" and host.recompute_layer_s is not None and not model_timed
                and layout.cp == 1):  # fmt: skip
            # recomputation as timed on a layer (of whole sequences), in place of the
            # curve's FLOPs
            _, plain = run("none")
            m = pred.training.microbatches(layout.dp)
            layers = max(r.layers for r in rank_models(shape, layout.tp, layout.pp))
            compute = plain["compute_s"] + m * layers * host.recompute_layer_s
            times["step_s"] += compute - times["compute_s"]
            times["compute_s"] = compute
        return pred, times

    m = t.global_batch // (t.micro_batch * dp)
    # the model timed whole: under the job's tensor parallelism (whole sequences: not
    # under cp), or its whole step (tp 1, whose model parts recompute as the job does)
    model_timed = host is not None and (
        (
            layout.cp == 1
            and host.tensor_parallel is not None
            and host.tensor_parallel.matches(layout, t.micro_batch, m)
        )
        or (host.steps is not None and host.steps.matches(layout, p.pp_schedule, t.micro_batch, m))
    )

    mode = t.activation_checkpointing
    parts = [run("none"), run("full")] if mode == "selective" else [run(mode)]

    def mean(get) -> float:
        return sum(get(pred, times) for pred, times in parts) / len(parts)

    first = parts[0][0]
    states = {
        "params": first.memory.params,
        "grads": first.memory.grads,
        "optimizer": first.memory.optimizer,
        "total": first.memory.model_states,
    }
    planner_total = mean(lambda pred, _: pred.memory.total)
    step_s = mean(lambda _, times: times["step_s"])
    breakdown = {key: mean(lambda _, times, k=key: times[k]) for key in parts[0][1]}
    return {
        "model_state_bytes": states,
        "activations_bytes": mean(lambda pred, _: pred.memory.activations or 0.0),
        "working_bytes": first.memory.working,
        "planner_memory_total_bytes": planner_total,
        "runtime_bytes": runtime_bytes,
        "memory_total_bytes": planner_total + runtime_bytes,
        "step_time_s": step_s,
        "tokens_per_s": t.global_batch * shape.seq_len / step_s,
        "time_model": "planner" if host is None else "planner + cpu host (plan.jobs.auto)",
        "time_breakdown_s": breakdown,
        "layout": {
            **layout.to_dict(),
            "micro_batch": t.micro_batch,
            "recompute": mode,
            "pp_schedule": p.pp_schedule if layout.pp > 1 else "none",
        },
        "profile": profile.to_dict(),
        "host": None if host is None else asdict(host),
        "warnings": host_warnings(host),
    }


def host_warnings(host: HostCosts | None) -> list[str]:
    """What makes a CPU host's timed figures doubtful: a second block timed as costing
    less than nothing means the machine's load changed while they were taken."""
    out = []
    timed = [
        ("data-parallel wrapping", host and host.wrapped, "block"),
        ("tensor-parallel model", host and host.tensor_parallel, "block"),
        ("step", host and host.steps, "layer"),
    ]
    for name, figures, unit in timed:
        if not figures:
            continue
        one = getattr(figures, f"one_{unit}_s")
        two = getattr(figures, f"two_{unit}s_s")
        if two < one:
            out.append(
                f"the {name} was timed faster with two {unit}s than with one "
                f"({two * 1e3:.1f} vs {one * 1e3:.1f} ms): the machine's load changed while "
                "it was measured; the step-time prediction is doubtful (`meshforge train "
                "--recalibrate` on a quieter machine measures again)"
            )
    return out


# -- what `meshforge plan --config` plans ----------------------------------------------------

# The job's fields behind each layout field of the planner (LayoutChoice).
JOB_FIELDS = {
    "dp": "parallel.dp",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "zero": "parallel.zero",
    "micro_batch": "train.micro_batch",
    "virtual_stages": "parallel.virtual_stages",
    "recompute": "train.activation_checkpointing",
    "sequence_parallel": "parallel.sequence_parallel",
    "ep": "parallel.ep",
    "cp": "parallel.cp",
    "cp_method": "parallel.cp_method",
}
# Pipeline schedules the planner's time and memory models describe (a v > 1 layout is
# interleaved 1F1B); GPipe keeps every micro-batch's activations, ZB-V splits backward.
_MODELLED_SCHEDULES = ("1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class JobPlan:
    """A job as the planner sees it: its model shape, its training, and the layout
    fields it gives (None in `choice`: searched). `trainer_cp`: the layouts it checks
    carry cp and cp_method to the trainer's rules (`meshforge plan --config`: the
    trainer builds context parallelism, and refuses it with experts, compile, a
    user's model, ring on CPU workers, Ulysses over heads cp does not divide); False
    (`plan --model`, which plans a cp run for any trainer): the rules see the dp x cp
    ranks as data parallel."""

    cfg: JobConfig
    shape: GPTShape
    training: Training
    choice: LayoutChoice
    trainer_cp: bool = False

    @property
    def world_size(self) -> int | None:
        """dp x tp x pp (x cp) when the job (or a flag) gives all three."""
        c = self.choice
        if None in (c.dp, c.tp, c.pp):
            return None
        return c.dp * c.tp * c.pp * (c.cp or 1)  # type: ignore[operator]

    def layout_fields(self) -> dict[str, str]:
        return layout_fields(self.choice)

    def refusal(self, prediction: Prediction) -> str | None:
        """Why `meshforge train` would refuse this job with the prediction's layout
        written in (parallel/dims.py's rules, parallel.comm's), or None if it runs it."""
        lay, train = prediction.layout, prediction.training
        if self.choice.recompute is None and train.recompute == "selective":
            # the planner's selective (Korthikanti's) is not the trainer's (every other
            # block recomputed in full): a search offers only what the trainer does
            return "the trainer's activation checkpointing is none, full or every other block"
        if self.cfg.parallel == "auto" and (
            lay.virtual_stages > 1 or lay.sequence_parallel or lay.ep > 1 or lay.cp > 1
        ):
            # plan/jobs/auto.py
            return "parallel: auto chooses 1F1B without sequence, expert or context parallelism"
        try:
            self._check(lay, train.micro_batch)
        except ConfigError as exc:
            return str(exc)
        return None

    def check_given(self, n_gpus: int) -> None:
        """The trainer's own checks of the layout the job gives, before any search, so
        that a job it would refuse is refused naming the job's fields. Only when the
        given fields fix dp, tp, pp and the micro-batch; otherwise the search decides."""
        c, p = self.choice, self.cfg.parallel
        if c.tp is None or c.pp is None or c.micro_batch is None or p == "auto":
            return
        if c.cp is None and self.shape.seq_len >= CP_SEARCH_MIN_SEQ:
            return  # cp searched: the search decides
        cp = c.cp or 1
        if n_gpus % (c.tp * c.pp * cp) or c.dp not in (None, n_gpus // (c.tp * c.pp * cp)):
            return  # the search names the broken degree
        if c.virtual_stages is None and p.pp_schedule == "interleaved_1f1b":
            return
        dp = n_gpus // (c.tp * c.pp * cp)
        v, sp = c.virtual_stages or 1, bool(c.sequence_parallel)
        layout = Layout(dp=dp, tp=c.tp, pp=c.pp, zero=c.zero or 0, virtual_stages=v,
                        sequence_parallel=sp, ep=c.ep or 1, cp=cp,
                        cp_method=c.cp_method or "allgather")  # fmt: skip
        self._check(layout, c.micro_batch, comm=c.zero is not None)  # comm depends on zero

    def _check(self, lay: Layout, micro_batch: int, comm: bool = True) -> None:
        """`meshforge train`'s checks of this job with `lay` and `micro_batch` written in
        (with `comm`, also parallel.comm's settings against the layout)."""
        p = ParallelConfig() if self.cfg.parallel == "auto" else self.cfg.parallel
        schedule = "interleaved_1f1b" if lay.virtual_stages > 1 else p.pp_schedule
        if lay.pp > 1 and schedule not in _MODELLED_SCHEDULES:
            raise ConfigError(f"the planner does not model parallel.pp_schedule={schedule}")
        if self.trainer_cp:  # the trainer's own cp rules (the class docstring)
            cp = {"dp": lay.dp, "cp": lay.cp, "cp_method": lay.cp_method}
        else:  # a cp run of any trainer: the dp x cp ranks seen as data parallel
            cp = {"dp": lay.dp * lay.cp, "cp": 1}
        parallel = p.model_copy(
            update={"tp": lay.tp, "pp": lay.pp, "zero": lay.zero,
                    "sequence_parallel": lay.sequence_parallel, "pp_schedule": schedule,
                    "virtual_stages": lay.virtual_stages, "ep": lay.ep, **cp}
        )  # fmt: skip
        train = self.cfg.train.model_copy(update={"micro_batch": micro_batch})
        cfg = self.cfg.model_copy(update={"parallel": parallel, "train": train})
        try:
            if comm:
                check_comm(parallel)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        cfg.dims(lay.world_size)


def layout_fields(choice: LayoutChoice, searched: str = "searched") -> dict[str, str]:
    """{"dp": "given" | "searched", ...}: which layout fields the user fixed. The
    context-parallel fields (cp, cp_method) are listed only where given (cp above 1)."""
    return {
        f.name: "given" if getattr(choice, f.name) is not None else searched
        for f in fields(choice)
        if f.name not in ("cp", "cp_method") or getattr(choice, f.name) not in (None, 1)
    }


def job_choice(cfg: JobConfig) -> LayoutChoice:
    """The layout fields a job gives. A field the job file (or `--set`) names is given;
    one it leaves out, `dp: auto`, or every field under `parallel: auto` is searched.
    `train.micro_batch` is searched when the job leaves it out or says `parallel: auto`
    (which chooses it at launch); `train.activation_checkpointing` when it is left out.
    `parallel.cp` left out is searched as `plan --model` searches it (at long sequences
    only, plan.core.search); `parallel.cp_method` left out is allgather."""
    t = cfg.train
    named_train = t.model_fields_set
    recompute = t.activation_checkpointing if "activation_checkpointing" in named_train else None
    if cfg.parallel == "auto":
        return LayoutChoice(recompute=recompute, cp=1)
    p: ParallelConfig = cfg.parallel
    named = p.model_fields_set

    def given(name: str) -> Any:
        return getattr(p, name) if name in named else None

    virtual = given("virtual_stages")
    if virtual is None and "pp_schedule" in named and p.pp_schedule != "interleaved_1f1b":
        virtual = 1  # a schedule without interleaving, named
    if given("pp") == 1:  # no pipeline: chunks per stage do not apply
        virtual = None if virtual is None else 1
    return LayoutChoice(
        dp=None if p.dp == "auto" else p.dp,
        tp=given("tp"),
        pp=given("pp"),
        zero=given("zero"),
        micro_batch=t.micro_batch if "micro_batch" in named_train else None,
        virtual_stages=virtual,
        recompute=recompute,
        sequence_parallel=given("sequence_parallel"),
        ep=given("ep"),
        cp=given("cp"),
        cp_method=given("cp_method"),
    )


def _check_schedule(cfg: JobConfig, choice: LayoutChoice, flags: LayoutChoice) -> None:
    """The job's pipeline schedule against the layout after the flags: one the planner
    does not model is refused only when a pipeline is given; --virtual-stages > 1 needs
    the interleaved schedule, as `--set parallel.virtual_stages` would."""
    if cfg.parallel == "auto":
        return
    p: ParallelConfig = cfg.parallel
    if (choice.pp or 1) > 1 and p.pp_schedule not in _MODELLED_SCHEDULES:
        raise ConfigError(
            f"parallel.pp_schedule={p.pp_schedule}: the planner models the 1f1b and "
            "interleaved_1f1b schedules only"
        )
    if (flags.virtual_stages or 1) > 1 and p.pp_schedule != "interleaved_1f1b":
        raise ConfigError(
            f"--virtual-stages {flags.virtual_stages} with --config: the job's "
            f"parallel.pp_schedule={p.pp_schedule} holds one stage per rank; add "
            "--set parallel.pp_schedule=interleaved_1f1b"
        )


def plan_for_job(cfg: JobConfig, flags: LayoutChoice = LayoutChoice()) -> JobPlan:
    """What `meshforge plan --config` plans for `cfg`: its shape (a preset resolved by
    the config), global batch, precision and activation checkpointing; the trainer's
    AdamW and SDPA attention; the layout fields the job gives, each overridden by the
    same field in `flags` (the command line's --dp, --tp, ...). ConfigError for what the
    planner cannot model: a user's factory model, parameter-server mode, a GPipe or
    ZB-V pipeline. Context parallelism (parallel.cp, or --cp and --cp-method) is planned
    among the layouts the trainer builds (`JobPlan.trainer_cp`)."""
    _collective_only(cfg)
    shape = shape_of(cfg)
    choice = job_choice(cfg)
    overrides = {f.name: getattr(flags, f.name) for f in fields(flags)}
    choice = replace(choice, **{k: v for k, v in overrides.items() if v is not None})
    _check_schedule(cfg, choice, flags)
    t = cfg.train
    training = Training(
        global_batch=t.global_batch,
        micro_batch=choice.micro_batch or t.micro_batch,
        precision=cfg.precision.dtype,
        recompute=choice.recompute or "none",
        optimizer="adamw",  # train/optim.py: the trainer's only optimizer
        sdpa=True,  # models/: attention through scaled_dot_product_attention
    )
    return JobPlan(cfg, shape, training, choice, trainer_cp=True)
