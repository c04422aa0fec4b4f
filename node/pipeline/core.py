"""What a stage's worker and its helpers (inbox, step driver, resync, outer sync) share: the stage's
parts (model, optimizer, codec streams, step state, stats, transport, compute thread) and what is done
with those parts alone. The helpers take this and the worker's few operations they call, never the
worker: the stage is one object again, with its parts named in one place."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Callable

import torch

from ..config import RunConfig
from ..net.body import Body, PendingBody
from ..net.transport import BACKWARD, Direction, Inbound, Transport
from ..proto import tahnode_pb2 as pb
from ..train.model import COMPUTE_DTYPES, StageModel, build_stage
from ..train.optim import StageOptimizer
from .admission import Admission
from .checkpoint import CheckpointStore, StageSaver
from .checkpoint_meta import kept_unreported
from .schedule import Split
from .state import Stats, StepState, Stopping, StopRequest
from .streams import CodecStreams

log = logging.getLogger("tahnode.pipeline")

__all__ = ["StageCore", "PEER_WAIT_S", "initial_model"]

PEER_WAIT_S = 10.0  # how long a micro-batch waits for its link's peer to be named (a few heartbeats)
TELL_WAIT_S = 120.0  # how long a replay request waits for a backward peer (stage 0's stall watchdog: 300 s)


def initial_model(run: RunConfig, stage: int, init_from: str = "") -> StageModel:
    """Stage `stage` of the run's model as every holder of it initializes it (its seed, its compute dtype),
    on the CPU; with `init_from`, its tensors then loaded from that Hugging Face checkpoint folder."""
    model = build_stage(run.model, stage, run.stages, seed=run.train.seed, dtype=COMPUTE_DTYPES[run.train.dtype])
    if init_from:
        from ..train.hf import load_stage_from_hf

        load_stage_from_hf(model, init_from)
    return model


class StageCore:
    """Stage `stage` of `run` in pipeline `pipeline`: its parts, its facts, and the operations that
    touch nothing else. `abort_step` is what asks stage 0's driver to replay the step in flight."""

    def __init__(self, run: RunConfig, stage: int, transport: Transport, device: str = "cpu",
                 store: CheckpointStore | None = None, model: StageModel | None = None,
                 on_saved: Callable[[str, int], None] | None = None, pipeline: int = 0):
        self.run_cfg, self.stage, self.pipeline = run, stage, pipeline
        self.t = transport
        self.model = (model or initial_model(run, stage)).to(device)
        self.opt = StageOptimizer(self.model.parameters(), self.train)
        self.stats = Stats(tokens_per_step=self.train.micro_batches * self.train.batch_size * self.train.seq_len)
        self.codecs = CodecStreams(run, stage, transport, self.device, self.stats)
        self.admission = Admission(run)
        self.saver = StageSaver(store, stage, run, on_saved)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage}-compute")
        split = Split.of(self.train, run.stages)
        self.state = StepState(micro_batches=split.micro_batches, samples_per_step=split.samples)
        self.ending = Stopping()
        self.abort_step: Callable[[bool], None] | None = None  # stage 0: its driver's (diverged or not)

    # -- what the stage is ----------------------------------------------------------------------
    @property
    def train(self):
        return self.run_cfg.train

    @property
    def num_stages(self) -> int:
        return self.run_cfg.stages

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.run_cfg.stages - 1

    @property
    def computes_loss(self) -> bool:
        """The stage with the head: the last, or stage 0 in a ring (RunConfig.ring)."""
        return self.stage == self.run_cfg.loss_stage

    @property
    def dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.train.dtype]

    @property
    def stopping(self) -> bool:
        return self.ending.request is not None

    @property
    def stop_request(self) -> StopRequest | None:
        return self.ending.request

    @property
    def shutdown(self) -> asyncio.Event:
        """Set once the stage's run is over (finished, or stopped)."""
        return self.ending.done

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def committed(self) -> int:
        return self.state.committed

    # -- what is done with the parts ------------------------------------------------------------
    async def compute(self, fn, *args):
        """Run `fn` on the compute thread (every change to the step state happens there)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def send(self, direction: Direction, gen: int | None = None,
                   envelope: pb.Envelope | Body | PendingBody | None = None, **body) -> bool:
        """Send `envelope` (or an envelope's body), or an envelope with `body`; with the link's
        current generation unless `gen` is given. False if the link dropped it (tahnode.net.transport)."""
        return await self.t.send(direction, envelope if envelope is not None else pb.Envelope(**body),
                                 self.t.generation(direction) if gen is None else gen)

    async def send_micro_batch(self, direction: Direction, gen: int, envelope: Body | PendingBody, index: int) -> None:
        """Send micro-batch `index` onward. A link that points at no peer yet (an assignment a heartbeat
        behind the step's Sync, which never crosses the ring's last hop back to stage 0) is waited for
        up to PEER_WAIT_S; then the step is replayed rather than the micro-batch dropped unseen."""
        if not await self.t.wait_for_peer(direction, PEER_WAIT_S):
            self.replay_step(f"no {direction} peer to send micro-batch {index} of step {self.state.step} to", tell=True)
            return
        await self.send(direction, gen, envelope=envelope)

    def offence(self, item: Inbound, exc: Exception) -> None:
        """A received envelope that is not the sender's to send (or not this direction's): counted
        against its sender and dropped; the run goes on without it."""
        self.stats.refused_from(item.sender)
        log.warning("stage %d dropped an envelope from %s: %s", self.stage, item.sender or "?", exc)

    def replay_step(self, reason: str, tell: bool, diverged: bool = False) -> None:
        """Have stage 0 replay the step in flight; a later stage tells it (if `tell`) through the
        backward chain, and whether the step diverged here (DivergedStep)."""
        if self.first:
            self.abort_step(diverged)
        elif tell:
            ack = pb.SyncAck(step=self.state.step, attempt=self.state.attempt, abort=True, reason=reason,
                             diverged=diverged)
            self.tell_first(ack)

    def tell_first(self, ack: pb.SyncAck, relayed: bool = False) -> None:
        """Send a replay request (an abort SyncAck) on towards stage 0, in the background; this stage's
        own (not `relayed`) only while the step it names is still the one in flight here."""
        asyncio.get_running_loop().create_task(self._deliver_abort(ack, relayed))

    async def _deliver_abort(self, ack: pb.SyncAck, relayed: bool) -> None:
        """A backward link that names no peer yet (a neighbour being replaced), or whose stream failed
        under the request, is waited for and the request sent again: a lost request would leave stage 0
        waiting for its stall watchdog."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TELL_WAIT_S
        while not self.shutdown.is_set() and (relayed or self.in_flight(ack.step, ack.attempt)):
            left = deadline - loop.time()
            if left <= 0:
                log.warning("stage %d gave up telling stage 0 to replay step %d: no backward peer for %.0f s",
                            self.stage, ack.step, TELL_WAIT_S)
                return
            if await self.t.wait_for_peer(BACKWARD, min(left, PEER_WAIT_S)):
                if await self.send(BACKWARD, sync_ack=ack):
                    return
                await asyncio.sleep(0.1)  # the link's generation moved on under the request: again, on the new one

    def in_flight(self, step: int, attempt: int) -> bool:
        return (self.state.step, self.state.attempt) == (step, attempt)

    def restart_step(self, step: int, attempt: int) -> None:
        """Drop the partial work of the current step and compute (step, attempt) from its start."""
        self.state.restart(step, attempt)
        self.model.zero_grad(set_to_none=True)
        self.codecs.zero_grad()

    def resumed_at(self, step: int) -> None:
        self.state.committed = step
        self.opt.at_most(step)
        self.restart_step(step, self.state.attempt)

    def resume(self) -> int:
        """Load the newest checkpoint of this stage, if any; returns the committed step."""
        loaded = self.saver.load_latest(self.model, self.opt.opt, self.codecs)
        if loaded:
            self.resumed_at(loaded)
            self.stats.outbox = list(self.saver.unreported)  # killed before it reported them
        return loaded

    def save(self) -> None:
        unreported = [[r.step, r.loss, list(r.sample_ids), r.seconds]
                      for r in kept_unreported(self.stats.outbox, self.committed)]
        self.saver.save(self.committed, self.model, self.opt.opt, self.codecs, unreported)

    def finish(self) -> None:
        """The run is over for this stage."""
        self.stats.finished = True
        self.shutdown.set()

    def drained(self) -> bool:
        """Stopping, and the step awaited by stop() is committed (or none was awaited)."""
        r = self.stop_request
        return r is not None and (r.drain_step is None or self.state.committed > r.drain_step)
