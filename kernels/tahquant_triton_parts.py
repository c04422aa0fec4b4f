"""TAH-Quant in Triton, the device helpers of tahquant_triton's kernels (tahquant_triton_alloc,
tahquant_triton_payload): the Hadamard transform as tl.dot, the pivot swap, the bit-plane stores and
loads of the codes, a program's block of rows, byte popcounts and the packed pivots' planes."""

from __future__ import annotations

import triton
import triton.language as tl


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
