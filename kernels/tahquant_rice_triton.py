"""TAH-Quant's entropy-coded layout (layout 3) on the GPU: symtiles_triton rotates, scales and quantizes
(8-bit codes on the layout's grid) and adds up the Rice coder's block sums of them as it goes,
rice_triton Rice-codes them into the payload; the same payload as the reference byte for byte. One
synchronization each way, after every kernel: it reads their flags (and the encode's payload size,
which the Rice kernel fixes on the device). A width of several slices (tahquant_rice_ref.tiling) is
quantized slice by slice, and the Rice coder's sums are taken after.

encode(x (..., C), params) -> uint8 payload       decode(payload, shape, params, dtype) -> (shape)"""

from __future__ import annotations

import torch

from . import rice_triton, symtiles_triton
from .tahquant_ref import TahQuantParams
from .tahquant_rice_ref import shape_of, slices, split, tiling

__all__ = ["encode", "decode"]

CODE_BITS = 8  # the kernels' codes before Rice coding: one byte each (qmax <= 127)


def encode(x: torch.Tensor, params: TahQuantParams) -> torch.Tensor:
    params.validate()
    n, c, t, width = shape_of(tuple(x.shape), params)
    x2, qmax = x.detach().reshape(n, c), int(params.qmax)
    cuts = tiling(c, int(params.group_size))
    if len(cuts) == 1:  # a width of whole tiles: the quantizing kernel sums the codes for the Rice coder
        sums = rice_triton.sums_buffer(n * width, x2.device)
        out, _, status = symtiles_triton.launch_encode(x2, cuts[0][2], CODE_BITS, True, qmax, sums)
        head, codes, statuses = out[:2 * n * t], out[2 * n * t: 2 * n * t + n * width], [status]
        sums, ends = sums[0], rice_triton.ends_of(sums[0])
    else:  # slices of other tiles, each quantized on its own, the Rice coder's sums taken after
        made = [symtiles_triton.launch_encode(x2[:, start:start + w], tile, CODE_BITS, True, qmax)
                for start, w, tile in cuts]
        heads = [2 * n * -(-w // tile) for _, w, tile in cuts]
        head = torch.cat([out[:h] for (out, _, _), h in zip(made, heads)])
        codes = torch.cat([out[h:h + n * -(-w // tile) * tile] for (out, _, _), h, (_, w, tile) in zip(made, heads, cuts)])
        statuses = [status for _, _, status in made]
        sums, ends = rice_triton.block_sums(codes, qmax)
    write = rice_triton.launch_write(codes, qmax, head, sums, ends)
    *bad, size, k = torch.cat([*(s.long() for s in statuses), write.picked]).tolist()  # the one synchronization
    for flag in bad:
        symtiles_triton.raise_for_encode(flag, x2, "tahquant")
    return write.finish(size, k)


def decode(payload: torch.Tensor, shape, params: TahQuantParams, dtype: torch.dtype) -> torch.Tensor:
    k, scale, low, unary = split(payload, shape, params)
    n, c, _, width = shape_of(shape, params)
    qmax = int(params.qmax)
    codes, flags = rice_triton.launch_decode(low, unary, n * width, k, qmax, "tahquant")
    made = [symtiles_triton.launch_decode(s.contiguous(), q.reshape(-1), n, w, tile, CODE_BITS, True, dtype, qmax)
            for _, w, tile, s, q in slices(scale, codes, n, c, int(params.group_size))]
    *flags, worst = torch.cat([flags, torch.stack([bad for _, bad in made]).max().long().reshape(1)]).tolist()  # the one sync
    rice_triton.raise_for_decode(flags, unary.numel(), n * width, "tahquant")  # the reference's order: the codes first
    symtiles_triton.raise_for_decode(worst, "tahquant")
    out = made[0][0] if len(made) == 1 else torch.cat([part for part, _ in made], dim=1)
    return out.reshape(shape)
