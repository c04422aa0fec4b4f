"""What a stage accepts of what a neighbour sends: the envelope from the neighbour of its direction;
as many sample ids as a micro-batch may have, the tensor shape its model expects, finite values no
larger than the run allows, labels of the right length inside the vocabulary, a sane gradient scale,
a gradient norm that is a number. Anything else is refused with BadMicroBatch (the step is replayed)."""

from __future__ import annotations

import math

import numpy as np
import torch

from ..config import RunConfig
from ..net.transport import BACKWARD, FORWARD, EnvelopeKind, Inbound, Transport
from ..proto import tahnode_pb2 as pb

__all__ = ["BadMicroBatch", "Admission", "MAX_SCALE_LOG2", "MAX_GRAD_SUMSQ", "envelope_cap"]

MAX_SCALE_LOG2 = 126  # gradient prescales stay far inside float32's exponent range
MAX_GRAD_SUMSQ = 1e16  # a gradient norm of 1e8: no training that still learns comes near it
IGNORED = -100        # a label without a loss (the torch convention, tahnode.train.model)


def envelope_cap(run: RunConfig, margin: float = 1.25) -> int:
    """The largest envelope a peer of `run` sends, with a margin: a whole step as one micro-batch of
    float32 activations with codec none (no codec is larger), its labels and sample ids, plus 1 MiB
    for headers. Incoming envelopes above it are refused before they are held in memory."""
    t = run.train
    samples = t.micro_batches * t.batch_size
    tensor = samples * t.seq_len * run.model.dim * 4
    return int(margin * (tensor + samples * t.seq_len * 4 + samples * 10)) + (1 << 20)


class BadMicroBatch(ValueError):
    """A received micro-batch this stage refuses; the message says what was wrong with it."""


class Admission:
    """The checks of one stage of `run` (tensors of width `run.model.dim`, `seq_len` tokens)."""

    def __init__(self, run: RunConfig):
        t = run.train
        self.seq_len, self.dim, self.vocab = t.seq_len, run.model.dim, run.model.vocab_size
        self.max_samples = t.micro_batches * t.batch_size  # a micro-batch is at most the whole step
        self.max_abs = t.max_abs_value

    @staticmethod
    def envelope(item: Inbound, kind: EnvelopeKind, transport: Transport) -> None:
        """An envelope must be of a kind its direction carries, from the neighbour on that side:
        activations, step ends, syncs and the shutdown from the previous stage, gradients and sync
        acks from the next (a node that is not that neighbour cannot speak for it)."""
        if not kind.travels(item.direction):
            raise BadMicroBatch(f"a {kind.value} never travels {item.direction}")
        expected = transport.peer(BACKWARD if item.direction is FORWARD else FORWARD)
        if expected and item.sender and item.sender != expected:
            raise BadMicroBatch(f"a {item.direction} {kind.value} from {item.sender}, who is not the neighbour "
                                f"on that side ({expected})")

    def grad_sumsq(self, value: float, at_least: float = 0.0) -> float:
        """A gradient norm squared from a neighbour: a finite number in [at_least, MAX_GRAD_SUMSQ]
        (at_least: what this stage itself added to it on the way back)."""
        if not (math.isfinite(value) and at_least <= value <= MAX_GRAD_SUMSQ):
            raise BadMicroBatch(f"gradient norm squared {value!r} is not a finite number in "
                                f"[{at_least:g}, {MAX_GRAD_SUMSQ:g}]")
        return value

    def header(self, mb: pb.MicroBatch) -> None:
        """Before decoding: the sample ids and the gradient scale."""
        if not 1 <= len(mb.sample_ids) <= self.max_samples:
            raise BadMicroBatch(f"{len(mb.sample_ids)} sample ids (a micro-batch has 1..{self.max_samples})")
        if abs(mb.scale_log2) > MAX_SCALE_LOG2:
            raise BadMicroBatch(f"gradient scale 2^{mb.scale_log2} is out of range")
        if mb.count and not mb.index < mb.count:
            raise BadMicroBatch(f"micro-batch index {mb.index} of {mb.count}")

    def activation_shape(self, mb: pb.MicroBatch) -> tuple[int, int, int]:
        return len(mb.sample_ids), self.seq_len, self.dim

    @staticmethod
    def encoded_shape(mb: pb.MicroBatch, shape: tuple[int, ...]) -> None:
        """Before decoding: the message describes the tensor this stage expects (a decoder allocates
        by the shape it is told, up to 28 times a payload of 1-bit codes)."""
        if tuple(mb.tensor.shape) != tuple(shape):
            raise BadMicroBatch(f"a tensor of shape {list(mb.tensor.shape)}, {list(shape)} expected")

    def activations(self, mb: pb.MicroBatch, x: torch.Tensor) -> None:
        """A decoded forward input: (samples, seq_len, dim), finite."""
        self._tensor(x, self.activation_shape(mb), "activations")

    def gradient(self, grad: torch.Tensor, out: torch.Tensor) -> None:
        """A decoded gradient of this stage's output `out`: its shape, finite."""
        self._tensor(grad, tuple(out.shape), "gradient")

    def labels(self, mb: pb.MicroBatch) -> np.ndarray:
        """The int32 labels of a forward message to the last stage, shape (samples, seq_len)."""
        n = len(mb.sample_ids) * self.seq_len
        if len(mb.labels) != 4 * n:
            raise BadMicroBatch(f"{len(mb.labels)} bytes of labels, {4 * n} expected")
        labels = np.frombuffer(mb.labels, dtype=np.int32).reshape(len(mb.sample_ids), self.seq_len)
        outside = (labels != IGNORED) & ((labels < 0) | (labels >= self.vocab))
        if outside.any():
            raise BadMicroBatch(f"labels outside the vocabulary of {self.vocab}")
        return labels

    def _tensor(self, x: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
        if tuple(x.shape) != shape:
            raise BadMicroBatch(f"{what} of shape {tuple(x.shape)}, {shape} expected")
        largest = float(x.detach().abs().amax()) if x.numel() else 0.0
        if not math.isfinite(largest):
            raise BadMicroBatch(f"{what} with non-finite values")
        if largest > self.max_abs:
            raise BadMicroBatch(f"{what} with a value of magnitude {largest:.3g}, beyond the run's bound "
                                f"(train.max_abs_value {self.max_abs:g})")
