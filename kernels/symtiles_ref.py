"""Symmetric absmax quantization per tile of G channels within a token, one bf16 scale per tile, and
the random-sign Hadamard rotation of whole tiles: the shared specification of `pertoken` and of
codec tahquant (TAH-Quant Rice-coded). All arithmetic is IEEE float32 in the order written here.

A scale never spans tokens; bf16 has float32's exponent range, so no shared exponent is needed."""

from __future__ import annotations

import hashlib

import torch

from .bitpack import pack_bits, packed_nbytes, padded_count, unpack_bits
from .wire import CodecError

__all__ = ["MIN_SCALE", "tile_scales", "quantize", "dequantize", "pack_codes", "unpack_codes", "corrupt_codes",
           "check_scales", "rotation_signs", "fwht", "rotate", "unrotate"]

MIN_SCALE = 2.0 ** -126  # absmax / qmax below the smallest normal float32: the tile is sent as zeros
SIGN_SEED = b"tahnode tahquant rotation signs"


def _per_element(values: torch.Tensor, channels: int, g: int) -> torch.Tensor:
    """(N, T) per-tile values -> (N, C): each channel gets its tile's value (the last tile may be short)."""
    return values.repeat_interleave(g, dim=1)[:, :channels]


def tile_scales(x2: torch.Tensor, g: int, qmax: int) -> torch.Tensor:
    """x2 (N, C) float32 -> scale (N, T) bf16, T = ceil(C / g): ratio = fp32(absmax / qmax) of each
    tile, rounded to nearest-even bf16, or 0 where ratio < 2^-126."""
    n, c = x2.shape
    t = -(-c // g)
    tiles = torch.nn.functional.pad(x2, (0, t * g - c)).reshape(n, t, g)
    ratio = tiles.abs().amax(-1) / qmax
    return torch.where(ratio >= MIN_SCALE, ratio, torch.zeros((), device=x2.device)).to(torch.bfloat16)


def quantize(x2: torch.Tensor, scale: torch.Tensor, g: int, qmax: int) -> torch.Tensor:
    """Codes q + qmax (N, C) uint8 in [0, 2 qmax]: q = round_half_even(clamp(fp32(x / s), -qmax, qmax)),
    s the tile's scale as float32; q = 0 where s = 0."""
    s = _per_element(scale.float(), x2.shape[1], g)
    nonzero = s > 0
    u = torch.where(nonzero, x2 / torch.where(nonzero, s, torch.ones((), device=x2.device)),
                    torch.zeros((), device=x2.device))
    return (torch.round(torch.clamp(u, -qmax, qmax)) + qmax).to(torch.uint8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, g: int, qmax: int) -> torch.Tensor:
    """x = (code - qmax) * s in float32: exact (an integer of at most 8 bits times an 8-bit significand)."""
    return (codes.float() - qmax) * _per_element(scale.float(), codes.shape[1], g)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """All codes, row-major, zero-padded to a multiple of 8, packed at `bits`."""
    flat = codes.reshape(-1)
    padded = torch.zeros(padded_count(flat.numel()), dtype=torch.uint8, device=codes.device)
    padded[: flat.numel()] = flat
    return pack_bits(padded, bits)


def unpack_codes(packed: torch.Tensor, n: int, c: int, bits: int, qmax: int, codec: str) -> torch.Tensor:
    """Inverse of pack_codes -> (n, c); codes above 2*qmax or non-zero padding are corrupt."""
    if packed.numel() != packed_nbytes(n * c, bits):
        raise CodecError(f"{codec} payload: {packed.numel()} bytes of codes, {packed_nbytes(n * c, bits)} expected")
    codes = unpack_bits(packed, bits, padded_count(n * c))
    if bool((codes[: n * c] > 2 * qmax).any()) or bool(codes[n * c:].any()):
        raise corrupt_codes(codec)
    return codes[: n * c].reshape(n, c)


def corrupt_codes(codec: str) -> CodecError:
    """The error of a code above 2 qmax or a non-zero padding code."""
    return CodecError(f"{codec} payload is corrupt: code out of range or non-zero padding")


def check_scales(scale: torch.Tensor, codec: str) -> None:
    """A received scale must be +0 or a positive normal float32 (what the encoder makes)."""
    s = scale.float()
    valid = torch.isfinite(s) & ~torch.signbit(s) & ((s == 0) | (s >= MIN_SCALE))
    if not bool(valid.all()):
        raise CodecError(f"{codec} payload is corrupt: a scale is negative, non-finite or subnormal")


def rotation_signs(g: int, device=None) -> torch.Tensor:
    """The fixed signs (g,) float32 of the rotation: -1 where bit i of SHA-256(SIGN_SEED) is set
    (bit i = bit i % 8 of byte i // 8), +1 elsewhere; g <= 256."""
    if not 1 <= g <= 256:
        raise ValueError(f"rotation size must be in [1, 256], got {g}")
    digest = torch.tensor(list(hashlib.sha256(SIGN_SEED).digest()), dtype=torch.int64)
    bits = (digest[:, None] >> torch.arange(8)) & 1
    return (1.0 - 2.0 * bits.reshape(-1)[:g].float()).to(device)


def fwht(y: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform of the last dim (a power of two, G): y @ H with the
    Sylvester H, as float32 butterflies for h = 1, 2, 4, ..., G/2: within each block of 2h
    entries, (a, b) = (y[j], y[j + h]) becomes (a + b, a - b). H @ H = G * I."""
    g = y.shape[-1]
    lead = y.shape[:-1]
    h = 1
    while h < g:
        v = y.reshape(*lead, g // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, g)
        h *= 2
    return y


def rotate(x2: torch.Tensor, g: int) -> torch.Tensor:
    """x2 (N, C) float32 -> (N, T*G): channels zero-padded to whole tiles, each tile times the signs,
    then fwht. Raises CodecError if a rotated value overflows float32."""
    n, c = x2.shape
    t = -(-c // g)
    tiles = torch.nn.functional.pad(x2, (0, t * g - c)).reshape(n, t, g)
    y = fwht(tiles * rotation_signs(g, x2.device)).reshape(n, t * g)
    if not bool(torch.isfinite(y * g).all()):  # decoding sums G of them again
        raise CodecError("tahquant: an activation is too large to rotate (|x| near the float32 maximum)")
    return y


def unrotate(y: torch.Tensor, g: int, channels: int) -> torch.Tensor:
    """Inverse of rotate: (N, T*G) -> (N, channels): fwht, times 1/G (exact), times the signs."""
    n = y.shape[0]
    tiles = fwht(y.reshape(n, -1, g)) * (1.0 / g) * rotation_signs(g, y.device)
    return tiles.reshape(n, -1)[:, :channels]
