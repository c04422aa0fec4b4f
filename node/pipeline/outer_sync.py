"""A stage replica's outer steps, when pipelines train in data parallel: at every outer boundary its
pseudo-gradient averaged with the replicas of its stage in the other pipelines (an averager:
tahnode.net.averaging), then the outer step; and, when its pipeline regroups (it was late, or a
stage is new), the return to its stage's latest outer step: a newer one of another replica, or its own."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..net.averaging import AveragingError, AveragingRound
from ..train.outer import OuterOptimizer
from .core import StageCore

log = logging.getLogger("tahnode.pipeline")

CATCH_UP_S = 10.0  # after a boundary without a group, how long a replica looks for the others' outer weights of it
REGROUP = "regroup"  # a backward micro-batch's extra: a later stage of the pipeline needs its pipeline to regroup

__all__ = ["OuterSync", "OuterStats", "ServedState", "Averager", "outer_round", "REGROUP", "CATCH_UP_S"]


class Averager(Protocol):
    """What the outer step needs of the replicas' averaging (tahnode.net.averaging.StageAverager)."""

    async def average(self, vector: torch.Tensor, round: int, expected: int, timeout: float): ...

    async def load_state(self, timeout: float) -> tuple[dict, list[torch.Tensor]] | None: ...


def outer_round(committed: int, every: int) -> int:
    """The outer step that follows `committed` steps: the k-th after k * every steps; the run's last
    step, between two, takes the next number."""
    return -(-committed // every)


@dataclass
class OuterStats:
    """What the outer steps of a replica came to (its heartbeats report them)."""

    steps: int = 0             # outer steps taken with a group
    alone: int = 0             # boundaries where no other replica came in time
    last_group: int = 0        # replicas in the last group, this one included
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0       # wall time of the averaging, all outer steps together
    adopted: int = 0           # times it took a newer replica's outer weights (a regroup)
    refused: dict[str, int] = field(default_factory=dict)  # replica (p2p peer id) -> parts refused


@dataclass(frozen=True)
class ServedState:
    """A peer's served state's metadata (`OuterSync.state()`), parsed once where it enters: the step its
    outer weights are of, whether they are a replica's own (no group at that step) rather than a
    group's, and for its own the pipeline whose outer step made them (None: not given as one)."""

    step: int
    alone: bool
    source: int | None

    @classmethod
    def parse(cls, meta: dict) -> "ServedState | None":
        """None unless `step` is a whole number >= 0; `alone` unless it says False; `source` a whole number >= 0."""
        step, source = meta.get("step"), meta.get("source")
        if type(step) is not int or step < 0:
            return None
        return cls(step, meta.get("alone") is not False, source if type(source) is int and source >= 0 else None)


class OuterSync:
    """The outer weights of a stage (`core`: its parts) and its averager (None: a single pipeline's stage).
    `expected` is how many pipelines train now (the coordinator's word): with one, there is
    nothing to average and the stage's weights are its outer weights at every boundary."""

    def __init__(self, core: StageCore, averager: Averager | None = None):
        self.core, self.swarm = core, core.run_cfg.swarm
        self.outer = OuterOptimizer(core.model.parameters(), self.swarm)
        self.averager = averager
        self.ready = asyncio.Event()  # set once it has an averager (the daemon starts one when pipelines train)
        if averager is not None:
            self.ready.set()
        self.expected = 1
        self.anchor_step = core.committed    # the step the outer weights are of
        self.needs_regroup = False           # the last boundary found no group while pipelines train
        self.alone_at: int | None = None     # that boundary's step (its outer weights are its own, not the group's)
        self.source = core.pipeline          # the pipeline whose outer step made outer weights of alone_at
        self.admitted: int | None = None     # replicas its averager admits, itself included (None: it admits any)
        self.stats = OuterStats()
        self._lock = threading.Lock()        # the outer weights, against the thread that serves them to newcomers

    @property
    def active(self) -> bool:
        return self.averager is not None and self.expected > 1

    def use(self, averager: Averager) -> None:
        """The averager the daemon started for this stage (once pipelines train in data parallel)."""
        self.averager = averager
        self.ready.set()

    async def wait_ready(self) -> None:
        """With pipelines training, wait (up to outer_timeout_s) for the averager the daemon starts."""
        if self.expected > 1 and self.averager is None:
            try:
                await asyncio.wait_for(self.ready.wait(), self.swarm.outer_timeout_s)
            except asyncio.TimeoutError:
                log.warning("stage %d: its averager did not start within %.3g s", self.core.stage,
                            self.swarm.outer_timeout_s)

    def due(self, committed: int) -> bool:
        """Whether the replicas average after `committed` steps (every outer_every, and the run's last)."""
        return committed > 0 and (committed % self.swarm.outer_every == 0 or committed == self.core.train.steps)

    async def after_commit(self) -> None:
        """At an outer boundary: average the pseudo-gradient with the other replicas of the stage
        that come within outer_timeout_s, and take the outer step (alone: keep the weights)."""
        committed = self.core.committed
        if not self.due(committed):
            return
        await self.wait_ready()  # its averager may be starting: the other replicas wait for it
        if not self.active:
            await self.core.compute(self._take, committed, None)
            return
        pseudo = await self.core.compute(self.outer.pseudo_gradient)
        await self._wait_members()
        try:
            result = await self.averager.average(pseudo, outer_round(committed, self.swarm.outer_every), self.expected,
                                                 self.swarm.outer_timeout_s)
        except AveragingError as exc:
            # its own pseudo-gradient not finite (it diverged), or its averager's process ended
            log.error("stage %d: outer step after step %d without the others: %s", self.core.stage, committed, exc)
            result = AveragingRound(None, 0)
        self._count(result)
        await self.core.compute(self._take, committed, result.mean, result.counted)
        self.needs_regroup = result.mean is None and not await self._catch_up(committed)
        if self.needs_regroup:
            log.warning("stage %d: no replica of it came to outer step %d within %.3g s; it keeps its weights",
                        self.core.stage, outer_round(committed, self.swarm.outer_every), self.swarm.outer_timeout_s)
        elif result.mean is not None:
            log.info("stage %d: outer step after step %d with %d replicas (%.2f s, %d bytes sent)", self.core.stage,
                     committed, result.group, result.seconds, result.bytes_sent)

    async def _wait_members(self) -> None:
        """Before a round: until its averager admits a replica of every pipeline (a stage new to
        averaging learns them from the coordinator's next assignments), at most outer_timeout_s. A
        round begun before would refuse the replicas it does not know yet, and form at its deadline if at all."""
        deadline = time.monotonic() + self.swarm.outer_timeout_s
        while self.admitted is not None and self.admitted < self.expected and time.monotonic() < deadline:
            await asyncio.sleep(0.2)

    async def _catch_up(self, committed: int) -> bool:
        """After a boundary where it found no group: the other replicas may have averaged this same
        step without it (they formed their group at the deadline), or been alone at it too. Take a
        peer's outer weights of this step that outrank its own (`outranked_by`) if a peer serves them
        within CATCH_UP_S, as if it had been in their group (this stage alone, no step trained again);
        else the replica keeps its own, and its pipeline regroups. At the run's last boundary, where
        no regroup follows, it looks for twice outer_timeout_s longer: a replica that comes that much
        later, alone too, may outrank it."""
        last = committed >= self.core.train.steps
        deadline = time.monotonic() + CATCH_UP_S + (2 * self.swarm.outer_timeout_s if last else 0.0)
        while time.monotonic() < deadline:
            try:
                peer = await self.averager.load_state(max(1.0, deadline - time.monotonic()))
            except AveragingError:  # its averager's process ended
                return False
            served = ServedState.parse(peer[0]) if peer else None
            if served is not None and served.step > committed:  # a newer step: the pipeline regroups instead
                return False
            if served is not None and served.step == committed and self.outranked_by(served):
                return await self.core.compute(self._adopt, peer[1], served)
            await asyncio.sleep(0.5)
        return False

    def outranked_by(self, served: ServedState) -> bool:
        """Whether a peer's state is to replace this replica's outer weights: a newer step; of the same
        step, a group's over one's own; and where both are a replica's own, that of the lowest
        pipeline, so that replicas which all missed a step still end with one model."""
        if served.step != self.anchor_step:
            return served.step > self.anchor_step
        own_alone = self.alone_at == self.anchor_step
        if own_alone != served.alone:
            return own_alone
        return own_alone and served.source is not None and served.source < self.source

    def _adopt(self, tensors: list[torch.Tensor], served: ServedState) -> bool:
        """(compute thread) A peer's outer weights of the step this replica just committed become its
        own, and its weights."""
        with self._lock:
            if self.core.committed != served.step or not self._fits(tensors):
                return False
            self._take_peer(tensors, served)
            self._weights_to_anchor()
        log.warning("stage %d missed outer step %d; it takes another replica's outer weights of it", self.core.stage,
                    outer_round(served.step, self.swarm.outer_every))
        return True

    def _count(self, result) -> None:
        s = self.stats
        s.steps += result.mean is not None
        s.alone += result.mean is None
        s.last_group = result.group
        s.bytes_sent += result.bytes_sent
        s.bytes_received += result.bytes_received
        s.seconds += result.seconds
        for peer, count in result.refused.items():
            s.refused[peer] = s.refused.get(peer, 0) + count

    def _take(self, committed: int, mean: torch.Tensor | None, counted: torch.Tensor | None = None) -> None:
        """(compute thread) The outer step with the group's mean (with error feedback, the residual
        becomes what the mean did not count of its pseudo-gradient), or without one the weights as they
        are (the residual waits for the next round)."""
        with self._lock:
            if mean is None:
                self.outer.reset()
            else:
                self.outer.step(mean)
                self.outer.feed_back(counted)
            self.anchor_step, self.source = committed, self.core.pipeline
            self.alone_at = committed if mean is None and self.active else None

    def regroup_asked(self, by_later_stage: bool) -> bool:
        """(A backward micro-batch went through this stage.) Whether to ask the stage before it for a
        regroup: this replica missed an outer step it could not catch up on, or a later stage asked.
        Stage 0 drives the regroup, once an outer period at most (a neighbour could ask every step),
        right after a boundary; before, a stage other than 0 that needed one never got it."""
        if self.core.first:
            if by_later_stage and self.active and self.due(self.core.committed):
                self.needs_regroup = True
            return False
        return self.active and (self.needs_regroup or by_later_stage)

    # -- checkpoints --------------------------------------------------------------------------------
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The outer weights, momentum and error-feedback residual a checkpoint keeps."""
        with self._lock:
            return {k: t.clone() for k, t in {**self.outer.tensors(), **self.outer.own_tensors()}.items()}

    def restore(self, tensors: dict[str, torch.Tensor], step: int) -> None:
        """(compute thread) From a checkpoint of `step`: its outer weights (none: the weights as they
        are), of the last outer boundary at or before `step`."""
        with self._lock:
            if "anchor" in tensors:
                self.outer.load(tensors)
                self.outer.load_own(tensors)
            else:
                self.outer.reset()
                self.outer.forget_residual()
            every = self.swarm.outer_every
            self.anchor_step = step if self.due(step) else step // every * every

    # -- newcomers and late pipelines ------------------------------------------------------------
    def state(self) -> tuple[dict, list[torch.Tensor]]:
        """What a newcomer of the stage loads (any thread): the outer weights, the outer momentum, the
        step they are of, and whether they are its own (no group at that step) rather than a group's."""
        with self._lock:
            tensors = [t.clone() for t in self.outer.tensors().values()]
            return ({"step": self.anchor_step, "alone": self.alone_at == self.anchor_step, "source": self.source},
                    tensors)

    async def regroup(self) -> int:
        """Return to the stage's latest outer step: a replica's in another pipeline if it is newer
        than this one's, else this one's own (the steps since are trained again); the committed
        step the stage is at then."""
        peer = None
        if self.active:
            try:
                peer = await self.averager.load_state(self.swarm.outer_timeout_s)
            except AveragingError as exc:  # its averager's process ended: the stage regroups on its own weights
                log.error("stage %d: regroups on its own outer weights, no replica's: %s", self.core.stage, exc)
        return await self.core.compute(self._regroup, peer)

    def _regroup(self, peer: tuple[dict, list[torch.Tensor]] | None) -> int:
        core = self.core
        self.needs_regroup = False
        with self._lock:
            served = ServedState.parse(peer[0]) if peer is not None else None
            # its own outer weights blown up (an outer step's mean that was not the group's): any peer's
            if served is not None and (self.outranked_by(served) or not self._own_finite()) and self._fits(peer[1]):
                self._take_peer(peer[1], served)
                log.warning("stage %d takes the outer weights of step %d from a replica in another pipeline",
                            core.stage, self.anchor_step)
            self._weights_to_anchor()
            step = self.anchor_step
        if core.committed != step:
            core.resumed_at(step)
            core.stats.losses = [r for r in core.stats.losses if r.step < step]
            core.codecs.drop_streams()
        return step

    def _take_peer(self, tensors: list[torch.Tensor], served: ServedState) -> None:
        """(holding the lock) A peer's outer weights and momentum become this replica's, of its step (a
        replica's own, not a group's, if the peer's were: their source comes with them)."""
        self.outer.load(dict(zip(list(self.outer.tensors()), tensors)))
        self.outer.forget_residual()
        self.anchor_step = served.step
        self.alone_at = served.step if served.alone else None
        self.source = served.source if served.alone and served.source is not None else self.core.pipeline
        self.stats.adopted += 1

    def _weights_to_anchor(self) -> None:
        """(holding the lock) The stage's weights become its outer weights."""
        with torch.no_grad():
            for a, p in zip(self.outer.anchor, self.outer.params):
                p.copy_(a)

    def _own_finite(self) -> bool:
        """(holding the lock) Every value of its outer weights and momentum finite (as a peer's must be)."""
        return self._fits(list(self.outer.tensors().values()))

    def _fits(self, tensors: list[torch.Tensor]) -> bool:
        """A replica's state of this stage's shapes, every value finite."""
        own = list(self.outer.tensors().values())
        return len(tensors) == len(own) and all(
            t.shape == o.shape and bool(torch.isfinite(t).all()) for t, o in zip(tensors, own))

    def report(self) -> dict[str, float]:
        """The figures a heartbeat carries (TrainingStats.outer)."""
        s = self.stats
        return {"steps": s.steps, "alone": s.alone, "group": s.last_group, "bytes_sent": s.bytes_sent,
                "bytes_received": s.bytes_received, "seconds": s.seconds, "adopted": s.adopted,
                "refused": float(sum(s.refused.values())), "pipelines": self.expected, "anchor_step": self.anchor_step}
