"""TAH-Quant's rotated layout (layout 2, the version-2 payload) in plain torch: every tile of G
channels is multiplied by fixed random signs and Hadamard-rotated, then quantized symmetrically at
`bits_high` bits with one bf16 scale per tile (tahnode.kernels.symtiles_ref).

The paper rotates only outlier tiles and gives low-entropy tokens fewer bits (layout 1,
tahquant_ref); rotating every tile spreads every outlier and makes each tile nearly Gaussian, so
one symmetric grid per tile fits all of them, at 4 + 16/G bits per element."""

from __future__ import annotations

import math

import torch

from .bitpack import packed_nbytes
from .quant_ref import check_finite
from .symtiles_ref import check_scales, dequantize, pack_codes, quantize, rotate, tile_scales, unpack_codes, unrotate
from .tahquant_ref import TahQuantParams
from .wire import CodecError, PayloadReader, as_bytes

__all__ = ["encode", "decode", "sections", "payload_nbytes", "shape_of"]


def shape_of(shape, params: TahQuantParams) -> tuple[int, int, int, int]:
    """(tokens N, channels C, tiles per token T, G) of a tensor of `shape` (..., C)."""
    c, g = shape[-1], int(params.group_size)
    return math.prod(shape) // c, c, -(-c // g), g


def _qmax(params: TahQuantParams) -> int:
    return 2 ** (int(params.bits_high) - 1) - 1


def payload_nbytes(shape, params: TahQuantParams) -> int:
    n, _, t, g = shape_of(shape, params)
    return 2 * n * t + packed_nbytes(n * t * g, params.bits_high)


def encode(x: torch.Tensor, params: TahQuantParams) -> torch.Tensor:
    """Payload: scale bf16[N, T], then the codes q + qmax of the N*T*G rotated values (padded
    channels included), row-major, packed at `bits_high`."""
    params.validate()
    check_finite(x, "tahquant")
    n, c, _, g = shape_of(tuple(x.shape), params)
    y = rotate(x.reshape(n, c).float(), g)
    scale = tile_scales(y, g, _qmax(params))
    return torch.cat([as_bytes(scale), pack_codes(quantize(y, scale, g, _qmax(params)), params.bits_high)])


def sections(payload: torch.Tensor, shape, params: TahQuantParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the payload's size; -> (scale bf16 (N, T), packed codes). Shared with the kernels."""
    params.validate()
    expected = payload_nbytes(shape, params)
    if payload.numel() != expected:
        raise CodecError(f"tahquant layout-2 payload has {payload.numel()} bytes, shape {list(shape)} needs {expected}")
    n, _, t, g = shape_of(shape, params)
    rd = PayloadReader(payload, "tahquant")
    scale = rd.take_array(n * t, torch.bfloat16, "scales").reshape(n, t)
    codes = rd.take(packed_nbytes(n * t * g, params.bits_high), "codes")
    rd.finish()
    return scale, codes


def decode(payload: torch.Tensor, shape, params: TahQuantParams, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize (exact), rotate back (fwht, 1/G, signs), drop the padded channels, cast to `dtype`."""
    scale, packed = sections(payload, shape, params)
    n, c, t, g = shape_of(shape, params)
    check_scales(scale, "tahquant")
    codes = unpack_codes(packed, n, t * g, params.bits_high, _qmax(params), "tahquant")
    return unrotate(dequantize(codes, scale, g, _qmax(params)), g, c).reshape(shape).to(dtype)
