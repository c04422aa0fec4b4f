"""symtiles_cpu (the fast CPU rotation and quantization) against symtiles_ref, its specification: the
same float32 bits and codes on awkward shapes (padded tiles, zero and tiny tiles, every tile size),
the same error on overflow, and the caller's tensor left as it was."""

from __future__ import annotations

import pytest
import torch

from tahnode.kernels import symtiles_cpu, symtiles_ref
from tahnode.kernels.wire import CodecError
from helpers import same_bits


def _input(n: int, c: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=gen) * torch.exp(3 * torch.randn(n, 1, generator=gen))
    x[:1] = 0.0
    if n > 2:
        x[1] *= 1e-38  # scales below the smallest normal: the tile is sent as zeros
        x[2, c // 2] = 3e4
    return x


@pytest.mark.parametrize("n,c,g,qmax", [(5, 128, 128, 12), (7, 200, 128, 31), (3, 40, 8, 1), (9, 768, 64, 127),
                                        (4, 96, 32, 7), (1, 256, 256, 12)])
def test_the_same_bits_as_the_reference(n, c, g, qmax):
    x = _input(n, c, seed=n * c + g)
    before = x.clone()
    y = symtiles_ref.rotate(x, g)
    assert same_bits(symtiles_cpu.rotate(x, g), y)
    assert torch.equal(x, before)
    scale = symtiles_ref.tile_scales(y, g, qmax)
    codes = symtiles_ref.quantize(y, scale, g, qmax)
    assert torch.equal(symtiles_cpu.quantize(y, scale, g, qmax), codes)
    back = symtiles_ref.dequantize(codes, scale, g, qmax)
    assert same_bits(symtiles_cpu.dequantize(codes, scale, g, qmax), back)
    kept = back.clone()
    assert same_bits(symtiles_cpu.unrotate(back, g, c), symtiles_ref.unrotate(back, g, c))
    assert torch.equal(back, kept)


def test_the_same_error_when_a_rotation_overflows():
    x = torch.full((2, 64), 3e38)
    with pytest.raises(CodecError) as want:
        symtiles_ref.rotate(x, 64)
    with pytest.raises(CodecError) as got:
        symtiles_cpu.rotate(x, 64)
    assert str(got.value) == str(want.value)
