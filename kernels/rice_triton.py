"""tahnode.kernels.rice in Triton, for tahquant's zigzagged codes on the GPU: the reference's bytes,
and its refusals, with one synchronization each way.

encode: a kernel sums each block's high parts at every k (rice_sums_triton: tahquant's quantizing
kernel adds them instead, as it makes the codes) and a cumsum runs them over the blocks; a
one-program kernel picks k (rice.best_k's) and the payload's size from the totals; a third packs the
low bits into their planes and writes the unary stream, each byte once, by the last value whose
zero-bit falls in it (no atomics; a thread takes 8 or more values in a row, their zero-bits in one
int64 where they fit, else carried a byte at a time), into a buffer with room for the longest
payload. It is compiled for a guessed k and stores only if the device picked it, so no synchronization comes
between the kernels: the one synchronization reads the size and k after all three (and launches the
third again at the k picked, should the guess be wrong). block_sums, launch_write and launch_decode
let a caller read other kernels' flags in the same synchronization.
decode: a kernel counts each block's zero-bits; a second ranks every zero-bit (its value's index),
counts the run of one-bits below it (the high part), adds the low bits, checks the range and stores
the code (a thread takes a few stream bytes in a row, bit after bit); the synchronization reads the
count and the range check. Only cumulative sums are scanned, so Triton's interpreter runs them at
numpy's speed.

The kernels are in rice_triton_kernels; this module sizes the buffers and launches them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from . import rice
from .rice_triton_kernels import _pick_kernel, _sums_kernel, _values_kernel, _write_kernel, _zeros_kernel
from .symtiles_triton import plane_shifts
from .triton_util import interpreting, on_device

__all__ = ["encode", "block_sums", "sums_buffer", "ends_of", "launch_write", "RiceWrite", "decode", "launch_decode",
           "raise_for_decode"]


# (values, warps) per program of the encode kernels and (stream bytes, warps) of the decode kernels on
# a GPU. `tahnode bench kernels --sweep` times others (the references' bytes at each: tests/test_bench.py)
GPU_ENCODE_BLOCK = (1024, 4)
GPU_DECODE_BLOCK = (256, 4)


def _blocks() -> tuple[tuple[int, int], tuple[int, int]]:
    """(GPU_ENCODE_BLOCK, GPU_DECODE_BLOCK), or 65536 of each in the interpreter (its cost is per program)."""
    return ((65536, 4), (65536, 4)) if interpreting() else (GPU_ENCODE_BLOCK, GPU_DECODE_BLOCK)


def encode(codes: torch.Tensor, qmax: int, head: torch.Tensor) -> torch.Tensor:
    """Codes q + qmax (uint8, a multiple of 8 of them, each at most 2 qmax) on a CUDA device (or
    interpreted) -> payload: k u8 (rice.best_k of their zigzagged values), `head` (uint8), then
    rice.encode's low bits and unary stream at k, byte for byte, the sections written in place."""
    sums, ends = block_sums(codes, qmax)
    write = launch_write(codes, qmax, head, sums, ends)
    return write.finish(*write.picked.tolist())  # the one synchronization


def block_sums(codes: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """encode's first kernel and the sums over blocks, launched: (sums, ends), (blocks, 9) each,
    sums[b, k] (int32) the sum of z >> k over block b's values (0 for k above the bit length of
    2 qmax), ends[b, k] (int64) that over blocks 0..b. The totals, ends[-1], fix k and the size."""
    codes = codes.reshape(-1)
    n = codes.numel()
    rice.check_whole_bytes(n, "rice_triton")
    with on_device(codes):
        sums, block = sums_buffer(n, codes.device)
        if n:
            _sums_kernel[(triton.cdiv(n, block),)](codes, n, sums, QMAX=qmax, KMAX=(2 * qmax).bit_length(), BLOCK=block,
                                                   num_warps=_blocks()[0][1])
        return sums, ends_of(sums)


def sums_buffer(n: int, device) -> tuple[torch.Tensor, int]:
    """(zeros (blocks, 9) int32, block): where the block sums of n codes go, block codes each (the
    write kernel's block), for block_sums' kernel or another that computes them (symtiles_triton's)."""
    (block, _), _ = _blocks()
    return torch.zeros(max(triton.cdiv(n, block), 1), 9, dtype=torch.int32, device=device), block


def ends_of(sums: torch.Tensor) -> torch.Tensor:
    """The block sums' running totals (int64), ends[b] over blocks 0..b: what launch_write reads beside them.
    One scan of the columns laid end to end, each column's start taken off after: torch's scan down the
    rows of a (blocks, 9) tensor runs each column on one GPU thread (5.8 ms at 4x2048x4096 on an H200,
    94% of the codec's GPU time), while a 1-D scan is CUB's."""
    columns = torch.cumsum(sums.t().reshape(-1), 0, dtype=torch.int64).view(sums.shape[1], sums.shape[0])
    before = torch.cat([columns.new_zeros(1), columns[:-1, -1]])  # each column's start: the columns before it
    return (columns - before[:, None]).t().contiguous()


# The k the last payload of each (qmax, values) took: the next one's first write kernel is compiled
# for it (k seldom changes between a stage's messages); a wrong guess costs a second launch, not bytes.
_LAST_K: dict[tuple[int, int], int] = {}


@dataclass
class RiceWrite:
    """A payload launch_write started: `payload`, a buffer with room for the longest; `picked`, int64
    (2,) on the device: the payload's size in bytes and its k; what a second write kernel needs."""

    payload: torch.Tensor
    picked: torch.Tensor
    start: int  # the low bits' first byte: 1 + the head's
    codes: torch.Tensor
    qmax: int
    sums: torch.Tensor
    ends: torch.Tensor
    guess: int

    def finish(self, size: int, k: int) -> torch.Tensor:
        """The payload, from `picked` read on the host: a view of the buffer. Where k is not the
        guess, the write kernel for k is launched now (its bytes follow on the stream, in order)."""
        if size > self.payload.numel():
            raise ValueError(f"rice_triton codes values up to 2 qmax: a code above that needs {size} bytes, "
                             f"{self.payload.numel()} were allotted")
        n = self.codes.numel()
        if len(_LAST_K) > 64:  # many shapes: a guess per shape is no longer worth keeping
            _LAST_K.clear()
        _LAST_K[(self.qmax, n)] = k
        if n and k != self.guess:
            _launch_write_kernel(self, k)
        return self.payload[:size]


def launch_write(codes: torch.Tensor, qmax: int, head: torch.Tensor, sums: torch.Tensor,
                 ends: torch.Tensor) -> RiceWrite:
    """encode's payload from block_sums' (sums, ends), launched and not waited for (RiceWrite.finish
    ends it, from `picked` read in the caller's synchronization): one copy (the head), a one-program
    kernel that picks k and the size, and the write kernel compiled for the k guessed (the last
    payload's of this size), which writes only if that is the k picked. The buffer has room for the
    longest payload codes up to 2 qmax make: that at the largest k, where every high part is 0."""
    codes = codes.reshape(-1)
    n = codes.numel()
    if n >= 2 ** 31:  # the write kernel's indices and positions within a block are int32
        raise ValueError(f"rice_triton codes at most 2**31 - 1 values in one payload, not {n}")
    kmax = (2 * qmax).bit_length()
    start = 1 + head.numel()
    with on_device(codes):
        payload = torch.empty(start + n * (kmax + 1) // 8, dtype=torch.uint8, device=codes.device)
        payload[1:start] = head
        picked = torch.empty(2, dtype=torch.int64, device=codes.device)  # (not torch.tensor: its copy would wait)
        write = RiceWrite(payload, picked, start, codes, qmax, sums, ends, _LAST_K.get((qmax, n), max(0, kmax - 3)))
        if n:
            _pick_kernel[(1,)](ends[-1], n, start, payload.numel(), picked, payload, KMAX=kmax, num_warps=1)
            _launch_write_kernel(write, write.guess)
        else:
            payload[0], picked[0], picked[1] = 0, start, 0
        return write


def _launch_write_kernel(write: RiceWrite, k: int) -> None:
    """The write kernel compiled for k, over write's codes."""
    (block, warps), _ = _blocks()
    n = write.codes.numel()
    with on_device(write.codes):
        _write_kernel[(triton.cdiv(n, block),)](write.codes, n, write.sums, write.ends, write.payload, write.start,
                                                 QMAX=write.qmax, K=k, BLOCK=block,
                                                 PER_LANE=_values_per_lane(block, warps), **plane_shifts(k),
                                                 num_warps=warps)


def _values_per_lane(block: int, warps: int) -> int:
    """Values a lane of the write kernel takes: a program's over its threads, 8 at least (see _write_kernel)."""
    return 8 if interpreting() else max(8, block // (32 * warps))


def _bytes_per_lane(block: int, warps: int) -> int:
    """Stream bytes a lane of the values kernel takes: a program's bytes over its threads on a GPU, one
    in the interpreter (whose cost is per operation, and a lane's bytes are unrolled)."""
    return 1 if interpreting() else max(1, block // (32 * warps))


def decode(low: torch.Tensor, unary: torch.Tensor, count: int, k: int, qmax: int, codec: str) -> torch.Tensor:
    """Inverse of encode -> codes q + qmax (uint8, count), with rice.decode's checks and messages
    (a multiple of 8 values: no padding in the low bits)."""
    codes, flags = launch_decode(low, unary, count, k, qmax, codec)
    raise_for_decode(flags.tolist(), unary.numel(), count, codec)  # the one synchronization
    return codes


def launch_decode(low: torch.Tensor, unary: torch.Tensor, count: int, k: int, qmax: int,
                  codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """decode's checks of sizes (raised at once) and its kernels, launched: (codes, flags int64 (3,) on
    the device for raise_for_decode), not waited for."""
    rice.check_whole_bytes(count, "rice_triton")
    rice.check_k(k, codec)
    rice.check_length(unary.numel(), count, k, 2 * qmax, codec)
    codes = torch.empty(count, dtype=torch.uint8, device=unary.device)
    if count == 0 or unary.numel() == 0:
        if count or unary.numel():
            raise rice.wrong_end(unary.numel(), count, codec)
        return codes, torch.zeros(3, dtype=torch.int64, device=unary.device)
    with on_device(unary):
        _, (block, warps) = _blocks()
        blocks = triton.cdiv(unary.numel(), block)
        zeros = torch.empty(blocks, dtype=torch.int32, device=unary.device)
        _zeros_kernel[(blocks,)](unary, unary.numel(), zeros, BLOCK=block, num_warps=warps)
        rank = torch.cumsum(zeros, 0, dtype=torch.int64) - zeros
        bad = torch.empty(blocks, dtype=torch.uint8, device=unary.device)
        windows = -(-((2 * qmax >> k) + 1) // 32)
        _values_kernel[(blocks,)](unary, unary.numel(), rank, low if k else unary, count, codes, bad, QMAX=qmax, K=k,
                                  WINDOWS=windows, BLOCK=block, PER_LANE=_bytes_per_lane(block, warps),
                                  **plane_shifts(k), num_warps=warps)
        found = rank[-1] + zeros[-1] - count  # 0 when the stream ends `count` values
        return codes, torch.stack([found, (unary[-1] == 0xFF).long(), bad.max().long()])


def raise_for_decode(flags: list[int], nbytes: int, count: int, codec: str) -> None:
    """rice.decode's error for launch_decode's flags (zero-bits found - count, last byte all ones, a
    value out of range), if any."""
    wrong_count, no_end, out_of_range = flags
    if wrong_count or no_end:  # the last zero-bit lies in the last byte
        raise rice.wrong_end(nbytes, count, codec)
    if out_of_range:
        raise rice.out_of_range(codec)
