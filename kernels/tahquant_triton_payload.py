"""TAH-Quant in Triton, the kernels that write and read the version-1 payload (tahquant_triton
launches them): encode (quantize and pack a block's tiles), assemble (the payload's front sections),
bitcount (the bitmaps' popcounts) and decode (validate, unpack, dequantize, undo the transform)."""

from __future__ import annotations

import triton
import triton.language as tl

from .tahquant_triton_parts import (_block_rows, _hadamard, _load_pivots, _load_plane, _pivot_plane, _popcount8,
                                    _store_plane, _swap_first)
from .triton_util import round_half_even, to_bf16_rne


@triton.jit
def _encode_kernel(
    x_ptr, stride_x, n_tokens, n_chan, n_tpt,  # input (tokens, C) with unit channel stride; T tiles per token
    flag_ptr, piv_ptr, cum_ptr,  # per tile: outlier flag, pivot (stats pass); inclusive count of flagged tiles
    low_ptr,  # uint8 per token: 1 -> bits_low
    off_ptr,  # int64 per token: byte offset of its first code block in codes_ptr
    codes_ptr, n_codes,  # uint8: the payload's tile-code section (no store reaches past it)
    zero_ptr, scale_ptr,  # float16 per tile
    compact_ptr,  # uint8: the pivots of the flagged tiles, in tile order
    status_ptr,  # int32: bit0 non-finite input, bit1 fp16 overflow (or-ed in)
    G: tl.constexpr, ROWS: tl.constexpr, TC: tl.constexpr, BH: tl.constexpr, BL: tl.constexpr,
    W8: tl.constexpr, W4: tl.constexpr, W2: tl.constexpr, W1: tl.constexpr,
    HK: tl.constexpr, RSQRT: tl.constexpr, POW4: tl.constexpr,
):
    BR: tl.constexpr = ROWS * TC
    rows, t, rvalid = _block_rows(n_tokens, n_tpt, ROWS, TC, True)
    j = tl.arange(0, G)
    ch = t[:, None] * G + j[None, :]
    m = rvalid[:, None] & (ch < n_chan)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + ch, mask=m, other=0.0).to(tl.float32)
    tile = rows64 * n_tpt + t

    bad_e = (x != x) | (tl.abs(x) == float("inf"))
    bad_in = tl.max(bad_e.to(tl.int32), axis=1) > 0
    x = tl.where(bad_e, 0.0, x)

    # outlier tiles (flag and pivot from the stats pass): pivot swap, then the Hadamard transform
    flag = tl.load(flag_ptr + tile, mask=rvalid, other=0) != 0
    pivot = tl.load(piv_ptr + tile, mask=rvalid, other=0).to(tl.int32)
    y = _swap_first(x, j, pivot, flag)
    if tl.max(flag.to(tl.int32), axis=0) > 0:
        y = tl.where(flag[:, None], _hadamard(y, BR, G, HK, RSQRT, POW4), y)

    # fp16 zero = min, fp16 scale = (max - min) / qmax, rounded before quantizing
    low = tl.load(low_ptr + rows64, mask=rvalid, other=0)
    bits = tl.where(low != 0, BL, BH)
    qmax = ((1 << bits) - 1).to(tl.float32)
    lo = tl.min(y, axis=1)
    hi = tl.max(y, axis=1)
    zero16 = lo.to(tl.float16)
    scale16 = tl.math.div_rn(hi - lo, qmax).to(tl.float16)
    zf = zero16.to(tl.float32)
    sf = scale16.to(tl.float32)
    bad16 = (tl.abs(zf) == float("inf")) | (sf == float("inf"))
    zf = tl.where(bad16, 0.0, zf)
    sf = tl.where(bad16, 0.0, sf)

    pos = sf > 0
    u = tl.math.div_rn(y - zf[:, None], tl.where(pos, sf, 1.0)[:, None])
    u = tl.where(pos[:, None], u, 0.0)
    u = tl.minimum(tl.maximum(u, 0.0), qmax[:, None])
    q = round_half_even(u)

    tile_off = tl.load(off_ptr + rows64, mask=rvalid, other=0) + t * (bits * (G // 8))
    if W8:
        _store_plane(codes_ptr, n_codes, tile_off, q, bits, rvalid, BR, G, 8)
    if W4:
        _store_plane(codes_ptr, n_codes, tile_off, q, bits, rvalid, BR, G, 4)
    if W2:
        _store_plane(codes_ptr, n_codes, tile_off, q, bits, rvalid, BR, G, 2)
    if W1:
        _store_plane(codes_ptr, n_codes, tile_off, q, bits, rvalid, BR, G, 1)

    tl.store(zero_ptr + tile, zero16, mask=rvalid)
    tl.store(scale_ptr + tile, scale16, mask=rvalid)
    k = tl.load(cum_ptr + tile, mask=rvalid & flag, other=1) - 1
    tl.store(compact_ptr + k, pivot.to(tl.uint8), mask=rvalid & flag)
    bad = tl.max(bad_in.to(tl.int32) | (bad16.to(tl.int32) << 1), axis=0)
    if bad != 0:
        tl.atomic_or(status_ptr, bad)


@triton.jit
def _assemble_kernel(
    out_ptr, low_ptr, flag_ptr, zs_ptr, compact_ptr, cum_ptr, status_ptr,
    n_alloc, nt, bm_a, bm_f, head, piv_max,
    PBITS: tl.constexpr, P8: tl.constexpr, P4: tl.constexpr, P2: tl.constexpr, P1: tl.constexpr, BLK: tl.constexpr,
):
    """The payload's front, bytes r of [allocation bitmap | flag bitmap | zero | scale | pivots],
    written just before the codes: at out[piv_max - piv_len + r], where piv_len is the packed
    size of the n_flag pivots (cum[nt - 1]); the codes were written at out[head + piv_max]. The
    pivots are packed in planes (P<w>: bit offset of the width-w plane, -1 if absent)."""
    pid = tl.program_id(0)
    n_flag = tl.load(cum_ptr + nt - 1)
    n_pad = (n_flag + 7) // 8 * 8
    piv_len = n_pad * PBITS // 8
    if pid == 0:
        tl.store(status_ptr + 1, n_flag)
    r = pid.to(tl.int64) * BLK + tl.arange(0, BLK)
    m8 = tl.arange(0, 8)
    in_a = r < bm_a
    in_f = (r >= bm_a) & (r < bm_a + bm_f)
    ea = r[:, None] * 8 + m8[None, :]
    bits = tl.load(low_ptr + ea, mask=in_a[:, None] & (ea < n_alloc), other=0).to(tl.int32)
    ef = ea - bm_a * 8
    bits |= tl.load(flag_ptr + ef, mask=in_f[:, None] & (ef < nt), other=0).to(tl.int32)
    byte = tl.sum(bits << m8[None, :], axis=1)
    zo = r - (bm_a + bm_f)
    in_z = (zo >= 0) & (zo < 4 * nt)
    byte = tl.where(in_z, tl.load(zs_ptr + zo, mask=in_z, other=0).to(tl.int32), byte)
    p = r - head
    if P8 >= 0:
        byte = _pivot_plane(byte, compact_ptr, p, n_flag, n_pad, 8, P8)
    if P4 >= 0:
        byte = _pivot_plane(byte, compact_ptr, p, n_flag, n_pad, 4, P4)
    if P2 >= 0:
        byte = _pivot_plane(byte, compact_ptr, p, n_flag, n_pad, 2, P2)
    if P1 >= 0:
        byte = _pivot_plane(byte, compact_ptr, p, n_flag, n_pad, 1, P1)
    tl.store(out_ptr + (piv_max - piv_len) + r, byte.to(tl.uint8), mask=r < head + piv_len)


@triton.jit
def _bitcount_kernel(pay_ptr, pc_ptr, status_ptr, n_bytes, bm_a, n_alloc, nt, BLK: tl.constexpr):
    """pc[b] = set bits of payload byte b, for the two bitmaps (b < n_bytes). Program 0 writes the
    status words: bit0 / bit1 of word 0 when the padding bits of the allocation / flag bitmap are
    not zero; words 1.. cleared."""
    pid = tl.program_id(0)
    b = pid * BLK + tl.arange(0, BLK)
    m = b < n_bytes
    v = tl.load(pay_ptr + b, mask=m, other=0).to(tl.int32)
    tl.store(pc_ptr + b, _popcount8(v), mask=m)
    if pid == 0:
        a_last = tl.load(pay_ptr + bm_a - 1).to(tl.int32)
        f_last = tl.load(pay_ptr + n_bytes - 1).to(tl.int32)
        a_pad = ((n_alloc % 8) != 0) & ((a_last >> (n_alloc % 8)) != 0)
        f_pad = ((nt % 8) != 0) & ((f_last >> (nt % 8)) != 0)
        w = tl.arange(0, 8)
        tl.store(status_ptr + w, tl.where(w == 0, a_pad.to(tl.int32) | (f_pad.to(tl.int32) << 1), 0))


@triton.jit
def _decode_kernel(
    pay_ptr, n_pay, cum_ptr, status_ptr,  # the payload (n_pay bytes); inclusive prefix sums of pc
    out_ptr, stride_out, n_tokens, n_chan, n_tpt, nt, bm_a, bm_f, head,
    G: tl.constexpr, ROWS: tl.constexpr, TC: tl.constexpr, BH: tl.constexpr, BL: tl.constexpr,
    W8: tl.constexpr, W4: tl.constexpr, W2: tl.constexpr, W1: tl.constexpr,
    HK: tl.constexpr, RSQRT: tl.constexpr, POW4: tl.constexpr, OUT_BF16: tl.constexpr,
    PBITS: tl.constexpr, P8: tl.constexpr, P4: tl.constexpr, P2: tl.constexpr, P1: tl.constexpr,
):
    """Decode a block of ROWS tokens x TC tile columns. The section offsets come from the bitmap
    counts (cum), never trusted: every payload read is masked to the n_pay bytes, so a payload whose
    lengths do not add up decodes to garbage that the host then refuses. Status (or-ed/stored):
    word 1 = a non-finite zero-point or a negative/non-finite scale; program 0 stores word 2 =
    non-zero padding among the pivots, words 3, 4 = INT3 tokens, flagged tiles."""
    BR: tl.constexpr = ROWS * TC
    rows, t, rvalid = _block_rows(n_tokens, n_tpt, ROWS, TC, False)
    j = tl.arange(0, G)
    rows64 = rows.to(tl.int64)
    tile = rows64 * n_tpt + t
    per = n_tpt * (G // 8)  # code bytes of a token per code bit
    n_low = tl.load(cum_ptr + bm_a - 1)
    n_flag = tl.load(cum_ptr + bm_a + bm_f - 1) - n_low
    n_pad = (n_flag + 7) // 8 * 8
    codes0 = head + n_pad * PBITS // 8

    # the token's bit width and its code offset: tokens before it at BH bits, less the INT3 ones
    ab = rows64 // 8
    abyte = tl.load(pay_ptr + ab, mask=rvalid, other=0).to(tl.int32)
    ebit = (rows64 % 8).to(tl.int32)
    low = (abyte >> ebit) & 1
    prior = tl.load(cum_ptr + ab - 1, mask=rvalid & (ab > 0), other=0) + _popcount8(abyte & ((1 << ebit) - 1))
    bits = tl.where(low != 0, BL, BH)
    tile_off = codes0 + rows64 * (BH * per) - prior.to(tl.int64) * ((BH - BL) * per) + t * (bits * (G // 8))

    # the tile's flag and, if flagged, its pivot: the k-th of the packed pivots
    fb = tile // 8
    fbyte = tl.load(pay_ptr + bm_a + fb, mask=rvalid, other=0).to(tl.int32)
    tbit = (tile % 8).to(tl.int32)
    flag = ((fbyte >> tbit) & 1) != 0
    k = tl.load(cum_ptr + bm_a + fb - 1, mask=rvalid, other=0) - n_low + _popcount8(fbyte & ((1 << tbit) - 1))
    pivot = _load_pivots(pay_ptr, n_pay, head, k, n_pad, rvalid & flag, P8, P4, P2, P1)

    # fp16 zero-point and scale from their byte pairs (the sections have no alignment)
    zo = bm_a + bm_f + 2 * tile
    so = zo + 2 * nt
    z16 = (tl.load(pay_ptr + zo, mask=rvalid, other=0).to(tl.int32)
           | (tl.load(pay_ptr + zo + 1, mask=rvalid, other=0).to(tl.int32) << 8))
    s16 = (tl.load(pay_ptr + so, mask=rvalid, other=0).to(tl.int32)
           | (tl.load(pay_ptr + so + 1, mask=rvalid, other=0).to(tl.int32) << 8))
    zf = z16.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    sf = s16.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    zs_bad = rvalid & ((zf != zf) | (tl.abs(zf) == float("inf")) | (sf != sf) | (sf == float("inf")) | (sf < 0))
    if tl.max(zs_bad.to(tl.int32), axis=0) > 0:
        tl.atomic_or(status_ptr + 1, 1)

    q = tl.zeros([BR, G], dtype=tl.int32)
    if W8:
        q = _load_plane(q, pay_ptr, n_pay, tile_off, bits, rvalid, j, G, 8)
    if W4:
        q = _load_plane(q, pay_ptr, n_pay, tile_off, bits, rvalid, j, G, 4)
    if W2:
        q = _load_plane(q, pay_ptr, n_pay, tile_off, bits, rvalid, j, G, 2)
    if W1:
        q = _load_plane(q, pay_ptr, n_pay, tile_off, bits, rvalid, j, G, 1)

    y = q.to(tl.float32) * sf[:, None] + zf[:, None]  # q * scale is exact: an FMA changes nothing
    if tl.max(flag.to(tl.int32), axis=0) > 0:
        y = tl.where(flag[:, None], _hadamard(y, BR, G, HK, RSQRT, POW4), y)
        y = _swap_first(y, j, pivot, flag)

    ch = t[:, None] * G + j[None, :]
    m = rvalid[:, None] & (ch < n_chan)
    dst = out_ptr + rows64[:, None] * stride_out + ch
    if OUT_BF16:
        tl.store(dst, to_bf16_rne(y), mask=m)
    else:
        tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=m)

    if tl.program_id(0) == 0:  # the padding codes after the last pivot must be zero
        kk = n_flag + tl.arange(0, 8)
        inpad = kk < n_pad
        v = _load_pivots(pay_ptr, n_pay, head, kk, n_pad, inpad, P8, P4, P2, P1)
        w = tl.arange(0, 4)
        word = tl.where(w == 0, tl.max((inpad & (v != 0)).to(tl.int32), axis=0), tl.where(w == 1, n_low, n_flag))
        tl.store(status_ptr + 2 + w, word, mask=w < 3)
