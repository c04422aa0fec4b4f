"""The codecs of one stage's two directions with their per-stream state: encode what the stage
sends, decode what it receives. A new stream (the link reconnected) starts its state afresh."""

from __future__ import annotations

import math
import time

import torch

from .. import codecs
from ..codecs import CodecContext, CodecState, PendingPayload
from ..config import RunConfig
from ..net.transport import BACKWARD, FORWARD, Direction, Transport
from ..proto import tahnode_pb2 as pb
from .state import Stats

__all__ = ["CodecStreams", "prescale_exponent"]


PRESCALE_TOP = 8     # a prescaled tensor's largest magnitude lands in [2^7, 2^8): far from fp16's both ends
PRESCALE_LIMIT = 100  # |k| at most this: 2^k stays a normal float32
OUTPUT_TOP = 14       # a forward output with a magnitude of 2^14 or more is moved down: fp16 (max 65504) is near


def prescale_exponent(tensor: torch.Tensor) -> int:
    """k such that max|tensor| * 2^k lies in [2^(PRESCALE_TOP-1), 2^PRESCALE_TOP); 0 for an all-zero
    or non-finite tensor (the codec refuses the latter itself)."""
    top = float(tensor.detach().abs().max()) if tensor.numel() else 0.0
    if top == 0.0 or not math.isfinite(top):
        return 0
    return max(-PRESCALE_LIMIT, min(PRESCALE_LIMIT, PRESCALE_TOP - math.frexp(top)[1]))


class CodecStreams:
    """Codec, sender state and stream contexts of both directions of stage `stage`."""

    def __init__(self, run: RunConfig, stage: int, transport: Transport, device: torch.device, stats: Stats):
        c = run.codec
        self.codecs = {FORWARD: codecs.get_codec(c.forward, **c.forward_codec_params),
                       BACKWARD: codecs.get_codec(c.backward, **c.backward_params)}
        # the precision schedule's other forward codec (the same codec, other parameters), if any
        self.high = codecs.get_codec(c.forward, **{**c.forward_codec_params, **c.high_params}) if c.scheduled else None
        self.run_cfg = run
        sends = {FORWARD: run.neighbour(stage, 1) is not None, BACKWARD: run.neighbour(stage, -1) is not None}
        self.states: dict[Direction, CodecState] = {
            d: self.codecs[d].sender_state(run.model.dim, device) if sends[d] else CodecState()
            for d in (FORWARD, BACKWARD)}
        self.t, self.device, self.stats = transport, device, stats
        self.overlap = run.train.host_copy == "overlap"  # encode(out=...) hands back a PendingPayload
        self.sending: dict[Direction, tuple[int, CodecContext]] = {}
        self.receiving: dict[Direction, tuple[int, CodecContext]] = {}

    def _context(self, table: dict, direction: Direction, number: int, fresh) -> CodecContext:
        if direction not in table or table[direction][0] != number:
            table[direction] = (number, fresh())
        return table[direction][1]

    def codec_for(self, direction: Direction, step: int):
        """The codec that encodes `direction` at optimizer step `step` (codec.forward_high_*)."""
        if (direction is FORWARD and self.high is not None
                and self.run_cfg.codec.high_phase(step, self.run_cfg.train.steps)):
            return self.high
        return self.codecs[direction]

    def encode(self, direction: Direction, tensor: torch.Tensor, sample_ids, step: int = 0,
               out: pb.EncodedTensor | None = None) -> tuple[pb.EncodedTensor | memoryview | PendingPayload, int]:
        """The encoded tensor and the link generation whose stream state encoded it. With `out`, the
        message is written there but for its payload, which comes back instead: a view of its bytes
        on the host, which the transport sends as they are (tahnode.net.body); with train.host_copy
        "overlap", a PendingPayload (its copy to the host and its checksum not waited for)."""
        gen = self.t.generation(direction)
        ctx = self._context(self.sending, direction, gen, self.states[direction].new_context)
        ctx.sample_ids = sample_ids
        started = self._clock()
        codec = self.codec_for(direction, step)
        if out is None:
            result = msg = codec.encode(tensor.detach(), ctx)  # ends with the payload's bytes on the host
            size = msg.ByteSize()
        else:
            pending = codec.encode_apart(tensor.detach(), out, ctx, overlap=self.overlap)
            size = pending.wire_bytes  # the whole message's, its checksum included
            result = pending if self.overlap else pending.finish()
        self.stats.codec_seconds += self._clock() - started
        self.stats.counted(direction, size, tensor)
        return result, gen

    def encode_output(self, tensor: torch.Tensor, sample_ids, step: int, out: pb.EncodedTensor | None = None
                      ) -> tuple[pb.EncodedTensor | memoryview | PendingPayload, int, int]:
        """A forward output to send: encoded, its generation, and the power of two it was multiplied
        by first: 0 unless its largest magnitude reaches 2^OUTPUT_TOP, where fp16 zero-points and
        scales near their overflow; such an output is moved down exactly, so that any finite output
        encodes. Before, inputs a neighbour sent within the admitted range could make a stage's own
        output overflow its encode, and the step was replayed for ever, nobody blamed (issue 39, low).
        A codec with per-stream state (AQ-SGD's cache of what it sent) encodes as it is."""
        top = float(tensor.detach().abs().max()) if tensor.numel() else 0.0
        movable = not self.codec_for(FORWARD, step).keeps_stream_state and math.isfinite(top)
        k = prescale_exponent(tensor) if movable and top >= 2.0 ** OUTPUT_TOP else 0
        msg, gen = self.encode(FORWARD, tensor * 2.0 ** k if k else tensor, sample_ids, step, out=out)
        return msg, gen, k

    def encode_gradient(self, tensor: torch.Tensor, sample_ids,
                        out: pb.EncodedTensor | None = None) -> tuple[pb.EncodedTensor | memoryview, int, int]:
        """A gradient to send backward: encoded, its generation, and the power of two it was
        multiplied by first. Gradients shrink as training goes on, down to where a codec's fp16
        zero-points and scales underflow (`needs_prescale`); a power of two moves them up exactly."""
        k = prescale_exponent(tensor) if self.codecs[BACKWARD].needs_prescale else 0
        msg, gen = self.encode(BACKWARD, tensor * 2.0 ** k if k else tensor, sample_ids, out=out)
        return msg, gen, k

    def decode(self, direction: Direction, stream: int, mb: pb.MicroBatch, dtype: torch.dtype,
               payload=None) -> torch.Tensor:
        """The received tensor, decoded by the run's codec of that direction, with the parameters the
        run sends (a message of another codec or of other parameters is refused: its codec's state,
        e.g. AQ-SGD's cache, is not the peer's to grow, nor its decoder's memory the peer's to size).
        `payload`: the tensor's payload where it travelled apart (tahnode.net.body)."""
        # zlib's CRC-32 (older senders) costs a receiver 5x the CPU: not the sender's pick
        if mb.tensor.checksum != pb.CRC32C:
            raise codecs.CodecError(f"{direction} message checked with CRC-32; this swarm's messages carry CRC-32C")
        own = [self.codecs[direction]] + ([self.high] if direction is FORWARD and self.high is not None else [])
        if not any(codec.sent(mb.tensor) for codec in own):
            sent = ", ".join(f"{k}={v:g}" for k, v in sorted(mb.tensor.params.items())[:8])
            raise codecs.CodecError(f"{direction} message encoded with {mb.tensor.codec!r} version {mb.tensor.version} "
                                    f"({sent}); this run sends {own[0].wire_name!r} version {own[0].version} "
                                    f"({', '.join(f'{k}={v:g}' for k, v in own[0].header_params().items())})")
        ctx = self._context(self.receiving, direction, stream, CodecContext)
        ctx.sample_ids = list(mb.sample_ids)
        if self.codecs[direction].keeps_stream_state:
            self._bound_cache(ctx, mb.step)
        started = self._clock()
        x = codecs.decode(mb.tensor, ctx, self.device, payload)
        x = (x * 2.0 ** -mb.scale_log2 if mb.scale_log2 else x).to(dtype)
        self.stats.codec_seconds += self._clock() - started
        return x

    def _bound_cache(self, ctx: CodecContext, step: int) -> None:
        """A stream's per-sample cache (AQ-SGD's) holds at most the samples its sender can have sent
        by `step` (the step's samples, and as many for each step before, up to a whole run's):
        made-up sample ids would grow it without bound, and stale ones would stay there for good
        (issue 39, low). A message that would grow it further is refused, not cached."""
        t = self.run_cfg.train
        most = min(step + 1, t.steps) * t.batch_size * t.micro_batches
        new = len(set(ctx.sample_ids) - ctx.aqsgd_cache.rows.keys())
        if len(ctx.aqsgd_cache) + new > most:
            raise codecs.CodecError(f"a message of step {step} with {new} new sample ids would cache "
                                    f"{len(ctx.aqsgd_cache) + new} samples on this stream; its sender can have "
                                    f"sent {most}")

    def _clock(self) -> float:
        """time.perf_counter() once the compute stream's queued work is done: on a GPU, codec_seconds
        counts the codec's kernels and copies, not the compute queued before them (nor a payload's
        copy on the side stream, train.host_copy "overlap": it runs beside the next compute)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    def discard(self, direction: Direction, stream: int, mb: pb.MicroBatch, payload=None) -> None:
        """A received message the pipeline drops: a codec with per-stream state still decodes it,
        so that its state stays in step with the sender's."""
        if self.codecs[direction].keeps_stream_state:
            self.decode(direction, stream, mb, torch.float32, payload)

    def sent(self, out: torch.Tensor) -> torch.Tensor:
        """The tensor the backward pass flows through in place of the forward output `out`."""
        return self.states[FORWARD].straight_through(out)

    def cache_bytes(self) -> int:
        """Memory held by the forward streams' codec state (AQ-SGD's caches)."""
        return sum(entry[1].cache_bytes for entry in (self.sending.get(FORWARD), self.receiving.get(FORWARD)) if entry)

    def drop_streams(self) -> None:
        """Forget every stream's state (after a rollback both ends start afresh)."""
        self.sending.clear()
        self.receiving.clear()

    # the sender states' hooks, for both directions
    def zero_grad(self) -> None:
        for state in self.states.values():
            state.zero_grad()

    def apply_step(self, step: int) -> None:
        for state in self.states.values():
            state.apply_step(step)

    def restart(self) -> None:
        for state in self.states.values():
            state.restart()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for state in self.states.values() for k, v in state.tensors().items()}

    def load(self, tensors: dict[str, torch.Tensor], step: int) -> None:
        for state in self.states.values():
            state.load(tensors, step)
