"""TAH-Quant's entropy-coded layout (layout 3, the version-3 payload) in plain torch: every tile of G
channels rotated as in layout 2, quantized on a uniform grid of 2 qmax + 1 levels, codes Rice-coded.

A tile's step is its absmax / qmax (one bf16 scale per tile, tahnode.kernels.symtiles_ref), so the
grid is finer than INT4's at the same bits on the wire: most values are small and take short codes
(tahnode.kernels.rice), the few large ones long codes. The size of a payload depends on its values.

A width that is not a multiple of G is cut into slices (`tiling`): whole tiles of G, then what is left
in tiles of descending powers of two, at least MIN_TILE (the last one padded); before, the rest was
padded to a whole tile of G and sent (a width of 64 took 9.1 bits per element, issue 43)."""

from __future__ import annotations

import math

import torch

from . import rice
from .bitpack import packed_nbytes
from .quant_ref import check_finite
from .symtiles_ref import check_scales, dequantize, quantize, rotate, tile_scales, unrotate
from .tahquant_ref import TahQuantParams
from .wire import CodecError, PayloadReader, as_bytes

__all__ = ["encode", "decode", "split", "sections", "slices", "slice_codes", "shape_of", "tiling", "zigzag", "unzigzag", "pack",
           "min_payload_nbytes", "MIN_TILE"]

MIN_TILE = 8  # the smallest tile of a token's last channels (fewer than this are padded to it)


def tiling(c: int, g: int) -> list[tuple[int, int, int]]:
    """A token's C channels as slices of whole tiles, (first channel, channels, tile) each: tiles of G,
    then what is left in tiles of descending powers of two down to MIN_TILE (or G, if smaller), the
    last tile padded. A width that is a multiple of G is one slice, as it always was."""
    smallest, out, start, tile = min(g, MIN_TILE), [], 0, g
    while start < c:
        rest = c - start
        while tile > smallest and tile > rest:
            tile //= 2
        width = rest // tile * tile or rest  # the smallest tile takes what is left, padded
        if out and out[-1][2] == tile:
            out[-1] = (out[-1][0], out[-1][1] + width, tile)
        else:
            out.append((start, width, tile))
        start += width
    return out


def shape_of(shape, params: TahQuantParams) -> tuple[int, int, int, int]:
    """(tokens N, channels C, tiles T and codes of a token) of a tensor of `shape` (..., C): the
    codes are its channels padded to whole tiles of each slice."""
    c, g = shape[-1], int(params.group_size)
    slices = tiling(c, g)
    return (math.prod(shape) // c, c, sum(-(-w // t) for _, w, t in slices), sum(-(-w // t) * t for _, w, t in slices))


def zigzag(codes: torch.Tensor, qmax: int) -> torch.Tensor:
    """Codes q + qmax (uint8) -> z = 2q for q >= 0, -2q - 1 for q < 0 (int32, in [0, 2 qmax]):
    (2q) xor (q >> 31), the sign's bits all ones for q < 0."""
    q = codes.to(torch.int32) - qmax
    return (q << 1) ^ (q >> 31)


def unzigzag(z: torch.Tensor, qmax: int) -> torch.Tensor:
    """Inverse of zigzag -> codes q + qmax (uint8): q = (z >> 1) xor -(z & 1)."""
    q = (z >> 1) ^ -(z & 1)
    return (q + qmax).to(torch.uint8)


def min_payload_nbytes(shape, params: TahQuantParams) -> int:
    """The bytes every payload of `shape` has at least: k, the scales, one unary bit per value."""
    n, _, t, width = shape_of(shape, params)
    return 1 + 2 * n * t + -(-n * width // 8)


def pack(scale: torch.Tensor, codes: torch.Tensor, qmax: int) -> torch.Tensor:
    """Payload: k u8 (the Rice parameter that makes it shortest, rice.best_k), the scales (bf16, each
    slice's (N, tiles) row-major, slice after slice), then the zigzagged codes of the rotated values
    (padded channels included; each slice's (N, its codes) row-major, slice after slice), Rice-coded
    at k: their low bits (k > 0), then the unary stream to the payload's end."""
    z = zigzag(codes.reshape(-1), qmax)
    k = rice.best_k(z, 2 * qmax)
    low, unary = rice.encode(z, k)
    head = torch.tensor([k], dtype=torch.uint8, device=codes.device)
    return torch.cat([head, as_bytes(scale.reshape(-1)), low, unary])


def slice_codes(x2: torch.Tensor, g: int, qmax: int, rotate=rotate, quantize=quantize) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 (N, C) float32 -> (scales bf16 (N*T,), codes uint8 (N*W,)) in pack's order: each slice of
    `tiling` rotated, scaled per tile and quantized at qmax (symtiles_ref's `rotate` and `quantize`,
    or a fast path's that give their results bit for bit)."""
    scales, codes = [], []
    for start, width, tile in tiling(x2.shape[1], g):
        y = rotate(x2[:, start:start + width], tile)
        scale = tile_scales(y, tile, qmax)
        scales.append(scale.reshape(-1))
        codes.append(quantize(y, scale, tile, qmax).reshape(-1))
    return torch.cat(scales), torch.cat(codes)


def encode(x: torch.Tensor, params: TahQuantParams) -> torch.Tensor:
    """x (..., C) -> payload (pack): slice_codes with symtiles_ref."""
    params.validate()
    check_finite(x, "tahquant")
    n, c, _, _ = shape_of(tuple(x.shape), params)
    qmax = int(params.qmax)
    return pack(*slice_codes(x.reshape(n, c).float(), int(params.group_size), qmax), qmax)


def split(payload: torch.Tensor, shape, params: TahQuantParams) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check the payload's size and k -> (k, scales bf16 (N*T,), low bits, unary stream). Shared with
    the kernels."""
    params.validate()
    n, _, t, width = shape_of(shape, params)
    if payload.numel() < min_payload_nbytes(shape, params):
        raise CodecError(f"tahquant layout-3 payload has {payload.numel()} bytes, shape {list(shape)} needs at least "
                         f"{min_payload_nbytes(shape, params)}")
    rd = PayloadReader(payload, "tahquant")
    k = int(rd.take(1, "Rice parameter")[0])
    scale = rd.take_array(n * t, torch.bfloat16, "scales")
    rice.check_k(k, "tahquant")  # before its low bits' size is computed from it
    low = rd.take(packed_nbytes(n * width, k) if k else 0, "low bits")
    return k, scale, low, rd.take(rd.remaining, "unary stream")


def sections(payload: torch.Tensor, shape, params: TahQuantParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the payload -> (scales bf16 (N*T,), codes q + qmax uint8 (N*codes,)), in pack's order."""
    k, scale, low, unary = split(payload, shape, params)
    n, _, _, width = shape_of(shape, params)
    z = rice.decode(low, unary, n * width, k, 2 * int(params.qmax), "tahquant")
    return scale, unzigzag(z, int(params.qmax))


def slices(scale: torch.Tensor, codes: torch.Tensor, n: int, c: int, g: int):
    """Each slice of `tiling` with its scales (N, tiles) and codes (N, tiles * tile), from pack's order:
    (first channel, channels, tile, scales, codes). Shared with the fast paths."""
    at_scale = at_code = 0
    for start, width, tile in tiling(c, g):
        t = -(-width // tile)
        yield (start, width, tile, scale[at_scale:at_scale + n * t].reshape(n, t),
               codes[at_code:at_code + n * t * tile].reshape(n, t * tile))
        at_scale, at_code = at_scale + n * t, at_code + n * t * tile


def decode(payload: torch.Tensor, shape, params: TahQuantParams, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize (exact), rotate back (fwht, 1/tile, signs) slice by slice, drop the padded channels,
    cast to `dtype`."""
    scale, codes = sections(payload, shape, params)
    n, c, _, _ = shape_of(shape, params)
    check_scales(scale, "tahquant")
    qmax = int(params.qmax)
    parts = [unrotate(dequantize(q, s, tile, qmax), tile, width)
             for _, width, tile, s, q in slices(scale, codes, n, c, int(params.group_size))]
    return torch.cat(parts, dim=1).reshape(shape).to(dtype)
