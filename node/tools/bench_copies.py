"""`tahnode bench copies`: how many times a message's payload is copied on the host between its
codec and the wire, counted (not timed) as the bytes of new memory blocks of 64 KiB or more.

A copy of a payload needs somewhere to go: every copy made by numpy, protobuf, Python's bytes or
torch allocates a block at least the size of what it copies. So the bytes of the large blocks that
the host path allocates, divided by the payload's bytes, count its copies. A child process runs the
path with a small allocator shim in LD_PRELOAD (C, compiled here with the system's `cc`) that adds
up every malloc, calloc, realloc and aligned allocation of 64 KiB or more.

Send: from the codec's payload tensor to the serialized frames gRPC writes (the codec's message
header, the envelope's body with the payload kept apart, the sealed 1 MiB frames, each frame's
bytes). Receive: from those bytes to the payload tensor a decoder reads (each frame parsed and
checked, the envelope reassembled and parsed, the payload taken out). The codec's own arithmetic is
not counted: it is not a copy. Issue 27 wants at most one copy each way."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from .host_path import CODECS

__all__ = ["CopyCount", "count_copies", "build_shim", "main"]

MIN_BLOCK = 64 * 1024
SHIM_ENV = "TAHNODE_ALLOC_SHIM"
SHIM_SOURCE = r"""
#include <stddef.h>
#include <errno.h>
extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
static size_t big_bytes = 0;
static void note(size_t n) { if (n >= %(min_block)d) __atomic_add_fetch(&big_bytes, n, __ATOMIC_RELAXED); }
size_t tahnode_big_bytes(void) { return big_bytes; }
void *malloc(size_t n) { note(n); return __libc_malloc(n); }
void *calloc(size_t k, size_t n) { note(k * n); return __libc_calloc(k, n); }
void *realloc(void *p, size_t n) { note(n); return __libc_realloc(p, n); }
void *memalign(size_t a, size_t n) { note(n); return __libc_memalign(a, n); }
void *aligned_alloc(size_t a, size_t n) { note(n); return __libc_memalign(a, n); }
int posix_memalign(void **out, size_t a, size_t n) {
    void *p;
    note(n);
    p = __libc_memalign(a, n);
    if (!p) return ENOMEM;
    *out = p;
    return 0;
}
"""


class NoCompiler(RuntimeError):
    """There is no C compiler to build the allocation counter with."""


@dataclass
class CopyCount:
    """One codec's host path: payload bytes, and the bytes of large blocks allocated per payload byte."""

    codec: str
    payload_bytes: int
    send_copies: float
    receive_copies: float


def build_shim(directory: Path) -> Path:
    """The allocation counter as a shared library in `directory` (compiled with `cc`)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise NoCompiler("tahnode bench copies needs a C compiler (cc or gcc) to build its allocation counter")
    src, lib = directory / "alloc_shim.c", directory / "alloc_shim.so"
    src.write_text(SHIM_SOURCE % {"min_block": MIN_BLOCK})
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(src)], check=True, capture_output=True)
    return lib


def _counter():
    lib = ctypes.CDLL(os.environ[SHIM_ENV])  # already loaded through LD_PRELOAD: the same counters
    lib.tahnode_big_bytes.restype = ctypes.c_size_t
    return lib.tahnode_big_bytes


def _measure(shape: tuple[int, ...], codecs: tuple[str, ...]) -> list[CopyCount]:
    """In the child: each codec's send and receive path, counted by the shim."""
    import torch

    from ..codecs import get_codec, payload_tensor
    from ..codecs.state import CodecContext
    from ..net.body import body_of
    from ..proto import tahnode_pb2 as pb
    from .bench_kernels import activations
    from .host_path import HostPath

    allocated = _counter()
    x = activations(shape, torch.bfloat16, device="cpu")
    out = []
    for name in codecs:
        path, codec = HostPath(name), get_codec(name)
        payload, extra = codec.encode_payload(x, CodecContext())
        payload = payload.contiguous()
        before = allocated()
        env = pb.Envelope()
        env.micro_batch.step = 1
        data = codec.pending(x, payload, extra, env.micro_batch.tensor).finish()  # as Worker._message does
        wire = path.frames(body_of(env, data))
        sent = allocated() - before
        del env, data
        before = allocated()
        got = payload_tensor(*path.message(wire))
        received = allocated() - before
        if not torch.equal(got, payload.reshape(-1).view(torch.uint8)):
            raise AssertionError(f"{name}: the received payload differs from the sent one")
        n = payload.numel() * payload.element_size()
        out.append(CopyCount(name, n, sent / n, received / n))
    return out


def count_copies(shape: tuple[int, ...] = (2, 512, 768), codecs: tuple[str, ...] = CODECS) -> list[CopyCount]:
    """Run the count in a child process under the shim; one CopyCount per codec."""
    with tempfile.TemporaryDirectory(prefix="tahnode-copies-") as tmp:
        lib = build_shim(Path(tmp))
        env = {**os.environ, "LD_PRELOAD": str(lib), SHIM_ENV: str(lib)}
        cmd = [sys.executable, "-m", "tahnode.tools.bench_copies", "--child", "--shape", ",".join(map(str, shape)),
               "--codecs", ",".join(codecs)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the counting process failed:\n{done.stderr[-2000:]}")
    return [CopyCount(**row) for row in json.loads(done.stdout.strip().splitlines()[-1])]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tahnode bench copies", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="2,512,768", help="B,S,C of the bf16 activations sent (default 2,512,768)")
    ap.add_argument("--codecs", default=",".join(CODECS), help=f"comma-separated codecs (default {','.join(CODECS)})")
    ap.add_argument("--json", action="store_true", help="print the counts as one JSON list")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        shape = tuple(int(v) for v in args.shape.split(","))
    except ValueError:
        print(f"tahnode bench copies: --shape must be B,S,C, got {args.shape!r}", file=sys.stderr)
        return 2
    codecs = tuple(c for c in args.codecs.split(",") if c)
    if args.child:
        print(json.dumps([asdict(c) for c in _measure(shape, codecs)]))
        return 0
    try:
        counts = count_copies(shape, codecs)
    except NoCompiler as exc:
        print(f"tahnode bench copies: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(c) for c in counts]))
        return 0
    print(f"bf16 activations {list(shape)}: bytes of new blocks >= {MIN_BLOCK // 1024} KiB per payload byte")
    print(f"{'codec':<10} {'payload':>10} {'send':>6} {'receive':>8}")
    for c in counts:
        print(f"{c.codec:<10} {c.payload_bytes / 1e6:>8.2f} MB {c.send_copies:>6.2f} {c.receive_copies:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
