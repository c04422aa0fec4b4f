"""The pseudo-gradient codecs as hivemind runs them: tahnode.codecs.blockwise (2, 4 and 8 bits) as a
hivemind codec, registered where hivemind decodes parts, and the decoding of an untrusted part."""

from __future__ import annotations

import math

import torch
from hivemind.compression import (CompressionBase, CompressionInfo, Float16Compression, NoCompression,
                                  deserialize_torch_tensor)
from hivemind.compression.serialization import _BASE_COMPRESSION_TYPES
from hivemind.proto import runtime_pb2

from ..codecs import blockwise

__all__ = ["BlockwiseCompression", "compression_for", "decoded"]


class BlockwiseCompression(CompressionBase):
    """tahnode.codecs.blockwise as a hivemind codec: 2, 4 or 8 bits, a bf16 scale per 64 values. Whatever
    does not decode to exactly the float32 tensor its message describes is refused (BlockwiseError)."""

    compression_type = runtime_pb2.CompressionType.BLOCKWISE_8BIT

    def __init__(self, bits: int):
        self.bits = bits

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        return runtime_pb2.Tensor(compression=self.compression_type, buffer=blockwise.quantize(tensor, self.bits),
                                  size=tensor.shape, dtype="float32", requires_grad=False)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape = tuple(serialized_tensor.size)
        if serialized_tensor.dtype != "float32" or any(dim < 0 for dim in shape):
            raise blockwise.BlockwiseError(f"a blockwise part must be float32 of a valid shape, not {shape}")
        return blockwise.dequantize(serialized_tensor.buffer, math.prod(shape)).reshape(shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.bits / 32


# hivemind decodes a part by its message's compression enum, through this table. tahnode registers its
# blockwise codec under BLOCKWISE_8BIT (hivemind's own needs bitsandbytes, absent here) before the
# averager forks; the bit width travels in the encoding's header, so one entry decodes 2, 4 and 8 bits.
_BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"] = BlockwiseCompression(8)


def compression_for(bits: int) -> CompressionBase:
    """The hivemind codec of `bits` (4, 8: blockwise; 16: float16; 32: none)."""
    if bits in blockwise.BLOCKWISE_BITS:
        return BlockwiseCompression(bits)
    return Float16Compression() if bits == 16 else NoCompression()


def decoded(serialized: runtime_pb2.Tensor) -> torch.Tensor | None:
    """The tensor a peer's message holds, or None where it does not decode."""
    try:
        return deserialize_torch_tensor(serialized).detach()
    except Exception:  # untrusted bytes: each of hivemind's codecs fails its own way (ValueError, TypeError, KeyError)
        return None
