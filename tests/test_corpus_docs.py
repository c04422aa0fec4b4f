"""Tests of the second corpus (`tahnode data prepare --corpus linux-docs`), without the network: HTML
pages to text, a small fake Debian package made here, the same bytes on every run, the sha256 pin
refusing a wrong archive, and the command's errors when nothing can be downloaded."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import tarfile
import urllib.error
from pathlib import Path

import numpy as np
import pytest

from tahnode import cli
from tahnode.train import archive as archive_mod
from tahnode.train import corpora
from tahnode.train.archive import Archive, ArchiveUnavailable, deb_members, fetch
from tahnode.train.corpus import EOD_TOKEN
from tahnode.train.htmltext import html_to_text
from tahnode.tools.data_prepare import CORPUS_NAMES

ROOT = corpora.LINUX_DOCS.root


def page(body: str, title: str = "T") -> str:
    """A Sphinx-like page: navigation and scripts around the main element."""
    return (f"<html><head><title>{title}</title><script>var x = '<p>not text</p>';</script>"
            "<style>p { color: red }</style></head><body>"
            "<div role=\"navigation\"><ul><li><a href=\"#\">Nav link</a></li></ul></div>"
            "<div role=\"search\"><form><input name=\"q\"></form></div>"
            f"<div class=\"body\" role=\"main\">{body}</div>"
            "<footer>© The kernel development community</footer></body></html>")


PAGES = {  # under the corpus's root; the ones the corpus leaves out map to None
    "admin-guide/intro.html": page("<h1>Intro<a class=\"headerlink\" href=\"#i\">¶</a></h1>"
                                   "<p>The <em>kernel</em>\n  boots.</p><pre>$ make\n    -j4\n</pre>"),
    "b/é.html": page("<p>caf&eacute; &amp; &lt;tea&gt;</p><table><tr><th>a</th><th><p>b</p></th></tr>"
                     "<tr><td>1</td><td>2</td></tr></table>"),
    "a.html": page("<ul><li>one</li><li>two</li></ul>"),
    "index.html": page("<div class=\"toctree-wrapper\"><ul><li>a link</li></ul></div>"),  # no text
    "_static/doc.html": page("<p>static</p>"),
    "_sources/a.rst.txt": "source",
    "translations/zh_CN/index.html": page("<p>中文</p>"),
    "genindex-A.html": page("<p>index</p>"),
    "search.html": page("<p>search</p>"),
    "process/maintainers.html": page("<p>names and addresses</p>"),
    "notes.txt": "not a page",
}
TEXTS = {  # the pages the corpus keeps, in sorted order, and their text
    "a.html": "one\ntwo\n",
    "admin-guide/intro.html": "Intro\n\nThe kernel boots.\n\n$ make\n    -j4\n",
    "b/é.html": "café & <tea>\n\na | b\n1 | 2\n",
}


def ar(members: list[tuple[str, bytes]]) -> bytes:
    """An ar archive as dpkg writes one."""
    out = [b"!<arch>\n"]
    for name, data in members:
        out.append(f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode())
        out.append(data + (b"\n" if len(data) % 2 else b""))
    return b"".join(out)


def fake_deb(path: Path, pages: dict[str, str], compression: str = "xz") -> Path:
    """A .deb whose data.tar holds the pages under the corpus's root (shuffled order), a symlink and
    a file elsewhere."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=f"w:{compression}") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
        add("./usr/share/doc/elsewhere/x.html", page("<p>elsewhere</p>").encode())
        for name in sorted(pages, reverse=True):
            add(f"./{ROOT}{name}", pages[name].encode("utf-8"))
        link = tarfile.TarInfo(f"./{ROOT}link.html")
        link.type, link.linkname = tarfile.SYMTYPE, "a.html"
        tar.addfile(link)
    path.write_bytes(ar([("debian-binary", b"2.0\n"), ("control.tar.xz", b""),
                         (f"data.tar.{compression}", buf.getvalue())]))
    return path


@pytest.fixture
def deb(tmp_path, monkeypatch) -> Path:
    """A fake linux-doc package, pinned in place of the real one."""
    path = fake_deb(tmp_path / "fake.deb", PAGES)
    pinned = dataclasses.replace(corpora.LINUX_DOCS.archive, filename="fake.deb", size=path.stat().st_size,
                                 sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    monkeypatch.setitem(corpora.CORPORA, "linux-docs", dataclasses.replace(corpora.LINUX_DOCS, archive=pinned))
    return path


def tokens_of(texts: dict[str, str]) -> list[int]:
    out = []
    for name in sorted(texts):
        out += list(texts[name].encode("utf-8")) + [EOD_TOKEN]
    return out


def test_html_to_text_keeps_the_main_text_only():
    for name, text in TEXTS.items():
        assert html_to_text(PAGES[name]) == text
    assert html_to_text(PAGES["index.html"]) == ""  # only a table of contents
    assert html_to_text("<p>no main element</p><script>x()</script><nav>menu</nav><p>second</p>") == \
        "no main element\n\nsecond\n"
    assert html_to_text("<p>unclosed <b>bold<p>next</div></span>") == "unclosed bold\n\nnext\n"
    assert html_to_text("") == "" and html_to_text("<html><body>  </body></html>") == ""


def test_the_pages_of_a_package(deb):
    found = corpora.pages(corpora.CORPORA["linux-docs"], deb, progress=False)
    assert sorted(found) == sorted([*TEXTS, "index.html"])  # left out: Sphinx's folders, translations, ...
    docs = list(corpora.documents(found))
    assert [name for name, _, _ in docs] == sorted(found)
    assert {name: text for name, text, _ in docs if text is not None} == TEXTS


def test_make_writes_the_same_bytes_every_time(deb, tmp_path):
    infos = [corpora.make("linux-docs", tmp_path / f"run{i}.bin", tmp_path / "cache", archive=deb, progress=False)
             for i in range(2)]
    first, second = ((tmp_path / f"run{i}.bin").read_bytes() for i in range(2))
    assert first == second and infos[0] == infos[1]
    assert np.frombuffer(first, dtype=np.uint16).tolist() == tokens_of(TEXTS)
    assert infos[0].sources == len(TEXTS) and infos[0].sha256 == hashlib.sha256(first).hexdigest()
    assert not (tmp_path / "cache").exists()  # a given archive is not copied anywhere


def test_gz_packages_are_read_too(tmp_path):
    path = fake_deb(tmp_path / "gz.deb", {"a.html": PAGES["a.html"]}, compression="gz")
    assert [n for n, _ in deb_members(path, lambda n: n.endswith(".html"))] == \
        ["usr/share/doc/elsewhere/x.html", f"{ROOT}a.html"]
    (tmp_path / "plain.deb").write_bytes(b"PK\x03\x04 a zip")
    with pytest.raises(ValueError, match="not an ar archive"):
        list(deb_members(tmp_path / "plain.deb", lambda n: True))


def test_the_pin_refuses_a_wrong_archive(deb, tmp_path):
    pinned = corpora.CORPORA["linux-docs"].archive
    other = tmp_path / "other.deb"
    other.write_bytes(deb.read_bytes() + b"\0")
    with pytest.raises(ValueError, match="is not fake.deb: its sha256 is"):
        fetch(pinned, tmp_path / "cache", given=other)
    with pytest.raises(ValueError, match="sha256"):
        corpora.make("linux-docs", tmp_path / "x.bin", tmp_path / "cache", archive=other, progress=False)
    assert not (tmp_path / "x.bin").exists()
    with pytest.raises(ValueError, match="would overwrite the package"):
        corpora.make("linux-docs", deb, tmp_path / "cache", archive=deb, progress=False)
    assert fetch(pinned, tmp_path / "cache", given=deb) == deb
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "fake.deb").write_bytes(b"damaged")  # a wrong file in the cache is refused, not replaced
    with pytest.raises(ValueError, match="the cached archive"):
        fetch(pinned, cache)
    assert (cache / "fake.deb").read_bytes() == b"damaged"


def test_fetch_downloads_checks_and_keeps(deb, tmp_path):
    pinned = corpora.CORPORA["linux-docs"].archive
    calls = []

    def opener(url, dest, archive, progress):
        calls.append(url)
        if len(calls) == 1:
            raise urllib.error.URLError("no route")
        dest.write_bytes(b"wrong bytes" if len(calls) == 2 else deb.read_bytes())  # the second: refused

    cache = tmp_path / "cache"
    path = fetch(pinned, cache, progress=False, opener=opener)
    assert calls == list(pinned.urls) and path == cache / "fake.deb"
    assert path.read_bytes() == deb.read_bytes() and os.listdir(cache) == ["fake.deb"]  # no temporary left
    assert fetch(pinned, cache, progress=False, opener=opener) == path and len(calls) == 3  # kept


def test_a_download_of_the_wrong_bytes_is_refused(tmp_path, monkeypatch):
    class Response(io.BytesIO):
        def __enter__(self):
            return self

    monkeypatch.setattr(archive_mod.urllib.request, "urlopen", lambda url, timeout: Response(b"evil"))
    pinned = Archive("x.deb", hashlib.sha256(b"good").hexdigest(), 4, ("https://a.invalid/x.deb",))
    with pytest.raises(ArchiveUnavailable, match="not the pinned"):
        fetch(pinned, tmp_path, progress=False)
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(archive_mod.urllib.request, "urlopen", lambda url, timeout: Response(b"good"))
    assert fetch(pinned, tmp_path, progress=False).read_bytes() == b"good"


def test_the_command_without_network_says_what_to_download(tmp_path, monkeypatch, capsys):
    def offline(url, timeout):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(archive_mod.urllib.request, "urlopen", offline)
    out = tmp_path / "docs.bin"
    rc = cli.main(["data", "prepare", "--corpus", "linux-docs", "--out", str(out), "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    pinned = corpora.LINUX_DOCS.archive
    assert f"cannot download {pinned.filename}" in err and "name resolution" in err
    assert "download it by hand" in err and pinned.urls[0] in err and pinned.sha256 in err
    assert "apt-get download linux-doc-6.1=6.1.176-1" in err and "--archive FILE" in err
    assert not out.exists() and os.listdir(tmp_path) == []


def test_the_command_with_an_archive_and_its_refusals(deb, tmp_path, capsys):
    out = tmp_path / "docs.bin"
    args = ["data", "prepare", "--corpus", "linux-docs", "--out", str(out), "--archive", str(deb)]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert f"wrote {len(tokens_of(TEXTS))} tokens" in printed and f"from {len(TEXTS)} pages" in printed
    assert f"sha256 {hashlib.sha256(out.read_bytes()).hexdigest()}" in printed
    before = out.read_bytes()
    assert cli.main(args) == 2 and "pass --force" in capsys.readouterr().err  # never overwritten silently
    assert cli.main([*args, "--force"]) == 0 and out.read_bytes() == before
    for extra, says in ((["--input", "x"], "not both"), (["--limit-mb", "1"], "--limit-mb applies")):
        assert cli.main([*args, "--force", *extra]) == 2 and says in capsys.readouterr().err
    assert cli.main(["data", "prepare", "--out", str(tmp_path / "s.bin"), "--archive", str(deb)]) == 2
    assert "--archive is the package" in capsys.readouterr().err


def test_the_command_knows_every_corpus():
    assert CORPUS_NAMES == ("stdlib", *corpora.CORPORA)
    for corpus in corpora.CORPORA.values():
        assert len(corpus.archive.sha256) == 64 and len(corpus.tokens_sha256) == 64 and corpus.n_tokens > 0


@pytest.mark.skipif(not (Path(os.environ.get("TAHNODE_CACHE", Path.home() / ".cache" / "tahnode"))
                         / corpora.LINUX_DOCS.archive.filename).is_file(),
                    reason="the real linux-doc-6.1 package is not in the cache (tahnode data prepare --corpus "
                    "linux-docs puts it there)")
def test_the_real_package_gives_the_recorded_token_file(tmp_path):
    cache = Path(os.environ.get("TAHNODE_CACHE", Path.home() / ".cache" / "tahnode"))
    info = corpora.make("linux-docs", tmp_path / "docs.bin", cache, progress=False)
    assert (info.sha256, info.n_tokens) == (corpora.LINUX_DOCS.tokens_sha256, corpora.LINUX_DOCS.n_tokens)
