"""What a swarm keeps in the hivemind DHT, so that `tahnode join --initial-peers MULTIADDR` finds
everything else: the coordinator's addresses (kind "coordinator"), the layout of stages (kind
"layout"), and each node's stage, address and measured throughput (kind "node", one entry per
node). Every entry expires unless republished, and carries an HMAC with the swarm key: only token
holders write an entry that readers believe; other swarms sharing the DHT use other keys."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass

from ..proto import tahnode_pb2 as pb
from .auth import SwarmKey
from .errors import CoordinatorNotFound

log = logging.getLogger("tahnode.p2p")

__all__ = ["SwarmDirectory", "CoordinatorRecord", "republish", "COORDINATOR_KIND", "NODE_KIND", "LAYOUT_KIND", "REPUBLISH_S", "TTL_S"]

COORDINATOR_KIND, NODE_KIND, LAYOUT_KIND = "coordinator", "node", "layout"
TTL_S = 90.0        # an entry not republished for this long disappears
REPUBLISH_S = 20.0  # how often a process republishes its entries (and at once when one changed)
CHECK_S = 1.0       # how often it looks for changes


@dataclass
class CoordinatorRecord:
    """How nodes reach the coordinator: `grpc` (HOST:PORT, "" if it serves none), `p2p` (its p2p
    address, "" if none) and the fingerprint of its TLS certificate (for --coordinator-fingerprint)."""

    grpc: str = ""
    p2p: str = ""
    fingerprint: str = ""

    def address_for(self, p2p: bool) -> str:
        """The address a node of the given transport dials (the other kind if it is the only one)."""
        first, second = (self.p2p, self.grpc) if p2p else (self.grpc, self.p2p)
        return first or second


class SwarmDirectory:
    """The swarm's entries in a hivemind DHT (`dht`), under a prefix derived from the swarm key."""

    def __init__(self, dht, key: SwarmKey):
        self.dht, self.key = dht, key
        self.prefix = "tahnode/" + hashlib.sha256(b"directory\0" + key.key).hexdigest()[:24]

    async def publish(self, kind: str, name: str, fields: dict, ttl: float = TTL_S) -> bool:
        from hivemind.utils import get_dht_time

        expires = get_dht_time() + ttl
        record = self.key.sign(pb.DirectoryRecord(kind=kind, name=name, json=json.dumps(fields, sort_keys=True), expires=expires))
        return bool(await asyncio.to_thread(self.dht.store, f"{self.prefix}/{kind}", record.SerializeToString(), expires,
                                            subkey=name or kind))

    async def read(self, kind: str) -> dict[str, dict]:
        """Every live, authentic entry of `kind`: name -> fields (forged or expired ones are dropped)."""
        found = await asyncio.to_thread(self.dht.get, f"{self.prefix}/{kind}", True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        out = {}
        for name, item in entries.items():
            try:
                record = pb.DirectoryRecord.FromString(item.value)
            except Exception:  # not ours (a DecodeError, or not even bytes)
                continue
            if not self.key.verify(record) or record.kind != kind or record.expires < time.time() or (record.name or kind) != name:
                log.warning("dropped a DHT entry under %s/%s that is not authentic or has expired", kind, name)
                continue
            out[name] = json.loads(record.json)
        return out

    async def coordinator(self, timeout: float) -> CoordinatorRecord:
        """The coordinator's entry; CoordinatorNotFound if none appears within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            entries = await self.read(COORDINATOR_KIND)
            if COORDINATOR_KIND in entries:
                fields = entries[COORDINATOR_KIND]
                return CoordinatorRecord(**{k: fields.get(k, "") for k in ("grpc", "p2p", "fingerprint")})
            if time.monotonic() > deadline:
                raise CoordinatorNotFound(f"no coordinator of this swarm in the DHT after {timeout:.0f} s (is it running with "
                                          "--transport p2p or both, and does this node hold the same swarm token?)")
            await asyncio.sleep(1.0)


async def republish(directory: SwarmDirectory, entries, stop: asyncio.Event, volatile: tuple[str, ...] = ()) -> None:
    """Keep what `entries()` returns ([(kind, name, fields)]) published until `stop`: each entry at
    once when it changed (fields named in `volatile` aside), and every REPUBLISH_S seconds anyway."""
    published: dict[tuple[str, str], tuple[float, dict]] = {}
    while not stop.is_set():
        now = time.monotonic()
        for kind, name, fields in entries():
            steady = {k: v for k, v in fields.items() if k not in volatile}
            when, before = published.get((kind, name), (0.0, None))
            if before == steady and now - when < REPUBLISH_S:
                continue
            try:
                await directory.publish(kind, name, fields)
                published[(kind, name)] = (now, steady)
            except Exception as exc:  # the DHT being briefly unreachable must not end the process
                log.warning("could not publish %s %s in the DHT: %s", kind, name, exc)
        try:
            await asyncio.wait_for(stop.wait(), CHECK_S)
        except asyncio.TimeoutError:
            pass
