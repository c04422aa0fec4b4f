"""A stage's inbox: it takes the received envelopes in order (gradients first), checks that each came
from the neighbour whose direction carries its kind, and hands it to the worker. Nothing a peer
sends ends the daemon: a refused micro-batch is counted against its sender and the step replayed.

The torch work runs on the worker's compute thread; sends overlap it in the transport's links."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

from ..net.transport import BACKWARD, FORWARD, EnvelopeKind, Inbound
from ..proto import tahnode_pb2 as pb
from .admission import BadMicroBatch
from .core import StageCore
from .driver import StepDriver
from .resync import Resync
from .schedule import InboxOrder
from .state import STALE, DivergedStep

log = logging.getLogger("tahnode.pipeline")

__all__ = ["Inbox", "StageOps"]


@dataclass
class StageOps:
    """What the inbox hands its envelopes to: the worker's forward and backward of a micro-batch (on the
    compute thread), its commit of a step, the stage's side of the Sync protocol, and on stage 0 the
    driver of the steps."""

    forward: Callable[[Inbound, pb.MicroBatch], object]
    backward: Callable[[Inbound, pb.MicroBatch], object]
    commit: Callable[[pb.StepEnd], Awaitable[float]]
    resync: Resync
    driver: StepDriver | None


class Inbox:
    """The envelope side of a stage (`serve` until the run ends for the stage)."""

    def __init__(self, core: StageCore, ops: StageOps):
        self.core, self.ops = core, ops
        self.handling = asyncio.Lock()  # held while one envelope is being handled

    async def serve(self) -> None:
        """Handle envelopes, gradients first (InboxOrder), until a Shutdown went through (or stop()
        was called)."""
        core = self.core
        order = InboxOrder(core.t.inbox, core.t.inbox_bytes, FORWARD if core.first else BACKWARD)
        while not core.shutdown.is_set():
            getter = asyncio.ensure_future(order.next())
            stopper = asyncio.ensure_future(core.shutdown.wait())
            done, _ = await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                break
            stopper.cancel()
            item: Inbound = getter.result()
            if item.envelope is None:
                continue  # a new stream: its codec state starts afresh (CodecStreams)
            async with self.handling:
                if core.shutdown.is_set():
                    break
                await self.handle(item)
                if core.drained():
                    core.shutdown.set()

    async def handle(self, item: Inbound) -> None:
        core, env = self.core, item.envelope
        kind = EnvelopeKind.of(env)
        if kind is None:
            return
        try:
            core.admission.envelope(item, kind, core.t)
        except BadMicroBatch as exc:
            core.offence(item, exc)
            return
        if kind is EnvelopeKind.MICRO_BATCH:
            await self._on_micro_batch(item, env.micro_batch)
        elif kind is EnvelopeKind.STEP_END:
            await self._on_step_end(item, env.step_end)
        elif kind is EnvelopeKind.SYNC:
            await self.ops.resync.on_sync(env.sync)
        elif kind is EnvelopeKind.SYNC_ACK:
            ack = await self.ops.resync.on_sync_ack(env.sync_ack)
            if self.ops.driver is not None:
                self.ops.driver.sync_answered(ack)
        elif kind is EnvelopeKind.SHUTDOWN:
            if not core.last:
                await core.send(FORWARD, shutdown=env.shutdown)
            core.finish()

    def refused(self, item: Inbound, mb: pb.MicroBatch, exc: Exception) -> None:
        """A received micro-batch failed admission or decoding: count it, replay the step."""
        core = self.core
        core.stats.refused_from(item.sender)
        reason = f"refused {item.direction} micro-batch {mb.index} of step {mb.step} from {item.sender or '?'}: {exc}"
        log.warning("stage %d %s; the step will be replayed", core.stage, reason)
        core.replay_step(reason, tell=True)

    async def _on_micro_batch(self, item: Inbound, mb: pb.MicroBatch) -> None:
        core = self.core
        try:
            result = await core.compute(self.ops.forward if item.direction == FORWARD else self.ops.backward, item, mb)
        except BadMicroBatch as exc:
            self.refused(item, mb, exc)
            return
        except DivergedStep as exc:
            log.error("%s: the model diverged; the step will be replayed", exc)
            core.replay_step(str(exc), tell=True, diverged=True)
            return
        except Exception as exc:  # whatever a peer's message caused, it never ends the daemon
            log.exception("stage %d: handling a micro-batch from %s failed", core.stage, item.sender or "?")
            self.refused(item, mb, exc)
            return
        if result is STALE:
            return
        if item.direction == FORWARD:
            direction, out, gen = result
            await core.send_micro_batch(direction, gen, out, mb.index)
            return
        if result is not None:
            await core.send_micro_batch(BACKWARD, result[1], result[0], mb.index)
        if self.ops.driver is not None:
            self.ops.driver.backward_done(core.state.all_backward)

    async def _on_step_end(self, item: Inbound, end: pb.StepEnd) -> None:
        core = self.core
        st = core.state
        if end.step == st.committed and st.awaits_step_end():
            try:  # the global norm includes what this stage sent back: it cannot be less
                core.admission.grad_sumsq(end.grad_sumsq, at_least=st.sent_sumsq)
            except BadMicroBatch as exc:  # commit in step with the others, clipping by what this stage knows
                core.offence(item, exc)
                end = pb.StepEnd(step=end.step, attempt=end.attempt, grad_sumsq=st.sent_sumsq)
            await self.ops.commit(end)
        elif end.step < st.committed:
            log.debug("stage %d dropped step end %d: already applied (from a sync)", core.stage, end.step)
        else:  # ahead of this stage: it missed steps (restarted behind the others, its neighbour not yet told): resync
            reason = f"step end {end.step} arrived with gradients of {st.done_backward} micro-batches of step {st.step}"
            log.warning("stage %d: %s; the step will be replayed", core.stage, reason)
            core.replay_step(reason, tell=True)
