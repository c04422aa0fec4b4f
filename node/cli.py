"""The `tahnode` command line: one argparse tree whose subcommands call the modules that do the
work (codec eval, data prepare, join, coordinator, demo, bench)."""

from __future__ import annotations

import argparse
import sys

from .codecs import CODECS, CodecError


def _add_codec_commands(sub) -> None:
    codec = sub.add_parser("codec", help="inspect and evaluate the activation/gradient codecs")
    csub = codec.add_subparsers(dest="codec_cmd", required=True)
    ev = csub.add_parser(
        "eval",
        help="encode+decode a stored tensor and report bits/element, SQNR, error and timings",
        description="Encode and decode a tensor (.pt holding one tensor of shape (..., C), or "
        ".safetensors) with one codec; report bits per element of the whole wire message (header "
        "included), SQNR in dB, max abs error, encode/decode time and device. aqsgd reports the "
        "second visit of the same samples; amaq reports untrained gates at the end of its schedule.",
    )
    ev.add_argument("file", help="tensor file: .pt (torch.save of one tensor) or .safetensors")
    ev.add_argument("--codec", required=True, choices=sorted(CODECS), help="codec to evaluate")
    ev.add_argument("--param", action="append", metavar="K=V", help="codec parameter, repeatable (e.g. --param rho=0.7)")
    ev.add_argument("--key", help="tensor name inside a .safetensors file (or dict .pt) holding several")
    ev.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    ev.add_argument("--repeat", type=int, default=3, help="timed repetitions after one warm-up (median reported)")
    ev.add_argument("--drift", type=float, default=0.1, help="aqsgd only: change of the activations between visits, in std units")
    ev.add_argument("--json", action="store_true", help="print one JSON object instead of text (sqnr_db is null for an exact reconstruction)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tahnode",
        description="Train LLMs across volunteers' GPUs over slow links: each daemon holds one pipeline "
        "stage, activations travel TAH-Quant compressed.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_codec_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "codec" and args.codec_cmd == "eval":
            from . import codec_eval

            return codec_eval.main(args)
    except CodecError as exc:
        print(f"tahnode: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
