"""From command-line inputs to a model, a cluster and a plan (shared by `meshforge
plan` and `meshforge cost`, so that both commands stay thin)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

from meshforge.errors import ConfigError
from meshforge.plan.core.flops import GPTShape
from meshforge.plan.core.hardware import Cluster
from meshforge.plan.core.layout import Training
from meshforge.plan.core.predict import Model, Prediction
from meshforge.plan.core.search import LayoutChoice, best_layout, search_layouts
from meshforge.plan.core.timing import Framework

SHAPE_FLAGS = ("layers", "hidden", "heads", "vocab", "seq")
# the mixture-of-experts flags and the model.moe fields they set
MOE_FLAGS = {"experts": "experts", "top_k": "top_k", "expert_ffn": "expert_ffn",
             "shared_experts": "shared_experts", "dense_layers": "dense_layers"}  # fmt: skip
_MOE_MIN = {"experts": 2, "top_k": 1, "expert_ffn": 1, "shared_experts": 0, "dense_layers": 0}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_moe_flags(
    moe: dict[str, int | None],
    preset_moe: dict[str, Any] | None = None,
    layers: int | None = None,
    family: str | None = None,
) -> dict[str, int]:
    """The mixture of experts the flags (`moe`: MOE_FLAGS' names, None where not given)
    give, over a preset's model.moe: {} for a dense model. ConfigError naming the flag
    for what the job config would refuse (--top-k above --experts, --experts without
    --expert-ffn, a MoE flag without experts, ...)."""
    given = {k: v for k, v in moe.items() if v is not None}
    for name, value in given.items():
        if value < _MOE_MIN[name]:
            raise ConfigError(f"{_flag(name)} must be >= {_MOE_MIN[name]}, got {value}")
    merged = {**(preset_moe or {}), **given}
    if not given and not preset_moe:
        return {}
    if "experts" not in merged:
        name = next(iter(given))
        raise ConfigError(f"{_flag(name)} needs --experts (a mixture-of-experts model)")
    if "expert_ffn" not in merged:
        raise ConfigError("--experts needs --expert-ffn (the width of each expert's SwiGLU)")
    if family == "gpt":
        raise ConfigError("--experts needs --family llama (experts are SwiGLU feed-forwards)")
    out = {"top_k": 2, "shared_experts": 0, "dense_layers": 0}  # model.moe's defaults
    out.update({k: int(v) for k, v in merged.items() if k in MOE_FLAGS})
    if out["top_k"] > out["experts"]:
        raise ConfigError(f"--top-k {out['top_k']} is larger than --experts {out['experts']}")
    if layers is not None and out["dense_layers"] >= layers:
        raise ConfigError(
            f"--dense-layers {out['dense_layers']} leaves no mixture-of-experts layer in "
            f"--layers {layers}"
        )
    return out


MAX_MLP_RATIO = 64  # wider than any published MLP (GPT-3, PaLM: 4; SwiGLU: 8/3-3.5)


def build_model(
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    vocab: int | None = None,
    seq: int | None = None,
    mlp_ratio: float | None = 4,
    params: float | None = None,
    preset: str | None = None,
    tied: bool | None = None,
    family: str | None = None,
    kv_heads: int | None = None,
    moe: dict[str, int | None] | None = None,
    head_dim: int | None = None,
) -> Model:
    """A model shape from a preset (`--model NAME`, the shape flags overriding it),
    from the five shape flags, or a bare parameter count. `tied`: the output head
    shares the token embedding (None: the preset's, or tied for a bare shape, as
    meshforge's gpt); `family` gpt or llama, `kv_heads` grouped-query attention's
    key/value heads (a bare shape only). `mlp_ratio` None: 4 (gpt), or llama's own
    SwiGLU width (8/3 h rounded up to 64). `moe`: the mixture-of-experts flags
    (MOE_FLAGS' names; check_moe_flags), `head_dim` the width of a head (llama)."""
    ratio = 4 if mlp_ratio is None else mlp_ratio
    moe = moe or {}
    given = {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab, "seq": seq}
    if head_dim is not None and not (head_dim >= 2 and head_dim % 2 == 0):
        raise ConfigError(f"--head-dim must be an even number >= 2 (rotary), got {head_dim}")
    if params is not None:
        if any(v is not None for v in given.values()) or preset is not None or tied is not None:
            raise ConfigError(
                "give either --params or the model (--model or --layers ...), not both"
            )
        if not (params > 0 and math.isfinite(params)):
            raise ConfigError(f"--params must be a finite number > 0, got {params}")
        return float(params)
    if preset is not None:
        from meshforge.presets import PRESETS

        base = PRESETS.get(preset, {})
        if head_dim is not None and base.get("name", "gpt") == "gpt":
            raise ConfigError(f"--head-dim with --model {preset}: a gpt has no head_dim (llama)")
        check_moe_flags(moe, base.get("moe"), layers or base.get("n_layers"),
                        base.get("name", "gpt"))  # fmt: skip
        return _preset_shape(preset, given, ratio, tied, model_fields(moe, head_dim))
    missing = [f"--{k}" for k, v in given.items() if v is None]
    if missing:
        raise ConfigError(
            f"model shape incomplete: missing {' '.join(missing)} (or use --model or --params)"
        )
    for name, value in given.items():
        if value < 1:  # type: ignore[operator]
            raise ConfigError(f"--{name} must be >= 1, got {value}")
    if not 1 <= ratio <= MAX_MLP_RATIO:
        raise ConfigError(f"--mlp-ratio must be between 1 and {MAX_MLP_RATIO}, got {ratio}")
    if hidden % heads and head_dim is None:  # type: ignore[operator]
        raise ConfigError(f"--heads {heads} does not divide --hidden {hidden}")
    experts = check_moe_flags(moe, None, layers, family)
    if family is None and (experts or head_dim is not None):
        family = "llama"  # experts and head_dim are the llama family's
    family = family or "gpt"
    if head_dim is not None and family == "gpt":
        raise ConfigError("--head-dim needs --family llama")
    if family not in ("gpt", "llama"):
        raise ConfigError(f"--family must be gpt or llama, got {family!r}")
    if kv_heads is not None and not (kv_heads >= 1 and heads % kv_heads == 0):  # type: ignore[operator]
        raise ConfigError(f"--kv-heads {kv_heads} must be >= 1 and divide --heads {heads}")
    extra = {"tie_embeddings": True if tied is None else tied, "family": family,
             "n_kv_heads": kv_heads, "head_dim": head_dim, **experts}  # fmt: skip
    if family == "llama" and mlp_ratio is None:  # llama's own SwiGLU width (flops.py)
        return GPTShape(layers, hidden, heads, vocab, seq, **extra)  # type: ignore[arg-type]
    # the MLP's width: ratio x h (for llama, of each of SwiGLU's three matrices)
    if float(ratio).is_integer() and family == "gpt":
        return GPTShape(layers, hidden, heads, vocab, seq, int(ratio), **extra)  # type: ignore[arg-type]
    width = round(ratio * hidden)  # type: ignore[operator]
    return GPTShape(layers, hidden, heads, vocab, seq, ffn_hidden=width, **extra)  # type: ignore[arg-type]


_FLAG_FIELDS = {"layers": "n_layers", "hidden": "d_model", "heads": "n_heads",
                "vocab": "vocab_size", "seq": "seq_len"}  # fmt: skip


def model_fields(moe: dict[str, int | None] | None, head_dim: int | None) -> dict[str, Any]:
    """The model fields the MoE and head flags write into a preset's job config (checked
    first: check_moe_flags)."""
    out: dict[str, Any] = {}
    if head_dim is not None:
        out["head_dim"] = head_dim
    given = {MOE_FLAGS[k]: v for k, v in (moe or {}).items() if v is not None}
    if given:
        out["moe"] = given  # merged over the preset's model.moe by the config
    return out


def _preset_shape(
    preset: str,
    given: dict[str, int | None],
    mlp_ratio: float,
    tied: bool | None = None,
    fields: dict[str, Any] | None = None,
) -> GPTShape:
    """The shape a job file with `model: {preset: NAME, ...}` trains: the same config
    code reads both, so the planner and the trainer agree."""
    from meshforge.plan.core.flops import shape_of

    return shape_of(preset_config(preset, given, mlp_ratio, tied=tied, fields=fields))


def preset_config(
    preset: str,
    given: dict[str, int | None],
    mlp_ratio: float = 4,
    training: Training | None = None,
    tied: bool | None = None,
    fields: dict[str, Any] | None = None,
) -> Any:
    """The job config (`config.JobConfig`) of `model: {preset: NAME, ...}` with the shape
    flags written in (and `fields`: model fields such as head_dim and moe), and the
    global batch and precision of `training` if given."""
    from meshforge.config import build_config

    model: dict[str, object] = {"preset": preset}
    model.update({_FLAG_FIELDS[k]: v for k, v in given.items() if v is not None})
    if tied is not None:
        model["tie_embeddings"] = tied
    model.update(fields or {})
    if mlp_ratio != 4:
        from meshforge.presets import PRESETS

        if (
            PRESETS.get(preset, {}).get("name", "gpt") == "gpt"
            and not float(mlp_ratio).is_integer()
        ):
            raise ConfigError(
                f"--mlp-ratio {mlp_ratio} with --model: a preset's model.mlp_ratio is an "
                "integer (the trainer's GPT); give the shape flags for another width"
            )
        model["mlp_ratio"] = int(mlp_ratio)
    raw: dict[str, Any] = {"model": model}
    if training is not None:
        raw["train"] = {"global_batch": training.global_batch}
        raw["precision"] = {"dtype": training.precision}
    try:
        return build_config(raw)
    except ConfigError as exc:
        raise ConfigError(f"--model {preset}: {exc}") from None


def preset_job(
    preset: str,
    given: dict[str, int | None],
    mlp_ratio: float,
    training: Training,
    choice: LayoutChoice,
    tied: bool | None = None,
    fields: dict[str, Any] | None = None,
) -> Any:
    """A preset planned as the job that trains it (`plan.jobs.job.JobPlan`): its `refusal`
    keeps a search to the layouts `meshforge train` runs for that model (a tied head
    refuses pp > 1, tp divides the vocabulary and the kv heads, ...), and its
    `check_given` refuses a given layout the trainer would, with the trainer's reason.
    The training (batch, precision, optimizer, attention) stays the flags'."""
    from meshforge.plan.core.flops import shape_of
    from meshforge.plan.jobs.job import JobPlan

    cfg = preset_config(preset, given, mlp_ratio, training, tied, fields)
    return JobPlan(cfg, shape_of(cfg), training, choice)


# The trainer's advice in a job file's words, as the flags that say it.
_ADVICE_AS_FLAGS = {
    "set model.tie_embeddings: false": "give --no-tie-embeddings",
    "use zero: 2 or 3": "use --zero 2 or 3",
    "use zero: 0, 2 or 3": "use --zero 0, 2 or 3",
}


def _in_flags(reason: str) -> str:
    for job_words, flag_words in _ADVICE_AS_FLAGS.items():
        reason = reason.replace(job_words, flag_words)
    return reason


def preset_refusal(
    preset: str,
    given: dict[str, int | None],
    mlp_ratio: float,
    training: Training,
    choice: LayoutChoice,
    n_gpus: int,
    tied: bool | None = None,
    fields: dict[str, Any] | None = None,
) -> Callable[[Prediction], str | None]:
    """For `plan --model` and `cost --tokens --model`: the preset's `preset_job`
    refusal, its advice in flags; a given layout the trainer refuses raises now.
    `fields`: model fields the flags set (`model_fields`)."""
    job = preset_job(preset, given, mlp_ratio, training, choice, tied, fields)
    try:
        job.check_given(n_gpus)
    except ConfigError as exc:
        raise ConfigError(_in_flags(str(exc))) from None

    def refusal(p: Prediction) -> str | None:
        reason = job.refusal(p)
        return None if reason is None else _in_flags(reason)

    return refusal


def world_size_from(gpus: int | None, choice: LayoutChoice) -> int:
    """--gpus, or dp x tp x pp (x cp) when all three are given."""
    if gpus is not None:
        return gpus
    if choice.dp is not None and choice.tp is not None and choice.pp is not None:
        return choice.dp * choice.tp * choice.pp * (choice.cp or 1)
    raise ConfigError("--gpus is required unless --dp, --tp and --pp are all given")


def plan(
    model: Model,
    training: Training,
    cluster: Cluster,
    choice: LayoutChoice,
    convention: str = "meshforge",
    top: int | None = None,
    refusal: Callable[[Prediction], str | None] | None = None,
    framework: Framework = Framework(),
) -> tuple[list[Prediction], bool]:
    """(predictions, is_search). A fully or partly given layout gives one prediction
    (left-out fields searched, the best kept); no layout fields, or `top`, gives the
    best `top` (default 5) fitting candidates, or, when none fits, the one layout that
    needs least memory (its `fits` False: how far it is from fitting). `refusal` (a
    job's: `JobPlan.refusal`) says why the trainer would not run a layout; such layouts
    are left out. `framework`: the trainer that runs the job (timing.FRAMEWORKS)."""
    if top is not None and top < 1:
        raise ConfigError(f"--top must be >= 1, got {top}")
    is_search = choice.is_empty() or top is not None
    if refusal is None:
        if is_search:
            result = search_layouts(model, training, cluster, choice, convention, framework)
            if not result.candidates:
                return [min(result.evaluated, key=lambda p: p.memory.total)], True
            return result.candidates[: top or 5], True
        return [best_layout(model, training, cluster, choice, convention, framework)], False
    result = search_layouts(model, training, cluster, choice, convention, framework)
    runnable = (p for p in result.candidates if refusal(p) is None)  # best first, lazily
    if is_search:
        found = list(itertools.islice(runnable, top or 5))
        if not found and result.candidates:
            raise ConfigError(
                f"no layout of {cluster.n_gpus} GPUs that fits can be trained: "
                f"{_reason(result.candidates, choice, refusal)}"
            )
        if not found:  # none fits: the runnable one needing least memory
            by_memory = sorted(result.evaluated, key=lambda p: p.memory.total)
            found = [p for p in by_memory if refusal(p) is None][:1]
        return found, True
    best = next(runnable, None)
    if best is None:  # none fits: as best_layout, the runnable one needing least memory
        by_memory = sorted(result.evaluated, key=lambda p: p.memory.total)
        best = next((p for p in by_memory if refusal(p) is None), None)
        if best is None:
            raise ConfigError(
                f"no layout of {cluster.n_gpus} GPUs with the given fields can be trained: "
                f"{_reason(by_memory, choice, refusal)}"
            )
    return [best], False


def _reason(
    refused: list[Prediction],
    choice: LayoutChoice,
    refusal: Callable[[Prediction], str | None],
) -> str | None:
    """Why the trainer refuses every layout of `refused`, in the words of the one whose
    searched fields are plainest (no tensor or pipeline parallelism, one chunk, no
    sequence parallelism, ZeRO 0, no recomputation, the smallest micro-batch, where the
    user left them out): the rule a given field breaks, not one a searched value
    happened to."""

    def plainness(p: Prediction) -> tuple:
        lay, train = p.layout, p.training
        searched = {f: getattr(choice, f) is None for f in ("tp", "pp", "zero", "micro_batch",
                                                            "virtual_stages", "recompute",
                                                            "sequence_parallel", "ep")}  # fmt: skip
        return (
            lay.tp if searched["tp"] else 0,
            lay.pp if searched["pp"] else 0,
            lay.virtual_stages if searched["virtual_stages"] else 0,
            lay.sequence_parallel if searched["sequence_parallel"] else False,
            lay.zero if searched["zero"] else 0,
            lay.ep if searched["ep"] else 0,
            train.recompute != "none" if searched["recompute"] else False,
            train.micro_batch if searched["micro_batch"] else 0,
        )

    return refusal(min(refused, key=plainness))


def plan_warnings(model: Any, predictions: list[Prediction], device: Any) -> list[str]:
    """What the user should know about how far a plan carries: matmuls smaller than any
    of the published runs the GPU's constants were fitted on (efficiency.py)."""
    from meshforge.plan.core.efficiency import VALIDATED_MIN_UNIT_FLOPS, matmul_unit_flops

    if not isinstance(model, GPTShape) or not predictions:
        return []
    if device.calibration.startswith("measured") and device.name.startswith("cpu"):
        return [
            "a measured CPU profile is planned with the planner's own time model, in which "
            "data-parallel collectives overlap compute as NCCL's do on a GPU; meshforge's "
            "CPU trainer exposes them (gloo), so ZeRO-2/3 rank better here than they run. "
            "`parallel: auto` and every run's `predicted` use the CPU host model"
        ]
    if device.calibration.startswith(("generic", "measured")):
        return []
    best = predictions[0]
    unit = matmul_unit_flops(best.training.micro_batch, model.seq_len, model.d_model,
                             model.mlp_width / model.d_model, best.layout.tp)  # fmt: skip
    if unit >= VALIDATED_MIN_UNIT_FLOPS:
        return []
    return [
        f"this model's matmuls ({unit:.1e} FLOPs per MLP projection and micro-batch) are "
        f"smaller than any in the published runs {device.name}'s constants were fitted on "
        f"(>= {VALIDATED_MIN_UNIT_FLOPS:.0e}): kernel launches and fixed costs are not "
        "in its step time, which is then a lower bound"
    ]


def plan_json(
    predictions: list[Prediction],
    is_search: bool,
    fields: dict[str, str] | None = None,
    warnings: list[str] | None = None,
) -> dict[str, Any]:
    """The object `meshforge plan --json` prints; `fields` (which layout fields were
    given and which searched) goes beside each prediction as "layout_fields"."""
    extra = {} if fields is None else {"layout_fields": fields}
    if warnings:
        extra["warnings"] = warnings
    if is_search:
        if predictions and not predictions[0].fits:  # nothing fits: the closest, apart
            return {"candidates": [], "closest": {**predictions[0].to_dict(), **extra}}
        return {"candidates": [{**p.to_dict(), **extra} for p in predictions]}
    return {**predictions[0].to_dict(), **extra}
