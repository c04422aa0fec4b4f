"""TAH-Quant's Rice-coded algorithm (codec tahquant) on the CPU, fast: symtiles_cpu's rotation and
quantization (symtiles_ref's arithmetic, bit for bit), the reference's scales, rice_cpu's numpy Rice
coding; the same payload as tahquant_rice_ref byte for byte, its decodes bit for bit, its errors.

encode(x (..., C), params) -> uint8 payload       decode(payload, shape, params, dtype) -> (shape)"""

from __future__ import annotations

import torch

from . import rice_cpu
from .quant_ref import check_finite
from .symtiles_cpu import dequantize, quantize, rotate, unrotate
from .symtiles_ref import check_scales
from .tahquant_rice_ref import RiceParams, assemble, shape_of, slice_codes, slices, split
from .wire import as_bytes

__all__ = ["encode", "decode"]


def encode(x: torch.Tensor, params: RiceParams) -> torch.Tensor:
    params.validate()
    check_finite(x, "tahquant")
    n, c, _, _ = shape_of(tuple(x.shape), params)
    qmax = int(params.qmax)
    scales, codes = slice_codes(x.reshape(n, c).float(), int(params.group_size), qmax, rotate, quantize)
    return rice_cpu.encode(codes, qmax, as_bytes(scales))


def decode(payload: torch.Tensor, shape, params: RiceParams, dtype: torch.dtype) -> torch.Tensor:
    k, scale, low, unary = split(payload, shape, params)
    n, c, _, codes_n = shape_of(shape, params)
    qmax, g = int(params.qmax), int(params.group_size)
    codes = rice_cpu.decode(low, unary, codes_n, k, qmax, "tahquant")
    check_scales(scale, "tahquant")
    parts = [unrotate(dequantize(q, s, b.tile, qmax), b.tile, b.width) for b, s, q in slices(scale, codes, n, c, g)]
    return assemble(parts, n, c, g).reshape(shape).to(dtype)
