"""Stage 0 drives the steps: it sends each step's micro-batches through the in-flight window,
waits for their gradients, commits the step, and after a failure restarts it with a Sync that
every stage must answer (all stages return to the same committed step first)."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Awaitable, Callable

from ..net.transport import FORWARD
from ..proto import tahnode_pb2 as pb
from ..train.data import SampleSchedule, TokenDataset
from ..train.optim import grad_sumsq
from .core import StageCore
from .outer_sync import OuterSync
from .regroup_plan import RegroupPlan
from .resync import Resync
from .schedule import SavedBytes, Split, SplitTuner, Window
from .state import DivergedStep, Divergence, PipelineError, StepRecord

log = logging.getLogger("tahnode.pipeline")

__all__ = ["StepDriver"]

SYNC_WAIT_MAX_S = 5.0  # the longest stage 0 waits for a Sync's answer before asking again
# attempts of one step that diverge one after another before stage 0 does more than replay it: with
# pipelines in data parallel its pipeline regroups (once per step), and then, as in a lone pipeline,
# each further attempt waits twice as long as the one before, up to DIVERGED_WAIT_MAX_S (a diverged
# model replayed its step about 20 times a second for ever)
DIVERGED_TRIES = 3
DIVERGED_WAIT_MAX_S = 60.0
# a pipeline whose stages disagree after a regroup tries each outer step every stage can reach this many times
# before it gives that one up for the next lower; past REGROUP_QUIET tries in a row it waits before the next,
# twice as long each time up to REGROUP_WAIT_MAX_S (a swarm once logged "stages are at steps 28..36" seven times a
# second for eight minutes and trained nothing)
TARGET_TRIES = 2
REGROUP_QUIET = 4
REGROUP_WAIT_MAX_S = 30.0


class StepDriver:
    """The step loop of stage 0 (`drive`), fed by the stage's inbox through `backward_done`,
    `sync_answered` and `abort_step`. It takes the stage's parts (`core`), the worker's forward of a
    micro-batch and commit of a step, the rollback of the stage (Resync) and its outer sync."""

    def __init__(self, core: StageCore, dataset: TokenDataset | None, forward_first: Callable[..., tuple],
                 commit: Callable[[pb.StepEnd], Awaitable[float]], resync: Resync, outer: OuterSync | None):
        self.core, self.forward_first, self.commit, self.resync, self.outer = core, forward_first, commit, resync, outer
        t = core.train
        self.split = Split.of(t, core.num_stages)
        self.tuner = SplitTuner(Split.counts(t), self.split.micro_batches)
        self.dataset = dataset
        self.samples = SampleSchedule.for_run(core.run_cfg, len(dataset)) if dataset else None
        self.window = Window.initial(core.num_stages, self.split, t.schedule)
        self.sample_bytes = 0.0  # activations saved here per sample (measured on the first micro-batch)
        self.all_backward = asyncio.Event()
        self.abort = asyncio.Event()
        self.sync_reply: asyncio.Future | None = None
        self.progress = 0  # gradients that came back so far (the stall watchdog's measure)
        self.diverged = False  # the step in flight diverged at a stage (its own output or gradient not finite)
        self.divergence = Divergence(DIVERGED_TRIES, DIVERGED_WAIT_MAX_S)

    # -- what the worker tells -------------------------------------------------------------------
    def backward_done(self, step_complete: bool) -> None:
        """The backward pass of one micro-batch finished here (the last of the step: `step_complete`)."""
        self.progress += 1
        if step_complete:
            self.all_backward.set()
        self.window.release()

    def abort_step(self, diverged: bool = False) -> None:
        """A link failed, or the step diverged here: the step in flight is given up and replayed."""
        self.diverged |= diverged
        self.abort.set()

    def sync_answered(self, ack: pb.SyncAck) -> None:
        """A Sync's answer, or a later stage's abort of the step in flight. An abort of an attempt
        before this one is stale (each micro-batch of a diverged attempt sends one): it ends nothing."""
        st = self.core.state
        if ack.abort:
            if ack.step == st.step and ack.attempt < st.attempt:
                return
            self.diverged |= ack.diverged
            self.abort.set()
        elif (self.sync_reply is not None and not self.sync_reply.done()
                and (ack.step, ack.attempt) == (st.step, st.attempt)):
            self.sync_reply.set_result(ack)

    # -- the loop ----------------------------------------------------------------------------------
    def _forward(self, index: int):
        split = self.split
        ids = self.samples.ids_at(self.core.state.step, index * split.batch_size, split.batch_size, self.core.pipeline)
        tokens, labels = self.dataset.batch(ids)
        if self.sample_bytes:
            return self.forward_first(index, split.micro_batches, ids, tokens, labels)
        with SavedBytes(self.core.model) as saved:
            result = self.forward_first(index, split.micro_batches, ids, tokens, labels)
        self.sample_bytes = max(1.0, saved.bytes / split.batch_size)
        self.window.cap(self._memory_cap(split))
        log.info("stage 0: a micro-batch of %d samples saves %.1f MB of activations; the memory budget holds %d "
                 "in flight", split.batch_size, self.sample_bytes * split.batch_size / 2**20, self._memory_cap(split))
        return result

    def _memory_cap(self, split: Split) -> int:
        """Micro-batches of `split` whose saved activations fit in the memory budget (at least 1)."""
        budget = self.core.train.memory_budget_mb * 2**20
        return (max(1, int(budget // (self.sample_bytes * split.batch_size))) if self.sample_bytes
                else split.micro_batches)

    def _begin_step(self) -> None:
        """This step's cut (the tuner's), and a window for it: as many places, in samples, as the
        last step's window had, within the step and the memory budget."""
        old, self.split = self.split, Split.with_count(self.core.train, self.tuner.count)
        if self.split != old:
            fresh = Window.initial(self.core.num_stages, self.split, self.core.train.schedule)
            self.window = Window(max(fresh.size, self.window.size * self.split.micro_batches // old.micro_batches),
                                 fresh.limit)
            self.window.cap(self._memory_cap(self.split))
            log.info("stage 0: steps are now %d micro-batches of %d samples (window %d)", self.split.micro_batches,
                     self.split.batch_size, self.window.size)

    async def _admit(self) -> bool:
        """A place in the window (False: the step was aborted). Waiting for one while the forward link
        has nothing to send means the window, not the link, holds the pipeline back: it grows."""
        if not self.window.full:
            return await self.window.admit(self.abort)
        admitted = asyncio.ensure_future(self.window.admit(self.abort))
        drained = asyncio.ensure_future(self.core.t.drained(FORWARD))
        done, _ = await asyncio.wait({admitted, drained}, return_when=asyncio.FIRST_COMPLETED)
        drained.cancel()
        if admitted not in done and self.window.grow():
            log.debug("stage 0: %d micro-batches in flight (the forward link went idle waiting for the window)",
                      self.window.size)
        return await admitted

    async def _sync(self, attempt: int, regroup: bool = False) -> None:
        """Restart step `committed` as `attempt` once every stage answers; repeat until they do.
        Stages that answer with different committed steps are all rolled back to the smallest; with
        pipelines in data parallel (`regroup`, or other pipelines training) every stage returns to
        its stage's latest outer step instead (once more when they disagree: a regroup done while a stage was
        still loading its checkpoint took a state the others have since moved on from), and if they still
        disagree, to the newest outer step every one of them can reach (RegroupPlan: a bounded number of tries
        each, then the next lower; 0, the initial weights, is always reachable), so that the loop ends."""
        core, st = self.core, self.core.state
        rollback, plan, before, fresh = False, RegroupPlan(TARGET_TRIES), st.committed, True
        wait = 1.0  # the first Sync may reach a stage before it listens: ask again soon, then less often
        while True:
            if regroup:
                await (self.outer.regroup() if plan.target is None else self.resync.regroup_to(plan.target))
                # every stage may wait that long for a replica's state
                wait = max(wait, self.outer.swarm.outer_timeout_s)
            await core.compute(core.restart_step, st.committed, attempt)
            # cleared once the attempt is this one: an abort of the one before that came in between (each
            # micro-batch of a diverged attempt sends one) would have ended this attempt before it began
            self.abort.clear()
            self.window = Window(self.window.size, self.window.limit)  # none in flight; what it learned stays
            if core.num_stages == 1:
                return
            self.sync_reply = asyncio.get_running_loop().create_future()
            sync = pb.Sync(step=st.step, attempt=attempt, last_commit=st.last_commit, rollback=rollback,
                           regroup=regroup, targeted=plan.target is not None, target=plan.target or 0)
            await core.send(FORWARD, sync=sync)
            try:
                ack = await asyncio.wait_for(asyncio.shield(self.sync_reply), timeout=wait)
            except asyncio.TimeoutError:
                log.info("waiting for every stage to answer (step %d, attempt %d)", st.step, attempt)
                attempt, wait = attempt + 1, min(2 * wait, SYNC_WAIT_MAX_S)
                continue
            low = min(ack.min_committed, st.committed)
            before = min(before, low)  # a stage behind stage 0 (its holder died before its losses were reported)
            if ack.max_committed == low and st.committed == low:
                self._skipped(before, low)
                return
            if self.outer is not None and self.outer.replicated and fresh:  # each to its stage's latest, as named now
                log.warning("stages are at steps %d..%d: every stage returns to its stage's latest outer step", low,
                            max(ack.max_committed, st.committed))
                regroup, attempt, fresh = True, attempt + 1, False
                continue
            if self.outer is not None and self.outer.replicated:
                target = plan.next(set(ack.reachable) & self.outer.reachable())
                log.warning("stages are at steps %d..%d: every stage returns to outer step %d, the newest each of "
                            "them can reach (try %d)", low, max(ack.max_committed, st.committed), target, plan.tries)
                if plan.tries > REGROUP_QUIET:
                    await self._pause(min(2.0 ** (plan.tries - REGROUP_QUIET), REGROUP_WAIT_MAX_S))
                regroup, attempt = True, attempt + 1
                continue
            # a stage came back from an older checkpoint (e.g. a standby took it over): every stage
            # returns to that step and the steps after it are trained again
            log.warning("stages are at steps %d..%d: rolling every stage back to step %d", low,
                        max(ack.max_committed, st.committed), low)
            if st.committed != low and not await self.resync.roll_back(low):
                raise PipelineError(f"stage 0 cannot roll back to step {low}: no checkpoint of it here or in the "
                                    "coordinator's store")
            rollback = True
            attempt += 1

    def _skipped(self, before: int, after: int) -> None:
        """Steps before..after-1, which its pipeline skipped to take a newer replica's state: to the ledger as
        skipped, with the samples they would have trained (nothing lost silently; `before` is the lowest step a
        stage stood at during the regroup, and the coordinator fills only the ledger's gaps with them)."""
        if after <= before or self.samples is None:
            return
        per_step, pipeline = self.samples.samples_per_step, self.core.pipeline
        log.warning("stage 0: pipeline %d skips steps %d..%d (it took a newer replica's state)", pipeline, before,
                    after - 1)
        self.core.stats.outbox += [StepRecord(step, float("nan"), self.samples.ids_at(step, 0, per_step, pipeline),
                                              0.0, skipped=True) for step in range(before, after)]

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds` unless the worker stops first."""
        try:
            await asyncio.wait_for(self.core.shutdown.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def _run_step(self) -> bool:
        """Send every micro-batch of the step, wait for its gradients. False if aborted (a link
        failed, a stage refused a micro-batch, or the step stalled)."""
        self.all_backward.clear()
        self.diverged = False
        self._begin_step()
        watchdog = asyncio.ensure_future(self._watch_for_stall())
        try:
            for index in range(self.split.micro_batches):
                if not await self._admit():
                    return False
                try:
                    env, gen = await self.core.compute(self._forward, index)
                except DivergedStep as exc:
                    log.error("%s: the model diverged; the step will be replayed", exc)
                    self.diverged = True
                    return False
                await self.core.send_micro_batch(FORWARD, gen, env, index)
            waiter = asyncio.ensure_future(self.all_backward.wait())
            aborted = asyncio.ensure_future(self.abort.wait())
            done, _ = await asyncio.wait({waiter, aborted}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            aborted.cancel()
            return waiter in done and not self.abort.is_set()
        finally:
            watchdog.cancel()

    async def _after_divergence(self) -> bool:
        """After an attempt that diverged: whether its pipeline regroups (the DIVERGED_TRIES-th in a
        row, once per step, with other pipelines training); past that, the wait before the next attempt."""
        outer, step = self.outer, self.core.committed
        action = self.divergence.failed(step, regroup_possible=outer is not None and outer.active)
        if action.regroup:
            log.error("stage 0: step %d diverged %d times in a row: pipeline %d returns to its stages' latest outer "
                      "weights", step, self.divergence.in_a_row, self.core.pipeline)
        elif action.wait:
            log.error("stage 0: step %d diverged %d times in a row; the next attempt in %.0f s (lower train.lr, or "
                      "resume from an earlier checkpoint)", step, self.divergence.in_a_row, action.wait)
            try:
                await asyncio.wait_for(self.core.shutdown.wait(), action.wait)
            except asyncio.TimeoutError:
                pass
        return action.regroup

    async def _watch_for_stall(self) -> None:
        """Abort the step when no gradient came back for `stall_timeout_s` (a message lost or
        dropped on the way, a peer that hangs): every wait of the step has this deadline."""
        timeout = self.core.train.stall_timeout_s
        if not timeout:
            return
        seen = self.progress
        while True:
            await asyncio.sleep(timeout)
            if self.progress == seen:
                log.warning("stage 0: no gradient came back for %.0f s; the step will be replayed", timeout)
                self.abort.set()
                return
            seen = self.progress

    async def drive(self, steps: int) -> None:
        """Train until `steps` steps are committed (or the worker stops), then shut the run down."""
        core, st = self.core, self.core.state
        # a fresh attempt number per incarnation of stage 0: leftovers of a previous one never match
        attempt = random.randrange(1, 1 << 30)
        outer = self.outer
        if outer is not None and outer.pipelines.now > 1:  # other pipelines train: start from their latest outer step
            await outer.wait_ready()
        await self._sync(attempt, regroup=outer is not None and outer.active)
        replayed = False  # a replayed step's time says nothing about its cut
        while st.committed < steps and not core.stopping:
            if core.num_stages == 1:
                raise PipelineError("a single-stage swarm: use tahnode.train.local instead")
            if not await self._run_step():
                if core.stopping:
                    break
                core.stats.replays += 1
                attempt, replayed = st.attempt + 1, True
                log.warning("stage 0 replays step %d (attempt %d)", st.committed, attempt)
                await self._sync(attempt, regroup=await self._after_divergence() if self.diverged else False)
                continue
            total = st.partial_sumsq + await core.compute(grad_sumsq, core.opt.params)
            seconds = await self.commit(pb.StepEnd(step=st.step, attempt=st.attempt, grad_sumsq=total))
            self.divergence.committed(st.committed)
            if not replayed:
                self.tuner.record(seconds)
            replayed = False
            if outer is not None and outer.active and outer.needs_regroup and st.committed < steps:
                log.warning("stage 0: pipeline %d missed an outer step: it regroups with the others", core.pipeline)
                outer.needs_regroup = False
                await self._sync(st.attempt + 1, regroup=True)
        if not core.stopping:
            await core.send(FORWARD, shutdown=pb.Shutdown(step=st.committed))
            core.finish()
