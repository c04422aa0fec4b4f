"""A daemon's libp2p side: whether it needs a p2p daemon at all, starting it (before CUDA and gRPC:
the DHT forks a process), finding the coordinator through the DHT when no --coordinator was given,
and what the node keeps published there about itself."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from ..config import DEFAULT_COORDINATOR, NodeConfig, TransportKind
from ..net.auth import SwarmKey
from ..net.discovery import NODE_KIND, SwarmDirectory
from ..net.errors import CoordinatorNotFound
from ..net.p2p.host import DHT_JOIN_TIMEOUT_S, IDENTITY_FILE, P2PAddress, P2PHost, is_p2p_address
from ..net.tls import fingerprint
from ..net.transport import FORWARD, Transport

log = logging.getLogger("tahnode.daemon")

__all__ = ["needs_p2p", "start_host", "averaging_host", "find_coordinator", "CoordinatorAddress", "node_entries",
           "RELAY_WAIT_S", "FIND_WAIT_S"]

RELAY_WAIT_S = 30.0   # how long a node behind NAT waits for a relay reservation before it joins anyway
FIND_WAIT_S = 60.0    # how long a node looks for the coordinator's entry in the DHT


def needs_p2p(cfg: NodeConfig) -> bool:
    """A p2p daemon from the start: p2p data plane, initial peers to find the swarm by, or a
    coordinator reached over p2p. (A gRPC node gets a dial-only one later if a neighbour is p2p.)"""
    return cfg.transport is TransportKind.P2P or bool(cfg.p2p.initial_peers) or is_p2p_address(cfg.coordinator)


async def start_host(cfg: NodeConfig, folder: Path) -> P2PHost:
    """The node's p2p daemon with its peer id kept in `folder`; it joins the DHT of its initial peers
    (given, or the coordinator's own multiaddrs), as a client only when it sits behind NAT."""
    peers = cfg.p2p.initial_peers or (list(P2PAddress.parse(cfg.coordinator).maddrs) if is_p2p_address(cfg.coordinator)
                                      else [])
    if cfg.p2p.use_auto_relay and not peers:
        raise ValueError("--use-auto-relay needs --initial-peers (public peers, such as the coordinator, that "
                         "relay for nodes behind NAT)")
    host = await P2PHost.start(dataclasses.replace(cfg.p2p, initial_peers=peers), identity=folder / IDENTITY_FILE,
                               dht=bool(peers), dht_client=cfg.p2p.use_auto_relay)
    if cfg.p2p.use_auto_relay and not await host.wait_for_relay(RELAY_WAIT_S):
        log.warning("none of the initial peers answered as a relay within %.0f s: peers outside this network may not "
                    "reach this node", RELAY_WAIT_S)
    return host


async def averaging_host(cfg: NodeConfig, folder: Path, dht_peers: list[str]) -> P2PHost:
    """This process's p2p daemon with a DHT joined to `dht_peers` (the coordinator's), for the
    replicas of a stage to find each other: the one it has (a DHT added to a dial-only one), else
    a new one on any port, its peer id kept in `folder`."""
    host = P2PHost._current
    if host is None:
        settings = dataclasses.replace(cfg.p2p, initial_peers=list(dht_peers))
        return await P2PHost.start(settings, identity=folder / IDENTITY_FILE, dht=True, dht_timeout=DHT_JOIN_TIMEOUT_S)
    await host.start_dht(list(dht_peers))
    return host


@dataclass
class CoordinatorAddress:
    address: str
    fingerprint: str = ""   # its TLS certificate, as the DHT entry (made with the swarm token) names it


async def find_coordinator(cfg: NodeConfig, host: P2PHost | None, key: SwarmKey,
                           remembered: Path | None = None) -> CoordinatorAddress:
    """--coordinator if given; else the coordinator's entry in the DHT (its p2p address for a p2p
    node, its gRPC one for a gRPC node, whichever it has); else DEFAULT_COORDINATOR. The entry is
    the one --coordinator-fingerprint pins, else the one of the certificate this node trusted before
    (`remembered`, its coordinator.crt), else the only one there is, trusted on first use and kept
    in `remembered`: a node that had joined took an insider's entry when it was the only one
    (issue 39, finding 11)."""
    if cfg.coordinator:
        return CoordinatorAddress(cfg.coordinator)
    if host is None or host.dht is None:
        return CoordinatorAddress(DEFAULT_COORDINATOR)
    known = remembered is not None and remembered.exists()
    pin = cfg.coordinator_fingerprint or (fingerprint(remembered.read_bytes()) if known else "")
    try:
        record = await SwarmDirectory(host.dht, key).coordinator(FIND_WAIT_S, pin=pin)
    except CoordinatorNotFound as exc:
        if known and not cfg.coordinator_fingerprint:
            raise CoordinatorNotFound(f"{exc}; this node trusted that certificate before (kept in {remembered}): if "
                                      "the coordinator really changed it, pin the new one with "
                                      "--coordinator-fingerprint or delete that file") from None
        raise
    if not pin and remembered is not None and record.certificate:
        log.warning("trusting the coordinator entry signed by %s on first use (kept in %s; pin it with "
                    "--coordinator-fingerprint, which the coordinator prints)", record.fingerprint, remembered)
        remembered.parent.mkdir(parents=True, exist_ok=True)
        remembered.write_bytes(record.certificate)
    address = record.address_for(p2p=cfg.transport is TransportKind.P2P)
    log.info("found the coordinator through the DHT at %s", address)
    return CoordinatorAddress(address, "" if is_p2p_address(address) else record.fingerprint)


def node_entries(node_id: str, transport: Transport, kind: TransportKind):
    """What a node keeps in the DHT: its stage, address, transport and the rate its forward link achieved."""
    def entries():
        sent = transport.counters(FORWARD) if transport.links else None
        mbps = sent.bytes * 8 / sent.seconds / 1e6 if sent and sent.seconds > 0 else None
        return [(NODE_KIND, node_id, {"stage": transport.stage, "address": transport.address, "transport": kind.value,
                                      "forward_mbps": mbps})]

    return entries
