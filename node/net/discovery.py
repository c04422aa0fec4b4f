"""What a swarm keeps in the hivemind DHT, so that `tahnode join --initial-peers MULTIADDR` finds
everything else: the coordinator's addresses (kind "coordinator"), the layout of stages (kind
"layout"), and each node's stage, address and measured throughput (kind "node", one entry per
node). Every entry expires unless republished (none may claim to live longer than TTL_S), and
carries an HMAC with the swarm key: only token holders write an entry that readers believe; other
swarms sharing the DHT use other keys. Every token holder could claim to be the coordinator, so its
entry is also signed by its TLS certificate's key, under that certificate's fingerprint: a joiner
takes the entry of the fingerprint it was given, and without one refuses to choose among several."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass

from ..proto import tahnode_pb2 as pb
from .auth import SwarmKey
from .errors import CoordinatorNotFound, UntrustedCoordinator
from .tls import TlsCertificate, fingerprint, signed_by

log = logging.getLogger("tahnode.p2p")

__all__ = ["SwarmDirectory", "CoordinatorRecord", "republish", "COORDINATOR_KIND", "NODE_KIND", "LAYOUT_KIND",
           "REPUBLISH_S", "TTL_S"]

COORDINATOR_KIND, NODE_KIND, LAYOUT_KIND = "coordinator", "node", "layout"
TTL_S = 90.0        # an entry not republished for this long disappears
REPUBLISH_S = 20.0  # how often a process republishes its entries (and at once when one changed)
CHECK_S = 1.0       # how often it looks for changes
CLOCK_SLACK_S = 60.0  # a writer's clock may run this much ahead of a reader's


@dataclass
class CoordinatorRecord:
    """How nodes reach the coordinator: `grpc` (HOST:PORT, "" if it serves none), `p2p` (its p2p
    address, "" if none) and the fingerprint of its TLS certificate (for --coordinator-fingerprint)."""

    grpc: str = ""
    p2p: str = ""
    fingerprint: str = ""
    certificate: bytes = b""  # the PEM that signed the entry (a node that trusts it on first use keeps it)

    def address_for(self, p2p: bool) -> str:
        """The address a node of the given transport dials (the other kind if it is the only one)."""
        first, second = (self.p2p, self.grpc) if p2p else (self.grpc, self.p2p)
        return first or second


def record_signed_part(record: pb.DirectoryRecord) -> bytes:
    """What a coordinator entry's signature covers: the record with empty mac and signature."""
    part = pb.DirectoryRecord()
    part.CopyFrom(record)
    part.mac, part.signature = b"", b""
    return b"DirectoryRecord\0" + part.SerializeToString(deterministic=True)


class SwarmDirectory:
    """The swarm's entries in a hivemind DHT (`dht`), under a prefix derived from the swarm key."""

    def __init__(self, dht, key: SwarmKey):
        self.dht, self.key = dht, key
        self.prefix = "tahnode/" + hashlib.sha256(b"directory\0" + key.key).hexdigest()[:24]

    async def publish(self, kind: str, name: str, fields: dict, ttl: float = TTL_S,
                      signer: TlsCertificate | None = None) -> bool:
        """Store an entry; with `signer`, signed by its certificate's key and kept under its fingerprint
        (so that another writer's entry of the same kind never replaces it)."""
        from hivemind.utils import get_dht_time

        expires = get_dht_time() + ttl
        record = pb.DirectoryRecord(kind=kind, name=name, json=json.dumps(fields, sort_keys=True), expires=expires)
        if signer is not None:
            record.certificate = signer.cert_pem
            record.signature = signer.sign(record_signed_part(record))
            name = signer.fingerprint
        self.key.sign(record)
        return bool(await asyncio.to_thread(self.dht.store, f"{self.prefix}/{kind}", record.SerializeToString(),
                                            expires, subkey=name or kind))

    async def records(self, kind: str) -> dict[str, pb.DirectoryRecord]:
        """Every live, authentic entry of `kind` by its subkey (forged, expired or far-future ones dropped)."""
        found = await asyncio.to_thread(self.dht.get, f"{self.prefix}/{kind}", True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        out, now = {}, time.time()
        for name, item in entries.items():
            try:
                record = pb.DirectoryRecord.FromString(item.value)
            except Exception:  # not ours (a DecodeError, or not even bytes)
                continue
            if (not self.key.verify(record) or record.kind != kind
                    or not now <= record.expires <= now + TTL_S + CLOCK_SLACK_S):
                log.warning("dropped a DHT entry under %s/%s that is not authentic, has expired or claims to "
                            "live too long", kind, name)
                continue
            out[name] = record
        return out

    async def read(self, kind: str) -> dict[str, dict]:
        """Every live, authentic entry of `kind`: name -> fields."""
        return {name: json.loads(r.json) for name, r in (await self.records(kind)).items() if (r.name or kind) == name}

    async def coordinators(self) -> dict[str, CoordinatorRecord]:
        """The coordinator entries signed by the certificate they carry: fingerprint -> record."""
        out = {}
        for name, record in (await self.records(COORDINATOR_KIND)).items():
            if not record.certificate or not signed_by(record.certificate, record_signed_part(record),
                                                       record.signature):
                log.warning("dropped a coordinator entry in the DHT that its certificate does not sign")
                continue
            seen = fingerprint(record.certificate)
            fields = json.loads(record.json)
            if name != seen or fields.get("fingerprint", "") != seen:
                log.warning("dropped a coordinator entry in the DHT filed under another certificate's name")
                continue
            out[seen] = CoordinatorRecord(**{k: fields.get(k, "") for k in ("grpc", "p2p", "fingerprint")},
                                          certificate=record.certificate)
        return out

    async def coordinator(self, timeout: float, pin: str = "") -> CoordinatorRecord:
        """The coordinator's entry: the one signed by the certificate `pin` (a fingerprint) names, or
        without a pin the only one there is. CoordinatorNotFound if none appears within `timeout`
        seconds; UntrustedCoordinator if, unpinned, several certificates claim the swarm."""
        deadline, pin = time.monotonic() + timeout, pin.strip().lower()
        while True:
            found = await self.coordinators()
            if pin and pin in found:
                return found[pin]
            if not pin and len(found) > 1:
                raise UntrustedCoordinator(f"{len(found)} certificates claim to be this swarm's coordinator in the DHT "
                                           f"({', '.join(sorted(found))}): pass --coordinator-fingerprint with the one "
                                           "the coordinator printed (`tahnode certs` on its machine shows it)")
            if not pin and found:
                return next(iter(found.values()))
            if time.monotonic() > deadline:
                which = f" signed by {pin}" if pin else ""
                raise CoordinatorNotFound(f"no coordinator of this swarm{which} in the DHT after {timeout:.0f} s (is "
                                          "it running with --transport p2p or both, and does this node hold the same "
                                          "swarm token?)")
            await asyncio.sleep(1.0)


async def republish(directory: SwarmDirectory, entries, stop: asyncio.Event, volatile: tuple[str, ...] = (),
                    signer: TlsCertificate | None = None) -> None:
    """Keep what `entries()` returns ([(kind, name, fields)]) published until `stop`: each entry at
    once when it changed (fields named in `volatile` aside), and every REPUBLISH_S seconds anyway;
    the coordinator's own entry signed by `signer`."""
    published: dict[tuple[str, str], tuple[float, dict]] = {}
    while not stop.is_set():
        now = time.monotonic()
        for kind, name, fields in entries():
            steady = {k: v for k, v in fields.items() if k not in volatile}
            when, before = published.get((kind, name), (0.0, None))
            if before == steady and now - when < REPUBLISH_S:
                continue
            try:
                await directory.publish(kind, name, fields, signer=signer if kind == COORDINATOR_KIND else None)
                published[(kind, name)] = (now, steady)
            except Exception as exc:  # the DHT being briefly unreachable must not end the process
                log.warning("could not publish %s %s in the DHT: %s", kind, name, exc)
        try:
            await asyncio.wait_for(stop.wait(), CHECK_S)
        except asyncio.TimeoutError:
            pass
