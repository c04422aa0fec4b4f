"""A node whose heartbeats stopped is looked at before its heartbeat timeout: when nothing listens at its data-plane
address any more (the connection is refused there, where the coordinator reached it before), its process is gone,
and it is failed at once rather than heartbeat_timeout s later. A node that stalls (stopped, starved) still
accepts connections, its kernel answering for it: only the timeout fails it, as before."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from enum import Enum
from typing import Awaitable, Callable

from .state import NodeRecord

log = logging.getLogger("tahnode.coordinator")

__all__ = ["GoneWatch", "tcp_endpoint", "connect", "Reach", "SILENT_PERIODS"]

SILENT_PERIODS = 2.5     # heartbeat periods without one before the coordinator looks at a node's address
CONNECT_TIMEOUT_S = 1.0  # a look that takes longer proves nothing (a slow link, a filtered port)
LOOK_EVERY_S = 0.5
REACH_AGAIN_S = 30.0     # between two tries to reach an address not reached yet (one behind NAT never is)


class Reach(Enum):
    """What a connection to an address found."""

    OPEN = "open"          # something listens there
    REFUSED = "refused"    # nothing does: the host answered, the port is closed
    UNKNOWN = "unknown"    # no answer in time, or another error: proves nothing


def tcp_endpoint(address: str) -> tuple[str, int] | None:
    """(ip, port) of an "ip:port" or "[v6]:port" address; None for any other: a p2p node's, or a host name (its
    lookup would hold one of the event loop's executor threads, which placement's probes use too)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        return str(ipaddress.ip_address(host.strip("[]"))), int(port)
    except ValueError:
        return None


async def connect(host: str, port: int, timeout: float) -> Reach:
    """Open a TCP connection to host:port and close it at once: what it found."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except ConnectionRefusedError:
        return Reach.REFUSED
    except (OSError, asyncio.TimeoutError):
        return Reach.UNKNOWN
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return Reach.OPEN


Connect = Callable[[str, int, float], Awaitable[Reach]]


class GoneWatch:
    """Every LOOK_EVERY_S: a live node's address is reached once (the proof that a refusal there later is its own);
    a node silent for SILENT_PERIODS heartbeat periods is looked at once per silence, and failed (`registry.fail`)
    if its address, reached before, now refuses."""

    def __init__(self, registry, connect_to: Connect = connect):
        self.r, self.connect = registry, connect_to
        self.reached: dict[str, str] = {}     # node id -> the address a connection to it opened
        self.tried: dict[str, tuple[str, float]] = {}  # node id -> the address last tried (reached or not), when
        self.looked: dict[str, float] = {}    # node id -> the last_seen of the silence it was looked at in

    async def run(self) -> None:
        while True:
            await self.look()
            await asyncio.sleep(LOOK_EVERY_S)

    async def look(self) -> None:
        now, quiet = time.monotonic(), SILENT_PERIODS * self.r.heartbeat_period()
        live = [n for n in self.r.nodes.values() if n.status.live and tcp_endpoint(n.address) is not None]
        for gone in set(self.tried) - {n.node_id for n in live}:
            for seen in (self.reached, self.tried, self.looked):
                seen.pop(gone, None)
        silent = [n for n in live if now - n.last_seen > quiet]
        fresh = [n for n in live if n not in silent and self.reached.get(n.node_id) != n.address
                 and not self._tried_lately(n, now)]
        await asyncio.gather(*(self._reach(n) for n in fresh),
                             *(self._look_at(n) for n in silent if self.looked.get(n.node_id) != n.last_seen))

    def _tried_lately(self, node: NodeRecord, now: float) -> bool:
        address, when = self.tried.get(node.node_id, ("", 0.0))
        return address == node.address and now - when < REACH_AGAIN_S

    async def _reach(self, node: NodeRecord) -> None:
        self.tried[node.node_id] = (node.address, time.monotonic())
        if await self.connect(*tcp_endpoint(node.address), CONNECT_TIMEOUT_S) is Reach.OPEN:
            self.reached[node.node_id] = node.address

    async def _look_at(self, node: NodeRecord) -> None:
        seen, address = node.last_seen, node.address
        self.looked[node.node_id] = seen
        if self.reached.get(node.node_id) != address:
            return  # never reached there: a refusal could be another host's (a private address seen from afar)
        found = await self.connect(*tcp_endpoint(address), CONNECT_TIMEOUT_S)
        if found is Reach.REFUSED and node.status.live and node.last_seen == seen and self.r.nodes.get(
                node.node_id) is node:
            self.r.fail(node, f"stopped its heartbeats {time.monotonic() - seen:.1f} s ago and its address "
                              f"{address} refuses connections: its process is gone")
