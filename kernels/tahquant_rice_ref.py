"""TAH-Quant as a run sends it (codec tahquant, the version-3 payload) in plain torch: every tile of G
channels sign-flipped and rotated (symtiles_ref), quantized on a grid of 2 qmax + 1 levels, Rice-coded.

A tile's step is its absmax / qmax (one bf16 scale per tile, tahnode.kernels.symtiles_ref), so the
grid is finer than INT4's at the same bits on the wire: most values are small and take short codes
(tahnode.kernels.rice), the few large ones long codes. The size of a payload depends on its values.

A width that is not a multiple of G is cut into blocks (`blocks`): each token's whole tiles of G, then
the channels left over (C mod G of every token, token after token) as one stream, cut into tiles of
G and its last fewer than G values into tiles of descending powers of two, at least MIN_TILE (the
last one padded). Before, each token's rest was padded to a whole tile of G (a width of 64 took 9.1
bits per element, issue 43), then cut into smaller tiles of its own (4.67 at 64: a bf16 scale per 64
values, and the smaller tiles' finer steps)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import rice
from .bitpack import packed_nbytes
from .quant_ref import check_finite
from .symtiles_ref import check_scales, dequantize, quantize, rotate, tile_scales, unrotate
from .tahquant_ref import check_group_size
from .wire import CodecError, PayloadReader, as_bytes

__all__ = ["RiceParams", "encode", "decode", "split", "sections", "Block", "blocks", "gather", "assemble", "slices",
           "slice_codes", "shape_of", "tiling", "zigzag", "unzigzag", "pack", "min_payload_nbytes", "MIN_TILE"]

MIN_TILE = 8  # the smallest tile of the left-over stream's last values (fewer than this are padded to it)


@dataclass(frozen=True)
class RiceParams:
    """The knobs of codec tahquant, a run's defaults; both travel in the message header (`params`)."""

    group_size: int = 128  # G: channels per tile, a power of two in [8, 256]
    qmax: int = 12         # codes q in [-qmax, qmax], step = the tile's absmax / qmax

    def validate(self) -> "RiceParams":
        check_group_size(self.group_size, "tahquant")
        if self.qmax != int(self.qmax) or not 1 <= self.qmax <= 127:
            raise CodecError(f"tahquant: qmax must be an integer in [1, 127], got {self.qmax}")
        return self


def tiling(c: int, g: int) -> list[tuple[int, int, int]]:
    """C values of a row as slices of whole tiles, (first value, values, tile) each: tiles of G, then
    what is left in tiles of descending powers of two down to MIN_TILE (or G, if smaller), the last
    tile padded."""
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


@dataclass(frozen=True)
class Block:
    """Rows of `width` values cut into tiles of `tile` (the last padded): the first `width` channels
    of every token (`stream` False), or `rows * width` values of the left-over stream from position
    `start` on (every token's channels past the whole tiles of G, token after token)."""

    rows: int
    width: int
    tile: int
    stream: bool = False
    start: int = 0

    @property
    def tiles(self) -> int:
        return self.rows * -(-self.width // self.tile)

    @property
    def codes(self) -> int:
        return self.tiles * self.tile


def blocks(n: int, c: int, g: int) -> list[Block]:
    """The blocks of N tokens of C channels, in the payload's order: the tokens' whole tiles of G (one
    block, as a width that is a multiple of G always was), then the left-over stream's tiles of G,
    then its tail's smaller tiles (`tiling`)."""
    whole = c // g * g
    out = [Block(n, whole, g)] if whole else []
    length = n * (c - whole)
    full = length // g * g
    if full:
        out.append(Block(full // g, g, g, stream=True))
    out += [Block(1, w, tile, stream=True, start=full + at) for at, w, tile in tiling(length - full, g)]
    return out


def gather(x2: torch.Tensor, g: int) -> list[tuple[Block, torch.Tensor]]:
    """Every block of x2 (N, C) with its values as (rows, width), in `blocks`' order (the left-over
    channels' stream made once, for all of its blocks)."""
    n, c = x2.shape
    whole = c // g * g
    stream = x2[:, whole:].reshape(-1) if whole < c else None
    return [(b, stream[b.start:b.start + b.rows * b.width].reshape(b.rows, b.width) if b.stream else x2[:, :b.width])
            for b in blocks(n, c, g)]


def assemble(parts: list[torch.Tensor], n: int, c: int, g: int) -> torch.Tensor:
    """Inverse of gather over every block: the decoded blocks' values (rows, width each, in `blocks`'
    order) -> (N, C)."""
    whole, cut = c // g * g, blocks(n, c, g)
    columns = [p for p, b in zip(parts, cut) if not b.stream]
    stream = [p.reshape(-1) for p, b in zip(parts, cut) if b.stream]
    rest = [torch.cat(stream).reshape(n, c - whole)] if stream else []
    return torch.cat(columns + rest, dim=1) if len(columns + rest) > 1 else (columns + rest)[0]


def shape_of(shape, params: RiceParams) -> tuple[int, int, int, int]:
    """(tokens N, channels C, tiles and codes) of a tensor of `shape` (..., C): every block's tiles,
    and its codes (its values padded to whole tiles)."""
    c, g = shape[-1], int(params.group_size)
    n = math.prod(shape) // c if c else 0
    cut = blocks(n, c, g)
    return n, c, sum(b.tiles for b in cut), sum(b.codes for b in cut)


def zigzag(codes: torch.Tensor, qmax: int) -> torch.Tensor:
    """Codes q + qmax (uint8) -> z = 2q for q >= 0, -2q - 1 for q < 0 (int32, in [0, 2 qmax]):
    (2q) xor (q >> 31), the sign's bits all ones for q < 0."""
    q = codes.to(torch.int32) - qmax
    return (q << 1) ^ (q >> 31)


def unzigzag(z: torch.Tensor, qmax: int) -> torch.Tensor:
    """Inverse of zigzag -> codes q + qmax (uint8): q = (z >> 1) xor -(z & 1)."""
    q = (z >> 1) ^ -(z & 1)
    return (q + qmax).to(torch.uint8)


def min_payload_nbytes(shape, params: RiceParams) -> int:
    """The bytes every payload of `shape` has at least: k, the scales, one unary bit per value."""
    _, _, tiles, codes = shape_of(shape, params)
    return 1 + 2 * tiles + -(-codes // 8)


def pack(scale: torch.Tensor, codes: torch.Tensor, qmax: int) -> torch.Tensor:
    """Payload: k u8 (the Rice parameter that makes it shortest, rice.best_k), the scales (bf16, each
    block's (rows, tiles) row-major, block after block), then the zigzagged codes of the rotated
    values (padded values included; each block's (rows, its codes) row-major, block after block),
    Rice-coded at k: their low bits (k > 0), then the unary stream to the payload's end."""
    z = zigzag(codes.reshape(-1), qmax)
    k = rice.best_k(z, 2 * qmax)
    low, unary = rice.encode(z, k)
    head = torch.tensor([k], dtype=torch.uint8, device=codes.device)
    return torch.cat([head, as_bytes(scale.reshape(-1)), low, unary])


def slice_codes(x2: torch.Tensor, g: int, qmax: int, rotate=rotate,
                quantize=quantize) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 (N, C) float32 -> (scales bf16, codes uint8) in pack's order: each block of `blocks`
    rotated, scaled per tile and quantized at qmax (symtiles_ref's `rotate` and `quantize`, or a
    fast path's that give their results bit for bit)."""
    scales, codes = [], []
    for block, values in gather(x2, g):
        y = rotate(values, block.tile)
        scale = tile_scales(y, block.tile, qmax)
        scales.append(scale.reshape(-1))
        codes.append(quantize(y, scale, block.tile, qmax).reshape(-1))
    return torch.cat(scales), torch.cat(codes)


def encode(x: torch.Tensor, params: RiceParams) -> torch.Tensor:
    """x (..., C) -> payload (pack): slice_codes with symtiles_ref."""
    params.validate()
    check_finite(x, "tahquant")
    n, c, _, _ = shape_of(tuple(x.shape), params)
    qmax = int(params.qmax)
    return pack(*slice_codes(x.reshape(n, c).float(), int(params.group_size), qmax), qmax)


def split(payload: torch.Tensor, shape, params: RiceParams) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check the payload's size and k -> (k, scales bf16, low bits, unary stream). Shared with the kernels."""
    params.validate()
    _, _, tiles, codes = shape_of(shape, params)
    if payload.numel() < min_payload_nbytes(shape, params):
        raise CodecError(f"tahquant payload has {payload.numel()} bytes, shape {list(shape)} needs at least "
                         f"{min_payload_nbytes(shape, params)}")
    rd = PayloadReader(payload, "tahquant")
    k = int(rd.take(1, "Rice parameter")[0])
    scale = rd.take_array(tiles, torch.bfloat16, "scales")
    rice.check_k(k, "tahquant")  # before its low bits' size is computed from it
    low = rd.take(packed_nbytes(codes, k) if k else 0, "low bits")
    return k, scale, low, rd.take(rd.remaining, "unary stream")


def sections(payload: torch.Tensor, shape, params: RiceParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the payload -> (scales bf16, codes q + qmax uint8), in pack's order."""
    k, scale, low, unary = split(payload, shape, params)
    _, _, _, codes = shape_of(shape, params)
    z = rice.decode(low, unary, codes, k, 2 * int(params.qmax), "tahquant")
    return scale, unzigzag(z, int(params.qmax))


def slices(scale: torch.Tensor, codes: torch.Tensor, n: int, c: int, g: int):
    """Each block of `blocks` with its scales (rows, tiles) and codes (rows, tiles * tile), from
    pack's order: (block, scales, codes). Shared with the fast paths."""
    at_scale = at_code = 0
    for block in blocks(n, c, g):
        t = block.tiles // block.rows
        yield (block, scale[at_scale:at_scale + block.tiles].reshape(block.rows, t),
               codes[at_code:at_code + block.codes].reshape(block.rows, t * block.tile))
        at_scale, at_code = at_scale + block.tiles, at_code + block.codes


def decode(payload: torch.Tensor, shape, params: RiceParams, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize (exact), rotate back (fwht, 1/tile, signs) block by block, drop the padded values,
    put the blocks back in their channels (`assemble`), cast to `dtype`."""
    scale, codes = sections(payload, shape, params)
    n, c, _, _ = shape_of(shape, params)
    check_scales(scale, "tahquant")
    qmax, g = int(params.qmax), int(params.group_size)
    parts = [unrotate(dequantize(q, s, b.tile, qmax), b.tile, b.width) for b, s, q in slices(scale, codes, n, c, g)]
    return assemble(parts, n, c, g).reshape(shape).to(dtype)
