"""Blockwise quantization of a flat float32 vector, what pseudo-gradients travel as between the
replicas of a stage: per block of 64 values a bfloat16 scale and one code per value.

At 4 and 8 bits the scale is the block's largest magnitude / qmax (7, 127), rounded up to bf16, and
the codes are signed, rounded to nearest (ties to even): a value is code x scale. At 2 bits the four
codes are levels at -1.5, -0.5, 0.5 and 1.5 x the scale, which is the block's root mean square
rounded up to bf16 (Lloyd-Max's levels for Gaussian values are +-0.45 and +-1.51 sigma); a value
takes the level nearest it (code = floor(x / scale) + 2, clipped to 0..3): larger ones are clipped,
which error feedback (tahnode.train.outer) carries into the next round.

Layout (little-endian): a 12-byte header (magic b"TBQ1", bits u8, 3 zero bytes, count u32), the
scales (bf16 bits, u16 each, ceil(count / 64) of them), then the codes: int8 at 8 bits; at 4 bits
two codes a byte (value + 8, the first in the low nibble); at 2 bits four a byte (the first in the
lowest two bits). 8 bits: 8.25 bits per value; 4: 4.25; 2: 2.25."""

from __future__ import annotations

import struct

import torch

__all__ = ["BLOCK", "BLOCKWISE_BITS", "BlockwiseError", "quantize", "dequantize", "encoded_size"]

BLOCK = 64
BLOCKWISE_BITS = (2, 4, 8)
MAGIC = b"TBQ1"
HEADER = struct.Struct("<4sB3xI")


class BlockwiseError(ValueError):
    """A vector that cannot be quantized (not finite), or bytes that are not a valid encoding."""


def _qmax(bits: int) -> int:
    """The largest code magnitude at 4 and 8 bits (2 bits: the number of levels' half-steps, unused)."""
    if bits not in BLOCKWISE_BITS:
        raise BlockwiseError(f"blockwise quantization has {', '.join(map(str, BLOCKWISE_BITS))} bits, not {bits}")
    return (1 << (bits - 1)) - 1


def encoded_size(count: int, bits: int) -> int:
    """Bytes of the encoding of `count` values at `bits` bits."""
    _qmax(bits)
    blocks = -(-count // BLOCK)
    return HEADER.size + 2 * blocks + -(-count * bits // 8)


def _bf16_up(x: torch.Tensor) -> torch.Tensor:
    """The bf16 bits (as int32) of the smallest bfloat16 >= x, for finite x >= 0."""
    bits = x.contiguous().view(torch.int32)
    return (bits + 0xFFFF) >> 16


def quantize(x: torch.Tensor, bits: int) -> bytes:
    """The encoding of the flat float32 vector `x` (BlockwiseError if a value is not finite)."""
    qmax = _qmax(bits)
    x = x.detach().reshape(-1).to(torch.float32, copy=False).cpu()
    if not bool(torch.isfinite(x).all()):
        raise BlockwiseError("a value to quantize is not finite")
    count = x.numel()
    blocks = -(-count // BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32)
    padded[:count] = x
    padded = padded.view(blocks, BLOCK)
    if bits == 2:  # the block's root mean square over its `count` values (padding counts 0 in the last)
        filled = torch.full((blocks,), float(BLOCK))
        if blocks:
            filled[-1] = count - (blocks - 1) * BLOCK
        spread = (padded.double().square().sum(dim=1) / filled.double()).sqrt().float()
    else:
        spread = padded.abs().amax(dim=1) / qmax
    scale_bits = _bf16_up(spread)
    if bool((scale_bits >= 0x7F80).any()):
        raise BlockwiseError("a block's scale overflows bfloat16")
    scale = (scale_bits << 16).view(torch.float32)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    if bits == 2:
        codes = (torch.floor(padded / divisor[:, None]) + 2).clamp_(0, 3).to(torch.uint8).reshape(-1)[:count]
        body = _pack(codes, 2)
    else:
        codes = torch.round(padded / divisor[:, None]).clamp_(-qmax, qmax).to(torch.int8).reshape(-1)[:count]
        body = codes.numpy().tobytes() if bits == 8 else _pack((codes.to(torch.int16) + 8).to(torch.uint8), 4)
    return HEADER.pack(MAGIC, bits, count) + scale_bits.to(torch.int16).numpy().tobytes() + body


def _pack(codes: torch.Tensor, bits: int) -> bytes:
    """Unsigned `bits`-bit codes (uint8), 8 // bits a byte, the first in the lowest bits."""
    per = 8 // bits
    pad = -codes.numel() % per
    if pad:
        codes = torch.cat([codes, torch.zeros(pad, dtype=torch.uint8)])
    grouped = codes.view(-1, per)
    packed = torch.zeros(grouped.shape[0], dtype=torch.uint8)
    for k in range(per):
        packed |= grouped[:, k] << (k * bits)
    return packed.numpy().tobytes()


def _unpack(raw: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The `count` codes _pack() made of bytes `raw`, as uint8."""
    per, mask = 8 // bits, (1 << bits) - 1
    return torch.stack([(raw >> (k * bits)) & mask for k in range(per)], dim=1).reshape(-1)[:count]


def dequantize(data: bytes | memoryview, expected_count: int | None = None) -> torch.Tensor:
    """The float32 vector an encoding holds. Every length is checked against the header (and the
    count against `expected_count`, where given) before anything is allocated."""
    data = memoryview(data).cast("B")
    if len(data) < HEADER.size:
        raise BlockwiseError(f"{len(data)} bytes are shorter than the {HEADER.size}-byte header")
    magic, bits, count = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BlockwiseError("not a blockwise encoding (wrong magic)")
    qmax = _qmax(bits)
    if expected_count is not None and count != expected_count:
        raise BlockwiseError(f"the encoding holds {count} values, {expected_count} were expected")
    if len(data) != encoded_size(count, bits):
        raise BlockwiseError(f"{len(data)} bytes, but {count} values at {bits} bits take {encoded_size(count, bits)}")
    blocks = -(-count // BLOCK)
    scale_end = HEADER.size + 2 * blocks
    if count == 0:
        return torch.zeros(0, dtype=torch.float32)
    scale_bits = torch.frombuffer(bytearray(data[HEADER.size:scale_end]), dtype=torch.int16).to(torch.int32) & 0xFFFF
    scale = (scale_bits << 16).view(torch.float32)
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise BlockwiseError("a block's scale is negative or not finite")
    raw = torch.frombuffer(bytearray(data[scale_end:]), dtype=torch.uint8)
    if bits == 8:
        codes = raw.view(torch.int8).to(torch.float32)
    elif bits == 4:
        codes = _unpack(raw, 4, count).to(torch.float32) - 8
    else:
        codes = _unpack(raw, 2, count).to(torch.float32) - 1.5  # every 2-bit code is a level
    if bits != 2 and bool((codes.abs() > qmax).any()):
        raise BlockwiseError(f"a code is outside -{qmax}..{qmax}")
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32)
    padded[:count] = codes
    return (padded.view(blocks, BLOCK) * scale[:, None]).reshape(-1)[:count]
