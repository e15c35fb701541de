"""`meshforge cost`: CAPEX/OPEX of a cluster versus the cloud, and the cost of a run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from meshforge.cli.app import app
from meshforge.cli.plan import (
    AsJson,
    Attention,
    GlobalBatch,
    Gpus,
    Heads,
    Hidden,
    Layers,
    MicroBatch,
    MlpRatio,
    Optimizer,
    Pp,
    Precision,
    Preset,
    Recompute,
    Seq,
    SequenceParallel,
    Tp,
    VirtualStages,
    Vocab,
    Zero,
)

if TYPE_CHECKING:
    from meshforge.cost.run import RunCost
    from meshforge.cost.tco import Tco


@app.command("cost", rich_help_panel="Plan")
def cost_command(
    cluster_file: Annotated[Path, typer.Argument(help="Cluster file (YAML), see examples/.")],
    run: Annotated[
        Path | None, typer.Option("--run", help="Cost of a finished run (its report.json).")
    ] = None,
    tokens: Annotated[
        float | None, typer.Option("--tokens", help="Cost of a planned run of T tokens.")
    ] = None,
    utilisation: Annotated[
        float | None, typer.Option("--utilisation", help="Override the file's utilisation.")
    ] = None,
    preset: Preset = None,
    layers: Layers = None,
    hidden: Hidden = None,
    heads: Heads = None,
    vocab: Vocab = None,
    seq: Seq = None,
    mlp_ratio: MlpRatio = 4,
    gpus: Gpus = None,
    global_batch: GlobalBatch = None,
    precision: Precision = "bf16",
    optimizer: Optimizer = "adamw",
    attention: Attention = "sdpa",
    tp: Tp = None,
    pp: Pp = None,
    zero: Zero = None,
    micro_batch: MicroBatch = None,
    virtual_stages: VirtualStages = None,
    recompute: Recompute = None,
    sequence_parallel: SequenceParallel = None,
    as_json: AsJson = False,
) -> None:
    """CAPEX, yearly OPEX, owned vs rented $/GPU-hour and breakeven; with --run or
    --tokens, the cost of a training run and the money lost to synchronisation."""
    from meshforge.cost.cluster import load_cluster
    from meshforge.cost.run import run_cost_from_plan, run_cost_from_report
    from meshforge.cost.tco import tco
    from meshforge.errors import ConfigError

    cluster = load_cluster(cluster_file)
    if utilisation is not None and not 0 < utilisation <= 1:
        raise ConfigError(f"--utilisation must be in (0, 1], got {utilisation}")
    costs = tco(cluster, utilisation)
    if run is not None and tokens is not None:
        raise ConfigError("give either --run or --tokens, not both")
    run_costs = None
    layout: dict[str, Any] | None = None  # the planned run's layout (--tokens)
    if tokens is None:
        planning = {"--model": preset, "--layers": layers, "--hidden": hidden, "--heads": heads,
                    "--vocab": vocab, "--seq": seq, "--gpus": gpus,
                    "--global-batch": global_batch, "--tp": tp, "--pp": pp, "--zero": zero,
                    "--micro-batch": micro_batch, "--virtual-stages": virtual_stages,
                    "--recompute": recompute, "--sequence-parallel": sequence_parallel}  # fmt: skip
        given = [flag for flag, value in planning.items() if value is not None]
        if given:
            raise ConfigError(
                f"{given[0]} plans a run: give --tokens T with it (the cost of training T tokens)"
            )
    if run is not None:
        run_costs = run_cost_from_report(run, costs)
    elif tokens is not None:
        from meshforge.plan.core.cluster import build_cluster
        from meshforge.plan.core.layout import Training
        from meshforge.plan.core.search import LayoutChoice
        from meshforge.plan.jobs.request import build_model, plan

        if cluster.gpus.kind is None:
            raise ConfigError(f"{cluster_file}: gpus.kind is needed to plan a run (--tokens)")
        if global_batch is None:
            raise ConfigError("--global-batch is required with --tokens")
        model = build_model(layers, hidden, heads, vocab, seq, mlp_ratio, preset=preset)
        if gpus is not None and not 1 <= gpus <= cluster.gpus.count:
            raise ConfigError(
                f"--gpus must be between 1 and the cluster's {cluster.gpus.count} GPUs, got {gpus}"
            )
        n = cluster.gpus.count if gpus is None else gpus
        net = cluster.network
        planned_cluster = build_cluster(
            n, cluster.gpus.kind, cluster.gpus_per_node, net.inter, net.intra, net.nics_per_node,
        )  # fmt: skip
        choice = LayoutChoice(None, tp, pp, zero, micro_batch, virtual_stages, recompute,
                              sequence_parallel)  # fmt: skip
        training = Training(global_batch, micro_batch or 1, precision, recompute or "none",
                            optimizer, attention == "sdpa")  # fmt: skip
        refusal = None
        if preset is not None:  # meshforge's model: the layouts its trainer runs (as plan)
            from meshforge.plan.jobs.request import preset_refusal

            shape_flags = {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab,
                           "seq": seq}  # fmt: skip
            refusal = preset_refusal(preset, shape_flags, mlp_ratio, training, choice, n)
        predictions, _ = plan(model, training, planned_cluster, choice, refusal=refusal)
        if not predictions or not predictions[0].fits:
            raise ConfigError(f"no layout of this model fits on {planned_cluster.n_gpus} GPUs")
        run_costs = run_cost_from_plan(predictions[0], tokens, costs)
        layout = predictions[0].to_dict()["layout"]
    if as_json:
        out: dict[str, Any] = {"cluster": cluster.name, **costs.to_dict()}
        if run_costs is not None:
            out["run"] = run_costs.to_dict()
            if layout is not None:
                out["run"]["layout"] = layout
        typer.echo(json.dumps(out))
        return
    _print(cluster.name, costs, run_costs, layout)


def _usd(value: float | None) -> str:
    if value is None:
        return "-"
    return f"${value:,.2f}" if abs(value) < 1000 else f"${value:,.0f}"


def _layout_text(layout: dict[str, Any]) -> str:
    """`dp8 tp1 pp1 zero1 mb1 none`: the layout the planner chose for a planned run."""
    text = (f"dp{layout['dp']} tp{layout['tp']} pp{layout['pp']} zero{layout['zero']} "
            f"mb{layout['micro_batch']} {layout['recompute']}")  # fmt: skip
    if layout["pp"] > 1:
        text += f" v{layout['virtual_stages']}"
    return text + (" sp" if layout.get("sequence_parallel") else "")


def _print(
    name: str, costs: Tco, run_costs: RunCost | None, layout: dict[str, Any] | None = None
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"cost of {name}", show_header=False)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    months = costs.breakeven_months
    u_star = costs.breakeven_utilisation
    rows = [
        ("CAPEX", _usd(costs.capex_usd)),
        ("OPEX per year", _usd(costs.opex_per_year_usd)),
        ("owned per year (amortised)", _usd(costs.owned_per_year_usd)),
        ("utilisation", f"{costs.utilisation:.0%}"),
        ("owned $/GPU-hour", f"${costs.owned_per_gpu_hour_usd:.2f}"),
        ("cloud $/GPU-hour", f"${costs.cloud_per_gpu_hour_usd:.2f}"),
        ("breakeven", "never" if months is None else f"{months:.1f} months"),
        ("breakeven utilisation",
         "never" if u_star is None else f"{u_star:.0%}" + (" (unreachable)" if u_star > 1 else "")),
    ]  # fmt: skip
    if run_costs is not None:
        frac = run_costs.exposed_comm_fraction
        if layout is not None:
            rows.append(("run layout (planned)", _layout_text(layout)))
        rows += [
            (f"run ({run_costs.source})", f"{run_costs.gpu_hours:,.1f} GPU-hours"),
            ("run owned / rented", f"{_usd(run_costs.owned_usd)} / {_usd(run_costs.rented_usd)}"),
            ("exposed communication", "-" if frac is None else f"{frac:.1%}"),
            ("lost to synchronisation (owned / rented)",
             f"{_usd(run_costs.sync_loss_owned_usd)} / {_usd(run_costs.sync_loss_rented_usd)}"),
        ]  # fmt: skip
    for quantity, value in rows:
        table.add_row(quantity, value)
    Console().print(table)
