"""Byte-level helpers of the payload layouts: the codec error type, a bounds-checked reader
and little-endian fp16/fp32 arrays. Every length is checked before it is used."""

from __future__ import annotations

import sys

import torch

if sys.byteorder != "little":  # the payload layouts are little-endian; tensors are viewed as bytes
    raise ImportError("tahnode's wire format needs a little-endian host")

__all__ = ["CodecError", "PayloadReader", "as_bytes", "from_bytes", "bitmap", "read_bitmap"]


class CodecError(ValueError):
    """A tensor or message a codec cannot handle: bad input, or a corrupt or inconsistent payload."""


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes (uint8, 1-D) of a contiguous tensor."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def from_bytes(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View uint8 bytes (1-D) as a 1-D tensor of `dtype` (copies when unaligned)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if data.numel() % itemsize:
        raise CodecError(f"{data.numel()} bytes is not a whole number of {dtype} values")
    return data.contiguous().clone().view(dtype)


def bitmap(flags: torch.Tensor) -> torch.Tensor:
    """Pack a 1-D bool tensor into bytes, least significant bit first, zero-padded to a byte."""
    from .bitpack import pack_bits, padded_count

    n = flags.numel()
    codes = torch.zeros(padded_count(n), dtype=torch.uint8, device=flags.device)
    codes[:n] = flags.reshape(-1).to(torch.uint8)
    return pack_bits(codes, 1)


def read_bitmap(data: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """Unpack n flags from bytes written by `bitmap`; the padding bits must be zero."""
    from .bitpack import padded_count, unpack_bits

    codes = unpack_bits(data, 1, padded_count(n))
    if bool(codes[n:].any()):
        raise CodecError(f"corrupt payload: padding bits of the {what} bitmap are not zero")
    return codes[:n].bool()


class PayloadReader:
    """Reads consecutive sections of a payload, raising CodecError on any short or extra bytes."""

    def __init__(self, data: torch.Tensor, codec: str):
        self.data = data
        self.codec = codec
        self.offset = 0

    @property
    def remaining(self) -> int:
        return self.data.numel() - self.offset

    def take(self, nbytes: int, what: str) -> torch.Tensor:
        if nbytes < 0 or nbytes > self.remaining:
            raise CodecError(
                f"{self.codec} payload is truncated: {what} needs {nbytes} bytes at offset {self.offset}, "
                f"only {self.remaining} left"
            )
        out = self.data[self.offset : self.offset + nbytes]
        self.offset += nbytes
        return out

    def take_array(self, count: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return from_bytes(self.take(count * itemsize, what), dtype)

    def finish(self) -> None:
        if self.remaining:
            raise CodecError(f"{self.codec} payload has {self.remaining} unexpected trailing bytes at offset "
                             f"{self.offset}")
