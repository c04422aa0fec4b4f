"""`pertoken` in Triton (tahnode.kernels.symtiles_triton): the same payload as pertoken_ref byte for
byte, and the same decoded values and errors.

encode(x (..., C), params) -> uint8 payload       decode(payload, shape, params, dtype) -> (shape)"""

from __future__ import annotations

import torch

from . import symtiles_triton
from .pertoken_ref import PerTokenParams, sections, tiles_of

__all__ = ["encode", "decode"]


def encode(x: torch.Tensor, params: PerTokenParams = PerTokenParams()) -> torch.Tensor:
    params.validate()
    n, c, _ = tiles_of(tuple(x.shape), params)
    return symtiles_triton.encode(x.detach().reshape(n, c), int(params.group_size), int(params.bits), "pertoken")


def decode(payload: torch.Tensor, shape, params: PerTokenParams, dtype: torch.dtype) -> torch.Tensor:
    scale, codes = sections(payload, shape, params)
    n, c, _ = tiles_of(shape, params)
    out = symtiles_triton.decode(scale, codes, n, c, int(params.group_size), int(params.bits), dtype, "pertoken")
    return out.reshape(shape)
