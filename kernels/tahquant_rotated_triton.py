"""TAH-Quant's rotated layout (layout 2) in Triton (tahnode.kernels.symtiles_triton): the same
payload as tahquant_rotated_ref byte for byte (the fwht is the reference's fp32 butterflies), and
the same decoded values and errors.

encode(x (..., C), params) -> uint8 payload       decode(payload, shape, params, dtype) -> (shape)"""

from __future__ import annotations

import torch

from . import symtiles_triton
from .tahquant_ref import TahQuantParams
from .tahquant_rotated_ref import sections, shape_of

__all__ = ["encode", "decode"]


def encode(x: torch.Tensor, params: TahQuantParams) -> torch.Tensor:
    params.validate()
    n, c, _, g = shape_of(tuple(x.shape), params)
    payload, _ = symtiles_triton.encode(x.detach().reshape(n, c), g, int(params.bits_high), True, "tahquant")
    return payload


def decode(payload: torch.Tensor, shape, params: TahQuantParams, dtype: torch.dtype) -> torch.Tensor:
    scale, codes = sections(payload, shape, params)
    n, c, _, g = shape_of(shape, params)
    return symtiles_triton.decode(scale, codes, n, c, g, int(params.bits_high), True, dtype, "tahquant").reshape(shape)
