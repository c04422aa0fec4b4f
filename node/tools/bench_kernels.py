"""`tahnode bench kernels`: time the Triton codec kernels on a GPU next to x.clone() of the same
tensor (the memory-bandwidth yardstick) and the pure-torch reference on the same GPU; append the
results, dated and naming the GPU, to docs/benchmarks-log.md. With --sweep, a run's default pair of
kernels at other launch settings instead (values and warps per program), to choose the defaults.

Timing: CUDA events around each call after warm-up (the first calls compile the kernels), the
median of --iters runs (at most 5 for the much slower references). Effective GB/s = bytes of the
input tensor / time, for every op, so the columns compare directly with clone (which moves twice
those bytes: read and write). The host path of a whole message per codec (tensor -> sealed frames
on the host and back, tahnode.tools.host_path) is timed on the wall clock beside copying the raw
tensor to pinned host memory."""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from typing import Callable

import torch

from ..codecs import decode
from ..net.memory import reuse_message_buffers
from .bench_sweep import fastest_settings, sweep_rows
from .host_path import CODECS as HOST_PATH_CODECS
from .host_path import HostPath

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HOST_PATH_ITERS = 10  # whole messages kept in host memory at once (64 MB each uncompressed at 4,2048,4096 bf16)
ALL_SHAPES = [(4, 2048, 4096), (1, 1024, 1600), (8, 4096, 8192)]
HEADER = """
### Kernel timings

Written by `tahnode bench kernels` (node/tools/bench_kernels.py): median of CUDA-event timings after
warm-up. GB/s = bytes of the input tensor / time; `× clone` = time / time of `x.clone()` of the same
tensor; `ref / kernel` = the pure-torch reference on the same GPU / the kernel. `bytes ≠ ref`: payload
bytes that differ from the reference's (the Hadamard rounding of docs/wire-format.md).
Input: Gaussian activations with 1% outlier channels (×20). Rows `CODEC: tensor -> frames` and
`CODEC: frames -> tensor` (since 2026-11-25) time a whole message's host path on the wall clock
(encode, envelope, sealed 1 MiB frames on the host; reassembly, checks, decode onto the GPU), beside
`x -> pinned host` (the raw tensor copied to pinned host memory, the limit the issue 27 sets) and
`x.cpu()`; their `bytes ≠ ref` counts elements that differ from decoding the message directly.

| date | GPU | torch / triton | shape | dtype | op | µs | GB/s | × clone | ref µs | ref / kernel | bytes ≠ ref |
|---|---|---|---|---|---|---|---|---|---|---|---|
"""


def _parse_shape(text: str) -> list[tuple[int, ...]]:
    if text == "all":
        return list(ALL_SHAPES)
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape must be B,S,C or 'all', got {text!r}") from None
    if not shape or any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"--shape must be positive integers, got {text!r}")
    return [shape]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tahnode bench kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=_parse_shape, default=[(4, 2048, 4096)],
                    help="B,S,C of the activations, or 'all' for " + " ".join(",".join(map(str, s)) for s in ALL_SHAPES)
                    + " (default 4,2048,4096)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="input dtype (default bf16)")
    ap.add_argument("--iters", type=int, default=50,
                    help="timed runs per op after warm-up; the median is reported (default 50)")
    ap.add_argument("--doc", default="docs/benchmarks-log.md",
                    help="markdown file the rows are appended to (default docs/benchmarks-log.md)")
    ap.add_argument("--profile", action="store_true",
                    help="also print the GPU time of each kernel of one encode and one decode "
                    "(torch.profiler), per shape")
    ap.add_argument("--sweep", action="store_true",
                    help="instead of the usual rows, time a run's default pair (tahquant, pertoken) at other "
                         "launch settings of its kernels (values/warps per program; 'default' marks the current ones)")
    return ap


def profile_codecs(shape, dtype) -> str:
    """Per-kernel GPU times of one encode + decode of each codec the bench times (after warm-up), a
    table per codec (their kernels share names): where the time goes, for tuning."""
    from tahnode.kernels import (pertoken_ref, pertoken_triton, tahquant_ref, tahquant_rice_ref, tahquant_rice_triton,
                                 tahquant_triton)

    x = activations(shape, dtype)
    tq, pt = tahquant_ref.PaperParams(), pertoken_ref.PerTokenParams()
    rice = tahquant_rice_ref.RiceParams()

    tables = []
    for name, once in (
            ("tahquant-paper (the paper's algorithm)",
             lambda: tahquant_triton.decode(tahquant_triton.encode(x, tq), shape, tq, dtype)),
            ("tahquant (a run's forward codec)",
             lambda: tahquant_rice_triton.decode(tahquant_rice_triton.encode(x, rice), shape, rice, dtype)),
            ("pertoken (a run's backward codec)",
             lambda: pertoken_triton.decode(pertoken_triton.encode(x, pt), shape, pt, dtype))):
        tables.append(f"{name}, one encode + decode:\n{_profile(once)}")
    return "\n".join(tables)


def _profile(once: Callable[[], object]) -> str:
    """The profiler's table of once()'s kernels, by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        once()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        once()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total"):  # the name changed across torch versions
        try:
            return averages.table(sort_by=key, row_limit=15)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=15)


def time_cuda(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median seconds of fn() over `iters` runs, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def activations(shape, dtype, device="cuda", seed=0) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, generator=gen, device=device)
    c = shape[-1]
    idx = torch.randperm(c, generator=gen, device=device)[: max(1, c // 100)]
    x[..., idx] *= 20.0
    return x.to(dtype)


def bench_shape(shape, dtype, iters: int, sweep: bool = False) -> list[dict]:
    """x.clone()'s row, then codec_rows' (or sweep_rows'), each with the shape, the input's bytes and the
    clone's time."""
    x = activations(shape, dtype)
    t_clone = time_cuda(lambda: x.clone(), iters)
    rows = [dict(op="x.clone()", t=t_clone, ref=None, diff="")]
    rows += sweep_rows(x, iters, time_cuda) if sweep else codec_rows(x, iters)
    for r in rows:
        r.update(shape=shape, nbytes=x.numel() * x.element_size(), clone=t_clone)
    return rows


def codec_rows(x: torch.Tensor, iters: int) -> list[dict]:
    """Encode and decode rows of tahquant-paper and symtiles_rows' codecs, beside their references,
    then host_path_rows."""
    from tahnode.kernels import tahquant_ref, tahquant_triton

    shape, dtype = tuple(x.shape), x.dtype
    tq = tahquant_ref.PaperParams()
    ref_iters = max(1, min(iters, 5))
    rows = []

    pay_k = tahquant_triton.encode(x, tq)
    pay_r = tahquant_ref.encode(x, tq)
    diff = (str(int((pay_k != pay_r).sum())) if pay_k.numel() == pay_r.numel()
            else f"size {pay_k.numel()} vs {pay_r.numel()}")
    rows.append(dict(op="tahquant-paper encode", t=time_cuda(lambda: tahquant_triton.encode(x, tq), iters),
                     ref=time_cuda(lambda: tahquant_ref.encode(x, tq), ref_iters), diff=diff))
    rows.append(dict(op="tahquant-paper decode",
                     t=time_cuda(lambda: tahquant_triton.decode(pay_r, shape, tq, dtype), iters),
                     ref=time_cuda(lambda: tahquant_ref.decode(pay_r, shape, tq, dtype), ref_iters), diff=""))
    del pay_k

    rows += symtiles_rows(x, iters, ref_iters)
    rows += host_path_rows(x, min(iters, HOST_PATH_ITERS))
    return rows


def symtiles_rows(x: torch.Tensor, iters: int, ref_iters: int) -> list[dict]:
    """Encode and decode rows of the per-tile symmetric codecs: pertoken (the default gradient codec)
    and tahquant (as a run sends it); their kernels must give the references' bytes exactly."""
    from tahnode.kernels import pertoken_ref, pertoken_triton, tahquant_rice_ref, tahquant_rice_triton

    shape, dtype, rows = tuple(x.shape), x.dtype, []
    for op, kernel, ref, params in (
            ("pertoken encode", pertoken_triton, pertoken_ref, pertoken_ref.PerTokenParams()),
            ("tahquant encode", tahquant_rice_triton, tahquant_rice_ref, tahquant_rice_ref.RiceParams())):
        pay_k, pay_r = kernel.encode(x, params), ref.encode(x, params)
        diff = (str(int((pay_k != pay_r).sum())) if pay_k.numel() == pay_r.numel()
                else f"size {pay_k.numel()} vs {pay_r.numel()}")
        rows.append(dict(op=op, t=time_cuda(lambda: kernel.encode(x, params), iters),
                         ref=time_cuda(lambda: ref.encode(x, params), ref_iters), diff=diff))
        rows.append(dict(op=op.replace("encode", "decode"),
                         t=time_cuda(lambda: kernel.decode(pay_r, shape, params, dtype), iters),
                         ref=time_cuda(lambda: ref.decode(pay_r, shape, params, dtype), ref_iters), diff=""))
    return rows


def time_wall(fn: Callable[[], object], iters: int, warmup: int = 2) -> float:
    """Median wall seconds of fn() over `iters` runs, each ending with the device idle: for work that
    waits on the host (the codec's copy of its payload to the host, protobuf, the MAC)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def host_path_rows(x: torch.Tensor, iters: int, codecs: tuple[str, ...] = HOST_PATH_CODECS) -> list[dict]:
    """A whole message per codec (tahnode.tools.host_path): "tensor -> frames" (encode, envelope,
    sealed frames' wire bytes on the host) and "frames -> tensor" (reassembly, checks, decode onto x's device),
    beside copying the raw tensor to pinned and to pageable host memory. `diff`: elements where the
    received tensor differs from decode(encode(x)) (must be 0)."""
    rows = []
    if x.is_cuda:
        pinned = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        rows.append(dict(op="x -> pinned host", t=time_wall(lambda: pinned.copy_(x, non_blocking=True), iters),
                         ref=None, diff=""))
    rows.append(dict(op="x.cpu()", t=time_wall(lambda: x.cpu(), iters), ref=None, diff=""))
    for label in codecs:
        path = HostPath(label)
        expected = decode(path.codec.encode(x), device=x.device)
        rows.append(dict(op=f"{label}: tensor -> frames", t=time_wall(lambda: path.send(x), iters), ref=None, diff=""))
        sent = [path.send(x) for _ in range(iters + 3)]  # a frame list is received once: no replays
        received = path.receive(sent.pop(), x.device)
        diff = str(int((received != expected).sum())) if received.shape == expected.shape else "shape differs"
        rows.append(dict(op=f"{label}: frames -> tensor",
                         t=time_wall(lambda: path.receive(sent.pop(), x.device), iters),
                         ref=None, diff=diff if diff != "0" else ""))
    return rows


def format_row(r: dict, gpu: str, versions: str, dtype_name: str, date: str) -> str:
    gbs = r["nbytes"] / r["t"] / 1e9
    ref_us = f"{r['ref'] * 1e6:.0f}" if r["ref"] is not None else ""
    speedup = f"{r['ref'] / r['t']:.1f}" if r["ref"] is not None else ""
    shape = "×".join(map(str, r["shape"]))
    return (f"| {date} | {gpu} | {versions} | {shape} | {dtype_name} | {r['op']} | {r['t'] * 1e6:.1f} | {gbs:.0f} | "
            f"{r['t'] / r['clone']:.2f} | {ref_us} | {speedup} | {r['diff']} |")


def append_rows(path: str, lines: list[str]) -> None:
    """Add `lines` under the last row of the kernel table in `path`, which gets the table (HEADER)
    at its end the first time; the rest of the file stays as it is."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    columns = HEADER.strip().splitlines()[-2]  # the table's column line
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    if columns not in text:
        text += HEADER
    rows = text.splitlines(keepends=True)
    at = next(i for i, row in enumerate(rows) if row.startswith(columns)) + 1
    while at < len(rows) and rows[at].startswith("|"):
        at += 1
    rows[at:at] = [line + "\n" for line in lines]
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(rows))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: tahnode bench kernels needs one", file=sys.stderr)
        return 2
    if args.iters < 1:
        print("tahnode bench kernels: --iters must be at least 1", file=sys.stderr)
        return 2
    import triton

    reuse_message_buffers()  # the host path's rows: this process keeps its heap as a daemon does
    gpu = torch.cuda.get_device_name()
    versions = f"{torch.__version__.split('+')[0]} / {triton.__version__}"
    date = datetime.date.today().isoformat()
    lines = []
    for shape in args.shape:
        rows = bench_shape(shape, DTYPES[args.dtype], args.iters, args.sweep)
        print(f"{gpu}  shape {list(shape)} {args.dtype}  ({rows[0]['nbytes'] / 1e6:.1f} MB)")
        for r in rows:
            ref = (f"  reference {r['ref'] * 1e6:9.1f} us (ref/kernel {r['ref'] / r['t']:.1f})" if r["ref"] is not None
                   else "")
            note = f"  bytes != ref: {r['diff']}" if r["diff"] else ""
            print(f"  {r['op']:<16} {r['t'] * 1e6:9.1f} us  {r['nbytes'] / r['t'] / 1e9:7.1f} GB/s  "
                  f"{r['t'] / r['clone']:5.2f}x clone{ref}{note}")
            lines.append(format_row(r, gpu, versions, args.dtype, date))
        if args.sweep:
            print("\n".join(["fastest launch settings:", *fastest_settings(rows)]))
        if args.profile:
            print(profile_codecs(shape, DTYPES[args.dtype]))
        torch.cuda.empty_cache()
    append_rows(args.doc, lines)
    print(f"appended {len(lines)} rows to {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
