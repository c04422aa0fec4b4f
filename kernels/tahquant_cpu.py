"""TAH-Quant on the CPU, fast: the same version-1 payload as tahquant_ref, byte for byte, with fewer
and larger operations. What changes is only how the work is done, never its arithmetic:

- the pivot swap and the Hadamard transform touch only the flagged tiles (the reference transforms
  every tile and keeps the flagged ones; each row's float64 product is the same either way);
- the bit planes are packed and unpacked with numpy on whole sections (bitpack_cpu: no per-row-width scatter);
- the entropies, the outlier test and the quantization run the reference's operations in its
  order, skipping only its where()s where they change nothing (no all-zero row, no zero scale);
  the ranking, the fp16 zero-points and scales and the dequantization are its own functions.

encode(x (..., C), params) -> uint8 payload       decode(payload, shape, params, dtype) -> (shape)
tests/test_codec_cpu_path.py holds it to the reference's bytes and values, and to its errors."""

from __future__ import annotations

import numpy as np
import torch

from .bitpack import padded_count
from .bitpack_cpu import pack_planes_np, pack_rows_np, unpack_rows_np
from .quant_ref import dequantize_asym, fp16_min_scale, hadamard
from .tahquant_ref import PaperParams, low_bit_mask, read_header, tile_bits, to_tiles

__all__ = ["encode", "decode"]


def _swap_first(rows: torch.Tensor, pivot: torch.Tensor) -> None:
    """Swap position 0 with `pivot` in every row, in place (its own inverse)."""
    k = torch.arange(rows.shape[0])
    first = rows[:, 0].clone()
    rows[:, 0] = rows[k, pivot]
    rows[k, pivot] = first


def _entropy(mag: torch.Tensor) -> torch.Tensor:
    """tahquant_ref's entropy of |x| rows (float64), element for element: the where()s it needs for
    all-zero rows and zero entries are applied only where they change something."""
    mag = mag.double()
    total = mag.sum(-1, keepdim=True)
    p = mag / total
    if not bool((total > 0).all()):
        p = torch.where(total > 0, p, torch.zeros((), dtype=torch.float64))
    terms = p * torch.log(p)
    terms.masked_fill_(p == 0, 0.0)  # 0 * log(0): the reference's where(p > 0, ..., 0)
    return -terms.sum(-1)


def _outliers(mag: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """tahquant_ref.outlier_pivots from |tiles| (argmax gives the first index of the maximum too)."""
    peak, pivot = mag.max(-1)
    second = mag.scatter(-1, pivot[..., None], -1.0).amax(-1)
    flag = (peak > 0) & (peak >= torch.tensor(tau, dtype=torch.float32) * second)
    return flag, pivot


def _quantize(y: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, qmax: torch.Tensor) -> torch.Tensor:
    """quant_ref.quantize_asym, op for op, without its where() when no scale is zero."""
    s = scale.float()[..., None]
    u = (y - zero.float()[..., None]) / s
    if not bool((scale > 0).all()):
        u = torch.where(s > 0, u, torch.zeros(()))
    return torch.round(torch.minimum(torch.clamp(u, min=0.0), qmax[..., None])).to(torch.uint8)


def encode(x: torch.Tensor, params: PaperParams = PaperParams()) -> torch.Tensor:
    """tahquant_ref.encode, faster on the CPU (the same bytes)."""
    g = params.group_size
    lay, _, tiles = to_tiles(x, params)
    mag = tiles.abs()
    low_token = low_bit_mask(_entropy(mag.reshape(lay.nseq, lay.seq_len, -1)), params.rho)
    low = low_token[..., None].expand(-1, -1, lay.tiles_per_token).reshape(-1)
    flag, pivot = _outliers(mag, params.tau)
    flag, pivot = flag.reshape(-1), pivot.reshape(-1)
    y = tiles.reshape(-1, g).clone()
    flagged = flag.nonzero().squeeze(1)
    if flagged.numel():
        sub = y[flagged]
        _swap_first(sub, pivot[flagged])
        y[flagged] = hadamard(sub)
    bits = tile_bits(low, params)
    qmax = (2.0 ** bits.float()) - 1.0
    zero, scale = fp16_min_scale(y.amin(-1), y.amax(-1), qmax, "tahquant")
    q = _quantize(y, zero, scale, qmax)
    pivots = np.zeros(padded_count(flagged.numel()), dtype=np.uint8)
    pivots[: flagged.numel()] = pivot[flagged].numpy()
    return torch.from_numpy(np.concatenate([
        np.packbits(low_token.reshape(-1).numpy(), bitorder="little"),
        np.packbits(flag.numpy(), bitorder="little"),
        zero.numpy().view(np.uint8),
        scale.numpy().view(np.uint8),
        pack_planes_np(pivots[None, :], params.pivot_bits)[0],
        pack_rows_np(q.numpy(), bits.numpy()),
    ]))


def decode(payload: torch.Tensor, shape: tuple[int, ...], params: PaperParams, dtype: torch.dtype) -> torch.Tensor:
    """tahquant_ref.decode, faster on the CPU (the same values, and the same errors in the same order)."""
    h = read_header(payload, shape, params)
    g, lay, bits, flag, zero, scale, rd = params.group_size, h.lay, h.bits, h.flag, h.zero, h.scale, h.reader
    codes = rd.take(int(bits.long().sum()) * (g // 8), "tile codes")
    rd.finish()
    q = torch.from_numpy(unpack_rows_np(codes.numpy(), bits.numpy(), g))
    y = dequantize_asym(q, zero, scale)
    flagged = flag.nonzero().squeeze(1)
    if flagged.numel():
        sub = hadamard(y[flagged])
        _swap_first(sub, h.pivots.long())
        y[flagged] = sub
    return y.reshape(lay.tokens, lay.padded_channels)[:, : lay.channels].reshape(shape).to(dtype)
