"""The pipeline's training math in one process: every stage's model and optimizer, and at every stage
boundary exactly the codec work of the stages' CodecStreams (encode, prescale, decode, stream state).

It gives the in-process pipeline's losses where the codecs give the same bytes (a test holds it to
that) in a fraction of the time, so `tahnode bench convergence` can train many codec pairs and seeds."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..codecs.base import copy_into, receive_buffer
from ..codecs.host import PendingPayload
from ..config import RunConfig
from ..net.transport import BACKWARD, FORWARD, Direction
from ..proto import tahnode_pb2 as pb
from ..train.data import SampleSchedule, TokenDataset
from ..train.model import COMPUTE_DTYPES, StageModel
from ..train.optim import StageOptimizer, grad_sumsq
from .core import initial_model
from .schedule import Split
from .state import Pending, Stats
from .streams import CodecStreams

__all__ = ["PipelineReplica", "CrossingErrors"]


class _OneStream:
    """What CodecStreams asks of a transport: the link's generation, which never changes here."""

    @staticmethod
    def generation(direction: Direction) -> int:
        return 0


@dataclass
class CrossingErrors:
    """Relative error ‖decoded − sent‖ / ‖sent‖ of every boundary crossing, summed per direction."""

    sums: dict = field(default_factory=lambda: {FORWARD: 0.0, BACKWARD: 0.0})
    counts: dict = field(default_factory=lambda: {FORWARD: 0, BACKWARD: 0})

    def add(self, direction: Direction, sent: torch.Tensor, received: torch.Tensor) -> None:
        sent = sent.detach().float()
        norm = float(sent.norm())
        if norm > 0:
            self.sums[direction] += float((received.detach().float() - sent).norm()) / norm
            self.counts[direction] += 1

    def mean(self, direction: Direction) -> float:
        return self.sums[direction] / self.counts[direction] if self.counts[direction] else 0.0


class PipelineReplica:
    """Stages 0..S-1 of `run` in this process, trained step by step as the pipeline trains them.

    The step is cut into `run.train.pipeline_micro_batches` micro-batches (else the pipeline's first
    cut, Split.of); each goes forward through every stage and straight back, in index order, which
    is the order in which a stage of the pipeline handles them. `train_samples` (default: all of the
    dataset) limits the sample schedule to the first ids, leaving the rest unseen for evaluation;
    `pipeline` is the pipeline whose samples it trains (of the run's swarm.data_slots)."""

    def __init__(self, run: RunConfig, dataset: TokenDataset, device: str = "cpu", init_from: str = "",
                 train_samples: int | None = None, pipeline: int = 0):
        t = run.train
        self.run, self.dataset, self.device = run, dataset, torch.device(device)
        self.dtype = COMPUTE_DTYPES[t.dtype]
        self.models: list[StageModel] = []
        for k in range(run.stages):
            self.models.append(initial_model(run, k, init_from).to(self.device))
        self.opts = [StageOptimizer(m.parameters(), t) for m in self.models]
        self.stats = Stats()  # every stage's sends counted together
        self.streams = [CodecStreams(run, k, _OneStream(), self.device, self.stats) for k in range(run.stages)]
        self.split = Split.of(t, run.stages)
        self.pipeline = pipeline
        self.schedule = SampleSchedule.for_run(run, train_samples or len(dataset))
        self.errors = CrossingErrors()

    # -- one boundary ---------------------------------------------------------------------------
    def _received(self, payload: memoryview | PendingPayload):
        """A sent payload as the receiving stage holds it: copied once into its receive buffer
        (page-locked on a GPU), the message's header apart, as stages send them (Worker._message;
        a pending one finished first, as the link does)."""
        data = payload.finish() if isinstance(payload, PendingPayload) else payload
        return copy_into(data, receive_buffer(self.device))

    def _cross_forward(self, sender: int, out: torch.Tensor, ids: list[int], step: int) -> torch.Tensor:
        """`out` of stage `sender` as the next stage decodes it, ready for its backward pass."""
        receiver = (sender + 1) % self.run.stages
        mb = pb.MicroBatch(sample_ids=ids, step=step)
        payload, _, mb.scale_log2 = self.streams[sender].encode_output(out, ids, step, out=mb.tensor)
        x = self.streams[receiver].decode(FORWARD, 0, mb, self.dtype, self._received(payload))
        self.errors.add(FORWARD, out, x)
        return x.requires_grad_(True)

    def _cross_backward(self, sender: int, grad: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """The gradient `grad` of stage `sender`'s input as the previous stage decodes it."""
        receiver = (sender - 1) % self.run.stages
        mb = pb.MicroBatch(sample_ids=ids)
        payload, _, mb.scale_log2 = self.streams[sender].encode_gradient(grad, ids, out=mb.tensor)
        g = self.streams[receiver].decode(BACKWARD, 0, mb, self.dtype, self._received(payload))
        self.errors.add(BACKWARD, grad, g)
        return g

    # -- one micro-batch ------------------------------------------------------------------------
    def _micro_batch(self, step: int, index: int) -> tuple[float, int]:
        """Forward through every stage, the loss, backward through every stage: (loss, samples)."""
        s, ring = self.run.stages, self.run.ring
        ids = self.schedule.ids_at(step, index * self.split.batch_size, self.split.batch_size, self.pipeline)
        tokens, labels = self.dataset.batch(ids)
        pending: list[Pending] = []
        x: torch.Tensor = tokens.to(self.device)
        for k in range(s):
            if k > 0:
                x = self._cross_forward(k - 1, out, ids, step)
            out = self.models[k](x)
            if k == s - 1 and not ring:
                logits, inp = out, x
                break
            pending.append(Pending(x if k else None, self.streams[k].sent(out), ids))
        else:  # a ring: the last stage's hidden states go back to stage 0's head
            inp = self._cross_forward(s - 1, out, ids, step)
            logits = self.models[0].head(inp)
        loss = StageModel.loss(logits, labels.to(self.device))
        (loss * (len(ids) / self.split.samples)).backward()
        grad, sender = inp.grad, (0 if ring else s - 1)
        for k in reversed(range(len(pending))):
            g = self._cross_backward(sender, grad, ids)
            pending[k].out.backward(g)
            if k:
                grad, sender = pending[k].inp.grad, k
        return float(loss.detach()), len(ids)

    def train_step(self, step: int) -> float:
        """Train optimizer step `step`; its mean loss over the step's tokens."""
        for streams in self.streams:
            streams.zero_grad()
        loss_sum, samples = 0.0, 0
        for index in range(self.split.micro_batches):
            loss, n = self._micro_batch(step, index)
            loss_sum += loss * n
            samples += n
        total = 0.0  # the global norm, summed from the last stage back as the StepEnd carries it
        for opt in reversed(self.opts):
            total = total + grad_sumsq(opt.params)
        for streams, opt in zip(self.streams, self.opts):
            streams.apply_step(step)
            opt.apply(step, total)
        return loss_sum / samples

    @torch.no_grad()
    def evaluate(self, sample_ids: list[int], batch_size: int) -> float:
        """Mean loss of the model (uncompressed, every stage in turn) over the samples, per token."""
        total, count = 0.0, 0
        for start in range(0, len(sample_ids), batch_size):
            ids = sample_ids[start:start + batch_size]
            tokens, labels = self.dataset.batch(ids)
            x = tokens.to(self.device)
            for model in self.models:
                x = model(x)
            logits = self.models[0].head(x) if self.run.ring else x
            total += float(StageModel.loss(logits, labels.to(self.device))) * len(ids)
            count += len(ids)
        return total / count
