"""Rice coding of small unsigned integers (specification): codec tahquant (TAH-Quant Rice-coded)
sends its codes this way, in vectorized torch on whatever device they are on.

A value z is split at bit k: its low k bits go, fixed width, into one packed section (tahnode.kernels.
bitpack), its high part h = z >> k into a unary stream: h one-bits then a zero-bit, values in order,
bits least significant first within a byte, the last byte padded with one-bits. The i-th zero of the
stream ends value i, so a decoder finds every value at once (the zeros' positions and their gaps)."""

from __future__ import annotations

import torch

from .bitpack import pack_bits, padded_count, unpack_bits
from .wire import CodecError

__all__ = ["best_k", "bits_at_each_k", "shortest_k", "encode", "decode", "check_k", "check_length", "wrong_end",
           "out_of_range", "check_whole_bytes"]


def best_k(z: torch.Tensor, zmax: int) -> int:
    """The k in [0, bit length of zmax] that makes values z (in [0, zmax]) shortest: the sum of
    k + 1 + (z >> k) over them, exact in int64; the smallest such k on a tie."""
    counts = torch.bincount(z.reshape(-1).long(), minlength=zmax + 1)[: zmax + 1].cpu()
    return shortest_k(bits_at_each_k(counts, zmax))


def bits_at_each_k(counts: torch.Tensor, zmax: int) -> list[int]:
    """The coded bits, sum of k + 1 + (z >> k), of values whose histogram over [0, zmax] is `counts`,
    for every k in [0, bit length of zmax]."""
    counts = counts.long()
    values = torch.arange(zmax + 1, dtype=torch.int64)
    return [int((counts * ((values >> k) + 1 + k)).sum()) for k in range(zmax.bit_length() + 1)]


def shortest_k(bits: list[int]) -> int:
    """The k of the fewest coded bits (bits[k]), the smallest on a tie."""
    return min(range(len(bits)), key=lambda k: (bits[k], k))


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


def check_k(k: int, codec: str) -> None:
    if not 0 <= k <= 8:
        raise CodecError(f"{codec} payload is corrupt: Rice parameter {k} is not in [0, 8]")


def check_length(nbytes: int, count: int, k: int, zmax: int, codec: str) -> None:
    """A unary stream of `nbytes` is no longer than `count` values of zmax take: checked before a
    decoder unpacks it (8 bits per byte), so a long one costs nothing."""
    longest = -(-count * ((zmax >> k) + 1) // 8)
    if nbytes > longest:
        raise CodecError(f"{codec} payload is corrupt: its unary stream has {nbytes} bytes, {count} values "
                         f"take at most {longest}")


def wrong_end(nbytes: int, count: int, codec: str) -> CodecError:
    """The error of a unary stream whose zero-bits are not `count`, the last of them in its last byte."""
    return CodecError(f"{codec} payload is corrupt: the {nbytes} bytes of its unary stream do not end {count} values "
                      f"exactly")


def out_of_range(codec: str) -> CodecError:
    return CodecError(f"{codec} payload is corrupt: a code is out of range")


def check_whole_bytes(count: int, coder: str) -> None:
    """The fast coders (rice_triton, rice_cpu) take a multiple of 8 values: whole bytes in every
    plane of the low bits, no padding to write or check (tahquant's N*T*G always is)."""
    if count % 8:
        raise ValueError(f"{coder} codes whole bytes of every plane: {count} values is not a multiple of 8")


def decode(low: torch.Tensor, unary: torch.Tensor, count: int, k: int, zmax: int, codec: str) -> torch.Tensor:
    """Inverse of encode -> int64 values (count,). The stream must be no longer than `count` values of
    zmax take (check_length), and hold exactly `count` zero-bits, the last of them in its last byte;
    padding of either section must be what encode writes; a value above zmax is corrupt (CodecError)."""
    check_k(k, codec)
    check_length(unary.numel(), count, k, zmax, codec)
    bits = unpack_bits(unary, 1, unary.numel() * 8)
    ends = torch.nonzero(bits == 0).reshape(-1)
    if ends.numel() != count or (count and int(ends[-1]) < 8 * (unary.numel() - 1)) or (not count and unary.numel()):
        raise wrong_end(unary.numel(), count, codec)
    high = torch.diff(ends, prepend=ends.new_full((1,), -1)) - 1
    z = high << k
    if k:
        codes = unpack_bits(low, k, padded_count(count)).to(torch.int64)
        if bool(codes[count:].any()):
            raise CodecError(f"{codec} payload is corrupt: non-zero padding in its low bits")
        z |= codes[:count]
    if count and bool((z > zmax).any()):
        raise out_of_range(codec)
    return z
