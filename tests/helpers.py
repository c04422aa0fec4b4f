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
