"""The run configuration every stage agrees on (model, [train], [codec]): built-in defaults,
overridden by a TOML file, overridden by CLI flags. The coordinator hands it to every node."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .knob import knob
from .model import ModelConfig
from .swarm import SwarmConfig
from .toml import load_toml, toml_table

__all__ = ["TrainConfig", "CodecConfig", "RunConfig", "HOST_COPIES"]

# train.host_copy: "inline", the compute thread copies a payload to the host and checksums it before
# it goes on; "overlap", a side stream copies it and the link's thread checksums it (issue 27)
HOST_COPIES = ("inline", "overlap")


@dataclass
class TrainConfig:
    """How the swarm trains: batch shape, optimizer, schedule, checkpoints. Every field is a flag of
    `tahnode coordinator` and `tahnode demo` (its metadata is the flag's --help)."""

    steps: int = knob(100, "optimizer steps to train")
    micro_batches: int = knob(4, "micro-batches per optimizer step (M)")
    batch_size: int = knob(4, "samples per micro-batch")
    seq_len: int = knob(64, "tokens per sample")
    lr: float = knob(3e-3, "peak learning rate (AdamW)")
    min_lr: float | None = knob(None, "learning rate at the end of the cosine decay (default: lr / 10)")
    warmup_steps: int = knob(10, "steps of linear learning-rate warm-up")
    weight_decay: float = knob(0.1, "AdamW weight decay")
    beta1: float = knob(0.9, "AdamW beta1")
    beta2: float = knob(0.95, "AdamW beta2")
    grad_clip: float = knob(1.0, "clip gradients to this global norm (summed across stages); 0 = off")
    schedule: str = knob("1f1b", "pipeline schedule: 1f1b (a window of micro-batches in flight that grows as "
                         "needed) or gpipe", choices=("1f1b", "gpipe"))
    pipeline_micro_batches: int = knob(0, "micro-batches the pipeline cuts each step into (0: enough to keep slow "
                                        "links busy, tahnode.pipeline.schedule)")
    min_micro_batch_tokens: int = knob(512, "the automatic cut never makes micro-batches of fewer tokens")
    memory_budget_mb: float = knob(4096.0, "activation memory stage 0 may hold for micro-batches in flight",
                                    flag="--memory-budget", metavar="MB")
    seed: int = knob(0, "seed of the model's initial weights and of the data order")
    checkpoint_every: int = knob(20, "save each stage every N steps (and on SIGTERM)")
    dtype: str = knob("float32", "compute dtype", choices=("float32", "bfloat16"))
    max_abs_value: float = knob(1e6, "a received activation or gradient larger in magnitude is refused (a hostile peer "
                                 "or a diverged run); finite values up to 3e38 would overflow the stage's own output")
    stall_timeout_s: float = knob(300.0, "stage 0 replays a step when no gradient came back for this long (a lost "
                                   "message)", flag="--stall-timeout", metavar="SECONDS")
    host_copy: str = knob("inline", "where a sent payload is copied to the host and checksummed: inline (the compute "
                           "thread waits for it) or overlap (a side stream and the link's thread, while the next "
                           "micro-batch computes)", choices=HOST_COPIES)

    @property
    def end_lr(self) -> float:
        """The learning rate the cosine decay ends at: min_lr, or lr / 10 where it is not set."""
        return self.lr / 10 if self.min_lr is None else self.min_lr

    def validate(self) -> "TrainConfig":
        for name in ("steps", "micro_batches", "batch_size", "seq_len", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if not self.max_abs_value > 0:
            raise ValueError(f"train.max_abs_value (--max-abs-value) must be > 0, got {self.max_abs_value}")
        for name in ("pipeline_micro_batches", "min_micro_batch_tokens", "memory_budget_mb", "stall_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        samples = self.micro_batches * self.batch_size
        if self.pipeline_micro_batches and samples % self.pipeline_micro_batches:
            raise ValueError(f"train.pipeline_micro_batches {self.pipeline_micro_batches} does not divide the "
                             f"step's {samples} samples")
        if self.schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"train.schedule must be '1f1b' or 'gpipe', got {self.schedule!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"train.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.host_copy not in HOST_COPIES:
            raise ValueError(f"train.host_copy must be one of {', '.join(HOST_COPIES)}, got {self.host_copy!r}")
        if self.lr < 0:
            raise ValueError(f"train.lr (--lr) must be >= 0, got {self.lr:g}")
        if self.min_lr is None:
            self.min_lr = self.end_lr  # fixed here, so that every node receives the same number
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"train.min_lr (--min-lr) {self.min_lr:g} must be in [0, train.lr (--lr) {self.lr:g}]: "
                             "lower --min-lr or raise --lr (without --min-lr, it follows --lr: lr / 10)")
        return self


@dataclass
class CodecConfig:
    """Which codecs carry activations forward and gradients backward, with their parameters."""

    forward: str = "tahquant"
    # 6 bits, a scale per token and 128 channels: its error does not grow with the message
    backward: str = "pertoken"
    # unset (None) or {}: the forward codec's defaults, a run's (tahquant: G = 128, qmax = 12)
    forward_params: dict[str, float] | None = None
    backward_params: dict[str, float] = field(default_factory=dict)
    # a precision schedule: the run's first `forward_high_start` and last `forward_high_end` share of
    # steps send activations with forward_params updated by `forward_high_params`; unset (None), the
    # forward codec's own (Codec.schedule_params: tahquant's qmax 31, tahquant-paper's 6 bits), {} for
    # no schedule (issue 25: the first 12% of the steps on the finer grid trained
    # closest to none of the schedules within 4.6 bits)
    forward_high_params: dict[str, float] | None = None
    forward_high_start: float = 0.12
    forward_high_end: float = 0.0

    @property
    def label(self) -> str:
        """fwd[:k=v,...][@start=..,end=..,k=v]/bwd[:k=v,...], as the benchmarks write a pair."""
        def one(name: str, params: dict) -> str:
            return name + (":" + ",".join(f"{k}={v:g}" for k, v in sorted(params.items())) if params else "")
        schedule = {"start": self.forward_high_start, "end": self.forward_high_end, **self.high_params}
        high = "@" + ",".join(f"{k}={v:g}" for k, v in schedule.items()) if self.scheduled else ""
        return f"{one(self.forward, self.forward_codec_params)}{high}/{one(self.backward, self.backward_params)}"

    @property
    def forward_codec_params(self) -> dict[str, float]:
        """The forward codec's parameters where they are not its defaults: forward_params ({} where unset)."""
        return dict(self.forward_params or {})

    @property
    def high_params(self) -> dict[str, float]:
        """The forward codec's parameters in the schedule's steps (on top of forward_codec_params)."""
        if self.forward_high_params is not None:
            return dict(self.forward_high_params)
        from ..codecs import CODECS

        return dict(CODECS[self.forward].schedule_params) if self.forward in CODECS else {}

    @property
    def scheduled(self) -> bool:
        return bool(self.high_params) and (self.forward_high_start > 0 or self.forward_high_end > 0)

    def high_phase(self, step: int, steps: int) -> bool:
        """Whether optimizer step `step` of `steps` sends activations with the high parameters: the
        first and last whole numbers of steps the shares make (a run of 8 steps has none at 2%)."""
        if not self.scheduled:
            return False
        first, last = int(self.forward_high_start * steps + 1e-9), int(self.forward_high_end * steps + 1e-9)
        return step < first or step >= steps - last

    def validate(self) -> "CodecConfig":
        from ..codecs import get_codec

        get_codec(self.forward, **self.forward_codec_params)
        get_codec(self.backward, **self.backward_params)
        get_codec(self.forward, **{**self.forward_codec_params, **self.high_params})
        if not (0 <= self.forward_high_start <= 1 and 0 <= self.forward_high_end <= 1):
            raise ValueError("codec.forward_high_start and codec.forward_high_end are shares of the "
                             "run's steps, in [0, 1]")
        if self.backward in ("aqsgd", "amaq"):
            raise ValueError(f"codec {self.backward!r} is a forward (activation) codec; use pertoken, none, naive, "
                             "group, tahquant or tahquant-paper backward")
        return self


@dataclass
class RunConfig:
    """Everything every stage must agree on; the coordinator sends it to each node as JSON."""

    model: ModelConfig
    stages: int = 3
    data: str = ""                  # prepared token file (tahnode data prepare); "" = built-in corpus
    data_limit_mb: float = 4.0      # size of the built-in corpus (Python's stdlib sources)
    train: TrainConfig = field(default_factory=TrainConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)

    @property
    def ring(self) -> bool:
        """A tied model over several stages: stage 0 holds the embedding and the head that shares it,
        the last stage sends its final hidden states back to stage 0 (docs/architecture.md)."""
        return self.model.tie_embeddings and self.stages > 1

    @property
    def loss_stage(self) -> int:
        """The stage that computes the loss (and reports the losses): 0 in a ring, else the last."""
        return 0 if self.ring else self.stages - 1

    def neighbour(self, stage: int, offset: int) -> int | None:
        """The stage `offset` (+1 next, -1 previous) from `stage`: around the ring in a ring, else
        None past either end."""
        other = stage + offset
        if self.ring:
            return other % self.stages
        return other if 0 <= other < self.stages else None

    def validate(self) -> "RunConfig":
        if not 1 <= self.stages <= self.model.n_layers:
            raise ValueError(f"stages must be in 1..{self.model.n_layers} (the model's layers), got {self.stages}")
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(f"train.seq_len {self.train.seq_len} exceeds the model's max_seq_len "
                             f"{self.model.max_seq_len}")
        self.train.validate()
        self.codec.validate()
        self.swarm.validate()
        return self

    def to_toml(self) -> str:
        """The [run], [train], [codec] and [swarm] tables (the model is named separately, by --model)."""
        d = dataclasses.asdict(self)
        run = {k: d[k] for k in ("stages", "data", "data_limit_mb")}
        tables = (("run", run), ("train", d["train"]), ("codec", d["codec"]), ("swarm", d["swarm"]))
        return "\n".join(toml_table(name, table) for name, table in tables)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        d = json.loads(text)
        return cls(
            model=ModelConfig.from_dict(d["model"]),
            stages=d["stages"],
            data=d["data"],
            data_limit_mb=d["data_limit_mb"],
            train=_build(TrainConfig, d["train"], "train"),
            codec=_build(CodecConfig, d["codec"], "codec"),
            swarm=_build(SwarmConfig, d.get("swarm", {}), "swarm"),
        ).validate()

    @classmethod
    def build(cls, model: str | Path, toml_path: str | Path | None = None, **overrides: Any) -> "RunConfig":
        """Defaults, then the [run], [train], [codec] and [swarm] tables of a TOML file, then `overrides`
        (dotted keys like "train.steps" or plain RunConfig fields)."""
        doc = load_toml(toml_path) if toml_path else {}
        run = cls(model=ModelConfig.from_name(str(model)))
        for key, value in doc.get("run", {}).items():
            _set(run, key, value, "run")
        run.train = _build(TrainConfig, doc.get("train", {}), "train")
        run.codec = _build(CodecConfig, doc.get("codec", {}), "codec")
        run.swarm = _build(SwarmConfig, doc.get("swarm", {}), "swarm")
        for key, value in overrides.items():
            if value is None:
                continue
            target, _, name = key.rpartition(".")
            _set(getattr(run, target) if target else run, name, value, target or "run")
        return run.validate()


def _build(kind, table: dict, section: str):
    obj = kind()
    for key, value in table.items():
        _set(obj, key, value, section)
    return obj


def _set(obj, key: str, value: Any, section: str) -> None:
    names = {f.name: f for f in dataclasses.fields(obj)}
    if key not in names or key == "model":
        raise ValueError(f"unknown setting [{section}] {key}; known: {', '.join(n for n in names if n != 'model')}")
    parse = names[key].metadata.get("parse")
    if parse is not None:
        try:
            value = parse(value)
        except ValueError as exc:
            raise ValueError(f"[{section}] {exc}") from None
    current = getattr(obj, key)
    if isinstance(current, bool) or isinstance(current, dict) or isinstance(current, str):
        setattr(obj, key, value)
    elif isinstance(current, int):
        if isinstance(value, float) and value != int(value):
            raise ValueError(f"[{section}] {key} must be an integer, got {value}")
        setattr(obj, key, int(value))
    elif isinstance(current, float) or (current is None and value is not None
                                        and str(names[key].type).startswith("float")):
        try:
            setattr(obj, key, float(value))
        except (TypeError, ValueError):
            raise ValueError(f"[{section}] {key} must be a number, got {value!r}") from None
    else:
        setattr(obj, key, value)
