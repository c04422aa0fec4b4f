"""TAH-Quant's entropy-coded layout (layout 3, the version-3 payload) in plain torch: every tile of G
channels rotated as in layout 2, quantized on a uniform grid of 2 qmax + 1 levels, codes Rice-coded.

A tile's step is its absmax / qmax (one bf16 scale per tile, tahnode.kernels.symtiles_ref), so the
grid is finer than INT4's at the same bits on the wire: most values are small and take short codes
(tahnode.kernels.rice), the few large ones long codes. The size of a payload depends on its values."""

from __future__ import annotations

import math

import torch

from . import rice
from .bitpack import packed_nbytes
from .quant_ref import check_finite
from .symtiles_ref import check_scales, dequantize, quantize, rotate, tile_scales, unrotate
from .tahquant_ref import TahQuantParams
from .wire import CodecError, PayloadReader, as_bytes

__all__ = ["encode", "decode", "split", "sections", "shape_of", "zigzag", "unzigzag", "pack", "min_payload_nbytes"]


def shape_of(shape, params: TahQuantParams) -> tuple[int, int, int, int]:
    """(tokens N, channels C, tiles per token T, G) of a tensor of `shape` (..., C)."""
    c, g = shape[-1], int(params.group_size)
    return math.prod(shape) // c, c, -(-c // g), g


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
    n, _, t, g = shape_of(shape, params)
    return 1 + 2 * n * t + -(-n * t * g // 8)


def pack(scale: torch.Tensor, codes: torch.Tensor, qmax: int) -> torch.Tensor:
    """Payload: k u8 (the Rice parameter that makes it shortest, rice.best_k), scale bf16[N, T], then
    the zigzagged codes of the N*T*G rotated values (padded channels included), row-major, Rice-coded
    at k: their low bits (k > 0), then the unary stream to the payload's end."""
    z = zigzag(codes, qmax)
    k = rice.best_k(z, 2 * qmax)
    low, unary = rice.encode(z, k)
    head = torch.tensor([k], dtype=torch.uint8, device=codes.device)
    return torch.cat([head, as_bytes(scale.reshape(-1)), low, unary])


def encode(x: torch.Tensor, params: TahQuantParams) -> torch.Tensor:
    """x (..., C) -> payload (pack): rotate, scale per tile, quantize with symtiles_ref at qmax."""
    params.validate()
    check_finite(x, "tahquant")
    n, c, _, g = shape_of(tuple(x.shape), params)
    qmax = int(params.qmax)
    y = rotate(x.reshape(n, c).float(), g)
    scale = tile_scales(y, g, qmax)
    return pack(scale, quantize(y, scale, g, qmax), qmax)


def split(payload: torch.Tensor, shape, params: TahQuantParams) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check the payload's size and k -> (k, scale bf16 (N, T), low bits, unary stream). Shared with
    the kernels."""
    params.validate()
    n, _, t, g = shape_of(shape, params)
    if payload.numel() < min_payload_nbytes(shape, params):
        raise CodecError(f"tahquant layout-3 payload has {payload.numel()} bytes, shape {list(shape)} needs at least "
                         f"{min_payload_nbytes(shape, params)}")
    rd = PayloadReader(payload, "tahquant")
    k = int(rd.take(1, "Rice parameter")[0])
    scale = rd.take_array(n * t, torch.bfloat16, "scales").reshape(n, t)
    rice.check_k(k, "tahquant")  # before its low bits' size is computed from it
    low = rd.take(packed_nbytes(n * t * g, k) if k else 0, "low bits")
    return k, scale, low, rd.take(rd.remaining, "unary stream")


def sections(payload: torch.Tensor, shape, params: TahQuantParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the payload -> (scale bf16 (N, T), codes q + qmax uint8 (N, T*G))."""
    k, scale, low, unary = split(payload, shape, params)
    n, _, t, g = shape_of(shape, params)
    z = rice.decode(low, unary, n * t * g, k, 2 * int(params.qmax), "tahquant")
    return scale, unzigzag(z, int(params.qmax)).reshape(n, t * g)


def decode(payload: torch.Tensor, shape, params: TahQuantParams, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize (exact), rotate back (fwht, 1/G, signs), drop the padded channels, cast to `dtype`."""
    scale, codes = sections(payload, shape, params)
    n, c, _, g = shape_of(shape, params)
    check_scales(scale, "tahquant")
    return unrotate(dequantize(codes, scale, g, int(params.qmax)), g, c).reshape(shape).to(dtype)
