"""One training run of `tahnode bench convergence`: a codec pair and a seed on the pipeline replica,
with held-out loss every few steps; its result is kept as JSON so an interrupted bench resumes.

Runs go to worker processes (several at once: one core each on a CPU, or sharing one GPU); their
progress comes back through a queue for the bench's progress bars."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .bench_report import machine
from .swarm_cells import NO_SCHEDULE

__all__ = ["RunSpec", "RunResult", "train_one"]


@dataclass(frozen=True)
class RunSpec:
    """Everything one run needs, picklable for a worker process."""

    pair: str                    # label, FWD[:k=v]/BWD[:k=v]
    forward: str
    forward_params: dict
    backward: str
    backward_params: dict
    seed: int
    model: str
    stages: int
    steps: int
    seq_len: int
    samples_per_message: int
    messages_per_step: int
    config: str = ""             # a TOML file with [train] settings (lr, warmup_steps, ...)
    train: dict = field(default_factory=dict)     # [train] settings over the TOML's (the bench's reference)
    data: str = ""               # a prepared token file; "" = the built-in corpus
    data_mb: float = 16.0        # size of the built-in corpus
    device: str = "cpu"
    dtype: str = "float32"
    init_from: str = ""
    eval_every: int = 25
    eval_samples: int = 512
    threads: int = 0             # torch threads in the worker (0: torch's default)
    schedule: dict = field(default_factory=dict)  # the forward codec's precision schedule (codec.forward_high_*)
    swarm: dict = field(default_factory=dict)     # [swarm] settings: pipelines in data parallel, the outer step

    @property
    def key(self) -> str:
        """A name for the run's result file: the pair and seed, and a hash of every other setting."""
        settings = asdict(self)
        for name in ("schedule", "swarm", "train"):  # runs without one keep the names they had before it existed
            if not settings[name]:
                del settings[name]
        text = json.dumps(settings, sort_keys=True)
        digest = hashlib.sha256(text.encode()).hexdigest()[:10]
        pair = "".join(ch if ch.isalnum() or ch in "=.-" else "_" for ch in self.pair)
        return f"{pair}-seed{self.seed}-{digest}"

    def result_file(self, workdir: Path) -> Path:
        """Where its result is kept: under its key, or under that of the same run trained at another torch
        thread count (`--jobs` sets it: one thread a run beside others, every core for a run alone): that
        changes how fast a run trains, not its settings. A run not trained yet goes under its own key."""
        for threads in dict.fromkeys((self.threads, 0, 1)):
            path = workdir / f"{replace(self, threads=threads).key}.json"
            if path.exists():
                return path
        return workdir / f"{self.key}.json"

    @property
    def pipelines(self) -> int:
        return int(self.swarm.get("pipelines", 1))

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step trains, over every pipeline."""
        return self.samples_per_message * self.messages_per_step * self.seq_len * self.pipelines

    def run_config(self):
        from ..config import RunConfig

        return RunConfig.build(self.model, self.config or None, **{
            **{f"train.{k}": v for k, v in self.train.items()},
            "stages": self.stages, "data": self.data, "data_limit_mb": self.data_mb,
            "train.steps": self.steps, "train.seq_len": self.seq_len, "train.batch_size": self.samples_per_message,
            "train.micro_batches": self.messages_per_step, "train.pipeline_micro_batches": self.messages_per_step,
            "train.seed": self.seed, "train.dtype": self.dtype,
            "codec.forward": self.forward, "codec.forward_params": dict(self.forward_params),
            "codec.backward": self.backward, "codec.backward_params": dict(self.backward_params),
            **{f"codec.{k}": v for k, v in (self.schedule or NO_SCHEDULE).items()},
            # one pipeline's samples: one stream
            **{f"swarm.{k}": v for k, v in {"pipelines": 1, **self.swarm}.items()}})


@dataclass
class RunResult:
    """What one run measured."""

    pair: str
    seed: int
    tokens_per_step: int
    losses: list[float] = field(default_factory=list)      # training loss of every step
    evals: list[list[float]] = field(default_factory=list)  # [steps trained, held-out loss]
    bits_fwd: float = 0.0
    bits_bwd: float = 0.0
    error_fwd: float = 0.0       # mean relative error of one boundary crossing
    error_bwd: float = 0.0
    dim: int = 0                 # width of what crosses a boundary
    seconds: float = 0.0
    diverged: str = ""           # why the run stopped early ("" if it did not)
    pipelines: int = 1
    activation_bytes: int = 0    # every message between stages, of every pipeline
    averaging_bytes: int = 0     # what the replicas sent each other for their outer steps
    outer_steps: int = 0
    spread: float = 0.0          # the largest |difference| between two replicas' weights after an outer step
    clipped: int = 0             # parts a reducer clipped or left out
    kept: int = 0                # averages a sender refused (both 0: the clip rule was the plain mean all run)
    machine: str = ""            # where it trained (bench_report.machine); "" in results older than the field

    @property
    def final_eval(self) -> float:
        return self.evals[-1][1] if self.evals and not self.diverged else math.inf

    @classmethod
    def load(cls, path: Path) -> "RunResult":
        return cls(**json.loads(path.read_text()))

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)


def _heldout(dataset, samples: int) -> tuple[int, list[int]]:
    """The samples the run trains on (the first ids) and the held-out ids at the end of the data."""
    if samples * 4 > len(dataset):
        raise ValueError(f"--eval-samples {samples} would hold out more than a quarter of the {len(dataset)} samples")
    return len(dataset) - samples, list(range(len(dataset) - samples, len(dataset)))


def train_one(spec: RunSpec, progress=None) -> RunResult:
    """Train `spec` on the pipeline replica; `progress.put((spec.key, steps done))` after every step.
    In a worker process, the run stops when the bench that started it has gone (killed, not interrupted)."""
    import multiprocessing
    import time

    import torch

    from ..codecs import CodecError
    from ..net.transport import BACKWARD, FORWARD
    from ..pipeline.replica import PipelineReplica
    from ..pipeline.replica_group import ReplicaGroup
    from ..train.data import open_dataset

    if spec.threads:
        torch.set_num_threads(spec.threads)
    run = spec.run_config()
    dataset = open_dataset(run)
    train_samples, heldout = _heldout(dataset, spec.eval_samples)
    kind = ReplicaGroup if spec.pipelines > 1 else PipelineReplica
    replica = kind(run, dataset, spec.device, spec.init_from, train_samples)
    result = RunResult(spec.pair, spec.seed, spec.tokens_per_step, dim=run.model.dim, pipelines=spec.pipelines)
    batch = spec.samples_per_message
    started = time.perf_counter()
    result.evals.append([0, replica.evaluate(heldout, batch)])
    bench = multiprocessing.parent_process()
    for step in range(spec.steps):
        if bench is not None and not bench.is_alive():
            raise SystemExit(f"run {spec.pair} seed {spec.seed}: the bench that started it has ended")
        try:
            loss = replica.train_step(step)
        except CodecError as exc:  # a non-finite activation or gradient: the run diverged
            result.diverged = f"step {step}: {exc}"
            break
        result.losses.append(loss)
        if not math.isfinite(loss):
            result.diverged = f"step {step}: loss {loss}"
            break
        if (step + 1) % spec.eval_every == 0 or step + 1 == spec.steps:
            result.evals.append([step + 1, replica.evaluate(heldout, batch)])
        if progress is not None:
            progress.put((spec.key, step + 1))
    result.seconds = time.perf_counter() - started
    result.machine = machine(spec.device)
    result.bits_fwd = replica.stats.bits_per_element(FORWARD)
    result.bits_bwd = replica.stats.bits_per_element(BACKWARD)
    result.error_fwd = replica.errors.mean(FORWARD)
    result.error_bwd = replica.errors.mean(BACKWARD)
    result.activation_bytes = spec.pipelines * sum(replica.stats.encoded_bytes.values())
    if isinstance(replica, ReplicaGroup):
        result.averaging_bytes, result.outer_steps, result.spread = (replica.averaging_bytes, replica.outer_steps,
                                                                     replica.spread)
        result.clipped, result.kept = replica.clipped, replica.kept
    return result
