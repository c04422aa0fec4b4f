"""TAH-Quant's entropy-coded layout (layout 3) on the GPU: symtiles_triton rotates, scales and quantizes
(8-bit codes on the layout's grid) and adds up the Rice coder's block sums of them as it goes,
rice_triton Rice-codes them into the payload; the same payload as the reference byte for byte. One synchronization each way, after every kernel: it reads their flags
(and the encode's payload size, which the Rice kernel fixes on the device).

encode(x (..., C), params) -> uint8 payload       decode(payload, shape, params, dtype) -> (shape)"""

from __future__ import annotations

import torch

from . import rice_triton, symtiles_triton
from .tahquant_ref import TahQuantParams
from .tahquant_rice_ref import shape_of, split

__all__ = ["encode", "decode"]

CODE_BITS = 8  # the kernels' codes before Rice coding: one byte each (qmax <= 127)


def encode(x: torch.Tensor, params: TahQuantParams) -> torch.Tensor:
    params.validate()
    n, c, t, g = shape_of(tuple(x.shape), params)
    x2, qmax = x.detach().reshape(n, c), int(params.qmax)
    sums = rice_triton.sums_buffer(n * t * g, x2.device)  # the quantizing kernel sums the codes for the Rice coder
    out, _, status = symtiles_triton.launch_encode(x2, g, CODE_BITS, True, qmax, sums)
    head = 2 * n * t  # the scales, then N*T*G codes: a multiple of G >= 8, as rice_triton needs
    codes = out[head: head + n * t * g]
    write = rice_triton.launch_write(codes, qmax, out[:head], sums[0], rice_triton.ends_of(sums[0]))
    bad, size, k = torch.cat([status.long(), write.picked]).tolist()  # the one synchronization, every kernel launched
    symtiles_triton.raise_for_encode(bad, x2, "tahquant")
    return write.finish(size, k)


def decode(payload: torch.Tensor, shape, params: TahQuantParams, dtype: torch.dtype) -> torch.Tensor:
    k, scale, low, unary = split(payload, shape, params)
    n, c, t, g = shape_of(shape, params)
    qmax = int(params.qmax)
    codes, flags = rice_triton.launch_decode(low, unary, n * t * g, k, qmax, "tahquant")
    out, worst = symtiles_triton.launch_decode(scale.contiguous(), codes, n, c, g, CODE_BITS, True, dtype, qmax)
    *flags, worst = torch.cat([flags, worst.long().reshape(1)]).tolist()  # the one synchronization
    rice_triton.raise_for_decode(flags, unary.numel(), n * t * g, "tahquant")  # the reference's order: the codes first
    symtiles_triton.raise_for_decode(worst, "tahquant")
    return out.reshape(shape)
