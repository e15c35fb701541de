"""Every layout rule, written once: what a layout must satisfy to split a model and a
batch over a world of ranks.

The job file (config.py), `meshforge plan` (plan/core/layout.py) and the trainer
(`derive`, which builds the `ParallelDims` the mesh is made from) all ask `check`.
Each caller gives `Names`: how it calls its fields, so the same rule says
`parallel.tp=3 does not divide model.n_heads=4` for a job file and
`--tp 3 does not divide --heads 4` on the command line.

Two kinds of rule:
- structural rules hold for any trainer (degrees >= 1, tp divides the heads, a
  pipeline stage per layer at most, torch.distributed.pipelining's micro-batch
  counts);
- meshforge's trainer's own rules (`trainer=True`): what its models split (key/value
  heads, the MLP width and the vocabulary over tp), a tied head off the pipeline,
  ZeRO-1, fp16 and compile on a one-dimensional mesh, parameter-server mode. The
  planner leaves them out for a bare shape given by flags, which another framework
  may run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from meshforge.errors import ConfigError
from meshforge.layout.dims import ParallelDims
from meshforge.layout.schedule import interleaved_accepts, min_microbatches, stages_per_rank

ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Names:
    """How a caller names the fields a rule talks about. `style="config"` shows a value
    as `label=value` (booleans as true/false), `style="flags"` as `label value` (a true
    switch as the bare flag). A field without a label is shown as `key=value`."""

    labels: Mapping[str, str] = field(default_factory=dict)
    style: str = "config"

    def name(self, key: str) -> str:
        return self.labels.get(key, key)

    def show(self, key: str, value: object) -> str:
        label = self.name(key)
        if self.style == "flags" and key in self.labels:
            if isinstance(value, bool):
                return label if value else f"{label}=false"
            return f"{label} {value}"
        if isinstance(value, bool):
            value = "true" if value else "false"
        return f"{label}={value}"


JOB_NAMES = Names(
    {
        "dp": "parallel.dp",
        "tp": "parallel.tp",
        "pp": "parallel.pp",
        "ep": "parallel.ep",
        "cp": "parallel.cp",
        "cp_method": "parallel.cp_method",
        "experts": "model.moe.experts",
        "capacity_factor": "model.moe.capacity_factor",
        "zero": "parallel.zero",
        "sequence_parallel": "parallel.sequence_parallel",
        "pp_schedule": "parallel.pp_schedule",
        "virtual_stages": "parallel.virtual_stages",
        "mode": "parallel.mode",
        "servers": "parallel.ps.servers",
        "model": "model.name",
        "tp_plan": "model.tp_plan",
        "n_layers": "model.n_layers",
        "d_model": "model.d_model",
        "n_heads": "model.n_heads",
        "kv_heads": "model.n_kv_heads",
        "vocab_size": "model.vocab_size",
        "seq_len": "model.seq_len",
        "tie_embeddings": "model.tie_embeddings",
        "dtype": "precision.dtype",
        "compile": "train.compile",
        "global_batch": "train.global_batch",
        "micro_batch": "train.micro_batch",
        "document_masking": "data.document_masking",
        "device": "runtime.device",
        "dropout": "model.dropout",
    }
)


@dataclass(frozen=True)
class ModelShape:
    """The shape a layout must split. A user's factory model (`factory`: its name) has
    no shape meshforge knows; only whether it names a tensor-parallel plan."""

    n_layers: int = 1
    d_model: int = 1
    n_heads: int = 1
    kv_heads: int = 1
    mlp_hidden: int = 1
    vocab_size: int = 1
    seq_len: int = 1
    tie_embeddings: bool = False
    factory: str | None = None
    tp_plan: bool = False
    experts: int = 0  # a mixture-of-experts model's routed experts per layer (0: dense)
    capacity_factor: float | None = None  # its experts' (None: dropless)
    dropout: float = 0.0  # gpt's (attention dropout among them)


@dataclass(frozen=True)
class LayoutRequest:
    """A layout as asked for, before it meets a world size. `dp=None`: whatever the
    world leaves (`dp: auto`); `servers`: a parameter server's serving ranks (None:
    collective training). The batch (sequences per step, per micro-batch) and the
    precision and compile settings are here because rules tie them to the degrees."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1  # context parallel: each rank holds 1/cp of every sequence
    cp_method: str = "allgather"
    dp: int | None = None
    zero: int = 0
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    servers: int | None = None
    ps_sync: bool = True
    max_staleness: int = 0
    dtype: str = "fp32"
    compile: bool = False
    global_batch: int | None = None
    micro_batch: int | None = None
    document_masking: bool = False  # attention kept inside each packed document
    # the workers' device type, "cpu" or "cuda"; None: not known yet (runtime.device:
    # auto before a launch decides), and the rules that need it wait for it
    device: str | None = None


def check(
    req: LayoutRequest,
    shape: ModelShape | None,
    names: Names = JOB_NAMES,
    world_size: int | None = None,
    trainer: bool = True,
) -> list[str]:
    """Every rule `req` breaks, in the order a user fixes them, each named with `names`.
    `shape=None`: a bare parameter count (only the rules on the degrees apply);
    `world_size=None`: the rules that need it (dp, the batch split) are checked only
    as far as `req.dp` fixes them."""
    n, out = names, []
    degrees = [
        ("tp", req.tp),
        ("pp", req.pp),
        ("ep", req.ep),
        ("cp", req.cp),
        ("virtual_stages", req.virtual_stages),
    ]
    for key, value in ([("dp", req.dp)] if req.dp is not None else []) + degrees:
        if value < 1:
            out.append(f"{n.name(key)} must be >= 1, got {value}")
    if req.zero not in ZERO_STAGES:
        out.append(f"{n.name('zero')} must be one of 0, 1, 2, 3, got {req.zero}")
    if out:
        return out  # the other rules divide by these
    if shape is None:
        return _degree_rules(req, n)
    if shape.factory is not None:
        out += _factory_rules(req, shape, n) if trainer else []
    else:
        out += _split_rules(req, shape, n, trainer)
    out += _degree_rules(req, n) if shape.factory is None else []
    if shape.factory is None:
        out += _stage_rules(req, shape, n)
    if req.ep > 1 and shape.experts and shape.experts % req.ep:  # any trainer's rule
        out.append(f"{n.show('ep', req.ep)} does not divide {n.show('experts', shape.experts)}")
    if trainer:
        out += _trainer_rules(req, shape, n)
        out += _expert_rules(req, shape, n)
        out += _context_rules(req, shape, n)
    dp = _world_rules(req, n, world_size, out)
    if dp is not None and req.ep > 1 and dp % req.ep:
        out.append(
            f"{n.show('ep', req.ep)} does not divide the data-parallel ranks dp={dp} "
            "(expert-parallel ranks are borrowed from the data-parallel ones; "
            f"{n.show('ep', 1)} for none, e.g. to resume on fewer ranks)"
        )
    if dp is not None and req.global_batch is not None and req.micro_batch is not None:
        out += _batch_rules(req, n, dp, world_size)
    return out


def derive(
    req: LayoutRequest, shape: ModelShape, world_size: int, names: Names = JOB_NAMES
) -> ParallelDims:
    """The checked layout of `req` on `world_size` ranks; ConfigError naming the first
    rule it breaks."""
    first_problem(check(req, shape, names, world_size))
    assert req.global_batch is not None and req.micro_batch is not None
    if req.servers is not None:
        workers = world_size - req.servers
        return ParallelDims(
            dp=workers,
            tp=1,
            pp=1,
            microbatches=req.global_batch // (workers * req.micro_batch),
            servers=req.servers,
            ps_sync=req.ps_sync,
            max_staleness=req.max_staleness,
        )
    dp = world_size // (req.tp * req.pp * req.cp)
    return ParallelDims(
        dp=dp,
        tp=req.tp,
        pp=req.pp,
        ep=req.ep,
        cp=req.cp,
        cp_method=req.cp_method,
        zero=req.zero,
        sequence_parallel=req.sequence_parallel,
        pp_schedule=req.pp_schedule,
        virtual_stages=req.virtual_stages,
        microbatches=req.global_batch // (dp * req.micro_batch),
    )


def first_problem(problems: list[str]) -> None:
    """Raise ConfigError with the first of `problems`, if any."""
    if problems:
        raise ConfigError(problems[0])


# -- the rules, by what they need ------------------------------------------------------


def _factory_rules(req: LayoutRequest, shape: ModelShape, n: Names) -> list[str]:
    """A user's factory model: the rules that do not need its shape."""
    out = []
    if req.servers is not None:
        out.append(
            f"{n.show('mode', 'parameter_server')} initialises meshforge's gpt and llama "
            f"only, not {n.show('model', shape.factory)}"
        )
    if req.tp > 1 and not shape.tp_plan:
        out.append(
            f"{n.show('tp', req.tp)} with {n.show('model', shape.factory)}: name the model's "
            f"tensor-parallel plan in {n.name('tp_plan')} ('package.module:function')"
        )
    if req.tp == 1 and shape.tp_plan:
        out.append(f"{n.name('tp_plan')} applies to {n.name('tp')} > 1")
    if req.sequence_parallel and req.tp == 1:
        out.append(f"{n.show('sequence_parallel', True)} needs {n.name('tp')} > 1")
    return out


def _split_rules(req: LayoutRequest, shape: ModelShape, n: Names, trainer: bool) -> list[str]:
    """Tensor parallelism over meshforge's models: each rank holds whole heads, a slice
    of the MLP and of the vocabulary."""
    tp, out = req.tp, []
    if shape.n_heads % tp:
        out.append(f"{n.show('tp', tp)} does not divide {n.show('n_heads', shape.n_heads)}")
    if trainer and shape.kv_heads % tp:  # each rank holds whole key/value heads
        out.append(f"{n.show('tp', tp)} does not divide {n.show('kv_heads', shape.kv_heads)}")
    # tp | n_heads | d_model, so tp also divides d_model and the GPT's MLP width
    if trainer and shape.mlp_hidden % tp:
        out.append(f"{n.show('tp', tp)} does not divide the MLP width {shape.mlp_hidden}")
    if trainer and shape.vocab_size % tp:
        out.append(
            f"{n.show('tp', tp)} does not divide {n.show('vocab_size', shape.vocab_size)} "
            "(the embedding and output head are split over the vocabulary)"
        )
    if shape.d_model % shape.n_heads:
        out.append(
            f"{n.show('n_heads', shape.n_heads)} does not divide {n.show('d_model', shape.d_model)}"
        )
    if req.sequence_parallel and req.tp > 1 and shape.seq_len % tp:
        out.append(
            f"{n.name('sequence_parallel')}: {n.show('tp', tp)} does not divide "
            f"{n.show('seq_len', shape.seq_len)}"
        )
    return out


def _degree_rules(req: LayoutRequest, n: Names) -> list[str]:
    """Switches that need another degree: sequence parallelism tp, virtual stages a
    pipeline with the interleaved schedule."""
    out = []
    if req.sequence_parallel and req.tp == 1:
        out.append(f"{n.show('sequence_parallel', True)} needs {n.name('tp')} > 1")
    v, schedule = req.virtual_stages, req.pp_schedule
    if v > 1 and schedule != "interleaved_1f1b":
        holds = "always holds 2 stages per rank" if schedule == "zbv" else "holds 1"
        out.append(
            f"{n.show('virtual_stages', v)} applies to "
            f"{n.show('pp_schedule', 'interleaved_1f1b')} only ({schedule} {holds})"
        )
    elif v > 1 and req.pp == 1:
        out.append(f"{n.name('virtual_stages')} > 1 needs {n.name('pp')} > 1")
    if req.pp > 1 and schedule == "interleaved_1f1b" and v < 2:
        out.append(f"{n.show('pp_schedule', schedule)} needs {n.name('virtual_stages')} >= 2")
    return out


def _stage_rules(req: LayoutRequest, shape: ModelShape, n: Names) -> list[str]:
    """Every pipeline stage holds a layer at least (layout/stages.py splits unevenly)."""
    if req.pp == 1:
        return []
    per_rank = stages_per_rank(req.pp_schedule, req.virtual_stages)
    chunks = req.pp * per_rank
    if chunks <= shape.n_layers:
        return []
    if req.pp_schedule == "interleaved_1f1b":
        each = n.show("virtual_stages", req.virtual_stages)
    else:
        each = f"{per_rank} stage(s) per rank ({req.pp_schedule})"
    return [
        f"{n.show('pp', req.pp)} x {each} = {chunks} stages is more than "
        f"{n.show('n_layers', shape.n_layers)}"
    ]


def _trainer_rules(req: LayoutRequest, shape: ModelShape, n: Names) -> list[str]:
    """What meshforge's trainer runs on a one-dimensional mesh only, or not at all."""
    out, tp, pp = [], req.tp, req.pp
    if shape.factory is None and pp > 1 and shape.tie_embeddings:
        out.append(
            f"{n.show('tie_embeddings', True)} shares the embedding with the output head, "
            f"which {n.show('pp', pp)} puts on different stages; set "
            f"{n.name('tie_embeddings')}: false"
        )
    both = f"{n.show('tp', tp)}, {n.show('pp', pp)}"
    if req.zero == 1 and (pp > 1 or tp > 1):
        out.append(
            f"{n.show('zero', 1)} with {both} is not supported "
            "(torch's ZeroRedundancyOptimizer takes plain tensors only); use zero: 2 or 3"
        )
    if req.dtype == "fp16" and (pp > 1 or tp > 1):
        out.append(
            f"{n.show('dtype', 'fp16')} with {both} is not supported "
            "(torch's loss scalers take gradients on one mesh only); use bf16"
        )
    if req.compile and (pp > 1 or tp > 1):
        out.append(f"{n.show('compile', True)} is supported with tp=1 and pp=1 only")
    if req.document_masking and shape.factory is not None:
        out.append(
            f"{n.show('document_masking', True)} needs meshforge's gpt or llama, not "
            f"{n.show('model', shape.factory)} (its forward takes no documents)"
        )
    if req.document_masking and pp > 1:
        out.append(
            f"{n.show('document_masking', True)} is not yet supported under a pipeline "
            f"({n.show('pp', pp)}): its stages pass hidden states only"
        )
    if req.servers is not None and req.dtype == "fp16":
        out.append(
            f"{n.show('dtype', 'fp16')} with {n.show('mode', 'parameter_server')} is not "
            "supported (its loss scaler would have to agree across workers); use bf16"
        )
    return out


def _expert_rules(req: LayoutRequest, shape: ModelShape, n: Names) -> list[str]:
    """Expert parallelism: a mixture-of-experts model whose experts split evenly, over
    ranks borrowed from data parallelism, beside the layouts its all-to-all composes
    with."""
    out, ep = [], req.ep
    if shape.experts and req.dtype == "fp16":
        out.append(
            f"{n.show('dtype', 'fp16')} with a mixture-of-experts model is not supported "
            "(its auxiliary loss would miss the loss scale); use bf16"
        )
    if shape.experts and req.sequence_parallel:
        out.append(
            f"{n.show('sequence_parallel', True)} with a mixture-of-experts model is not "
            "supported (its router reads whole sequences)"
        )
    if ep == 1:
        return out
    if not shape.experts:
        what = n.show("model", shape.factory) if shape.factory else "a dense model"
        return out + [
            f"{n.show('ep', ep)} needs a mixture-of-experts model (model.moe), not {what}"
        ]
    if req.servers is not None:
        out.append(
            f"{n.show('ep', ep)} with {n.show('mode', 'parameter_server')} is not supported "
            "(a parameter server holds whole replicas)"
        )
    if req.zero == 1:
        out.append(
            f"{n.show('ep', ep)} with {n.show('zero', 1)} is not supported (torch's "
            "ZeroRedundancyOptimizer takes plain tensors only); use zero: 0, 2 or 3"
        )
    if req.compile:
        out.append(f"{n.show('compile', True)} is supported with {n.name('ep')}=1 only")
    return out


def _context_rules(req: LayoutRequest, shape: ModelShape, n: Names) -> list[str]:
    """Context parallelism: every sequence cut into 2 x cp chunks (two per rank, head
    and tail, for balanced causal work), attention by all-gathering keys and values
    (allgather) or by trading heads for sequence (alltoall, which needs cp to divide
    the heads of a tensor-parallel rank), on meshforge's models (a mixture of experts
    dropless: its auxiliary loss and load are summed over the cp ranks), beside the
    layouts it is known to compose with."""
    cp, out = req.cp, []
    if cp == 1:  # no attention method applies
        return out
    if req.cp_method == "ring":
        out += _ring_rules(req, shape, n)
    elif req.cp_method not in ("allgather", "alltoall"):
        out.append(
            f"{n.name('cp_method')} must be one of allgather, ring, alltoall, got {req.cp_method!r}"
        )
    if shape.factory is not None:
        out.append(
            f"{n.show('cp', cp)} needs meshforge's gpt or llama, not "
            f"{n.show('model', shape.factory)} (its attention cannot be given the other "
            "ranks' keys and values)"
        )
        return out
    heads = shape.n_heads // req.tp  # a tensor-parallel rank's (tp dividing them: _split_rules)
    if req.cp_method == "alltoall" and shape.n_heads % req.tp == 0 and heads % cp:
        # Ulysses hands each cp rank whole heads of its tensor-parallel rank's; key/value
        # heads too few to split are repeated first, so they need not divide
        per_tp = f" / {n.show('tp', req.tp)}" if req.tp > 1 else ""
        out.append(
            f"{n.show('cp_method', 'alltoall')} needs {n.show('n_heads', shape.n_heads)}"
            f"{per_tp} divisible by {n.show('cp', cp)} (each cp rank attends whole heads)"
        )
    if shape.seq_len % (2 * cp):
        out.append(
            f"{n.show('cp', cp)} needs {n.show('seq_len', shape.seq_len)} divisible by "
            f"2 x cp = {2 * cp} (each rank keeps a chunk from each end of every sequence)"
        )
    elif req.sequence_parallel and req.tp > 1 and (shape.seq_len // cp) % req.tp:
        out.append(
            f"{n.name('sequence_parallel')}: {n.show('tp', req.tp)} does not divide the "
            f"{shape.seq_len // cp} tokens a rank holds of {n.show('seq_len', shape.seq_len)} "
            f"under {n.show('cp', cp)}"
        )
    if req.servers is not None:
        out.append(
            f"{n.show('cp', cp)} with {n.show('mode', 'parameter_server')} is not supported "
            "(a parameter server's workers train whole sequences)"
        )
    if shape.experts and shape.capacity_factor is not None:
        out.append(
            f"{n.show('cp', cp)} with {n.show('capacity_factor', shape.capacity_factor)} is "
            "not yet supported (experts drop tokens in the order of the whole sequence); "
            f"leave {n.name('capacity_factor')} unset (dropless)"
        )
    if req.compile:
        out.append(f"{n.show('compile', True)} is not yet supported with {n.show('cp', cp)}")
    return out


def _ring_rules(req: LayoutRequest, shape: ModelShape, n: Names) -> list[str]:
    """Ring attention (parallel/context_parallel.py, RingAttend): on CUDA devices (its
    flash kernels; the CPU runs its tests, not users' jobs), plain causal attention."""
    out = []
    use = f"use {n.show('cp_method', 'allgather')} or alltoall"
    if req.device is not None and req.device != "cuda":
        out.append(
            f"{n.show('cp_method', 'ring')} needs CUDA devices, and this job's workers "
            f"would run on {req.device} ({n.name('device')}); {use}"
        )
    if req.document_masking:
        out.append(
            f"{n.show('cp_method', 'ring')} with {n.show('document_masking', True)} is not "
            f"yet built; {use}"
        )
    if shape.dropout:
        out.append(
            f"{n.show('cp_method', 'ring')} with {n.show('dropout', shape.dropout)} is not "
            f"built (attention dropout); {use}"
        )
    return out


def _world_rules(
    req: LayoutRequest, n: Names, world_size: int | None, out: list[str]
) -> int | None:
    """The data-parallel degree the world leaves (None: not known yet, or it does not
    fit, in which case the reason is added to `out`)."""
    if world_size is None:
        return req.dp
    if req.servers is not None:
        workers = world_size - req.servers
        if workers < 1:
            out.append(
                f"{n.show('servers', req.servers)} leaves no worker in world size {world_size}"
            )
            return None
        if req.dp is not None and req.dp != workers:
            out.append(
                f"{n.show('dp', req.dp)} does not equal the workers of world size "
                f"{world_size}: {world_size} - {n.show('servers', req.servers)} = {workers}"
            )
            return None
        return workers
    model_ranks = req.tp * req.pp * req.cp
    # "x parallel.cp=N" only where cp is used: the messages of cp 1 stay as they were
    with_cp = f" x {n.show('cp', req.cp)}" if req.cp > 1 else ""
    if world_size % model_ranks:
        out.append(
            f"world size {world_size} is not divisible by {n.show('tp', req.tp)} x "
            f"{n.show('pp', req.pp)}{with_cp} = {model_ranks}"
        )
        return None
    dp = world_size // model_ranks
    if req.dp is not None and req.dp != dp:
        out.append(
            f"{n.show('dp', req.dp)} x {n.show('tp', req.tp)} x {n.show('pp', req.pp)}"
            f"{with_cp} = {req.dp * model_ranks} does not equal the world size {world_size}"
        )
        return None
    return dp


def _batch_rules(req: LayoutRequest, n: Names, dp: int, world_size: int | None) -> list[str]:
    """The global batch splits into dp x micro-batch x micro-batches, and a pipeline
    gets the micro-batches its schedule needs."""
    gb, b = req.global_batch, req.micro_batch
    assert gb is not None and b is not None
    if gb % (dp * b):
        if req.servers is not None and world_size is not None:
            return [
                f"{n.show('global_batch', gb)} is not divisible by workers={dp} x "
                f"{n.show('micro_batch', b)} (world size {world_size} - "
                f"{n.show('servers', req.servers)} workers)"
            ]
        return [
            f"{n.show('global_batch', gb)} is not divisible by dp={dp} x {n.show('micro_batch', b)}"
        ]
    if req.pp == 1:
        return []
    m, schedule = gb // (dp * b), req.pp_schedule
    split = f"{n.name('global_batch')} / (dp x {n.name('micro_batch')}) = {gb} / ({dp} x {b}) = {m}"
    least = min_microbatches(schedule, req.pp)
    if m < least:
        return [
            f"{n.show('pp_schedule', schedule)} with {n.show('pp', req.pp)} needs at least "
            f"{least} micro-batches per step; {split}"
        ]
    if schedule == "interleaved_1f1b" and not interleaved_accepts(m, req.pp):
        return [
            f"{n.show('pp_schedule', schedule)} cannot run {m} micro-batches per step at "
            f"{n.show('pp', req.pp)}: make {n.name('global_batch')} / (dp x "
            f"{n.name('micro_batch')}) a multiple of {req.pp}"
        ]
    return []
