"""One pipeline stage at work: forward and backward of its micro-batches, the step commit with the
global gradient norm, and the replay protocol (Sync) that restarts a step after a link failed.

Messages on each stream arrive in order, so one task handles the inbox sequentially; the torch work
runs on one compute thread, and sends overlap with compute in the transport's link tasks."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from . import codecs
from .checkpoint import CheckpointStore
from .checkpoint import load as load_checkpoint
from .codecs import CodecContext
from .config import RunConfig
from .data import SampleSchedule, TokenDataset
from .kernels.amaq_ref import AmaqState, fake_quant
from .model import StageModel
from .optim import StageOptimizer, grad_sumsq
from .proto import tahnode_pb2 as pb
from .transport import BACKWARD, FORWARD, Inbound

log = logging.getLogger("tahnode.pipeline")


STALE = object()  # what compute returns for a micro-batch of an attempt that was dropped meanwhile


class PipelineError(RuntimeError):
    """The pipeline cannot go on (e.g. stages resumed from different steps)."""


@dataclass
class Stats:
    """Counters every stage keeps; the last stage also has the losses."""

    encoded_bytes: dict = field(default_factory=lambda: {FORWARD: 0, BACKWARD: 0})  # EncodedTensor messages
    elements: dict = field(default_factory=lambda: {FORWARD: 0, BACKWARD: 0})
    uncompressed_bytes: int = 0
    losses: list = field(default_factory=list)      # (step, mean loss, sample ids), committed steps
    outbox: list = field(default_factory=list)      # the same, not yet reported to the coordinator
    step_times: list = field(default_factory=list)  # wall time of each committed step
    tokens_per_step: int = 0
    finished: bool = False
    replays: int = 0

    def bits_per_element(self, direction: str) -> float:
        n = self.elements[direction]
        return 8.0 * self.encoded_bytes[direction] / n if n else 0.0

    def tokens_per_s(self, last: int = 10) -> float:
        times = self.step_times[-last:]
        return self.tokens_per_step * len(times) / sum(times) if times and sum(times) > 0 else 0.0


@dataclass
class Pending:
    inp: torch.Tensor | None
    out: torch.Tensor
    sample_ids: list[int]


class StageWorker:
    """Holds stage `stage` of `run`; drive with `run()` (stage 0 also drives the steps)."""

    def __init__(self, run: RunConfig, stage: int, transport, device: str = "cpu", store: CheckpointStore | None = None,
                 dataset: TokenDataset | None = None, on_step: Callable[["StageWorker"], None] | None = None,
                 model: StageModel | None = None, on_saved: Callable[[str, int], None] | None = None):
        from .model import build_stage

        self.run_cfg, self.train = run, run.train
        self.stage, self.num_stages = stage, run.stages
        self.first, self.last = stage == 0, stage == run.stages - 1
        self.t = transport
        self.device = torch.device(device)
        self.dtype = torch.float32 if self.train.dtype == "float32" else torch.bfloat16
        self.model = (model or build_stage(run.model, stage, run.stages, seed=self.train.seed, dtype=self.dtype)).to(self.device)
        self.opt = StageOptimizer(self.model.parameters(), self.train)
        self.store = store
        self.on_step = on_step
        self.on_saved = on_saved
        self.fw_codec = codecs.get_codec(run.codec.forward, **run.codec.forward_params)
        self.bw_codec = codecs.get_codec(run.codec.backward, **run.codec.backward_params)
        self.amaq: AmaqState | None = None
        self.amaq_opt = None
        if run.codec.forward == "amaq" and not self.last:
            self.amaq = AmaqState(run.model.dim, self.fw_codec.params, device=self.device)
            self.amaq_opt = torch.optim.Adam(self.amaq.parameters(), lr=self.fw_codec.params.q_lr)
        self.send_ctx: dict[str, tuple[int, CodecContext]] = {}
        self.recv_ctx: dict[str, tuple[int, CodecContext]] = {}
        self.dataset = dataset
        self.schedule = SampleSchedule(len(dataset), self.train.batch_size, self.train.micro_batches, seed=self.train.seed) if dataset else None
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage}-compute")
        self.stats = Stats(tokens_per_step=self.train.micro_batches * self.train.batch_size * self.train.seq_len)
        # step state
        self.committed = 0                 # number of optimizer steps applied
        self.step, self.attempt = 0, 0     # the step being computed
        self.pending: dict[int, Pending] = {}
        self.done_backward = 0
        self.partial_sumsq = 0.0           # gradient sum of squares of the later stages
        self.step_losses: list[float] = []
        self.step_samples: list[int] = []
        self.step_started = time.perf_counter()
        self.last_commit = pb.StepEnd()
        # stage 0's driver
        self.window = asyncio.Semaphore(self.num_stages if self.train.schedule == "1f1b" else self.train.micro_batches)
        self.backward_done = asyncio.Event()
        self.abort = asyncio.Event()
        self.sync_reply: asyncio.Future | None = None
        self.stopping = False
        self.saved_step = -1
        self.shutdown = asyncio.Event()
        self.t.on_link_down(self._link_down)

    # -- helpers ----------------------------------------------------------------------------
    async def compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def _ctx(self, table: dict, direction: str, number: int, sample_ids=None) -> CodecContext:
        """The codec state of a stream; a new stream number starts it afresh (AMAQ gates persist)."""
        if direction not in table or table[direction][0] != number:
            table[direction] = (number, CodecContext(amaq_state=self.amaq if table is self.send_ctx and direction == FORWARD else None))
        ctx = table[direction][1]
        ctx.sample_ids = sample_ids
        return ctx

    def _encode(self, direction: str, tensor: torch.Tensor, sample_ids) -> tuple[pb.EncodedTensor, int]:
        gen = self.t.generation(direction)
        codec = self.fw_codec if direction == FORWARD else self.bw_codec
        msg = codec.encode(tensor.detach(), self._ctx(self.send_ctx, direction, gen, sample_ids))
        self.stats.encoded_bytes[direction] += msg.ByteSize()
        self.stats.elements[direction] += tensor.numel()
        self.stats.uncompressed_bytes += tensor.numel() * tensor.element_size()
        return msg, gen

    def _decode(self, item: Inbound, mb: pb.MicroBatch) -> torch.Tensor:
        ctx = self._ctx(self.recv_ctx, item.direction, item.stream, list(mb.sample_ids))
        return codecs.decode(mb.tensor, ctx, self.device).to(self.dtype)

    async def _send(self, direction: str, gen: int, **body) -> None:
        await self.t.send(direction, pb.Envelope(**body), gen)

    def _link_down(self, direction: str, reason: str) -> None:
        if self.stopping or self.shutdown.is_set():
            return
        log.warning("stage %d: %s; the step will be replayed", self.stage, reason)
        if self.first:
            self.abort.set()
        elif direction == FORWARD:  # tell stage 0 through the intact backward chain
            ack = pb.SyncAck(step=self.step, attempt=self.attempt, abort=True, reason=reason)
            asyncio.get_running_loop().create_task(self._send(BACKWARD, self.t.generation(BACKWARD), sync_ack=ack))

    def _reset_step(self, step: int, attempt: int) -> None:
        self.step, self.attempt = step, attempt
        self.pending.clear()
        self.done_backward = 0
        self.partial_sumsq = 0.0
        self.step_losses = []
        self.step_samples = []
        self.model.zero_grad(set_to_none=True)
        if self.amaq is not None:
            self.amaq.zero_grad(set_to_none=True)

    # -- resume -------------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the newest checkpoint of this stage, if any; returns the committed step."""
        if self.store is None:
            return 0
        ckpt = self.store.latest(self.stage, self.num_stages)
        if ckpt is None:
            return 0
        self._load(ckpt)
        return ckpt.step

    def rollback(self, step: int) -> None:
        """Return to the committed state of `step` (a checkpoint of it, or the initial weights)."""
        if step == 0:
            from .model import init_weights

            init_weights(self.model, self.train.seed)
            self.opt = StageOptimizer(self.model.parameters(), self.train)
            if self.amaq is not None:
                with torch.no_grad():
                    self.amaq.gate.zero_()
                self.amaq.step = 0
            self.committed = 0
            self._reset_step(0, self.attempt)
        else:
            ckpt = self.store.find(self.stage, self.num_stages, step) if self.store else None
            if ckpt is None:
                raise PipelineError(f"stage {self.stage} cannot roll back to step {step}: no checkpoint of that step")
            self._load(ckpt)
        self.stats.losses = [entry for entry in self.stats.losses if entry[0] < step]
        self.send_ctx.clear()
        self.recv_ctx.clear()
        log.warning("stage %d rolled back to step %d", self.stage, step)

    def _load(self, ckpt) -> None:
        extra = load_checkpoint(ckpt, self.model, self.opt.opt, self.run_cfg.to_json())
        if self.amaq is not None and "amaq_gate" in extra:
            with torch.no_grad():
                self.amaq.gate.copy_(extra["amaq_gate"].to(self.device))
            self.amaq.step = ckpt.step
        self.committed = ckpt.step
        self._reset_step(ckpt.step, self.attempt)
        log.info("stage %d loaded %s (step %d)", self.stage, ckpt.path, ckpt.step)

    def save(self) -> None:
        if self.store is None or self.committed == 0 or self.committed == self.saved_step:
            return
        self.saved_step = self.committed
        extra = {"amaq_gate": self.amaq.gate} if self.amaq is not None else None
        path = self.store.save(self.stage, self.num_stages, self.committed, self.model, self.opt.opt, self.run_cfg.to_json(), extra)
        log.info("stage %d saved step %d to %s", self.stage, self.committed, path)
        if self.on_saved:
            self.on_saved(str(path), self.committed)

    # -- compute (runs on the compute thread) -------------------------------------------------
    def _forward_first(self, index: int) -> tuple[pb.MicroBatch, int]:
        ids = self.schedule.ids(self.step, index)
        tokens, labels = self.dataset.batch(ids)
        out = self.model(tokens.to(self.device))
        sent = fake_quant(out, self.amaq) if self.amaq is not None else out
        self.pending[index] = Pending(None, sent, ids)
        enc, gen = self._encode(FORWARD, out, ids)
        mb = pb.MicroBatch(step=self.step, index=index, sample_ids=ids, labels=labels.to(torch.int32).numpy().tobytes(),
                           tensor=enc, attempt=self.attempt)
        return mb, gen

    def _forward(self, item: Inbound, mb: pb.MicroBatch):
        if (mb.step, mb.attempt) != (self.step, self.attempt):
            return STALE
        x = self._decode(item, mb).requires_grad_(True)
        out = self.model(x)
        ids = list(mb.sample_ids)
        if self.last:
            labels = torch.from_numpy(np.frombuffer(mb.labels, dtype=np.int32).copy()).long().reshape(x.shape[:2]).to(self.device)
            loss = self.model.loss(out, labels)
            (loss / self.train.micro_batches).backward()
            self.step_losses.append(float(loss.detach()))
            self.step_samples.extend(ids)
            self.done_backward += 1
            extras = {"grad_sumsq": grad_sumsq(self.opt.params)} if self.done_backward == self.train.micro_batches else {}
            enc, gen = self._encode(BACKWARD, x.grad, ids)
            return BACKWARD, pb.MicroBatch(step=mb.step, index=mb.index, sample_ids=ids, tensor=enc, attempt=mb.attempt, extras=extras), gen
        sent = fake_quant(out, self.amaq) if self.amaq is not None else out
        self.pending[mb.index] = Pending(x, sent, ids)
        enc, gen = self._encode(FORWARD, out, ids)
        return FORWARD, pb.MicroBatch(step=mb.step, index=mb.index, sample_ids=ids, labels=mb.labels, tensor=enc, attempt=mb.attempt), gen

    def _backward(self, item: Inbound, mb: pb.MicroBatch):
        if (mb.step, mb.attempt) != (self.step, self.attempt) or mb.index not in self.pending:
            return STALE
        grad = self._decode(item, mb)
        p = self.pending.pop(mb.index)
        p.out.backward(grad)
        self.done_backward += 1
        if "grad_sumsq" in mb.extras:
            self.partial_sumsq = mb.extras["grad_sumsq"]
        if self.first:
            return None
        extras = {}
        if self.done_backward == self.train.micro_batches:
            extras["grad_sumsq"] = self.partial_sumsq + grad_sumsq(self.opt.params)
        enc, gen = self._encode(BACKWARD, p.inp.grad, p.sample_ids)
        return pb.MicroBatch(step=mb.step, index=mb.index, sample_ids=p.sample_ids, tensor=enc, attempt=mb.attempt, extras=extras), gen

    def _apply(self, step: int, total_sumsq: float) -> None:
        """Clip and step (runs on the compute thread, like every change to the step state)."""
        if self.amaq is not None:
            self.amaq.regularization().backward()
            self.amaq_opt.step()
            self.amaq_opt.zero_grad(set_to_none=True)
            self.amaq.step = step + 1
        self.opt.apply(step, total_sumsq)
        self.committed = step + 1
        if self.last:
            entry = (step, sum(self.step_losses) / max(1, len(self.step_losses)), list(self.step_samples))
            self.stats.losses.append(entry)
            self.stats.outbox.append(entry)
        self._reset_step(step + 1, 0)

    # -- commit --------------------------------------------------------------------------------
    async def _commit(self, end: pb.StepEnd) -> None:
        await self.compute(self._apply, end.step, end.grad_sumsq)
        self.last_commit = end
        now = time.perf_counter()
        self.stats.step_times.append(now - self.step_started)
        self.step_started = now
        if not self.last:
            await self._send(FORWARD, self.t.generation(FORWARD), step_end=end)
        if self.committed % self.train.checkpoint_every == 0:
            await self.compute(self.save)
        if self.on_step:
            self.on_step(self)

    # -- the inbox -----------------------------------------------------------------------------
    async def serve(self) -> None:
        """Handle envelopes until a Shutdown went through (or stop() was called)."""
        while not self.shutdown.is_set():
            getter = asyncio.ensure_future(self.t.inbox.get())
            stopper = asyncio.ensure_future(self.shutdown.wait())
            done, _ = await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                break
            stopper.cancel()
            item: Inbound = getter.result()
            if item.envelope is None:
                continue  # a new stream: its codec state starts afresh in _ctx
            await self.handle(item)

    def _current(self, step: int, attempt: int) -> bool:
        """Is a micro-batch of (step, attempt) part of the work now? Only a Sync changes attempts;
        anything else is left over from an aborted attempt (or an earlier incarnation of stage 0)."""
        return step == self.step and attempt == self.attempt

    async def handle(self, item: Inbound) -> None:
        env = item.envelope
        kind = env.WhichOneof("body")
        if kind == "micro_batch":
            mb = env.micro_batch
            if not self._current(mb.step, mb.attempt):
                log.debug("stage %d dropped stale micro-batch %d/%d of step %d", self.stage, mb.index, mb.attempt, mb.step)
                return
            if item.direction == FORWARD:
                result = await self.compute(self._forward, item, mb)
                if result is not STALE:
                    direction, out, gen = result
                    await self._send(direction, gen, micro_batch=out)
            else:
                result = await self.compute(self._backward, item, mb)
                if result is STALE:
                    return
                if result is not None:
                    await self._send(BACKWARD, result[1], micro_batch=result[0])
                elif self.done_backward == self.train.micro_batches:
                    self.backward_done.set()
                if self.first:
                    self.window.release()
        elif kind == "step_end":
            end = env.step_end
            if end.step == self.committed and self.done_backward == self.train.micro_batches and end.step == self.step:
                await self._commit(end)
            elif end.step < self.committed:
                log.debug("stage %d dropped step end %d: already applied (from a sync)", self.stage, end.step)
            else:
                raise PipelineError(f"stage {self.stage}: step end {end.step} arrived with gradients of {self.done_backward} micro-batches of step {self.step}")
        elif kind == "sync":
            await self._on_sync(env.sync)
        elif kind == "sync_ack":
            await self._on_sync_ack(env.sync_ack)
        elif kind == "shutdown":
            if not self.last:
                await self._send(FORWARD, self.t.generation(FORWARD), shutdown=env.shutdown)
            self.stats.finished = True
            self.shutdown.set()

    async def _on_sync(self, sync: pb.Sync) -> None:
        if sync.rollback and self.committed != sync.step:
            await self.compute(self.rollback, sync.step)
        lc = sync.last_commit
        if lc.step + 1 == sync.step and self.committed == lc.step and self.step == lc.step and self.done_backward == self.train.micro_batches:
            log.info("stage %d applies step %d from the sync", self.stage, lc.step)
            await self._commit(lc)
        await self.compute(self._reset_step, sync.step, sync.attempt)
        if self.last:
            ack = pb.SyncAck(step=sync.step, attempt=sync.attempt, min_committed=self.committed, max_committed=self.committed)
            await self._send(BACKWARD, self.t.generation(BACKWARD), sync_ack=ack)
        else:
            await self._send(FORWARD, self.t.generation(FORWARD), sync=sync)

    async def _on_sync_ack(self, ack: pb.SyncAck) -> None:
        if not ack.abort:
            ack.min_committed = min(ack.min_committed, self.committed)
            ack.max_committed = max(ack.max_committed, self.committed)
        if self.first:
            if ack.abort:
                self.abort.set()
            elif self.sync_reply is not None and not self.sync_reply.done() and (ack.step, ack.attempt) == (self.step, self.attempt):
                self.sync_reply.set_result(ack)
        else:
            await self._send(BACKWARD, self.t.generation(BACKWARD), sync_ack=ack)

    # -- stage 0 drives the steps --------------------------------------------------------------
    async def _sync(self, attempt: int) -> None:
        """Restart step self.committed as `attempt` once every stage answers; repeat until they do.
        Stages that answer with different committed steps are all rolled back to the smallest."""
        rollback = False
        while True:
            self.abort.clear()
            await self.compute(self._reset_step, self.committed, attempt)
            self.window = asyncio.Semaphore(self.num_stages if self.train.schedule == "1f1b" else self.train.micro_batches)
            if self.num_stages == 1:
                return
            self.sync_reply = asyncio.get_running_loop().create_future()
            sync = pb.Sync(step=self.step, attempt=attempt, last_commit=self.last_commit, rollback=rollback)
            await self._send(FORWARD, self.t.generation(FORWARD), sync=sync)
            try:
                ack = await asyncio.wait_for(asyncio.shield(self.sync_reply), timeout=5.0)
            except asyncio.TimeoutError:
                log.info("waiting for every stage to answer (step %d, attempt %d)", self.step, attempt)
                attempt += 1
                continue
            low = min(ack.min_committed, self.committed)
            if ack.max_committed == low and self.committed == low:
                return
            # a stage came back from an older checkpoint (e.g. a standby took it over): every stage
            # returns to that step and the steps after it are trained again
            log.warning("stages are at steps %d..%d: rolling every stage back to step %d", low, max(ack.max_committed, self.committed), low)
            if self.committed != low:
                await self.compute(self.rollback, low)
            rollback = True
            attempt += 1

    async def _run_step(self) -> bool:
        """Send every micro-batch of the step, wait for its gradients. False if aborted."""
        self.backward_done.clear()
        for index in range(self.train.micro_batches):
            acquire = asyncio.ensure_future(self.window.acquire())
            aborted = asyncio.ensure_future(self.abort.wait())
            done, _ = await asyncio.wait({acquire, aborted}, return_when=asyncio.FIRST_COMPLETED)
            aborted.cancel()
            if acquire not in done:
                acquire.cancel()
                return False
            mb, gen = await self.compute(self._forward_first, index)
            await self._send(FORWARD, gen, micro_batch=mb)
        waiter = asyncio.ensure_future(self.backward_done.wait())
        aborted = asyncio.ensure_future(self.abort.wait())
        done, _ = await asyncio.wait({waiter, aborted}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        aborted.cancel()
        return waiter in done and not self.abort.is_set()

    async def drive(self, steps: int) -> None:
        # a fresh attempt number per incarnation of stage 0: leftovers of a previous one never match
        attempt = random.randrange(1, 1 << 30)
        await self._sync(attempt)
        while self.committed < steps and not self.stopping:
            if self.num_stages == 1:
                raise PipelineError("a single-stage swarm: use tahnode.local_train instead")
            if not await self._run_step():
                if self.stopping:
                    break
                self.stats.replays += 1
                attempt = self.attempt + 1
                log.warning("stage 0 replays step %d (attempt %d)", self.committed, attempt)
                await self._sync(attempt)
                continue
            total = self.partial_sumsq + await self.compute(grad_sumsq, self.opt.params)
            await self._commit(pb.StepEnd(step=self.step, attempt=self.attempt, grad_sumsq=total))
        if not self.stopping:
            await self._send(FORWARD, self.t.generation(FORWARD), shutdown=pb.Shutdown(step=self.committed))
            self.stats.finished = True
            self.shutdown.set()

    async def run(self, steps: int) -> None:
        if self.first:
            await asyncio.gather(self.serve(), self.drive(steps))
        else:
            await self.serve()

    async def stop(self, drain_s: float = 5.0) -> None:
        """Graceful stop (SIGTERM): wait briefly for a pending step end, save the committed state."""
        self.stopping = True
        deadline = time.monotonic() + drain_s
        while (not self.first and self.done_backward == self.train.micro_batches and self.committed == self.step
               and time.monotonic() < deadline and not self.shutdown.is_set()):
            await asyncio.sleep(0.05)
        self.shutdown.set()
        await self.t.flush(2.0)
        await self.compute(self.save)
