"""`naive` in Triton: k-bit symmetric absmax with one fp16 scale per channel, the same payload as
naive_ref byte for byte.

encode(x (..., C), params) -> (uint8 payload, e)     decode(payload, shape, params, e, dtype) -> (shape)

The per-channel absmax is a torch reduction; quantize + bit-plane pack and unpack + dequantize are
one kernel each over blocks of consecutive codes (the planes of the whole code array, row-major,
as bitpack.pack_bits lays them out). The scales and their shared exponent come from the spec's own
quant_ref.absmax_scales, applied to the (1, C) absmax."""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .bitpack import packed_nbytes, padded_count, plane_widths
from .naive_ref import NaiveParams, sections
from .quant_ref import absmax_scales, check_finite
from .triton_util import on_device, round_half_even, to_bf16_rne
from .wire import CodecError

__all__ = ["encode", "decode"]


@triton.jit
def _store_plane(out_ptr, q, pid, n_pad, BLOCK: tl.constexpr, W: tl.constexpr, SHIFT: tl.constexpr):
    """Bits SHIFT..SHIFT+W-1 of the codes q (BLOCK,) into the width-W plane (which starts at byte
    n_pad*SHIFT/8), 8/W codes per byte, least significant first."""
    PER: tl.constexpr = 8 // W
    v = tl.reshape((q >> SHIFT) & ((1 << W) - 1), (BLOCK // PER, PER))
    packed = tl.sum(v << (tl.arange(0, PER) * W)[None, :], axis=1)
    kb = pid.to(tl.int64) * (BLOCK // PER) + tl.arange(0, BLOCK // PER)
    tl.store(out_ptr + (n_pad // 8) * SHIFT + kb, packed.to(tl.uint8), mask=kb < n_pad // PER)


@triton.jit
def _load_plane(q, codes_ptr, i, in_pad, n_pad, W: tl.constexpr, SHIFT: tl.constexpr):
    PER: tl.constexpr = 8 // W
    b = tl.load(codes_ptr + (n_pad // 8) * SHIFT + i // PER, mask=in_pad, other=0).to(tl.int32)
    return q | (((b >> ((i % PER) * W).to(tl.int32)) & ((1 << W) - 1)) << SHIFT)


@triton.jit
def _naive_encode_kernel(
    x_ptr, scale_ptr, pow2, out_ptr, n, n_pad, n_chan,
    QMAX: tl.constexpr, BLOCK: tl.constexpr, S8: tl.constexpr, S4: tl.constexpr, S2: tl.constexpr, S1: tl.constexpr,
):
    """Codes q + QMAX of x (flat, n values) for elements [pid*BLOCK, +BLOCK), zero past n, stored
    into each plane of the payload; S<w> = the bit offset of the width-w plane, -1 if absent."""
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    x = tl.load(x_ptr + i, mask=inside, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + i % n_chan, mask=inside, other=0.0).to(tl.float32) * pow2
    pos = s > 0
    u = tl.where(pos, tl.math.div_rn(x, tl.where(pos, s, 1.0)), 0.0)
    u = tl.minimum(tl.maximum(u, -QMAX), QMAX)
    r = round_half_even(tl.abs(u))
    q = tl.where(u < 0, -r, r) + QMAX
    q = tl.where(inside, q, 0)
    if S8 >= 0:
        _store_plane(out_ptr, q, pid, n_pad, BLOCK, 8, S8)
    if S4 >= 0:
        _store_plane(out_ptr, q, pid, n_pad, BLOCK, 4, S4)
    if S2 >= 0:
        _store_plane(out_ptr, q, pid, n_pad, BLOCK, 2, S2)
    if S1 >= 0:
        _store_plane(out_ptr, q, pid, n_pad, BLOCK, 1, S1)


@triton.jit
def _naive_decode_kernel(
    codes_ptr, scale_ptr, pow2, out_ptr, bad_ptr, n, n_pad, n_chan,
    QMAX: tl.constexpr, BLOCK: tl.constexpr, S8: tl.constexpr, S4: tl.constexpr, S2: tl.constexpr, S1: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    """x = (code - QMAX) * scale for elements [pid*BLOCK, +BLOCK); bad[pid] = 1 if a code exceeds
    2*QMAX or a padding code is not zero."""
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_pad = i < n_pad
    inside = i < n
    q = tl.zeros([BLOCK], dtype=tl.int32)
    if S8 >= 0:
        q = _load_plane(q, codes_ptr, i, in_pad, n_pad, 8, S8)
    if S4 >= 0:
        q = _load_plane(q, codes_ptr, i, in_pad, n_pad, 4, S4)
    if S2 >= 0:
        q = _load_plane(q, codes_ptr, i, in_pad, n_pad, 2, S2)
    if S1 >= 0:
        q = _load_plane(q, codes_ptr, i, in_pad, n_pad, 1, S1)
    bad = tl.where(inside, q > 2 * QMAX, q != 0) & in_pad
    tl.store(bad_ptr + pid, tl.max(bad.to(tl.int32), axis=0).to(tl.uint8))
    s = tl.load(scale_ptr + i % n_chan, mask=inside, other=0.0).to(tl.float32) * pow2
    y = (q.to(tl.float32) - QMAX) * s
    if OUT_BF16:
        tl.store(out_ptr + i, to_bf16_rne(y), mask=inside)
    else:
        tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=inside)


def _block() -> int:
    return 65536 if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else 4096


def _constexprs(params: NaiveParams) -> dict:
    """QMAX and the bit offset S<w> of each plane of width w (-1 when the code has none)."""
    shifts, shift = {}, 0
    for w in plane_widths(params.bits):
        shifts[w] = shift
        shift += w
    return dict(QMAX=params.qmax, **{f"S{w}": shifts.get(w, -1) for w in (8, 4, 2, 1)})


def encode(x: torch.Tensor, params: NaiveParams = NaiveParams()) -> tuple[torch.Tensor, int]:
    """-> (payload, e), equal to naive_ref.encode(x, params) for x (..., C) on a CUDA device (or
    under TRITON_INTERPRET=1)."""
    with on_device(x):
        return _encode(x, params)


def _encode(x: torch.Tensor, params: NaiveParams) -> tuple[torch.Tensor, int]:
    params.validate()
    if x.numel() == 0:
        raise CodecError(f"naive: cannot encode an empty tensor (shape {list(x.shape)})")
    c = x.shape[-1]
    x2 = x.detach().reshape(-1, c)
    xf = x2.reshape(-1) if x2.is_contiguous() else x2.contiguous().reshape(-1)
    absmax = torch.linalg.vector_norm(x2, ord=float("inf"), dim=0).float()  # NaN/Inf propagate
    if not bool(torch.isfinite(absmax).all()):
        check_finite(x, "naive")  # raises with the reference's message
    scale16, e = absmax_scales(absmax[None, :], params.qmax, "naive")  # the spec's scales and exponent
    n = x.numel()
    n_pad = padded_count(n)
    out = torch.empty(2 * c + packed_nbytes(n, params.bits), dtype=torch.uint8, device=x.device)
    out[: 2 * c] = scale16.view(torch.uint8)
    block = _block()
    _naive_encode_kernel[(triton.cdiv(n_pad, block),)](
        xf, scale16, 2.0**e, out[2 * c :], n, n_pad, c, BLOCK=block, **_constexprs(params)
    )
    return out, e


def decode(payload: torch.Tensor, shape, params: NaiveParams, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Equal to naive_ref.decode, on the payload's device; a corrupt payload raises CodecError with
    the reference's message."""
    with on_device(payload):
        return _decode(payload, shape, params, e, dtype)


def _decode(payload: torch.Tensor, shape, params: NaiveParams, e: int, dtype: torch.dtype) -> torch.Tensor:
    scale16, codes = sections(payload, shape, params, e)
    c = shape[-1]
    n = math.prod(shape)
    n_pad = padded_count(n)
    out = torch.empty(n, dtype=dtype, device=payload.device)
    block = _block()
    grid = triton.cdiv(n_pad, block)
    bad = torch.empty(grid, dtype=torch.uint8, device=payload.device)
    _naive_decode_kernel[(grid,)](
        codes, scale16, 2.0**e, out, bad, n, n_pad, c, BLOCK=block, OUT_BF16=dtype == torch.bfloat16, **_constexprs(params)
    )
    scale_ok, codes_ok = torch.stack(
        [(torch.isfinite(scale16).all() & (scale16 >= 0).all()), ~bad.bool().any()]
    ).tolist()
    if not scale_ok:
        raise CodecError("naive payload is corrupt: negative or non-finite scale")
    if not codes_ok:
        raise CodecError("naive payload is corrupt: code out of range or non-zero padding")
    return out.reshape(shape)
