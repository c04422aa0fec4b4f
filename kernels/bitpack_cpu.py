"""tahnode.kernels.bitpack in numpy, byte for byte: bit planes of whole sections of codes, and rows
at per-row widths, packed and unpacked without a per-row scatter (the CPU paths of tahquant-paper,
pertoken and the Rice coder's low bits use them)."""

from __future__ import annotations

import numpy as np

from .bitpack import plane_widths

__all__ = ["pack_planes_np", "unpack_planes_np", "pack_rows_np", "unpack_rows_np"]


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
            values = np.stack([(plane >> (j * width)) & ((1 << width) - 1) for j in range(8 // width)],
                              axis=-1).reshape(r, n)
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
