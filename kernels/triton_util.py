"""Small pieces shared by the Triton kernels: exact rounding by hand (the CPU interpreter lacks
rint and truncates fp32 -> bf16 casts) and launching on a tensor's own GPU."""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

__all__ = ["round_half_even", "to_bf16_rne", "on_device", "interpreting"]


@triton.jit
def round_half_even(u):
    """u >= 0 (float32) -> nearest int32, ties to even. Exact: u - floor(u) is exact for u >= 0
    (floor(u) + 0.5 is not: it rounds for u just below 0.5)."""
    r = tl.floor(u)
    f = u - r
    ri = r.to(tl.int32)
    up = (f > 0.5) | ((f == 0.5) & ((ri & 1) == 1))
    return ri + up.to(tl.int32)


@triton.jit
def to_bf16_rne(y):
    """float32 -> bfloat16 rounded to nearest even by hand (finite y; overflow gives +-inf)."""
    b = y.to(tl.uint32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


def on_device(t: torch.Tensor):
    """Launch on t's GPU (Triton launches on the current device); nothing for the interpreter."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (TRITON_INTERPRET set): block sizes differ there."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
