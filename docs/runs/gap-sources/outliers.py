"""The same boundary activations as rounding.py; in each rotated tile the m largest values sent on a side channel
(bf16 and a 7-bit index each) and the rest on the grid of the (m+1)-th largest: error against bits per element."""
import torch

from reference import G, bits_and_error, boundary_activations, reference
from tahnode.kernels import symtiles_ref as tiles

SIDE_BITS = 16 + 7  # a value sent apart: bf16 and its 7-bit index in the tile
caught = boundary_activations(reference()[0])


def side_channel(y, m, qmax):
    """(bits per element, relative error per token, RMS over tokens) of y (N, C) rotated, m outliers a tile."""
    n, c = y.shape
    t = y.reshape(n, c // G, G)
    apart = torch.zeros_like(t, dtype=torch.bool).scatter(-1, t.abs().topk(m, dim=-1).indices, True).reshape(n, c)
    bits, error = bits_and_error(y, tiles.tile_scales(y.masked_fill(apart, 0.0), G, qmax), qmax, apart)
    return bits + m * SIDE_BITS / G, error


firsts = {(step, sender): x for step, sender, x in reversed(caught)}  # each step's first message at each boundary
for (step, sender), x in sorted(firsts.items()):
    y = tiles.rotate(x, G)
    for m in (0, 1, 2, 4):
        print(f"step {step} boundary {sender} m {m}: " + "; ".join(
            f"qmax {q} bits {b:.3f} error {e:.4f}" for q in (10, 11, 12, 13, 14) for b, e in [side_channel(y, m, q)]))
