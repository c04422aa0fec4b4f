"""Quantization primitives shared by the codec specifications: fp16 min/zero-point per group,
symmetric absmax per channel, round half to even, and the Sylvester Hadamard transform.

All arithmetic is IEEE float32 in the order written here (the Triton kernels repeat it op for op),
except the Hadamard product, which is computed in float64 and rounded once to float32."""

from __future__ import annotations

import math

import torch

from .wire import CodecError

__all__ = [
    "check_finite",
    "fp16_min_scale",
    "quantize_asym",
    "dequantize_asym",
    "pow2_exponent",
    "absmax_scales",
    "quantize_sym",
    "dequantize_sym",
    "sylvester",
    "hadamard",
]


def check_finite(x: torch.Tensor, codec: str) -> None:
    """Raises CodecError if `x` holds a NaN or an infinity. The smallest and largest value are finite
    exactly when every value is (both propagate NaN): one reduction, 40x faster than isfinite(x) on
    a CPU's bf16; the bad values are counted only when there are some."""
    if x.numel() == 0 or bool(torch.isfinite(torch.stack(torch.aminmax(x))).all()):
        return
    bad = int((~torch.isfinite(x)).sum())
    raise CodecError(f"{codec}: input has {bad} NaN/Inf values; refusing to encode")


def fp16_min_scale(lo: torch.Tensor, hi: torch.Tensor, qmax: torch.Tensor | float, codec: str):
    """zero = fp16(lo), scale = fp16(fp32(hi - lo) / qmax): rounded to fp16 *before* quantizing."""
    zero = lo.to(torch.float16)
    scale = ((hi - lo) / qmax).to(torch.float16)
    if not (bool(torch.isfinite(zero).all()) and bool(torch.isfinite(scale).all())):
        raise CodecError(
            f"{codec}: a group's min or range exceeds the fp16 range (|x| > 65504) of its zero-point/scale; "
            "use codec 'none' or 'naive' for such tensors"
        )
    return zero, scale


def quantize_asym(y: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, qmax: torch.Tensor | float) -> torch.Tensor:
    """q = round_half_even(clamp((y - zero) / scale, 0, qmax)) per group; y (..., G) float32,
    zero/scale (...) fp16, qmax a float or a tensor broadcastable to (...). A zero scale gives q = 0."""
    z = zero.float()[..., None]
    s = scale.float()[..., None]
    u = (y - z) / s
    qmax_t = torch.as_tensor(qmax, dtype=torch.float32, device=y.device)
    if qmax_t.dim():
        qmax_t = qmax_t[..., None]
    u = torch.where(s > 0, u, torch.zeros((), device=y.device))
    u = torch.minimum(torch.clamp(u, min=0.0), qmax_t)
    return torch.round(u).to(torch.uint8)  # torch.round rounds half to even


def dequantize_asym(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x = q * scale + zero in float32 (q < 256 and fp16 scale make the product exact, so the
    result is the same with or without a fused multiply-add)."""
    return q.float() * scale.float()[..., None] + zero.float()[..., None]


def pow2_exponent(peak: torch.Tensor) -> int:
    """e with peak * 2**-e in [2**14, 2**15) (0 for peak == 0), clamped to [-126, 126]: the largest
    per-channel scale lands at the top of fp16's range, leaving its whole normal range below."""
    value = float(peak)
    if value == 0.0:
        return 0
    return max(-126, min(126, math.frexp(value)[1] - 15))


def absmax_scales(x2d: torch.Tensor, qmax: int, codec: str):
    """Per-channel symmetric scales for x2d (N, C) float32: returns (scale16 (C,) fp16, e) such that
    the channel's effective scale is fp32(scale16) * 2**e. The power of two keeps tiny gradients
    inside the fp16 range of the per-channel scales."""
    absmax = x2d.abs().amax(dim=0)
    ratio = absmax / qmax
    e = pow2_exponent(ratio.max())
    scale16 = (ratio * (2.0 ** -e)).to(torch.float16)
    if not bool(torch.isfinite(scale16).all()):
        raise CodecError(f"{codec}: per-channel scale overflowed fp16")
    return scale16, e


def quantize_sym(x2d: torch.Tensor, scale16: torch.Tensor, e: int, qmax: int) -> torch.Tensor:
    """Codes q + qmax in [0, 2*qmax] with q = round_half_even(clamp(x / s, -qmax, qmax)), s = scale16 * 2**e."""
    s = scale16.float() * (2.0 ** e)
    u = torch.where(s > 0, x2d / s, torch.zeros((), device=x2d.device))
    q = torch.round(torch.clamp(u, -qmax, qmax))
    return (q + qmax).to(torch.uint8)


def dequantize_sym(codes: torch.Tensor, scale16: torch.Tensor, e: int, qmax: int) -> torch.Tensor:
    s = scale16.float() * (2.0 ** e)
    return (codes.float() - qmax) * s


def sylvester(n: int, device=None, dtype=torch.float64) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix (entries ±1, H[i, j] = (-1)**popcount(i & j))."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard(y: torch.Tensor) -> torch.Tensor:
    """Normalized Hadamard transform y·H/sqrt(G) of the last dim (its own inverse), computed in
    float64 and rounded once to float32."""
    g = y.shape[-1]
    h = sylvester(g, device=y.device)
    return ((y.double() @ h) / math.sqrt(g)).float()
