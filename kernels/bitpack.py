"""Bit packing of 1-8 bit integer codes into bytes, shared by every codec (specification).

A b-bit code is split into power-of-two planes from the low bits up (3 = 2+1, 5 = 4+1, 6 = 4+2,
7 = 4+2+1, 8 = 8); each plane packs 8/w values per byte, least significant first, planes in order."""

from __future__ import annotations

import torch

__all__ = ["plane_widths", "padded_count", "packed_nbytes", "pack_bits", "unpack_bits", "row_nbytes", "pack_rows",
           "unpack_rows"]


def plane_widths(bits: int) -> list[int]:
    """Widths of the planes a `bits`-bit code is stored in, low bits first."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bit width must be 1..8, got {bits}")
    if bits == 8:
        return [8]
    return [w for w in (4, 2, 1) if bits & w]


def padded_count(n: int) -> int:
    """Number of codes after padding `n` with zeros to a multiple of 8 (whole bytes in every plane)."""
    return -(-n // 8) * 8


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that `n` codes of `bits` bits take once padded and packed."""
    return padded_count(n) * bits // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes (..., n) of values < 2**bits, n a multiple of 8, into uint8 (..., n*bits/8)."""
    n = codes.shape[-1]
    if n % 8:
        raise ValueError(f"pack_bits needs a multiple of 8 codes per row, got {n}")
    codes = codes.to(torch.uint8)
    planes = []
    shift = 0
    for width in plane_widths(bits):
        per_byte = 8 // width
        values = ((codes >> shift) & ((1 << width) - 1)).reshape(*codes.shape[:-1], n // per_byte, per_byte)
        packed = torch.zeros(values.shape[:-1], dtype=torch.uint8, device=codes.device)
        for j in range(per_byte):
            packed |= values[..., j] << (j * width)
        planes.append(packed)
        shift += width
    return torch.cat(planes, dim=-1)


def unpack_bits(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8 (..., n*bits/8) -> codes uint8 (..., n)."""
    if n % 8:
        raise ValueError(f"unpack_bits needs a multiple of 8 codes per row, got {n}")
    if data.shape[-1] != n * bits // 8:
        raise ValueError(f"unpack_bits: {data.shape[-1]} bytes per row, expected {n * bits // 8} for {n} codes "
                         f"of {bits} bits")
    codes = torch.zeros(*data.shape[:-1], n, dtype=torch.uint8, device=data.device)
    offset = 0
    shift = 0
    for width in plane_widths(bits):
        per_byte = 8 // width
        nbytes = n // per_byte
        plane = data[..., offset : offset + nbytes]
        mask = (1 << width) - 1
        values = torch.stack([(plane >> (j * width)) & mask for j in range(per_byte)], dim=-1)
        codes |= values.reshape(*data.shape[:-1], n) << shift
        offset += nbytes
        shift += width
    return codes


def row_nbytes(bits_per_row: torch.Tensor, n: int) -> torch.Tensor:
    """Bytes each row of n codes (n a multiple of 8) takes at its own bit width."""
    return bits_per_row.long() * (n // 8)


def pack_rows(codes: torch.Tensor, bits_per_row: torch.Tensor) -> torch.Tensor:
    """Pack rows of codes (R, n) at per-row bit widths (R,) into consecutive blocks, row order."""
    r, n = codes.shape
    sizes = row_nbytes(bits_per_row, n)
    starts = torch.cumsum(sizes, 0) - sizes
    out = torch.empty(int(sizes.sum()), dtype=torch.uint8, device=codes.device)
    for b in sorted(set(bits_per_row.tolist())):
        sel = bits_per_row == b
        packed = pack_bits(codes[sel], int(b))
        idx = starts[sel][:, None] + torch.arange(packed.shape[1], device=codes.device)
        out[idx.reshape(-1)] = packed.reshape(-1)
    return out


def unpack_rows(data: torch.Tensor, bits_per_row: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack_rows: bytes -> codes (R, n); `data` must hold exactly the rows' bytes."""
    sizes = row_nbytes(bits_per_row, n)
    if data.numel() != int(sizes.sum()):
        raise ValueError(f"unpack_rows: {data.numel()} bytes, rows need {int(sizes.sum())}")
    starts = torch.cumsum(sizes, 0) - sizes
    codes = torch.empty(bits_per_row.numel(), n, dtype=torch.uint8, device=data.device)
    for b in sorted(set(bits_per_row.tolist())):
        sel = bits_per_row == b
        idx = starts[sel][:, None] + torch.arange(n * int(b) // 8, device=data.device)
        codes[sel] = unpack_bits(data[idx], int(b), n)
    return codes
