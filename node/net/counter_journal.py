"""The replay guard's counters on disk, written ahead of what they guard: a counter that raises a
sender's highest is appended to a journal before the message it seals is accepted, and a snapshot of
the guard's bounded table replaces the journals every SAVE_S, written by a thread of its own.

Why this is enough: a journal line is one short write(2) with the file opened for appending, in the
kernel's page cache when `append` returns, so a restarted receiver (after kill -9 too) reads every
counter it accepted before; only a crash of the machine may lose the last lines, as it may the
coordinator's SQLite writes (durable.SwarmDB), and the snapshot is fsynced before it replaces
anything. The event loop pays one small write per accepted seal that raises its sender's highest
counter (a few microseconds, no fsync, no waiting for a batch); the snapshot (bounded as the tables
are: under 200 KB for a thousand senders, at most about 2 MB a table under a flood of made-up ones,
most of it eviction floors) is encoded and written off it, only when the journal has grown.

Files, all owner-only: `<store>` (the snapshot), `<store>.<tag>-<n>.journal` (the journals; `tag` is
random per process). Each line is JSON: `[sender, counter]`, or `{"evicted": {table: {"salt": hex,
"floors": [[bucket, floor], ...]}}}` (some of a table's eviction floors, tahnode.net.sender_table); the
older one-object form `{sender: counter, ...}` still reads. Lines that do not parse are skipped."""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
from array import array
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("tahnode.auth")

__all__ = ["SAVE_S", "CounterJournal", "Remembered"]

SAVE_S = 2.0        # how often the journals are folded into a snapshot (when they grew)
CHUNK_LINES = 512   # snapshot lines encoded at a time (the writer thread lets the event loop run between)


class Remembered:
    """What the files hold: each sender's highest counter, and each table's eviction floors (its salt,
    and the floor of each bucket that was still on the clock)."""

    def __init__(self) -> None:
        self.highs: dict[str, int] = {}
        self.floors: dict[str, tuple[bytes, dict[int, int]]] = {}

    def add(self, line: bytes) -> None:
        try:
            item = json.loads(line)
        except ValueError:
            return  # a line cut short by a crash, or damaged
        if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and type(item[1]) is int:
            self.highs[item[0]] = max(self.highs.get(item[0], 0), item[1])
        elif isinstance(item, dict):
            for key, value in item.items():
                if key == "evicted" and isinstance(value, dict):
                    for kind, kept in value.items():
                        self._floors(kind, kept)
                elif type(value) is int:  # the older form: one object of every sender's highest counter
                    self.highs[key] = max(self.highs.get(key, 0), value)


    def _floors(self, kind: str, kept) -> None:
        """Some of a table's eviction floors (a snapshot writes them a chunk to a line, each with the salt)."""
        try:
            salt, floors = bytes.fromhex(kept["salt"]), {int(b): int(f) for b, f in kept["floors"]}
        except (TypeError, KeyError, ValueError):
            return
        known, held = self.floors.setdefault(kind, (salt, {}))
        if known == salt:  # floors of another salt (another file) name other buckets: the first salt read wins
            for bucket, floor in floors.items():
                held[bucket] = max(held.get(bucket, 0), floor)


class CounterJournal:
    """The files of one guard's store: `load` once, then `append` each counter that raises a sender's
    highest, and `compact` from time to time (nothing blocks but `compact(wait=True)`)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tag, self.sequence = secrets.token_hex(4), 0
        self.journal = None          # the open journal, if any line went to it since the last compaction
        self.journal_path: Path | None = None
        self.folded: list[Path] = []  # journals read or written whose lines the next snapshot holds
        self.grown = False
        self.writer: threading.Thread | None = None
        self.failed: list[Path] = []  # journals a failed snapshot could not replace (its thread hands them back)
        self.lock = threading.Lock()

    def journals(self) -> list[Path]:
        return sorted(self.path.parent.glob(self.path.name + ".*.journal"))

    def load(self) -> Remembered:
        """What the snapshot and every journal beside it hold (OSError if the folder cannot be listed)."""
        found = Remembered()
        files = ([self.path] if self.path.exists() else []) + self.journals()
        for file in files:
            try:
                with open(file, "rb") as fh:
                    for line in fh:
                        found.add(line)
            except OSError as exc:
                log.warning("could not read the seal counters in %s (%s): going on without them", file, exc)
        self.folded = [f for f in files if f != self.path]
        return found

    def append(self, sender: str, counter: int) -> None:
        """Write `counter` of `sender` down before it is accepted (raises OSError)."""
        if self.journal is None:
            self.sequence += 1
            self.journal_path = self.path.with_name(f"{self.path.name}.{self.tag}-{self.sequence}.journal")
            fd = os.open(self.journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self.journal = open(fd, "ab", buffering=0)
        line = f"[{json.dumps(sender)}, {counter}]\n".encode()
        try:
            written = self.journal.write(line)
        except OSError:
            self._drop_journal()
            raise
        if written != len(line):  # a short write (the disk is full): the next line must not run on from it
            self._drop_journal()
            raise OSError(f"wrote {written} of {len(line)} bytes to {self.journal_path}")
        self.grown = True

    def _drop_journal(self) -> None:
        """Stop writing to the open journal (the next line starts another); it is read back like the others."""
        try:
            self.journal.close()
        except OSError:
            pass
        self.folded.append(self.journal_path)
        self.journal = None

    @property
    def writing(self) -> bool:
        return self.writer is not None and self.writer.is_alive()

    def compact(self, highs: dict[str, int], floors: dict[str, tuple[bytes, array | None]], horizon: int,
                wait: bool = False) -> bool:
        """Replace the journals by a snapshot of `highs` and of each table's eviction `floors` (salt and
        floors; those below `horizon` left out), copies the caller no longer changes, written by a
        thread; False, and nothing done, while the last one is still writing (its journals keep
        everything meanwhile), unless `wait`."""
        if self.writing:
            if not wait:
                return False
            self.writer.join()
        if self.journal is not None:
            self.journal.close()
            self.folded.append(self.journal_path)
            self.journal = None  # the next line starts a new journal, which this snapshot does not replace
        with self.lock:
            done, self.failed = self.folded + self.failed, []
        self.folded, self.grown = [], False
        self.writer = threading.Thread(target=self._write, args=(highs, floors, horizon, done), daemon=True,
                                       name="seal-counters")
        self.writer.start()
        if wait:
            self.writer.join()
        return True

    def _write(self, highs: dict[str, int], floors: dict[str, tuple[bytes, array | None]], horizon: int,
               done: list[Path]) -> None:
        """(thread) The snapshot, to a temp file, fsynced, in place of the old; then the journals it holds go."""
        tmp = self.path.with_name(f"{self.path.name}.{self.tag}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with open(fd, "wb") as fh:
                for kind, (salt, kept) in floors.items():  # the salt even without floors: it names the buckets
                    live = [[b, f] for b, f in enumerate(kept or ()) if f >= horizon]
                    for chunk in _chunks(live, CHUNK_LINES) if live else [[]]:
                        line = {"evicted": {kind: {"salt": salt.hex(), "floors": chunk}}}
                        fh.write((json.dumps(line) + "\n").encode())
                for chunk in _chunks(highs.items(), CHUNK_LINES):
                    fh.write("".join(f"[{json.dumps(s)}, {c}]\n" for s, c in chunk).encode())
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("could not write the seal counters to %s (%s): the journals keep them", self.path, exc)
            with self.lock:
                self.failed.extend(done)
            return
        for journal in done:
            try:
                journal.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("could not remove %s (%s): it is read again after a restart", journal, exc)


def _chunks(items: Iterable, size: int):
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
