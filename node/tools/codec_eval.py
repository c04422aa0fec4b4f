"""`tahnode codec eval`: encode and decode a stored tensor with one codec and report its wire
size (bits per element, whole message), SQNR, max error, timings and device."""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch

from .. import codecs
from ..codecs import CodecContext, CodecError

AQSGD_NOTE = (
    "aqsgd is stateful: the first visit of a sample is sent in full precision and primes the cache; "
    "the figures are for the second visit of the same samples, whose activations moved by "
    "drift x std(x) x N(0, 1) (seed 0) since the first, as between two epochs"
)
AMAQ_NOTE = (
    "amaq learns its per-channel bit widths during training; the figures use untrained gates "
    "(Q = 0) at the end of the bit schedule (step = anneal_steps), i.e. the middle of [bits_min, bits_max]"
)


def load_tensor(path: Path, key: str | None = None) -> torch.Tensor:
    """A float tensor (..., C) from a .pt file or one tensor of a .safetensors file."""
    if not path.exists():
        raise CodecError(f"{path}: no such file")
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                keys = list(f.keys())
                if key is None:
                    if len(keys) != 1:
                        raise CodecError(f"{path} holds {len(keys)} tensors "
                                         f"({', '.join(keys[:8])}); choose one with --key")
                    key = keys[0]
                if key not in keys:
                    raise CodecError(f"{path} has no tensor {key!r}; it has: {', '.join(keys[:8])}")
                return f.get_tensor(key)
        except CodecError:
            raise
        except Exception as exc:
            raise CodecError(f"{path} is not a readable safetensors file: {exc}") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CodecError(f"{path} is not a readable .pt tensor file: {exc}") from None
    if isinstance(obj, dict) and key is not None:
        obj = obj.get(key)
    if not isinstance(obj, torch.Tensor):
        raise CodecError(f"{path} does not hold a tensor (got {type(obj).__name__}); save one with "
                         "torch.save(tensor, path)")
    return obj


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """10 log10(||x||^2 / ||x - y||^2) in float64; inf for an exact reconstruction."""
    x64, y64 = x.double(), y.double()
    noise = (x64 - y64).pow(2).sum().item()
    signal = x64.pow(2).sum().item()
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf


def _timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, (time.perf_counter() - start) * 1e3


def evaluate(x: torch.Tensor, codec_name: str, params: dict, repeat: int = 3, drift: float = 0.1) -> dict:
    """Encode/decode x with the codec; returns the report as a dict (the JSON of --json)."""
    codec = codecs.get_codec(codec_name, **params)
    device = x.device
    report: dict = {"codec": codec_name, "shape": list(x.shape), "dtype": str(x.dtype).replace("torch.", "")}

    def new_ctx() -> CodecContext:
        ctx = CodecContext(sample_ids=list(range(x.shape[0])) if x.dim() >= 2 else None)
        if codec_name == "amaq":
            codec.state_for(x.shape[-1], ctx, device).step = codec.params.anneal_steps
        return ctx

    target = x
    if codec_name == "aqsgd":
        if x.dim() < 2:
            raise CodecError("aqsgd needs a tensor (B, ..., C): one sample per row of dim 0")
        gen = torch.Generator().manual_seed(0)
        noise = torch.randn(x.shape, generator=gen).to(device)
        target = (x.float() + drift * x.float().std() * noise).to(x.dtype)
        report["note"] = AQSGD_NOTE
    elif codec_name == "amaq":
        report["note"] = AMAQ_NOTE

    enc_ms, dec_ms = [], []
    for _ in range(max(1, repeat) + 1):  # the first round warms up
        enc_ctx, dec_ctx = new_ctx(), new_ctx()
        if codec_name == "aqsgd":
            first = codec.encode(x, enc_ctx)
            codecs.decode(first, dec_ctx, device)
            report["first_visit_bits_per_element"] = codecs.bits_per_element(first)
        msg, te = _timed(lambda: codec.encode(target, enc_ctx), device)
        wire = codecs.serialize(msg)
        out, td = _timed(lambda: codecs.decode(codecs.parse_message(wire), dec_ctx, device), device)
        enc_ms.append(te)
        dec_ms.append(td)
    if codec_name == "amaq":
        bits = enc_ctx.amaq_state.bits().float()
        report["mean_channel_bits"] = float(bits.mean())
    if codec_name == "aqsgd":
        report["cache_bytes"] = enc_ctx.aqsgd_cache.nbytes
    err = (target.double() - out.double()).abs()
    report.update(
        bits_per_element=8.0 * len(wire) / target.numel(),
        sqnr_db=sqnr_db(target, out),
        max_abs_err=float(err.max()),
        encode_ms=statistics.median(enc_ms[1:]),
        decode_ms=statistics.median(dec_ms[1:]),
        device=str(device) if device.type != "cuda" else f"{device} ({torch.cuda.get_device_name(device)})",
        wire_bytes=len(wire),
    )
    return report


def format_report(r: dict) -> str:
    lines = [
        f"codec            {r['codec']}",
        f"shape            {tuple(r['shape'])} {r['dtype']}",
        f"bits/element     {r['bits_per_element']:.4f}  ({r['wire_bytes']} bytes on the wire, header included)",
        f"SQNR             {r['sqnr_db']:.2f} dB",
        f"max abs error    {r['max_abs_err']:.6g}",
        f"encode / decode  {r['encode_ms']:.2f} ms / {r['decode_ms']:.2f} ms  on {r['device']}",
    ]
    if "first_visit_bits_per_element" in r:
        lines.append(f"first visit      {r['first_visit_bits_per_element']:.4f} bits/element; cache "
                     f"{r['cache_bytes'] / 2**20:.1f} MiB")
    if "mean_channel_bits" in r:
        lines.append(f"channel bits     mean {r['mean_channel_bits']:.2f}")
    if "note" in r:
        lines.append(f"note             {r['note']}")
    return "\n".join(lines)


def main(args) -> int:
    x = load_tensor(Path(args.file), args.key)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CodecError("--device cuda asked for, but no CUDA GPU is available")
    params = codecs.parse_param_args(args.codec, args.param or [])
    report = evaluate(x.to(device), args.codec, params, repeat=args.repeat, drift=args.drift)
    if args.json:  # strict JSON: an exact reconstruction's infinite SQNR is written as null
        print(json.dumps({k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in report.items()},
                         allow_nan=False))
    else:
        print(format_report(report))
    return 0
