"""TAH-Quant in Triton: the same version-1 payload as tahquant_ref, byte for byte, from fused kernels.

encode(x (..., C), params) -> uint8 payload       decode(payload, shape, params, dtype) -> (shape)

Encode (sequences of up to SEQ_MAX tokens) is six kernels and one scan, with one synchronization at
the end:
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
The rare cases the fast ranking cannot settle (more uncertain tokens than NSLOT) and longer
sequences rank in torch (rank_low, then the reference's exact ranking).

Decode is two kernels and one scan: bitmap popcounts, their prefix sums (every token's code offset
and every flagged tile's pivot index), then one fused kernel that validates and unpacks,
dequantizes, inverts the Hadamard, swaps back and stores in the output dtype; a corrupt payload
raises CodecError with the reference's message, in the reference's order, after that one sync.

The only intended difference from the reference: the Hadamard product is an fp32 tl.dot here and a
float64 product rounded once there, so a value on a flagged tile can differ by a few fp32 ulps (see
docs/wire-format.md for what that does to the codes).

The kernels are in tahquant_triton_alloc (1 to 4) and tahquant_triton_payload (5, 6 and decode's),
their device helpers in tahquant_triton_parts; this module launches them."""

from __future__ import annotations

import math

import torch
import triton

from .bitpack import packed_nbytes, plane_widths
from .quant_ref import check_finite, fp16_min_scale
from .tahquant_ref import Layout, PaperParams, check_min_payload, low_bit_mask, token_entropy
from .tahquant_triton_alloc import _alloc_kernel, _cut_kernel, _refine_kernel, _stats_kernel
from .tahquant_triton_payload import _assemble_kernel, _bitcount_kernel, _decode_kernel, _encode_kernel
from .triton_util import interpreting as _interpreting
from .triton_util import on_device
from .wire import CodecError, PayloadReader

__all__ = ["encode", "decode", "rank_low", "entropy_slack", "SEQ_MAX", "NSLOT"]

SEQ_MAX = 8192  # longest sequence the in-kernel allocation ranks (one program holds all its entropies)
# values per program (ROWS x G) and warps per program of the encode and decode kernels on a GPU:
# measured on an H100 (docs/benchmarks-log.md, "Kernel block sizes"); 2048 values in 4 warps spilled registers
GPU_ENCODE_BLOCK = (1024, 8)
GPU_DECODE_BLOCK = (1024, 4)
NSLOT = 64      # uncertain tokens per sequence the refine kernel recomputes in float64


# ---------------------------------------------------------------------------------------------
# Python side: block sizes, the allocation, and the launches


def _launch_config(params: PaperParams, lay: Layout, block: tuple[int, int]) -> tuple[dict, tuple[int], int]:
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
        W8=8 in widths,
        W4=4 in widths,
        W2=2 in widths,
        W1=1 in widths,
        HK=min(g, 64),
        RSQRT=1.0 / math.sqrt(g),
        POW4=(g.bit_length() - 1) % 2 == 0,
    )
    return cx, (triton.cdiv(lay.tokens, rows) * triton.cdiv(t, tc),), 1 if _interpreting() else block[1]


def _pivot_planes(params: PaperParams) -> dict:
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


def _stats_blocks(channels: int, g: int) -> tuple[int, int]:
    """(tokens per program, chunk width) of the stats kernel; a chunk holds whole tiles."""
    block = max(min(triton.next_power_of_2(channels), 2048), g)
    return max(1, (65536 if _interpreting() else 4096) // block), block


def entropy_slack(channels: int, group_size: int = 64) -> float:
    """An upper bound on |fp32 entropy of _stats_kernel - exact entropy| for tokens of `channels`
    channels: a sum of depth d has relative error <= d*u, p and ln p add a few u each, and the
    error of sum p ln p is then <= (2*gamma + 4u) * (H + 1) with H <= ln(channels); doubled."""
    u = 2.0**-24
    _, block = _stats_blocks(channels, group_size)
    depth = -(-channels // block) + 2 * math.log2(block) + 32  # lanes, then a tree (or numpy's pairwise sum)
    gamma = depth * u
    return 2.0 * (2.0 * gamma + 8.0 * u) * (math.log(channels) + 1.0)


def _stats(x2: torch.Tensor, lay: Layout, params: PaperParams, status: torch.Tensor):
    """-> (fp32 entropy per token, uint8 flag per tile, uint8 pivot per tile)."""
    g, n = params.group_size, lay.tokens
    ent = torch.empty(n, dtype=torch.float32, device=x2.device)
    flag = torch.empty(lay.tiles, dtype=torch.uint8, device=x2.device)
    piv = torch.empty(lay.tiles, dtype=torch.uint8, device=x2.device)
    rows, block = _stats_blocks(lay.channels, g)
    _stats_kernel[(triton.cdiv(n, rows),)](
        x2, x2.stride(0), ent, flag, piv, status, n, lay.channels, lay.tiles_per_token, float(params.tau),
        G=g, ROWS=rows, BLOCK=block, NCHUNK=triton.cdiv(lay.channels, block),
    )
    return ent, flag, piv


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


def _torch_allocation(x2: torch.Tensor, lay: Layout, params: PaperParams, e32: torch.Tensor) -> torch.Tensor:
    """The low mask (nseq, S) by rank_low; the exact ranking when the window does not settle it."""
    seq0 = torch.arange(lay.nseq, device=x2.device)[:, None] * lay.seq_len

    def exact(win):
        rows = x2[(seq0 + win).reshape(-1)].float()
        return token_entropy(_padded(rows, lay.padded_channels)).reshape(win.shape)

    slack = entropy_slack(lay.channels, params.group_size)
    mask, ok = rank_low(e32.reshape(lay.nseq, lay.seq_len), params.rho, slack, exact)
    return mask if bool(ok) else _exact_allocation(x2, lay, params)


def _exact_allocation(x2: torch.Tensor, lay: Layout, params: PaperParams) -> torch.Tensor:
    """The reference's ranking of everything (the rare fallback of both rankings)."""
    ent = token_entropy(_padded(x2.float(), lay.padded_channels)).reshape(lay.nseq, lay.seq_len)
    return low_bit_mask(ent, params.rho)


def _with_offsets(low_mask: torch.Tensor, params: PaperParams, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 low per token, int64 byte offset of its codes: an exclusive prefix sum; T tiles a token)."""
    low = low_mask.reshape(-1)
    bits = torch.where(low, params.bits_low, params.bits_high).long()
    sizes = bits * (params.group_size // 8 * t)
    return low.to(torch.uint8), torch.cumsum(sizes, 0) - sizes


def _kernel_allocation(x2, lay: Layout, params: PaperParams, e32: torch.Tensor, n_low: int, status: torch.Tensor):
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


def _codes_nbytes(n_low: int, n_tokens: int, params: PaperParams, t: int) -> int:
    per = params.group_size // 8 * t
    return (n_low * params.bits_low + (n_tokens - n_low) * params.bits_high) * per


def encode(x: torch.Tensor, params: PaperParams = PaperParams()) -> torch.Tensor:
    """Encode x (..., C) float32/float16/bfloat16 on a CUDA device (or under TRITON_INTERPRET=1)
    into the version-1 payload (uint8, 1-D): equal to tahquant_ref.encode(x, params) up to the
    Hadamard rounding of flagged tiles (docs/wire-format.md)."""
    with on_device(x):
        return _encode(x, params)


def _encode(x: torch.Tensor, params: PaperParams) -> torch.Tensor:
    params.validate()
    g = params.group_size
    lay = Layout.of(tuple(x.shape), g)
    if x.numel() == 0:
        raise CodecError(f"tahquant: cannot encode an empty tensor (shape {list(x.shape)})")
    x2 = _rows(x.detach(), lay)
    dev = x.device
    t, nt = lay.tiles_per_token, lay.tiles
    n_low = lay.seq_len - int(round(params.rho * lay.seq_len))

    # payload = [bitmaps, zero, scale | pivots | codes]; the front is placed right before the codes
    bm_a, bm_f = -(-lay.tokens // 8), -(-nt // 8)
    head = bm_a + bm_f + 4 * nt
    piv_max = packed_nbytes(nt, params.pivot_bits)
    out = torch.empty(head + piv_max + _codes_nbytes(lay.nseq * n_low, lay.tokens, params, t), dtype=torch.uint8,
                      device=dev)
    status = torch.empty(4, dtype=torch.int32, device=dev)  # bad input/overflow/uncertain bits, n_flag

    e32, flag, piv = _stats(x2, lay, params, status)
    cum = torch.cumsum(flag, 0, dtype=torch.int32)
    if lay.seq_len <= SEQ_MAX:
        low, off = _kernel_allocation(x2, lay, params, e32, n_low, status)
    else:
        low, off = _with_offsets(_torch_allocation(x2, lay, params, e32), params, t)
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
            out, low, flag, zs, compact, cum, status, lay.tokens, nt, bm_a, bm_f, head, piv_max,
            BLK=blk, **_pivot_planes(params),
        )
        return status.tolist()  # the one synchronization of the common path

    bad, n_flag = quantize(low, off)[:2]
    if bad & 1:
        check_finite(x, "tahquant")  # raises with the reference's message
    if bad & 4:  # too many entropies too close to the cut for the cut kernel: rank exactly
        status.zero_()
        bad = quantize(*_with_offsets(_exact_allocation(x2, lay, params), params, t))[0]
    if bad & 2:
        inf = torch.tensor([float("inf")])
        fp16_min_scale(inf, inf, 1.0, "tahquant")  # raises with the reference's message
    return out[piv_max - packed_nbytes(n_flag, params.pivot_bits) :]


def decode(payload: torch.Tensor, shape: tuple[int, ...], params: PaperParams, dtype: torch.dtype) -> torch.Tensor:
    """Decode a version-1 payload (uint8, 1-D, on a CUDA device or under TRITON_INTERPRET=1) into
    a tensor of `shape` and `dtype` on the payload's device: equal to tahquant_ref.decode up to the
    Hadamard rounding of flagged tiles; a corrupt payload raises CodecError (the reference's checks
    and messages, in its order)."""
    with on_device(payload):
        return _decode(payload, shape, params, dtype)


def _decode(payload: torch.Tensor, shape: tuple[int, ...], params: PaperParams, dtype: torch.dtype) -> torch.Tensor:
    params.validate()
    g = params.group_size
    lay = Layout.of(tuple(shape), g)
    nt, t = lay.tiles, lay.tiles_per_token
    check_min_payload(payload, shape, params)
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise CodecError(f"tahquant payload must be a 1-D uint8 tensor, got {payload.dtype} of shape "
                         f"{list(payload.shape)}")
    dev = payload.device
    bm_a, bm_f = -(-lay.tokens // 8), -(-nt // 8)
    head = bm_a + bm_f + 4 * nt  # within the minimum: the front sections are all there

    pc = torch.empty(bm_a + bm_f, dtype=torch.int32, device=dev)
    status = torch.empty(8, dtype=torch.int32, device=dev)
    blk = _byte_block()
    _bitcount_kernel[(triton.cdiv(bm_a + bm_f, blk),)](payload, pc, status, bm_a + bm_f, bm_a, lay.tokens, nt, BLK=blk)
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
    rd.take(_codes_nbytes(n_low, lay.tokens, params, t), "tile codes")
    rd.finish()
    return out.reshape(shape)
