"""`pertoken` (the default backward codec) on the CPU, fast: pertoken_ref's payload byte for byte, its
decodes bit for bit, its errors. The reference's scales; its quantization and dequantization with
symtiles_cpu when every tile is whole (else its own functions); the bit planes packed and unpacked
with numpy on the whole section (tahquant_cpu's planes) instead of torch per plane.

encode(x (..., C), params) -> uint8 payload       decode(payload, shape, params, dtype) -> (shape)"""

from __future__ import annotations

import numpy as np
import torch

from . import symtiles_cpu, symtiles_ref
from .bitpack import padded_count
from .pertoken_ref import PerTokenParams, sections, tiles_of
from .quant_ref import check_finite
from .symtiles_ref import check_scales, corrupt_codes, tile_scales
from .bitpack_cpu import pack_planes_np, unpack_planes_np
from .wire import as_bytes

__all__ = ["encode", "decode"]


def encode(x: torch.Tensor, params: PerTokenParams = PerTokenParams()) -> torch.Tensor:
    params.validate()
    check_finite(x, "pertoken")
    n, c, _ = tiles_of(tuple(x.shape), params)
    g, qmax = int(params.group_size), params.qmax
    x2 = x.reshape(n, c).float()
    scale = tile_scales(x2, g, qmax)
    quantize = symtiles_cpu.quantize if c % g == 0 else symtiles_ref.quantize
    codes = np.zeros(padded_count(n * c), dtype=np.uint8)
    codes[: n * c] = quantize(x2, scale, g, qmax).reshape(-1).numpy()
    packed = pack_planes_np(codes[None, :], int(params.bits))[0]
    return torch.cat([as_bytes(scale), torch.from_numpy(packed)])


def decode(payload: torch.Tensor, shape, params: PerTokenParams, dtype: torch.dtype) -> torch.Tensor:
    scale, packed = sections(payload, shape, params)
    n, c, _ = tiles_of(shape, params)
    check_scales(scale, "pertoken")
    codes = unpack_planes_np(packed.numpy()[None, :], int(params.bits), padded_count(n * c))[0]
    if int(codes[: n * c].max(initial=0)) > 2 * params.qmax or codes[n * c:].any():
        raise corrupt_codes("pertoken")
    g = int(params.group_size)
    dequantize = symtiles_cpu.dequantize if c % g == 0 else symtiles_ref.dequantize
    codes2 = torch.from_numpy(codes[: n * c]).reshape(n, c)
    return dequantize(codes2, scale, g, params.qmax).reshape(shape).to(dtype)
