"""symtiles_ref's rotation, quantization and their inverses on the CPU, fast and bit for bit: the
same float32 operations in the same order, with fewer and larger tensors.

fwht runs its butterflies between two buffers (the reference stacks new tensors at every stage);
scales apply per tile by broadcasting (the reference repeats them per element)."""

from __future__ import annotations

import torch

from .symtiles_ref import rotation_signs
from .wire import CodecError

__all__ = ["fwht", "rotate", "unrotate", "quantize", "dequantize"]


def fwht(y: torch.Tensor) -> torch.Tensor:
    """symtiles_ref.fwht of y (..., G): stages h = 1, 2, ..., G/2, each (a, b) -> (a + b, a - b);
    y itself is never written."""
    g = y.shape[-1]
    if g == 1:
        return y.clone()
    cur = y.reshape(-1, g)
    buffers = [torch.empty_like(cur), None]
    h = 1
    while h < g:
        out = buffers[0] if cur is not buffers[0] else buffers[1]
        if out is None:
            out = buffers[1] = torch.empty_like(cur)
        v, o = cur.reshape(-1, g // (2 * h), 2, h), out.reshape(-1, g // (2 * h), 2, h)
        torch.add(v[:, :, 0], v[:, :, 1], out=o[:, :, 0])
        torch.sub(v[:, :, 0], v[:, :, 1], out=o[:, :, 1])
        cur = out
        h *= 2
    return cur.reshape(y.shape)


def _tiles(x2: torch.Tensor, g: int) -> torch.Tensor:
    """x2 (N, C) -> (N, T, G), channels zero-padded to whole tiles."""
    n, c = x2.shape
    t = -(-c // g)
    return (torch.nn.functional.pad(x2, (0, t * g - c)) if t * g != c else x2).reshape(n, t, g)


def rotate(x2: torch.Tensor, g: int) -> torch.Tensor:
    """symtiles_ref.rotate: x2 (N, C) float32 -> (N, T*G), or its CodecError on overflow."""
    y = fwht(_tiles(x2, g) * rotation_signs(g))
    if y.numel() and not bool(torch.isfinite(y.abs().amax() * g)):  # y * g is exact up to overflow
        raise CodecError("tahquant: an activation is too large to rotate (|x| near the float32 maximum)")
    return y.reshape(x2.shape[0], y.shape[1] * g)


def unrotate(y: torch.Tensor, g: int, channels: int) -> torch.Tensor:
    """symtiles_ref.unrotate: fwht, times 1/G, times the signs; (N, T*G) -> (N, channels)."""
    n, width = y.shape
    tiles = fwht(y.reshape(n, width // g, g))
    tiles.mul_(1.0 / g).mul_(rotation_signs(g))
    return tiles.reshape(n, width)[:, :channels]


def quantize(y: torch.Tensor, scale: torch.Tensor, g: int, qmax: int) -> torch.Tensor:
    """symtiles_ref.quantize of rows y (N, T*G) (whole tiles) with scales (N, T): codes uint8."""
    s = scale.float().unsqueeze(-1)
    nonzero = s > 0
    u = y.reshape(y.shape[0], y.shape[1] // g, g) / torch.where(nonzero, s, 1.0)
    u = torch.where(nonzero, u, 0.0)
    return u.clamp_(-qmax, qmax).round_().add_(qmax).to(torch.uint8).reshape(y.shape)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, g: int, qmax: int) -> torch.Tensor:
    """symtiles_ref.dequantize of codes (N, T*G) (whole tiles): (code - qmax) * s, float32."""
    n, width = codes.shape
    return ((codes.reshape(n, width // g, g).float() - qmax) * scale.float().unsqueeze(-1)).reshape(n, width)
