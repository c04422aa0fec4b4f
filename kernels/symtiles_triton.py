"""symtiles_ref in Triton: symmetric absmax per tile of G channels of a token with a bf16 scale, after
the random-sign Hadamard rotation where asked; the kernels of `pertoken` (encode, decode) and of
codec tahquant (launch_*, rotated), giving the references' bytes and values exactly.

encode: one kernel over blocks of (BR tokens x one tile): load, [signs, fwht butterflies in fp32],
absmax, scale, quantize, and the codes straight into their bit planes when every tile starts on a
whole byte (row width a multiple of 8; else into a code buffer that one flat kernel packs); for
tahquant also the Rice coder's block sums of those codes (rice_sums_triton).
decode: one kernel over the same blocks: unpack, check, dequantize, [fwht, 1/G, signs], store.
The one synchronization of each reads its error flags, to raise the references' errors (launch_*:
the kernels alone, for a caller that reads the flags in a synchronization of its own)."""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from .bitpack import packed_nbytes, padded_count, plane_widths
from .quant_ref import check_finite
from .rice_sums_triton import add_block_sums, zigzag
from .symtiles_ref import MIN_SCALE, corrupt_codes, rotation_signs
from .triton_util import interpreting, on_device, quotient, round_half_even, to_bf16_rne
from .wire import CodecError

__all__ = ["encode", "decode", "launch_encode", "raise_for_encode", "launch_decode", "raise_for_decode", "store_planes",
           "plane_shifts"]

MIN_SCALE_C = tl.constexpr(MIN_SCALE)  # the reference's smallest tile scale sent, as the kernels read it
MIN_SCALE_BITS = tl.constexpr(struct.unpack("<i", struct.pack("<f", MIN_SCALE))[0])  # its float32 bits (0x00800000)
# (values, warps) per program of the encode and decode kernels on a GPU: a block is values // G
# tokens of one tile. The interpreter's blocks are larger (its cost is per program). `tahnode bench
# kernels --sweep` times others (the references' bytes at each: tests/test_bench.py)
GPU_ENCODE_BLOCK = (4096, 4)
GPU_DECODE_BLOCK = (4096, 4)


@triton.jit
def _butterfly(y, BR: tl.constexpr, G: tl.constexpr, H: tl.constexpr):
    """One fwht stage on y (BR, G): within each block of 2H entries, (y[j], y[j + H]) -> (a + b, a - b).
    Each entry adds its partner to itself or to its negation (b + a; a + -b, which is a - b exactly),
    as fma(v, +-1, partner): the product is exact, so it rounds once as the sum does, and the sign is
    one register a thread where the pair lies in two lanes (a select of v or -v took one a value).
    Its partner's bits are the pair's sum of bits (int32, modulo 2^32) less its own: a shuffle where
    the two lie in different lanes, nothing where a thread holds both (tl.flip's xor gives the same
    code on a GPU, but the interpreter runs its reduction value by value). So y keeps its layout from
    stage to stage: splitting the pair off took a layout conversion a stage and, in the encode, left
    a thread's values in different rows, a reciprocal of a scale for each."""
    if H < G:
        v = tl.reshape(y, (BR * G // (2 * H), 2, H))
        first = (tl.arange(0, 2) == 0)[None, :, None]
        bits = v.to(tl.int32, bitcast=True)
        partner = (tl.sum(bits, axis=1)[:, None, :] - bits).to(tl.float32, bitcast=True)
        y = tl.reshape(tl.fma(v, tl.where(first, 1.0, -1.0), partner), (BR, G))
    return y


@triton.jit
def _fwht(y, BR: tl.constexpr, G: tl.constexpr):
    """symtiles_ref.fwht of each row of y (BR, G) float32 (G <= 256): stages h = 1, 2, ..., G/2."""
    y = _butterfly(y, BR, G, 1)
    y = _butterfly(y, BR, G, 2)
    y = _butterfly(y, BR, G, 4)
    y = _butterfly(y, BR, G, 8)
    y = _butterfly(y, BR, G, 16)
    y = _butterfly(y, BR, G, 32)
    y = _butterfly(y, BR, G, 64)
    y = _butterfly(y, BR, G, 128)
    return y


@triton.jit
def _store_plane(out_ptr, plane, q, first, count, rows_ok, BR: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
    """The low W bits of the codes q (BR, G), whose code indices start at first (BR,) (multiples of 8),
    into the width-W plane that starts at byte `plane`: 8/W codes per byte, least significant first.
    Only the first `count` codes of each row (a multiple of 8) are stored."""
    PER: tl.constexpr = 8 // W
    v = tl.reshape(q & ((1 << W) - 1), (BR, G // PER, PER))
    packed = tl.sum(v << (tl.arange(0, PER) * W)[None, None, :], axis=2)
    k = tl.arange(0, G // PER)
    ok = rows_ok[:, None] & (k[None, :] * PER < count)
    tl.store(out_ptr + plane + first[:, None] // PER + k[None, :], packed.to(tl.uint8), mask=ok)


@triton.jit
def store_planes(out_ptr, n_pad, q, first, count, rows_ok, BR: tl.constexpr, G: tl.constexpr, S8: tl.constexpr,
                 S4: tl.constexpr, S2: tl.constexpr, S1: tl.constexpr):
    """_store_plane into every plane of the code (S<w>: its bit offset in the code, -1 if absent), the
    planes of n_pad codes one after another."""
    if S8 >= 0:
        _store_plane(out_ptr, n_pad // 8 * S8, q >> S8, first, count, rows_ok, BR, G, 8)
    if S4 >= 0:
        _store_plane(out_ptr, n_pad // 8 * S4, q >> S4, first, count, rows_ok, BR, G, 4)
    if S2 >= 0:
        _store_plane(out_ptr, n_pad // 8 * S2, q >> S2, first, count, rows_ok, BR, G, 2)
    if S1 >= 0:
        _store_plane(out_ptr, n_pad // 8 * S1, q >> S1, first, count, rows_ok, BR, G, 1)


@triton.jit
def _load_plane(base, first, count, rows_ok, BR: tl.constexpr, G: tl.constexpr, W: tl.constexpr, SHORT: tl.constexpr):
    """The width-W plane's values (BR, G) int32 of the codes at indices first + 0..G-1 (any first).
    SHORT (a row's last tile is short): 0 past the first `count` of each row, so that the last row's
    tile reads nothing past the plane (a mask that costs 16 registers at 4096 values in 4 warps)."""
    PER: tl.constexpr = 8 // W
    j = tl.arange(0, G)
    i = first[:, None] + j[None, :]
    ok = rows_ok[:, None] & (j < count)[None, :] if SHORT else rows_ok[:, None]
    b = tl.load(base + i // PER, mask=ok, other=0).to(tl.int32)
    return (b >> ((i % PER) * W).to(tl.int32)) & ((1 << W) - 1)


@triton.jit
def _block(n_rows, BR: tl.constexpr, G: tl.constexpr):
    """This program's tokens [r*BR, +BR) and tile t: (t, rows, rows_ok, j = 0..G-1, channels c)."""
    rb = tl.program_id(0)
    t = tl.program_id(1)
    rows = rb * BR + tl.arange(0, BR)
    j = tl.arange(0, G)
    return t, rows, rows < n_rows, j, t * G + j


@triton.jit
def _encode_kernel(x_ptr, stride_x, signs_ptr, n_rows, n_chan, n_tpt, width, scale_ptr, out_ptr, n_pad, codes_ptr,
                   status_ptr, sums_ptr,
                   G: tl.constexpr, QMAX: tl.constexpr, ROTATE: tl.constexpr, PACKED: tl.constexpr,
                   BR: tl.constexpr, S8: tl.constexpr, S4: tl.constexpr, S2: tl.constexpr, S1: tl.constexpr,
                   SUMS_BLOCK: tl.constexpr, KMAX: tl.constexpr):
    """Program (r, t): tokens [r*BR, +BR), tile t. Scales go to scale_ptr[token * n_tpt + t]; code i
    of a token (i < width: C, or T*G when ROTATE) is code token*width + i of the payload's planes
    (S<w>: the bit offset of the width-w plane, -1 if absent), or of codes_ptr unpacked when not
    PACKED. status[0] |= 1 for a non-finite input, |= 2 for a rotated value too large (|= 3 for either
    when ROTATE: raise_for_encode tells them apart on the host). Where SUMS_BLOCK > 0, also adds the
    block sums rice_triton's write kernel reads: sums[b, k] += the sum of z >> k (k <= KMAX) over the
    program's codes in block b of SUMS_BLOCK codes (z: the code less QMAX, zigzagged), a row's tile
    at a time (a multiple of G: each lies in one block), by atomic additions."""
    t, rows, rows_ok, j, c = _block(n_rows, BR, G)
    m = rows_ok[:, None] & (c < n_chan)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + c[None, :], mask=m, other=0.0).to(tl.float32)
    if ROTATE:  # a non-finite input makes its tile's sums non-finite: one check after the rotation finds both
        x = _fwht(x * tl.load(signs_ptr + j)[None, :], BR, G)
        xg = x * G
        bad = 3 * tl.max(tl.max((xg - xg != 0).to(tl.int32), axis=1), axis=0)  # inf - inf, nan - nan: nan
    else:
        bad = tl.max(tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=1), axis=0)
    if bad != 0:
        tl.atomic_or(status_ptr, bad)
    ratio = tl.math.div_rn(tl.max(tl.abs(x), axis=1), tl.full([BR], QMAX, tl.float32))
    s16 = tl.where(ratio >= MIN_SCALE_C, to_bf16_rne(ratio), tl.zeros([BR], dtype=tl.bfloat16))
    tl.store(scale_ptr + rows.to(tl.int64) * n_tpt + t, s16, mask=rows_ok)
    s = s16.to(tl.float32)[:, None]
    pos = s > 0
    u = tl.where(pos, quotient(x, tl.where(pos, s, 1.0)), 0.0)
    q = round_half_even(tl.minimum(tl.maximum(u, -QMAX), QMAX)) + QMAX
    first = rows.to(tl.int64) * width + t * G
    if PACKED:
        store_planes(out_ptr, n_pad, q, first, width - t * G, rows_ok, BR, G, S8, S4, S2, S1)
    else:
        tl.store(codes_ptr + first[:, None] + j[None, :], q.to(tl.uint8), mask=m)
    if SUMS_BLOCK > 0:  # (rows past n_rows have codes QMAX: z = 0)
        add_block_sums(zigzag(q - QMAX), sums_ptr + first // SUMS_BLOCK * 9, rows_ok, BR, G, KMAX)


@triton.jit
def _pack_kernel(codes_ptr, out_ptr, n, n_pad, BLOCK: tl.constexpr, S8: tl.constexpr, S4: tl.constexpr,
                 S2: tl.constexpr, S1: tl.constexpr):
    """Pack codes [pid*BLOCK, +BLOCK) of the flat code buffer (zero past n) into the planes."""
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    q = tl.load(codes_ptr + i, mask=i < n, other=0).to(tl.int32)
    first = tl.full([1], 0, tl.int64) + pid.to(tl.int64) * BLOCK
    ok = first < n_pad
    store_planes(out_ptr, n_pad, tl.reshape(q, (1, BLOCK)), first, n_pad - first, ok, 1, BLOCK, S8, S4, S2, S1)


@triton.jit
def _decode_kernel(codes_ptr, n_pad, scale_ptr, signs_ptr, out_ptr, bad_ptr, n_rows, n_chan, n_tpt, width,
                   G: tl.constexpr, QMAX: tl.constexpr, ROTATE: tl.constexpr, BR: tl.constexpr, OUT_BF16: tl.constexpr,
                   SHORT: tl.constexpr, S8: tl.constexpr, S4: tl.constexpr, S2: tl.constexpr, S1: tl.constexpr):
    """Program (r, t): tokens [r*BR, +BR), tile t (SHORT: width is not a multiple of G). bad[program]
    = 2 if one of its scales is not +0 or a positive normal float32, else 1 if a code exceeds 2*QMAX,
    else 0."""
    t, rows, rows_ok, j, c = _block(n_rows, BR, G)
    in_row = (c < width)[None, :]
    first = rows.to(tl.int64) * width + t * G
    count = width - t * G
    q = tl.zeros([BR, G], dtype=tl.int32)
    if S8 >= 0:
        q |= _load_plane(codes_ptr + n_pad // 8 * S8, first, count, rows_ok, BR, G, 8, SHORT) << S8
    if S4 >= 0:
        q |= _load_plane(codes_ptr + n_pad // 8 * S4, first, count, rows_ok, BR, G, 4, SHORT) << S4
    if S2 >= 0:
        q |= _load_plane(codes_ptr + n_pad // 8 * S2, first, count, rows_ok, BR, G, 2, SHORT) << S2
    if S1 >= 0:
        q |= _load_plane(codes_ptr + n_pad // 8 * S1, first, count, rows_ok, BR, G, 1, SHORT) << S1
    s = tl.load(scale_ptr + rows.to(tl.int64) * n_tpt + t, mask=rows_ok, other=0.0).to(tl.float32)
    sbits = s.to(tl.int32, bitcast=True)
    # sign set, subnormal, inf or nan
    bad_scale = rows_ok & (sbits != 0) & ((sbits < MIN_SCALE_BITS) | (sbits >= 0x7F800000))
    bad_code = rows_ok[:, None] & in_row & (q > 2 * QMAX)
    bad = tl.where(tl.max(bad_scale.to(tl.int32), axis=0) > 0, 2, tl.max(tl.max(bad_code.to(tl.int32), axis=1), axis=0))
    tl.store(bad_ptr + tl.program_id(0) * tl.num_programs(1) + t, bad.to(tl.uint8))
    y = (q.to(tl.float32) - QMAX) * s[:, None]
    if ROTATE:
        y = _fwht(y, BR, G) * (1.0 / G) * tl.load(signs_ptr + j)[None, :]
    m = rows_ok[:, None] & (c < n_chan)[None, :]
    dst = out_ptr + rows.to(tl.int64)[:, None] * n_chan + c[None, :]
    if OUT_BF16:
        tl.store(dst, to_bf16_rne(y), mask=m)
    else:
        tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=m)


def plane_shifts(bits: int) -> dict:
    """The bit offset S<w> of each plane of width w (-1 when the code has none; all -1 for 0 bits)."""
    shifts, shift = {}, 0
    for w in plane_widths(bits) if bits else []:
        shifts[w] = shift
        shift += w
    return {f"S{w}": shifts.get(w, -1) for w in (8, 4, 2, 1)}


def _grid(bits: int, qmax: int) -> int:
    """The largest |q| of a grid of `bits`-bit codes: qmax where given, else 2^(bits-1) - 1."""
    widest = 2 ** (bits - 1) - 1
    if not 0 <= qmax <= widest:
        raise ValueError(f"a grid of {bits}-bit codes has qmax at most {widest}, got {qmax}")
    return qmax or widest


def _launch(block: tuple[int, int], g: int, n_rows: int) -> tuple[int, int]:
    """(tokens, warps) per program: block = (values, warps) on a GPU, 65536 values in the interpreter."""
    values, warps = (65536, 4) if interpreting() else block
    return max(1, min(triton.next_power_of_2(max(1, n_rows)), values // g)), warps


def encode(x2: torch.Tensor, g: int, bits: int, codec: str) -> torch.Tensor:
    """x2 (N, C) on a CUDA device (or interpreted) -> payload: bf16 scales (N, T) then the packed
    codes of the unrotated values on the grid q in [-qmax, qmax], qmax = 2^(bits-1) - 1 (pertoken's)."""
    out, _, status = launch_encode(x2, g, bits, False)
    raise_for_encode(int(status.item()), x2, codec)  # the one synchronization
    return out


def launch_encode(x2: torch.Tensor, g: int, bits: int, rotate: bool, qmax: int = 0,
                  sums: tuple[torch.Tensor, int] | None = None) -> tuple[torch.Tensor, int, torch.Tensor]:
    """encode's kernels, launched: (payload, width, status int32 (1,) for raise_for_encode), not
    waited for (a caller may read the status in a synchronization of its own). `sums`: (zeros
    (blocks, 9) int32, block), to which the kernel adds rice_triton's block sums of the codes, their
    blocks `block` codes each (a multiple of g; rice_triton.sums_buffer)."""
    with on_device(x2):
        n, c = x2.shape
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        t = -(-c // g)
        width = t * g if rotate else c
        qmax = _grid(bits, qmax)
        n_codes = n * width
        n_pad = padded_count(n_codes)
        head = 2 * n * t
        out = torch.empty(head + packed_nbytes(n_codes, bits), dtype=torch.uint8, device=x2.device)
        status = torch.zeros(1, dtype=torch.int32, device=x2.device)
        signs = rotation_signs(g, x2.device) if rotate else status  # a pointer the kernel never reads
        packed = width % 8 == 0
        codes = out if packed else torch.empty(n_codes, dtype=torch.uint8, device=x2.device)
        br, warps = _launch(GPU_ENCODE_BLOCK, g, n)
        sums_at, sums_block = sums if sums is not None else (status, 0)
        if sums_block % g:
            raise ValueError(f"block sums over {sums_block} codes would cut tiles of {g}")
        _encode_kernel[(triton.cdiv(n, br), t)](
            x2, x2.stride(0), signs, n, c, t, width, out[:head].view(torch.bfloat16), out[head:], n_pad, codes, status,
            sums_at, G=g, QMAX=qmax, ROTATE=rotate, PACKED=packed, BR=br, **plane_shifts(bits), SUMS_BLOCK=sums_block,
            KMAX=(2 * qmax).bit_length(), num_warps=warps)
        if not packed:
            block = 65536 if interpreting() else 4096
            _pack_kernel[(triton.cdiv(n_pad, block),)](codes, out[head:], n_codes, n_pad, BLOCK=block,
                                                       **plane_shifts(bits))
        return out, width, status


def raise_for_encode(status: int, x2: torch.Tensor, codec: str) -> None:
    """The reference's error for a status launch_encode's kernel set, if any: a non-finite input first
    (checked again here, as the rotated kernel flags both with one check), then a rotated value too
    large."""
    if status & 1:
        check_finite(x2, codec)  # raises with the reference's message
    if status & 2:
        raise CodecError(f"{codec}: an activation is too large to rotate (|x| near the float32 maximum)")


def decode(scale: torch.Tensor, codes: torch.Tensor, n: int, c: int, g: int, bits: int, dtype: torch.dtype,
           codec: str) -> torch.Tensor:
    """(N, C) of `dtype` from checked sections (scale bf16 (N, T), packed codes), on their device;
    the grid as encode's."""
    out, worst = launch_decode(scale, codes, n, c, g, bits, False, dtype)
    raise_for_decode(int(worst), codec)  # the one synchronization
    return out


def launch_decode(scale: torch.Tensor, codes: torch.Tensor, n: int, c: int, g: int, bits: int, rotate: bool,
                  dtype: torch.dtype, qmax: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """decode's kernels, launched: (output, its worst flag (uint8 scalar on the device) for
    raise_for_decode), not waited for."""
    with on_device(codes):
        t = scale.shape[1]
        width = t * g if rotate else c
        n_pad = padded_count(n * width)
        br, warps = _launch(GPU_DECODE_BLOCK, g, n)
        grid = (triton.cdiv(n, br), t)
        out = torch.empty(n, c, dtype=dtype, device=codes.device)
        bad = torch.empty(grid[0] * grid[1], dtype=torch.uint8, device=codes.device)
        signs = rotation_signs(g, codes.device) if rotate else bad
        qmax = _grid(bits, qmax)
        _decode_kernel[grid](codes, n_pad, scale, signs, out, bad, n, c, t, width, G=g, QMAX=qmax, ROTATE=rotate, BR=br,
                             OUT_BF16=dtype == torch.bfloat16, SHORT=width % g != 0, **plane_shifts(bits),
                             num_warps=warps)
        return out, torch.maximum(bad.max(), _padding_flag(codes, n * width, n_pad, bits))


def raise_for_decode(worst: int, codec: str) -> None:
    """The reference's error for the flag launch_decode's kernel set, if any."""
    if worst == 2:
        raise CodecError(f"{codec} payload is corrupt: a scale is negative, non-finite or subnormal")
    if worst == 1:
        raise corrupt_codes(codec)


def _padding_flag(codes: torch.Tensor, n_codes: int, n_pad: int, bits: int) -> torch.Tensor:
    """1 (uint8, on the device) if a padding code (index n_codes..n_pad-1) of any plane is not zero."""
    flag = torch.zeros((), dtype=torch.uint8, device=codes.device)
    if n_codes == n_pad:
        return flag
    plane = 0
    for w in plane_widths(bits):
        per = 8 // w
        first_byte = n_codes // per
        tail = codes[plane + first_byte: plane + n_pad // per]
        shifts = torch.arange(per, device=codes.device) * w
        values = (tail[:, None].long() >> shifts) & ((1 << w) - 1)
        index = ((first_byte + torch.arange(tail.numel(), device=codes.device))[:, None] * per
                 + torch.arange(per, device=codes.device))
        flag = torch.maximum(flag, ((values != 0) & (index >= n_codes)).any().to(torch.uint8))
        plane += n_pad * w // 8
    return flag
