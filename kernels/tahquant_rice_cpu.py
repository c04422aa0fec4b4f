"""TAH-Quant's entropy-coded layout (layout 3) on the CPU, fast: symtiles_cpu's rotation and
quantization (symtiles_ref's arithmetic, bit for bit), the reference's scales, rice_cpu's numpy Rice
coding; the same payload as tahquant_rice_ref byte for byte, its decodes bit for bit, its errors.

encode(x (..., C), params) -> uint8 payload       decode(payload, shape, params, dtype) -> (shape)"""

from __future__ import annotations

import torch

from . import rice_cpu
from .quant_ref import check_finite
from .symtiles_cpu import dequantize, quantize, rotate, unrotate
from .symtiles_ref import check_scales, tile_scales
from .tahquant_ref import TahQuantParams
from .tahquant_rice_ref import shape_of, split
from .wire import as_bytes

__all__ = ["encode", "decode"]


def encode(x: torch.Tensor, params: TahQuantParams) -> torch.Tensor:
    params.validate()
    check_finite(x, "tahquant")
    n, c, _, g = shape_of(tuple(x.shape), params)
    qmax = int(params.qmax)
    y = rotate(x.reshape(n, c).float(), g)
    scale = tile_scales(y, g, qmax)
    return rice_cpu.encode(quantize(y, scale, g, qmax), qmax, as_bytes(scale.reshape(-1)))


def decode(payload: torch.Tensor, shape, params: TahQuantParams, dtype: torch.dtype) -> torch.Tensor:
    k, scale, low, unary = split(payload, shape, params)
    n, c, t, g = shape_of(shape, params)
    qmax = int(params.qmax)
    codes = rice_cpu.decode(low, unary, n * t * g, k, qmax, "tahquant")
    check_scales(scale, "tahquant")
    return unrotate(dequantize(codes.reshape(n, t * g), scale, g, qmax), g, c).reshape(shape).to(dtype)
