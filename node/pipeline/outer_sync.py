"""A stage replica's outer steps, when pipelines train in data parallel: at every outer boundary its
pseudo-gradient averaged with the replicas of its stage in the other pipelines (an averager:
tahnode.net.averaging, by the clip rule), then the outer step and the digest of its new outer weights
(which its heartbeats report); its judgement of the other replicas (tahnode.pipeline.peer_standing); and,
when its pipeline regroups (it was late, or a stage is new), the return to its stage's latest outer step:
the one the coordinator names (tahnode.pipeline.outer_adopt), or its own."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..net.averaging import AveragingError, AveragingRound
from ..train.outer import OuterOptimizer, state_digest
from .core import StageCore
from .outer_adopt import NamedState, fetch_named, fetch_newest, named_past, not_served, within_reach
from .outer_count import PipelineCount
from .outer_heal import meet_named
from .peer_standing import PeerStanding

log = logging.getLogger("tahnode.pipeline")

CATCH_UP_S = 10.0  # after a boundary without a group, how long a replica waits for the stage's named state of it
REGROUP = "regroup"  # a backward micro-batch's extra: a later stage of the pipeline needs its pipeline to regroup

__all__ = ["OuterSync", "OuterStats", "Averager", "outer_round", "REGROUP", "CATCH_UP_S"]


class Averager(Protocol):
    """What the outer step needs of the replicas' averaging (tahnode.net.averaging.StageAverager)."""

    peer_id: str

    async def average(self, vector: torch.Tensor, round: int, expected: int, timeout: float): ...

    async def load_state(self, peer_id: str, timeout: float) -> tuple[dict, list[torch.Tensor]] | None: ...


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
    adopted: int = 0           # times it took another replica's outer weights (a catch-up or a regroup)
    last_norm: float = 0.0     # its last pseudo-gradient's norm (0: none yet since it started)
    refused: dict[str, int] = field(default_factory=dict)  # replica (p2p peer id) -> averages or states refused
    unsure: bool = False       # a round without a mean since a settled naming last confirmed its outer weights


class OuterSync:
    """The outer weights of a stage (`core`: its parts) and its averager (None: a single pipeline's stage).
    `expected` is how many pipelines train now and `named` the stage's outer state the coordinator names
    (the daemon sets both from each assignment; `known` and `admitted` count the replicas its averager
    knows of and admits, itself included); with one pipeline there is nothing to average and the stage's
    weights are its outer weights at every boundary."""

    def __init__(self, core: StageCore, averager: Averager | None = None):
        self.core, self.swarm = core, core.run_cfg.swarm
        self.outer = OuterOptimizer(core.model.parameters(), self.swarm)
        self.averager = averager
        self.ready = asyncio.Event()  # set once it has an averager (the daemon starts one when pipelines train)
        if averager is not None:
            self.ready.set()
        self.anchor_step = core.committed    # the step the outer weights are of
        self.digest: bytes | None = None     # their digest once it averages (tahnode.train.outer.state_digest)
        self.named: NamedState | None = None
        self.needs_regroup = False           # the last boundary found no group while pipelines train
        self.known: int | None = None        # replicas its averager knows of, itself included (None: not told)
        self.admitted: int | None = None     # of those, the ones it admits (not excluded, not suspended)
        self.standing = PeerStanding()
        self.on_standing: Callable[[], None] | None = None  # the daemon admits the replicas again after a change
        self.failed: set[tuple[int, bytes]] = set()  # named states (step, digest) whose sources did not serve them
        self.stats = OuterStats()
        self.pipelines = PipelineCount(self.swarm.data_slots)  # how many train: now, and as stage 0 took a step
        self._lock = threading.Lock()        # the outer weights, against the thread that serves them to newcomers

    active = property(lambda self: self.averager is not None and self.pipelines.now > 1)  # it averages with others
    # replicas in other pipelines (which may train alone while another recovers): disagreeing stages regroup
    replicated = property(lambda self: self.averager is not None)

    def use(self, averager: Averager) -> None:  # the averager the daemon started (pipelines train in parallel)
        self.averager = averager
        self.ready.set()

    async def wait_ready(self) -> None:
        """With pipelines training, wait (up to outer_timeout_s) for the averager the daemon starts."""
        if self.pipelines.now > 1 and self.averager is None:
            try:
                await asyncio.wait_for(self.ready.wait(), self.swarm.outer_timeout_s)
            except asyncio.TimeoutError:
                log.warning("stage %d: its averager did not start within %.3g s", self.core.stage,
                            self.swarm.outer_timeout_s)

    def due(self, committed: int) -> bool:
        """Whether the replicas average after `committed` steps (every outer_every, and the run's last)."""
        return committed > 0 and (committed % self.swarm.outer_every == 0 or committed == self.core.train.steps)

    def group_target(self, expected: int | None = None) -> int:
        """The group a round waits for: a replica of every pipeline (`expected`, else the assignment's), less those
        it excluded or suspended."""
        expected = expected or self.pipelines.now
        unknown = self.admitted is None or self.known is None
        return expected if unknown else max(1, expected - (self.known - self.admitted))

    async def after_commit(self) -> None:
        """At an outer boundary: average the pseudo-gradient with the other replicas of the stage
        that come within outer_timeout_s, and take the outer step (alone: keep the weights)."""
        committed = self.core.committed
        if not self.due(committed):
            return
        await self.wait_ready()  # its averager may be starting: the other replicas wait for it
        expected = self.pipelines.of(committed - 1)  # as stage 0 counted for the step
        if self.averager is None or expected < 2:
            await self.core.compute(self._take, committed, None)
            return
        if named_past(self):  # the others averaged past it: none comes
            log.warning("stage %d: the named outer step %d is past its %d: it regroups", self.core.stage,
                        self.named.step, committed)  # at once, not after outer_timeout_s alone
            await self.core.compute(self._take, committed, None)
            self.stats.alone, self.needs_regroup = self.stats.alone + 1, True
            return
        await meet_named(self)  # it parted from the others at its last outer step: their anchor, its steps since
        pseudo = await self.core.compute(self.outer.pseudo_gradient)
        self.stats.last_norm = float(pseudo.norm())
        await self._wait_members(expected)
        round_, target = outer_round(committed, self.swarm.outer_every), self.group_target(expected)
        result, lone = AveragingRound(None, 0), target < 2  # every other replica excluded: it trains on its own
        if not lone:
            try:
                result = await self.averager.average(pseudo, round_, target, self.swarm.outer_timeout_s)
            except AveragingError as exc:  # its own pseudo-gradient not finite (it diverged), or its averager ended
                log.error("stage %d: outer step after step %d without the others: %s", self.core.stage, committed,
                          exc)
            lone = not self.active  # meanwhile the coordinator said no other pipeline trains now (they lost a stage)
        self._judge(round_, result)  # (a round sat out by the others it suspended ends their suspension too)
        self._count(result)
        await self.core.compute(self._take, committed, result.mean, result.counted)
        self.needs_regroup = result.mean is None and not lone and not await self._catch_up(committed)
        if self.needs_regroup and result.peers:
            log.warning("stage %d: its round of outer step %d with %d replicas came back partial (an average never "
                        "came); it keeps its weights", self.core.stage, round_, len(result.peers))
        elif self.needs_regroup:
            log.warning("stage %d: no replica of it came to outer step %d within %.3g s; it keeps its weights",
                        self.core.stage, round_, self.swarm.outer_timeout_s)
        elif result.mean is not None:
            log.info("stage %d: outer step after step %d with %d replicas (%.2f s, %d bytes sent)", self.core.stage,
                     committed, result.group, result.seconds, result.bytes_sent)

    def _judge(self, round_: int, result: AveragingRound) -> None:
        """Its standing of the others after a round; the daemon admits its members again if it changed."""
        suspended = set(self.standing.suspended)
        for peer in self.standing.judge(round_, result, self.averager.peer_id):
            record = self.standing.records[peer]
            log.warning("stage %d: excludes replica %s from its groups: %s (%d rounds held against it)",
                        self.core.stage, peer, record.last, record.suspect + record.stalled)
        if self.on_standing is not None and (self.standing.suspended != suspended or self.standing.excluded):
            self.on_standing()

    async def _wait_members(self, expected: int) -> None:
        """Before a round: until its averager knows a replica of every pipeline (a stage new to averaging
        learns them from the coordinator's next assignments), at most outer_timeout_s. A round begun
        before would refuse the replicas it does not know yet, and form at its deadline if at all."""
        deadline = time.monotonic() + self.swarm.outer_timeout_s
        while self.known is not None and self.known < expected and time.monotonic() < deadline:
            await asyncio.sleep(0.2)

    async def _catch_up(self, committed: int) -> bool:
        """After a boundary where it found no group (or a partial one): the others may have averaged this
        step without it, or been alone at it too. It waits (CATCH_UP_S; at the run's last boundary, where
        no regroup follows, twice outer_timeout_s longer) until the coordinator's naming of this step is
        settled, then takes the named state if it is not its own (as if it had been in their group: this
        stage alone, no step trained again); a newer named step means its pipeline regroups instead."""
        last = committed >= self.core.train.steps
        deadline = time.monotonic() + CATCH_UP_S + (2 * self.swarm.outer_timeout_s if last else 0.0)
        while True:
            named = self.named
            if named is not None and named.step > committed:
                return False
            if named is not None and named.step == committed and (named.settled or time.monotonic() >= deadline):
                return named.digest == await self.core.compute(self.rehash) or await self._adopt(named, deadline)
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.5)

    async def _adopt(self, named: NamedState, deadline: float) -> bool:
        tensors = await fetch_named(self, named, max(1.0, deadline - time.monotonic()))
        return tensors is not None and await self.core.compute(self.take_named, tensors, named, True)

    def _count(self, result) -> None:
        s = self.stats
        s.steps, s.alone = s.steps + (result.mean is not None), s.alone + (result.mean is None)
        s.unsure, s.last_group = s.unsure or result.mean is None, result.group
        s.bytes_sent, s.bytes_received = s.bytes_sent + result.bytes_sent, s.bytes_received + result.bytes_received
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
            self.anchor_step = committed
            self.digest = self._hash()

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
            self.digest = self._hash()

    # -- newcomers and late pipelines ------------------------------------------------------------
    def state(self) -> tuple[dict, list[torch.Tensor]]:
        """What another replica of the stage loads (any thread): the outer weights, the outer momentum,
        and the step they are of."""
        with self._lock:
            return {"step": self.anchor_step}, [t.clone() for t in self.outer.tensors().values()]

    def wants(self, named: NamedState | None) -> bool:
        """Whether the named state is to replace its outer weights: a newer step, or of its step another
        digest (its own, a replica's own, lost to a group's or to the lowest pipeline's), or its own not
        finite; never from sources it excluded alone."""
        if not self.active or not self.takes_from(named):
            return False
        return named.step > self.anchor_step or (named.step == self.anchor_step and (
            named.digest != self.digest or not self._own_finite()))

    def boundary_of(self, step: int) -> int:
        """The outer step whose outer weights a stage at committed step `step` holds (a checkpoint keeps them)."""
        return step if self.due(step) else step // self.swarm.outer_every * self.swarm.outer_every

    def reachable(self) -> set[int]:
        """The outer steps this stage can return to: its own outer weights', the named state's (unless its
        sources failed it), those its own checkpoints keep, and 0 (the initial weights)."""
        steps = {0, self.anchor_step}
        named = self.named
        if self.takes_from(named):
            steps.add(named.step)
        store = self.core.saver.store
        if store is not None:
            steps.update(self.boundary_of(c.step) for c in store.list(self.core.stage, self.core.num_stages))
        return steps

    async def reach(self, target: int) -> bool:
        """Return to outer step `target` from its own outer weights or the named state (a pipeline whose
        stages disagreed: tahnode.pipeline.resync.Resync.regroup_to); False if neither is of it, or the named
        state's sources did not serve it (then it is no longer reachable: `failed`)."""
        named = self.named
        if self.anchor_step != target and self.takes_from(named) and named.step == target:
            tensors = await fetch_named(self, named, self.swarm.outer_timeout_s)
            if tensors is None:
                not_served(self, named)
            else:
                await self.core.compute(self._regroup, tensors, named)
        if self.anchor_step == target:
            await self.core.compute(self._regroup, None, None)
            return True
        return False

    async def regroup(self) -> int:
        """Return to the stage's latest outer step: the named one if it is to replace its own (wants; a newer one
        named while it fetched takes its place: the others train on), else its own (the steps since are trained
        again); the committed step the stage is at then."""
        await self.core.compute(self.rehash)
        named, tensors = await fetch_newest(self, self.swarm.outer_timeout_s)
        return await self.core.compute(self._regroup, tensors, named)

    def _regroup(self, tensors: list[torch.Tensor] | None, named: NamedState | None) -> int:
        core = self.core
        self.needs_regroup = False
        if tensors is not None:
            self.take_named(tensors, named, False)
        with self._lock:
            self._weights_to_anchor()
            step = self.anchor_step
        if core.committed != step:
            core.resumed_at(step)
            core.stats.losses = [r for r in core.stats.losses if r.step < step]
            core.codecs.drop_streams()
        return step

    def take_named(self, tensors: list[torch.Tensor], named: NamedState, catching_up: bool) -> bool:
        """(compute thread) The named state becomes its outer weights (and, catching up at the step it just
        committed, its weights); False if it no longer fits (it moved on, another shape), or is of its own
        step, named by one operator alone, and (while it trains on weights of its own) further from its own
        than outer_adopt allows."""
        with self._lock:
            if (catching_up and self.core.committed != named.step) or not self._fits(tensors):
                return False
            own = list(self.outer.tensors().values())
            norm = self.stats.last_norm
            if (named.step == self.anchor_step and named.operators < 2 and norm > 0 and self._own_finite()
                    and not within_reach(own, tensors, norm)):
                log.warning("stage %d: refused the named state of step %d: one operator's word, too far from its "
                            "own outer weights", self.core.stage, named.step)
                return False
            self.outer.load(dict(zip(list(self.outer.tensors()), tensors)))
            self.outer.forget_residual()
            self.anchor_step = named.step
            self.digest = self._hash()
            self.stats.adopted += 1
            if catching_up:
                self._weights_to_anchor()
        log.warning("stage %d takes the outer weights of step %d the coordinator names (%d operators)",
                    self.core.stage, named.step, named.operators)
        return True

    def takes_from(self, named: NamedState | None) -> bool:
        """Whether a named state has a source this replica would load it from (not one it excluded, and not a
        state whose sources failed it before)."""
        return (named is not None and (named.step, named.digest) not in self.failed
                and any(peer not in self.standing.excluded for peer in named.sources))

    def _hash(self) -> bytes | None:
        """(holding the lock) The digest of its outer weights of anchor_step, once it averages (None before:
        a lone pipeline's stage never needs one)."""
        if self.averager is None:
            return None
        return state_digest(self.anchor_step, list(self.outer.tensors().values()))

    def rehash(self) -> bytes | None:
        """(compute thread) Its digest, computed now if it is not known yet."""
        with self._lock:
            self.digest = self.digest if self.digest is not None else self._hash()
            return self.digest

    def outer_state(self) -> tuple[int, bytes] | None:
        """(any thread) The step and digest of its outer weights, for its heartbeats; None before it knows."""
        with self._lock:
            return (self.anchor_step, self.digest) if self.digest is not None else None

    def _weights_to_anchor(self) -> None:
        """(holding the lock) The stage's weights become its outer weights."""
        with torch.no_grad():
            for a, p in zip(self.outer.anchor, self.outer.params):
                p.copy_(a)

    def _own_finite(self) -> bool:  # every value of its outer weights and momentum finite (as a peer's must be)
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
                "refused": float(sum(s.refused.values())), "pipelines": self.pipelines.now,
                "anchor_step": self.anchor_step, "excluded": float(len(self.standing.excluded))}
