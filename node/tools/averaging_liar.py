"""A stage replica that lies at every outer step, for `tahnode bench abuse --averaging`: the real `tahnode join`
daemon with its pseudo-gradient replaced in-process by one of the lies below (its own weights take the lie too).

Run as `python -m tahnode.tools.averaging_liar LIE join FLAGS...`, LIE one of -9x, tiny, zeros, random."""

from __future__ import annotations

import enum
import runpy
import sys

import torch

__all__ = ["Lie", "lie", "patch", "main", "TINY"]

TINY = 1e-9  # the tiny lie: its own pseudo-gradient times this


class Lie(enum.Enum):
    """What the liar sends in place of its pseudo-gradient g."""

    REVERSED = "-9x"    # -9 g: against its own update, at 9 times its size
    TINY = "tiny"       # g * 1e-9: the honest reducer's own part looks huge beside it
    ZEROS = "zeros"     # nothing at all
    RANDOM = "random"   # random, of the norm of g: no direction of the others'

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, text: str) -> "Lie":
        try:
            return cls(text.strip())
        except ValueError:
            raise ValueError(f"no lie {text!r}: one of {', '.join(k.value for k in cls)}") from None


def lie(kind: Lie, g: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The lie `kind` told in place of the pseudo-gradient `g` (flat float32; the same shape and dtype back)."""
    if kind is Lie.REVERSED:
        return g * -9.0
    if kind is Lie.TINY:
        return g * TINY
    if kind is Lie.ZEROS:
        return torch.zeros_like(g)
    noise = torch.randn(g.shape, generator=generator, dtype=g.dtype)
    norm = float(noise.norm())
    return noise * (float(g.norm()) / norm) if norm > 0 else noise


def patch(kind: Lie, seed: int = 0) -> None:
    """From now on every OuterOptimizer of this process sends the lie `kind` (random ones drawn from `seed`), and
    says so on stdout once an outer step."""
    from ..train import outer

    honest = outer.OuterOptimizer.pseudo_gradient
    generator = torch.Generator().manual_seed(seed)
    told = {"n": 0}

    def pseudo_gradient(self) -> torch.Tensor:
        g = honest(self)
        told["n"] += 1
        out = lie(kind, g, generator)
        print(f"liar: outer step {told['n']}: sends {kind} (its pseudo-gradient's norm {float(g.norm()):.4g}, "
              f"the lie's {float(out.norm()):.4g})", flush=True)
        return out

    outer.OuterOptimizer.pseudo_gradient = pseudo_gradient


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) < 2 or argv[1] != "join":
        print("usage: python -m tahnode.tools.averaging_liar LIE join FLAGS... (LIE: "
              f"{', '.join(k.value for k in Lie)})", file=sys.stderr)
        return 2
    try:
        kind = Lie.parse(argv[0])
    except ValueError as exc:
        print(f"averaging_liar: {exc}", file=sys.stderr)
        return 2
    patch(kind)
    # then what `python -m tahnode.cli join ...` runs, in this process (run, not imported: the cli is a layer above)
    sys.argv = ["tahnode", *argv[1:]]
    runpy.run_module("tahnode.cli", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
