"""Taking another replica's outer state, only the one the coordinator names (`NamedState`: the newest outer
step of the stage and the digest most distinct operators reported for it) and only from the replicas it
names as its sources: fetched one at a time, hashed, refused and counted against its server unless it
hashes to the named digest. A state of the replica's own step named by one operator alone moves it by at
most SAME_STEP_RADIUS times its last pseudo-gradient's norm (two replicas alone at one step differ by about
that; anything further is one replica's word against its own weights)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

from ..net.averaging import AveragingError
from ..proto import tahnode_pb2 as pb
from ..train.clip_rule import CLIP
from ..train.outer import state_digest

log = logging.getLogger("tahnode.pipeline")

__all__ = ["NamedState", "ServedState", "NewerServed", "fetch_named", "fetch_newest", "not_served", "superseded",
           "named_past", "SAME_STEP_RADIUS"]

SAME_STEP_RADIUS = CLIP + 1.0
RETRY_S = 1.0  # between two passes over a named state's sources that did not answer
NAMING_WAIT_S = 2.0  # the longest a regroup waits for the naming of a newer state it holds (heartbeats: 1 s)


@dataclass(frozen=True)
class NamedState:
    """The coordinator's naming of a stage's outer state (proto NamedState), parsed once where it enters."""

    step: int
    digest: bytes
    sources: tuple[str, ...]
    settled: bool        # every replica of the stage reported this step: the naming will not change for it
    operators: int

    @classmethod
    def of(cls, message: pb.NamedState) -> "NamedState | None":
        if not message.digest:
            return None
        return cls(int(message.step), bytes(message.digest), tuple(message.sources), bool(message.settled),
                   int(message.operators))


@dataclass(frozen=True)
class ServedState:
    """A peer's served state's metadata (`OuterSync.state()`), parsed once where it enters: the step its
    outer weights are of."""

    step: int

    @classmethod
    def parse(cls, meta: dict) -> "ServedState | None":
        """None unless `step` is a whole number >= 0."""
        step = meta.get("step")
        return cls(step) if type(step) is int and step >= 0 else None


class NewerServed:
    """A source's state of a step later than the one named when it was asked (the others train on, and an outer
    step of theirs may take under a second): its tensors and digest, the last served only (a liar's far step is
    replaced by the next source's), taken once the coordinator names that step with that digest (an operator's
    report, a heartbeat later) rather than asked for again, by when the source has moved on once more."""

    def __init__(self):
        self.step, self.digest, self.tensors = -1, b"", None

    async def keep(self, sync, step: int, tensors: list[torch.Tensor]) -> None:
        self.step, self.digest, self.tensors = step, await sync.core.compute(state_digest, step, tensors), tensors

    def of(self, named: NamedState) -> list[torch.Tensor] | None:
        """Its tensors, if they are of `named` (its step and digest)."""
        return self.tensors if (named.step, named.digest) == (self.step, self.digest) else None

    async def named_by(self, sync, deadline: float) -> None:
        """Wait (at most NAMING_WAIT_S) until the coordinator names the step it keeps, or a later one."""
        until = min(deadline, time.monotonic() + NAMING_WAIT_S)
        while sync.named is not None and sync.named.step < self.step and time.monotonic() < until:
            await asyncio.sleep(0.1)


async def fetch_named(sync, named: NamedState, timeout: float, newer: NewerServed | None = None
                      ) -> list[torch.Tensor] | None:
    """The tensors of `named` from the first of its sources (not excluded by `sync`'s standing) that serves
    them, each checked against the digest; a source that serves other bytes for the named step is refused
    and counted (`sync.stats.refused`) and not asked again. Sources that do not answer (a replica new to
    them is admitted once the coordinator's next assignment names it, about a second) are asked again every
    RETRY_S until `timeout` s have passed. None if none served them by then, or once the coordinator names a
    newer step of the stage (`sync.named`: its sources moved on, and serve that one). `newer`: where a source's
    state of a later step is kept, and looked in first (its digest checked against the naming all the same)."""
    deadline, refused = time.monotonic() + timeout, set()
    while sync.averager is not None:  # (none: its averager did not start)
        if newer is not None and (held := newer.of(named)) is not None:
            return held
        for peer in named.sources:
            if peer in sync.standing.excluded or peer in refused:
                continue
            try:
                loaded = await sync.averager.load_state(peer, max(1.0, deadline - time.monotonic()))
            except AveragingError as exc:  # its averager's process ended
                log.error("stage %d: cannot load a replica's state: %s", sync.core.stage, exc)
                return None
            served = ServedState.parse(loaded[0]) if loaded is not None else None
            if served is not None and served.step > named.step and newer is not None:  # moved on (no offence)
                await newer.keep(sync, served.step, loaded[1])
            if served is None or served.step != named.step:  # no answer, or it moved on since
                continue
            digest = await sync.core.compute(state_digest, served.step, loaded[1])
            if digest == named.digest:
                return loaded[1]
            refused.add(peer)
            sync.stats.refused[peer] = sync.stats.refused.get(peer, 0) + 1
            log.warning("stage %d: refused %s's outer state of step %d: it is not the one its replicas reported",
                        sync.core.stage, peer, served.step)
        gave_up = time.monotonic() + RETRY_S >= deadline or all(p in refused for p in named.sources)
        if gave_up or superseded(sync, named):
            return None
        if newer is not None and newer.step > named.step:  # the naming of what it holds, rather than ask again
            await newer.named_by(sync, deadline)
        else:
            await asyncio.sleep(RETRY_S)
        if superseded(sync, named):
            return None
    return None


def superseded(sync, named: NamedState) -> bool:
    """Whether the coordinator names a newer step of `sync`'s stage than `named`: the others moved on from it,
    and a source no longer serves it (not a failure of its sources: they may return to it, from a checkpoint)."""
    return sync.named is not None and sync.named.step > named.step


def not_served(sync, named: NamedState) -> bool:
    """After no source served `named`: unless it was superseded, it is not asked for again (`sync.failed`).
    True if it was superseded."""
    gone = superseded(sync, named)
    if not gone:
        sync.failed.add((named.step, named.digest))
    return gone


async def fetch_newest(sync, timeout: float) -> tuple[NamedState | None, list[torch.Tensor] | None]:
    """The state the coordinator names for `sync`'s stage, if it is to replace its own (`sync.wants`), with its
    tensors (None: none fetched in `timeout` s); a newer one named while it fetched takes its place (the
    others train on: the older one is gone; a source's newer state met on the way is kept for it, NewerServed).
    A named state no source served is not asked for again (`sync.failed`)."""
    named, tensors, deadline, newer = sync.named, None, time.monotonic() + timeout, NewerServed()
    while tensors is None and sync.wants(named) and time.monotonic() < deadline:
        tensors = await fetch_named(sync, named, max(1.0, deadline - time.monotonic()), newer)
        if tensors is None:
            if not_served(sync, named):
                log.info("stage %d: the named state of step %d is gone (a newer one is named)", sync.core.stage,
                         named.step)
            else:
                log.error("stage %d: no source of the named state of step %d served it; it keeps its own",
                          sync.core.stage, named.step)
            named = sync.named
    return named, tensors


def within_reach(own: list[torch.Tensor], theirs: list[torch.Tensor], last_norm: float) -> bool:
    """Whether a same-step state of one operator is near enough to take: its outer weights within
    SAME_STEP_RADIUS times the replica's last pseudo-gradient's norm of its own."""
    distance = float((theirs[0].double() - own[0].double()).norm())
    return distance <= SAME_STEP_RADIUS * last_norm


def named_past(sync) -> bool:
    """Whether the coordinator names an outer step of `sync`'s stage past the boundary it committed, before it took
    that boundary's (the others averaged past it, or took it alone): no replica comes to its round of that step."""
    named = sync.named
    if named is None:
        return False
    committed = sync.core.committed
    return named.step > committed and sync.takes_from(named) and sync.due(committed) and sync.anchor_step < committed
