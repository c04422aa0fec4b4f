"""The corpus: text files tokenized once into a flat file of token ids with a JSON index
(`prepare`); the built-in corpus is Python's own standard-library sources (others: `corpora`).

Byte-level tokens by default: token = byte value 0..255, and EOD_TOKEN = 256 ends every document,
so the vocabulary has BYTE_VOCAB_SIZE = 257 ids (llama-tiny's 260 covers it). A Hugging Face
`tokenizer.json` can be used instead; its end-of-document token is looked up by name."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

__all__ = [
    "EOD_TOKEN",
    "BYTE_VOCAB_SIZE",
    "DEFAULT_SUFFIXES",
    "EOD_NAMES",
    "DatasetInfo",
    "index_path",
    "prepare",
    "prepare_documents",
    "EmptyCorpus",
    "progress_bar",
    "default_corpus",
    "find_text_files",
    "file_sha256",
]

EOD_TOKEN = 256  # end of document, in the byte-level vocabulary
BYTE_VOCAB_SIZE = 257  # 256 byte values + EOD_TOKEN
DEFAULT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json")
# Names under which a tokenizer.json may hold its end-of-document token, tried in this order.
EOD_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "[SEP]")
INDEX_FORMAT = 1
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@dataclass(frozen=True)
class DatasetInfo:
    """The index written beside a token file as <file>.json; sha256 identifies the data, so
    stages on different machines can check that they train on the same tokens."""

    dtype: str  # "uint16" or "uint32"
    n_tokens: int
    vocab_size: int
    tokenizer: str  # "bytes", or the path of the tokenizer.json used
    eod_token: int
    sources: int  # number of documents (files) tokenized
    sha256: str  # of the token file's bytes
    tokenizer_sha256: str | None = None  # of the tokenizer.json, when one was used
    format: int = INDEX_FORMAT

    @classmethod
    def read(cls, path: Path) -> "DatasetInfo":
        """Reads and validates an index file; any problem is a ValueError that names the file."""
        if not path.is_file():
            raise FileNotFoundError(f"dataset index {path} does not exist "
                                    "(run `prepare` to write the token file and its index)")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"dataset index {path} is corrupt (not JSON: {e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"dataset index {path} is corrupt (not a JSON object)")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        missing = [n for n, f in fields.items()
                   if f.default is dataclasses.MISSING and n not in raw]
        if missing:
            raise ValueError(f"dataset index {path} is corrupt (missing {missing})")
        try:
            info = cls(**{k: v for k, v in raw.items() if k in fields})
        except TypeError as e:
            raise ValueError(f"dataset index {path} is corrupt ({e})") from None
        problems = []
        if info.format != INDEX_FORMAT:
            problems.append(f"format {info.format!r}, this version reads {INDEX_FORMAT}")
        if info.dtype not in TOKEN_DTYPES:
            problems.append(f"dtype {info.dtype!r} is not one of {sorted(TOKEN_DTYPES)}")
        for name in ("n_tokens", "vocab_size", "sources"):
            value = getattr(info, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                problems.append(f"{name} {value!r} is not a non-negative integer")
        vocab = info.vocab_size if isinstance(info.vocab_size, int) else 0
        if not isinstance(info.eod_token, int) or not 0 <= info.eod_token < vocab:
            problems.append(f"eod_token {info.eod_token!r} is outside the vocabulary")
        if not isinstance(info.sha256, str) or len(info.sha256) != 64:
            problems.append("sha256 is not a hex SHA-256 digest")
        if problems:
            raise ValueError(f"dataset index {path} is corrupt: {'; '.join(problems)}")
        return info

    def write(self, path: Path) -> None:
        """Write the index whole (a temporary file of this process, renamed): a reader sees the old or the new."""
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")
        os.replace(tmp, path)


def index_path(token_file: Path) -> Path:
    """The index of a token file: the same name with the suffix .json."""
    return Path(token_file).with_suffix(".json")


# ------------------------------------------------------------------------------------------------
# Finding text
# ------------------------------------------------------------------------------------------------


def find_text_files(inputs: Sequence[Path], suffixes: Sequence[str] = DEFAULT_SUFFIXES
                    ) -> list[Path]:
    """Files named in `inputs` plus, under directories in `inputs`, every file with one of the
    suffixes (hidden and __pycache__ directories skipped); sorted, without duplicates."""
    found: set[Path] = set()
    for item in map(Path, inputs):
        if item.is_file():
            found.add(item)
        elif item.is_dir():
            for root, dirs, files in os.walk(item):
                dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
                found.update(Path(root) / f for f in files if f.endswith(tuple(suffixes)))
        else:
            raise FileNotFoundError(f"input {item} does not exist")
    return sorted(found)


def default_corpus(limit_bytes: int | None = None) -> list[Path]:
    """The running interpreter's standard library sources (*.py), sorted, without site-packages
    and test directories. With `limit_bytes`, the first files (in sorted order) that together
    stay within that size (at least one file), for a quick demo."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}
    files = [p for p in sorted(stdlib.rglob("*.py"))
             if not skip.intersection(p.relative_to(stdlib).parts[:-1]) and p.is_file()]
    if not files:
        raise FileNotFoundError(f"no Python sources under the standard library at {stdlib}")
    if limit_bytes is None:
        return files
    chosen, total = [], 0
    for p in files:
        size = p.stat().st_size
        if chosen and total + size > limit_bytes:
            break
        chosen.append(p)
        total += size
    return chosen


# ------------------------------------------------------------------------------------------------
# Tokenizing
# ------------------------------------------------------------------------------------------------


def _read_text(path: Path) -> str | None:
    """The file as UTF-8 text, or None if it is binary (has NUL bytes) or does not decode."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


class _ByteTokenizer:
    """token = byte value of the UTF-8 text."""

    name, vocab_size, eod, sha256 = "bytes", BYTE_VOCAB_SIZE, EOD_TOKEN, None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


class _HFTokenizer:
    """A `tokenizers` tokenizer.json; each document gets the special tokens the tokenizer's own
    template adds (a BOS, for Llama 3's), then the end-of-document token (once)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        path = Path(path)
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers package raises plain Exceptions
            raise ValueError(f"cannot load tokenizer {path}: {e}") from None
        self.name = str(path.resolve())
        self.sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        ids = [self.tok.token_to_id(n) for n in EOD_NAMES]
        found = [i for i in ids if i is not None]
        if not found:
            raise ValueError(f"tokenizer {path} has none of the end-of-document tokens "
                             f"{list(EOD_NAMES)}; add one as a special token")
        self.eod = found[0]

    def encode(self, text: str) -> np.ndarray:
        ids = self.tok.encode(text, add_special_tokens=True).ids
        if ids and ids[-1] == self.eod:  # the template ends documents itself
            ids = ids[:-1]
        return np.asarray(ids, dtype=np.int64)


def progress_bar(enabled: bool):
    """A rich progress bar over bytes (to stderr), or a stand-in that does nothing."""
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True))


def _refuse_overwrite(out: Path, inputs: list[Path]) -> None:
    """The token file, its index and the temporary file must not be any of the inputs."""
    written = {p.resolve(): p for p in (out, index_path(out), _tmp(out))}
    for item in inputs:
        if item.resolve() in written:
            raise ValueError(f"--out {out} would overwrite the input {item} (the token file and its index "
                             f"{index_path(out).name} are written there): choose another --out")


def prepare(inputs: list[Path], out: Path, tokenizer: Path | None = None, progress: bool = True,
            suffixes: Sequence[str] = DEFAULT_SUFFIXES) -> DatasetInfo:
    """Tokenizes the text files in `inputs` (files, or directories walked for `suffixes`) into
    `out`, a flat array of token ids (uint16, or uint32 for vocabularies over 65536), and writes
    its index `out.with_suffix('.json')`. Documents are taken in sorted path order, each with the
    special tokens its tokenizer adds and followed by the end-of-document token; binary and
    non-UTF-8 files are skipped; an output that is one of the inputs is refused. Deterministic: the same
    files give the same bytes on every machine. Returns the index."""
    out = _token_file(out)
    files = find_text_files(inputs, suffixes)
    _refuse_overwrite(out, files + ([Path(tokenizer)] if tokenizer is not None else []))
    docs = ((str(path), _read_text(path), path.stat().st_size) for path in files)
    try:
        return prepare_documents(docs, out, tokenizer, progress, label=f"tokenizing {len(files)} files",
                                 total_bytes=sum(p.stat().st_size for p in files))
    except EmptyCorpus:
        raise EmptyCorpus(f"no text files found in {[str(p) for p in inputs]} "
                          f"(looked for {', '.join(suffixes)})") from None


class EmptyCorpus(ValueError):
    """Not one document was tokenized."""


def prepare_documents(documents: Iterable[tuple[str, str | None, int]], out: Path,
                      tokenizer: Path | None = None, progress: bool = True, total_bytes: int | None = None,
                      label: str = "tokenizing") -> DatasetInfo:
    """Tokenizes `documents`, (name, text, size) in the order given (text None: skipped; size: how far
    the progress bar moves, of `total_bytes`), into the token file `out` and its index, as `prepare`
    does for files. Deterministic: the same documents in the same order give the same bytes."""
    out = _token_file(out)
    tok = _HFTokenizer(tokenizer) if tokenizer is not None else _ByteTokenizer()
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    eod = np.asarray([tok.eod], dtype=dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp(out)
    digest, n_tokens, sources = hashlib.sha256(), 0, 0
    bar = progress_bar(progress)
    try:
        with open(tmp, "wb") as f:
            if bar is not None:
                bar.start()
                task = bar.add_task(label, total=total_bytes)
            for name, text, size in documents:
                if text is not None:
                    ids = tok.encode(text)
                    if ids.size and int(ids.max()) >= tok.vocab_size:  # guards the uint16 cast
                        raise ValueError(f"tokenizer produced id {int(ids.max())} >= vocab size "
                                         f"{tok.vocab_size} on {name}")
                    chunk = np.concatenate([ids.astype(dtype), eod]).tobytes()
                    f.write(chunk)
                    digest.update(chunk)
                    n_tokens += ids.size + 1
                    sources += 1
                if bar is not None:
                    bar.advance(task, size)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.stop()
    if sources == 0:
        tmp.unlink(missing_ok=True)
        raise EmptyCorpus(f"no documents to write to {out}")
    info = DatasetInfo(dtype=np.dtype(dtype).name, n_tokens=n_tokens, vocab_size=tok.vocab_size,
                       tokenizer=tok.name, eod_token=tok.eod, sources=sources,
                       sha256=digest.hexdigest(), tokenizer_sha256=tok.sha256)
    info.write(index_path(out))  # the index first: whoever sees the token file finds its index
    os.replace(tmp, out)
    return info


def _token_file(out: Path) -> Path:
    """`out` as a Path; refused if it ends in .json, the name of its index."""
    out = Path(out)
    if out.suffix == ".json":
        raise ValueError(f"token file {out} must not end in .json (its index takes that name)")
    return out


def _tmp(out: Path) -> Path:
    """Where this process writes a token file before renaming it: processes that prepare the same file
    at once (two pipelines' stage 0 on one machine) each write their own."""
    return out.with_name(f"{out.name}.{os.getpid()}.tmp")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
