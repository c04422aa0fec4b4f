"""`group` codec specification: k-bit asymmetric min-max quantization per tile of G contiguous
channels of one token, fp16 zero-point and scale (the "QAT-Group" fixed-precision baseline)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bitpack import pack_bits, unpack_bits
from .quant_ref import check_finite, dequantize_asym, fp16_min_scale, quantize_asym
from .tahquant_ref import Layout
from .wire import CodecError, PayloadReader, as_bytes

__all__ = ["GroupParams", "encode", "decode", "quantize_tiles", "dequantize_tiles"]


@dataclass(frozen=True)
class GroupParams:
    group_size: int = 64  # channels per tile, a power of two in [8, 256]
    bits: int = 4

    def validate(self) -> "GroupParams":
        g = self.group_size
        if g != int(g) or not 8 <= g <= 256 or g & (g - 1):
            raise CodecError(f"group: group_size must be a power of two in [8, 256], got {g}")
        if self.bits != int(self.bits) or not 1 <= self.bits <= 8:
            raise CodecError(f"group: bits must be an integer in [1, 8], got {self.bits}")
        return self


def quantize_tiles(x: torch.Tensor, params: GroupParams, codec: str = "group"):
    """x (..., C) -> (codes (NT, G) uint8, zero (NT,) fp16, scale (NT,) fp16), channels zero-padded."""
    lay = Layout.of(tuple(x.shape), params.group_size)
    x2 = x.reshape(lay.tokens, lay.channels).float()
    if lay.padded_channels != lay.channels:
        x2 = torch.nn.functional.pad(x2, (0, lay.padded_channels - lay.channels))
    tiles = x2.reshape(-1, params.group_size)
    qmax = float(2 ** params.bits - 1)
    zero, scale = fp16_min_scale(tiles.amin(-1), tiles.amax(-1), qmax, codec)
    return quantize_asym(tiles, zero, scale, qmax), zero, scale


def dequantize_tiles(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, shape,
                     params: GroupParams) -> torch.Tensor:
    """Inverse of quantize_tiles up to rounding: float32 tensor of `shape`."""
    lay = Layout.of(tuple(shape), params.group_size)
    x = dequantize_asym(q, zero, scale).reshape(lay.tokens, lay.padded_channels)[:, : lay.channels]
    return x.reshape(shape)


def payload_nbytes(shape, params: GroupParams) -> int:
    lay = Layout.of(tuple(shape), params.group_size)
    return lay.tiles * (4 + params.group_size * params.bits // 8)


def encode(x: torch.Tensor, params: GroupParams = GroupParams()) -> torch.Tensor:
    """Payload: zero fp16[NT], scale fp16[NT], then each tile's G codes packed (G*bits/8 bytes)."""
    params.validate()
    check_finite(x, "group")
    return tile_sections(*quantize_tiles(x, params), params)


def tile_sections(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, params: GroupParams) -> torch.Tensor:
    """The zero, scale and code sections of quantized tiles (shared with aqsgd)."""
    return torch.cat([as_bytes(zero), as_bytes(scale), pack_bits(q, params.bits).reshape(-1)])


def read_tiles(rd: PayloadReader, shape, params: GroupParams):
    """Read the zero, scale and code sections of `shape` from a reader (shared with aqsgd)."""
    lay = Layout.of(tuple(shape), params.group_size)
    nt, g = lay.tiles, params.group_size
    zero = rd.take_array(nt, torch.float16, "zero-points")
    scale = rd.take_array(nt, torch.float16, "scales")
    if not (bool(torch.isfinite(zero).all()) and bool(torch.isfinite(scale).all()) and bool((scale >= 0).all())):
        raise CodecError(f"{rd.codec} payload is corrupt: non-finite zero-point or negative/non-finite scale")
    packed = rd.take(nt * g * params.bits // 8, "codes").reshape(nt, g * params.bits // 8)
    return unpack_bits(packed, params.bits, g), zero, scale


def decode(payload: torch.Tensor, shape, params: GroupParams, dtype: torch.dtype) -> torch.Tensor:
    params.validate()
    expected = payload_nbytes(shape, params)
    if payload.numel() != expected:
        raise CodecError(f"group payload has {payload.numel()} bytes, shape {list(shape)} needs {expected}")
    rd = PayloadReader(payload, "group")
    q, zero, scale = read_tiles(rd, shape, params)
    rd.finish()
    return dequantize_tiles(q, zero, scale, shape, params).to(dtype)
