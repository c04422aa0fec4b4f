"""A pinned archive fetched once and checked against its sha256 (`fetch`), and the files inside a
Debian package read without dpkg (`deb_members`): what a named corpus is made from.

Nothing is trusted that does not match the pin: a download is written to a temporary file, hashed as
it arrives and renamed into the cache only when its sha256 is the pinned one."""

from __future__ import annotations

import os
import tarfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from .corpus import file_sha256, progress_bar

__all__ = ["Archive", "ArchiveUnavailable", "fetch", "deb_members"]

CHUNK = 1 << 20
TIMEOUT_S = 60


@dataclass(frozen=True)
class Archive:
    """One file pinned by its sha256, and where it can be downloaded (tried in order)."""

    filename: str  # the name it is kept under in the cache
    sha256: str
    size: int  # bytes
    urls: tuple[str, ...]
    by_hand: str = ""  # another way to get it, said when no URL answers (e.g. an apt-get command)


class ArchiveUnavailable(OSError):
    """No URL gave the archive; the message says what to download by hand and where to put it."""


def _check(path: Path, archive: Archive, what: str) -> Path:
    got = file_sha256(path)
    if got != archive.sha256:
        raise ValueError(f"{what} {path} is not {archive.filename}: its sha256 is {got}, the pinned one "
                         f"{archive.sha256} (a different version, or damaged)")
    return path


def _download(url: str, dest: Path, archive: Archive, progress: bool) -> None:
    """Download url into dest (a temporary name), with a progress bar."""
    bar = progress_bar(progress)
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, open(dest, "wb") as f:
            if bar is not None:
                bar.start()
                task = bar.add_task(f"downloading {archive.filename}", total=archive.size)
            for block in iter(lambda: response.read(CHUNK), b""):
                f.write(block)
                if bar is not None:
                    bar.advance(task, len(block))
    finally:
        if bar is not None:
            bar.stop()


def fetch(archive: Archive, cache_dir: Path, given: Path | None = None, progress: bool = True,
          opener: Callable[[str, Path, Archive, bool], None] = _download) -> Path:
    """The archive's path, checked against its sha256: `given` (a copy downloaded by hand), else the
    copy in `cache_dir`, else downloaded there from the first URL that answers with the right bytes.
    A file of the wrong sha256 is refused, never replaced; no URL answering is an ArchiveUnavailable
    that says what to download by hand."""
    if given is not None:
        if not Path(given).is_file():
            raise FileNotFoundError(f"--archive {given} does not exist")
        return _check(Path(given), archive, "--archive")
    cached = Path(cache_dir) / archive.filename
    if cached.exists():
        return _check(cached, archive, "the cached archive")  # refused, not replaced: the user decides
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    failures = []
    for url in archive.urls:
        try:
            opener(url, tmp, archive, progress)
            got = file_sha256(tmp)
        except (urllib.error.URLError, OSError) as e:  # unreachable, not there (404), cut short
            failures.append(f"{url}: {getattr(e, 'reason', None) or e}")
            tmp.unlink(missing_ok=True)
            continue
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if got != archive.sha256:
            failures.append(f"{url}: gave a file whose sha256 is {got}, not the pinned {archive.sha256}")
            tmp.unlink(missing_ok=True)
            continue
        os.replace(tmp, cached)
        return cached
    where = "\n  ".join(archive.urls)
    hand = f"\n  or: {archive.by_hand}" if archive.by_hand else ""
    raise ArchiveUnavailable(
        f"cannot download {archive.filename} ({archive.size} bytes):\n  " + "\n  ".join(failures)
        + f"\ndownload it by hand from one of\n  {where}{hand}\n"
        f"check that its sha256 is {archive.sha256}, and pass it with --archive FILE "
        f"(or put it in {Path(cache_dir)})")


# ------------------------------------------------------------------------------------------------
# Debian packages: an ar archive whose data.tar.* holds the files
# ------------------------------------------------------------------------------------------------


def _ar_members(f) -> Iterator[tuple[str, int, int]]:
    """(name, offset, size) of each member of an ar archive open at its start."""
    if f.read(8) != b"!<arch>\n":
        raise ValueError("not an ar archive (a .deb starts with !<arch>)")
    while True:
        header = f.read(60)
        if not header:
            return
        if len(header) != 60 or header[58:60] != b"`\n":
            raise ValueError("damaged ar archive (a member header is cut short)")
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        offset = f.tell()
        yield name, offset, size
        f.seek(offset + size + (size & 1))  # members are padded to an even length


class _Window:
    """A read-only view of `size` bytes of a file from `offset`, for tarfile's stream mode."""

    def __init__(self, f, offset: int, size: int, on_read: Callable[[int], None] | None = None):
        self.f, self.left, self.on_read = f, size, on_read
        f.seek(offset)

    def read(self, n: int = -1) -> bytes:
        n = self.left if n is None or n < 0 else min(n, self.left)
        data = self.f.read(n)
        self.left -= len(data)
        if self.on_read is not None:
            self.on_read(len(data))
        return data


def deb_members(path: Path, want: Callable[[str], bool],
                on_read: Callable[[int], None] | None = None) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each regular file in a .deb's data.tar.{xz,gz,bz2} whose name (without
    the leading ./) `want` accepts, in the archive's order. `on_read(n)` is told of every n bytes
    of the package read, for a progress bar."""
    with open(path, "rb") as f:
        members = {name: (offset, size) for name, offset, size in _ar_members(f)}
        data = [n for n in members if n.startswith("data.tar")]
        if not data:
            raise ValueError(f"{path} is not a Debian package: no data.tar member in {sorted(members)}")
        if data[0] not in ("data.tar.xz", "data.tar.gz", "data.tar.bz2", "data.tar"):
            raise ValueError(f"{path}: {data[0]} is compressed in a way Python's tarfile does not read")
        with tarfile.open(fileobj=_Window(f, *members[data[0]], on_read), mode="r|*") as tar:
            for member in tar:
                name = member.name[2:] if member.name.startswith("./") else member.name
                if member.isfile() and want(name):
                    yield name, tar.extractfile(member).read()
