"""Bringing the stages back to one step after a replay: a stage's part of the Sync protocol (pass
the Sync on, answer with its committed step) and the rollback to an earlier committed step, from a
checkpoint of its own or, if it has none of that step, one fetched from the coordinator's store;
with pipelines in data parallel, the regroup: back to the stage's latest outer step."""

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
            await self.outer.regroup()
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
        if core.first:
            return ack
        if ack.abort:
            core.tell_first(ack, relayed=True)  # a replay request is passed on even across a link being re-pointed
        else:
            await core.send(BACKWARD, sync_ack=ack)
        return ack
