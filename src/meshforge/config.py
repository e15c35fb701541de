"""The job config: a pydantic v2 schema (unknown keys rejected), YAML loading and
`--set key.path=value` overrides. Every error is a ConfigError naming the field."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import AliasEvent
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import Resolver
from yaml.scanner import Scanner

from meshforge.errors import MAX_QUOTED_CHARS, ConfigError, quote, shorten, shorten_quoted
from meshforge.fileio import write_text_atomic
from meshforge.layout import LayoutRequest, ModelShape, ParallelDims, check, derive, first_problem
from meshforge.presets import preset
from meshforge.redact import redact_tree


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)


FAMILIES = ("gpt", "llama")
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
# fields that shape one family only, with the value that means "not given"
_LLAMA_ONLY = {
    "n_kv_heads": None,
    "ffn_hidden": None,
    "rope_theta": 10000.0,
    "norm_eps": 1e-5,
    "head_dim": None,
    "moe": None,
}
_GPT_ONLY = {"mlp_ratio": 4, "dropout": 0.0}
_MOE_ON_GPT = "model.moe applies to model.name=llama, not gpt"
_SHAPE = {"d_model": 128, "n_layers": 4, "n_heads": 4, **_LLAMA_ONLY, **_GPT_ONLY}


class MoEConfig(_Section):
    """A mixture-of-experts feed-forward in every layer after the first `dense_layers`
    (Llama family): `experts` SwiGLU experts `expert_ffn` wide, each token routed to
    `top_k` of them by a router computed in fp32, plus `shared_experts` that every
    token passes through. `router`: softmax (Mixtral, Qwen3) or sigmoid (DeepSeek-V3);
    the top-k weights are renormalised to sum to 1. `load_balance`: the Switch
    Transformer auxiliary loss (weighted by `aux_loss_coeff`), DeepSeek-V3's
    per-expert routing bias (moved by `bias_update_rate` after every step), or none.
    `capacity_factor`: null routes every token (dropless); a number c caps each expert
    at ceil(c x tokens x top_k / experts) tokens per micro-batch and drops the rest."""

    experts: int = Field(ge=2)
    top_k: int = Field(2, ge=1)
    expert_ffn: int = Field(ge=1)
    shared_experts: int = Field(0, ge=0)
    dense_layers: int = Field(0, ge=0)
    router: Literal["softmax", "sigmoid"] = "softmax"
    load_balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    aux_loss_coeff: float = Field(0.01, ge=0)
    bias_update_rate: float = Field(0.001, gt=0)
    capacity_factor: float | None = None

    @model_validator(mode="after")
    def _consistent(self) -> MoEConfig:
        if self.top_k > self.experts:
            raise ValueError(
                f"model.moe.top_k={self.top_k} is larger than model.moe.experts={self.experts}"
            )
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(
                f"model.moe.capacity_factor={self.capacity_factor} must be > 0 "
                "(or null: dropless routing)"
            )
        given = self.model_fields_set
        if "aux_loss_coeff" in given and self.load_balance != "aux_loss":
            raise ValueError(
                f"model.moe.aux_loss_coeff applies to load_balance=aux_loss, "
                f"not {self.load_balance}"
            )
        if "bias_update_rate" in given and self.load_balance != "bias":
            raise ValueError(
                f"model.moe.bias_update_rate applies to load_balance=bias, not {self.load_balance}"
            )
        return self

    @model_serializer(mode="wrap")
    def _without_unused(self, handler: Any) -> dict[str, Any]:
        """A dump leaves out the settings of the balance not chosen (given back, they
        would be refused)."""
        data = handler(self)
        if self.load_balance != "aux_loss":
            data.pop("aux_loss_coeff", None)
        if self.load_balance != "bias":
            data.pop("bias_update_rate", None)
        return data


class ModelConfig(_Section):
    """The model: meshforge's GPT (`gpt`), the Llama-style decoder (`llama`), or a
    user's factory `package.module:function` (called with `kwargs`, returning an
    nn.Module that maps token ids (b, s) to logits (b, s, vocab_size)). `preset`
    fills the shape from presets.py; fields given beside it win."""

    name: str = "gpt"
    preset: str | None = None
    vocab_size: int = Field(256, ge=2)
    d_model: int = Field(128, ge=1)
    n_layers: int = Field(4, ge=1)
    n_heads: int = Field(4, ge=1)
    seq_len: int = Field(128, ge=2)
    mlp_ratio: int = Field(4, ge=1)  # gpt: MLP width = mlp_ratio x d_model
    dropout: float = Field(0.0, ge=0.0, lt=1.0)  # gpt
    # output head shares the token embedding (default: true for gpt, false otherwise)
    tie_embeddings: bool = True
    n_kv_heads: int | None = Field(None, ge=1)  # llama: key/value heads (GQA); n_heads
    ffn_hidden: int | None = Field(None, ge=1)  # llama: SwiGLU width; 8/3 d_model, x64
    rope_theta: float = Field(10000.0, gt=0)  # llama: rotary base
    norm_eps: float = Field(1e-5, gt=0)  # llama: RMSNorm epsilon
    head_dim: int | None = Field(None, ge=2)  # llama: per-head width; d_model/n_heads
    moe: MoEConfig | None = None  # llama: mixture-of-experts feed-forward
    kwargs: dict[str, Any] | None = None  # a factory's keyword arguments
    # a factory's tensor-parallel plan: "package.module:function", called as
    # function(model, tp_mesh) to shard the model in place (parallelize_module)
    tp_plan: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _preset_and_family_defaults(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        value = dict(value)
        if value.get("preset") is not None:
            base = preset(str(value["preset"]))
            if isinstance(base.get("moe"), dict) and isinstance(value.get("moe"), dict):
                moe = dict(base["moe"])
                if value["moe"].get("load_balance", "aux_loss") != "aux_loss":
                    moe.pop("aux_loss_coeff", None)  # the preset's, for a balance not chosen
                value["moe"] = {**moe, **value["moe"]}  # moe fields given beside win
            value = {**base, **value}
        if value.get("name", "gpt") == "gpt" and value.get("moe") is not None:
            # the family first: not the moe fields a gpt cannot use anyway (expert_ffn
            # missing), nor the preset's other llama fields (n_kv_heads)
            raise ValueError(_MOE_ON_GPT)
        if "tie_embeddings" not in value and value.get("name", "gpt") != "gpt":
            value["tie_embeddings"] = False  # Llama-style models have a head of their own
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.is_factory:
            self._check_factory()
            return self
        if self.name not in FAMILIES:
            raise ValueError(
                f"model.name={self.name!r}: use gpt, llama, or a factory 'package.module:function'"
            )
        for key in ("kwargs", "tp_plan"):
            if getattr(self, key) is not None:
                raise ValueError(f"model.{key} applies to a factory model.name, not {self.name}")
        other = _LLAMA_ONLY if self.name == "gpt" else _GPT_ONLY
        for key, unset in other.items():
            if getattr(self, key) != unset:
                owner = "llama" if self.name == "gpt" else "gpt"
                raise ValueError(f"model.{key} applies to model.name={owner}, not {self.name}")
        if self.d_model % self.n_heads and self.head_dim is None:
            raise ValueError(
                f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}"
            )
        if self.moe is not None and self.moe.dense_layers >= self.n_layers:
            raise ValueError(
                f"model.moe.dense_layers={self.moe.dense_layers} leaves no mixture-of-experts "
                f"layer in model.n_layers={self.n_layers}"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"model.n_kv_heads={self.kv_heads} does not divide model.n_heads={self.n_heads}"
            )
        if self.name == "llama" and self.attention_head_dim % 2:
            raise ValueError(
                f"rotary embeddings need an even head size; got {self.attention_head_dim}"
            )
        return self

    def _check_factory(self) -> None:
        for key, unset in _SHAPE.items():
            # given at all (even at its default value), or set to something else
            if key in self.model_fields_set or getattr(self, key) != unset:
                raise ValueError(
                    f"model.{key} shapes meshforge's own models; a factory model "
                    f"({self.name}) takes its shape from model.kwargs"
                )
        if self.tp_plan is not None and not _FACTORY.match(self.tp_plan):
            raise ValueError(f"model.tp_plan={self.tp_plan!r}: expected 'package.module:function'")

    @model_serializer(mode="wrap")
    def _without_unused_shape(self, handler: Any) -> dict[str, Any]:
        """A factory model's dump leaves out the shape fields of meshforge's own models
        (they do not apply, and given back they would be refused)."""
        data = handler(self)
        if self.is_factory:
            for key in _SHAPE:
                data.pop(key, None)
        return data

    @property
    def is_factory(self) -> bool:
        """A user's `package.module:function` rather than one of meshforge's models."""
        return ":" in self.name and bool(_FACTORY.match(self.name))

    def layout_shape(self) -> ModelShape:
        """The shape the layout rules split (a factory model: its name only)."""
        if self.is_factory:
            return ModelShape(factory=self.name, tp_plan=self.tp_plan is not None)
        return ModelShape(
            n_layers=self.n_layers,
            d_model=self.d_model,
            n_heads=self.n_heads,
            kv_heads=self.kv_heads,
            mlp_hidden=self.mlp_hidden,
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            tie_embeddings=self.tie_embeddings,
            experts=self.moe.experts if self.moe is not None else 0,
            capacity_factor=self.moe.capacity_factor if self.moe is not None else None,
            dropout=self.dropout,
        )

    @property
    def attention_head_dim(self) -> int:
        """The width of one attention head: model.head_dim, or d_model / n_heads."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def mlp_hidden(self) -> int:
        """The MLP's inner width: mlp_ratio x d_model (gpt); ffn_hidden, or Llama's
        rule 8/3 x d_model rounded up to a multiple of 64 (llama)."""
        if self.name == "gpt":
            return self.mlp_ratio * self.d_model
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return -(-int(8 * self.d_model / 3) // 64) * 64


class DataConfig(_Section):
    # The built-in corpus, a token-shard directory (`meshforge data prepare`), a
    # nanoGPT-style .bin token file, or an fsspec URL of shards (s3://, gs://, ...)
    # copied once into cache_dir.
    source: str = "builtin:python-stdlib"
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5)
    prefetch: int = Field(2, ge=0)  # steps prepared ahead
    readers: int = Field(1, ge=1)  # threads gathering a step's sequences
    cache_dir: str | None = None  # remote shards' local copy (default: the user cache)
    # Warn, naming data.source, when waiting for data takes more than this share of
    # the step (over a logged interval after the first).
    wait_warning: float = Field(0.1, gt=0, le=1)
    # Keep attention inside the documents packed into a sequence (cut after each
    # end-of-text token of the data's tokenizer) and restart positions in each one.
    document_masking: bool = False


class CommConfig(_Section):
    """How gradients and parameters travel between data-parallel ranks (README:
    "Communication"). Each setting applies to the layouts named beside it; set
    elsewhere it is refused, since it would do nothing."""

    # DDP (zero 0/1, tp = pp = 1): gradient bucket size; reduction overlapped with
    # backward (off only to measure what overlap saves); compression by a DDP
    # communication hook.
    bucket_mb: float = Field(25.0, gt=0)
    overlap: bool = True
    compression: Literal["none", "bf16", "fp16", "powersgd"] = "none"
    powersgd_rank: int = Field(1, ge=1)  # PowerSGD's matrix approximation rank
    powersgd_warmup: int = Field(10, ge=2)  # optimizer steps of plain all-reduce first
    # FSDP (zero 2/3): blocks whose parameters are gathered ahead of use (torch's
    # default, None, is one, implicitly), and the dtype gradients are reduced in.
    prefetch: int | None = Field(None, ge=1)
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"


class ParameterServerConfig(_Section):
    """parallel.mode: parameter_server. The last `servers` ranks hold the parameters
    and optimizer state, sharded; the others (rank 0 among them) are workers."""

    servers: int = Field(1, ge=1)
    sync: bool = True  # one averaged update per step; false: each push applied on arrival
    max_staleness: int = Field(0, ge=0)  # async: updates a gradient may lag, at most


class ParallelConfig(_Section):
    dp: int | Literal["auto"] = "auto"
    zero: Literal[0, 1, 2, 3] = 0
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    # expert parallel: each rank holds model.moe.experts / ep experts; the ep ranks are
    # borrowed from the data-parallel ranks (ep divides dp), tokens reach their experts
    # by all-to-all
    ep: int = Field(1, ge=1)
    # context parallel: each rank holds 1/cp of every sequence (two chunks of 1/(2 cp),
    # head and tail, so causal work is balanced); a mesh dimension of its own
    cp: int = Field(1, ge=1)
    # how attention sees the other cp ranks' keys and values: allgather (all-gather K
    # and V, Llama 3's), alltoall (DeepSpeed Ulysses: an all-to-all trades heads for
    # sequence, so cp must divide model.n_heads / parallel.tp) or ring (ring attention:
    # K and V passed around the cp ranks while attention runs, on CUDA devices only;
    # plain causal attention, without data.document_masking or model.dropout)
    cp_method: Literal["allgather", "ring", "alltoall"] = "allgather"
    # Under pp > 1 the pipeline's micro-batches are the gradient-accumulation
    # micro-batches: global_batch / (dp x micro_batch) of them, micro_batch each.
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv"] = "1f1b"
    virtual_stages: int = Field(1, ge=1)  # stages per pipeline rank, interleaved_1f1b only
    sequence_parallel: bool = False  # shard norms/dropout along the sequence (needs tp > 1)
    loss_parallel: bool = True  # tp > 1: cross-entropy on vocabulary-sharded logits
    mode: Literal["collective", "parameter_server"] = "collective"
    comm: CommConfig = CommConfig()
    ps: ParameterServerConfig | None = None  # parallel.mode: parameter_server only

    @field_validator("pp_schedule", mode="before")
    @classmethod
    def _schedule_alias(cls, value: Any) -> Any:
        return "interleaved_1f1b" if value == "interleaved" else value

    @model_validator(mode="before")
    @classmethod
    def _legacy_bucket(cls, value: Any) -> Any:
        """`parallel.bucket_mb` (before parallel.comm existed) still reads as
        parallel.comm.bucket_mb: resolved config.yaml files of older runs carry it."""
        if isinstance(value, dict) and "bucket_mb" in value:
            value = dict(value)
            bucket = value.pop("bucket_mb")
            comm = dict(value.get("comm") or {})
            if "bucket_mb" in comm and comm["bucket_mb"] != bucket:
                raise ValueError(
                    "parallel.bucket_mb and parallel.comm.bucket_mb disagree; "
                    "give parallel.comm.bucket_mb only"
                )
            comm["bucket_mb"] = bucket
            value["comm"] = comm
        return value

    @model_validator(mode="after")
    def _dp_positive(self) -> ParallelConfig:
        if self.dp != "auto" and self.dp < 1:
            raise ValueError(f"parallel.dp must be >= 1 or 'auto', got {self.dp}")
        check_comm(self)
        return self

    @property
    def is_ddp(self) -> bool:
        """Plain DistributedDataParallel carries the gradients (zero 0/1, no tp/pp)."""
        return self.zero <= 1 and self.tp == 1 and self.pp == 1 and self.ep == 1


def check_comm(p: ParallelConfig) -> None:
    """parallel.comm and parallel.ps settings against the layout (the rules that need
    no world size); each failure names the fields."""
    c = p.comm
    # settings that differ from their defaults (a resolved config.yaml lists them all)
    given = {k for k, f in CommConfig.model_fields.items() if getattr(c, k) != f.default}
    layout = f"parallel.zero={p.zero}, tp={p.tp}, pp={p.pp}" + (f", ep={p.ep}" if p.ep > 1 else "")
    layout += f", cp={p.cp}" if p.cp > 1 else ""
    if p.mode == "parameter_server":
        if p.zero or p.tp > 1 or p.pp > 1:
            raise ValueError(
                f"parallel.mode=parameter_server trains full replicas on its workers; "
                f"it takes zero=0, tp=1, pp=1 (got {layout})"
            )
        if given:
            raise ValueError(
                "parallel.comm." + sorted(given)[0] + " applies to parallel.mode=collective; "
                "a parameter server moves whole gradients and parameters point to point"
            )
        ps = p.ps or ParameterServerConfig()
        if ps.sync and ps.max_staleness:
            raise ValueError(
                f"parallel.ps.max_staleness={ps.max_staleness} applies to asynchronous "
                "training (parallel.ps.sync: false); a synchronous server is never stale"
            )
        return
    if p.ps is not None:
        raise ValueError("parallel.ps applies to parallel.mode=parameter_server only")
    if not p.is_ddp:
        for key, what in (
            ("compression", "compression hooks"),
            ("overlap", "overlap switch"),
            ("bucket_mb", "gradient buckets"),
            ("powersgd_rank", "PowerSGD settings"),
            ("powersgd_warmup", "PowerSGD settings"),
        ):
            if key in given:
                hint = " (under zero 2/3 use parallel.comm.reduce_dtype)" if p.zero >= 2 else ""
                raise ValueError(
                    f"parallel.comm.{key}={getattr(c, key)}: DDP's {what} apply to zero 0/1 "
                    f"with tp=1 and pp=1, not to {layout}{hint}"
                )
    if c.compression != "powersgd":
        for key in ("powersgd_rank", "powersgd_warmup"):
            if key in given:
                raise ValueError(
                    f"parallel.comm.{key} applies to parallel.comm.compression=powersgd "
                    f"(got compression={c.compression})"
                )
    if not c.overlap and c.compression != "none":
        raise ValueError(
            f"parallel.comm.overlap=false reduces the gradients after backward in "
            f"plain all-reduces; it cannot take parallel.comm.compression={c.compression}"
        )
    if p.zero < 2:
        if c.prefetch is not None:
            raise ValueError(
                f"parallel.comm.prefetch applies to FSDP (zero 2 or 3), not zero={p.zero}"
            )
        if c.reduce_dtype != "fp32":
            # also under tp/pp: zero 0's `replicate` could reduce in another dtype, but
            # whether it exists at all (dp > 1) only the world size tells
            hint = f"; with DDP use parallel.comm.compression: {c.reduce_dtype}" if p.is_ddp else ""
            raise ValueError(
                f"parallel.comm.reduce_dtype applies to FSDP (zero 2 or 3), not zero={p.zero}"
                + hint
            )


class PrecisionConfig(_Section):
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    initial_loss_scale: float = Field(2.0**16, gt=0)


class TrainConfig(_Section):
    steps: int = Field(200, ge=1)
    global_batch: int = Field(16, ge=1)
    micro_batch: int = Field(4, ge=1)
    lr: float = Field(3.0e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup: int = Field(20, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0)  # 0 disables clipping
    seed: int = Field(1234, ge=0)
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    eval_every: int = Field(50, ge=0)  # 0 disables validation
    eval_batches: int = Field(2, ge=1)
    compile: bool = False
    # Elastic restarts after a worker fails (torchrun's --max-restarts, which wins when
    # given); each restart resumes from the newest valid checkpoint.
    max_restarts: int = Field(0, ge=0)


class CheckpointConfig(_Section):
    every: int = Field(50, ge=0)  # 0: only at the end
    keep: int = Field(3, ge=1)


class WandbConfig(_Section):
    """Weights & Biases (the wandb package, when installed). Offline by default: the
    run is written under RUN_DIR/wandb and `wandb sync` uploads it later; online sends
    it as it trains (needs `wandb login` on rank 0's node)."""

    project: str = Field(min_length=1)

    @field_validator("project", mode="before")
    @classmethod
    def _named(cls, value: Any) -> Any:
        if value is None or (isinstance(value, str) and not value.strip()):
            raise ValueError("name the W&B project (observe.wandb.project: NAME)")
        return value

    mode: Literal["offline", "online"] = "offline"
    entity: str | None = None


class ObserveConfig(_Section):
    log_every: int = Field(10, ge=1)
    # Flight record: what each rank is doing, in RUN_DIR/health/flight-rank-K.json,
    # written every flight_every_s seconds and on any exception (observe/flight.py).
    flight: bool = True
    flight_every_s: float = Field(5.0, gt=0)
    # A rank whose own work per log interval exceeds the median's by this fraction, in
    # this many consecutive intervals, is named a straggler.
    straggler_margin: float = Field(0.25, gt=0)
    straggler_intervals: int = Field(2, ge=1)
    # Steps written to RUN_DIR/trace.json as one Chrome/Perfetto timeline of every
    # rank (torch profiler): "" for none, "5" or "5-7" or "5,9".
    trace_steps: str = ""
    # The per-node system sampler (observe/sampler.py): CPU, host memory, network per
    # interface, GPUs through NVML, every sample_every_s seconds, in RUN_DIR/system/.
    system: bool = True
    sample_every_s: float = Field(2.0, gt=0)
    # Memory health: advice when this share of reserved GPU memory holds no tensor.
    fragmentation_threshold: float = Field(0.3, gt=0, lt=1)
    # Sinks beside metrics.jsonl (observe/sinks.py): TensorBoard event files in
    # RUN_DIR/tensorboard; a Prometheus endpoint per node (its first rank serves every
    # rank of the node, metrics named meshforge_*); Weights & Biases.
    tensorboard: bool = False
    prometheus_port: int | None = Field(None, ge=1, le=65535)
    prometheus_addr: str = "127.0.0.1"
    wandb: WandbConfig | None = None

    @field_validator("prometheus_port", mode="before")
    @classmethod
    def _port_only(cls, value: Any) -> Any:
        """A port number; an address belongs in prometheus_addr, said out loud."""
        if isinstance(value, str) and not value.strip().isdigit():
            raise ValueError(
                f"a port number, not {value!r}: the endpoint listens on 127.0.0.1 unless "
                "observe.prometheus_addr names another address"
            )
        return value

    @field_validator("prometheus_addr")
    @classmethod
    def _ip_address(cls, value: str) -> str:
        import ipaddress

        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(
                f"observe.prometheus_addr must be an IP address to listen on "
                f"(127.0.0.1, 0.0.0.0, ...), not {value!r}"
            ) from None
        return value

    def check_sinks(self) -> None:
        """A sink whose package is missing is refused before anything starts."""
        import importlib.util

        wanted = [("tensorboard", self.tensorboard, "observe.tensorboard")]
        wanted.append(("prometheus_client", self.prometheus_port, "observe.prometheus_port"))
        wanted.append(("wandb", self.wandb, "observe.wandb"))
        pip = {"prometheus_client": "prometheus-client"}
        for module, used, key in wanted:
            if used and importlib.util.find_spec(module) is None:
                raise ConfigError(
                    f"{key} needs the {module} package, which is not installed here: "
                    f"pip install {pip.get(module, module)}"
                )
        if self.prometheus_port and not self.flight:
            raise ConfigError(
                "observe.prometheus_port serves the ranks' flight records; it needs "
                "observe.flight: true"
            )

    @field_validator("trace_steps", mode="before")
    @classmethod
    def _trace_steps_spec(cls, value: Any) -> Any:
        """A step spec (observe/trace.py); a single step may come as a YAML number."""
        if value is None:  # `--set observe.trace_steps=`
            return ""
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if isinstance(value, str):
            parse_steps(value)
            value = value.strip()
        return value


class RuntimeConfig(_Section):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # Collective timeout while the job starts (first step: compilation, first
    # checkpoint load), then a shorter one for training (as torchtitan does); None keeps
    # timeout_s throughout.
    timeout_s: float = Field(300.0, gt=0)
    step_timeout_s: float | None = Field(120.0, gt=0)
    # After SIGTERM (a scheduler's time limit, preemption, eviction): seconds the workers
    # get to write a checkpoint and leave; also how long a launcher whose workers are
    # gone waits for its rendezvous before it exits.
    grace_s: float = Field(30.0, gt=0)
    threads_per_worker: int | None = Field(None, ge=1)


class JobConfig(_Section):
    name: str = "job"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    # "auto": the planner picks the layout at launch (plan/jobs/auto.py, resolve_parallel_auto)
    parallel: ParallelConfig | Literal["auto"] = Field(ParallelConfig(), union_mode="left_to_right")
    precision: PrecisionConfig = PrecisionConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    observe: ObserveConfig = ObserveConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    # the job file it was read from (load_config): an error about the layout at a world
    # size names it, as the errors found while reading it do
    _source: str | None = PrivateAttr(None)

    def __eq__(self, other: object) -> bool:
        """The same settings: which file a config was read from does not count."""
        if not isinstance(other, JobConfig):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        """The run directory is runs/NAME when --run-dir is not given: a plain name, so
        that a job file can never choose a directory outside runs/."""
        if not re.fullmatch(r"[A-Za-z0-9._-]+", value) or value in (".", ".."):
            raise ValueError(
                f"{value!r} is not a plain name (letters, digits, '.', '_', '-'; not '.' "
                "or '..'): it names the run directory runs/NAME"
            )
        return value

    @field_validator("parallel", mode="before")
    @classmethod
    def _parallel_mapping_or_auto(cls, value: Any) -> Any:
        if value == "auto" or isinstance(value, dict | ParallelConfig):
            return value
        raise ValueError("parallel must be a mapping of settings or 'auto'")

    @model_validator(mode="after")
    def _cross_checks(self) -> JobConfig:
        t = self.train
        if t.global_batch % t.micro_batch:
            raise ValueError(
                f"train.global_batch={t.global_batch} is not divisible by "
                f"train.micro_batch={t.micro_batch}"
            )
        _check_trace_steps(self.observe.trace_steps, t.steps)
        if self.parallel != "auto":  # resolved at launch, then checked like any layout
            first_problem(check(self.layout_request(), self.model.layout_shape()))
        return self

    def _parallel(self) -> ParallelConfig:
        if self.parallel == "auto":
            raise ConfigError(
                "parallel: auto is resolved at launch by `meshforge train`; "
                "give a parallel mapping to run a worker directly"
            )
        return self.parallel

    def check_trainable(self) -> None:
        """Layouts this version cannot train, and sinks it cannot write, fail before any
        worker starts."""
        self._parallel()
        self.observe.check_sinks()

    # -- layout -------------------------------------------------------------
    def layout_request(self, device: str | None = None) -> LayoutRequest:
        """The layout this job asks for, as the layout rules read it. `device`: the
        workers' device type where the caller knows it (a launch, a worker); else
        runtime.device's, unless auto (not known yet)."""
        p = self._parallel()
        if device is None and self.runtime.device != "auto":
            device = self.runtime.device
        ps = p.ps or ParameterServerConfig()
        server = p.mode == "parameter_server"
        return LayoutRequest(
            tp=p.tp,
            pp=p.pp,
            ep=p.ep,
            cp=p.cp,
            cp_method=p.cp_method,
            dp=None if p.dp == "auto" else p.dp,
            zero=p.zero,
            sequence_parallel=p.sequence_parallel,
            pp_schedule=p.pp_schedule,
            virtual_stages=p.virtual_stages,
            servers=ps.servers if server else None,
            ps_sync=ps.sync,
            max_staleness=ps.max_staleness,
            dtype=self.precision.dtype,
            compile=self.train.compile,
            global_batch=self.train.global_batch,
            micro_batch=self.train.micro_batch,
            document_masking=self.data.document_masking,
            device=device,
        )

    def dims(self, world_size: int, device: str | None = None) -> ParallelDims:
        """The checked layout on `world_size` ranks (`device`: the workers' device type,
        where the caller knows it: `layout_request`); ConfigError naming the first rule
        it breaks (layout/rules.py), prefixed with the job file it was read from."""
        try:
            return derive(self.layout_request(device), self.model.layout_shape(), world_size)
        except ConfigError as exc:
            if self._source is None:
                raise
            raise ConfigError(f"{self._source}: {exc}") from None

    def resolve_dp(self, world_size: int) -> int:
        """The data-parallel degree for a world size; raises ConfigError if it cannot fit."""
        return self.dims(world_size).dp

    def grad_accum_steps(self, dp: int) -> int:
        return self.train.global_batch // (dp * self.train.micro_batch)


_STEP_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_steps(spec: str) -> list[int]:
    """ "5" -> [5]; "5-7" -> [5, 6, 7]; "5,9" -> [5, 9]; "" -> []. Raises ValueError
    naming the part that is not a step number (>= 1) or an increasing range."""
    spec = spec.strip()
    if not spec:
        return []
    steps: set[int] = set()
    for item in spec.split(","):
        match = _STEP_ITEM.match(item.strip())
        if match is None:
            raise ValueError(
                f"{item.strip()!r} is not a step or a range of steps (give e.g. 5, 5-7 or 5,9)"
            )
        first = int(match.group(1))
        last = int(match.group(2) or first)
        if first < 1:
            raise ValueError(f"steps count from 1 (as the progress line shows them), not {first}")
        if last < first:
            raise ValueError(f"the range {item.strip()} ends before it starts")
        steps.update(range(first, last + 1))
    return sorted(steps)


def _check_trace_steps(spec: str, steps: int) -> None:
    traced = parse_steps(spec)
    if traced and traced[-1] > steps:
        raise ValueError(
            f"observe.trace_steps={spec} names step {traced[-1]}, beyond train.steps={steps}"
        )


# -- loading -----------------------------------------------------------------

# Bounds on a config's YAML (a file, or one `--set` value), so that hostile or broken
# input is refused in well under a second with one line, never expanded into memory.
# A job file is a few kilobytes; a megabyte leaves room for a factory's kwargs and is
# still scanned by libyaml in milliseconds.
MAX_CONFIG_BYTES = 2**20
# Values (mappings, lists, scalars, keys included) once every alias is expanded where it
# is used: a job has about a hundred, a factory's kwargs perhaps thousands. Counting
# alias uses refuses a "billion laughs" (aliases of aliases, ~1 KB that expand to
# billions of values) after a few events, and keeps the resolved config.yaml small.
MAX_CONFIG_NODES = 10_000
# Nesting depth of mappings and lists: the schema is 3 levels deep and kwargs add a
# few; composing, validating and dumping recurse per level, so a limit far below
# Python's recursion limit (1000) turns deep nesting into one line, not a traceback.
MAX_CONFIG_DEPTH = 32


class _Bounds(Exception):
    """A bound broken while composing YAML (the reason, without the source's name)."""


class _BoundedComposer(Composer):
    """PyYAML's composer, counting values as aliases expand and refusing deep nesting.

    Every alias use adds the size of the subtree it names (computed once, when that
    subtree was composed), so the count is what a reader of the loaded data would see."""

    def __init__(self) -> None:
        super().__init__()
        self._nodes = 0
        self._depth = 0
        self._sizes: dict[int, int] = {}  # id(node) -> values in it, aliases expanded

    def _count(self, n: int) -> None:
        self._nodes += n
        if self._nodes > MAX_CONFIG_NODES:
            raise _Bounds(
                f"more than {MAX_CONFIG_NODES:,} values, each alias counted where it is "
                "used (the limit, MAX_CONFIG_NODES)"
            )

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(AliasEvent):
            anchor = self.peek_event().anchor
            target = self.anchors.get(anchor)
            if target is not None:  # an unknown anchor: PyYAML's own error
                if id(target) not in self._sizes:
                    raise _Bounds(f"alias *{anchor} is used inside the value it names")
                self._count(self._sizes[id(target)])
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_CONFIG_DEPTH:
            raise _Bounds(_too_deep())
        before = self._nodes
        node = super().compose_node(parent, index)
        self._depth -= 1
        self._count(1)
        self._sizes[id(node)] = self._nodes - before
        return node


class _PyBoundedLoader(Reader, Scanner, Parser, _BoundedComposer, SafeConstructor, Resolver):
    """yaml.SafeLoader with the bounded composer (PyYAML's own parser, in Python)."""

    def __init__(self, stream: str) -> None:
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        Parser.__init__(self)
        _BoundedComposer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)


_BoundedLoader: type = _PyBoundedLoader
if yaml.__with_libyaml__:  # libyaml's parser where installed: scans ~50x faster
    from yaml.cyaml import CParser

    class _CBoundedLoader(_BoundedComposer, CParser, SafeConstructor, Resolver):
        """yaml.CSafeLoader with the bounded composer: libyaml's events, composed here
        (the composer comes first in the MRO, so CParser's own composing is not used)."""

        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            _BoundedComposer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)

    _BoundedLoader = _CBoundedLoader


def load_yaml_text(text: str, where: str) -> Any:
    """yaml.safe_load within the bounds above (MAX_CONFIG_BYTES, MAX_CONFIG_NODES,
    MAX_CONFIG_DEPTH). A broken bound is a one-line ConfigError starting with WHERE (a
    file, or `--set KEY`); a YAML syntax error is yaml.YAMLError, as from safe_load."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{where}: {size:,} bytes, more than a config may hold "
            f"({MAX_CONFIG_BYTES:,} bytes, the limit MAX_CONFIG_BYTES)"
        )
    return _load_bounded(text, where, _BoundedLoader)


def _load_bounded(text: str, where: str, loader_type: type) -> Any:
    loader = loader_type(text)
    try:
        return loader.get_single_data()
    except _Bounds as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except yaml.YAMLError as exc:
        # libyaml has a nesting limit of its own (1000 flow levels), met while it scans
        # ahead, before the composer counts: the same bound, said the same way
        if "maximum nesting depth" in str(getattr(exc, "problem", "")):
            raise ConfigError(f"{where}: {_too_deep()}") from None
        raise
    finally:
        loader.dispose()


def _too_deep() -> str:
    return f"nested more than {MAX_CONFIG_DEPTH} levels deep (the limit, MAX_CONFIG_DEPTH)"


def _is_union_tag(part: Any) -> bool:
    """pydantic names the union member a value was tried against in the error path."""
    return isinstance(part, str) and ("ParallelConfig" in part or part.startswith("literal["))


def _format_validation_error(exc: ValidationError) -> str:
    """The first error as one line naming the field; a value quoted back is cut short
    (errors.quote), whatever its size."""
    err = exc.errors(include_url=False)[0]
    # a union's member name (parallel: mapping | "auto") is not part of the user's path
    loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        return f"unknown key '{shorten(loc, MAX_QUOTED_CHARS)}'"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    msg = shorten_quoted(msg)
    if not loc or msg.startswith(f"{loc}."):  # the message names the field itself
        return msg
    value = err.get("input")
    shown = quote(value)
    if isinstance(value, dict) or shown in msg:
        return f"{loc}: {msg}"
    return f"{loc}: {msg} (got {shown})"


def _section_type(annotation: Any) -> Any:
    """The model class of a section, also when it may be a string instead (parallel: auto)."""
    for member in get_args(annotation) or (annotation,):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return annotation


def _parse_scalar(text: str, where: str) -> Any:
    """Coerce an override value the way YAML would ('3' -> 3, 'true' -> True, 'null' ->
    None), within the config bounds; text that is not YAML stays text."""
    try:
        return load_yaml_text(text, where)
    except yaml.YAMLError:
        return text


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one `key.path=value` to a raw config dict, checking the path against the schema."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects KEY=VALUE, got {quote(assignment)}")
    path, value_text = assignment.split("=", 1)
    parts = path.strip().split(".")
    shown = shorten(path.strip(), MAX_QUOTED_CHARS)  # the key as error lines quote it
    if not all(parts):
        raise ConfigError(f"--set has an empty key in {shown!r}")
    schema: type[BaseModel] = JobConfig
    node = raw
    for i, part in enumerate(parts):
        fields = schema.model_fields
        if part not in fields:
            where = ".".join(parts[:i]) or "the top level"
            raise ConfigError(
                f"--set {shown}: no key '{shorten(part, MAX_QUOTED_CHARS)}' in {where}"
            )
        annotation = _section_type(fields[part].annotation)
        is_last = i == len(parts) - 1
        if is_last:
            node[part] = _parse_scalar(value_text, f"--set {shown}")
            return
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            raise ConfigError(f"--set {shown}: '{'.'.join(parts[: i + 1])}' is not a section")
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {shown}: '{'.'.join(parts[: i + 1])}' is not a section")
        node, schema = child, annotation


def build_config(raw: dict[str, Any]) -> JobConfig:
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None


def read_yaml_file(path: str | Path, kind: str = "config file") -> Any:
    """Parse a YAML file within the config bounds (load_yaml_text); every failure is a
    one-line ConfigError naming the file. At most MAX_CONFIG_BYTES + 1 bytes are read."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{kind} not found: {path}")
    if path.is_dir():
        raise ConfigError(f"{kind} path is a directory, not a file: {path}")
    try:
        with open(path, "rb") as f:  # read bounded: a FIFO or /dev/zero has no size
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {kind} {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{path}: {kind} larger than {MAX_CONFIG_BYTES:,} bytes "
            f"(the limit, MAX_CONFIG_BYTES); a job file is a few kilobytes"
        )
    try:
        return load_yaml_text(data.decode("utf-8"), str(path))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        # the parser's own words: what it expected, and what it was inside (an
        # unclosed brace names the line it opened on)
        problem = " ".join(str(getattr(exc, "problem", "") or "").split())
        context, opened = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if problem and context and opened is not None:
            problem += f" ({' '.join(str(context).split())} at line {opened.line + 1})"
        why = f": {shorten(problem, MAX_QUOTED_CHARS * 2)}" if problem else ""
        raise ConfigError(f"invalid YAML in {path}{where}{why}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{kind} is not UTF-8 text: {path}") from None


def load_raw(path: str | Path) -> dict[str, Any]:
    raw = read_yaml_file(path)
    if raw is None or raw == {}:
        # An empty file (or only comments) would train every default: almost surely a
        # wrong path or an unsaved editor buffer, never what was meant.
        raise ConfigError(f"{path}: the job file is empty (nothing but comments or blanks)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return raw


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> JobConfig:
    raw = load_raw(path) if path is not None else {}
    for assignment in overrides or []:
        apply_override(raw, assignment)
    if path is None:
        return build_config(raw)
    try:
        cfg = build_config(raw)
    except ConfigError as exc:  # which file: a job file, or a cluster file given as one
        raise ConfigError(f"{path}: {exc}") from None
    cfg._source = str(path)
    return cfg


def dump_config(cfg: JobConfig) -> str:
    """The resolved config as YAML, every URL's credential replaced by `***`
    (meshforge.redact): what a run records, shares or sends is never a secret. A redacted
    `data.source` still names its data: the launcher, which read the job with the
    credential, fills the remote-shard cache that the workers then read by that name."""
    return yaml.safe_dump(redact_tree(cfg.model_dump(mode="json")), sort_keys=False)


def save_config(cfg: JobConfig, path: str | Path) -> None:
    """Write `dump_config(cfg)` (redacted) to `path`, atomically, never through a link
    at PATH."""
    write_text_atomic(path, dump_config(cfg))
