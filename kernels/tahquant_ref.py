"""TAH-Quant as the paper gives it (arXiv 2506.01352; codec tahquant-paper) in plain torch: tile-wise adaptive
Hadamard quantization of activations (..., S, C) into the payload of docs/wire-format.md (tahquant version 1).

Steps (defaults in brackets): per-token entropy ranks tokens in each sequence, the lowest-entropy
(1 - rho) share gets INT3, the rest INT4 [rho = 0.8]; channels form tiles of G [64], zero-padded
when G does not divide C; a tile whose largest |x| is >= tau x its second largest [tau = 2] has
that element swapped to position 0 and is multiplied by H/sqrt(G); each tile is quantized with
fp16 min zero-point and fp16 scale (rounded before quantizing), round half to even."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .bitpack import pack_bits, pack_rows, packed_nbytes, padded_count, row_nbytes, unpack_bits, unpack_rows
from .quant_ref import check_finite, dequantize_asym, fp16_min_scale, hadamard, quantize_asym
from .wire import CodecError, PayloadReader, as_bytes, bitmap, read_bitmap

__all__ = ["PaperParams", "Layout", "encode", "decode", "token_entropy", "low_bit_mask", "outlier_pivots",
           "check_group_size"]

ALLOC_TOKEN = 0  # one bit width per token (the paper's v1 rule): the only allocation (per tile, 1, is retired)


def check_group_size(g, codec: str) -> None:
    """G, the channels of a tile: a power of two in [8, 256] (both TAH-Quant codecs')."""
    if g != int(g) or not 8 <= g <= 256 or g & (g - 1):
        raise CodecError(f"{codec}: group_size must be a power of two in [8, 256], got {g}")


@dataclass(frozen=True)
class PaperParams:
    """The knobs of TAH-Quant as the paper gives it (codec tahquant-paper); each travels in the
    message header (`params`) of version 1."""

    group_size: int = 64   # G: channels per tile, a power of two in [8, 256]
    rho: float = 0.8       # share of tokens kept at bits_high
    tau: float = 2.0       # outlier rule: max |x| >= tau * second |x| -> pivot swap + Hadamard
    bits_high: int = 4
    bits_low: int = 3
    alloc: int = ALLOC_TOKEN  # travels in version 1's params, always 0: one bit width per token

    def validate(self) -> "PaperParams":
        check_group_size(self.group_size, "tahquant-paper")
        if not 0.0 <= self.rho <= 1.0:
            raise CodecError(f"tahquant-paper: rho must be in [0, 1], got {self.rho}")
        if not (self.tau >= 1.0 and math.isfinite(self.tau)):
            raise CodecError(f"tahquant-paper: tau must be a finite number >= 1, got {self.tau}")
        for name in ("bits_high", "bits_low"):
            b = getattr(self, name)
            if b != int(b) or not 2 <= b <= 8:
                raise CodecError(f"tahquant-paper: {name} must be an integer in [2, 8], got {b}")
        if self.bits_low > self.bits_high:
            raise CodecError("tahquant-paper: bits_low must not exceed bits_high")
        if self.alloc != ALLOC_TOKEN:
            raise CodecError(f"tahquant-paper: alloc must be 0 (one bit width per token), got {self.alloc}")
        return self

    @property
    def pivot_bits(self) -> int:
        return int(self.group_size).bit_length() - 1


@dataclass(frozen=True)
class Layout:
    """Shape bookkeeping shared by encoder, decoder and kernels: nseq sequences of S tokens of C
    channels, padded to T tiles of G."""

    nseq: int
    seq_len: int
    channels: int
    group_size: int

    @staticmethod
    def of(shape: tuple[int, ...], group_size: int) -> "Layout":
        channels = shape[-1]
        seq_len = shape[-2] if len(shape) >= 2 else 1
        nseq = math.prod(shape[:-2]) if len(shape) >= 2 else 1
        return Layout(nseq, seq_len, channels, group_size)

    @property
    def tiles_per_token(self) -> int:
        return -(-self.channels // self.group_size)

    @property
    def tokens(self) -> int:
        return self.nseq * self.seq_len

    @property
    def tiles(self) -> int:
        return self.tokens * self.tiles_per_token

    @property
    def padded_channels(self) -> int:
        return self.tiles_per_token * self.group_size


def token_entropy(x: torch.Tensor) -> torch.Tensor:
    """Entropy of each token of x (..., C) over its channels: H = -sum p ln p with p = |x| / sum |x|
    (float64; 0 for an all-zero token)."""
    mag = x.abs().double()
    total = mag.sum(-1, keepdim=True)
    p = torch.where(total > 0, mag / total, torch.zeros((), dtype=torch.float64, device=mag.device))
    terms = torch.where(p > 0, p * torch.log(p), torch.zeros((), dtype=torch.float64, device=mag.device))
    return -terms.sum(-1)


def low_bit_mask(entropy: torch.Tensor, rho: float) -> torch.Tensor:
    """(nseq, n) entropies -> bool mask of the entries that get bits_low: in each row the
    n - round(rho * n) lowest entropies (Python round, half to even); ties go to the lower index."""
    n = entropy.shape[-1]
    n_low = n - int(round(rho * n))
    order = torch.sort(entropy, dim=-1, stable=True).indices
    mask = torch.zeros_like(entropy, dtype=torch.bool)
    mask.scatter_(-1, order[..., :n_low], True)
    return mask


def outlier_pivots(tiles: torch.Tensor, tau: float):
    """For tiles (..., G) float32: (flag, pivot). pivot = first index of the largest |x|; flag when
    that magnitude is > 0 and >= fp32(tau) * the largest |x| among the other positions."""
    mag = tiles.abs()
    peak = mag.amax(-1)
    pivot = (mag == peak[..., None]).to(torch.int32).argmax(-1)  # first index of the maximum
    others = mag.scatter(-1, pivot[..., None].long(), -1.0)
    second = others.amax(-1)
    flag = (peak > 0) & (peak >= torch.tensor(tau, dtype=torch.float32) * second)
    return flag, pivot


def _swap_first(tiles: torch.Tensor, pivot: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """Swap position 0 with `pivot` in the flagged tiles (its own inverse)."""
    idx = torch.arange(tiles.shape[-1], device=tiles.device).expand(tiles.shape)
    p = torch.where(flag, pivot.long(), torch.zeros_like(pivot, dtype=torch.long))[..., None]
    src = torch.where(idx == 0, p, torch.where(idx == p, torch.zeros_like(idx), idx))
    return torch.gather(tiles, -1, src)


def to_tiles(x: torch.Tensor, params: PaperParams) -> tuple[Layout, torch.Tensor, torch.Tensor]:
    """Check x, then its layout, x as (nseq, seq_len, padded channels) float32 with the channels
    zero-padded to a multiple of G, and the same values as (nseq, seq_len, tiles per token, G)."""
    params.validate()
    check_finite(x, "tahquant")
    lay = Layout.of(tuple(x.shape), params.group_size)
    x3 = x.reshape(lay.nseq, lay.seq_len, lay.channels).float()
    if lay.padded_channels != lay.channels:
        x3 = torch.nn.functional.pad(x3, (0, lay.padded_channels - lay.channels))
    return lay, x3, x3.reshape(lay.nseq, lay.seq_len, lay.tiles_per_token, params.group_size)


def encode(x: torch.Tensor, params: PaperParams = PaperParams()) -> torch.Tensor:
    """Encode x (..., C) of float32/float16/bfloat16 into the version-1 payload (uint8, 1-D)."""
    g = params.group_size
    lay, x3, tiles = to_tiles(x, params)

    # 1-2. entropy-guided bit allocation within each sequence
    low_token = low_bit_mask(token_entropy(x3), params.rho)                  # (nseq, S)
    low_tile = low_token[..., None].expand(-1, -1, lay.tiles_per_token)

    # 3-4. outlier tiles: pivot swap, then the normalized Hadamard transform
    flag, pivot = outlier_pivots(tiles, params.tau)
    y = _swap_first(tiles, pivot, flag)
    y = torch.where(flag[..., None], hadamard(y), y)

    # 5. asymmetric min-max per tile with fp16 zero/scale
    bits = torch.where(low_tile, params.bits_low, params.bits_high)
    qmax = (2.0 ** bits.float()) - 1.0
    zero, scale = fp16_min_scale(y.amin(-1), y.amax(-1), qmax, "tahquant")
    q = quantize_asym(y, zero, scale, qmax).reshape(-1, g)

    flat_flag = flag.reshape(-1)
    flat_low = low_tile.reshape(-1)
    pivots = pivot.reshape(-1)[flat_flag].to(torch.uint8)
    pivot_codes = torch.zeros(padded_count(pivots.numel()), dtype=torch.uint8, device=x.device)
    pivot_codes[: pivots.numel()] = pivots
    code_bytes = pack_rows(q, tile_bits(flat_low, params))
    return torch.cat(
        [
            bitmap(low_token.reshape(-1)),
            bitmap(flat_flag),
            as_bytes(zero.reshape(-1)),
            as_bytes(scale.reshape(-1)),
            pack_bits(pivot_codes, params.pivot_bits),
            code_bytes,
        ]
    )


def tile_bits(low: torch.Tensor, params: PaperParams) -> torch.Tensor:
    return torch.where(low, params.bits_low, params.bits_high)


@dataclass
class Header:
    """What a version-1 payload holds before its tile codes, read and checked; `reader` stands
    at the codes."""

    lay: Layout
    bits: torch.Tensor    # (NT,) bits of each tile
    flag: torch.Tensor    # (NT,) bool: the tile was pivot-swapped and Hadamard-rotated
    zero: torch.Tensor    # (NT,) fp16
    scale: torch.Tensor   # (NT,) fp16
    pivots: torch.Tensor  # (n_flag,) pivot index of each flagged tile
    reader: PayloadReader


def check_min_payload(payload: torch.Tensor, shape: tuple[int, ...], params: PaperParams) -> None:
    """Refuse a payload shorter than the smallest one a tensor of `shape` allows (both bitmaps, the
    zero-points and scales, every tile at bits_low), before anything of its size is allocated."""
    lay = Layout.of(tuple(shape), params.group_size)
    nt = lay.tiles
    minimum = -(-lay.tokens // 8) + -(-nt // 8) + 4 * nt + nt * params.group_size * params.bits_low // 8
    if payload.numel() < minimum:
        raise CodecError(f"tahquant payload is truncated: {payload.numel()} bytes, shape "
                         f"{list(shape)} needs at least {minimum}")


def read_header(payload: torch.Tensor, shape: tuple[int, ...], params: PaperParams) -> Header:
    """The sections before the tile codes, with the checks (and errors, in their order) that
    decode makes of them."""
    params.validate()
    g = params.group_size
    lay = Layout.of(shape, g)
    nt = lay.tiles
    check_min_payload(payload, shape, params)
    rd = PayloadReader(payload, "tahquant")
    low_token = read_bitmap(rd.take(-(-lay.tokens // 8), "bit-allocation bitmap"), lay.tokens, "bit-allocation")
    flag = read_bitmap(rd.take(-(-nt // 8), "Hadamard flag bitmap"), nt, "Hadamard flag")
    zero = rd.take_array(nt, torch.float16, "zero-points")
    scale = rd.take_array(nt, torch.float16, "scales")
    if not (bool(torch.isfinite(zero).all()) and bool(torch.isfinite(scale).all()) and bool((scale >= 0).all())):
        raise CodecError("tahquant payload is corrupt: non-finite zero-point or negative/non-finite scale")
    n_flag = int(flag.sum())
    pivots = unpack_bits(rd.take(packed_nbytes(n_flag, params.pivot_bits), "pivot indices"), params.pivot_bits,
                         padded_count(n_flag))
    if bool(pivots[n_flag:].any()):
        raise CodecError("tahquant payload is corrupt: padding of the pivot indices is not zero")
    low = low_token.reshape(lay.tokens, 1).expand(-1, lay.tiles_per_token).reshape(-1)
    return Header(lay, tile_bits(low, params), flag, zero, scale, pivots[:n_flag], rd)


def decode(payload: torch.Tensor, shape: tuple[int, ...], params: PaperParams, dtype: torch.dtype) -> torch.Tensor:
    """Decode a version-1 payload (uint8, 1-D) into a tensor of `shape` and `dtype`."""
    h = read_header(payload, shape, params)
    g, lay, nt, bits, flag, zero, scale, rd = (params.group_size, h.lay, h.lay.tiles, h.bits, h.flag, h.zero, h.scale,
                                               h.reader)
    n_flag, pivots = h.pivots.numel(), h.pivots
    codes = rd.take(int(row_nbytes(bits, g).sum()), "tile codes")
    rd.finish()
    q = unpack_rows(codes, bits, g)

    y = dequantize_asym(q, zero, scale)                                            # (NT, G)
    y = torch.where(flag[:, None], hadamard(y), y)
    pivot = torch.zeros(nt, dtype=torch.long, device=payload.device)
    pivot[flag] = pivots[:n_flag].long()
    y = _swap_first(y, pivot, flag)
    x = y.reshape(lay.tokens, lay.padded_channels)[:, : lay.channels]
    return x.reshape(shape).to(dtype)
