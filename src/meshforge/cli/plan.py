"""`meshforge plan`: memory, step time and MFU of a layout, or the best layouts for N GPUs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from meshforge.cli.app import app

if TYPE_CHECKING:
    from meshforge.plan.predict import Prediction

_MODEL = "Model"
_CLUSTER = "Cluster"
_TRAINING = "Training"
_LAYOUT = "Layout (left out: searched)"


def _opt(*names: str, help: str, panel: str):
    return typer.Option(*names, help=help, rich_help_panel=panel)


# Option types shared with `meshforge cost` (which plans a run from the same flags).
Preset = Annotated[
    str | None,
    _opt(
        "--model",
        help="A model preset (gpt2-124m ... llama-8b, llama-70b); shape flags override it.",
        panel=_MODEL,
    ),
]
Layers = Annotated[int | None, _opt("--layers", help="Transformer layers.", panel=_MODEL)]
Hidden = Annotated[int | None, _opt("--hidden", help="Hidden size h.", panel=_MODEL)]
Heads = Annotated[int | None, _opt("--heads", help="Attention heads.", panel=_MODEL)]
Vocab = Annotated[int | None, _opt("--vocab", help="Vocabulary size.", panel=_MODEL)]
Seq = Annotated[int | None, _opt("--seq", help="Sequence length.", panel=_MODEL)]
MlpRatio = Annotated[int, _opt("--mlp-ratio", help="MLP width / h.", panel=_MODEL)]
Params = Annotated[
    float | None,
    _opt("--params", help="Bare parameter count (model-state maths only).", panel=_MODEL),
]
Gpus = Annotated[int | None, _opt("--gpus", help="GPUs (or ranks).", panel=_CLUSTER)]
GlobalBatch = Annotated[
    int | None, _opt("--global-batch", help="Sequences per step.", panel=_TRAINING)
]
Precision = Annotated[str, _opt("--precision", help="bf16, fp16 or fp32.", panel=_TRAINING)]
Optimizer = Annotated[str, _opt("--optimizer", help="adamw or sgd.", panel=_TRAINING)]
Attention = Annotated[str, _opt("--attention", help="sdpa (fused) or eager.", panel=_TRAINING)]
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
AsJson = Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")]


@app.command("plan")
def plan_command(
    preset: Preset = None,
    layers: Layers = None,
    hidden: Hidden = None,
    heads: Heads = None,
    vocab: Vocab = None,
    seq: Seq = None,
    mlp_ratio: MlpRatio = 4,
    params: Params = None,
    gpus: Gpus = None,
    gpus_per_node: Annotated[
        int, _opt("--gpus-per-node", help="GPUs per node.", panel=_CLUSTER)
    ] = 8,
    gpu: Annotated[
        str, _opt("--gpu", help="a100-40gb, a100-80gb, h100, h200.", panel=_CLUSTER)
    ] = "h100",
    network: Annotated[
        str,
        _opt(
            "--network",
            help="Inter-node link: ib-hdr, ib-ndr, roce-100, eth-25, eth-10.",
            panel=_CLUSTER,
        ),
    ] = "ib-ndr",
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
    precision: Precision = "bf16",
    optimizer: Optimizer = "adamw",
    attention: Attention = "sdpa",
    dp: Dp = None,
    tp: Tp = None,
    pp: Pp = None,
    zero: Zero = None,
    micro_batch: MicroBatch = None,
    virtual_stages: VirtualStages = None,
    recompute: Recompute = None,
    sequence_parallel: SequenceParallel = None,
    memory_convention: Annotated[
        str, typer.Option("--memory-convention", help="meshforge or zero-paper.")
    ] = "meshforge",
    top: Annotated[
        int | None, typer.Option("--top", help="Print the best K layouts (a search).")
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Predict memory per GPU, step time, throughput and MFU for a layout, or search."""
    from meshforge.errors import ConfigError
    from meshforge.plan.layout import Training
    from meshforge.plan.request import build_cluster, build_model, plan, plan_json, world_size_from
    from meshforge.plan.search import LayoutChoice

    if attention not in ("sdpa", "eager"):
        raise ConfigError(f"--attention must be sdpa or eager, got {attention!r}")
    model = build_model(layers, hidden, heads, vocab, seq, mlp_ratio, params, preset)
    if global_batch is None and params is None:
        raise ConfigError("--global-batch is required with a model shape")
    choice = LayoutChoice(dp, tp, pp, zero, micro_batch, virtual_stages, recompute,
                          sequence_parallel)  # fmt: skip
    n = world_size_from(gpus, choice)
    cluster = build_cluster(n, gpu, gpus_per_node, network, intra_network, nics_per_node, profile)
    training = Training(
        global_batch=global_batch or 1,
        micro_batch=micro_batch or 1,
        precision=precision,
        recompute=recompute or "none",
        optimizer=optimizer,
        sdpa=attention == "sdpa",
    )
    predictions, is_search = plan(model, training, cluster, choice, memory_convention, top)
    if as_json:
        typer.echo(json.dumps(plan_json(predictions, is_search)))
        return
    _print_table(predictions, is_search, cluster.device.name, n)


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f} GiB"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _layout_text(p: Prediction) -> str:
    lay, train = p.layout, p.training
    text = f"dp{lay.dp} tp{lay.tp} pp{lay.pp} zero{lay.zero}"
    if p.time is not None:
        text += f" mb{train.micro_batch} {train.recompute}"
        text += f" v{lay.virtual_stages}" if lay.pp > 1 else ""
        text += " sp" if lay.sequence_parallel else ""
    return text


def _hw_tflops(p: Prediction) -> float | None:
    return None if p.hfu is None else p.hfu * p.peak_flops_per_s / 1e12


def _print_table(predictions: list[Prediction], is_search: bool, device: str, n: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)  # piped: do not truncate columns
    if not predictions:
        console.print(f"no layout of {n} x {device} fits in memory")
        return
    convention = predictions[0].memory.convention
    if is_search:
        table = Table(title=f"best layouts for {n} x {device} ({convention} memory)")
        for column in ("layout", "step s", "tokens/s", "TFLOP/s/GPU", "MFU", "bubble",
                       "memory/GPU", "fits"):  # fmt: skip
            table.add_column(column, justify="left" if column == "layout" else "right")
        for p in predictions:
            table.add_row(
                _layout_text(p), _num(p.step_time_s, ".3g"), _num(p.tokens_per_s, ",.0f"),
                _num(_hw_tflops(p), ".0f"), _num(p.mfu, ".1%"), _num(p.bubble_fraction, ".1%"),
                _gib(p.memory.total), "yes" if p.fits else "NO",
            )  # fmt: skip
        console.print(table)
        return
    p, mem = predictions[0], predictions[0].memory
    table = Table(title=f"plan for {n} x {device}", show_header=False)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    rows = [
        ("layout", _layout_text(p)),
        ("step time", _num(p.step_time_s, ".4g") + " s"),
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
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
