"""A volunteer's folder (--checkpoint-dir, else tahnode-state/NODE_ID): its checkpoints, its node key (node.key) and,
beside the key, its node id (node-id), made on the first start and the same after every restart, so that the
coordinator sees the same node again; and a lock (daemon.lock), so that one daemon at a time runs from it.

`--node-id` names the node on its first start; later it must name the id the folder keeps (the coordinator bound that
id to the folder's key): another one is an error that says so, never a silent new identity."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

__all__ = ["NodeFolder", "FolderError", "NodeIdMismatch", "FolderInUse", "NODE_ID_FILE", "LOCK_FILE"]

NODE_ID_FILE = "node-id"
LOCK_FILE = "daemon.lock"
MAX_ID_CHARS = 128


class FolderError(RuntimeError):
    """The node's folder cannot be used as asked (the message says why and what to do)."""


class NodeIdMismatch(FolderError):
    """--node-id names another node than the one its folder keeps."""


class FolderInUse(FolderError):
    """Another daemon runs from the same folder."""


class NodeFolder:
    """The folder a daemon runs from, locked (a POSIX lock: the system drops it when the process ends, SIGKILL
    included, and a process it forks does not hold it) until `close()`; `node_id` is the id the folder keeps."""

    def __init__(self, path: Path, node_id: str, lock_fd: int):
        self.path, self.node_id, self._fd = path, node_id, lock_fd

    @classmethod
    def open(cls, checkpoint_dir: str = "", node_id: str = "") -> "NodeFolder":
        """Lock the folder, then read its node id, or keep `node_id` (default HOSTNAME-PID) there on a first
        start. NodeIdMismatch where `node_id` is given and the folder keeps another; FolderInUse where a daemon
        runs from it."""
        path = Path(checkpoint_dir) if checkpoint_dir else Path("tahnode-state") / (node_id or default_node_id())
        path.mkdir(parents=True, exist_ok=True)
        fd = _lock(path)
        try:
            kept = (path / NODE_ID_FILE).read_text().strip() if (path / NODE_ID_FILE).exists() else ""
            if len(kept) > MAX_ID_CHARS:
                raise FolderError(f"{path / NODE_ID_FILE} does not hold a node id (over {MAX_ID_CHARS} characters)")
            if kept and node_id and node_id != kept:
                raise NodeIdMismatch(
                    f"{path} is the folder of node {kept!r} (its {NODE_ID_FILE}, beside the key the coordinator bound "
                    f"to that id), not of {node_id!r}: start it without --node-id (or with --node-id {kept}) to be "
                    "that node again, or give a new node a folder of its own with --checkpoint-dir")
            chosen = kept or node_id or default_node_id()
            if not kept:
                temp = path / f".{NODE_ID_FILE}.{os.getpid()}"
                temp.write_text(chosen + "\n")
                temp.replace(path / NODE_ID_FILE)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, chosen, fd)

    def close(self) -> None:
        """Unlock the folder (a daemon that ends unlocks it anyway)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def default_node_id() -> str:
    """The id of a node started without --node-id on a folder that keeps none: this machine's name and the pid."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _lock(path: Path) -> int:
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            raise FolderInUse(f"another tahnode join{f' (pid {holder})' if holder.isdigit() else ''} runs from "
                              f"{path}: one daemon per folder (its node id and key are one node); stop that one "
                              "first, or give this one a folder of its own with --checkpoint-dir") from None
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
