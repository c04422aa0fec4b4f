"""TAH-Quant's entropy-coded layout (layout 3) on the GPU: symtiles_triton rotates, scales and quantizes
(8-bit codes on the layout's grid), tahquant_rice_ref's pack and sections do the Rice coding in
integer torch ops on the device; the same payload as the reference byte for byte.

encode(x (..., C), params) -> uint8 payload       decode(payload, shape, params, dtype) -> (shape)"""

from __future__ import annotations

import torch

from . import symtiles_triton
from .tahquant_ref import TahQuantParams
from .tahquant_rice_ref import pack, sections, shape_of

__all__ = ["encode", "decode"]

CODE_BITS = 8  # the kernels' codes before Rice coding: one byte each (qmax <= 127)


def encode(x: torch.Tensor, params: TahQuantParams) -> torch.Tensor:
    params.validate()
    n, c, t, g = shape_of(tuple(x.shape), params)
    out, _ = symtiles_triton.encode(x.detach().reshape(n, c), g, CODE_BITS, True, "tahquant", qmax=int(params.qmax))
    head = 2 * n * t
    scale = out[:head].view(torch.bfloat16).reshape(n, t)
    return pack(scale, out[head: head + n * t * g], int(params.qmax))


def decode(payload: torch.Tensor, shape, params: TahQuantParams, dtype: torch.dtype) -> torch.Tensor:
    scale, codes = sections(payload, shape, params)
    n, c, _, g = shape_of(shape, params)
    # N*T*G codes, a multiple of G >= 8: already whole bytes of the kernel's 8-bit plane, no padding
    return symtiles_triton.decode(scale.contiguous(), codes.reshape(-1), n, c, g, CODE_BITS, True, dtype, "tahquant",
                                  qmax=int(params.qmax)).reshape(shape)
