"""The named corpora `tahnode data prepare --corpus NAME` makes besides the stdlib sources: English
prose from the HTML pages of a pinned package, the same token file on every run (`make`).

linux-docs: the Linux 6.1 kernel's documentation as Debian 12 ships it (linux-doc-6.1, GPL-2), each
page's main text one document, pages in sorted path order; docs/benchmarks.md gives its numbers."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .archive import Archive, deb_members, fetch
from .corpus import DatasetInfo, index_path, prepare_documents, progress_bar
from .htmltext import html_to_text

__all__ = ["PackagedCorpus", "CORPORA", "pages", "documents", "make"]


@dataclass(frozen=True)
class PackagedCorpus:
    """A corpus made from the HTML pages of one pinned package."""

    name: str
    title: str
    license: str
    archive: Archive
    root: str  # the folder in the package that holds the pages, with a trailing /
    skip: tuple[str, ...]  # pages left out: fnmatch patterns over the path under root (* spans /)
    tokens_sha256: str  # of the byte-level token file it makes here (Python 3.11's html.parser)
    n_tokens: int  # of that token file

    def wants(self, name: str) -> bool:
        """Whether a file of the package is one of the corpus's pages."""
        if not name.startswith(self.root) or not name.endswith(".html"):
            return False
        page = name[len(self.root):]
        return not any(fnmatch.fnmatchcase(page, pattern) for pattern in self.skip)


_DEB = "linux-doc-6.1_6.1.176-1_all.deb"
LINUX_DOCS = PackagedCorpus(
    name="linux-docs",
    title="the Linux 6.1 kernel's documentation (HTML pages of Debian 12's linux-doc-6.1 6.1.176-1)",
    license="GPL-2 (the kernel's; Debian main, see usr/share/doc/linux-doc-6.1/copyright in the package)",
    archive=Archive(
        filename=_DEB,
        sha256="0d843674607703b9ef8c1db5e715c38ed52ff23574feabfe0d961d552126859f",
        size=37222656,
        urls=(f"https://deb.debian.org/debian/pool/main/l/linux/{_DEB}",  # Debian 12.15, its last point release
              f"https://archive.debian.org/debian/pool/main/l/linux/{_DEB}",  # once Debian 12 is archived
              "https://snapshot.debian.org/file/97a5e89b363de0a3439a2b0953a366683e859d77"),  # by its sha1
        by_hand="`apt-get download linux-doc-6.1=6.1.176-1` on Debian 12"),
    root="usr/share/doc/linux-doc-6.1/html/",
    # Sphinx's own folders (_sources, _static, ...), the pages in other languages, the indexes, and
    # the MAINTAINERS list (names and e-mail addresses, not prose)
    skip=("_*", "translations/*", "genindex*.html", "search.html", "process/maintainers.html"),
    tokens_sha256="2eb7a40a2c78bfa3c0649e8e5a6bd1996c70697d5eb254b3279605ece15a9eef",
    n_tokens=29376506,
)
CORPORA = {c.name: c for c in (LINUX_DOCS,)}


def pages(corpus: PackagedCorpus, archive: Path, progress: bool = True) -> dict[str, bytes]:
    """The corpus's pages in the package at `archive`: path under the corpus's root -> HTML bytes."""
    bar = progress_bar(progress)
    if bar is not None:
        bar.start()
        task = bar.add_task(f"reading {Path(archive).name}", total=Path(archive).stat().st_size)
    try:
        on_read = (lambda n: bar.advance(task, n)) if bar is not None else None
        found = {name[len(corpus.root):]: data for name, data in deb_members(archive, corpus.wants, on_read)}
    finally:
        if bar is not None:
            bar.stop()
    if not found:
        raise ValueError(f"{archive} holds no pages of {corpus.name} under {corpus.root}")
    return found


def documents(found: dict[str, bytes]) -> Iterator[tuple[str, str | None, int]]:
    """(page, text, HTML bytes) in sorted page order, the text extracted as it is asked for; None for
    a page that is not UTF-8 or has no text (an index of links), which is left out."""
    for page in sorted(found):
        raw = found[page]
        try:
            text = html_to_text(raw.decode("utf-8"))
        except UnicodeDecodeError:
            text = ""
        yield page, (text or None), len(raw)


def make(name: str, out: Path, cache_dir: Path, archive: Path | None = None, tokenizer: Path | None = None,
         progress: bool = True) -> DatasetInfo:
    """Fetches (or takes `archive`, checked against its pin) the package of corpus `name`, and
    writes its token file `out` and index. Returns the index."""
    if name not in CORPORA:
        raise ValueError(f"no corpus {name!r}: the corpora are stdlib, {', '.join(sorted(CORPORA))}")
    corpus = CORPORA[name]
    path = fetch(corpus.archive, cache_dir, archive, progress=progress)
    if path.resolve() in (Path(out).resolve(), index_path(Path(out)).resolve()):
        raise ValueError(f"--out {out} would overwrite the package {path} it is made from: choose another --out")
    found = pages(corpus, path, progress)
    return prepare_documents(documents(found), out, tokenizer, progress, total_bytes=sum(map(len, found.values())),
                             label=f"extracting and tokenizing {len(found)} pages")
