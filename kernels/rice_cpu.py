"""tahnode.kernels.rice in numpy, for tahquant's zigzagged codes on the CPU: the reference's bytes and
its refusals, with whole-array operations (a histogram for k, packbits and unpackbits for the unary
stream) instead of torch's per-bit tensors.

encode(codes, qmax, head) -> payload: k, head, low bits, unary stream   decode(...) -> codes uint8"""

from __future__ import annotations

import numpy as np
import torch

from . import rice
from .bitpack_cpu import pack_planes_np, unpack_planes_np
from .tahquant_rice_ref import unzigzag, zigzag

__all__ = ["encode", "decode"]


def _zigzag_table(qmax: int) -> np.ndarray:
    """tahquant_rice_ref.zigzag of every code byte (uint8 -> uint8; bytes past 2 qmax, which no
    encoder makes, wrap)."""
    return (zigzag(torch.arange(256, dtype=torch.uint8), qmax) & 0xFF).to(torch.uint8).numpy()


def _unzigzag_table(qmax: int) -> np.ndarray:
    """tahquant_rice_ref.unzigzag of every z byte (uint8 -> uint8; only z <= 2 qmax are looked up)."""
    return unzigzag(torch.arange(256, dtype=torch.int32), qmax).numpy()


def _cumsum_dtype(count: int, longest_run: int):
    """int32 when `count` values of at most `longest_run` unary bits each cannot overflow it."""
    return np.int32 if count * longest_run < 2 ** 31 else np.int64


def encode(codes: torch.Tensor, qmax: int, head: torch.Tensor) -> torch.Tensor:
    """Codes q + qmax (uint8 on the CPU, a multiple of 8 of them) -> payload: k u8 (rice.best_k of
    their zigzagged values), `head` (uint8), then rice.encode's low bits and unary stream at k."""
    c = codes.reshape(-1).numpy()
    rice.check_whole_bytes(c.size, "rice_cpu")
    z = _zigzag_table(qmax)[c]
    totals = rice.bits_at_each_k(torch.from_numpy(np.bincount(z, minlength=2 * qmax + 1)), 2 * qmax)
    k = rice.shortest_k(totals)
    low = pack_planes_np(z[None, :] & ((1 << k) - 1), k)[0] if k and z.size else np.zeros(0, np.uint8)
    bits = np.ones(-(-(totals[k] - k * z.size) // 8) * 8, dtype=np.uint8)  # totals[k] counts k low bits a value
    bits[np.cumsum((z >> k) + np.uint8(1), dtype=_cumsum_dtype(z.size, (2 * qmax >> k) + 1)) - 1] = 0
    unary = np.packbits(bits, bitorder="little")
    return torch.from_numpy(np.concatenate([np.array([k], np.uint8), head.numpy(), low, unary]))


def decode(low: torch.Tensor, unary: torch.Tensor, count: int, k: int, qmax: int, codec: str) -> torch.Tensor:
    """Inverse of encode -> codes q + qmax (uint8, count), with rice.decode's checks and messages
    (a multiple of 8 values: no padding in the low bits)."""
    rice.check_whole_bytes(count, "rice_cpu")
    rice.check_k(k, codec)
    rice.check_length(unary.numel(), count, k, 2 * qmax, codec)
    u = unary.numpy()
    if 8 * u.size - int(np.bitwise_count(u).sum(dtype=np.int64)) != count:  # counted before unpacking (8x its size)
        raise rice.wrong_end(u.size, count, codec)
    ends = np.flatnonzero(np.unpackbits(u, bitorder="little") == 0)
    if ends.size != count or (count and int(ends[-1]) < 8 * (u.size - 1)) or (not count and u.size):
        raise rice.wrong_end(u.size, count, codec)
    high = np.empty_like(ends)  # the gaps between zero-bits, less one (np.diff with prepend is slower)
    if count:
        high[0] = ends[0]
        np.subtract(ends[1:], ends[:-1], out=high[1:])
        high[1:] -= 1
    if count and int(high.max()) > (2 * qmax) >> k:
        raise rice.out_of_range(codec)
    z = high.astype(np.uint8) << k  # at most 2 qmax <= 254 from here on
    if k:
        z |= unpack_planes_np(low.numpy()[None, :], k, count)[0]
    if count and int(z.max()) > 2 * qmax:
        raise rice.out_of_range(codec)
    return torch.from_numpy(_unzigzag_table(qmax)[z])
