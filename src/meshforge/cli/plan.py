"""`meshforge plan`: memory, step time and MFU of a layout, or the best layouts for N GPUs;
of a model given by flags, or of a job file (`--config`, the job `meshforge train` runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from meshforge.cli.app import app
from meshforge.plan.core.gpus import ALIASES, GPU_BY_KEY
from meshforge.presets import PRESETS

if TYPE_CHECKING:
    from meshforge.plan.core.predict import Prediction
    from meshforge.plan.core.search import LayoutChoice
    from meshforge.plan.jobs.job import JobPlan

_JOB = "Job"
_MODEL = "Model (not with --config: the job gives it)"
_CLUSTER = "Cluster"
_TRAINING = "Training (not with --config: the job gives it)"
_LAYOUT = "Layout (left out: searched; with --config, each overrides the job's field)"


def _opt(*names: str, help: str, panel: str, metavar: str | None = None):
    return typer.Option(*names, help=help, rich_help_panel=panel, metavar=metavar)


# Option types shared with `meshforge cost` (which plans a run from the same flags).
Preset = Annotated[
    str | None,
    _opt(
        "--model",
        help=f"A model preset ({', '.join(PRESETS)}); shape flags override it.",
        panel=_MODEL,
    ),
]
Layers = Annotated[int | None, _opt("--layers", help="Transformer layers.", panel=_MODEL)]
Hidden = Annotated[int | None, _opt("--hidden", help="Hidden size h.", panel=_MODEL)]
Heads = Annotated[int | None, _opt("--heads", help="Attention heads.", panel=_MODEL)]
Vocab = Annotated[int | None, _opt("--vocab", help="Vocabulary size.", panel=_MODEL)]
Seq = Annotated[int | None, _opt("--seq", help="Sequence length.", panel=_MODEL)]
MlpRatio = Annotated[
    float | None,
    _opt("--mlp-ratio", help="MLP width / h (default 4; 2.6875 for a SwiGLU-sized MLP).",
         panel=_MODEL),
]  # fmt: skip
TiedHead = Annotated[
    bool | None,
    _opt("--tie-embeddings/--no-tie-embeddings",
         help="Whether the output head shares the token embedding (default: a preset's; "
         "tied for a shape given by flags, as meshforge's gpt).", panel=_MODEL),
]  # fmt: skip
Family = Annotated[
    str | None,
    _opt("--family", help="gpt (LayerNorm, GELU MLP; default) or llama (RMSNorm, SwiGLU, "
         "rotary, a token embedding only).", panel=_MODEL),
]  # fmt: skip
KvHeads = Annotated[
    int | None,
    _opt("--kv-heads", help="Key/value heads (grouped-query attention; default: --heads).",
         panel=_MODEL),
]  # fmt: skip
HeadDim = Annotated[
    int | None,
    _opt("--head-dim", help="Width of one attention head (llama; default --hidden / --heads): "
         "q is heads x head-dim wide, k and v kv-heads x head-dim.", panel=_MODEL),
]  # fmt: skip
Experts = Annotated[
    int | None,
    _opt("--experts", help="Routed experts per layer: a mixture of experts (llama; needs "
         "--expert-ffn).", panel=_MODEL),
]  # fmt: skip
TopK = Annotated[
    int | None, _opt("--top-k", help="Routed experts per token (default 2).", panel=_MODEL)
]
ExpertFfn = Annotated[
    int | None, _opt("--expert-ffn", help="Each expert's SwiGLU width.", panel=_MODEL)
]
SharedExperts = Annotated[
    int | None,
    _opt("--shared-experts", help="Experts every token passes through (default 0).",
         panel=_MODEL),
]  # fmt: skip
DenseLayers = Annotated[
    int | None,
    _opt("--dense-layers", help="Dense layers before the first MoE one (default 0).",
         panel=_MODEL),
]  # fmt: skip
Params = Annotated[
    float | None,
    _opt("--params", help="Bare parameter count (model-state maths only).", panel=_MODEL),
]
Gpus = Annotated[int | None, _opt("--gpus", help="GPUs (or ranks).", panel=_CLUSTER)]
GlobalBatch = Annotated[
    int | None, _opt("--global-batch", help="Sequences per step.", panel=_TRAINING)
]
Precision = Annotated[
    str | None, _opt("--precision", help="bf16 (default), fp16 or fp32.", panel=_TRAINING)
]
Optimizer = Annotated[
    str | None, _opt("--optimizer", help="adamw (default) or sgd.", panel=_TRAINING)
]
Attention = Annotated[
    str | None, _opt("--attention", help="sdpa (fused, default) or eager.", panel=_TRAINING)
]
Dp = Annotated[int | None, _opt("--dp", help="Data-parallel degree.", panel=_LAYOUT)]
Tp = Annotated[int | None, _opt("--tp", help="Tensor-parallel degree.", panel=_LAYOUT)]
Pp = Annotated[int | None, _opt("--pp", help="Pipeline stages.", panel=_LAYOUT)]
Zero = Annotated[int | None, _opt("--zero", help="ZeRO stage 0-3.", panel=_LAYOUT)]
MicroBatch = Annotated[
    int | None, _opt("--micro-batch", help="Sequences per micro-batch.", panel=_LAYOUT)
]
VirtualStages = Annotated[
    int | None,
    _opt("--virtual-stages", help="Chunks per stage (interleaved 1F1B).", panel=_LAYOUT),
]
Recompute = Annotated[
    str | None, _opt("--recompute", help="none, selective or full.", panel=_LAYOUT)
]
SequenceParallel = Annotated[
    bool | None,
    _opt("--sequence-parallel/--no-sequence-parallel", help="With TP.", panel=_LAYOUT),
]
Ep = Annotated[
    int | None,
    _opt("--ep", help="Expert-parallel degree (ranks borrowed from dp; divides dp and "
         "--experts).", panel=_LAYOUT),
]  # fmt: skip
Cp = Annotated[
    int | None,
    _opt("--cp", help="Context-parallel degree: each sequence split over cp ranks (world = "
         "pp x dp x cp x tp; searched at seq >= 16384 when left out). With --config, among "
         "the layouts the trainer builds (parallel.cp_method allgather, no pp, experts "
         "or compile).", panel=_LAYOUT),
]  # fmt: skip
CpMethod = Annotated[
    str | None,
    _opt("--cp-method", help="How cp ranks exchange K/V: allgather (default, Llama 3), "
         "ring (overlapped with attention) or alltoall (Ulysses; heads divisible by cp).",
         panel=_LAYOUT),
]  # fmt: skip
AsJson = Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")]


@app.command("plan", rich_help_panel="Plan")
def plan_command(
    config: Annotated[
        Path | None,
        _opt(
            "--config",
            help="A job file: plan the job `meshforge train` runs (its model, batch, "
            "precision; the layout fields it names are kept, the others searched). Layout "
            "flags (--dp ... --sequence-parallel) override the job's; model and training "
            "flags are refused: use --set.",
            panel=_JOB,
        ),
    ] = None,
    overrides: Annotated[
        list[str] | None,
        _opt(
            "--set",
            help="Override a job key, as for train (repeat it for more: --set a=1 --set b=2).",
            panel=_JOB,
            metavar="KEY.PATH=VALUE",
        ),
    ] = None,
    preset: Preset = None,
    layers: Layers = None,
    hidden: Hidden = None,
    heads: Heads = None,
    vocab: Vocab = None,
    seq: Seq = None,
    mlp_ratio: MlpRatio = None,
    tie_embeddings: TiedHead = None,
    family: Family = None,
    kv_heads: KvHeads = None,
    head_dim: HeadDim = None,
    experts: Experts = None,
    top_k: TopK = None,
    expert_ffn: ExpertFfn = None,
    shared_experts: SharedExperts = None,
    dense_layers: DenseLayers = None,
    params: Params = None,
    gpus: Gpus = None,
    gpus_per_node: Annotated[
        int | None, _opt("--gpus-per-node", help="GPUs per node (default 8).", panel=_CLUSTER)
    ] = None,
    gpu: Annotated[
        str | None,
        _opt(
            "--gpu",
            help=f"A GPU of the table: {', '.join(GPU_BY_KEY)} (aliases: "
            + ", ".join(f"{a} = {k}" for a, k in ALIASES.items())
            + "). Default h100.",
            panel=_CLUSTER,
        ),
    ] = None,
    network: Annotated[
        str | None,
        _opt(
            "--network",
            help="Inter-node link: ib-hdr, ib-ndr (default), roce-100, eth-25, eth-10, or a "
            "port rate <kind>-<N>g of ib, roce, eth, omnipath, efa or slingshot (roce-200g: "
            "200 Gb/s ports).",
            panel=_CLUSTER,
        ),
    ] = None,
    intra_network: Annotated[
        str | None,
        _opt("--intra-network", help="Intra-node link (default by GPU).", panel=_CLUSTER),
    ] = None,
    nics_per_node: Annotated[
        int | None, _opt("--nics-per-node", help="Default: one per GPU.", panel=_CLUSTER)
    ] = None,
    profile: Annotated[
        Path | None,
        _opt(
            "--profile",
            "--cpu-profile",
            help="Measured machine profile (JSON) instead of a catalogue GPU.",
            panel=_CLUSTER,
        ),
    ] = None,
    global_batch: GlobalBatch = None,
    precision: Precision = None,
    optimizer: Optimizer = None,
    attention: Attention = None,
    dp: Dp = None,
    tp: Tp = None,
    pp: Pp = None,
    zero: Zero = None,
    micro_batch: MicroBatch = None,
    virtual_stages: VirtualStages = None,
    recompute: Recompute = None,
    sequence_parallel: SequenceParallel = None,
    ep: Ep = None,
    cp: Cp = None,
    cp_method: CpMethod = None,
    framework: Annotated[
        str | None,
        _opt(
            "--framework",
            help="The trainer that runs the job: meshforge (its own, torch DDP/FSDP2), "
            "megatron-lm, megatron-core or deepspeed-pipeline (their overlaps, buckets and "
            "pipeline transfers; docs/planner.md). Default meshforge; not with --config.",
            panel=_CLUSTER,
        ),
    ] = None,
    memory_convention: Annotated[
        str, typer.Option("--memory-convention", help="meshforge or zero-paper.")
    ] = "meshforge",
    top: Annotated[
        int | None, typer.Option("--top", help="Print the best K layouts (a search).")
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Predict memory per GPU, step time, throughput and MFU for a layout, or search:
    of a model given by flags, or of a job file (--config, with layout flags overriding
    the job's fields). The output marks each layout field given or searched (*)."""
    from meshforge.errors import ConfigError
    from meshforge.plan.core.cluster import build_cluster
    from meshforge.plan.core.layout import Training
    from meshforge.plan.core.search import LayoutChoice
    from meshforge.plan.core.timing import framework_for
    from meshforge.plan.jobs.job import layout_fields
    from meshforge.plan.jobs.request import (
        build_model,
        model_fields,
        plan,
        plan_json,
        plan_warnings,
        preset_refusal,
        world_size_from,
    )

    flags = LayoutChoice(dp, tp, pp, zero, micro_batch, virtual_stages, recompute,
                         sequence_parallel, ep, cp, cp_method)  # fmt: skip
    refusal = None
    framework_name = framework or "meshforge"
    shape_extras = {"--family": family, "--kv-heads": kv_heads}
    moe = {"experts": experts, "top_k": top_k, "expert_ffn": expert_ffn,
           "shared_experts": shared_experts, "dense_layers": dense_layers}  # fmt: skip
    # the mixture of experts and the head width: over a preset's, or with a shape
    model_extras = {"--head-dim": head_dim, **{"--" + k.replace("_", "-"): v
                                              for k, v in moe.items()}}  # fmt: skip
    if config is not None:
        for flag, value in {**shape_extras, **model_extras}.items():
            if value is not None:
                raise ConfigError(f"{flag} with --config: the job's model section gives it")
        if framework_name != "meshforge":
            raise ConfigError(
                f"--framework {framework} with --config: a job file is run by meshforge's "
                "own trainer; plan another trainer's run from flags (--model or --layers ...)"
            )
        _refuse_model_flags(
            {"--model": preset, "--layers": layers, "--hidden": hidden, "--heads": heads,
             "--vocab": vocab, "--seq": seq, "--mlp-ratio": mlp_ratio, "--params": params,
             "--tie-embeddings": tie_embeddings,
             "--global-batch": global_batch, "--precision": precision,
             "--optimizer": optimizer, "--attention": attention}
        )  # fmt: skip
        job = _load_job(config, overrides or [], flags)
        model, training, choice, refusal = job.shape, job.training, job.choice, job.refusal
        fields = job.layout_fields()
        n = gpus if gpus is not None else _job_world_size(job, config)
        job.check_given(n)
    else:
        if overrides:
            raise ConfigError("--set changes a job file: give the job with --config")
        given_attention = attention
        attention = "sdpa" if attention is None else attention
        if attention not in ("sdpa", "eager"):
            raise ConfigError(f"--attention must be sdpa or eager, got {attention!r}")
        if params is not None:  # model states only: what shapes blocks or a step is refused
            for flag, value in {"--mlp-ratio": mlp_ratio, "--global-batch": global_batch,
                                "--framework": framework, "--attention": given_attention,
                                **shape_extras, **model_extras}.items():  # fmt: skip
                if value is not None:
                    raise ConfigError(
                        f"{flag} with --params: a bare parameter count plans model states "
                        "only, without blocks or a batch; give a model shape to plan a step"
                    )
        for flag, value in shape_extras.items():
            if value is not None and preset is not None:
                raise ConfigError(f"{flag} with --model: the preset gives it")
        ratio = 4 if mlp_ratio is None else mlp_ratio
        model = build_model(layers, hidden, heads, vocab, seq, mlp_ratio, params, preset,
                            tie_embeddings, family, kv_heads, moe, head_dim)  # fmt: skip
        if global_batch is None and params is None:
            raise ConfigError("--global-batch is required with a model shape")
        choice = flags
        # with a bare parameter count only dp and zero are searched (search.py)
        fields = layout_fields(choice, "searched")
        if params is not None:
            fields = {k: v if k in ("dp", "zero") or v == "given" else "default"
                      for k, v in fields.items()}  # fmt: skip
        n = world_size_from(gpus, choice)
        training = Training(
            global_batch=1 if global_batch is None else global_batch,
            micro_batch=micro_batch or 1,
            precision="bf16" if precision is None else precision,
            recompute=recompute or "none",
            optimizer="adamw" if optimizer is None else optimizer,
            sdpa=attention == "sdpa",
        )
        if preset is not None and framework_name == "meshforge":  # the layouts train runs
            given = {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab,
                     "seq": seq}  # fmt: skip
            refusal = preset_refusal(preset, given, ratio, training, choice, n, tie_embeddings,
                                     model_fields(moe, head_dim))  # fmt: skip
    trainer = framework_for(framework_name, training.precision)
    if profile is not None:
        cluster_flags = {
            "--gpu": gpu,
            "--network": network,
            "--intra-network": intra_network,
            "--nics-per-node": nics_per_node,
            "--gpus-per-node": gpus_per_node,
        }
        for flag, value in cluster_flags.items():  # fmt: skip
            if value is not None:
                raise ConfigError(
                    f"--profile and {flag} {value} both given: a measured profile is the "
                    "machine, its device and links included; give one of them"
                )
    gpu = gpu or "h100"
    cluster = build_cluster(n, gpu, gpus_per_node or 8, network or "ib-ndr", intra_network,
                            nics_per_node, profile)  # fmt: skip
    predictions, is_search = plan(model, training, cluster, choice, memory_convention, top,
                                  refusal, trainer)  # fmt: skip
    warnings = plan_warnings(model, predictions, cluster.device)
    if as_json:
        out = plan_json(predictions, is_search, fields, warnings)
        typer.echo(json.dumps({**out, "framework": framework_name, "model": _shape_dict(model)}))
        return
    where = cluster.device.name
    if framework_name != "meshforge":
        where += f", {framework_name}"
    seq_from = " (the job's model.seq_len)" if config is not None else _seq_from(preset, seq)
    _print_table(predictions, is_search, where, n, fields, _seq_line(model, seq_from))
    for warning in warnings:
        typer.echo(f"meshforge: note: {warning}", err=True)


# What to --set instead of a model or training flag beside --config.
_JOB_KEYS = {
    "--model": "model.preset", "--layers": "model.n_layers", "--hidden": "model.d_model",
    "--heads": "model.n_heads", "--vocab": "model.vocab_size", "--seq": "model.seq_len",
    "--mlp-ratio": "model.mlp_ratio", "--global-batch": "train.global_batch",
    "--tie-embeddings": "model.tie_embeddings",
    "--precision": "precision.dtype",
}  # fmt: skip


def _refuse_model_flags(given: dict[str, object]) -> None:
    """With --config the job gives the model and its training: a flag that would change
    them is refused (the plan must be the job `train` runs; --set changes both alike)."""
    from meshforge.errors import ConfigError

    for flag, value in given.items():
        if value is None:
            continue
        if flag == "--model":
            raise ConfigError(
                "--model with --config: the job's model section gives the model; change it "
                "with --set model.preset=NAME (shape fields the job names still win over "
                "the preset's)"
            )
        if flag in _JOB_KEYS:
            raise ConfigError(
                f"{flag} with --config: the job gives the model and its training; "
                f"change the job with --set {_JOB_KEYS[flag]}=..."
            )
        if flag == "--params":
            raise ConfigError("--params with --config: the job gives the model's shape")
        raise ConfigError(
            f"{flag} with --config: a job trains with AdamW and SDPA attention; "
            "--optimizer and --attention apply to a model given by flags"
        )


def _load_job(config: Path, overrides: list[str], flags: LayoutChoice) -> JobPlan:
    """The job `meshforge train CONFIG --set ...` would run (the same loader and checks),
    as the planner sees it; the layout flags override the job's fields."""
    from meshforge.config import load_config
    from meshforge.plan.jobs.job import plan_for_job

    return plan_for_job(load_config(config, overrides), flags)


def _shape_dict(model: object) -> dict[str, object] | None:
    """The planned model's shape for --json (None: a bare parameter count)."""
    from dataclasses import asdict

    from meshforge.plan.core.flops import GPTShape

    if not isinstance(model, GPTShape):
        return None
    return {**asdict(model), "mlp_width": model.mlp_width}


def _run_world_size(config: Path) -> int | None:
    """The ranks a run trained with, when CONFIG is a run directory's config.yaml (its
    report.json beside it says), else None."""
    from meshforge.rundir.report import read_report_or_none

    report = read_report_or_none(config.parent)
    size = report.get("world_size") if report is not None else None
    return size if isinstance(size, int) and size >= 1 else None


def _job_world_size(job: JobPlan, config: Path) -> int:
    from meshforge.errors import ConfigError
    from meshforge.plan.jobs.job import JOB_FIELDS

    if job.world_size is not None:
        return job.world_size
    ran = _run_world_size(config)
    if ran is not None:  # a run's config.yaml (dp: auto follows the world size)
        typer.echo(f"meshforge: note: --gpus {ran}, the world size the run in "
                   f"{config.parent} trained with (report.json)", err=True)  # fmt: skip
        return ran
    left = [k for k in ("dp", "tp", "pp") if getattr(job.choice, k) is None]
    raise ConfigError(
        f"--gpus is required: the job leaves {', '.join(JOB_FIELDS[k] for k in left)} to be "
        f"chosen (or give {' '.join('--' + k for k in left)})"
    )


def _seq_from(preset: str | None, seq: int | None) -> str:
    """Where the planned sequence length came from, for the plan's header: a flag, or
    a preset's own (said, with how to change it: a MoE preset's is 32k tokens)."""
    from meshforge.presets import PUBLISHED

    if seq is not None or preset is None:
        return " (--seq)"
    context = "published context" if preset in PUBLISHED else "seq_len"
    return f": {preset}'s {context}; --seq to change"


def _seq_line(model: object, seq_from: str) -> str | None:
    """`seq 32,768: mixtral-8x7b's published context; ...`: the sequence length
    every step of the plan is at (None: a bare parameter count has none)."""
    from meshforge.plan.core.flops import GPTShape

    if not isinstance(model, GPTShape):
        return None
    return f"seq {model.seq_len:,}{seq_from}"


def _gib(value: float | None) -> str:
    """GiB, or MiB below a tenth of one (a small model's states read 0.00 GiB)."""
    if value is None:
        return "-"
    if abs(value) < 2**30 / 10 and value:
        return f"{value / 2**20:.1f} MiB"
    return f"{value / 2**30:.2f} GiB"


def _stages_text(p: Prediction) -> str:
    """`5, 6 x10, 5 layers; slowest rank 0, most memory rank 0`: the layers of each
    pipeline rank (a run of equal ones counted), and the ranks that set the pace and
    the memory."""
    runs: list[list[int]] = []
    for layers in p.pipeline_stages or ():
        if runs and runs[-1][0] == layers:
            runs[-1][1] += 1
        else:
            runs.append([layers, 1])
    split = ", ".join(f"{n}" if k == 1 else f"{n} x{k}" for n, k in runs)
    slowest = "" if p.time is None else f"; slowest rank {p.time.slowest_pp_rank}"
    return f"{split} layers{slowest}; most memory rank {p.memory_pp_rank}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _layout_text(p: Prediction, fields: dict[str, str]) -> str:
    """`dp16* tp8 pp8 zero1* mb1* full`: a `*` marks a field the search chose."""
    lay, train = p.layout, p.training

    def part(name: str, text: str) -> str:
        return text + ("*" if fields.get(name) == "searched" else "")

    parts = [part("dp", f"dp{lay.dp}"), part("tp", f"tp{lay.tp}"), part("pp", f"pp{lay.pp}"),
             part("zero", f"zero{lay.zero}")]  # fmt: skip
    if p.time is not None:
        parts += [part("micro_batch", f"mb{train.micro_batch}"), part("recompute", train.recompute)]
        if lay.pp > 1:
            parts.append(part("virtual_stages", f"v{lay.virtual_stages}"))
        if lay.sequence_parallel:
            parts.append(part("sequence_parallel", "sp"))
    if lay.ep > 1 or fields.get("ep") == "given":
        parts.append(part("ep", f"ep{lay.ep}"))
    if lay.cp > 1 or fields.get("cp") == "given":
        searched = "cp" not in fields  # listed only where given (jobs.job.layout_fields)
        parts.append(f"cp{lay.cp}{'*' if searched else ''} {lay.cp_method}")
    return " ".join(parts)


def _legend(fields: dict[str, str], predictions: list[Prediction]) -> str:
    """`* chosen by the search: dp, zero; given: tp, pp` (and the fields a bare
    parameter count leaves at their defaults): ep only for a model with experts, cp
    where the search chose it."""
    fields = dict(fields)
    experts = any(
        p.active_params is not None and p.active_params < p.model_params for p in predictions
    )
    if not experts and fields.get("ep") == "searched":
        del fields["ep"]
    if "cp" not in fields and any(p.layout.cp > 1 for p in predictions):
        fields["cp"] = "searched"
    searched = [k for k, v in fields.items() if v == "searched"]
    given = [k for k, v in fields.items() if v == "given"]
    default = [k for k, v in fields.items() if v == "default"]
    text = (
        f"* chosen by the search: {', '.join(searched) or 'none'}; "
        f"given: {', '.join(given) or 'none'}"
    )
    return text + (f"; default: {', '.join(default)}" if default else "")


def _hw_tflops(p: Prediction) -> float | None:
    return None if p.hfu is None else p.hfu * p.peak_flops_per_s / 1e12


def _print_table(
    predictions: list[Prediction],
    is_search: bool,
    device: str,
    n: int,
    fields: dict[str, str],
    seq_line: str | None = None,
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)  # piped: do not truncate columns
    below = f"\n{seq_line}" if seq_line else ""  # the title's second line
    if not predictions:
        console.print(f"no layout of {n} x {device} fits in memory{below}")
        return
    convention = predictions[0].memory.convention
    if is_search:
        title = f"best layouts for {n} x {device} ({convention} memory)"
        if not predictions[0].fits:
            p = predictions[0]
            title = (
                f"no layout of {n} x {device} fits in memory; the one needing least "
                f"({_gib(p.memory.total)} of {_gib(p.memory.device)} per GPU, "
                f"{convention} memory)"
            )
        table = Table(
            title=title + below,
            caption=_legend(fields, predictions),
        )
        for column in ("layout", "step s", "tokens/s", "TFLOP/s/GPU", "MFU", "bubble",
                       "memory/GPU", "fits"):  # fmt: skip
            table.add_column(column, justify="left" if column == "layout" else "right",
                             no_wrap=column == "layout")  # fmt: skip
        for p in predictions:
            table.add_row(
                _layout_text(p, fields), _num(p.step_time_s, ".3g"), _num(p.tokens_per_s, ",.0f"),
                _num(_hw_tflops(p), ".0f"), _num(p.mfu, ".1%"), _num(p.bubble_fraction, ".1%"),
                _gib(p.memory.total), "yes" if p.fits else "NO",
            )  # fmt: skip
        console.print(table)
        return
    p, mem = predictions[0], predictions[0].memory
    table = Table(title=f"plan for {n} x {device}{below}", show_header=False)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    rows = [
        ("layout", _layout_text(p, fields)),
        ("step time", "-" if p.step_time_s is None else f"{p.step_time_s:.4g} s"),
        ("tokens/s", _num(p.tokens_per_s, ",.0f")),
        ("TFLOP/s per GPU (hardware)", _num(_hw_tflops(p), ".1f")),
        ("MFU / HFU", f"{_num(p.mfu, '.1%')} / {_num(p.hfu, '.1%')}"),
        ("pipeline bubble", _num(p.bubble_fraction, ".1%")),
        (f"model states ({convention})", _gib(mem.model_states)),
        ("  params / grads / optimizer",
         f"{_gib(mem.params)} / {_gib(mem.grads)} / {_gib(mem.optimizer)}"),
        ("comm buffers + working", f"{_gib(mem.comm_buffers)} + {_gib(mem.working)}"),
        ("activations", _gib(mem.activations)),
        ("margin + reserved", f"{_gib(mem.margin)} + {_gib(mem.reserved)}"),
        ("total / device", f"{_gib(mem.total)} / {_gib(mem.device)}"),
        ("fits", "yes" if p.fits else "NO"),
    ]  # fmt: skip
    if p.pipeline_stages:
        rows.insert(6, ("pipeline stages", _stages_text(p)))
    if p.time is not None and p.layout.ep > 1:
        rows.insert(3, ("expert all-to-all per step", f"{p.time.ep_comm_s:.4g} s"))
    if p.time is not None and p.layout.cp > 1:
        rows.insert(3, (f"context-parallel K/V ({p.layout.cp_method}) per step, exposed",
                        f"{p.time.cp_comm_s:.4g} s"))  # fmt: skip
    for name, value in rows:
        table.add_row(name, value)
    table.caption = _legend(fields, predictions)
    console.print(table)
