"""The state of one stage at work, as dataclasses: where it stands in the run (committed steps,
the step being computed and what of it is done) and the counters it reports."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch

from ..net.transport import BACKWARD, FORWARD
from ..proto import tahnode_pb2 as pb

__all__ = ["PipelineError", "DivergedStep", "Divergence", "AfterDivergence", "Pending", "StepState", "StopRequest",
           "Stopping", "StepRecord", "Stats", "BAD_MICRO_BATCH", "STALE"]

BAD_MICRO_BATCH = "bad_micro_batch"  # the refusal count of the micro-batches a stage refused (heartbeats' stats)
STALE = object()  # what the worker's compute returns for a micro-batch of an attempt that was dropped meanwhile


class PipelineError(RuntimeError):
    """The pipeline cannot go on (e.g. stages resumed from different steps)."""


class DivergedStep(RuntimeError):
    """This stage's own output or gradient cannot be encoded (non-finite, or beyond a codec's range):
    the step diverged here; it is replayed, with a clear log line, and no peer is blamed."""


@dataclass(frozen=True)
class AfterDivergence:
    """What stage 0 does before its next attempt of a step that diverged: regroup its pipeline, or wait."""

    regroup: bool = False
    wait: float = 0.0


@dataclass
class Divergence:
    """The attempts of one step that diverged one after another (stage 0's count): after each of the
    first `tries` - 1 the step is replayed at once; after the `tries`-th the pipeline regroups (once,
    where other pipelines train); after each later one the next attempt waits twice as long as the
    one before (1 s first), up to `wait_max_s`. Once that step commits the count starts again; the
    steps retrained after a regroup do not reset it."""

    tries: int
    wait_max_s: float
    at: int = -1          # the step that diverged
    in_a_row: int = 0
    regrouped: bool = False

    def failed(self, step: int, regroup_possible: bool) -> AfterDivergence:
        if step != self.at:
            self.at, self.in_a_row, self.regrouped = step, 0, False
        self.in_a_row += 1
        if self.in_a_row < self.tries:
            return AfterDivergence()
        if regroup_possible and not self.regrouped:
            self.regrouped = True
            return AfterDivergence(regroup=True)
        return AfterDivergence(wait=min(self.wait_max_s, 2.0 ** (self.in_a_row - self.tries)))

    def committed(self, committed: int) -> None:
        """`committed` steps are committed: once past the step that diverged, the count starts again."""
        if committed > self.at:
            self.at, self.in_a_row, self.regrouped = -1, 0, False


@dataclass
class Pending:
    """A micro-batch whose forward ran here and whose gradient has not come back yet."""

    inp: torch.Tensor | None  # what this stage received (None on stage 0: token ids need no gradient)
    out: torch.Tensor         # what its backward pass starts from
    sample_ids: list[int]


@dataclass
class StepState:
    """The optimizer steps applied so far, and the step (`step`, `attempt`) being computed.

    Only a Sync changes the attempt; micro-batches of any other (step, attempt) are left over from
    an aborted attempt (or an earlier incarnation of stage 0) and are dropped."""

    micro_batches: int = 1             # of the step being computed (stage 0 cuts each step anew)
    samples_per_step: int = 1
    committed: int = 0                 # number of optimizer steps applied
    last_commit: pb.StepEnd = field(default_factory=pb.StepEnd)
    step: int = 0
    attempt: int = 0
    pending: dict[int, Pending] = field(default_factory=dict)
    done_backward: int = 0             # micro-batches of this step whose backward ran here
    partial_sumsq: float = 0.0         # gradient sum of squares of the later stages
    # what this stage sent back: the later stages' and its own (the StepEnd's is no less)
    sent_sumsq: float = 0.0
    loss_sum: float = 0.0              # last stage: sum over micro-batches of loss x samples
    samples: list[int] = field(default_factory=list)    # last stage: the step's sample ids so far

    def current(self, step: int, attempt: int) -> bool:
        """Is work of (step, attempt) part of the step now being computed?"""
        return step == self.step and attempt == self.attempt

    def restart(self, step: int, attempt: int) -> None:
        """Start computing (step, attempt) afresh."""
        self.step, self.attempt = step, attempt
        self.pending.clear()
        self.done_backward = 0
        self.partial_sumsq = self.sent_sumsq = 0.0
        self.loss_sum = 0.0
        self.samples = []

    @property
    def all_backward(self) -> bool:
        """Every micro-batch of the step went backward here."""
        return self.done_backward == self.micro_batches

    def awaits_step_end(self) -> bool:
        """Every backward of the step ran here; only its StepEnd is missing."""
        return self.all_backward and self.committed == self.step


@dataclass
class StopRequest:
    """The stage was asked to stop; `drain_step` is the step whose StepEnd it still waits for (every
    gradient of that step went out, so stage 0 commits it), None if it stops at once."""

    drain_step: int | None = None


@dataclass
class Stopping:
    """A stage's end: the stop it was asked for (None: none), and whether its run is over (`done`)."""

    request: StopRequest | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class StepRecord:
    """A committed step as the last stage saw it: its mean loss, its samples, its wall time."""

    step: int
    loss: float
    sample_ids: list[int]
    seconds: float
    skipped: bool = False  # stage 0: a step its pipeline skipped (it took a newer replica's state), never trained


@dataclass
class Stats:
    """Counters every stage keeps; the last stage also has the losses."""

    encoded_bytes: dict = field(default_factory=lambda: {FORWARD: 0, BACKWARD: 0})  # EncodedTensor messages
    elements: dict = field(default_factory=lambda: {FORWARD: 0, BACKWARD: 0})
    uncompressed_bytes: int = 0
    losses: list[StepRecord] = field(default_factory=list)  # last stage: the committed steps
    outbox: list[StepRecord] = field(default_factory=list)  # the same, not yet reported to the coordinator
    step_times: list = field(default_factory=list)  # wall time of each committed step
    codec_seconds: float = 0.0  # wall time spent encoding and decoding tensors (device copies included)
    step_started: float = field(default_factory=time.perf_counter)
    tokens_per_step: int = 0
    finished: bool = False
    replays: int = 0
    refused_micro_batches: int = 0  # received, but malformed or non-finite (tahnode.pipeline.admission)
    offences: dict = field(default_factory=dict)  # sender node id -> its refused micro-batches (for bans)

    def report(self, committed: int, cache_bytes: int) -> pb.TrainingStats:
        """The stage's stats for a heartbeat, with the committed steps not yet reported (the caller
        takes them off with `reported()` once the heartbeat went through)."""
        stats = pb.TrainingStats(
            step=committed, tokens_per_s=self.tokens_per_s(), forward_bits_per_element=self.bits_per_element(FORWARD),
            backward_bits_per_element=self.bits_per_element(BACKWARD), uncompressed_bytes=self.uncompressed_bytes,
            finished=self.finished, replays=self.replays, aqsgd_cache_bytes=cache_bytes,
            codec_seconds=self.codec_seconds, step_seconds=sum(self.step_times))
        if self.losses:
            stats.loss, stats.loss_first = self.losses[-1].loss, self.losses[0].loss
        for r in self.outbox:
            (stats.skipped if r.skipped else stats.losses).add(step=r.step, loss=r.loss, sample_ids=r.sample_ids,
                                                               seconds=r.seconds, skipped=r.skipped)
        if self.refused_micro_batches:
            stats.refused[BAD_MICRO_BATCH] = self.refused_micro_batches
        for sender, count in self.offences.items():
            stats.offences[sender] = count
        return stats

    def refused_from(self, sender: str) -> None:
        """A micro-batch from `sender` was refused (malformed, non-finite, oversized)."""
        self.refused_micro_batches += 1
        if sender:
            self.offences[sender] = self.offences.get(sender, 0) + 1

    def reported(self, count: int) -> None:
        """The first `count` steps of the outbox (committed, or skipped) reached the coordinator."""
        del self.outbox[:count]

    def bits_per_element(self, direction) -> float:
        n = self.elements[direction]
        return 8.0 * self.encoded_bytes[direction] / n if n else 0.0

    def tokens_per_s(self, last: int = 10) -> float:
        times = self.step_times[-last:]
        return self.tokens_per_step * len(times) / sum(times) if times and sum(times) > 0 else 0.0

    def step_done(self) -> float:
        """A step was committed: its wall time since the previous commit."""
        now = time.perf_counter()
        seconds = now - self.step_started
        self.step_times.append(seconds)
        self.step_started = now
        return seconds

    def counted(self, direction, encoded: int, tensor: torch.Tensor) -> None:
        """One tensor sent `direction`: its wire size and what it would have been uncompressed."""
        self.encoded_bytes[direction] += encoded
        self.elements[direction] += tensor.numel()
        self.uncompressed_bytes += tensor.numel() * tensor.element_size()
