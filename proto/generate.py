"""Generates tahnode's *_pb2 (and *_pb2_grpc) modules from the .proto sources in this folder.

Run as `python -m tahnode.proto.generate` (`make proto`); `--check` only compares (used by tests)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _generate_into(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # grpcio-tools: a test/dev dependency only
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    written: list[Path] = []
    for source in sorted(HERE.glob("*.proto")):
        args = [
            "protoc",
            f"-I{HERE}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(source),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {source.name}")
    for path in sorted(out_dir.glob("*_pb2*.py")):
        text = path.read_text()
        # protoc emits `import tahnode_pb2`; inside the package it must be relative.
        for other in sorted(out_dir.glob("*_pb2.py")):
            text = text.replace(f"import {other.stem} as", f"from . import {other.stem} as")
        path.write_text(text)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report whether the committed modules are current")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = _generate_into(Path(tmp))
        stale = [p.name for p in fresh if not (HERE / p.name).exists() or (HERE / p.name).read_text() != p.read_text()]
        if args.check:
            if stale:
                print(f"stale generated modules: {', '.join(stale)} (run `make proto`)", file=sys.stderr)
                return 1
            return 0
        for path in fresh:
            (HERE / path.name).write_text(path.read_text())
            print(f"wrote {HERE / path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
