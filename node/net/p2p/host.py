"""One process's place in the libp2p network, through hivemind: its p2p daemon (a `p2pd` child,
with a stable peer id kept in the state folder), the streams it serves and opens, and optionally a
hivemind DHT on the same daemon (tahnode.net.discovery). hivemind is imported only here, and only
when p2p is used; without it every entry point raises P2PUnavailable with how to install it.

A process has at most one P2PHost (`P2PHost.start` makes it the process's; `process_host()` gives
it, starting a dial-only one the first time a gRPC node must reach a p2p peer). A p2p address is a
comma-separated list of multiaddrs of one peer, each ending in /p2p/<peer id> (`P2PAddress`)."""

from __future__ import annotations

import asyncio
import errno
import logging
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from ...config.node import P2PSettings
from ..errors import P2PStartFailed, P2PUnavailable, PeerUnreachable
from ..reaper import Reaper

log = logging.getLogger("tahnode.p2p")

__all__ = ["P2PHost", "P2PAddress", "is_p2p_address", "process_host", "close_process_host", "use_swarm_key",
           "require_hivemind", "IDENTITY_FILE", "INSTALL_HINT"]

IDENTITY_FILE = "p2p.key"   # in the process's state folder: the same peer id across restarts
INSTALL_HINT = "the p2p transport needs hivemind: pip install 'tahnode[p2p]'"
CONNECT_TIMEOUT_S = 20.0    # how long a dial may take
DIRECT_TRY_S = 3.0          # how long to try a peer that names relays directly before going through one
DIRECT_RETRY_S = 60.0       # after such a try failed, go through its relays at once for this long
STARTUP_TIMEOUT_S = 15.0
DHT_JOIN_TIMEOUT_S = 60.0   # a DHT joined mid-run, by a busy process (a training stage): its start may take longer


def require_hivemind():
    """hivemind's P2P class (as tahnode starts it), or P2PUnavailable saying how to install it."""
    try:
        from hivemind.p2p import P2P
    except ImportError:
        raise P2PUnavailable(INSTALL_HINT) from None

    class StaticRelayP2P(P2P):
        """hivemind's P2P, but a daemon given trusted relays reserves a slot on them at once: with
        relay discovery on (p2pd's default, which hivemind cannot turn off) libp2p waits for four
        candidate relays, or three minutes, before it reserves any."""

        @staticmethod
        def _make_process_args(*args, **kwargs):
            if kwargs.get("trustedRelays"):
                kwargs["relayDiscovery"] = False
            return P2P._make_process_args(*args, **kwargs)

    return StaticRelayP2P


def to_multiaddr(text: str):
    """hivemind's Multiaddr of `text`, with each /p2p/<id> inside it encoded as the daemon reads it:
    hivemind's own encoder writes peer ids as CIDv1, which p2pd refuses in the middle of an address
    (a relay's id in /p2p/RELAY/p2p-circuit: "length greater than remaining number of bytes")."""
    import base58
    import varint
    from hivemind.utils.multiaddr import Multiaddr
    from hivemind.utils.multiaddr.protocols import protocol_with_name

    p2p_code = protocol_with_name("p2p").vcode

    parts = re.split(r"/p2p/([^/]+)", text)
    encoded = b""
    for k, part in enumerate(parts):
        if k % 2 == 0:
            encoded += Multiaddr(part).to_bytes() if part else b""
        else:
            digest = base58.b58decode(part)
            encoded += p2p_code + varint.encode(len(digest)) + digest
    return Multiaddr(encoded)


def is_p2p_address(address: str) -> bool:
    """True for a p2p address (multiaddrs), False for gRPC's HOST:PORT."""
    return address.startswith("/")


@dataclass(frozen=True)
class P2PAddress:
    peer_id: str
    maddrs: tuple[str, ...]

    @classmethod
    def parse(cls, address: str) -> "P2PAddress":
        maddrs = tuple(m.strip() for m in address.split(",") if m.strip())
        ids = {m.rsplit("/p2p/", 1)[-1] for m in maddrs if "/p2p/" in m}
        if not maddrs or len(ids) != 1 or not all("/p2p/" in m for m in maddrs):
            raise ValueError(f"{address!r} is not a p2p address: multiaddrs of one peer, each ending in /p2p/<peer id>")
        return cls(ids.pop(), maddrs)

    def __str__(self) -> str:
        return ",".join(self.maddrs)

    def dialable(self) -> list[str]:
        """The multiaddrs to dial, without the trailing /p2p/<id> (a bare /p2p/<id> gives none)."""
        return [m[: -len(f"/p2p/{self.peer_id}")] for m in self.maddrs if not m.startswith("/p2p/")]


def check_multiaddrs(maddrs: list[str], what: str, listen: bool = False) -> None:
    """P2PStartFailed for a multiaddr that does not parse, or (`listen`) a fixed TCP port another
    process holds (libp2p listens with SO_REUSEPORT: it would share the port silently, not fail)."""
    from hivemind.utils.multiaddr import Multiaddr

    for text in maddrs:
        try:
            maddr = Multiaddr(text)
        except Exception as exc:  # hivemind's multiaddr raises several kinds
            raise P2PStartFailed(f"{what} {text!r} is not a multiaddr ({exc})") from None
        protocols = [proto.name for proto in maddr.protocols()]
        if (listen and "tcp" in protocols and protocols[0] in ("ip4", "ip6")
                and int(maddr.value_for_protocol("tcp")) != 0):
            family = socket.AF_INET if protocols[0] == "ip4" else socket.AF_INET6
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind((maddr.value_for_protocol(protocols[0]), int(maddr.value_for_protocol("tcp"))))
                except OSError as exc:
                    reason = ("is taken by another process" if exc.errno == errno.EADDRINUSE
                              else f"cannot be used ({exc.strerror})")
                    raise P2PStartFailed(f"{what} {text}: the port {reason}") from None


def reachability(settings: P2PSettings) -> str | None:
    """What the daemon is told of its own reachability instead of waiting for AutoNAT (which needs
    many peers to conclude): a process that asks for a relay is behind NAT ("private"); one that
    announces its public addresses is reachable at them ("public"), and so relays for others."""
    if settings.use_auto_relay:
        return "private"
    return "public" if settings.announce else None


class P2PHost:
    """A running p2p daemon; see the module's docstring. `dht` is the hivemind DHT, if started."""

    _current: "P2PHost | None" = None
    swarm_key = None  # this process's SwarmKey (use_swarm_key): signs its relay requests, checks those it relays

    def __init__(self, p2p, reaper: Reaper, settings: P2PSettings):
        self.p2p, self.reaper, self.settings = p2p, reaper, settings
        self.dht = None
        self.peer_id = str(p2p.peer_id)
        self.relays = list(settings.initial_peers) if settings.use_auto_relay else []  # public peers that relay for it
        self.relayed_bytes = 0  # what this process relayed for others (tahnode.net.p2p.relay)
        self.direct_failed: dict[str, float] = {}  # peer id -> until when (monotonic) to go through its relays at once

    @classmethod
    async def start(cls, settings: P2PSettings, identity: Path | None = None, dht: bool = True,
                    dht_client: bool = False, dht_timeout: float = STARTUP_TIMEOUT_S) -> "P2PHost":
        """Start the daemon (and the DHT unless `dht` is False; `dht_client`: it stores nothing for
        others) and make it this process's host. P2PStartFailed within seconds if it cannot."""
        P2P = require_hivemind()
        check_multiaddrs(settings.listen, "--p2p-listen", listen=True)
        check_multiaddrs(settings.announce, "--announce")
        check_multiaddrs(settings.initial_peers, "--initial-peers")
        if identity is not None:
            identity.parent.mkdir(parents=True, exist_ok=True)
        if dht:  # its process is the forkserver's child: the forkserver starts while the p2p daemon does
            from ..clean_start import warm

            await asyncio.to_thread(warm)  # seconds under load: never on the event loop (a coordinator's heartbeats)
        reaper = Reaper()
        try:
            p2p = await P2P.create(initial_peers=settings.initial_peers or None, host_maddrs=settings.listen,
                                   announce_maddrs=settings.announce or None,
                                   identity_path=str(identity) if identity else None,
                                   use_relay=settings.use_relay, use_auto_relay=settings.use_auto_relay,
                                   force_reachability=reachability(settings),
                                   trusted_relays=(settings.initial_peers or None) if settings.use_auto_relay else None,
                                   startup_timeout=STARTUP_TIMEOUT_S, check_if_identity_free=False)
        except Exception as exc:  # hivemind's P2PDaemonError, or an OSError starting p2pd
            reaper.release()
            raise P2PStartFailed(f"the p2p daemon did not start: {exc}") from None
        if p2p._child is not None:
            reaper.watch(p2p._child.pid)
        host = cls(p2p, reaper, settings)
        try:
            if settings.announce and cls.swarm_key is not None:  # a public peer relays for those behind NAT
                from .relay import serve_relay

                await serve_relay(host, cls.swarm_key)
            if dht:
                await host._start_dht(dht_client, dht_timeout)
        except BaseException:
            await host.close()
            raise
        cls._current = host
        return host

    async def start_dht(self, initial_peers: list[str]) -> None:
        """Join the DHT of `initial_peers` on this daemon, if it has none yet (a node that learns
        only after joining that it needs one: to average with its stage's replicas)."""
        if self.dht is None:
            self.settings.initial_peers = list(initial_peers)
            await self._start_dht(client_mode=False, timeout=DHT_JOIN_TIMEOUT_S)

    async def _start_dht(self, client_mode: bool, timeout: float = STARTUP_TIMEOUT_S) -> None:
        from ..clean_start import CleanDHT
        from ..dht_auth import SwarmAuthorizer

        # members only: every DHT request and answer carries the swarm key's MAC (a process without a key,
        # such as a bare test host, runs an open DHT)
        authorizer = SwarmAuthorizer(self.swarm_key) if self.swarm_key is not None else None

        def start():  # the DHT's process, a forkserver's child (never forked from this one), shares this daemon
            return CleanDHT(p2p=self.p2p, initial_peers=self.settings.initial_peers or None, start=True,
                            client_mode=client_mode, await_ready=False, authorizer=authorizer)

        self.dht = await asyncio.to_thread(start)
        self.reaper.watch(self.dht.pid)
        try:
            await asyncio.to_thread(self.dht.wait_until_ready, timeout)
        except Exception as exc:
            raise P2PStartFailed(f"the DHT did not start (no initial peer answered?): {exc}") from None

    async def handle(self, name: str, handler) -> None:
        """Serve libp2p streams of protocol `name` with handler(stream_info, reader, writer)."""
        await self.p2p.add_binary_stream_handler(name, handler)

    async def connect(self, address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
        """Connect to the peer at `address` directly, not through a relay (an existing connection,
        even one the peer opened, will do); PeerUnreachable if none of its addresses answers."""
        from hivemind.p2p import PeerID

        target = P2PAddress.parse(address)
        direct = [to_multiaddr(m) for m in target.dialable() if "/p2p-circuit" not in m]
        try:
            await asyncio.wait_for(self.p2p._client.connect(PeerID.from_base58(target.peer_id), direct), timeout)
        except Exception as exc:
            raise PeerUnreachable(f"cannot reach {target.peer_id} at {address}: {exc or type(exc).__name__}") from None

    async def open_to(self, peer_id: str, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A new stream of protocol `name` to a peer this daemon can reach without new addresses
        (connected to it, or knowing where it is)."""
        from hivemind.p2p import PeerID

        try:
            _, reader, writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), name), CONNECT_TIMEOUT_S)
        except Exception as exc:
            raise PeerUnreachable(f"cannot open {name} to {peer_id}: {exc or type(exc).__name__}") from None
        return reader, writer

    async def open_direct(self, address: str, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        await self.connect(address)
        return await self.open_to(P2PAddress.parse(address).peer_id, name)

    async def open_stream(self, address: str, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A new stream of protocol `name` to the peer at `address`: directly if the peer can be
        reached so (or is connected to this one), else through each relay its address names in
        turn (tahnode.net.p2p.relay; libp2p's own relays carry too little)."""
        from .relay import open_relayed

        target = P2PAddress.parse(address)
        relays = [m.split("/p2p-circuit", 1)[0] for m in target.maddrs if "/p2p-circuit" in m]
        failure = PeerUnreachable(f"{address} names no address to dial")
        own = len(relays) < len(target.maddrs) or not relays  # it names addresses of its own: try them first
        if own and self.direct_failed.get(target.peer_id, 0.0) < time.monotonic():
            try:
                await self.connect(address, DIRECT_TRY_S if relays and P2PHost.swarm_key else CONNECT_TIMEOUT_S)
                return await self.open_to(target.peer_id, name)
            except PeerUnreachable as exc:
                if not relays or P2PHost.swarm_key is None:
                    raise
                self.direct_failed[target.peer_id] = time.monotonic() + DIRECT_RETRY_S
                failure = exc
        for relay in relays:
            try:
                return await open_relayed(self, relay, target.peer_id, name, P2PHost.swarm_key)
            except PeerUnreachable as exc:
                failure = exc
        raise failure

    async def maddrs(self, latest: bool = True) -> list[str]:
        """The multiaddrs others reach this process at: its announced ones if it has any, else the
        ones its daemon listens on, and through each of its relays (p2pd does not list those)."""
        seen = [str(m) for m in await self.p2p.get_visible_maddrs(latest=latest)]
        return [f"{relay}/p2p-circuit/p2p/{self.peer_id}" for relay in self.relays] + seen

    async def address(self) -> str:
        """This process's p2p address: relayed ones first (behind NAT the others are private), then
        routable ones, loopback last."""
        maddrs = await self.maddrs()
        return ",".join(sorted(maddrs, key=lambda m: ("p2p-circuit" not in m, "/127.0.0.1/" in m or "/::1/" in m)))

    async def wait_for_relay(self, timeout: float) -> bool:
        """Wait until the daemon is connected to one of its relays (it reserves a slot on each as it
        connects); False if none answered within `timeout` seconds."""
        ids = {P2PAddress.parse(relay).peer_id for relay in self.relays}
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            if ids & {str(info.peer_id) for info in await self.p2p.list_peers()}:
                await asyncio.sleep(1.0)  # the reservation follows the connection by a round trip or two
                return True
            await asyncio.sleep(0.5)
        return False

    async def close(self) -> None:
        if P2PHost._current is self:
            P2PHost._current = None
        if self.dht is not None:
            await asyncio.to_thread(self.dht.shutdown)
        await self.p2p.shutdown()
        self.reaper.release()


_dial_only_lock: asyncio.Lock | None = None


async def process_host() -> P2PHost:
    """This process's P2PHost; a gRPC process reaching its first p2p peer gets a dial-only one
    (no DHT, listening on a random local port)."""
    global _dial_only_lock
    if P2PHost._current is None:
        _dial_only_lock = _dial_only_lock or asyncio.Lock()
        async with _dial_only_lock:
            if P2PHost._current is None:
                log.info("starting a p2p daemon to reach p2p peers")
                await P2PHost.start(P2PSettings(), dht=False)
    return P2PHost._current


async def close_process_host() -> None:
    """Close this process's P2PHost, if it has one (at its end: a dial-only one has no other owner)."""
    if P2PHost._current is not None:
        await P2PHost._current.close()


def use_swarm_key(key) -> None:
    """The swarm key (tahnode.net.auth.SwarmKey) this process's DHT requests and answers and its p2p
    relay requests are signed and checked with; set before P2PHost.start."""
    P2PHost.swarm_key = key
