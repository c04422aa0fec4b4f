"""TAH-Quant on the CPU, fast: the same version-1 payload as tahquant_ref, byte for byte, with fewer
and larger operations. What changes is only how the work is done, never its arithmetic:

- the pivot swap and the Hadamard transform touch only the flagged tiles (the reference transforms
  every tile and keeps the flagged ones; each row's float64 product is the same either way);
- the bit planes are packed and unpacked with numpy on whole sections (no per-row-width scatter);
- the entropies, the outlier test and the quantization run the reference's operations in its
  order, skipping only its where()s where they change nothing (no all-zero row, no zero scale);
  the ranking, the fp16 zero-points and scales and the dequantization are its own functions.

encode(x (..., C), params) -> uint8 payload       decode(payload, shape, params, dtype) -> (shape)
tests/test_codec_cpu_path.py holds it to the reference's bytes and values, and to its errors."""

from __future__ import annotations

import numpy as np
import torch

from .bitpack import padded_count, plane_widths
from .quant_ref import dequantize_asym, fp16_min_scale, hadamard
from .tahquant_ref import ALLOC_TOKEN, TahQuantParams, low_bit_mask, read_header, tile_bits, to_tiles

__all__ = ["encode", "decode", "pack_rows_np", "unpack_rows_np", "pack_planes_np", "unpack_planes_np"]


def pack_planes_np(codes: np.ndarray, bits: int) -> np.ndarray:
    """Rows of codes (R, n), n a multiple of 8, as bitpack.pack_bits packs them: (R, n*bits/8)."""
    r, n = codes.shape
    planes, shift = [], 0
    for width in plane_widths(bits):
        values = ((codes >> shift) & ((1 << width) - 1)).reshape(r, n * width // 8, 8 // width)
        if width == 1:
            packed = np.packbits(values, axis=-1, bitorder="little").reshape(r, -1)
        else:
            packed = values[..., 0].copy()
            for j in range(1, 8 // width):
                packed |= values[..., j] << (j * width)
        planes.append(packed)
        shift += width
    return np.concatenate(planes, axis=1)


def unpack_planes_np(data: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of pack_planes_np: bytes (R, n*bits/8) -> codes (R, n)."""
    r = data.shape[0]
    codes, offset, shift = np.zeros((r, n), dtype=np.uint8), 0, 0
    for width in plane_widths(bits):
        nbytes = n * width // 8
        plane = data[:, offset:offset + nbytes]
        if width == 1:
            values = np.unpackbits(plane, axis=-1, bitorder="little")
        else:
            values = np.stack([(plane >> (j * width)) & ((1 << width) - 1) for j in range(8 // width)], axis=-1).reshape(r, n)
        codes |= values << shift
        offset += nbytes
        shift += width
    return codes


def _row_offsets(bits: np.ndarray, n: int) -> np.ndarray:
    sizes = bits.astype(np.int64) * (n // 8)
    return np.cumsum(sizes) - sizes


def pack_rows_np(codes: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """bitpack.pack_rows in numpy: rows (R, n) at per-row widths (R,), row blocks in row order."""
    n = codes.shape[1]
    starts = _row_offsets(bits, n)
    out = np.empty(int(bits.astype(np.int64).sum()) * (n // 8), dtype=np.uint8)
    for b in np.unique(bits):
        rows = np.flatnonzero(bits == b)
        packed = pack_planes_np(codes[rows], int(b))
        out[(starts[rows][:, None] + np.arange(packed.shape[1])).reshape(-1)] = packed.reshape(-1)
    return out


def unpack_rows_np(data: np.ndarray, bits: np.ndarray, n: int) -> np.ndarray:
    """bitpack.unpack_rows in numpy (the caller checked that `data` holds exactly the rows' bytes)."""
    starts = _row_offsets(bits, n)
    codes = np.empty((bits.size, n), dtype=np.uint8)
    for b in np.unique(bits):
        rows = np.flatnonzero(bits == b)
        idx = starts[rows][:, None] + np.arange(n * int(b) // 8)
        codes[rows] = unpack_planes_np(data[idx], int(b), n)
    return codes


def _swap_first(rows: torch.Tensor, pivot: torch.Tensor) -> None:
    """Swap position 0 with `pivot` in every row, in place (its own inverse)."""
    k = torch.arange(rows.shape[0])
    first = rows[:, 0].clone()
    rows[:, 0] = rows[k, pivot]
    rows[k, pivot] = first


def _entropy(mag: torch.Tensor) -> torch.Tensor:
    """tahquant_ref's entropy of |x| rows (float64), element for element: the where()s it needs for
    all-zero rows and zero entries are applied only where they change something."""
    mag = mag.double()
    total = mag.sum(-1, keepdim=True)
    p = mag / total
    if not bool((total > 0).all()):
        p = torch.where(total > 0, p, torch.zeros((), dtype=torch.float64))
    terms = p * torch.log(p)
    terms.masked_fill_(p == 0, 0.0)  # 0 * log(0): the reference's where(p > 0, ..., 0)
    return -terms.sum(-1)


def _outliers(mag: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """tahquant_ref.outlier_pivots from |tiles| (argmax gives the first index of the maximum too)."""
    peak, pivot = mag.max(-1)
    second = mag.scatter(-1, pivot[..., None], -1.0).amax(-1)
    flag = (peak > 0) & (peak >= torch.tensor(tau, dtype=torch.float32) * second)
    return flag, pivot


def _quantize(y: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, qmax: torch.Tensor) -> torch.Tensor:
    """quant_ref.quantize_asym, op for op, without its where() when no scale is zero."""
    s = scale.float()[..., None]
    u = (y - zero.float()[..., None]) / s
    if not bool((scale > 0).all()):
        u = torch.where(s > 0, u, torch.zeros(()))
    return torch.round(torch.minimum(torch.clamp(u, min=0.0), qmax[..., None])).to(torch.uint8)


def encode(x: torch.Tensor, params: TahQuantParams = TahQuantParams()) -> torch.Tensor:
    """tahquant_ref.encode, faster on the CPU (the same bytes)."""
    g = params.group_size
    lay, _, tiles = to_tiles(x, params)
    mag = tiles.abs()
    if params.alloc == ALLOC_TOKEN:
        low_token = low_bit_mask(_entropy(mag.reshape(lay.nseq, lay.seq_len, -1)), params.rho)
        low = low_token[..., None].expand(-1, -1, lay.tiles_per_token).reshape(-1)
        low_stored = low_token.reshape(-1)
    else:
        low = low_bit_mask(_entropy(mag).reshape(lay.nseq, -1), params.rho).reshape(-1)
        low_stored = low
    flag, pivot = _outliers(mag, params.tau)
    flag, pivot = flag.reshape(-1), pivot.reshape(-1)
    y = tiles.reshape(-1, g).clone()
    flagged = flag.nonzero().squeeze(1)
    if flagged.numel():
        sub = y[flagged]
        _swap_first(sub, pivot[flagged])
        y[flagged] = hadamard(sub)
    bits = tile_bits(low, params)
    qmax = (2.0 ** bits.float()) - 1.0
    zero, scale = fp16_min_scale(y.amin(-1), y.amax(-1), qmax, "tahquant")
    q = _quantize(y, zero, scale, qmax)
    pivots = np.zeros(padded_count(flagged.numel()), dtype=np.uint8)
    pivots[: flagged.numel()] = pivot[flagged].numpy()
    return torch.from_numpy(np.concatenate([
        np.packbits(low_stored.numpy(), bitorder="little"),
        np.packbits(flag.numpy(), bitorder="little"),
        zero.numpy().view(np.uint8),
        scale.numpy().view(np.uint8),
        pack_planes_np(pivots[None, :], params.pivot_bits)[0],
        pack_rows_np(q.numpy(), bits.numpy()),
    ]))


def decode(payload: torch.Tensor, shape: tuple[int, ...], params: TahQuantParams, dtype: torch.dtype) -> torch.Tensor:
    """tahquant_ref.decode, faster on the CPU (the same values, and the same errors in the same order)."""
    h = read_header(payload, shape, params)
    g, lay, bits, flag, zero, scale, rd = params.group_size, h.lay, h.bits, h.flag, h.zero, h.scale, h.reader
    codes = rd.take(int(bits.long().sum()) * (g // 8), "tile codes")
    rd.finish()
    q = torch.from_numpy(unpack_rows_np(codes.numpy(), bits.numpy(), g))
    y = dequantize_asym(q, zero, scale)
    flagged = flag.nonzero().squeeze(1)
    if flagged.numel():
        sub = hadamard(y[flagged])
        _swap_first(sub, h.pivots.long())
        y[flagged] = sub
    return y.reshape(lay.tokens, lay.padded_channels)[:, : lay.channels].reshape(shape).to(dtype)
