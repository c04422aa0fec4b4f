"""The same boundary activations as rounding.py; in each rotated tile the m largest values sent on a side channel
(bf16 and a 7-bit index each) and the rest on the grid of the (m+1)-th largest: error against bits per element."""
import torch

from reference import boundary_activations, reference
from tahnode.kernels import symtiles_ref as tiles
from tahnode.kernels import tahquant_rice_ref as rice

G, SIDE_BITS = 128, 16 + 7
caught = boundary_activations(reference()[0])


def side_channel(y, m, qmax):
    """(bits per element, relative error per token, RMS over tokens) of y (N, C) rotated, m outliers a tile."""
    n, c = y.shape
    t = y.reshape(n, c // G, G)
    idx = t.abs().topk(m, dim=-1).indices
    outliers = torch.zeros_like(t).scatter(-1, idx, t.gather(-1, idx).bfloat16().float())
    rest = t.scatter(-1, idx, 0.0).reshape(n, c)
    s = tiles.tile_scales(rest, G, qmax)
    q = tiles.quantize(rest, s, G, qmax)
    yq = tiles.dequantize(q, s, G, qmax) + outliers.reshape(n, c)
    error = ((yq - y).norm(dim=1) / y.norm(dim=1)).pow(2).mean().sqrt()
    return 8 * rice.pack(s, q, qmax).numel() / y.numel() + m * SIDE_BITS / G, float(error)


firsts = {(step, sender): x for step, sender, x in reversed(caught)}  # each step's first message at each boundary
for (step, sender), x in sorted(firsts.items()):
    y = tiles.rotate(x, G)
    for m in (0, 1, 2, 4):
        print(f"step {step} boundary {sender} m {m}: " + "; ".join(
            f"qmax {q} bits {b:.3f} error {e:.4f}" for q in (10, 11, 12, 13, 14) for b, e in [side_channel(y, m, q)]))
