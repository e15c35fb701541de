"""The time model against independent published runs (plan/core/published.py): conversion,
fit, leave-one-source-out error, and the table in docs/planner.md."""

from __future__ import annotations

import functools
from pathlib import Path

from meshforge.plan.core.comm import NETWORK_SCALING
from meshforge.plan.core.efficiency import CALIBRATIONS, curve_for
from meshforge.plan.core.published import PUBLISHED_RUNS
from meshforge.plan.core.validation import BOUND, fit, fitted, markdown, validation_table

DOCS = Path(__file__).resolve().parents[2] / "docs" / "planner.md"
USABLE = tuple(r for r in PUBLISHED_RUNS if fitted(r))


@functools.cache
def _table():
    return validation_table()


def test_the_shipped_constants_are_the_fit_on_every_source():
    curves, scaling = fit(USABLE)
    for gen in ("a100", "h100", "h200"):
        assert curves[gen] == CALIBRATIONS[gen], gen
    assert scaling == NETWORK_SCALING


def test_h200_keeps_the_h100_matmuls_and_its_own_bandwidth():
    h100, _ = curve_for("h100")
    h200, name = curve_for("h200")
    assert (h200.f_max, h200.t0_s) == (h100.f_max, h100.t0_s) and "h100" in name
    assert curve_for("a100-40gb")[1] == "a100" and curve_for("h100-nvl")[1] == "h100"
    assert curve_for("v100-sxm2-16gb")[1].startswith("generic")


def test_the_validation_spans_the_sources_sizes_and_layouts_the_issue_asks_for():
    sources = {r.source for r in USABLE}
    assert len(USABLE) >= 12 and len(sources) >= 4
    assert {r.gpu.split("-")[0] for r in USABLE} >= {"a100", "h100"}
    assert {r.layout_kind for r in USABLE} == {"dp", "3d"}
    sizes = [r.published_params for r in USABLE if r.published_params]
    assert min(sizes) <= 2e9 and max(sizes) >= 1e12


def test_only_hardware_outside_the_catalogue_is_excluded_and_it_is_still_predicted():
    excluded = [r for r in _table() if r.excluded is not None]
    assert excluded, "the torchtitan H100 rows (500 W HBM2e parts) are excluded"
    for row in excluded:
        assert "catalogue does not hold" in row.excluded, row.run.name
        assert row.predicted is not None and row.held_out_error is not None


def test_every_held_out_row_is_within_20_percent():
    misses = [
        (r.run.source, r.run.name, round(r.held_out_error, 3))
        for r in _table()
        if r.unsupported is None and r.excluded is None and abs(r.held_out_error) > BOUND
    ]
    assert misses == []


def test_the_docs_table_is_the_computed_one():
    assert markdown(_table()) in DOCS.read_text()


def test_the_validated_range_of_matmul_sizes_is_the_published_runs():
    """`plan` warns below VALIDATED_MIN_UNIT_FLOPS: no published run is below it."""
    from meshforge.plan.core.efficiency import VALIDATED_MIN_UNIT_FLOPS, matmul_unit_flops
    from meshforge.plan.core.validation import planner_inputs

    units = []
    for run in USABLE:
        x = planner_inputs(run)
        for t in x.trainings:
            ratio = x.shape.mlp_width / x.shape.d_model
            units.append(matmul_unit_flops(t.micro_batch, x.shape.seq_len, x.shape.d_model,
                                           ratio, x.layout.tp))  # fmt: skip
    assert min(units) >= VALIDATED_MIN_UNIT_FLOPS


def test_an_unpublished_micro_batch_is_the_fastest_that_fits():
    """validation.planner_inputs: a row without a published micro-batch is predicted
    with the planner's choice, the fastest power of two that divides the per-rank batch
    and fits the GPU (1 where none fits by the planner's memory model)."""
    from dataclasses import replace

    from meshforge.plan.core.comm import NETWORK_SCALING as SCALING
    from meshforge.plan.core.validation import _fits, _step_s, planner_inputs

    unpublished = [r for r in USABLE if r.micro_batch is None]
    assert unpublished
    for run in unpublished:
        chosen = planner_inputs(run)
        b = chosen.trainings[0].micro_batch
        per_rank = run.global_batch // run.dp
        assert per_rank % b == 0, run.name
        assert _fits(chosen) or b == 1, run.name
        for other in (2**k for k in range(per_rank.bit_length())):
            if other == b or per_rank % other:
                continue
            x = replace(chosen, trainings=tuple(replace(t, micro_batch=other)
                                                for t in chosen.trainings))  # fmt: skip
            if _fits(x):
                assert _fits(chosen), (run.name, other)
                assert _step_s(x, SCALING) >= _step_s(chosen, SCALING), (run.name, other)
    # a published micro-batch is kept as published
    published = next(r for r in USABLE if r.micro_batch not in (None, 1))
    assert planner_inputs(published).trainings[0].micro_batch == published.micro_batch
