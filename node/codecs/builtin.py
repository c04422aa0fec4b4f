"""The eight codecs of tahnode, registered by name: none, naive, pertoken, group, tahquant, tahquant-paper,
aqsgd, amaq. Each validates its header and calls its specification in tahnode.kernels (or a Triton kernel)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import amaq_ref, aqsgd_ref, group_ref, naive_ref, pertoken_ref, tahquant_ref, tahquant_rice_ref
from ..kernels import dispatch
from ..kernels.quant_ref import check_finite
from ..kernels.wire import CodecError, from_bytes
from .base import Codec, register
from .state import AmaqSenderState, CodecContext

__all__ = ["NoneCodec", "NaiveCodec", "PerTokenCodec", "GroupCodec", "TahQuantCodec", "TahQuantPaperCodec",
           "AqsgdCodec", "AmaqCodec"]


@dataclass(frozen=True)
class NoParams:
    pass


@register
class NoneCodec(Codec):
    """The uncompressed baseline: the tensor's own bytes, row-major, little-endian."""

    name = "none"
    Params = NoParams

    def encode_payload(self, x, ctx):
        check_finite(x, self.name)  # a NaN activation means a diverged run: say so at the source
        return x.detach().contiguous().reshape(-1).view(torch.uint8), {}

    def decode_payload(self, payload, shape, dtype, header, ctx):
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if payload.numel() != expected:
            raise CodecError(f"none payload has {payload.numel()} bytes, shape {list(shape)} of {dtype} "
                             f"needs {expected}")
        return from_bytes(payload, dtype).reshape(shape)


@register
class NaiveCodec(Codec):
    """k-bit symmetric absmax, one fp16 scale per channel (with a shared power-of-two exponent)."""

    name = "naive"
    Params = naive_ref.NaiveParams
    on_cpu = True  # a baseline: its reference only (a CUDA tensor's bytes are encoded on the CPU, as group's)

    def encode_payload(self, x, ctx):
        payload, e = naive_ref.encode(x.detach(), self.params)
        return payload, {"exp": float(e)}

    def decode_payload(self, payload, shape, dtype, header, ctx):
        params = self.from_header(header, extra=("exp",)).params
        e = header.get("exp", math.nan)
        if not math.isfinite(e) or e != int(e):
            raise CodecError(f"naive header has an invalid scale exponent {e}")
        return naive_ref.decode(payload, shape, params, int(e), dtype)


@register
class PerTokenCodec(Codec):
    """k-bit symmetric absmax, one bf16 scale per token and tile of G channels: the gradient codec."""

    name = "pertoken"
    Params = pertoken_ref.PerTokenParams

    def encode_payload(self, x, ctx):
        return dispatch.PERTOKEN.serving(x).encode(x.detach(), self.params), {}

    def decode_payload(self, payload, shape, dtype, header, ctx):
        return dispatch.PERTOKEN.serving(payload).decode(payload, shape, self.from_header(header).params, dtype)


@register
class GroupCodec(Codec):
    """k-bit asymmetric min-max per tile of G channels, fp16 zero-point and scale."""

    name = "group"
    Params = group_ref.GroupParams
    on_cpu = True

    def encode_payload(self, x, ctx):
        return group_ref.encode(x.detach(), self.params), {}

    def decode_payload(self, payload, shape, dtype, header, ctx):
        return group_ref.decode(payload, shape, self.from_header(header).params, dtype)


BLOCKS_MARK = "blocks"  # a tahquant message's param: its width's left-over channels are tiled as one stream
LAYOUTS = {"layout": "tahquant's layouts are codecs of their own now: layout 3 (a run's) is codec tahquant "
                     "(parameters group_size, qmax), layout 1 (the paper's) codec tahquant-paper; name the codec "
                     "(e.g. [codec] forward = \"tahquant-paper\") and leave `layout` out"}


@register
class TahQuantCodec(Codec):
    """TAH-Quant as a run sends it: every tile of G channels sign-flipped and rotated, a grid of
    2 qmax + 1 levels, Rice-coded (tahquant_rice_ref; messages: tahquant version 3)."""

    name = "tahquant"
    version = 3
    Params = tahquant_rice_ref.RiceParams
    needs_prescale = True
    schedule_params = {"qmax": 31}  # a grid as fine as 6 bits' (docs/codecs.md, the schedule)
    gone_params = LAYOUTS

    def encode_payload(self, x, ctx):
        return dispatch.TAHQUANT.serving(x).encode(x.detach(), self.params), self._blocks_mark(self.params, x.shape)

    def decode_payload(self, payload, shape, dtype, header, ctx):
        params = self.from_header(header, extra=(BLOCKS_MARK,)).params
        if header.get(BLOCKS_MARK) != self._blocks_mark(params, shape).get(BLOCKS_MARK):
            raise CodecError(f"tahquant: a width of {shape[-1]} channels at group_size {params.group_size} is cut "
                             f"into blocks whose message says {BLOCKS_MARK}=1 (an older build cut it otherwise and "
                             f"sends no mark)")
        return dispatch.TAHQUANT.serving(payload).decode(payload, shape, params, dtype)

    @staticmethod
    def _blocks_mark(params: tahquant_rice_ref.RiceParams, shape) -> dict[str, float]:
        """A width that is not a multiple of G (its left-over channels tiled as one stream,
        tahquant_rice_ref.blocks) says so in its params: a build that cut such widths otherwise
        refuses the message ("unknown parameters") instead of misreading it. Widths of whole tiles
        carry no mark: their messages are as they always were."""
        return {BLOCKS_MARK: 1.0} if shape[-1] % int(params.group_size) else {}


@register
class TahQuantPaperCodec(Codec):
    """TAH-Quant as the paper gives it: entropy-guided INT3/INT4 per token, adaptive pivot swap +
    Hadamard per tile (tahquant_ref; messages: tahquant version 1, as before the two had names)."""

    name = "tahquant-paper"
    wire_name = "tahquant"
    version = 1
    Params = tahquant_ref.PaperParams
    needs_prescale = True
    schedule_params = {"bits_high": 6, "bits_low": 6}  # every token at 6 bits (docs/codecs.md, the schedule)
    gone_params = LAYOUTS

    def encode_payload(self, x, ctx):
        return dispatch.TAHQUANT_PAPER.serving(x).encode(x.detach(), self.params), {}

    def decode_payload(self, payload, shape, dtype, header, ctx):
        params = self.from_header(header).params
        return dispatch.TAHQUANT_PAPER.serving(payload).decode(payload, shape, params, dtype)


@register
class AqsgdCodec(Codec):
    """AQ-SGD: quantized delta against a per-sample cache kept on both ends (ctx.aqsgd_cache)."""

    name = "aqsgd"
    Params = aqsgd_ref.AqsgdParams
    keeps_stream_state = True
    on_cpu = True  # its per-sample caches live in host memory on both ends

    def _ids(self, n: int, ctx: CodecContext) -> list[int]:
        if ctx.sample_ids is None:
            raise CodecError("aqsgd needs the sample ids of the rows in the codec context")
        return list(ctx.sample_ids)

    def encode_payload(self, x, ctx):
        return aqsgd_ref.encode(x.detach(), self._ids(x.shape[0], ctx), ctx.aqsgd_cache, self.params), {}

    def decode_payload(self, payload, shape, dtype, header, ctx):
        params = self.from_header(header).params
        return aqsgd_ref.decode(payload, shape, dtype, self._ids(shape[0], ctx), ctx.aqsgd_cache, params)


@register
class AmaqCodec(Codec):
    """AMAQ: per-channel learned integer bit widths (the sender's ctx.amaq_state), min-max per channel."""

    name = "amaq"
    Params = amaq_ref.AmaqParams

    def state_for(self, channels: int, ctx: CodecContext, device=None) -> amaq_ref.AmaqState:
        """The sender's gates, created on first use (Q = 0)."""
        if ctx.amaq_state is None:
            ctx.amaq_state = amaq_ref.AmaqState(channels, self.params, device=device)
        if ctx.amaq_state.gate.numel() != channels:
            raise CodecError(f"amaq: state has {ctx.amaq_state.gate.numel()} channels, tensor has {channels}")
        return ctx.amaq_state

    def encode_payload(self, x, ctx):
        state = self.state_for(x.shape[-1], ctx, x.device)
        return amaq_ref.encode(x.detach(), state.bits()), {"step": float(state.step)}

    def sender_state(self, channels, device="cpu"):
        return AmaqSenderState(channels, self.params, device=device)

    def decode_payload(self, payload, shape, dtype, header, ctx):
        return amaq_ref.decode(payload, shape, dtype)
