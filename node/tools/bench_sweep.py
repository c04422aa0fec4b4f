"""`tahnode bench kernels --sweep`: a run's default pair of kernels (tahquant, pertoken)
timed at other launch settings than their modules' defaults (values and warps per program), each
checked against the references' bytes, and the fastest exact setting of each named."""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple

import torch

__all__ = ["SYMTILES_BLOCKS", "RICE_BLOCKS", "Setting", "launch_blocks", "sweep_settings", "sweep_rows",
           "fastest_settings"]

# the launch settings --sweep times beside each module's defaults (GPU_ENCODE_BLOCK, GPU_DECODE_BLOCK):
# (values, warps) per program of symtiles_triton's kernels (one setting for both), and pairs of
# ((values, warps) of the Rice encode kernels, (stream bytes, warps) of its decode kernels)
SYMTILES_BLOCKS = [(4096, 8), (2048, 4), (2048, 8), (1024, 4)]
RICE_BLOCKS = [((512, 2), (128, 4)), ((2048, 8), (512, 4)), ((2048, 4), (512, 8))]


class Setting(NamedTuple):
    """Which op of which codec a sweep row timed, at which setting of which kernels."""

    op: str                  # "CODEC encode" or "CODEC decode"
    kernels: str             # "symtiles" or "rice": the module whose setting the row varies
    block: tuple[int, int]   # (values or stream bytes, warps) per program of that op's kernels
    default: bool            # every module at its defaults


@contextlib.contextmanager
def launch_blocks(module, encode: tuple[int, int], decode: tuple[int, int]):
    """`module`'s GPU_ENCODE_BLOCK and GPU_DECODE_BLOCK set to `encode` and `decode` inside the block."""
    saved = module.GPU_ENCODE_BLOCK, module.GPU_DECODE_BLOCK
    module.GPU_ENCODE_BLOCK, module.GPU_DECODE_BLOCK = encode, decode
    try:
        yield
    finally:
        module.GPU_ENCODE_BLOCK, module.GPU_DECODE_BLOCK = saved


def sweep_settings() -> list[tuple[str, object, tuple[int, int], tuple[int, int], tuple[str, ...]]]:
    """(kernels, module, encode block, decode block, codecs timed) of each setting --sweep times: the
    defaults first, then symtiles_triton's others (both codecs use it), then rice_triton's (tahquant's)."""
    from tahnode.kernels import rice_triton, symtiles_triton

    both, rice = ("pertoken", "tahquant"), ("tahquant",)
    default = (symtiles_triton.GPU_ENCODE_BLOCK, symtiles_triton.GPU_DECODE_BLOCK)
    out = [("symtiles", symtiles_triton, *default, both)]
    out += [("symtiles", symtiles_triton, b, b, both) for b in SYMTILES_BLOCKS if (b, b) != default]
    default = (rice_triton.GPU_ENCODE_BLOCK, rice_triton.GPU_DECODE_BLOCK)
    out += [("rice", rice_triton, e, d, rice) for e, d in RICE_BLOCKS if (e, d) != default]
    return out


def sweep_rows(x: torch.Tensor, iters: int, timer: Callable[[Callable[[], object], int], float]) -> list[dict]:
    """Encode and decode rows of a run's default pair at each of sweep_settings(), named
    "CODEC encode [KERNELS values/warps]" ("default": the first setting, every module's defaults).
    `diff`: payload bytes (encode) or decoded elements (decode) that differ from the reference's
    (every setting must give 0). timer(fn, iters): fn's seconds (bench_kernels.time_cuda)."""
    from tahnode.kernels import pertoken_ref, pertoken_triton, tahquant_rice_ref, tahquant_rice_triton

    shape, dtype, rows = tuple(x.shape), x.dtype, []
    codecs = {"pertoken": (pertoken_triton, pertoken_ref, pertoken_ref.PerTokenParams()),
              "tahquant": (tahquant_rice_triton, tahquant_rice_ref, tahquant_rice_ref.RiceParams())}
    wanted = {}
    for name, (_, ref, params) in codecs.items():
        payload = ref.encode(x, params)
        wanted[name] = payload, ref.decode(payload, shape, params, dtype)
    for i, (kernels, module, encode_block, decode_block, names) in enumerate(sweep_settings()):
        with launch_blocks(module, encode_block, decode_block):
            for name in names:
                kernel, _, params = codecs[name]
                payload, values = wanted[name]
                ops = (("encode", encode_block, lambda: kernel.encode(x, params),
                        _differing(kernel.encode(x, params), payload)),
                       ("decode", decode_block, lambda: kernel.decode(payload, shape, params, dtype),
                        _differing(kernel.decode(payload, shape, params, dtype), values)))
                for op, block, fn, diff in ops:
                    label = f"{name} {op} [{kernels} {block[0]}/{block[1]}{', default' if i == 0 else ''}]"
                    rows.append(dict(op=label, t=timer(fn, iters), ref=None, diff=diff,
                                     setting=Setting(f"{name} {op}", kernels, block, i == 0)))
    return rows


def fastest_settings(rows: list[dict]) -> list[str]:
    """What sweep_rows found, a line per (codec op, kernels): the fastest setting of those kernels
    that gives the reference's bytes, against the defaults (the other kernels at theirs)."""
    settings = [r for r in rows if "setting" in r]
    lines = []
    for op in dict.fromkeys(r["setting"].op for r in settings):
        mine = [r for r in settings if r["setting"].op == op]
        default = next(r for r in mine if r["setting"].default)
        for kernels in dict.fromkeys(r["setting"].kernels for r in mine):
            exact = [r for r in mine if (r["setting"].kernels == kernels or r["setting"].default) and r["diff"] == "0"]
            best = min(exact, key=lambda r: r["t"], default=None)
            if best is None:
                lines.append(f"{op}, {kernels}: no setting gave the reference's bytes")
                continue
            if best is default:
                lines.append(f"{op}, {kernels}: the defaults are fastest ({default['t'] * 1e6:.1f} us)")
            else:
                values, warps = best["setting"].block
                lines.append(f"{op}, {kernels}: fastest {values}/{warps} {best['t'] * 1e6:.1f} us, "
                             f"the defaults {default['t'] * 1e6:.1f} us ({default['t'] / best['t']:.2f}x)")
    return lines


def _differing(got: torch.Tensor, want: torch.Tensor) -> str:
    """The elements of `got` whose bits differ from `want`'s (a payload's bytes, or decoded values)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{list(got.shape)} {got.dtype} vs {list(want.shape)} {want.dtype}"
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    return str(int((got.view(ints) != want.view(ints)).sum()))
