"""TAH-Quant in Triton: the same version-1 payload as tahquant_ref, byte for byte, from fused kernels.

encode(x (..., C), params) -> uint8 payload       decode(payload, shape, params, dtype) -> (shape)

Encode, per-token allocation (the default; sequences of up to SEQ_MAX tokens), is six kernels and
one scan, with one synchronization at the end:
  1. stats: per token its fp32 entropy (a proven error bound, entropy_slack), per tile the outlier
     flag and pivot; torch.cumsum then numbers the flagged tiles;
  2. cut: per sequence, the two entropies around the INT3/INT4 cut (bitwise binary search); the
     tokens within twice the error bound of the cut are the only ones whose side is uncertain;
  3. refine: one program per uncertain token recomputes its entropy in float64 (the reference's
     formula);
  4. alloc: per sequence, the INT3 tokens (those surely below the cut, then the uncertain ones in
     float64 order, ties to the lower index) and each token's byte offset among the codes;
  5. encode: per block of tokens x one tile column, pivot swap, Hadamard as tl.dot with a Sylvester
     matrix built in registers, fp16 min/scale, round half to even, bit-plane packing straight
     into the payload; the pivots of flagged tiles go to their compacted place;
  6. assemble: the bitmaps, zero-points, scales and packed pivots in front of the codes.
The rare cases the fast ranking cannot settle (more uncertain tokens than NSLOT), per-tile
allocation and longer sequences rank in torch (rank_low, then the reference's exact ranking).

Decode is two kernels and one scan: bitmap popcounts, their prefix sums (every entry's code offset
and every flagged tile's pivot index), then one fused kernel that validates and unpacks,
dequantizes, inverts the Hadamard, swaps back and stores in the output dtype; a corrupt payload
raises CodecError with the reference's message, in the reference's order, after that one sync.

The only intended difference from the reference: the Hadamard product is an fp32 tl.dot here and a
float64 product rounded once there, so a value on a flagged tile can differ by a few fp32 ulps (see
docs/wire-format.md for what that does to the codes)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .bitpack import packed_nbytes, plane_widths
from .quant_ref import check_finite, fp16_min_scale
from .tahquant_ref import ALLOC_TOKEN, Layout, TahQuantParams, check_min_payload, low_bit_mask, token_entropy
from .triton_util import interpreting as _interpreting
from .triton_util import on_device, round_half_even, to_bf16_rne
from .wire import CodecError, PayloadReader

__all__ = ["encode", "decode", "entropies", "rank_low", "entropy_slack", "SEQ_MAX", "NSLOT"]

SEQ_MAX = 8192  # longest sequence the in-kernel allocation ranks (one program holds all its entropies)
# values per program (ROWS x G) and warps per program of the encode and decode kernels on a GPU:
# measured on an H100 (docs/benchmarks-log.md, "Kernel block sizes"); 2048 values in 4 warps spilled registers
GPU_ENCODE_BLOCK = (1024, 8)
GPU_DECODE_BLOCK = (1024, 4)
NSLOT = 64      # uncertain tokens per sequence the refine kernel recomputes in float64


# ---------------------------------------------------------------------------------------------
# device helpers shared by the kernels


@triton.jit
def _hadamard(y, BR: tl.constexpr, G: tl.constexpr, K: tl.constexpr, RSQRT: tl.constexpr, POW4: tl.constexpr):
    """y (BR, G) float32 -> y @ H_G / sqrt(G). tl.dot in fp32 with H_K (K = min(G, 64)) on each
    chunk of K channels, then (G > K) a ±1 combination across the G/K chunks: H_G = H_{G/K} (x) H_K."""
    i = tl.arange(0, K)
    v = i[:, None] & i[None, :]
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    h = 1.0 - 2.0 * (v & 1).to(tl.float32)  # (-1)**popcount(i & j), i, j < 64
    if G == K:
        if K >= 16:
            z = tl.dot(y, h, input_precision="ieee")
        else:  # tl.dot needs K >= 16: a broadcast product for G = 8
            z = tl.sum(y[:, :, None] * h[None, :, :], axis=1)
    else:
        NC: tl.constexpr = G // K
        z = tl.dot(tl.reshape(y, (BR * NC, K)), h, input_precision="ieee")
        z = tl.reshape(z, (BR, NC, K))
        c = tl.arange(0, NC)
        vc = c[:, None] & c[None, :]
        vc = vc ^ (vc >> 1)  # NC <= 4
        hc = 1.0 - 2.0 * (vc & 1).to(tl.float32)
        z = tl.sum(z[:, :, None, :] * hc[None, :, :, None], axis=1)
        z = tl.reshape(z, (BR, G))
    if POW4:  # 1/sqrt(G) is a power of two: exact
        z = z * RSQRT
    else:  # one rounding of the fp32 sum divided by sqrt(G) in float64, as the reference does
        z = (z.to(tl.float64) * RSQRT).to(tl.float32)
    return z


@triton.jit
def _swap_first(y, j, pivot, flag):
    """Swap column 0 with column `pivot` on the flagged rows (its own inverse)."""
    y0 = tl.max(tl.where(j[None, :] == 0, y, -float("inf")), axis=1)
    yp = tl.max(tl.where(j[None, :] == pivot[:, None], y, -float("inf")), axis=1)
    at0 = flag[:, None] & (j[None, :] == 0)
    atp = flag[:, None] & (j[None, :] == pivot[:, None])
    return tl.where(at0, yp[:, None], tl.where(atp, y0[:, None], y))


@triton.jit
def _store_plane(out_ptr, n_out, tile_off, q, bits, rvalid, BR: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
    """Store the width-W plane of the codes q (BR, G) int32 of `bits`-bit rows: 8/W values per
    byte, least significant first, at byte tile_off + (bit offset of the plane) * G/8. Planes go
    from the low bits up: 8, or 4, 2, 1 as present in `bits`. Nothing at or past byte n_out."""
    if W == 8:
        present = (bits == 8) & rvalid
        shift = bits * 0
        packed = q
    else:
        present = (bits < 8) & ((bits & W) != 0) & rvalid
        shift = bits & (7 & ~(2 * W - 1))
        PER: tl.constexpr = 8 // W
        v3 = tl.reshape((q >> shift[:, None]) & ((1 << W) - 1), (BR, G // PER, PER))
        packed = tl.sum(v3 << (tl.arange(0, PER) * W)[None, None, :], axis=2)
    NB: tl.constexpr = G * W // 8
    off = (tile_off + shift * (G // 8))[:, None] + tl.arange(0, NB)[None, :]
    tl.store(out_ptr + off, packed.to(tl.uint8), mask=present[:, None] & (off < n_out))


@triton.jit
def _load_plane(q, pay_ptr, n_pay, tile_off, bits, rvalid, j, G: tl.constexpr, W: tl.constexpr):
    """q | (the width-W plane of each row's code block, shifted into place); see _store_plane.
    Nothing at or past byte n_pay of the payload is read."""
    if W == 8:
        present = (bits == 8) & rvalid
        shift = bits * 0
    else:
        present = (bits < 8) & ((bits & W) != 0) & rvalid
        shift = bits & (7 & ~(2 * W - 1))
    PER: tl.constexpr = 8 // W
    off = (tile_off + shift * (G // 8))[:, None] + (j // PER)[None, :]
    b = tl.load(pay_ptr + off, mask=present[:, None] & (off < n_pay), other=0).to(tl.int32)
    v = (b >> ((j % PER) * W)[None, :]) & ((1 << W) - 1)
    return q | (v << shift[:, None])


@triton.jit
def _block_rows(n_tokens, n_tpt, ROWS: tl.constexpr, TC: tl.constexpr, REVERSE: tl.constexpr):
    """The (token, tile column) of each of the ROWS*TC rows of this program's block: ROWS tokens x
    TC consecutive tile columns, row r = (token r // TC, column r % TC). REVERSE walks the blocks
    from the end: what the stats pass read last is then read first, while it is still in L2."""
    pid = tl.program_id(0)
    if REVERSE:
        pid = tl.num_programs(0) - 1 - pid
    n_tcb = tl.cdiv(n_tpt, TC)
    r = tl.arange(0, ROWS * TC)
    rows = (pid // n_tcb) * ROWS + r // TC
    t = (pid % n_tcb) * TC + r % TC
    return rows, t, (rows < n_tokens) & (t < n_tpt)


@triton.jit
def _popcount8(v):
    """Set bits of each byte value (int32 in 0..255)."""
    v = v - ((v >> 1) & 0x55)
    v = (v & 0x33) + ((v >> 2) & 0x33)
    return (v + (v >> 4)) & 0x0F


@triton.jit
def _pivot_plane(byte, compact_ptr, p, n_flag, n_pad, W: tl.constexpr, SHIFT: tl.constexpr):
    """Bytes p (relative to the pivot section) of the width-W plane of the packed pivots, from the
    compacted pivots (k-th flagged tile's pivot at compact[k], k < n_flag; zero past it)."""
    PER: tl.constexpr = 8 // W
    q = p - n_pad * SHIFT // 8
    inside = (q >= 0) & (q < n_pad // PER)
    m = tl.arange(0, PER)
    k = q[:, None] * PER + m[None, :]
    v = tl.load(compact_ptr + k, mask=inside[:, None] & (k < n_flag), other=0).to(tl.int32)
    packed = tl.sum(((v >> SHIFT) & ((1 << W) - 1)) << (m * W)[None, :], axis=1)
    return tl.where(inside, packed, byte)


@triton.jit
def _load_pivot(v, pay_ptr, n_pay, piv0, k, n_pad, mask, W: tl.constexpr, SHIFT: tl.constexpr):
    """v | the width-W plane's bits of pivot k, read from the packed section at byte piv0."""
    PER: tl.constexpr = 8 // W
    off = piv0 + n_pad * SHIFT // 8 + k // PER
    b = tl.load(pay_ptr + off, mask=mask & (off < n_pay), other=0).to(tl.int32)
    return v | (((b >> ((k % PER) * W)) & ((1 << W) - 1)) << SHIFT)


@triton.jit
def _load_pivots(pay_ptr, n_pay, piv0, k, n_pad, mask, P8: tl.constexpr, P4: tl.constexpr, P2: tl.constexpr,
                 P1: tl.constexpr):
    """Pivots k (int32) from the packed section at byte piv0, every plane (P<w>: bit offset of the
    width-w plane, -1 if absent); 0 where masked."""
    v = tl.zeros_like(k)
    if P8 >= 0:
        v = _load_pivot(v, pay_ptr, n_pay, piv0, k, n_pad, mask, 8, P8)
    if P4 >= 0:
        v = _load_pivot(v, pay_ptr, n_pay, piv0, k, n_pad, mask, 4, P4)
    if P2 >= 0:
        v = _load_pivot(v, pay_ptr, n_pay, piv0, k, n_pad, mask, 2, P2)
    if P1 >= 0:
        v = _load_pivot(v, pay_ptr, n_pay, piv0, k, n_pad, mask, 1, P1)
    return v


# ---------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _stats_kernel(
    x_ptr, stride_x, ent_ptr, flag_ptr, piv_ptr, status_ptr,
    n_entries, n_seg, seg_len, n_chan, n_tpt, tau,
    G: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, NCHUNK: tl.constexpr,
):
    """Per allocation entry e (a token: n_seg = 1, seg_len = C; a tile: n_seg = T, seg_len = G) of
    token e // n_seg: H = -sum p ln p, p = |x| / sum |x|, in float32. Per tile of G channels: the
    outlier flag (largest |x| > 0 and >= tau x the largest of the others) and the pivot (first
    index of the largest |x|), with non-finite inputs counted as 0 (encode refuses them later).
    NCHUNK = cdiv(seg_len, BLOCK) is a constexpr (a loop bound that is a kernel argument breaks
    triton 3.6's interpreter under numpy 2). Program 0 clears the status words."""
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(status_ptr + tl.arange(0, 4), tl.zeros([4], dtype=tl.int32))
    TPB: tl.constexpr = BLOCK // G
    e = pid * ROWS + tl.arange(0, ROWS)
    ev = e < n_entries
    tok = (e // n_seg).to(tl.int64)
    c0 = (e % n_seg) * seg_len
    cend = tl.minimum(c0 + seg_len, n_chan)
    rowp = x_ptr + tok * stride_x
    k = tl.arange(0, BLOCK)
    j = tl.arange(0, G)
    # the tiles of a chunk, row-major: (entry, tile of the chunk)
    r = tl.arange(0, ROWS * TPB)
    t_tok = tl.reshape(tl.broadcast_to(tok[:, None], (ROWS, TPB)), (ROWS * TPB,))
    t_c0 = tl.reshape(tl.broadcast_to(c0[:, None], (ROWS, TPB)), (ROWS * TPB,))
    t_end = tl.reshape(tl.broadcast_to(cend[:, None], (ROWS, TPB)), (ROWS * TPB,))
    t_ev = tl.reshape(tl.broadcast_to(ev[:, None], (ROWS, TPB)), (ROWS * TPB,))
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for s in range(NCHUNK):
        ch = c0[:, None] + s * BLOCK + k[None, :]
        m = ev[:, None] & (ch < cend[:, None])
        v = tl.load(rowp[:, None] + ch, mask=m, other=0.0).to(tl.float32)
        a = tl.abs(v)
        acc += a
        mag = tl.reshape(tl.where((a == float("inf")) | (v != v), 0.0, a), (ROWS * TPB, G))
        peak = tl.max(mag, axis=1)
        pivot = tl.min(tl.where(mag == peak[:, None], j[None, :], G), axis=1)
        second = tl.max(tl.where(j[None, :] == pivot[:, None], -1.0, mag), axis=1)
        flag = (peak > 0) & (peak >= tau * second)
        ch0 = t_c0 + s * BLOCK + (r % TPB) * G
        tile = t_tok * n_tpt + ch0 // G
        tv = t_ev & (ch0 < t_end)
        tl.store(flag_ptr + tile, flag.to(tl.uint8), mask=tv)
        tl.store(piv_ptr + tile, pivot.to(tl.uint8), mask=tv)
    total = tl.sum(acc, axis=1)
    tsafe = tl.where(total > 0, total, 1.0)
    acc2 = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for s in range(NCHUNK):
        ch = c0[:, None] + s * BLOCK + k[None, :]
        m = ev[:, None] & (ch < cend[:, None])
        a = tl.abs(tl.load(rowp[:, None] + ch, mask=m, other=0.0).to(tl.float32))
        p = tl.math.div_rn(a, tsafe[:, None])
        acc2 += tl.where(p > 0, p * tl.log(tl.where(p > 0, p, 1.0)), 0.0)
    h = tl.where(total > 0, -tl.sum(acc2, axis=1), 0.0)
    tl.store(ent_ptr + e, h, mask=ev)


@triton.jit
def _cut_kernel(
    ent_ptr, seq_len, n_low, slack2, n_slots, thr_ptr, cnt_ptr, cand_i_ptr, status_ptr,
    SB: tl.constexpr, NSLOT: tl.constexpr,
):
    """Program q: from the fp32 entropies e of sequence q (|e - exact| <= slack2 / 2), a = the
    n_low-th and b = the (n_low+1)-th smallest. A token with e < b - slack2 is surely among the
    n_low lowest, one with e > a + slack2 surely not; the others are uncertain. Writes the
    thresholds (b - slack2, a + slack2), the counts of sure and of uncertain tokens, the uncertain
    tokens in index order to cand_i[q, :n_slots], and sets status bit 4 when there are more."""
    seq = tl.program_id(0)
    i = tl.arange(0, SB)
    valid = i < seq_len
    e = tl.load(ent_ptr + seq.to(tl.int64) * seq_len + i, mask=valid, other=0.0)
    e = tl.where(e > 0, e, 0.0)  # -0.0 and the NaN of a non-finite token (encode refuses it) as 0
    # entropies are >= 0, so their bit patterns order like their values
    key = tl.where(valid, e.to(tl.int32, bitcast=True), 0x7FFFFFFF)
    lo_a = tl.full((), 0, tl.int32)
    hi_a = tl.full((), 0x7FFFFFFF, tl.int32)
    lo_b = tl.full((), 0, tl.int32)
    hi_b = tl.full((), 0x7FFFFFFF, tl.int32)
    for _ in range(31):  # the smallest key with at least n_low (n_low + 1) keys at or below it
        mid_a = lo_a + (hi_a - lo_a) // 2
        ok_a = tl.sum((key <= mid_a).to(tl.int32), axis=0) >= n_low
        hi_a = tl.where(ok_a, mid_a, hi_a)
        lo_a = tl.where(ok_a, lo_a, mid_a + 1)
        mid_b = lo_b + (hi_b - lo_b) // 2
        ok_b = tl.sum((key <= mid_b).to(tl.int32), axis=0) >= n_low + 1
        hi_b = tl.where(ok_b, mid_b, hi_b)
        lo_b = tl.where(ok_b, lo_b, mid_b + 1)
    lo_thr = lo_b.to(tl.float32, bitcast=True).to(tl.float64) - slack2
    hi_thr = lo_a.to(tl.float32, bitcast=True).to(tl.float64) + slack2
    edge = tl.where(n_low == 0, -float("inf"), float("inf"))  # nothing low, or everything
    lo_thr = tl.where((n_low == 0) | (n_low >= seq_len), edge, lo_thr)
    hi_thr = tl.where((n_low == 0) | (n_low >= seq_len), edge, hi_thr)
    ef = e.to(tl.float64)
    amb = valid & (ef >= lo_thr) & (ef <= hi_thr)
    n_amb = tl.sum(amb.to(tl.int32), axis=0)
    tl.store(thr_ptr + 2 * seq, lo_thr)
    tl.store(thr_ptr + 2 * seq + 1, hi_thr)
    tl.store(cnt_ptr + 2 * seq, tl.sum((valid & (ef < lo_thr)).to(tl.int32), axis=0))
    tl.store(cnt_ptr + 2 * seq + 1, n_amb)
    rank = tl.cumsum(amb.to(tl.int32), axis=0) - 1
    tl.store(cand_i_ptr + seq * NSLOT + rank, i, mask=amb & (rank < n_slots))
    if n_amb > n_slots:
        tl.atomic_or(status_ptr, 4)


@triton.jit
def _refine_kernel(x_ptr, stride_x, seq_len, n_chan, cnt_ptr, cand_e_ptr, cand_i_ptr, NSLOT: tl.constexpr,
                   CB: tl.constexpr, NCB: tl.constexpr):
    """Program (q, k): the float64 entropy of the k-th uncertain token of sequence q, computed like
    the reference: cand_e/cand_i[q, k] = (entropy, token), (inf, 2^31 - 1) for an empty slot."""
    seq = tl.program_id(0)
    slot = tl.program_id(1)
    has = slot < tl.load(cnt_ptr + 2 * seq + 1)
    tok = tl.load(cand_i_ptr + seq * NSLOT + slot, mask=has, other=0)
    width = tl.where(has, n_chan, 0)  # an empty slot reads nothing
    row = x_ptr + (seq.to(tl.int64) * seq_len + tok) * stride_x
    c = tl.arange(0, CB)
    acc = tl.zeros([CB], dtype=tl.float64)
    for s in range(NCB):
        ch = s * CB + c
        acc += tl.abs(tl.load(row + ch, mask=ch < width, other=0.0).to(tl.float32)).to(tl.float64)
    total = tl.sum(acc, axis=0)
    tsafe = tl.where(total > 0, total, 1.0)
    acc2 = tl.zeros([CB], dtype=tl.float64)
    for s in range(NCB):
        ch = s * CB + c
        a = tl.abs(tl.load(row + ch, mask=ch < width, other=0.0).to(tl.float32)).to(tl.float64)
        p = a / tsafe
        acc2 += tl.where(p > 0, p * tl.log(tl.where(p > 0, p, 1.0)), 0.0)
    h = tl.where(total > 0, -tl.sum(acc2, axis=0), 0.0)
    tl.store(cand_e_ptr + seq * NSLOT + slot, tl.where(has, h, float("inf")))
    tl.store(cand_i_ptr + seq * NSLOT + slot, tl.where(has, tok, 0x7FFFFFFF))


@triton.jit
def _alloc_kernel(
    ent_ptr, thr_ptr, cnt_ptr, cand_e_ptr, cand_i_ptr, low_ptr, off_ptr,
    seq_len, n_low, n_slots, seq_bytes, tok_bytes, diff_bytes,
    SB: tl.constexpr, NSLOT: tl.constexpr,
):
    """Program q: the INT3 tokens of sequence q, the reference's low_bit_mask: the sure ones and
    the n_low - n_sure uncertain ones first in (float64 entropy, index) order. low[token] = 1 for
    INT3; off[token] = byte offset of its codes = q * seq_bytes + i * tok_bytes - (INT3 tokens
    before it) * diff_bytes."""
    seq = tl.program_id(0)
    i = tl.arange(0, SB)
    valid = i < seq_len
    base = seq.to(tl.int64) * seq_len
    e = tl.load(ent_ptr + base + i, mask=valid, other=0.0)
    ef = tl.where(e > 0, e, 0.0).to(tl.float64)  # as the cut kernel saw them
    lo_thr = tl.load(thr_ptr + 2 * seq)
    hi_thr = tl.load(thr_ptr + 2 * seq + 1)
    need = n_low - tl.load(cnt_ptr + 2 * seq)
    k = tl.arange(0, NSLOT)
    ce = tl.load(cand_e_ptr + seq * NSLOT + k, mask=k < n_slots, other=float("inf"))
    ci = tl.load(cand_i_ptr + seq * NSLOT + k, mask=k < n_slots, other=0x7FFFFFFF)
    # the need-th uncertain token in (entropy, index) order: the last one that goes low
    before = (ce[None, :] < ce[:, None]) | ((ce[None, :] == ce[:, None]) & (ci[None, :] < ci[:, None]))
    last = tl.sum(before.to(tl.int32), axis=1) == need - 1
    cut_e = tl.sum(tl.where(last, ce, 0.0), axis=0)
    cut_i = tl.sum(tl.where(last, ci, 0), axis=0)
    amb = valid & (ef >= lo_thr) & (ef <= hi_thr)
    slot = tl.cumsum(amb.to(tl.int32), axis=0) - 1
    e64 = tl.load(cand_e_ptr + seq * NSLOT + slot, mask=amb & (slot < n_slots), other=float("inf"))
    chosen = amb & (need > 0) & ((e64 < cut_e) | ((e64 == cut_e) & (i <= cut_i)))
    # more uncertain tokens than slots (status bit 4: the host ranks again): still exactly need
    # of them, so that the codes fill their section exactly
    chosen = tl.where(need > n_slots, amb & (slot < need), chosen)
    low = ((valid & (ef < lo_thr)) | chosen).to(tl.int32)
    prior = (tl.cumsum(low, axis=0) - low).to(tl.int64)
    off = seq.to(tl.int64) * seq_bytes + i.to(tl.int64) * tok_bytes - prior * diff_bytes
    tl.store(low_ptr + base + i, low.to(tl.uint8), mask=valid)
    tl.store(off_ptr + base + i, off, mask=valid)


@triton.jit
def _encode_kernel(
    x_ptr, stride_x, n_tokens, n_chan, n_tpt,  # input (tokens, C) with unit channel stride; T tiles per token
    flag_ptr, piv_ptr, cum_ptr,  # per tile: outlier flag, pivot (stats pass); inclusive count of flagged tiles
    low_ptr,  # uint8 per allocation entry (token, or tile when ALLOC_TILE): 1 -> bits_low
    off_ptr,  # int64 per allocation entry: byte offset of its first code block in codes_ptr
    codes_ptr, n_codes,  # uint8: the payload's tile-code section (no store reaches past it)
    zero_ptr, scale_ptr,  # float16 per tile
    compact_ptr,  # uint8: the pivots of the flagged tiles, in tile order
    status_ptr,  # int32: bit0 non-finite input, bit1 fp16 overflow (or-ed in)
    G: tl.constexpr, ROWS: tl.constexpr, TC: tl.constexpr, BH: tl.constexpr, BL: tl.constexpr,
    TOKEN_ALLOC: tl.constexpr,
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
    if TOKEN_ALLOC:
        entry = rows64
    else:
        entry = tile
    low = tl.load(low_ptr + entry, mask=rvalid, other=0)
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

    tile_off = tl.load(off_ptr + entry, mask=rvalid, other=0)
    if TOKEN_ALLOC:
        tile_off += t * (bits * (G // 8))
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
    TOKEN_ALLOC: tl.constexpr,
    W8: tl.constexpr, W4: tl.constexpr, W2: tl.constexpr, W1: tl.constexpr,
    HK: tl.constexpr, RSQRT: tl.constexpr, POW4: tl.constexpr, OUT_BF16: tl.constexpr,
    PBITS: tl.constexpr, P8: tl.constexpr, P4: tl.constexpr, P2: tl.constexpr, P1: tl.constexpr,
):
    """Decode a block of ROWS tokens x TC tile columns. The section offsets come from the bitmap
    counts (cum), never trusted: every payload read is masked to the n_pay bytes, so a payload whose
    lengths do not add up decodes to garbage that the host then refuses. Status (or-ed/stored):
    word 1 = a non-finite zero-point or a negative/non-finite scale; program 0 stores word 2 =
    non-zero padding among the pivots, words 3, 4 = INT3 entries, flagged tiles."""
    BR: tl.constexpr = ROWS * TC
    rows, t, rvalid = _block_rows(n_tokens, n_tpt, ROWS, TC, False)
    j = tl.arange(0, G)
    rows64 = rows.to(tl.int64)
    tile = rows64 * n_tpt + t
    if TOKEN_ALLOC:
        entry = rows64
        per = n_tpt * (G // 8)  # code bytes of an entry per code bit
    else:
        entry = tile
        per = G // 8
    n_low = tl.load(cum_ptr + bm_a - 1)
    n_flag = tl.load(cum_ptr + bm_a + bm_f - 1) - n_low
    n_pad = (n_flag + 7) // 8 * 8
    codes0 = head + n_pad * PBITS // 8

    # the entry's bit width and its code offset: entries before it at BH bits, less the INT3 ones
    ab = entry // 8
    abyte = tl.load(pay_ptr + ab, mask=rvalid, other=0).to(tl.int32)
    ebit = (entry % 8).to(tl.int32)
    low = (abyte >> ebit) & 1
    prior = tl.load(cum_ptr + ab - 1, mask=rvalid & (ab > 0), other=0) + _popcount8(abyte & ((1 << ebit) - 1))
    bits = tl.where(low != 0, BL, BH)
    tile_off = codes0 + entry * (BH * per) - prior.to(tl.int64) * ((BH - BL) * per)
    if TOKEN_ALLOC:
        tile_off += t * (bits * (G // 8))

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


# ---------------------------------------------------------------------------------------------
# Python side: block sizes, the allocation, and the launches


def _launch_config(params: TahQuantParams, lay: Layout, block: tuple[int, int]) -> tuple[dict, tuple[int], int]:
    """Constexprs, grid and warps per program of the encode/decode kernels. On a GPU a block is ROWS
    tokens x one tile column, `block` = (values, warps) (1024 values: tl.dot gets M = 16 rows): the
    tiles of an outlier channel are flagged down a whole column, so the other blocks mostly skip the
    Hadamard. The interpreter's cost is per program, so there a block spans up to 32768 values over
    several columns."""
    g, t = params.group_size, lay.tiles_per_token
    if _interpreting():
        rows = min(triton.next_power_of_2(lay.tokens), max(16, 32768 // g))
        tc = min(triton.next_power_of_2(t), max(1, 32768 // (g * rows)))
        rows = max(rows, 16 // tc)
    else:  # block[0] values (at most 1024 for G = 8, whose Hadamard is a (ROWS, 8, 8) broadcast product)
        rows, tc = (min(128, block[0] // 8) if g == 8 else max(8, block[0] // g)), 1
    widths = set(plane_widths(params.bits_high)) | set(plane_widths(params.bits_low))
    cx = dict(
        G=g,
        ROWS=rows,
        TC=tc,
        BH=params.bits_high,
        BL=params.bits_low,
        TOKEN_ALLOC=params.alloc == ALLOC_TOKEN,
        W8=8 in widths,
        W4=4 in widths,
        W2=2 in widths,
        W1=1 in widths,
        HK=min(g, 64),
        RSQRT=1.0 / math.sqrt(g),
        POW4=(g.bit_length() - 1) % 2 == 0,
    )
    return cx, (triton.cdiv(lay.tokens, rows) * triton.cdiv(t, tc),), 1 if _interpreting() else block[1]


def _pivot_planes(params: TahQuantParams) -> dict:
    """PBITS and the bit offset P<w> of each plane of width w of the packed pivots (-1 if absent)."""
    shifts, shift = {}, 0
    for w in plane_widths(params.pivot_bits):
        shifts[w] = shift
        shift += w
    return dict(PBITS=params.pivot_bits, **{f"P{w}": shifts.get(w, -1) for w in (8, 4, 2, 1)})


def _byte_block() -> int:
    """Bytes per program of the assemble and bitcount kernels: 256 on a GPU (ptxas -v for sm_90: the
    assemble kernel at 2048 spilled 10 kB per thread at G = 64; at 256 it takes 48 registers, no spill)."""
    return 65536 if _interpreting() else 256


def _rows(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    x2 = x.reshape(lay.tokens, lay.channels)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def _stats_blocks(seg_len: int, g: int) -> tuple[int, int]:
    """(entries per program, chunk width) of the stats kernel; a chunk holds whole tiles."""
    block = max(min(triton.next_power_of_2(seg_len), 2048), g)
    return max(1, (65536 if _interpreting() else 4096) // block), block


def entropy_slack(seg_len: int, group_size: int = 64) -> float:
    """An upper bound on |fp32 entropy of _stats_kernel - exact entropy| for segments of seg_len
    channels: a sum of depth d has relative error <= d*u, p and ln p add a few u each, and the
    error of sum p ln p is then <= (2*gamma + 4u) * (H + 1) with H <= ln(seg_len); doubled."""
    u = 2.0**-24
    _, block = _stats_blocks(seg_len, group_size)
    depth = -(-seg_len // block) + 2 * math.log2(block) + 32  # lanes, then a tree (or numpy's pairwise sum)
    gamma = depth * u
    return 2.0 * (2.0 * gamma + 8.0 * u) * (math.log(seg_len) + 1.0)


def _stats(x2: torch.Tensor, lay: Layout, params: TahQuantParams, status: torch.Tensor):
    """-> (fp32 entropy per allocation entry, uint8 flag per tile, uint8 pivot per tile)."""
    g, t = params.group_size, lay.tiles_per_token
    seg_len, n_seg = (lay.channels, 1) if params.alloc == ALLOC_TOKEN else (g, t)
    n = lay.tokens * n_seg
    ent = torch.empty(n, dtype=torch.float32, device=x2.device)
    flag = torch.empty(lay.tiles, dtype=torch.uint8, device=x2.device)
    piv = torch.empty(lay.tiles, dtype=torch.uint8, device=x2.device)
    rows, block = _stats_blocks(seg_len, g)
    _stats_kernel[(triton.cdiv(n, rows),)](
        x2, x2.stride(0), ent, flag, piv, status, n, n_seg, seg_len, lay.channels, t, float(params.tau),
        G=g, ROWS=rows, BLOCK=block, NCHUNK=triton.cdiv(seg_len, block),
    )
    return ent, flag, piv


def entropies(x2: torch.Tensor, seg_len: int, n_seg: int, group_size: int = 64) -> torch.Tensor:
    """float32 entropy of every segment (the stats kernel's): x2 (tokens, C) -> (tokens * n_seg,);
    n_seg = 1 (whole tokens, seg_len = C) or C / seg_len (tiles, seg_len = group_size)."""
    params = TahQuantParams(group_size=group_size, alloc=0 if n_seg == 1 else 1)
    lay = Layout(1, x2.shape[0], x2.shape[1], group_size)
    status = torch.empty(4, dtype=torch.int32, device=x2.device)
    return _stats(x2, lay, params, status)[0]


def rank_low(e32: torch.Tensor, rho: float, slack: float, exact) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's low_bit_mask from approximate entropies e32 (nseq, n), |e32 - exact| <= slack
    (the torch ranking of the cases the cut kernel does not take).

    Sorted by e32, the entries far below the cut are low and those far above are high whatever the
    rounding; the entries of a window around the cut are re-ranked with exact(window) (the
    reference's float64 entropies of those entries, ties to the lower index). Returns (mask, ok):
    ok (a 0-d bool tensor, not synchronized) is False when the entries within 2*slack of the cut do
    not all lie inside the window; the caller then ranks everything exactly."""
    nseq, n = e32.shape
    n_low = n - int(round(rho * n))
    mask = torch.zeros(nseq, n, dtype=torch.bool, device=e32.device)
    ok = torch.ones((), dtype=torch.bool, device=e32.device)
    if n_low == 0:
        return mask, ok
    if n_low == n:
        return mask.fill_(True), ok
    sv, order = torch.sort(e32, dim=-1, stable=True)
    k = max(64, n // 256)
    lo, hi = max(0, n_low - k), min(n, n_low + k)
    win = order[:, lo:hi]
    e64 = exact(win)
    by_index, perm = torch.sort(win, dim=-1)
    perm2 = torch.sort(torch.gather(e64, 1, perm), dim=-1, stable=True).indices
    ranked = torch.gather(by_index, 1, perm2)
    mask.scatter_(1, order[:, :lo], True)
    mask.scatter_(1, ranked[:, : n_low - lo], True)
    sv = sv.double()
    if lo > 0:
        ok = ok & (sv[:, lo - 1] < sv[:, n_low - 1] - 2 * slack).all()
    if hi < n:
        ok = ok & (sv[:, hi] > sv[:, n_low] + 2 * slack).all()
    return mask, ok


def _padded(rows: torch.Tensor, channels: int) -> torch.Tensor:
    return torch.nn.functional.pad(rows, (0, channels - rows.shape[-1])) if rows.shape[-1] != channels else rows


def _torch_allocation(x2: torch.Tensor, lay: Layout, params: TahQuantParams, e32: torch.Tensor) -> torch.Tensor:
    """The low mask (nseq, n) by rank_low, n = S tokens or S*T tiles per sequence; the exact
    ranking when the window does not settle it."""
    g, t = params.group_size, lay.tiles_per_token
    if params.alloc == ALLOC_TOKEN:
        seq0 = torch.arange(lay.nseq, device=x2.device)[:, None] * lay.seq_len

        def exact(win):
            rows = x2[(seq0 + win).reshape(-1)].float()
            return token_entropy(_padded(rows, lay.padded_channels)).reshape(win.shape)

        mask, ok = rank_low(e32.reshape(lay.nseq, lay.seq_len), params.rho, entropy_slack(lay.channels, g), exact)
    else:
        seq0 = torch.arange(lay.nseq, device=x2.device)[:, None] * (lay.seq_len * t)

        def exact(win):
            return token_entropy(_gather_tiles(x2, (seq0 + win).reshape(-1), t, g)).reshape(win.shape)

        mask, ok = rank_low(e32.reshape(lay.nseq, lay.seq_len * t), params.rho, entropy_slack(g, g), exact)
    return mask if bool(ok) else _exact_allocation(x2, lay, params)


def _gather_tiles(x2: torch.Tensor, tiles: torch.Tensor, t: int, g: int) -> torch.Tensor:
    """float32 tiles (len(tiles), G) of x2 (tokens, C), zero-padded past C."""
    ch = (tiles % t)[:, None] * g + torch.arange(g, device=x2.device)
    inside = ch < x2.shape[1]
    vals = x2[(tiles // t)[:, None], ch.clamp(max=x2.shape[1] - 1)].float()
    return torch.where(inside, vals, torch.zeros((), device=x2.device))


def _exact_allocation(x2: torch.Tensor, lay: Layout, params: TahQuantParams) -> torch.Tensor:
    """The reference's ranking of everything (the rare fallback of both rankings)."""
    xp = _padded(x2.float(), lay.padded_channels)
    if params.alloc == ALLOC_TOKEN:
        ent = token_entropy(xp).reshape(lay.nseq, lay.seq_len)
    else:
        ent = token_entropy(xp.reshape(lay.tokens, lay.tiles_per_token, params.group_size)).reshape(lay.nseq, -1)
    return low_bit_mask(ent, params.rho)


def _with_offsets(low_mask: torch.Tensor, params: TahQuantParams,
                  per_entry_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 low per allocation entry, int64 byte offset of its codes: an exclusive prefix sum)."""
    low = low_mask.reshape(-1)
    bits = torch.where(low, params.bits_low, params.bits_high).long()
    sizes = bits * (params.group_size // 8 * per_entry_tiles)
    return low.to(torch.uint8), torch.cumsum(sizes, 0) - sizes


def _kernel_allocation(x2, lay: Layout, params: TahQuantParams, e32: torch.Tensor, n_low: int, status: torch.Tensor):
    """(low, offsets) per token from the cut, refine and alloc kernels; status bit 4 when a
    sequence had more uncertain tokens than slots (then the result is not to be used)."""
    nseq, s, dev = lay.nseq, lay.seq_len, x2.device
    sb = triton.next_power_of_2(s)
    warps = 4 if sb <= 2048 else 8
    n_slots = min(NSLOT, s)  # a sequence has no more uncertain tokens than tokens
    thr = torch.empty(nseq, 2, dtype=torch.float64, device=dev)
    cnt = torch.empty(nseq, 2, dtype=torch.int32, device=dev)
    cand_e = torch.empty(nseq, NSLOT, dtype=torch.float64, device=dev)
    cand_i = torch.empty(nseq, NSLOT, dtype=torch.int32, device=dev)
    _cut_kernel[(nseq,)](
        e32, s, n_low, 2.0 * entropy_slack(lay.channels, params.group_size), n_slots, thr, cnt, cand_i, status,
        SB=sb, NSLOT=NSLOT, num_warps=warps,
    )
    cb = min(triton.next_power_of_2(lay.channels), 65536 if _interpreting() else 1024)
    _refine_kernel[(nseq, n_slots)](
        x2, x2.stride(0), s, lay.channels, cnt, cand_e, cand_i, NSLOT=NSLOT, CB=cb, NCB=triton.cdiv(lay.channels, cb),
    )
    low = torch.empty(lay.tokens, dtype=torch.uint8, device=dev)
    off = torch.empty(lay.tokens, dtype=torch.int64, device=dev)
    per = lay.tiles_per_token * params.group_size // 8  # code bytes of a token per code bit
    _alloc_kernel[(nseq,)](
        e32, thr, cnt, cand_e, cand_i, low, off, s, n_low, n_slots,
        (n_low * params.bits_low + (s - n_low) * params.bits_high) * per, params.bits_high * per,
        (params.bits_high - params.bits_low) * per, SB=sb, NSLOT=NSLOT, num_warps=warps,
    )
    return low, off


def _codes_nbytes(n_low: int, n_entries: int, params: TahQuantParams, per_entry_tiles: int) -> int:
    per = params.group_size // 8 * per_entry_tiles
    return (n_low * params.bits_low + (n_entries - n_low) * params.bits_high) * per


def encode(x: torch.Tensor, params: TahQuantParams = TahQuantParams()) -> torch.Tensor:
    """Encode x (..., C) float32/float16/bfloat16 on a CUDA device (or under TRITON_INTERPRET=1)
    into the version-1 payload (uint8, 1-D): equal to tahquant_ref.encode(x, params) up to the
    Hadamard rounding of flagged tiles (docs/wire-format.md)."""
    with on_device(x):
        return _encode(x, params)


def _encode(x: torch.Tensor, params: TahQuantParams) -> torch.Tensor:
    params.validate()
    g = params.group_size
    lay = Layout.of(tuple(x.shape), g)
    if x.numel() == 0:
        raise CodecError(f"tahquant: cannot encode an empty tensor (shape {list(x.shape)})")
    x2 = _rows(x.detach(), lay)
    dev = x.device
    t, nt = lay.tiles_per_token, lay.tiles
    token_alloc = params.alloc == ALLOC_TOKEN
    n_entries, per_entry = (lay.tokens, t) if token_alloc else (nt, 1)
    n_per_seq = lay.seq_len if token_alloc else lay.seq_len * t
    n_low = n_per_seq - int(round(params.rho * n_per_seq))

    # payload = [bitmaps, zero, scale | pivots | codes]; the front is placed right before the codes
    bm_a, bm_f = -(-n_entries // 8), -(-nt // 8)
    head = bm_a + bm_f + 4 * nt
    piv_max = packed_nbytes(nt, params.pivot_bits)
    out = torch.empty(head + piv_max + _codes_nbytes(lay.nseq * n_low, n_entries, params, per_entry), dtype=torch.uint8,
                      device=dev)
    status = torch.empty(4, dtype=torch.int32, device=dev)  # bad input/overflow/uncertain bits, n_flag

    e32, flag, piv = _stats(x2, lay, params, status)
    cum = torch.cumsum(flag, 0, dtype=torch.int32)
    if token_alloc and lay.seq_len <= SEQ_MAX:
        low, off = _kernel_allocation(x2, lay, params, e32, n_low, status)
    else:
        low, off = _with_offsets(_torch_allocation(x2, lay, params, e32), params, per_entry)
    codes = out[head + piv_max :]
    zs = torch.empty(4 * nt, dtype=torch.uint8, device=dev)
    compact = torch.empty(nt, dtype=torch.uint8, device=dev)
    cx, grid, warps = _launch_config(params, lay, GPU_ENCODE_BLOCK)
    blk = _byte_block()

    def quantize(low: torch.Tensor, off: torch.Tensor) -> list[int]:
        _encode_kernel[grid](
            x2, x2.stride(0), lay.tokens, lay.channels, t, flag, piv, cum, low, off, codes, codes.numel(),
            zs[: 2 * nt].view(torch.float16), zs[2 * nt :].view(torch.float16), compact, status, **cx, num_warps=warps,
        )
        _assemble_kernel[(triton.cdiv(head + piv_max, blk),)](
            out, low, flag, zs, compact, cum, status, n_entries, nt, bm_a, bm_f, head, piv_max,
            BLK=blk, **_pivot_planes(params),
        )
        return status.tolist()  # the one synchronization of the common path

    bad, n_flag = quantize(low, off)[:2]
    if bad & 1:
        check_finite(x, "tahquant")  # raises with the reference's message
    if bad & 4:  # too many entropies too close to the cut for the cut kernel: rank exactly
        status.zero_()
        bad = quantize(*_with_offsets(_exact_allocation(x2, lay, params), params, per_entry))[0]
    if bad & 2:
        inf = torch.tensor([float("inf")])
        fp16_min_scale(inf, inf, 1.0, "tahquant")  # raises with the reference's message
    return out[piv_max - packed_nbytes(n_flag, params.pivot_bits) :]


def decode(payload: torch.Tensor, shape: tuple[int, ...], params: TahQuantParams, dtype: torch.dtype) -> torch.Tensor:
    """Decode a version-1 payload (uint8, 1-D, on a CUDA device or under TRITON_INTERPRET=1) into
    a tensor of `shape` and `dtype` on the payload's device: equal to tahquant_ref.decode up to the
    Hadamard rounding of flagged tiles; a corrupt payload raises CodecError (the reference's checks
    and messages, in its order)."""
    with on_device(payload):
        return _decode(payload, shape, params, dtype)


def _decode(payload: torch.Tensor, shape: tuple[int, ...], params: TahQuantParams, dtype: torch.dtype) -> torch.Tensor:
    params.validate()
    g = params.group_size
    lay = Layout.of(tuple(shape), g)
    nt, t = lay.tiles, lay.tiles_per_token
    token_alloc = params.alloc == ALLOC_TOKEN
    n_alloc, per_entry = (lay.tokens, t) if token_alloc else (nt, 1)
    check_min_payload(payload, shape, params)
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise CodecError(f"tahquant payload must be a 1-D uint8 tensor, got {payload.dtype} of shape "
                         f"{list(payload.shape)}")
    dev = payload.device
    bm_a, bm_f = -(-n_alloc // 8), -(-nt // 8)
    head = bm_a + bm_f + 4 * nt  # within the minimum: the front sections are all there

    pc = torch.empty(bm_a + bm_f, dtype=torch.int32, device=dev)
    status = torch.empty(8, dtype=torch.int32, device=dev)
    blk = _byte_block()
    _bitcount_kernel[(triton.cdiv(bm_a + bm_f, blk),)](payload, pc, status, bm_a + bm_f, bm_a, n_alloc, nt, BLK=blk)
    cum = torch.cumsum(pc, 0, dtype=torch.int32)
    out = torch.empty(lay.tokens, lay.channels, dtype=dtype, device=dev)
    cx, grid, warps = _launch_config(params, lay, GPU_DECODE_BLOCK)
    _decode_kernel[grid](
        payload, payload.numel(), cum, status, out, out.stride(0), lay.tokens, lay.channels, t, nt, bm_a, bm_f, head,
        OUT_BF16=dtype == torch.bfloat16, **cx, **_pivot_planes(params), num_warps=warps,
    )
    pads, zs_bad, piv_pad, n_low, n_flag = status.tolist()[:5]  # the one synchronization

    # the reference's checks, in its order
    if pads & 1:
        raise CodecError("corrupt payload: padding bits of the bit-allocation bitmap are not zero")
    if pads & 2:
        raise CodecError("corrupt payload: padding bits of the Hadamard flag bitmap are not zero")
    if zs_bad:
        raise CodecError("tahquant payload is corrupt: non-finite zero-point or negative/non-finite scale")
    rd = PayloadReader(payload, "tahquant")
    rd.offset = head
    rd.take(packed_nbytes(n_flag, params.pivot_bits), "pivot indices")
    if piv_pad:
        raise CodecError("tahquant payload is corrupt: padding of the pivot indices is not zero")
    rd.take(_codes_nbytes(n_low, n_alloc, params, per_entry), "tile codes")
    rd.finish()
    return out.reshape(shape)
