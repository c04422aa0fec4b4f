"""Rice coding of small unsigned integers (specification): TAH-Quant's entropy-coded layout (layout 3)
sends its codes this way, in vectorized torch on whatever device they are on.

A value z is split at bit k: its low k bits go, fixed width, into one packed section (tahnode.kernels.
bitpack), its high part h = z >> k into a unary stream: h one-bits then a zero-bit, values in order,
bits least significant first within a byte, the last byte padded with one-bits. The i-th zero of the
stream ends value i, so a decoder finds every value at once (the zeros' positions and their gaps)."""

from __future__ import annotations

import torch

from .bitpack import pack_bits, packed_nbytes, padded_count, unpack_bits
from .wire import CodecError

__all__ = ["best_k", "coded_nbytes", "encode", "decode"]


def best_k(z: torch.Tensor, zmax: int) -> int:
    """The k in [0, bit length of zmax] that makes values z (in [0, zmax]) shortest: the sum of
    k + 1 + (z >> k) over them, exact in int64; the smallest such k on a tie."""
    counts = torch.bincount(z.reshape(-1).long(), minlength=zmax + 1)[: zmax + 1].cpu().long()
    values = torch.arange(zmax + 1, dtype=torch.int64)
    totals = [int((counts * ((values >> k) + 1 + k)).sum()) for k in range(zmax.bit_length() + 1)]
    return min(range(len(totals)), key=lambda k: (totals[k], k))


def coded_nbytes(z: torch.Tensor, k: int) -> tuple[int, int]:
    """(bytes of the low bits, bytes of the unary stream) of values z coded at k."""
    unary_bits = int((z.reshape(-1).long() >> k).sum()) + z.numel()
    return (packed_nbytes(z.numel(), k) if k else 0), -(-unary_bits // 8)


def encode(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values z (any shape, row-major order, each in [0, 255]) -> (low bits: packed at k bits, zero-padded
    to a multiple of 8 values, empty when k = 0; unary stream), both uint8 on z's device."""
    if not 0 <= k <= 8:
        raise ValueError(f"rice: k must be in [0, 8], got {k}")
    flat = z.reshape(-1)
    if k:
        low = torch.zeros(padded_count(flat.numel()), dtype=torch.uint8, device=z.device)
        low[: flat.numel()] = (flat & ((1 << k) - 1)).to(torch.uint8)
        low = pack_bits(low, k)
    else:
        low = torch.empty(0, dtype=torch.uint8, device=z.device)
    ends = torch.cumsum((flat >> k) + 1, 0, dtype=torch.int64) - 1  # the position of each value's zero-bit
    total = int(ends[-1]) + 1 if flat.numel() else 0
    bits = torch.ones(padded_count(total), dtype=torch.uint8, device=z.device)
    bits[ends] = 0
    return low, pack_bits(bits, 1)


def decode(low: torch.Tensor, unary: torch.Tensor, count: int, k: int, zmax: int, codec: str) -> torch.Tensor:
    """Inverse of encode -> int64 values (count,). The stream must be no longer than `count` values of
    zmax take, and hold exactly `count` zero-bits, the last of them in its last byte; padding of
    either section must be what encode writes; a value above zmax is corrupt (CodecError)."""
    if not 0 <= k <= 8:
        raise CodecError(f"{codec} payload is corrupt: Rice parameter {k} is not in [0, 8]")
    longest = -(-count * ((zmax >> k) + 1) // 8)  # every value at zmax: checked before unpacking 8x the bytes
    if unary.numel() > longest:
        raise CodecError(f"{codec} payload is corrupt: its unary stream has {unary.numel()} bytes, {count} values "
                         f"take at most {longest}")
    bits = unpack_bits(unary, 1, unary.numel() * 8)
    ends = torch.nonzero(bits == 0).reshape(-1)
    if ends.numel() != count or (count and int(ends[-1]) < 8 * (unary.numel() - 1)) or (not count and unary.numel()):
        raise CodecError(f"{codec} payload is corrupt: the {unary.numel()} bytes of its unary stream do not end "
                         f"{count} values exactly")
    high = torch.diff(ends, prepend=ends.new_full((1,), -1)) - 1
    z = high << k
    if k:
        codes = unpack_bits(low, k, padded_count(count)).to(torch.int64)
        if bool(codes[count:].any()):
            raise CodecError(f"{codec} payload is corrupt: non-zero padding in its low bits")
        z |= codes[:count]
    if count and bool((z > zmax).any()):
        raise CodecError(f"{codec} payload is corrupt: a code is out of range")
    return z
