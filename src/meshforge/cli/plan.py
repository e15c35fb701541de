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


@app.command("plan")
def plan_command(
    layers: Annotated[
        int | None, _opt("--layers", help="Transformer layers.", panel=_MODEL)
    ] = None,
    hidden: Annotated[int | None, _opt("--hidden", help="Hidden size h.", panel=_MODEL)] = None,
    heads: Annotated[int | None, _opt("--heads", help="Attention heads.", panel=_MODEL)] = None,
    vocab: Annotated[int | None, _opt("--vocab", help="Vocabulary size.", panel=_MODEL)] = None,
    seq: Annotated[int | None, _opt("--seq", help="Sequence length.", panel=_MODEL)] = None,
    mlp_ratio: Annotated[int, _opt("--mlp-ratio", help="MLP width / h.", panel=_MODEL)] = 4,
    params: Annotated[
        float | None,
        _opt("--params", help="Bare parameter count (model-state maths only).", panel=_MODEL),
    ] = None,
    gpus: Annotated[int | None, _opt("--gpus", help="GPUs (or ranks).", panel=_CLUSTER)] = None,
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
    global_batch: Annotated[
        int | None, _opt("--global-batch", help="Sequences per step.", panel=_TRAINING)
    ] = None,
    precision: Annotated[
        str, _opt("--precision", help="bf16, fp16 or fp32.", panel=_TRAINING)
    ] = "bf16",
    optimizer: Annotated[str, _opt("--optimizer", help="adamw or sgd.", panel=_TRAINING)] = "adamw",
    attention: Annotated[
        str, _opt("--attention", help="sdpa (fused) or eager.", panel=_TRAINING)
    ] = "sdpa",
    dp: Annotated[int | None, _opt("--dp", help="Data-parallel degree.", panel=_LAYOUT)] = None,
    tp: Annotated[int | None, _opt("--tp", help="Tensor-parallel degree.", panel=_LAYOUT)] = None,
    pp: Annotated[int | None, _opt("--pp", help="Pipeline stages.", panel=_LAYOUT)] = None,
    zero: Annotated[int | None, _opt("--zero", help="ZeRO stage 0-3.", panel=_LAYOUT)] = None,
    micro_batch: Annotated[
        int | None, _opt("--micro-batch", help="Sequences per micro-batch.", panel=_LAYOUT)
    ] = None,
    virtual_stages: Annotated[
        int | None,
        _opt("--virtual-stages", help="Chunks per stage (interleaved 1F1B).", panel=_LAYOUT),
    ] = None,
    recompute: Annotated[
        str | None, _opt("--recompute", help="none, selective or full.", panel=_LAYOUT)
    ] = None,
    sequence_parallel: Annotated[
        bool | None,
        _opt("--sequence-parallel/--no-sequence-parallel", help="With TP.", panel=_LAYOUT),
    ] = None,
    memory_convention: Annotated[
        str, typer.Option("--memory-convention", help="meshforge or zero-paper.")
    ] = "meshforge",
    top: Annotated[
        int | None, typer.Option("--top", help="Print the best K layouts (a search).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Predict memory per GPU, step time, throughput and MFU for a layout, or search."""
    from meshforge.errors import ConfigError
    from meshforge.plan.layout import Training
    from meshforge.plan.request import build_cluster, build_model, plan, plan_json, world_size_from
    from meshforge.plan.search import LayoutChoice

    if attention not in ("sdpa", "eager"):
        raise ConfigError(f"--attention must be sdpa or eager, got {attention!r}")
    model = build_model(layers, hidden, heads, vocab, seq, mlp_ratio, params)
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
    return "-" if value is None else f"{value / 2**30:.1f}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _print_table(predictions: list[Prediction], is_search: bool, device: str, n: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not predictions:
        console.print(f"no layout of {n} x {device} fits in memory")
        return
    title = f"{'best layouts' if is_search else 'plan'} for {n} x {device}"
    table = Table(title=title)
    for column in ("dp", "tp", "pp", "zero", "mb", "v", "recompute", "sp", "step s",
                   "tokens/s", "TFLOP/s/GPU", "MFU", "bubble", "states GiB", "act GiB",
                   "total GiB", "fits"):  # fmt: skip
        table.add_column(column, justify="left" if column == "recompute" else "right")
    for p in predictions:
        lay, mem = p.layout, p.memory
        hw_tflops = None if p.hfu is None else p.hfu * p.peak_flops_per_s / 1e12
        table.add_row(
            str(lay.dp), str(lay.tp), str(lay.pp), str(lay.zero), str(p.training.micro_batch),
            str(lay.virtual_stages), p.training.recompute, "y" if lay.sequence_parallel else "n",
            _num(p.step_time_s, ".3g"), _num(p.tokens_per_s, ",.0f"), _num(hw_tflops, ".0f"),
            _num(p.mfu, ".1%"), _num(p.bubble_fraction, ".1%"), _gib(mem.model_states),
            _gib(mem.activations), _gib(mem.total), "yes" if p.fits else "NO",
        )  # fmt: skip
    console.print(table)
    console.print(
        f"memory: {predictions[0].memory.convention} convention; device "
        f"{_gib(predictions[0].memory.device)} GiB per GPU"
    )
