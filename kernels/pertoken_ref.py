"""`pertoken` codec specification: k-bit symmetric absmax with one bf16 scale per token and tile of G
channels; the default backward (gradient) codec, k = 6, G = 128 (DeepSeek-V3's 1 x 128 tiles).

A scale never spans tokens, so one token's large gradient cannot drown the others' (as `naive`'s
per-channel scales do). The quantizer itself is tahnode.kernels.symtiles_ref."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .bitpack import packed_nbytes
from .quant_ref import check_finite
from .symtiles_ref import check_scales, dequantize, pack_codes, quantize, tile_scales, unpack_codes
from .wire import CodecError, PayloadReader, as_bytes

__all__ = ["PerTokenParams", "encode", "decode", "sections", "payload_nbytes", "tiles_of"]


@dataclass(frozen=True)
class PerTokenParams:
    bits: int = 6           # code width; codes are q + qmax with q in [-qmax, qmax], qmax = 2^(bits-1) - 1
    group_size: int = 128   # G: channels per scale within a token (the last tile may be shorter)

    def validate(self) -> "PerTokenParams":
        if self.bits != int(self.bits) or not 2 <= self.bits <= 8:
            raise CodecError(f"pertoken: bits must be an integer in [2, 8], got {self.bits}")
        g = self.group_size
        if g != int(g) or not 8 <= g <= 1024 or int(g) & (int(g) - 1):
            raise CodecError(f"pertoken: group_size must be a power of two in [8, 1024], got {g}")
        return self

    @property
    def qmax(self) -> int:
        return 2 ** (int(self.bits) - 1) - 1


def tiles_of(shape, params: PerTokenParams) -> tuple[int, int, int]:
    """(tokens N, channels C, tiles per token T) of a tensor of `shape` (..., C)."""
    channels = shape[-1]
    return math.prod(shape) // channels, channels, -(-channels // int(params.group_size))


def payload_nbytes(shape, params: PerTokenParams) -> int:
    n, _, t = tiles_of(shape, params)
    return 2 * n * t + packed_nbytes(math.prod(shape), params.bits)


def encode(x: torch.Tensor, params: PerTokenParams = PerTokenParams()) -> torch.Tensor:
    """Payload: scale bf16[N, T] (tokens in order, tiles in order within each), then the codes
    q + qmax of all N*C elements, row-major, packed at `bits` (zero-padded to a multiple of 8 codes)."""
    params.validate()
    check_finite(x, "pertoken")
    n, c, _ = tiles_of(tuple(x.shape), params)
    g, qmax = int(params.group_size), params.qmax
    x2 = x.reshape(n, c).float()
    scale = tile_scales(x2, g, qmax)
    return torch.cat([as_bytes(scale), pack_codes(quantize(x2, scale, g, qmax), params.bits)])


def sections(payload: torch.Tensor, shape, params: PerTokenParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the payload's size; -> (scale bf16 (N, T), packed codes). Shared with the Triton decoder."""
    params.validate()
    expected = payload_nbytes(shape, params)
    if payload.numel() != expected:
        raise CodecError(f"pertoken payload has {payload.numel()} bytes, shape {list(shape)} needs {expected}")
    n, _, t = tiles_of(shape, params)
    rd = PayloadReader(payload, "pertoken")
    scale = rd.take_array(n * t, torch.bfloat16, "scales").reshape(n, t)
    codes = rd.take(packed_nbytes(math.prod(shape), params.bits), "codes")
    rd.finish()
    return scale, codes


def decode(payload: torch.Tensor, shape, params: PerTokenParams, dtype: torch.dtype) -> torch.Tensor:
    """x = (code - qmax) * scale (exact in float32), cast to `dtype`. Scales that are not +0 or a
    positive normal number, codes above 2*qmax and non-zero padding codes are corrupt."""
    scale, packed = sections(payload, shape, params)
    n, c, _ = tiles_of(shape, params)
    check_scales(scale, "pertoken")
    codes = unpack_codes(packed, n, c, params.bits, params.qmax, "pertoken")
    return dequantize(codes, scale, int(params.group_size), params.qmax).reshape(shape).to(dtype)
