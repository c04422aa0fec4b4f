"""TAH-Quant in Triton, the allocation kernels of tahquant_triton's encode (steps 1-4 of its
docstring): stats (entropies, outlier flags, pivots), cut (the INT3/INT4 cut and its uncertain tokens),
refine (their float64 entropies) and alloc (the INT3 tokens and every token's code offset)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _stats_kernel(
    x_ptr, stride_x, ent_ptr, flag_ptr, piv_ptr, status_ptr,
    n_tokens, n_chan, n_tpt, tau,
    G: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, NCHUNK: tl.constexpr,
):
    """Per token: H = -sum p ln p over its C channels, p = |x| / sum |x|, in float32. Per tile of G
    channels: the outlier flag (largest |x| > 0 and >= tau x the largest of the others) and the pivot
    (first index of the largest |x|), with non-finite inputs counted as 0 (encode refuses them later).
    NCHUNK = cdiv(C, BLOCK) is a constexpr (a loop bound that is a kernel argument breaks triton 3.6's
    interpreter under numpy 2). Program 0 clears the status words."""
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(status_ptr + tl.arange(0, 4), tl.zeros([4], dtype=tl.int32))
    TPB: tl.constexpr = BLOCK // G
    e = pid * ROWS + tl.arange(0, ROWS)
    ev = e < n_tokens
    tok = e.to(tl.int64)
    rowp = x_ptr + tok * stride_x
    k = tl.arange(0, BLOCK)
    j = tl.arange(0, G)
    # the tiles of a chunk, row-major: (token, tile of the chunk)
    r = tl.arange(0, ROWS * TPB)
    t_tok = tl.reshape(tl.broadcast_to(tok[:, None], (ROWS, TPB)), (ROWS * TPB,))
    t_ev = tl.reshape(tl.broadcast_to(ev[:, None], (ROWS, TPB)), (ROWS * TPB,))
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for s in range(NCHUNK):
        ch = s * BLOCK + k[None, :]
        m = ev[:, None] & (ch < n_chan)
        v = tl.load(rowp[:, None] + ch, mask=m, other=0.0).to(tl.float32)
        a = tl.abs(v)
        acc += a
        mag = tl.reshape(tl.where((a == float("inf")) | (v != v), 0.0, a), (ROWS * TPB, G))
        peak = tl.max(mag, axis=1)
        pivot = tl.min(tl.where(mag == peak[:, None], j[None, :], G), axis=1)
        second = tl.max(tl.where(j[None, :] == pivot[:, None], -1.0, mag), axis=1)
        flag = (peak > 0) & (peak >= tau * second)
        ch0 = s * BLOCK + (r % TPB) * G
        tile = t_tok * n_tpt + ch0 // G
        tv = t_ev & (ch0 < n_chan)
        tl.store(flag_ptr + tile, flag.to(tl.uint8), mask=tv)
        tl.store(piv_ptr + tile, pivot.to(tl.uint8), mask=tv)
    total = tl.sum(acc, axis=1)
    tsafe = tl.where(total > 0, total, 1.0)
    acc2 = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for s in range(NCHUNK):
        ch = s * BLOCK + k[None, :]
        m = ev[:, None] & (ch < n_chan)
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
