"""TAH-Quant in Triton: the same version-1 payload as tahquant_ref, byte for byte, from fused kernels.

encode(x (..., C), params) -> uint8 payload       decode(payload, shape, params, dtype) -> (shape)

Steps: an entropy kernel (fp32, per token or per tile) -> a torch ranking step that makes the INT3
choice equal to the reference's float64 ranking (the few entries whose fp32 entropy is too close
to the cut are re-ranked with the reference's own float64 entropies) -> exclusive prefix sums for
the byte offset of each tile's code block -> ONE fused kernel per block of ROWS tokens x one tile
column (outlier test, pivot swap, Hadamard as tl.dot with a Sylvester matrix built in registers,
fp16 min/scale, round half to even, bit-plane packing straight into the payload) -> torch packs the
bitmaps and the pivots of the flagged tiles in front. Decode validates every section with the
reference's checks and messages, then one fused kernel unpacks, dequantizes, inverts the Hadamard,
swaps back and stores in the output dtype.

The only intended difference from the reference: the Hadamard product is an fp32 tl.dot here and a
float64 product rounded once there, so a value on a flagged tile can differ by a few fp32 ulps (see
docs/wire-format.md for what that does to the codes)."""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .bitpack import pack_bits, packed_nbytes, padded_count, plane_widths, unpack_bits
from .quant_ref import check_finite, fp16_min_scale
from .tahquant_ref import ALLOC_TOKEN, Layout, TahQuantParams, low_bit_mask, token_entropy
from .triton_util import on_device, round_half_even, to_bf16_rne
from .wire import CodecError, PayloadReader, as_bytes, bitmap

__all__ = ["encode", "decode", "entropies", "rank_low", "entropy_slack"]


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
def _store_plane(out_ptr, tile_off, q, bits, rvalid, BR: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
    """Store the width-W plane of the codes q (BR, G) int32 of `bits`-bit rows: 8/W values per
    byte, least significant first, at byte tile_off + (bit offset of the plane) * G/8. Planes go
    from the low bits up: 8, or 4, 2, 1 as present in `bits`."""
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
    dst = out_ptr + (tile_off + shift * (G // 8))[:, None] + tl.arange(0, NB)[None, :]
    tl.store(dst, packed.to(tl.uint8), mask=present[:, None])


@triton.jit
def _load_plane(q, codes_ptr, tile_off, bits, rvalid, j, G: tl.constexpr, W: tl.constexpr):
    """q | (the width-W plane of each row's code block, shifted into place); see _store_plane."""
    if W == 8:
        present = (bits == 8) & rvalid
        shift = bits * 0
    else:
        present = (bits < 8) & ((bits & W) != 0) & rvalid
        shift = bits & (7 & ~(2 * W - 1))
    PER: tl.constexpr = 8 // W
    src = codes_ptr + (tile_off + shift * (G // 8))[:, None] + (j // PER)[None, :]
    b = tl.load(src, mask=present[:, None], other=0).to(tl.int32)
    v = (b >> ((j % PER) * W)[None, :]) & ((1 << W) - 1)
    return q | (v << shift[:, None])


@triton.jit
def _block_rows(n_tokens, n_tpt, ROWS: tl.constexpr, TC: tl.constexpr):
    """The (token, tile column) of each of the ROWS*TC rows of this program's block: ROWS tokens x
    TC consecutive tile columns, row r = (token r // TC, column r % TC)."""
    pid = tl.program_id(0)
    n_tcb = tl.cdiv(n_tpt, TC)
    r = tl.arange(0, ROWS * TC)
    rows = (pid // n_tcb) * ROWS + r // TC
    t = (pid % n_tcb) * TC + r % TC
    return rows, t, (rows < n_tokens) & (t < n_tpt)


# ---------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _entropy_kernel(
    x_ptr, stride_x, out_ptr, n_entries, n_seg, seg_len, n_chan, ROWS: tl.constexpr, BLOCK: tl.constexpr, NCHUNK: tl.constexpr
):
    """H = -sum p ln p, p = |x| / sum |x|, in float32 over segments of seg_len channels (a whole
    token: n_seg = 1; a tile: seg_len = G); entry e is segment e % n_seg of token e // n_seg.
    NCHUNK = cdiv(seg_len, BLOCK) is a constexpr (a loop bound that is a kernel argument breaks
    triton 3.6's interpreter under numpy 2)."""
    pid = tl.program_id(0)
    e = pid * ROWS + tl.arange(0, ROWS)
    ev = e < n_entries
    tok = (e // n_seg).to(tl.int64)
    c0 = (e % n_seg) * seg_len
    cend = tl.minimum(c0 + seg_len, n_chan)
    rowp = x_ptr + tok * stride_x
    k = tl.arange(0, BLOCK)
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for s in range(NCHUNK):
        ch = c0[:, None] + s * BLOCK + k[None, :]
        m = ev[:, None] & (ch < cend[:, None])
        acc += tl.abs(tl.load(rowp[:, None] + ch, mask=m, other=0.0).to(tl.float32))
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
    tl.store(out_ptr + e, h, mask=ev)


@triton.jit
def _encode_kernel(
    x_ptr, stride_x, n_tokens, n_chan, n_tpt,  # input (tokens, C) with unit channel stride; T tiles per token
    low_ptr,  # uint8 per allocation entry (token, or tile when ALLOC_TILE): 1 -> bits_low
    off_ptr,  # int64 per allocation entry: byte offset of its first code block in codes_ptr
    codes_ptr,  # uint8: the payload's tile-code section
    zero_ptr, scale_ptr,  # float16 per tile
    piv_ptr, stat_ptr,  # uint8 per tile: pivot (0 if unflagged); bit0 flag, bit1 non-finite input, bit2 fp16 overflow
    tau,  # float32
    G: tl.constexpr, ROWS: tl.constexpr, TC: tl.constexpr, BH: tl.constexpr, BL: tl.constexpr, TOKEN_ALLOC: tl.constexpr,
    W8: tl.constexpr, W4: tl.constexpr, W2: tl.constexpr, W1: tl.constexpr,
    HK: tl.constexpr, RSQRT: tl.constexpr, POW4: tl.constexpr,
):
    BR: tl.constexpr = ROWS * TC
    rows, t, rvalid = _block_rows(n_tokens, n_tpt, ROWS, TC)
    j = tl.arange(0, G)
    ch = t[:, None] * G + j[None, :]
    m = rvalid[:, None] & (ch < n_chan)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + ch, mask=m, other=0.0).to(tl.float32)
    tile = rows64 * n_tpt + t

    bad_e = (x != x) | (tl.abs(x) == float("inf"))
    bad_in = tl.max(bad_e.to(tl.int32), axis=1) > 0
    x = tl.where(bad_e, 0.0, x)

    # outlier test on the raw tile: first index of the largest |x|, flag if >= tau x the runner-up
    mag = tl.abs(x)
    peak = tl.max(mag, axis=1)
    pivot = tl.min(tl.where(mag == peak[:, None], j[None, :], G), axis=1)
    second = tl.max(tl.where(j[None, :] == pivot[:, None], -1.0, mag), axis=1)
    flag = (peak > 0) & (peak >= tau * second)

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
        _store_plane(codes_ptr, tile_off, q, bits, rvalid, BR, G, 8)
    if W4:
        _store_plane(codes_ptr, tile_off, q, bits, rvalid, BR, G, 4)
    if W2:
        _store_plane(codes_ptr, tile_off, q, bits, rvalid, BR, G, 2)
    if W1:
        _store_plane(codes_ptr, tile_off, q, bits, rvalid, BR, G, 1)

    tl.store(zero_ptr + tile, zero16, mask=rvalid)
    tl.store(scale_ptr + tile, scale16, mask=rvalid)
    tl.store(piv_ptr + tile, tl.where(flag, pivot, 0).to(tl.uint8), mask=rvalid)
    stat = flag.to(tl.int32) | (bad_in.to(tl.int32) << 1) | (bad16.to(tl.int32) << 2)
    tl.store(stat_ptr + tile, stat.to(tl.uint8), mask=rvalid)


@triton.jit
def _decode_kernel(
    codes_ptr, off_ptr,  # tile-code section; int64 byte offset per allocation entry
    alloc_ptr, flag_ptr,  # the payload's bitmaps (bit e of byte e // 8, LSB first)
    piv_ptr,  # uint8 pivot per tile (0 if unflagged)
    zero_ptr, scale_ptr,  # float16 per tile
    out_ptr, stride_out, n_tokens, n_chan, n_tpt,
    G: tl.constexpr, ROWS: tl.constexpr, TC: tl.constexpr, BH: tl.constexpr, BL: tl.constexpr, TOKEN_ALLOC: tl.constexpr,
    W8: tl.constexpr, W4: tl.constexpr, W2: tl.constexpr, W1: tl.constexpr,
    HK: tl.constexpr, RSQRT: tl.constexpr, POW4: tl.constexpr, OUT_BF16: tl.constexpr,
):
    BR: tl.constexpr = ROWS * TC
    rows, t, rvalid = _block_rows(n_tokens, n_tpt, ROWS, TC)
    j = tl.arange(0, G)
    rows64 = rows.to(tl.int64)
    tile = rows64 * n_tpt + t
    if TOKEN_ALLOC:
        entry = rows64
    else:
        entry = tile
    low = (tl.load(alloc_ptr + entry // 8, mask=rvalid, other=0).to(tl.int32) >> (entry % 8).to(tl.int32)) & 1
    flag = ((tl.load(flag_ptr + tile // 8, mask=rvalid, other=0).to(tl.int32) >> (tile % 8).to(tl.int32)) & 1) != 0
    bits = tl.where(low != 0, BL, BH)
    tile_off = tl.load(off_ptr + entry, mask=rvalid, other=0)
    if TOKEN_ALLOC:
        tile_off += t * (bits * (G // 8))

    q = tl.zeros([BR, G], dtype=tl.int32)
    if W8:
        q = _load_plane(q, codes_ptr, tile_off, bits, rvalid, j, G, 8)
    if W4:
        q = _load_plane(q, codes_ptr, tile_off, bits, rvalid, j, G, 4)
    if W2:
        q = _load_plane(q, codes_ptr, tile_off, bits, rvalid, j, G, 2)
    if W1:
        q = _load_plane(q, codes_ptr, tile_off, bits, rvalid, j, G, 1)

    zf = tl.load(zero_ptr + tile, mask=rvalid, other=0.0).to(tl.float32)
    sf = tl.load(scale_ptr + tile, mask=rvalid, other=0.0).to(tl.float32)
    y = q.to(tl.float32) * sf[:, None] + zf[:, None]  # q * scale is exact: an FMA changes nothing
    if tl.max(flag.to(tl.int32), axis=0) > 0:
        y = tl.where(flag[:, None], _hadamard(y, BR, G, HK, RSQRT, POW4), y)
        pivot = tl.load(piv_ptr + tile, mask=rvalid, other=0).to(tl.int32)
        y = _swap_first(y, j, pivot, flag)

    ch = t[:, None] * G + j[None, :]
    m = rvalid[:, None] & (ch < n_chan)
    dst = out_ptr + rows64[:, None] * stride_out + ch
    if OUT_BF16:
        tl.store(dst, to_bf16_rne(y), mask=m)
    else:
        tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=m)


# ---------------------------------------------------------------------------------------------
# Python side: block sizes, the ranking step, section assembly and validation


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _launch_config(params: TahQuantParams, lay: Layout) -> tuple[dict, tuple[int]]:
    """Constexprs and grid of the encode/decode kernels. On a GPU a block is ROWS tokens x one tile
    column (2048 values; tl.dot gets M = 32 rows): the tiles of an outlier channel are flagged down
    a whole column, so the other blocks mostly skip the Hadamard. The interpreter's cost is per
    program, so there a block spans up to 32768 values over several columns."""
    g, t = params.group_size, lay.tiles_per_token
    if _interpreting():
        rows = min(triton.next_power_of_2(lay.tokens), max(16, 32768 // g))
        tc = min(triton.next_power_of_2(t), max(1, 32768 // (g * rows)))
        rows = max(rows, 16 // tc)
    else:  # 2048 values (1024 for G = 8, whose Hadamard is a (ROWS, 8, 8) broadcast product)
        rows, tc = (128 if g == 8 else max(8, 2048 // g)), 1
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
    return cx, (triton.cdiv(lay.tokens, rows) * triton.cdiv(t, tc),)


def _rows(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    x2 = x.reshape(lay.tokens, lay.channels)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def _entropy_blocks(seg_len: int) -> tuple[int, int]:
    block = min(triton.next_power_of_2(seg_len), 2048)
    return max(1, (65536 if _interpreting() else 4096) // block), block


def entropy_slack(seg_len: int) -> float:
    """An upper bound on |fp32 entropy of _entropy_kernel - exact entropy| for segments of seg_len
    channels: a sum of depth d has relative error <= d*u, p and ln p add a few u each, and the
    error of sum p ln p is then <= (2*gamma + 4u) * (H + 1) with H <= ln(seg_len); doubled."""
    u = 2.0**-24
    _, block = _entropy_blocks(seg_len)
    depth = -(-seg_len // block) + 2 * math.log2(block) + 32  # lanes, then a tree (or numpy's pairwise sum)
    gamma = depth * u
    return 2.0 * (2.0 * gamma + 8.0 * u) * (math.log(seg_len) + 1.0)


def entropies(x2: torch.Tensor, seg_len: int, n_seg: int) -> torch.Tensor:
    """float32 entropy of every segment: x2 (tokens, C) -> (tokens * n_seg,)."""
    n = x2.shape[0] * n_seg
    out = torch.empty(n, dtype=torch.float32, device=x2.device)
    rows, block = _entropy_blocks(seg_len)
    _entropy_kernel[(triton.cdiv(n, rows),)](
        x2, x2.stride(0), out, n, n_seg, seg_len, x2.shape[1], ROWS=rows, BLOCK=block, NCHUNK=triton.cdiv(seg_len, block)
    )
    return out


def rank_low(e32: torch.Tensor, rho: float, slack: float, exact) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's low_bit_mask from approximate entropies e32 (nseq, n), |e32 - exact| <= slack.

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


def _allocation(x2: torch.Tensor, lay: Layout, params: TahQuantParams):
    """(low mask (nseq, n) bool, ok) for n = S tokens or S*T tiles per sequence."""
    g, t = params.group_size, lay.tiles_per_token
    if params.alloc == ALLOC_TOKEN:
        e32 = entropies(x2, lay.channels, 1).reshape(lay.nseq, lay.seq_len)
        seq0 = torch.arange(lay.nseq, device=x2.device)[:, None] * lay.seq_len

        def exact(win):
            rows = x2[(seq0 + win).reshape(-1)].float()
            return token_entropy(_padded(rows, lay.padded_channels)).reshape(win.shape)

        return rank_low(e32, params.rho, entropy_slack(lay.channels), exact)
    e32 = entropies(x2, g, t).reshape(lay.nseq, lay.seq_len * t)
    seq0 = torch.arange(lay.nseq, device=x2.device)[:, None] * (lay.seq_len * t)

    def exact(win):
        return token_entropy(_gather_tiles(x2, (seq0 + win).reshape(-1), t, g)).reshape(win.shape)

    return rank_low(e32, params.rho, entropy_slack(g), exact)


def _gather_tiles(x2: torch.Tensor, tiles: torch.Tensor, t: int, g: int) -> torch.Tensor:
    """float32 tiles (len(tiles), G) of x2 (tokens, C), zero-padded past C."""
    ch = (tiles % t)[:, None] * g + torch.arange(g, device=x2.device)
    inside = ch < x2.shape[1]
    vals = x2[(tiles // t)[:, None], ch.clamp(max=x2.shape[1] - 1)].float()
    return torch.where(inside, vals, torch.zeros((), device=x2.device))


def _exact_allocation(x2: torch.Tensor, lay: Layout, params: TahQuantParams) -> torch.Tensor:
    """The reference's ranking of everything (the rare fallback of rank_low)."""
    xp = _padded(x2.float(), lay.padded_channels)
    if params.alloc == ALLOC_TOKEN:
        ent = token_entropy(xp).reshape(lay.nseq, lay.seq_len)
    else:
        ent = token_entropy(xp.reshape(lay.tokens, lay.tiles_per_token, params.group_size)).reshape(lay.nseq, -1)
    return low_bit_mask(ent, params.rho)


def _entry_offsets(low: torch.Tensor, params: TahQuantParams, per_entry_tiles: int) -> torch.Tensor:
    """Exclusive prefix sum of the code bytes of each allocation entry (int64)."""
    bits = torch.where(low, params.bits_low, params.bits_high).long()
    sizes = bits * (params.group_size // 8 * per_entry_tiles)
    return torch.cumsum(sizes, 0) - sizes


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
    n_low_total = lay.nseq * (n_per_seq - int(round(params.rho * n_per_seq)))
    pbits = params.pivot_bits

    bm_alloc, bm_flag = -(-n_entries // 8), -(-nt // 8)
    head = bm_alloc + bm_flag + 4 * nt
    piv_max = packed_nbytes(nt, pbits)
    codes_len = _codes_nbytes(n_low_total, n_entries, params, per_entry)
    out = torch.empty(head + piv_max + codes_len, dtype=torch.uint8, device=dev)
    codes = out[head + piv_max :]
    zero = torch.empty(nt, dtype=torch.float16, device=dev)
    scale = torch.empty(nt, dtype=torch.float16, device=dev)
    piv = torch.empty(nt, dtype=torch.uint8, device=dev)
    stat = torch.empty(nt, dtype=torch.uint8, device=dev)
    cx, grid = _launch_config(params, lay)

    def run(low_mask):
        low = low_mask.reshape(-1)
        off = _entry_offsets(low, params, per_entry)
        _encode_kernel[grid](
            x2, x2.stride(0), lay.tokens, lay.channels, t, low.to(torch.uint8), off, codes,
            zero, scale, piv, stat, float(params.tau), **cx,
        )
        return low

    low_mask, ok = _allocation(x2, lay, params)
    low = run(low_mask)
    flag = (stat & 1).bool()
    compact = torch.zeros(padded_count(nt) + 1, dtype=torch.uint8, device=dev)
    compact.scatter_(0, torch.where(flag, torch.cumsum(flag, 0) - 1, compact.numel() - 1), piv)
    # the single synchronization of the common path
    ok_, n_flag, bad_in, bad16 = torch.stack([ok.long(), flag.sum(), (stat & 2).any().long(), (stat & 4).any().long()]).tolist()
    if bad_in:
        check_finite(x, "tahquant")  # raises with the reference's message
    if not ok_:  # entropies too close to the cut for the window: rank exactly and encode again
        low = run(_exact_allocation(x2, lay, params))
        bad16 = bool((stat & 4).any())  # flags and pivots do not depend on the allocation
    if bad16:
        inf = torch.tensor([float("inf")])
        fp16_min_scale(inf, inf, 1.0, "tahquant")  # raises with the reference's message

    piv_len = packed_nbytes(n_flag, pbits)
    res = out[piv_max - piv_len :]
    res[:head] = torch.cat([bitmap(low), bitmap(flag), as_bytes(zero), as_bytes(scale)])
    res[head : head + piv_len] = pack_bits(compact[: padded_count(n_flag)], pbits)
    return res


def _bits(sec: torch.Tensor, n: int) -> torch.Tensor:
    """n flags (bool) of a LSB-first bitmap section, on its device."""
    idx = torch.arange(n, device=sec.device)
    return ((sec.long()[idx >> 3] >> (idx & 7)) & 1).bool()


def _pad_bits_set(sec: torch.Tensor, n: int) -> torch.Tensor:
    if n % 8 == 0:
        return torch.zeros((), dtype=torch.bool, device=sec.device)
    return (sec[-1].long() >> (n % 8)) != 0


def decode(payload: torch.Tensor, shape: tuple[int, ...], params: TahQuantParams, dtype: torch.dtype) -> torch.Tensor:
    """Decode a version-1 payload (uint8, 1-D, on a CUDA device or under TRITON_INTERPRET=1) into
    a tensor of `shape` and `dtype` on the payload's device: equal to tahquant_ref.decode up to the
    Hadamard rounding of flagged tiles; a corrupt payload raises CodecError (the reference's checks
    and messages, in its order) before any kernel runs."""
    with on_device(payload):
        return _decode(payload, shape, params, dtype)


def _decode(payload: torch.Tensor, shape: tuple[int, ...], params: TahQuantParams, dtype: torch.dtype) -> torch.Tensor:
    params.validate()
    g = params.group_size
    lay = Layout.of(tuple(shape), g)
    nt, t = lay.tiles, lay.tiles_per_token
    token_alloc = params.alloc == ALLOC_TOKEN
    n_alloc, per_entry = (lay.tokens, t) if token_alloc else (nt, 1)
    minimum = 2 * (-(-nt // 8)) + 4 * nt + nt * g * params.bits_low // 8
    if payload.numel() < minimum:
        raise CodecError(f"tahquant payload is truncated: {payload.numel()} bytes, shape {list(shape)} needs at least {minimum}")
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise CodecError(f"tahquant payload must be a 1-D uint8 tensor, got {payload.dtype} of shape {list(payload.shape)}")
    rd = PayloadReader(payload, "tahquant")
    a_sec = rd.take(-(-n_alloc // 8), "bit-allocation bitmap")
    f_sec = rd.take(-(-nt // 8), "Hadamard flag bitmap")
    zero = rd.take_array(nt, torch.float16, "zero-points")
    scale = rd.take_array(nt, torch.float16, "scales")
    low = _bits(a_sec, n_alloc)
    flag = _bits(f_sec, nt)
    zs_ok = torch.isfinite(zero).all() & torch.isfinite(scale).all() & (scale >= 0).all()
    a_pad, f_pad, zs_bad, n_low, n_flag = torch.stack(
        [_pad_bits_set(a_sec, n_alloc).long(), _pad_bits_set(f_sec, nt).long(), (~zs_ok).long(), low.sum(), flag.sum()]
    ).tolist()
    if a_pad:
        raise CodecError("corrupt payload: padding bits of the bit-allocation bitmap are not zero")
    if f_pad:
        raise CodecError("corrupt payload: padding bits of the Hadamard flag bitmap are not zero")
    if zs_bad:
        raise CodecError("tahquant payload is corrupt: non-finite zero-point or negative/non-finite scale")
    pbits = params.pivot_bits
    pivots = unpack_bits(rd.take(packed_nbytes(n_flag, pbits), "pivot indices"), pbits, padded_count(n_flag))
    if n_flag % 8 and bool(pivots[n_flag:].any()):
        raise CodecError("tahquant payload is corrupt: padding of the pivot indices is not zero")
    codes = rd.take(_codes_nbytes(n_low, n_alloc, params, per_entry), "tile codes")
    rd.finish()

    off = _entry_offsets(low, params, per_entry)
    if n_flag:
        piv = torch.where(flag, pivots[(torch.cumsum(flag, 0) - 1).clamp(min=0)], 0).to(torch.uint8)
    else:
        piv = torch.zeros(nt, dtype=torch.uint8, device=payload.device)
    out = torch.empty(lay.tokens, lay.channels, dtype=dtype, device=payload.device)
    cx, grid = _launch_config(params, lay)
    _decode_kernel[grid](
        codes, off, a_sec, f_sec, piv, zero, scale, out, out.stride(0), lay.tokens, lay.channels, t,
        OUT_BF16=dtype == torch.bfloat16, **cx,
    )
    return out.reshape(shape)
