"""The coordinator's durable state in SQLite (WAL; every write outlives a crash of the process, kill -9
included, and all but the last ones a crash of the machine) in the run's store folder:
the ledger of committed steps of every pipeline (loss, samples, wall time), the membership epoch,
the node identities (node id -> public key), the bans and who holds each stage of each pipeline, so
that a coordinator restarted after a crash goes on where it was: the holders keep their stages,
the others rejoin by themselves."""

from __future__ import annotations

import secrets
import sqlite3
from array import array
from pathlib import Path

from ..proto import tahnode_pb2 as pb

__all__ = ["SwarmDB", "MAX_IDENTITIES", "run_identity"]

MAX_IDENTITIES = 65536  # node id -> key bindings kept (the oldest of gone nodes dropped past it)


def run_identity(folder: Path) -> str:
    """The run's id: random when the run starts, kept in its store folder so that a restarted
    coordinator goes on with the same run (every seal and frame of the swarm names it)."""
    path = folder / "run-id"
    if path.exists():
        return path.read_text().strip()
    folder.mkdir(parents=True, exist_ok=True)
    run_id = secrets.token_hex(8)
    path.write_text(run_id + "\n")
    return run_id

SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger (pipeline INTEGER NOT NULL, step INTEGER NOT NULL, loss REAL, seconds REAL NOT NULL,
                                   sample_ids BLOB NOT NULL, PRIMARY KEY (pipeline, step));
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS identities (node_id TEXT PRIMARY KEY, public_key BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS holders (pipeline INTEGER NOT NULL, stage INTEGER NOT NULL, node_id TEXT NOT NULL,
                                    address TEXT NOT NULL, device TEXT NOT NULL, tls_cert BLOB NOT NULL,
                                    PRIMARY KEY (pipeline, stage));
CREATE TABLE IF NOT EXISTS bans (mark TEXT PRIMARY KEY, until REAL NOT NULL);
"""


def _loss(stored: float | None) -> float:
    """A loss as read back: SQLite keeps NaN as NULL."""
    return float("nan") if stored is None else stored


class SwarmDB:
    """One SQLite file; every write is its own transaction, in the file (WAL) when the call returns."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # WAL: no fsync per write (a join cost 1.6 ms of fsync)
        self.db.executescript(SCHEMA)
        if "skipped" not in {row[1] for row in self.db.execute("PRAGMA table_info(ledger)")}:  # a store from before it
            self.db.execute("ALTER TABLE ledger ADD COLUMN skipped INTEGER NOT NULL DEFAULT 0")
        self.saved_holders: list | None = None
        self.ledger_version = 0  # bumps with every write to the ledger (a cached ledger document is stale then)

    def ledger(self) -> dict[int, dict[int, pb.LossPoint]]:
        """pipeline -> step -> its committed step."""
        out: dict[int, dict[int, pb.LossPoint]] = {}
        rows = self.db.execute("SELECT pipeline, step, loss, seconds, sample_ids, skipped FROM ledger "
                               "ORDER BY pipeline, step")
        for pipeline, step, loss, seconds, ids, skipped in rows:
            out.setdefault(pipeline, {})[step] = pb.LossPoint(step=step, loss=_loss(loss), seconds=seconds,
                                                              sample_ids=array("Q", ids).tolist(),
                                                              skipped=bool(skipped))
        return out

    def pipelines(self) -> list[int]:
        """The pipelines the ledger has steps of."""
        return [p for (p,) in self.db.execute("SELECT DISTINCT pipeline FROM ledger ORDER BY pipeline")]

    def losses(self, last: int, pipeline: int = 0) -> dict[int, float]:
        """The losses of the `last` most recent steps of a pipeline (what the status page draws)."""
        rows = self.db.execute("SELECT step, loss FROM ledger WHERE pipeline = ? AND NOT skipped ORDER BY step DESC "
                               "LIMIT ?", (pipeline, last))
        return {step: _loss(loss) for step, loss in sorted(rows)}

    def record(self, points: list[pb.LossPoint], pipeline: int = 0) -> None:
        """Store committed steps of a pipeline in order, each replacing the step it names and every
        later one of that pipeline (after a rollback those are trained again), in one transaction."""
        self.ledger_version += 1
        with self.db:
            self.db.execute("BEGIN")
            for p in points:
                self.db.execute("DELETE FROM ledger WHERE pipeline = ? AND step >= ?", (pipeline, p.step))
                self.db.execute("INSERT INTO ledger VALUES (?, ?, ?, ?, ?, 0)",
                                (pipeline, p.step, p.loss, p.seconds, array("Q", p.sample_ids).tobytes()))

    def record_skipped(self, points: list[pb.LossPoint], pipeline: int = 0) -> None:
        """Steps a pipeline skipped on purpose (it took a newer replica's state), with the samples they would
        have trained and no loss, where the ledger has none of them yet; never in place of a trained step."""
        if not points:
            return
        self.ledger_version += 1
        with self.db:
            self.db.execute("BEGIN")
            for p in points:
                self.db.execute("INSERT OR IGNORE INTO ledger VALUES (?, ?, NULL, 0, ?, 1)",
                                (pipeline, p.step, array("Q", p.sample_ids).tobytes()))

    def identities(self) -> dict[str, bytes]:
        return dict(self.db.execute("SELECT node_id, public_key FROM identities"))

    def bind(self, node_id: str, public_key: bytes) -> None:
        self.db.execute("INSERT INTO identities VALUES (?, ?)", (node_id, public_key))

    def forget_oldest(self, bound: dict[str, bytes], keep) -> list[str]:
        """Past MAX_IDENTITIES bindings, drop the oldest (of ids not in `keep`, the live records) and
        return their ids. Bindings outlive their nodes' records: an id whose node left was free to
        anyone 600 s later, and the node could not rejoin under it (issue 39, finding 7)."""
        excess = len(bound) - MAX_IDENTITIES
        if excess <= 0:
            return []
        oldest = [i for (i,) in self.db.execute("SELECT node_id FROM identities ORDER BY rowid")
                  if i not in keep][:excess]
        self.db.executemany("DELETE FROM identities WHERE node_id = ?", [(i,) for i in oldest])
        return oldest

    def bans(self) -> dict[str, float]:
        """Ban mark -> when it ends (wall clock), for the bans not over yet."""
        return dict(self.db.execute("SELECT mark, until FROM bans"))

    def ban(self, marks: dict[str, float]) -> None:
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany("INSERT OR REPLACE INTO bans VALUES (?, ?)", list(marks.items()))

    def holders(self) -> list[tuple[int, int, str, str, str, bytes]]:
        """(pipeline, stage, node id, address, device, TLS certificate) of every stage's holder when last saved."""
        return list(self.db.execute("SELECT pipeline, stage, node_id, address, device, tls_cert FROM holders "
                                    "ORDER BY pipeline, stage"))

    def set_holders(self, rows: list[tuple[int, int, str, str, str, bytes]]) -> None:
        """Replace the saved holders by `rows`, in one transaction (none if they are those saved last)."""
        if rows == self.saved_holders:
            return
        self.saved_holders = rows
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("DELETE FROM holders")
            self.db.executemany("INSERT OR REPLACE INTO holders VALUES (?, ?, ?, ?, ?, ?)", rows)

    def get(self, key: str, default: int) -> int:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def put(self, key: str, value: int) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def close(self) -> None:
        self.db.close()
