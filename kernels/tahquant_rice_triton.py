"""TAH-Quant's Rice-coded algorithm (codec tahquant) on the GPU: symtiles_triton rotates, scales and quantizes
(8-bit codes on the layout's grid) and adds up the Rice coder's block sums of them as it goes,
rice_triton Rice-codes them into the payload; the same payload as the reference byte for byte. One
synchronization each way, after every kernel: it reads their flags (and the encode's payload size,
which the Rice kernel fixes on the device). A width of several blocks (tahquant_rice_ref.blocks: the
tokens' whole tiles, the left-over channels' stream) is quantized block by block, and the Rice
coder's sums are taken after.

encode(x (..., C), params) -> uint8 payload       decode(payload, shape, params, dtype) -> (shape)"""

from __future__ import annotations

import torch

from . import rice_triton, symtiles_triton
from .tahquant_rice_ref import RiceParams, assemble, gather, shape_of, slices, split

__all__ = ["encode", "decode"]

CODE_BITS = 8  # the kernels' codes before Rice coding: one byte each (qmax <= 127)


def encode(x: torch.Tensor, params: RiceParams) -> torch.Tensor:
    params.validate()
    n, c, tiles, codes_n = shape_of(tuple(x.shape), params)
    x2, qmax, g = x.detach().reshape(n, c), int(params.qmax), int(params.group_size)
    cuts = gather(x2, g)
    # a width of whole tiles: the quantizing kernel sums the codes for the Rice coder
    if len(cuts) == 1 and not cuts[0][0].stream:
        sums = rice_triton.sums_buffer(codes_n, x2.device)
        out, _, status = symtiles_triton.launch_encode(x2, g, CODE_BITS, True, qmax, sums)
        head, codes, statuses = out[:2 * tiles], out[2 * tiles: 2 * tiles + codes_n], [status]
        sums, ends = sums[0], rice_triton.ends_of(sums[0])
    else:  # blocks quantized each on its own (the stream's gathered first), the Rice coder's sums taken after
        made = [symtiles_triton.launch_encode(values, b.tile, CODE_BITS, True, qmax) for b, values in cuts]
        head = torch.cat([out[:2 * b.tiles] for (out, _, _), (b, _) in zip(made, cuts)])
        codes = torch.cat([out[2 * b.tiles:2 * b.tiles + b.codes] for (out, _, _), (b, _) in zip(made, cuts)])
        statuses = [status for _, _, status in made]
        sums, ends = rice_triton.block_sums(codes, qmax)
    write = rice_triton.launch_write(codes, qmax, head, sums, ends)
    *bad, size, k = torch.cat([*(s.long() for s in statuses), write.picked]).tolist()  # the one synchronization
    for flag in bad:
        symtiles_triton.raise_for_encode(flag, x2, "tahquant")
    return write.finish(size, k)


def decode(payload: torch.Tensor, shape, params: RiceParams, dtype: torch.dtype) -> torch.Tensor:
    k, scale, low, unary = split(payload, shape, params)
    n, c, _, codes_n = shape_of(shape, params)
    qmax, g = int(params.qmax), int(params.group_size)
    codes, flags = rice_triton.launch_decode(low, unary, codes_n, k, qmax, "tahquant")
    made = [symtiles_triton.launch_decode(s.contiguous(), q.reshape(-1), b.rows, b.width, b.tile, CODE_BITS, True,
                                          dtype, qmax)
            for b, s, q in slices(scale, codes, n, c, g)]
    # the one sync
    *flags, worst = torch.cat([flags, torch.stack([bad for _, bad in made]).max().long().reshape(1)]).tolist()
    rice_triton.raise_for_decode(flags, unary.numel(), codes_n, "tahquant")  # the reference's order: the codes first
    symtiles_triton.raise_for_decode(worst, "tahquant")
    return assemble([part for part, _ in made], n, c, g).reshape(shape)
