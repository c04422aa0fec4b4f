"""Bringing the stages back to one step after a replay: a stage's part of the Sync protocol (pass
the Sync on, answer with its committed step) and the rollback to an earlier committed step, from a
checkpoint of its own or, if it has none of that step, one fetched from the coordinator's store;
with pipelines in data parallel, the regroup: back to the stage's latest outer step, or, when the
stages disagree after one, to the outer step stage 0 chose among those every stage can reach."""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

from ..net.transport import BACKWARD, FORWARD
from ..proto import tahnode_pb2 as pb
from ..train.model import init_weights
from ..train.optim import StageOptimizer
from .core import StageCore
from .outer_sync import OuterSync
from .state import PipelineError

log = logging.getLogger("tahnode.pipeline")

__all__ = ["Resync"]


class Resync:
    """A stage's side of the replay protocol (stage 0 drives it: tahnode.pipeline.driver): its parts,
    the worker's commit (a Sync may carry the step end this stage missed) and its outer sync (a regroup)."""

    def __init__(self, core: StageCore, commit: Callable[[pb.StepEnd], Awaitable[float]], outer: OuterSync | None):
        self.core, self.commit, self.outer = core, commit, outer

    async def roll_back(self, step: int) -> bool:
        """Return to the committed state of `step`; False (stage 0 is told, the stage goes on as it
        was) if neither this stage nor the coordinator's store has a checkpoint of it."""
        core = self.core
        if await core.saver.ensure(step):
            await core.compute(self.rollback, step)
            return True
        reason = (f"stage {core.stage} cannot roll back to step {step}: no checkpoint of it here or in the "
                  "coordinator's store")
        log.error("%s", reason)
        core.replay_step(reason, tell=True)
        return False

    async def regroup_to(self, target: int) -> None:
        """Return to outer step `target` (stage 0 chose it among those every stage of the pipeline can
        reach): its own outer weights or the named state if either is of it, else its own checkpoint that
        keeps the outer weights of it (from there its weights become those outer weights), else, for step 0,
        the initial weights. A stage that cannot stays where it is and says so in its committed step."""
        core, outer = self.core, self.outer
        if await outer.reach(target):
            return
        steps = [c.step for c in core.saver.store.list(core.stage, core.num_stages)] if core.saver.store else []
        for step in sorted((s for s in steps if outer.boundary_of(s) == target), reverse=True):
            if await core.saver.ensure(step) and await core.compute(core.saver.load, step, core.model, core.opt.opt,
                                                                    core.codecs):
                log.warning("stage %d returns to outer step %d through its checkpoint of step %d", core.stage,
                            target, step)
                if await outer.reach(target):
                    return
        if target == 0:
            await core.compute(self.rollback, 0)
            await core.compute(outer.restore, {}, 0)
            return
        log.error("stage %d cannot return to outer step %d (it holds %d)", core.stage, target, outer.anchor_step)

    def rollback(self, step: int) -> None:
        """(compute thread) The committed state of `step`: a checkpoint of it, or the initial weights."""
        core = self.core
        if step == 0:
            init_weights(core.model, core.train.seed)
            core.opt = StageOptimizer(core.model.parameters(), core.train)
            core.codecs.restart()
        elif not core.saver.load(step, core.model, core.opt.opt, core.codecs):
            raise PipelineError(f"stage {core.stage} cannot roll back to step {step}: its checkpoint cannot be loaded")
        core.resumed_at(step)
        core.stats.losses = [r for r in core.stats.losses if r.step < step]
        core.codecs.drop_streams()
        log.warning("stage %d rolled back to step %d", core.stage, step)

    async def on_sync(self, sync: pb.Sync) -> None:
        """Stage 0 restarts step `sync.step` (rolling every stage back to it, if asked): follow,
        then pass the Sync on (or, the last stage, answer it)."""
        core, st = self.core, self.core.state
        if sync.regroup and self.outer is not None:
            await (self.regroup_to(sync.target) if sync.targeted else self.outer.regroup())
        elif sync.rollback and st.committed != sync.step and not await self.roll_back(sync.step):
            return
        lc = sync.last_commit
        if lc.step + 1 == sync.step and st.committed == lc.step and st.awaits_step_end():
            log.info("stage %d applies step %d from the sync", core.stage, lc.step)
            await self.commit(lc)
        await core.compute(core.restart_step, sync.step, sync.attempt)
        if core.last:
            ack = pb.SyncAck(step=sync.step, attempt=sync.attempt, min_committed=st.committed,
                             max_committed=st.committed)
            if self.outer is not None:
                ack.reachable.extend(sorted(self.outer.reachable()))
            await core.send(BACKWARD, sync_ack=ack)
        else:
            await core.send(FORWARD, sync=sync)

    async def on_sync_ack(self, ack: pb.SyncAck) -> pb.SyncAck:
        """An answer on its way back to stage 0: add this stage's committed step to its range and pass
        it on (stage 0: the answer, for its driver)."""
        core = self.core
        if not ack.abort:
            ack.min_committed = min(ack.min_committed, core.committed)
            ack.max_committed = max(ack.max_committed, core.committed)
            if self.outer is not None:  # the outer steps every stage so far can return to
                reachable = sorted(set(ack.reachable) & self.outer.reachable())
                del ack.reachable[:]
                ack.reachable.extend(reachable)
        if core.first:
            return ack
        if ack.abort:
            core.tell_first(ack, relayed=True)  # a replay request is passed on even across a link being re-pointed
        else:
            await core.send(BACKWARD, sync_ack=ack)
        return ack
