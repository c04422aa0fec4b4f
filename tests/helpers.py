"""Small helpers shared by the codec tests: reading sections of payloads back independently of
the codecs, and building test tensors."""

from __future__ import annotations

import numpy as np
import torch


def outlier_activations(shape, frac=0.01, scale=20.0, seed=0) -> torch.Tensor:
    """Gaussian activations with a fraction of outlier channels (scaled by `scale`)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    c = shape[-1]
    idx = torch.randperm(c, generator=gen)[: max(1, int(frac * c))]
    x[..., idx] *= scale
    return x


def bits_lsb_first(data: bytes, n: int) -> np.ndarray:
    """n flags from a LSB-first bitmap (independent of tahnode's packer)."""
    arr = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    return arr[:n].astype(bool)


def activations(shape, dtype, seed=0, spikes=0.4, outlier_frac=0.02):
    """Gaussian values, a few outlier channels (x20) and, in a share `spikes` of the 64-wide
    blocks, one element x8: many tiles pass the tau = 2 outlier test."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    c = shape[-1]
    x[..., torch.randperm(c, generator=gen)[: max(1, int(outlier_frac * c))]] *= 20.0
    flat = x.reshape(-1)
    hit = torch.nonzero(torch.rand(flat.numel() // 64 + 1, generator=gen) < spikes)[:, 0] * 64
    hit = (hit + torch.randint(0, 64, hit.shape, generator=gen)).clamp(max=flat.numel() - 1)
    flat[hit] *= 8.0
    return x.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bit patterns, wherever each tensor lives (-0.0 is not +0.0, a NaN is
    never equal)."""
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu().view(view), b.cpu().view(view))


def assert_kernel_gives_the_reference(kernel, ref, x: torch.Tensor, params, device: str) -> None:
    """`kernel`'s encode of x (moved to `device`) is `ref`'s payload byte for byte, and its decode of
    that payload is `ref`'s decode bit for bit (modules with encode(x, params), decode(payload, shape,
    params, dtype))."""
    shape, dtype = tuple(x.shape), x.dtype
    payload = ref.encode(x, params)
    assert torch.equal(kernel.encode(x.to(device), params).cpu(), payload), kernel.__name__
    assert same_bits(kernel.decode(payload.to(device), shape, params, dtype).cpu(),
                     ref.decode(payload, shape, params, dtype))


def kernel_test_input(shape, dtype) -> torch.Tensor:
    """Tokens of different scales, one value 1000 times its token's others, the last token all zeros
    (scale 0): the cases a tile quantizer's kernels must get right."""
    x = (torch.randn(shape) * torch.rand(*shape[:-1], 1) * 5).to(dtype)
    x.reshape(-1, shape[-1])[0, 1] *= 1000
    x.reshape(-1, shape[-1])[-1] = 0
    return x
