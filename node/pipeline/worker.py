"""One pipeline stage at work: forward and backward of its micro-batches, the step commit with the
global gradient norm, and its part of the replay protocol (Sync) after a link failed.

Messages on each stream arrive in order, so one task handles the inbox sequentially; the torch work
runs on one compute thread, and sends overlap with compute in the transport's link tasks. Stage 0
also drives the steps (tahnode.pipeline.driver)."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import torch

from ..codecs import CodecError, PendingPayload
from ..config import RunConfig
from ..net.body import Body, PendingBody, body_of
from ..net.transport import BACKWARD, FORWARD, Direction, Inbound, Transport
from ..proto import tahnode_pb2 as pb
from ..train.data import TokenDataset
from ..train.model import StageModel
from ..train.optim import grad_sumsq
from .admission import BadMicroBatch
from .checkpoint import CheckpointStore, has_outer
from .core import StageCore
from .driver import StepDriver
from .inbox import Inbox, StageOps
from .outer_count import PIPELINES
from .outer_sync import REGROUP, Averager, OuterSync
from .resync import Resync
from .state import STALE, DivergedStep, Pending, PipelineError, StepRecord, StopRequest

log = logging.getLogger("tahnode.pipeline")

__all__ = ["StageWorker", "PipelineError", "STALE"]


class StageWorker(StageCore):
    """Holds stage `stage` of `run` in pipeline `pipeline` (whose samples stage 0 trains); drive with
    `run()` (stage 0 also drives the steps). Its parts are StageCore's; its helpers take those parts
    and the few operations of the worker they call."""

    def __init__(self, run: RunConfig, stage: int, transport: Transport, device: str = "cpu",
                 store: CheckpointStore | None = None, dataset: TokenDataset | None = None,
                 on_step: Callable[["StageWorker"], None] | None = None, model: StageModel | None = None,
                 on_saved: Callable[[str, int], None] | None = None, pipeline: int = 0,
                 averager: Averager | None = None):
        super().__init__(run, stage, transport, device, store, model, on_saved, pipeline)
        self.on_step = on_step
        # pipelines in data parallel (a run that may have more than one): the replicas' outer steps
        self.outer = OuterSync(self, averager) if has_outer(run) else None
        self.saver.outer, self.saver.pipeline = self.outer, pipeline  # its checkpoints keep the outer weights
        self.resync = Resync(self, self.commit, self.outer)
        self.driver = None
        if self.first:
            self.driver = StepDriver(self, dataset, self.forward_first, self.commit, self.resync, self.outer)
            self.abort_step = self.driver.abort_step
        self.inbox = Inbox(self, StageOps(self.forward, self.backward, self.commit, self.resync, self.driver))
        self.t.on_link_down(self._link_down)

    def _link_down(self, direction: Direction, reason: str) -> None:
        if self.stopping or self.shutdown.is_set():
            return
        log.warning("stage %d: %s; the step will be replayed", self.stage, reason)
        # a failed backward link is reported to stage 0 by the stage on its other end
        self.replay_step(reason, tell=direction == FORWARD)

    def _message(self, direction: Direction, tensor: torch.Tensor, ids: list[int], src: pb.MicroBatch | None = None,
                 **fields) -> tuple[Body | PendingBody, int]:
        """An envelope with one micro-batch (`src`'s step, index, attempt and count, then `fields`)
        and this stage's own output (or input gradient, going BACKWARD) encoded, as the body the
        transport sends (the payload's host bytes kept apart, uncopied: tahnode.net.body; a
        PendingBody the link finishes, with train.host_copy "overlap"); and the link generation
        that encoded it. A codec that cannot encode the tensor (a non-finite or
        overflowing value) means the step diverged here, not that a peer misbehaved."""
        env = pb.Envelope()
        mb = env.micro_batch
        if src is not None:
            mb.step, mb.index, mb.attempt, mb.count = src.step, src.index, src.attempt, src.count
        extras = fields.pop("extras", {})
        for name, value in fields.items():
            setattr(mb, name, value)
        mb.sample_ids.extend(ids)
        mb.extras.update(extras)
        gradient = direction == BACKWARD
        try:
            if gradient:
                payload, gen, mb.scale_log2 = self.codecs.encode_gradient(tensor, ids, out=mb.tensor)
            else:
                payload, gen, mb.scale_log2 = self.codecs.encode_output(tensor, ids, self.state.step, out=mb.tensor)
        except CodecError as exc:
            raise DivergedStep(f"stage {self.stage} cannot encode its own {'gradient' if gradient else 'output'} "
                               f"of step {self.state.step}: {exc}") from None
        return (PendingBody(env, payload) if isinstance(payload, PendingPayload) else body_of(env, payload)), gen

    # -- compute (runs on the compute thread) -------------------------------------------------
    def forward_first(self, index: int, count: int, ids: list[int], tokens: torch.Tensor,
                      labels: torch.Tensor) -> tuple[Body, int]:
        """Stage 0: embed and run micro-batch `index` of the `count` of the current step; its envelope
        and generation."""
        st = self.state
        st.micro_batches = count
        out = self.model(tokens.to(self.device))
        st.pending[index] = Pending(None, self.codecs.sent(out), ids)
        return self._message(FORWARD, out, ids, step=st.step, index=index, extras=self._counted(st.step),
                             labels=labels.to(torch.int32).numpy().tobytes(), attempt=st.attempt, count=count)

    def _counted(self, step: int) -> dict[str, float]:
        """Stage 0: the pipelines it counts for `step` (with pipelines in data parallel), the same for every
        micro-batch of the step; every stage's outer step after it waits for that many (outer_count)."""
        outer = self.outer
        if outer is None or outer.averager is None:
            return {}
        if outer.pipelines.step != step:
            outer.pipelines.take(step, max(1, outer.pipelines.now))
        return {PIPELINES: float(outer.pipelines.count)}

    def _stale(self, item: Inbound, mb: pb.MicroBatch):
        """Drop a micro-batch of another attempt; its stream's codec state still takes it in (the
        sender's state advanced when it encoded it), once its header passed admission."""
        log.debug("stage %d dropped stale micro-batch %d/%d of step %d", self.stage, mb.index, mb.attempt, mb.step)
        try:
            self.admission.header(mb)
            self.codecs.discard(item.direction, item.stream, mb, item.payload)
        except (BadMicroBatch, CodecError) as exc:
            self.offence(item, exc)
        return STALE

    def _decode(self, item: Inbound, mb: pb.MicroBatch) -> torch.Tensor:
        """The received tensor; an unreadable payload is a bad micro-batch (a CodecError encoding
        this stage's own output, e.g. a diverged model, stays fatal)."""
        try:
            return self.codecs.decode(item.direction, item.stream, mb, self.dtype, item.payload)
        except CodecError as exc:
            raise BadMicroBatch(str(exc)) from None

    def forward(self, item: Inbound, mb: pb.MicroBatch):
        st = self.state
        if not st.current(mb.step, mb.attempt):
            return self._stale(item, mb)
        self.admission.header(mb)
        labels = self.admission.labels(mb) if self.computes_loss else None
        self.admission.encoded_shape(mb, self.admission.activation_shape(mb))  # before decoding allocates anything
        x = self._decode(item, mb)
        self.admission.activations(mb, x)
        if mb.count:  # stage 0 cuts every step anew (tahnode.pipeline.schedule)
            st.micro_batches = mb.count
        if PIPELINES in mb.extras and self.outer is not None:
            self.outer.pipelines.take(mb.step, mb.extras[PIPELINES])
        x.requires_grad_(True)
        ids = list(mb.sample_ids)
        if self.first and self.run_cfg.ring:  # the last stage's final hidden states, for the head that is the embedding
            self._loss_backward(self.model.head(x), labels, ids)
            extras = {"grad_sumsq": 0.0}  # the tied weight counts once, with stage 0's own parameters at the commit
        elif self.computes_loss:
            self._loss_backward(self.model(x), labels, ids)
            st.done_backward += 1
            if st.all_backward:
                st.sent_sumsq = grad_sumsq(self.opt.params)
            extras = {"grad_sumsq": st.sent_sumsq} if st.all_backward else {}
        if self.computes_loss:
            return (BACKWARD, *self._message(BACKWARD, x.grad, ids, mb, extras=extras))
        out = self.model(x)
        st.pending[mb.index] = Pending(x, self.codecs.sent(out), ids)
        counted = {PIPELINES: mb.extras[PIPELINES]} if PIPELINES in mb.extras else {}
        return (FORWARD, *self._message(FORWARD, out, ids, mb, labels=mb.labels, extras=counted))

    def _loss_backward(self, logits: torch.Tensor, labels, ids: list[int]) -> None:
        """The loss of one micro-batch and its backward pass, weighted so that the step's loss is the
        mean over all its tokens."""
        st = self.state
        loss = self.model.loss(logits, torch.from_numpy(labels.copy()).long().to(self.device))
        (loss * (len(ids) / st.samples_per_step)).backward()
        st.loss_sum += float(loss.detach()) * len(ids)
        st.samples.extend(ids)

    def backward(self, item: Inbound, mb: pb.MicroBatch):
        st = self.state
        if not st.current(mb.step, mb.attempt) or mb.index not in st.pending:
            return self._stale(item, mb)
        self.admission.header(mb)
        partial = self.admission.grad_sumsq(mb.extras["grad_sumsq"]) if "grad_sumsq" in mb.extras else None
        self.admission.encoded_shape(mb, tuple(st.pending[mb.index].out.shape))
        grad = self._decode(item, mb)
        self.admission.gradient(grad, st.pending[mb.index].out)
        p = st.pending.pop(mb.index)
        p.out.backward(grad)
        st.done_backward += 1
        if partial is not None:
            st.partial_sumsq = partial
        regroup = self.outer is not None and self.outer.regroup_asked(REGROUP in mb.extras)
        if self.first:
            return None
        extras = {REGROUP: 1.0} if regroup else {}
        if st.all_backward:
            extras["grad_sumsq"] = st.sent_sumsq = st.partial_sumsq + grad_sumsq(self.opt.params)
        return self._message(BACKWARD, p.inp.grad, p.sample_ids, mb, extras=extras)

    def _apply(self, step: int, total_sumsq: float) -> float:
        """Clip and step (runs on the compute thread, like every change to the step state); the
        step's wall time since the previous commit. The step's loss record (last stage) is in the
        stats before the step counts as committed, so no heartbeat reports the one without the other."""
        st = self.state
        loss, samples = st.loss_sum / max(1, len(st.samples)), list(st.samples)
        self.codecs.apply_step(step)
        self.opt.apply(step, total_sumsq)
        seconds = self.stats.step_done()
        if self.computes_loss:
            record = StepRecord(step, loss, samples, seconds)
            self.stats.losses.append(record)
            self.stats.outbox.append(record)
        st.committed = step + 1
        self.restart_step(step + 1, 0)
        return seconds

    # -- commit --------------------------------------------------------------------------------
    async def commit(self, end: pb.StepEnd) -> float:
        """Apply step `end.step` (clip with the global norm and step), pass the StepEnd on; the
        step's wall time since the previous commit."""
        seconds = await self.compute(self._apply, end.step, end.grad_sumsq)
        self.state.last_commit = end
        if not self.last:
            await self.send(FORWARD, step_end=end)
        if self.outer is not None:
            await self.outer.after_commit()  # at an outer boundary: the replicas of the stage average
        if self.committed % self.train.checkpoint_every == 0:
            await self.compute(self.save)
        if self.on_step:
            self.on_step(self)
        return seconds

    # -- the inbox (tahnode.pipeline.inbox) ---------------------------------------------------
    async def serve(self) -> None:
        await self.inbox.serve()

    async def handle(self, item: Inbound) -> None:
        await self.inbox.handle(item)

    # -- running -------------------------------------------------------------------------------
    async def run(self, steps: int) -> None:
        if self.first:
            await asyncio.gather(self.serve(), self.driver.drive(steps))
        else:
            await self.serve()

    async def stop(self, drain_s: float = 5.0) -> None:
        """Graceful stop (SIGTERM): if the stage sent every gradient of the step and only its StepEnd
        is missing, wait (up to `drain_s`) for that StepEnd; then save the committed state.

        Decided between envelopes, never while one is handled: a gradient still being sent lets
        stage 0 commit the step, so its StepEnd is then waited for too; and nothing of a later
        step is handled once the awaited step is committed."""
        async with self.inbox.handling:
            awaits = not self.first and self.state.awaits_step_end()
            self.ending.request = StopRequest(self.state.step if awaits else None)
            if not awaits:
                self.shutdown.set()
        try:
            await asyncio.wait_for(self.shutdown.wait(), drain_s)
        except asyncio.TimeoutError:
            log.warning("stage %d: the StepEnd of step %d did not come within %.0f s", self.stage,
                        self.stop_request.drain_step, drain_s)
            self.shutdown.set()
        await self.t.flush(2.0)
        await self.compute(self.save)

    def close(self) -> None:
        """Release the compute thread (the worker is not used afterwards)."""
        self.pool.shutdown(wait=False)
