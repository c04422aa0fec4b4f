"""What `tahnode bench coordinator` reads from outside the coordinator: CPU and memory of a process
tree from /proc, and GETs of its HTTP endpoints, polled from a process of their own."""

from __future__ import annotations

import os
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .workers import worker_pool

__all__ = ["stat_fields", "process_tree", "cpu_seconds", "memory_mb", "fetch", "EndpointLog", "poll_endpoints",
           "poller_pool", "POLL_S"]

POLL_S = 0.5
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through http_proxy


def stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat after the command name (state, ppid, ...), or None if the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        if (fields := stat_fields(entry)) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes used so far (those gone count 0)."""
    ticks = sum(int(f[11]) + int(f[12]) for f in map(stat_fields, pids) if f is not None)  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def memory_mb(pids: list[int], key: str) -> float:
    """Sum of a /proc/PID/status memory line (VmRSS, VmHWM) over the processes, in MB."""
    def kb(pid: int) -> int:
        try:
            return next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith(key + ":"))
        except (OSError, StopIteration):
            return 0

    return sum(map(kb, pids)) / 1024


def fetch(url: str, timeout: float = 10.0) -> tuple[float, bytes] | None:
    """(seconds to the last byte, body) of GET `url`, or None if it does not answer."""
    start = time.perf_counter()
    try:
        with _DIRECT.open(url, timeout=timeout) as r:
            body = r.read()
            return time.perf_counter() - start, body
    except OSError:
        return None


@dataclass
class EndpointLog:
    """Latency (ms) and size (KB) of each GET of one endpoint; `failed`: GETs without an answer."""

    url: str
    latencies_ms: list[float] = field(default_factory=list)
    sizes_kb: list[float] = field(default_factory=list)
    failed: int = 0

    def get(self) -> None:
        got = fetch(self.url)
        if got is None:
            self.failed += 1
        else:
            self.latencies_ms.append(got[0] * 1e3)
            self.sizes_kb.append(len(got[1]) / 1024)


def poll_endpoints(urls: list[str], seconds: float) -> list[EndpointLog]:
    """GET every URL each POLL_S for `seconds`. Run in a process of its own (poller_pool), so that
    its reads and JSON never slow the simulated volunteers' event loop, whose latencies count."""
    logs = [EndpointLog(url) for url in urls]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.monotonic()
        for log in logs:
            log.get()
        time.sleep(max(0.0, POLL_S - (time.monotonic() - started)))
    return logs


def poller_pool() -> ProcessPoolExecutor:
    """One worker process (spawned: this process has gRPC threads)."""
    return worker_pool(1)
