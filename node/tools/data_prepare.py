"""`tahnode data prepare`: a token file and its index from text files (--input), the stdlib sources
(the default) or a named corpus made from a pinned package (--corpus linux-docs).

Never overwrites silently: an existing --out is replaced only with --force."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

CORPUS_NAMES = ("stdlib", "linux-docs")  # node.train.corpora.CORPORA has the packaged ones


def add_flags(pr: argparse.ArgumentParser) -> None:
    pr.add_argument("--input", nargs="*", default=None, help="files or directories (default: the stdlib sources)")
    pr.add_argument("--corpus", choices=CORPUS_NAMES, default=None,
                    help="a built-in corpus instead of --input: stdlib (Python's standard library sources, the "
                    "default) or linux-docs (English prose: the Linux 6.1 kernel's documentation, made from "
                    "Debian's linux-doc-6.1 package, downloaded once and checked against its sha256)")
    pr.add_argument("--out", required=True, help="output token file, e.g. data.bin")
    pr.add_argument("--force", action="store_true", help="replace --out if it exists (default: refuse)")
    pr.add_argument("--tokenizer", help="a Hugging Face tokenizer.json (default: bytes)")
    pr.add_argument("--limit-mb", type=float, help="stdlib only: stop after this many MB of text")
    pr.add_argument("--archive", help="--corpus linux-docs: its package, downloaded by hand (checked against "
                    "its sha256), for a machine that cannot download it")
    pr.add_argument("--cache-dir", default="",
                    help="where downloaded packages are kept (default: $TAHNODE_CACHE, else ~/.cache/tahnode)")


def cache_dir(flag: str) -> Path:
    return Path(flag or os.environ.get("TAHNODE_CACHE", Path.home() / ".cache" / "tahnode"))


def main(args) -> int:
    from ..train.corpus import default_corpus, prepare

    corpus = args.corpus or "stdlib"
    if args.input and args.corpus:
        raise ValueError("give --input or --corpus, not both")
    if args.archive and corpus == "stdlib":
        raise ValueError("--archive is the package of a --corpus other than stdlib")
    if args.limit_mb and corpus != "stdlib":
        raise ValueError(f"--limit-mb applies to the stdlib corpus, not {corpus} (made whole, to its pinned sha256)")
    out = Path(args.out)
    if out.exists() and not args.force:
        raise ValueError(f"{out} exists: pass --force to replace it, or choose another --out")
    tokenizer = Path(args.tokenizer) if args.tokenizer else None
    if corpus == "stdlib":
        limit = int(args.limit_mb * 2**20) if args.limit_mb else None
        inputs = [Path(p) for p in args.input] if args.input else default_corpus(limit_bytes=limit)
        info = prepare(inputs, out, tokenizer=tokenizer, progress=True)
        print(f"wrote {info.n_tokens} tokens ({info.dtype}, vocab {info.vocab_size}) from "
              f"{info.sources} files to {args.out}")
        return 0

    from ..train.corpora import CORPORA, make

    info = make(corpus, out, cache_dir(args.cache_dir), Path(args.archive) if args.archive else None, tokenizer)
    sha = info.sha256  # of the token file's bytes, as it was written
    print(f"wrote {info.n_tokens} tokens ({info.dtype}, vocab {info.vocab_size}) from {info.sources} pages "
          f"of {CORPORA[corpus].title} to {args.out}\nsha256 {sha}")
    pinned = CORPORA[corpus].tokens_sha256
    if tokenizer is None and pinned and sha != pinned:
        print(f"note: the recorded byte-level token file of {corpus} has sha256 {pinned} "
              f"({CORPORA[corpus].n_tokens} tokens); this one differs (another Python's html.parser?)")
    elif tokenizer is None and pinned:
        print(f"the same bytes as the recorded {corpus} token file")
    return 0
