"""Helper processes (the libp2p daemon, the DHT's process) end with the process that started them,
however it ends: a small watcher, told their pids through a pipe, terminates them when its parent
is gone (exited, cleanly or killed with SIGKILL: the watcher is re-parented) or closes the pipe."""

from __future__ import annotations

import subprocess
import sys

__all__ = ["Reaper"]

# The watcher: read pids until EOF or its parent's end, then SIGTERM them, and SIGKILL what is left 3 s later.
WATCHER = r"""
import os, select, signal, sys, time
parent, pids, buf = os.getppid(), [], b""
while os.getppid() == parent:  # a forked child may hold the pipe too: the parent's end is its exit, or EOF
    ready, _, _ = select.select([0], [], [], 0.5)
    if ready:
        chunk = os.read(0, 4096)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        pids += [int(x) for x in lines if x.strip().isdigit()]
for sig, pause in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 0.0)):
    alive = []
    for pid in pids:
        try:
            os.kill(pid, sig)
            alive.append(pid)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + pause
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    pids = alive
"""


class Reaper:
    """`watch(pid)`: that process is terminated when this one ends (or `release()` is called)."""

    def __init__(self):
        # its own session: a Ctrl-C or a signal to this process group must not end the watcher first
        self.proc = subprocess.Popen([sys.executable, "-c", WATCHER], stdin=subprocess.PIPE, start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def watch(self, pid: int) -> None:
        self.proc.stdin.write(f"{pid}\n".encode())
        self.proc.stdin.flush()

    def release(self) -> None:
        """End the watched processes now (those still alive) and the watcher."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
