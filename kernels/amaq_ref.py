"""`amaq` codec specification (AMAQ, arXiv 2510.05468): per-channel learned bit widths
b = bmin + (bmax - bmin) * sigmoid(alpha * Q), rounded to integers on the wire.

The sender keeps Q (one learnable value per channel) in an `AmaqState`, adds the bit-regularization
term beta * mean(sigmoid(alpha * Q)^2) to its loss, and trains Q through `fake_quant`, whose value
equals decode(encode(x)) and whose gradient reaches Q through the scale (straight-through rounding).
The bit range anneals from (8, 8) at step 0 to (bits_min, bits_max) at `anneal_steps`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .bitpack import padded_count, pack_rows, row_nbytes, unpack_rows
from .quant_ref import check_finite, dequantize_asym, fp16_min_scale, quantize_asym
from .wire import CodecError, PayloadReader, as_bytes

__all__ = ["AmaqParams", "AmaqState", "encode", "decode", "fake_quant", "bit_range"]


@dataclass(frozen=True)
class AmaqParams:
    """Hyperparameters; docs/codecs.md says which the paper fixes and which we chose."""

    bits_min: float = 2.0      # lower end of the learned range once annealed
    bits_max: float = 6.0      # upper end once annealed (Q = 0 gives the middle, 4 bits)
    alpha: float = 1.0         # sigmoid slope on Q
    beta: float = 0.01         # weight of the bit-regularization term
    anneal_steps: int = 200    # steps to go from 8 bits to [bits_min, bits_max]
    q_lr: float = 0.01         # learning rate of Q (its own optimizer, as in the paper)

    def validate(self) -> "AmaqParams":
        if not 1 <= self.bits_min <= self.bits_max <= 8:
            raise CodecError(f"amaq: need 1 <= bits_min <= bits_max <= 8, got {self.bits_min}, {self.bits_max}")
        if self.anneal_steps < 0:
            raise CodecError("amaq: anneal_steps must be >= 0")
        return self


def bit_range(params: AmaqParams, step: int) -> tuple[float, float]:
    """(bmin, bmax) at `step`: linear from (8, 8) to (bits_min, bits_max) over anneal_steps."""
    t = 1.0 if params.anneal_steps == 0 else min(1.0, max(0, step) / params.anneal_steps)
    return 8.0 + (params.bits_min - 8.0) * t, 8.0 + (params.bits_max - 8.0) * t


class AmaqState(torch.nn.Module):
    """The sender's learnable gates Q (one per channel) and the current step of the schedule."""

    def __init__(self, channels: int, params: AmaqParams = AmaqParams(), device=None):
        super().__init__()
        self.params = params.validate()
        self.gate = torch.nn.Parameter(torch.zeros(channels, device=device))
        self.step = 0

    def continuous_bits(self) -> torch.Tensor:
        bmin, bmax = bit_range(self.params, self.step)
        return bmin + (bmax - bmin) * torch.sigmoid(self.params.alpha * self.gate)

    def bits(self) -> torch.Tensor:
        """Integer bits per channel (uint8), as sent on the wire."""
        return torch.round(self.continuous_bits().detach()).clamp(1, 8).to(torch.uint8)

    def regularization(self) -> torch.Tensor:
        """beta * mean(sigmoid(alpha Q)^2): add to the loss to push the bit budget down."""
        return self.params.beta * torch.sigmoid(self.params.alpha * self.gate).pow(2).mean()


def _channel_params(x2: torch.Tensor, bits: torch.Tensor):
    """Per-channel min-max over the tokens of x2 (N, C): zero, scale fp16 (C,), qmax (C,)."""
    qmax = 2.0 ** bits.float() - 1.0
    zero, scale = fp16_min_scale(x2.amin(0), x2.amax(0), qmax, "amaq")
    return zero, scale, qmax


def encode(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Payload: bits uint8[C], zero fp16[C], scale fp16[C], then per channel c, in order, the codes
    of its N tokens (zero-padded to a multiple of 8) packed at bits[c]."""
    check_finite(x, "amaq")
    c = x.shape[-1]
    if bits.shape != (c,):
        raise CodecError(f"amaq: {tuple(bits.shape)} bit widths for {c} channels")
    bits = bits.to(torch.uint8).to(x.device)
    x2 = x.reshape(-1, c).float()
    zero, scale, qmax = _channel_params(x2, bits)
    q = quantize_asym(x2.t(), zero, scale, qmax)                     # (C, N)
    n = x2.shape[0]
    padded = torch.zeros(c, padded_count(n), dtype=torch.uint8, device=x.device)
    padded[:, :n] = q
    return torch.cat([bits, as_bytes(zero), as_bytes(scale), pack_rows(padded, bits)])


def decode(payload: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    c = shape[-1]
    n = math.prod(shape) // c
    minimum = 5 * c + c * padded_count(n) // 8  # every channel at 1 bit at least
    if payload.numel() < minimum:
        raise CodecError(f"amaq payload is truncated: {payload.numel()} bytes, shape {list(shape)} needs at least "
                         f"{minimum}")
    rd = PayloadReader(payload, "amaq")
    bits = rd.take(c, "bit widths")
    if bool(((bits < 1) | (bits > 8)).any()):
        raise CodecError("amaq payload is corrupt: a channel bit width outside 1..8")
    zero = rd.take_array(c, torch.float16, "zero-points")
    scale = rd.take_array(c, torch.float16, "scales")
    if not (bool(torch.isfinite(zero).all()) and bool(torch.isfinite(scale).all()) and bool((scale >= 0).all())):
        raise CodecError("amaq payload is corrupt: non-finite zero-point or negative/non-finite scale")
    codes = rd.take(int(row_nbytes(bits, padded_count(n)).sum()), "codes")
    rd.finish()
    q = unpack_rows(codes, bits, padded_count(n))[:, :n]
    x = dequantize_asym(q, zero, scale).t()                          # (N, C)
    return x.reshape(shape).to(dtype)


def fake_quant(x: torch.Tensor, state: AmaqState) -> torch.Tensor:
    """decode(encode(x, state.bits())) as a differentiable function of x (straight through) and of
    the gates Q (through the scale, LSQ-style: d x_hat / d scale = round(u) - u)."""
    c = x.shape[-1]
    x2 = x.detach().reshape(-1, c).float()
    bits = state.bits()
    zero, scale, qmax = _channel_params(x2, bits)
    s = scale.float()
    u = torch.where(s > 0, (x2 - zero.float()) / s, torch.zeros((), device=x.device))
    u = torch.minimum(u.clamp(min=0.0), qmax)
    r = torch.round(u)
    value = (r * s + zero.float()).reshape(x.shape).to(x.dtype)
    cont = state.continuous_bits()
    b_ste = cont + (torch.round(cont).clamp(1, 8) - cont).detach()
    span = (x2.amax(0) - x2.amin(0))
    s_soft = span / (2.0 ** b_ste - 1.0)
    scale_path = ((s_soft - s_soft.detach()) * (r - u)).reshape(x.shape).to(x.dtype)
    return value + (x - x.detach()) + scale_path
