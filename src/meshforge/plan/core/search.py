"""Layout search: every valid layout for N GPUs, evaluated, best first.

A field the user fixes is not searched. The candidates are the layouts that fit in
memory, fastest first (then least memory); with a bare parameter count there is
no time model, so they are ordered by memory. With a bare parameter count tp and
pp default to 1 (splitting Ψ by tp·pp says nothing without the shape). A mixture of
experts searches ep too: every divisor of both dp and the routed experts (a dense model
keeps ep 1). Context parallelism is searched at long sequences only (seq >=
CP_SEARCH_MIN_SEQ, so that shorter searches keep their answers): cp 1 and every power of
two dividing both seq/2 and the ranks left beside tp and pp, with the method given
(`--cp-method`, allgather by default); the fastest fitting layout wins, so cp > 1 is
chosen where cp 1 does not fit or runs slower.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from meshforge.errors import ConfigError
from meshforge.plan.core.flops import GPTShape
from meshforge.plan.core.hardware import Cluster
from meshforge.plan.core.layout import RECOMPUTE, Layout, Training, check_layout, is_valid
from meshforge.plan.core.predict import Model, Prediction, evaluate
from meshforge.plan.core.timing import Framework

MAX_MICRO_BATCH = 64
VIRTUAL_STAGE_CHOICES = (1, 2, 4)
CP_SEARCH_MIN_SEQ = 16384  # below this a search keeps cp 1 (module docstring)


@dataclass(frozen=True)
class LayoutChoice:
    """The user's fixed fields; None means 'search this one'."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    zero: int | None = None
    micro_batch: int | None = None
    virtual_stages: int | None = None
    recompute: str | None = None
    sequence_parallel: bool | None = None
    ep: int | None = None
    cp: int | None = None
    cp_method: str | None = None  # not searched: allgather where not given

    def is_empty(self) -> bool:
        return all(getattr(self, name) is None for name in self.__dataclass_fields__)


@dataclass
class SearchResult:
    candidates: list[Prediction]  # fitting layouts, best first
    evaluated: list[Prediction] = field(default_factory=list)  # every valid layout tried

    @property
    def best(self) -> Prediction | None:
        return self.candidates[0] if self.candidates else None


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _options(fixed: int | str | bool | None, choices: list) -> list:
    return [fixed] if fixed is not None else choices


def enumerate_layouts(
    model: Model, training: Training, n_gpus: int, choice: LayoutChoice
) -> Iterator[tuple[Layout, Training]]:
    """Every (layout, training) pair consistent with the fixed fields; validity is
    checked by the caller."""
    shape = model if isinstance(model, GPTShape) else None
    default_one = [1] if shape is None else None
    for tp in _options(choice.tp, default_one or _divisors(n_gpus)):
        if n_gpus % tp:
            continue
        for pp in _options(choice.pp, default_one or _divisors(n_gpus // tp)):
            if n_gpus % (tp * pp):
                continue
            for cp in _options(choice.cp, _context_degrees(shape, n_gpus // (tp * pp))):
                yield from _with_cp(model, training, n_gpus, choice, shape, tp, pp, cp)


def _with_cp(model, training, n_gpus, choice, shape, tp, pp, cp):
    """The layouts of one (tp, pp, cp): the rest searched as `enumerate_layouts` says."""
    if (n_gpus // (tp * pp)) % cp:
        return
    dp = n_gpus // (tp * pp * cp)
    method = choice.cp_method or "allgather"
    if choice.dp is not None and choice.dp != dp:
        return
    zeros = _options(choice.zero, [0, 1, 2, 3] if dp > 1 else [0])
    if shape is None:
        micro = [training.micro_batch if choice.micro_batch is None else choice.micro_batch]
        virtual, recompute, seq_par = [1], [training.recompute], [False]
    else:
        per_rank = training.global_batch // dp if training.global_batch % dp == 0 else 0
        powers = [b for b in (1, 2, 4, 8, 16, 32, MAX_MICRO_BATCH) if b <= per_rank]
        micro = _options(choice.micro_batch, powers or [1])
        virtual = _options(choice.virtual_stages, list(VIRTUAL_STAGE_CHOICES) if pp > 1 else [1])
        recompute = _options(choice.recompute, list(RECOMPUTE))
        seq_par = _options(choice.sequence_parallel, [False, True] if tp > 1 else [False])
    eps = _options(choice.ep, _expert_degrees(shape, dp))
    for zero, b, v, rc, sp, ep in itertools.product(zeros, micro, virtual, recompute,
                                                    seq_par, eps):  # fmt: skip
        layout = Layout(dp, tp, pp, zero, v, sp, ep, cp, method)
        yield layout, replace(training, micro_batch=b, recompute=rc)


def _context_degrees(shape: GPTShape | None, ranks: int) -> list[int]:
    """The cp a search tries (module docstring): 1, and at long sequences the powers of
    two dividing seq/2 and the `ranks` left beside tp and pp."""
    if shape is None or shape.seq_len < CP_SEARCH_MIN_SEQ:
        return [1]
    half = shape.seq_len // 2
    out, k = [1], 2
    while k <= ranks:
        if ranks % k == 0 and half % k == 0:
            out.append(k)
        k *= 2
    return out


def _expert_degrees(shape: GPTShape | None, dp: int) -> list[int]:
    """The ep a search tries: the divisors of dp that divide the routed experts."""
    if shape is None or not shape.is_moe:
        return [1]
    return [k for k in _divisors(dp) if shape.experts % k == 0]


def _rank(prediction: Prediction) -> tuple[float, float]:
    step = prediction.step_time_s
    return (step if step is not None else 0.0, prediction.memory.total)


def _check_fixed_degrees(choice: LayoutChoice, n_gpus: int) -> None:
    fixed = 1
    if choice.ep is not None and choice.ep < 1:
        raise ConfigError(f"--ep must be >= 1, got {choice.ep}")
    for name in ("tp", "pp", "dp", "cp"):
        value = getattr(choice, name)
        if value is None:
            continue
        if value < 1:
            raise ConfigError(f"--{name} must be >= 1, got {value}")
        fixed *= value
        if n_gpus % fixed:
            given = " x ".join(
                f"{n}={getattr(choice, n)}" for n in ("tp", "pp", "dp", "cp") if getattr(choice, n)
            )
            raise ConfigError(f"{given} does not divide --gpus {n_gpus}")
    if None not in (choice.tp, choice.pp, choice.dp) and fixed != n_gpus:
        # with dp, tp and pp given, cp is what --cp says (1 when left out)
        cp_part = f" x cp={choice.cp}" if choice.cp else ""
        raise ConfigError(
            f"dp={choice.dp} x tp={choice.tp} x pp={choice.pp}{cp_part} = {fixed} does not "
            f"equal --gpus {n_gpus}"
        )


def search_layouts(
    model: Model,
    training: Training,
    cluster: Cluster,
    choice: LayoutChoice = LayoutChoice(),
    convention: str = "meshforge",
    framework: Framework = Framework(),
) -> SearchResult:
    """Evaluate every valid layout of `cluster.n_gpus` GPUs (run by `framework`); raise
    ConfigError if none is valid."""
    shape = model if isinstance(model, GPTShape) else None
    _check_fixed_degrees(choice, cluster.n_gpus)
    evaluated: list[Prediction] = []
    first: tuple[Layout, Training] | None = None
    for layout, train in enumerate_layouts(model, training, cluster.n_gpus, choice):
        first = first or (layout, train)
        if is_valid(layout, train, shape):
            evaluated.append(
                evaluate(model, layout, train, cluster, convention, framework=framework)
            )
    if not evaluated:
        if first is not None:
            check_layout(*first, shape)  # the most permissive pair: names the broken rule
        raise ConfigError(
            f"no layout with dp x tp x pp x cp = --gpus {cluster.n_gpus} matches the given "
            f"fields (dp={choice.dp}, tp={choice.tp}, pp={choice.pp})"
        )
    candidates = sorted((p for p in evaluated if p.fits), key=_rank)
    return SearchResult(candidates, evaluated)


def best_layout(
    model: Model,
    training: Training,
    cluster: Cluster,
    choice: LayoutChoice = LayoutChoice(),
    convention: str = "meshforge",
    framework: Framework = Framework(),
) -> Prediction:
    """The fastest layout that fits; if none fits, the one needing least memory
    (its `fits` is False). Used for `parallel: auto` and for a partly given layout."""
    result = search_layouts(model, training, cluster, choice, convention, framework)
    if result.best is not None:
        return result.best
    return min(result.evaluated, key=lambda p: p.memory.total)
