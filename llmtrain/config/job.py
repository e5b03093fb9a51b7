"""A run's whole config (:class:`JobConfig`), built from a preset and overrides
(:func:`load_config`); what reliability reads of it, whatever the loop trains
(:class:`Settings`); and the checks that span fields, run before any process group
starts."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import json
from dataclasses import dataclass, field
from typing import Any

from llmtrain.config.parsing import (check_field, coerce, parse_overrides, read_preset,
                                     step_ranges, unknown_key)
from llmtrain.config.sections import (SECTIONS, CheckpointConfig, ConfigError, ControlConfig,
                                      DataConfig, HealthConfig, IntegrityConfig, MetricsConfig,
                                      ModelConfig, OptimConfig, ParallelismConfig,
                                      ReliabilityConfig, TrainingConfig, WarmConfig)


@dataclass
class JobConfig:
    """Every setting of a run, one section each (:mod:`llmtrain.config.sections`)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)
    warm: WarmConfig = field(default_factory=WarmConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every section's fields, as plain values."""
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """A short hash of every setting, to tell runs and checkpoints apart."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def checkpoint_url(self) -> str:
        """Where checkpoints go (:attr:`Settings.checkpoint_url`)."""
        return self.settings().checkpoint_url

    def mesh_shape(self, world_size: int) -> tuple[int, int]:
        """(dp_replicate, dp_shard) for ``world_size`` ranks (:func:`mesh_shape`)."""
        return mesh_shape(self.parallelism, world_size)

    def tokens_per_step(self) -> int:
        """Tokens in one optimizer step: the global batch's sequences, whole."""
        return self.training.global_batch_size * self.data.seq_len

    def data_rank(self, rank: int, world_size: int) -> tuple[int, int]:
        """The data-parallel rank of ``rank`` and their count: each tensor-parallel group
        (``parallelism.tp`` consecutive ranks) reads one share of every batch."""
        tp = self.parallelism.tp
        return rank // tp, world_size // tp

    def settings(self) -> Settings:
        """The sections the reliability components read: what llmtrain's trainer gives
        the public API (:class:`llmtrain.api.Session`)."""
        return Settings(run_dir=self.training.run_dir, steps=self.training.steps,
                        **{name: getattr(self, name) for name in Settings.SECTIONS})

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step that keep the global batch fixed."""
        t, tp = self.training, self.parallelism.tp
        per_step = t.micro_batch_size * (world_size // tp)
        ranks = (f"{world_size} ranks" if tp == 1 else
                 f"{world_size // tp} data-parallel ranks ({world_size} / parallelism.tp={tp})")
        if t.global_batch_size % per_step:
            raise ConfigError(
                f"training.global_batch_size={t.global_batch_size} is not a multiple of "
                f"training.micro_batch_size={t.micro_batch_size} x {ranks} "
                f"= {per_step}; choose a global batch divisible by {per_step}")
        return t.global_batch_size // per_step

    def validate(self, world_size: int = 1) -> None:
        """Checks that span fields; per-field ranges are checked while loading."""
        m, d = self.model, self.data
        if m.dim % m.n_heads:
            raise ConfigError(f"model.dim={m.dim} must be divisible by model.n_heads={m.n_heads}")
        if (m.dim // m.n_heads) % 2:
            raise ConfigError(f"model.dim / model.n_heads = {m.dim // m.n_heads} must be even "
                              f"(rotary embeddings rotate pairs)")
        if m.n_heads % m.n_kv_heads:
            raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide "
                              f"model.n_heads={m.n_heads}")
        if d.seq_len > m.max_seq_len:
            raise ConfigError(f"data.seq_len={d.seq_len} exceeds model.max_seq_len="
                              f"{m.max_seq_len}; lower data.seq_len or raise model.max_seq_len")
        if d.source == "tokens" and not d.path:
            raise ConfigError("data.path is empty but data.source='tokens' needs it: give "
                              "the fsspec URL of a directory of token shards")
        if d.source == "embedded" and m.vocab_size < 256:
            raise ConfigError(f"model.vocab_size={m.vocab_size} is too small for the byte "
                              f"tokenizer of data.source='embedded': it needs >= 256")
        self._check_tp()
        self.settings().validate(world_size)
        self.accumulation_steps(world_size)


    def _check_tp(self) -> None:
        """Tensor parallelism splits heads, KV heads, the FFN's hidden units and the
        vocabulary over ``parallelism.tp`` ranks, and the sequence (sequence parallel
        norms): each must divide evenly. The same at every world size."""
        p = self.parallelism
        tp = p.tp
        if tp == 1:
            return
        if p.compile and p.activation_checkpoint == "full":
            raise ConfigError(
                f"parallelism.activation_checkpoint='full' with parallelism.compile and "
                f"parallelism.tp={tp} fails in torch's compiled checkpoint (a device mesh "
                f"among the saved tensors); use activation_checkpoint='selective', or "
                f"compile=false")
        m = self.model
        split = {"model.n_heads": m.n_heads, "model.n_kv_heads": m.n_kv_heads,
                 "the FFN's hidden size (model.dim, ffn_dim_multiplier, multiple_of)":
                     m.ffn_hidden_dim(),
                 "model.vocab_size": m.vocab_size, "data.seq_len": self.data.seq_len}
        uneven = {name: n for name, n in split.items() if n % tp}
        if uneven:
            raise ConfigError(
                f"parallelism.tp={tp} does not divide "
                + ", ".join(f"{name}={n}" for name, n in uneven.items())
                + f": tensor parallelism splits each of them over the tp ranks; set "
                  f"parallelism.tp={math.gcd(*split.values())} (the largest that divides "
                  f"them all) or change the model")


def mesh_shape(p: ParallelismConfig, world_size: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for ``world_size`` ranks, or ConfigError. One of the two
    may be -1, the rest: with ``dp_replicate = -1`` a replica keeps its size at any world
    size, and a job that loses a replica goes on with the others (no resharding). With
    ``tp`` above 1 they divide the world size / tp: each data-parallel rank is a group of
    ``tp`` consecutive ranks."""
    if world_size % p.tp:
        raise ConfigError(
            f"parallelism.tp={p.tp} does not divide a world of {world_size} ranks: every "
            f"tensor-parallel group needs {p.tp} ranks; run a multiple of {p.tp} ranks "
            f"(whole nodes), or lower parallelism.tp")
    world_size //= p.tp
    if 0 in (p.dp_replicate, p.dp_shard) or p.dp_replicate == p.dp_shard == -1:
        raise ConfigError(
            f"parallelism.dp_replicate={p.dp_replicate}, parallelism.dp_shard="
            f"{p.dp_shard}: each must be a count of ranks, or -1 for the rest, and at "
            f"most one of them -1")
    replicate = p.dp_replicate if p.dp_replicate != -1 else world_size // p.dp_shard
    shard = p.dp_shard if p.dp_shard != -1 else world_size // p.dp_replicate
    if replicate * shard != world_size or not replicate or not shard:
        raise ConfigError(
            f"parallelism.dp_replicate={p.dp_replicate} x parallelism.dp_shard="
            f"{p.dp_shard} does not fit a world of {world_size} ranks: their product "
            f"must equal the world size (set one of them to -1 to use all the rest)")
    return replicate, shard


@dataclass
class Settings:
    """What llmtrain's reliability needs to know of a run, whatever its loop trains: the
    run's directory (events, diagnostics, checkpoints unless ``checkpoint.url`` says
    otherwise), its length in optimizer steps (the last is always saved, and a run that
    reached it is complete), and one section per component, each as in ``JobConfig``
    (``llmtrain config --reference`` lists every field)."""
    SECTIONS = ("parallelism", "checkpoint", "control", "reliability", "integrity", "warm",
                "health", "metrics")
    run_dir: str
    steps: int
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)
    warm: WarmConfig = field(default_factory=WarmConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @property
    def checkpoint_url(self) -> str:
        """Where checkpoints go: ``checkpoint.url``, else ``<run_dir>/checkpoints``."""
        return self.checkpoint.url or f"{self.run_dir.rstrip('/')}/checkpoints"

    @classmethod
    def from_args(cls, args: list[str]) -> Settings:
        """The settings of a command line as ``llmtrain launch --script`` passes it to a
        script: ``--config`` (a preset's name or a TOML file; default ``debug_cpu``), then
        dotted overrides (``--training.run_dir runs/x --warm.enable true``). Raises
        ConfigError naming a wrong field or value."""
        args, preset = list(args), "debug_cpu"
        if "--config" in args:
            at = args.index("--config")
            if at + 1 >= len(args):
                raise ConfigError("--config needs a preset name or a TOML file")
            preset = args[at + 1]
            del args[at:at + 2]
        return load_config(preset, parse_overrides(args)).settings()

    def validate(self, world_size: int = 1) -> None:
        """The checks that span fields, at ``world_size`` ranks; ConfigError names the
        field and what to set."""
        if self.steps < 1:
            raise ConfigError(f"steps={self.steps}: a run trains at least one step")
        if self.parallelism.backend == "nccl" and self.parallelism.device == "cpu":
            raise ConfigError("parallelism.backend='nccl' needs parallelism.device "
                              "'cuda' or 'auto', not 'cpu'")
        r = self.reliability
        if r.watchdog and r.collective_timeout_s <= r.hang_timeout_s:
            raise ConfigError(
                f"reliability.collective_timeout_s={r.collective_timeout_s} must exceed "
                f"reliability.hang_timeout_s={r.hang_timeout_s}, or the backend aborts "
                f"before the watchdog can dump and diagnose the hang")
        step_ranges("integrity.skip_steps", self.integrity.skip_steps)
        if self.parallelism.tp > 1 and self.integrity.recompute_every:
            raise ConfigError(
                f"integrity.recompute_every={self.integrity.recompute_every} needs "
                f"parallelism.tp=1: a rank cannot compute another's micro-batch alone when "
                f"its blocks are split over a tensor-parallel group; set "
                f"integrity.recompute_every=0")
        mesh_shape(self.parallelism, world_size)


def _apply(cfg: JobConfig, key: str, value: Any) -> None:
    """Sets ``key`` (``section.field``) of ``cfg`` to ``value``, coerced and checked."""
    section_name, _, field_name = key.partition(".")
    if section_name not in SECTIONS:
        raise unknown_key(key, list(SECTIONS))
    section = getattr(cfg, section_name)
    fields = {f.name: f for f in dataclasses.fields(section)}
    if field_name not in fields:
        raise unknown_key(key, [f"{section_name}.{n}" for n in fields])
    f = fields[field_name]
    value = coerce(key, f.type, value)
    check_field(key, f, value)
    setattr(section, field_name, value)


def load_config(preset: str = "debug_cpu", overrides: list[tuple[str, Any]] = ()) -> JobConfig:
    """The preset (packaged name or TOML path), then ``overrides`` on top, field-checked."""
    cfg = JobConfig()
    for section_name, table in read_preset(preset).items():
        if not isinstance(table, dict):
            raise unknown_key(section_name, list(SECTIONS))
        for key, value in table.items():
            _apply(cfg, f"{section_name}.{key}", value)
    for key, value in overrides:
        _apply(cfg, key, value)
    return cfg
