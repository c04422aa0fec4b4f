"""Train the bench's reference 200 steps keeping the boundary activations of steps 100 and 199; then rounding to
nearest (the codec) against stochastic rounding, and a token's step from its absmax against one from its RMS."""
import torch

from reference import G, bits_and_error, boundary_activations, reference
from tahnode.kernels import symtiles_ref as tiles

caught = boundary_activations(reference()[0])
generator = torch.Generator().manual_seed(0)


def round_trip(x, qmax, stochastic):
    y = tiles.rotate(x, G)
    s = tiles.tile_scales(y, G, qmax)
    if stochastic:
        step = s.float().repeat_interleave(G, 1)
        u = (y / step).clamp(-qmax, qmax)
        yq = torch.floor(u + torch.rand(u.shape, generator=generator)).clamp(-qmax, qmax) * step
    else:
        yq = tiles.dequantize(tiles.quantize(y, s, G, qmax), s, G, qmax)
    return tiles.unrotate(yq, G, x.shape[1])


for step, sender, x in caught:
    for stochastic in (False, True):
        e = round_trip(x, 12, stochastic) - x
        shared = float(e.mean(0).pow(2).sum() * len(e) / e.pow(2).sum(1).mean())
        print(f"step {step} boundary {sender} {'stochastic' if stochastic else 'nearest'}: "
              f"error {float(e.norm() / x.norm()):.4f} slope {float((e * x).sum() / (x * x).sum()):+.5f} "
              f"shared {shared:.2f}")
    y = tiles.rotate(x, G)
    rms = y.pow(2).mean(1, keepdim=True).sqrt()
    steps = [("absmax/12", tiles.tile_scales(y, G, 12), 12)] + [
        (f"rms/{c}", (rms / c).to(torch.bfloat16), 24) for c in (4.2, 4.4)]
    print("  " + "; ".join(f"{name}: bits {b:.3f} error {e:.4f}"
                           for name, s, q in steps for b, e in [bits_and_error(y, s, q)]))
