"""`naive` in Triton: k-bit symmetric absmax with one fp16 scale per channel, the same payload as
naive_ref byte for byte.

encode(x (..., C), params) -> (uint8 payload, e)     decode(payload, shape, params, e, dtype) -> (shape)

Encode is three kernels and one synchronization (e travels in the header, so the host must read
it): the absmax of blocks of tokens per channel, the per-channel absmax / qmax and their maximum
(whose power of two is e), then quantize + bit-plane pack over blocks of consecutive codes (the
planes of the whole code array, row-major, as bitpack.pack_bits lays them out), which also
writes the fp16 scales. The scale arithmetic is quant_ref.absmax_scales', op for op. Decode is
one kernel (unpack + dequantize + checks) and a reduction of its error flags."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .bitpack import packed_nbytes, padded_count, plane_widths
from .naive_ref import NaiveParams, sections
from .quant_ref import check_finite
from .triton_util import interpreting as _interpreting
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
def _colmax_kernel(x_ptr, stride_x, n_rows, n_chan, part_ptr, badp_ptr, status_ptr, TB: tl.constexpr, CB: tl.constexpr):
    """Program (b, c): the absmax of channels [c*CB, +CB) over rows [b*TB, +TB) -> part[b, :] (the
    non-finite values counted as 0) and badp[b, c] = 1 if any value is NaN/Inf. Program (0, 0)
    clears the status words."""
    pb = tl.program_id(0)
    cb = tl.program_id(1)
    if (pb == 0) & (cb == 0):
        tl.store(status_ptr + tl.arange(0, 4), tl.zeros([4], dtype=tl.int32))
    r = pb * TB + tl.arange(0, TB)
    c = cb * CB + tl.arange(0, CB)
    m = (r < n_rows)[:, None] & (c < n_chan)[None, :]
    a = tl.abs(tl.load(x_ptr + r.to(tl.int64)[:, None] * stride_x + c[None, :], mask=m, other=0.0).to(tl.float32))
    bad = (a != a) | (a == float("inf"))
    tl.store(part_ptr + pb.to(tl.int64) * n_chan + c, tl.max(tl.where(bad, 0.0, a), axis=0), mask=c < n_chan)
    tl.store(badp_ptr + pb * tl.num_programs(1) + cb, tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0).to(tl.uint8))


@triton.jit
def _ratio_kernel(part_ptr, badp_ptr, n_part, n_chan, ratio_ptr, status_ptr, QMAX: tl.constexpr, CB: tl.constexpr,
                  PB: tl.constexpr):
    """Program c: ratio = absmax / qmax (fp32) of channels [c*CB, +CB) from the n_part partial
    maxima; the largest ratio's bit pattern is max-ed into status[1] (ratios >= 0 order like their
    bits) and a non-finite input sets status[0] bit 0."""
    cb = tl.program_id(0)
    c = cb * CB + tl.arange(0, CB)
    p = tl.arange(0, PB)
    amax = tl.zeros([CB], dtype=tl.float32)
    bad = tl.zeros([PB], dtype=tl.int32)
    for s in range(0, n_part, PB):
        pm = (s + p) < n_part
        part = tl.load(part_ptr + (s + p).to(tl.int64)[:, None] * n_chan + c[None, :],
                       mask=pm[:, None] & (c < n_chan)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(part, axis=0))
        bad |= tl.load(badp_ptr + (s + p) * tl.num_programs(0) + cb, mask=pm, other=0).to(tl.int32)
    ratio = tl.math.div_rn(amax, tl.full([CB], QMAX, tl.float32))
    tl.store(ratio_ptr + c, ratio, mask=c < n_chan)
    tl.atomic_max(status_ptr + 1, tl.max(ratio.to(tl.int32, bitcast=True), axis=0))
    if tl.max(bad, axis=0) > 0:
        tl.atomic_or(status_ptr, 1)


@triton.jit
def _exponent(peak_bits):
    """quant_ref.pow2_exponent of the fp32 value with these bits (>= 0, finite): e with
    peak * 2**-e in [2**14, 2**15), 0 for 0, clamped to [-126, 126]."""
    be = (peak_bits >> 23) & 0xFF
    mant = peak_bits & 0x7FFFFF
    sub = (mant.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 275  # frexp exponent of a subnormal
    frexp_e = tl.where(be == 0, sub, be - 126)
    return tl.where(peak_bits == 0, 0, tl.minimum(tl.maximum(frexp_e - 15, -126), 126))


@triton.jit
def _pow2(e):
    """2.0**e in fp32 for e in [-126, 127], built from its bits (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _naive_encode_kernel(
    x_ptr, ratio_ptr, status_ptr, scale_ptr, out_ptr, n, n_pad, n_chan,
    QMAX: tl.constexpr, BLOCK: tl.constexpr, S8: tl.constexpr, S4: tl.constexpr, S2: tl.constexpr, S1: tl.constexpr,
):
    """Codes q + QMAX of x (flat, n values) for elements [pid*BLOCK, +BLOCK), zero past n, stored
    into each plane of the payload; S<w> = the bit offset of the width-w plane, -1 if absent. The
    channel scales are fp16(ratio * 2**-e), e from the largest ratio (status[1]); this program
    also stores the scales of channels [pid*BLOCK, +BLOCK), and program 0 stores e in status[2]
    and sets status[0] bit 1 if a scale overflowed fp16."""
    pid = tl.program_id(0)
    e = _exponent(tl.load(status_ptr + 1))
    inv = _pow2(-e)
    pow2 = _pow2(e)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    x = tl.load(x_ptr + i, mask=inside, other=0.0).to(tl.float32)
    s16 = (tl.load(ratio_ptr + i % n_chan, mask=inside, other=0.0) * inv).to(tl.float16)
    s = s16.to(tl.float32) * pow2
    pos = s > 0
    u = tl.where(pos, tl.math.div_rn(x, tl.where(pos, s, 1.0)), 0.0)
    q = round_half_even(tl.minimum(tl.maximum(u, -QMAX), QMAX)) + QMAX
    q = tl.where(inside, q, 0)
    if S8 >= 0:
        _store_plane(out_ptr, q, pid, n_pad, BLOCK, 8, S8)
    if S4 >= 0:
        _store_plane(out_ptr, q, pid, n_pad, BLOCK, 4, S4)
    if S2 >= 0:
        _store_plane(out_ptr, q, pid, n_pad, BLOCK, 2, S2)
    if S1 >= 0:
        _store_plane(out_ptr, q, pid, n_pad, BLOCK, 1, S1)
    c = pid * BLOCK + tl.arange(0, BLOCK)
    cs16 = (tl.load(ratio_ptr + c, mask=c < n_chan, other=0.0) * inv).to(tl.float16)
    tl.store(scale_ptr + c, cs16, mask=c < n_chan)
    if tl.max(((cs16 == float("inf")) & (c < n_chan)).to(tl.int32), axis=0) > 0:
        tl.atomic_or(status_ptr, 2)
    if pid == 0:
        tl.store(status_ptr + 2, e)


@triton.jit
def _naive_decode_kernel(
    codes_ptr, scale_ptr, pow2, out_ptr, bad_ptr, n, n_pad, n_chan,
    QMAX: tl.constexpr, BLOCK: tl.constexpr, S8: tl.constexpr, S4: tl.constexpr, S2: tl.constexpr, S1: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    """x = (code - QMAX) * scale for elements [pid*BLOCK, +BLOCK); bad[pid] = 2 if a scale of its
    elements is negative or non-finite, else 1 if a code exceeds 2*QMAX or a padding code is not
    zero, else 0 (the reference checks the scales first: the largest flag names the error)."""
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
    bad_code = tl.where(inside, q > 2 * QMAX, q != 0) & in_pad
    s16 = tl.load(scale_ptr + i % n_chan, mask=inside, other=0.0).to(tl.float32)
    bad_scale = inside & ((s16 != s16) | (s16 == float("inf")) | (s16 < 0))
    bad = tl.where(bad_scale, 2, bad_code.to(tl.int32))
    tl.store(bad_ptr + pid, tl.max(bad, axis=0).to(tl.uint8))
    y = (q.to(tl.float32) - QMAX) * (s16 * pow2)
    if OUT_BF16:
        tl.store(out_ptr + i, to_bf16_rne(y), mask=inside)
    else:
        tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=inside)


def _block() -> int:
    return 65536 if _interpreting() else 4096


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
    if x2.stride(1) != 1 or x2.stride(0) != c:
        x2 = x2.contiguous()
    n_rows, n = x2.shape[0], x.numel()
    n_pad = padded_count(n)
    dev = x.device
    if _interpreting():  # its cost is per program: few, large blocks
        cb = min(triton.next_power_of_2(c), 1024)
        tb = min(triton.next_power_of_2(n_rows), max(16, 262144 // cb))
    else:
        tb, cb = 64, 256
    grid = (triton.cdiv(n_rows, tb), triton.cdiv(c, cb))
    part = torch.empty(grid[0], c, dtype=torch.float32, device=dev)
    badp = torch.empty(grid, dtype=torch.uint8, device=dev)
    ratio = torch.empty(c, dtype=torch.float32, device=dev)
    status = torch.empty(4, dtype=torch.int32, device=dev)  # bad input / scale overflow bits, max ratio bits, e
    out = torch.empty(2 * c + packed_nbytes(n, params.bits), dtype=torch.uint8, device=dev)
    _colmax_kernel[grid](x2, x2.stride(0), n_rows, c, part, badp, status, TB=tb, CB=cb)
    _ratio_kernel[(grid[1],)](part, badp, grid[0], c, ratio, status, QMAX=params.qmax, CB=cb, PB=16)
    block = _block()
    _naive_encode_kernel[(triton.cdiv(n_pad, block),)](
        x2.reshape(-1), ratio, status, out[: 2 * c].view(torch.float16), out[2 * c :], n, n_pad, c, BLOCK=block,
        **_constexprs(params),
    )
    bad, _, e = status.tolist()[:3]  # the one synchronization
    if bad & 1:
        check_finite(x, "naive")  # raises with the reference's message
    if bad & 2:
        raise CodecError("naive: per-channel scale overflowed fp16")
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
        codes, scale16, 2.0**e, out, bad, n, n_pad, c, BLOCK=block, OUT_BF16=dtype == torch.bfloat16,
        **_constexprs(params)
    )
    worst = int(bad.max())  # the one synchronization
    if worst == 2:
        raise CodecError("naive payload is corrupt: negative or non-finite scale")
    if worst == 1:
        raise CodecError("naive payload is corrupt: code out of range or non-zero padding")
    return out.reshape(shape)
