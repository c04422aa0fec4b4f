"""Small pieces shared by the Triton kernels: exact rounding by hand (the CPU interpreter lacks
rint and truncates fp32 -> bf16 casts), counting bits, and launching on a tensor's own GPU."""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

__all__ = ["round_half_even", "quotient", "to_bf16_rne", "leading_ones", "zero_bits", "on_device", "interpreting"]


@triton.jit
def round_half_even(u):
    """u (float32, |u| <= 2^22) -> the nearest int32, ties to even: u + 1.5 * 2^23 lies in [2^23,
    2^24), where float32's step is 1, so IEEE addition (the interpreter's numpy too) rounds it to
    the integer there, ties to even (that sum is even exactly when the rounded u is); its bits less
    those of 1.5 * 2^23 are that integer. Two instructions. u must not be a product: a multiply fed
    straight into this add may fuse into one FMA, rounded once (callers clamp u first)."""
    return (u + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def quotient(x, s):
    """x / s in float32 (s: positive normal scales, broadcast against x, one a row) as a quantizer
    rounds it: IEEE's quotient wherever |x / s| >= 1/4; a smaller one may differ in its last bits
    and rounds to code 0 either way. A correctly rounded reciprocal y a scale, then a multiply and
    Markstein's correction a value: q = x*y, q + (x - q*s)*y in two FMAs. Scales below 2^-60 and
    their x are scaled by 2^64 first, so that residual x - q*s is not subnormal. Above 2^126 (qmax 1
    only) y is subnormal, a bit short, and the correction still gives IEEE's quotient
    (tests/test_symtiles.py tries every bf16 mantissa at both ends). div_rn a value took a range
    check and a branch around its own reciprocal besides."""
    k = tl.where(s < 8.673617379884035e-19, 1.8446744073709552e19, 1.0)
    s = s * k
    y = tl.math.div_rn(tl.zeros_like(s) + 1.0, s)
    x = x * k
    q = x * y
    return tl.fma(tl.fma(-q, s, x), y, q)


@triton.jit
def to_bf16_rne(y):
    """float32 -> bfloat16 rounded to nearest even by hand (finite y; overflow gives +-inf)."""
    b = y.to(tl.uint32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def leading_ones(x):
    """The one-bits at the top of x (int64 holding 32 bits), from bit 31 down: 0..32 (a binary search
    for the highest zero-bit: 16, 8, 4, 2, then 1 bit at a time)."""
    y = ~x & 0xFFFFFFFF
    count = tl.where(y == 0, 32, 0)
    for step in tl.static_range(5):  # a width of 16 >> step bits
        short = y < (1 << (32 - (16 >> step)))
        count += tl.where(short, 16 >> step, 0)
        y = tl.where(short, y << (16 >> step), y)
    return tl.where(count > 32, 32, count)


@triton.jit
def zero_bits(byte):
    """The zero-bits of each byte (int32 holding 8 bits): 0..8."""
    x = ~byte & 0xFF
    x = x - ((x >> 1) & 0x55)
    x = (x & 0x33) + ((x >> 2) & 0x33)
    return (x + (x >> 4)) & 0x0F


def on_device(t: torch.Tensor):
    """Launch on t's GPU (Triton launches on the current device); nothing for the interpreter."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (TRITON_INTERPRET set): block sizes differ there."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
