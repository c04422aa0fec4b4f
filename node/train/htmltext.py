"""HTML pages to plain text with the standard library's html.parser, for corpora of documentation:
the page's main content only (no scripts, styles, navigation, search boxes, footers or permalinks).

Deterministic: the same page gives the same text on every run (html.parser is Python's own, so another
Python version could in principle read a page otherwise: a corpus's sha256 tells). Block elements end
lines, `<pre>` keeps its spacing, table cells are joined by " | ", any other run of white space is one space."""

from __future__ import annotations

import html.parser
import re

__all__ = ["html_to_text"]

# Elements whose content is never text a reader would read as the page's prose.
SKIP_TAGS = frozenset({"script", "style", "noscript", "template", "nav", "header", "footer", "form",
                       "button", "select", "textarea", "svg", "math", "head", "title", "iframe", "object"})
SKIP_ROLES = frozenset({"navigation", "search", "contentinfo", "banner"})
SKIP_CLASSES = frozenset({"headerlink", "sphinxsidebar", "related", "footer", "rst-footer-buttons",
                          "wy-nav-side", "toctree-wrapper", "breadcrumbs"})
BLOCK_TAGS = frozenset({"p", "div", "section", "article", "main", "aside", "blockquote", "pre", "table",
                        "tr", "ul", "ol", "li", "dl", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6",
                        "br", "hr", "figure", "figcaption", "caption", "details", "summary", "address"})
VOID_TAGS = frozenset({"br", "hr", "img", "meta", "link", "input", "area", "base", "col", "embed",
                       "source", "track", "wbr", "param"})
PARAGRAPH_TAGS = frozenset({"p", "pre", "blockquote", "table", "ul", "ol", "dl", "h1", "h2", "h3", "h4",
                            "h5", "h6", "figure", "section", "article", "hr"})  # a blank line around them
CELL_TAGS = frozenset({"td", "th"})
_SPACE = re.compile(r"[ \t\r\n\f\v]+")


class _Text:
    """Text being written: spaces collapsed outside <pre>, at most one blank line between blocks,
    table cells on one line between " | "."""

    def __init__(self):
        self.parts: list[str] = []
        self.newlines = 2  # newlines at the end so far (the start counts as after a blank line)
        self.sep = ""  # owed before the next word: "", a space, or a cell separator

    def words(self, data: str) -> None:
        data = _SPACE.sub(" ", data)
        core = data.strip(" ")
        if not core:
            self.sep = self.sep or data
            return
        sep = self.sep or data[:1] if data.startswith(" ") else self.sep
        if sep and not self.newlines:
            self.parts.append(sep)
        self.parts.append(core)
        self.newlines, self.sep = 0, (" " if data.endswith(" ") else "")

    def verbatim(self, data: str) -> None:
        data = data.replace("\r\n", "\n")
        if data:
            self.parts.append(data)
            stripped = data.rstrip("\n")
            self.newlines = len(data) - len(stripped) if stripped else self.newlines + len(data)
            self.sep = ""

    def cell(self) -> None:
        """A new table cell: " | " before its first word, unless it starts the row."""
        self.sep = " | "

    def brk(self, lines: int) -> None:
        """Ends the line (lines=1) or the paragraph (lines=2)."""
        if self.newlines < lines:
            self.parts.append("\n" * (lines - self.newlines))
            self.newlines = lines
        self.sep = ""

    def text(self) -> str:
        text = "\n".join(line.rstrip() for line in "".join(self.parts).split("\n")).strip("\n")
        return text + "\n" if text else ""


class _Extractor(html.parser.HTMLParser):
    """Collects the text of the whole page and, separately, of the first element whose role is main."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool, bool]] = []  # (tag, skipped, opened main) per open element
        self.skip = 0  # depth of open elements being skipped
        self.pre = 0  # depth of open <pre> elements
        self.cells = 0  # depth of open table cells
        self.in_main = False
        self.main_done = False
        self.page, self.main = _Text(), _Text()

    def _outputs(self) -> tuple[_Text, ...]:
        return (self.page, self.main) if self.in_main else (self.page,)

    def _break(self, tag: str) -> None:
        """The line, paragraph or cell break an element's start or end makes (inside a table cell,
        blocks are run together: a cell's paragraphs are one line)."""
        if self.skip:
            return
        for out in self._outputs():
            if tag in CELL_TAGS:
                out.cell()
            elif tag == "tr":
                out.brk(1)
            elif tag in BLOCK_TAGS and self.cells:
                out.sep = out.sep or " "
            elif tag in BLOCK_TAGS:
                out.brk(2 if tag in PARAGRAPH_TAGS else 1)

    def handle_starttag(self, tag, attrs):
        a = {k: (v or "") for k, v in attrs}
        self._break(tag)
        if tag in VOID_TAGS:
            return
        skipped = (tag in SKIP_TAGS or a.get("role", "") in SKIP_ROLES
                   or bool(SKIP_CLASSES.intersection(a.get("class", "").split())) or "hidden" in a)
        opened_main = ((a.get("role") == "main" or tag == "main") and not self.in_main
                       and not self.main_done and not self.skip and not skipped)
        self.in_main = self.in_main or opened_main
        self.stack.append((tag, skipped, opened_main))
        self.skip += skipped
        self.pre += tag == "pre"
        self.cells += tag in CELL_TAGS

    def handle_startendtag(self, tag, attrs):
        self._break(tag)

    def handle_endtag(self, tag):
        if tag in VOID_TAGS or not any(t == tag for t, _, _ in self.stack):
            return  # a stray end tag: ignored, as browsers do
        while self.stack:  # close whatever was left open inside it
            t, skipped, opened_main = self.stack.pop()
            self.skip -= skipped
            self.pre -= t == "pre"
            self.cells -= t in CELL_TAGS
            self._break(t)
            if opened_main:
                self.in_main, self.main_done = False, True
            if t == tag:
                break

    def handle_data(self, data):
        if self.skip:
            return
        for out in self._outputs():
            out.verbatim(data) if self.pre else out.words(data)


def html_to_text(page: str) -> str:
    """The readable text of an HTML page: the content of its main element (role="main" or <main>)
    when it has one, else of the whole page, without scripts, styles, navigation and permalinks.
    Ends with one newline; a page without text gives the empty string."""
    parser = _Extractor()
    parser.feed(page)
    parser.close()
    return (parser.main if parser.main_done or parser.in_main else parser.page).text()
