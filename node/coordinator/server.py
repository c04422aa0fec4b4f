"""`tahnode coordinator`: serves the Coordinator control plane (on gRPC, on libp2p, or both) and
the HTTP status side (`/`, `/api/v1/state`, `/metrics`, `/api/v1/ledger`), publishes itself and
the layout in the DHT when it speaks p2p, and places nodes, until interrupted."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import math
import signal
import sys
import time
from pathlib import Path

import grpc
from aiohttp import web

from ..config import CoordinatorConfig, RunConfig, TlsMode, TransportKind
from ..config.node import COORDINATOR_P2P_LISTEN, NODE_P2P_LISTEN
from ..net.auth import SwarmKey
from ..net.channels import ChannelPool
from ..net.discovery import COORDINATOR_KIND, LAYOUT_KIND, SwarmDirectory, republish
from ..net.p2p.host import IDENTITY_FILE, P2PHost, close_process_host, use_swarm_key
from ..net.grpc_transport import DIRECT
from ..net.p2p.rpc import serve_service
from ..net.probe import request_compute, request_measure
from ..net.tls import TlsCertificate, add_port, is_loopback, wants_tls
from ..net.unparsable import RefuseUnparsable
from ..proto import tahnode_pb2_grpc as pb_grpc
from .placement import Placement
from .probing import Measure
from .registry import SwarmRegistry
from .remeasure import MeasureCompute
from .service import CoordinatorServicer
from .state import NodeRecord
from .status_page import SwarmView, make_app
from .view import LedgerDocument, all_links, latest_on, swarm_state

log = logging.getLogger("tahnode.coordinator")

__all__ = ["serve", "http_app", "control_plane"]


class StateSnapshot:
    """The status documents' view, rebuilt every `max_age` seconds by `refresh` (a task of the
    coordinator): however many clients poll, none waits for a build, and the loop that also serves
    the control plane builds the (bounded) state once per interval."""

    def __init__(self, build, max_age: float = 1.0):
        self.build, self.max_age = build, max_age
        self.view = None

    def __call__(self) -> SwarmView:
        if self.view is None:
            self.view = self.build()
        return self.view

    async def refresh(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            view = self.build()
            self.view = await view.prepare() if hasattr(view, "prepare") else view
            try:
                await asyncio.wait_for(stop.wait(), self.max_age)
            except asyncio.TimeoutError:
                pass


def http_app(snapshot: StateSnapshot, registry: SwarmRegistry, placement: Placement) -> web.Application:
    app = make_app(snapshot, lambda offset, limit: all_links(registry, placement, offset, limit))
    ledger = LedgerDocument(registry)

    async def get_ledger(_request: web.Request) -> web.Response:
        return web.Response(body=await ledger.get(), content_type="application/json")

    app.router.add_get("/api/v1/ledger", get_ledger)
    return app


def control_plane(servicer: CoordinatorServicer) -> grpc.aio.Server:
    """The Coordinator gRPC service on a server of its own (no port yet)."""
    server = grpc.aio.server(interceptors=[RefuseUnparsable()])
    pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
    return server


def grpc_address(listen: str, p2p_maddrs: list[str]) -> str:
    """Where nodes reach the gRPC control plane: `listen`, its wildcard host replaced by the first
    routable IPv4 address the p2p daemon sees (the DHT record must name a reachable host)."""
    host, _, port = listen.rpartition(":")
    if host not in ("", "0.0.0.0", "[::]"):
        return listen
    seen = [m.split("/")[2] for m in p2p_maddrs if m.startswith("/ip4/") and not m.startswith("/ip4/127.")]
    return f"{seen[0] if seen else '127.0.0.1'}:{port}"


def directory_entries(registry: SwarmRegistry, record: dict):
    """What the coordinator keeps in the DHT: itself, and which node holds each stage (or held it
    last, once the run is over)."""
    def entries():
        layout = {"stages": registry.run.stages, "holders": {}}
        for stage in range(registry.run.stages):
            held = latest_on(registry, stage)
            if held is not None:
                layout["holders"][str(stage)] = {"node": held.node_id, "address": held.address}
        return [(COORDINATOR_KIND, "", record), (LAYOUT_KIND, "", layout)]

    return entries


async def start_p2p(cfg: CoordinatorConfig, servicer: CoordinatorServicer) -> P2PHost:
    """The coordinator's p2p daemon and DHT (before any gRPC server: the DHT forks a process), with
    the control plane on it."""
    host = await P2PHost.start(cfg.p2p, identity=Path(cfg.store) / IDENTITY_FILE)
    await serve_service(host, "Coordinator", servicer, servicer.r.sealer.key, servicer.r.identities)
    return host


async def dht_when_needed(registry: SwarmRegistry, cfg: CoordinatorConfig, p2p: P2PHost | None,
                          stop: asyncio.Event) -> None:
    """Once two pipelines train, the replicas of each stage find each other through a DHT: the
    coordinator's own (p2p transport), else one it starts then, on a port of its own (not the
    p2p control plane's); its multiaddrs go out with the assignments (Assignment.dht_peers)."""
    while not stop.is_set():
        if len(registry.roster.complete_pipelines()) > 1:
            host = p2p
            if host is None:
                listen = [NODE_P2P_LISTEN] if cfg.p2p.listen == [COORDINATOR_P2P_LISTEN] else cfg.p2p.listen
                settings = dataclasses.replace(cfg.p2p, listen=listen)
                host = await P2PHost.start(settings, identity=Path(cfg.store) / IDENTITY_FILE)
            registry.roster.dht_peers = (await host.address()).split(",")
            registry.event(f"pipelines train in data parallel: their replicas find each other through the DHT at "
                           f"{registry.roster.dht_peers[0]}")
            return
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


def measurer(registry: SwarmRegistry, pool: ChannelPool) -> Measure:
    async def measure(a: NodeRecord, b: NodeRecord, payload_bytes: int, timeout: float) -> tuple[float, float]:
        """Ask node a to measure its link to b over a's own data plane."""
        return await request_measure(registry.sealer, registry.peer(a), registry.peer(b), pool, payload_bytes, timeout)

    return measure


def compute_measurer(registry: SwarmRegistry, pool: ChannelPool) -> MeasureCompute:
    async def measure(node: NodeRecord, timeout: float) -> float:
        """Ask the node to measure its compute again (placement, before it refuses a chain for its speed)."""
        return await request_compute(registry.sealer, registry.peer(node), pool, timeout)

    return measure


def say_tls(cfg: CoordinatorConfig, tls: TlsCertificate | None) -> None:
    """Tell the operator how nodes reach the control plane: the certificate they pin, or a warning
    where it is plain gRPC off loopback."""
    if tls is not None:
        print(f"tahnode coordinator: TLS on, certificate {tls.fingerprint}; volunteers pin it with "
              f"--coordinator-fingerprint {tls.fingerprint} (else they trust the first one they see)", flush=True)
    elif cfg.tls is TlsMode.OFF and not is_loopback(cfg.listen):
        print("tahnode coordinator: warning: --insecure: the control plane on "
              f"{cfg.listen} is plain gRPC; run configs and checkpoints travel in clear", file=sys.stderr, flush=True)


async def until_stopped(work, stop: asyncio.Event) -> bool:
    """Run `work` to its end (True), or cancel it as soon as `stop` is set (False)."""
    task, stopper = asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if task.done():
        task.result()
        return True
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False


async def serve(run: RunConfig, cfg: CoordinatorConfig) -> None:
    key = SwarmKey(cfg.token)
    use_swarm_key(key)  # its p2p side relays for nodes behind NAT (when it announces), and reaches them through relays
    registry = SwarmRegistry(run, key, cfg.heartbeat_timeout, store_dir=cfg.store)
    channels = ChannelPool(DIRECT)
    placement = Placement(registry, cfg.placement, measurer(registry, channels),
                          compute_measurer(registry, channels))
    servicer = CoordinatorServicer(registry, node_tls=cfg.tls is not TlsMode.OFF)
    p2p = await start_p2p(cfg, servicer) if TransportKind.P2P in cfg.transports else None
    p2p_maddrs = (await p2p.address()).split(",") if p2p else []
    server, tls = None, None
    if TransportKind.GRPC in cfg.transports:
        server = control_plane(servicer)
        tls = TlsCertificate.load_or_create(Path(cfg.store)) if wants_tls(cfg.tls, cfg.listen) else None
        if add_port(server, cfg.listen, tls) == 0:
            await close_process_host()
            raise OSError(f"cannot listen on {cfg.listen} for the control plane")
        await server.start()
    snapshot = StateSnapshot(lambda: SwarmView.from_state(swarm_state(registry, placement, p2p_maddrs)))
    runner = web.AppRunner(http_app(snapshot, registry, placement), access_log=None)
    await runner.setup()
    host, _, port = cfg.http.rpartition(":")
    site = web.TCPSite(runner, host or "0.0.0.0", int(port), shutdown_timeout=0.5)  # SIGTERM ends it within 2 s
    await site.start()
    registry.serving()
    shown = "127.0.0.1" if host in ("", "0.0.0.0") else host
    planes = ([cfg.listen] if server else []) + (["p2p"] if p2p else [])
    print(f"tahnode coordinator: control plane on {' and '.join(planes)}, status page at http://{shown}:{port}/ "
          f"({run.stages} stages of {run.model.n_layers} layers, codecs {run.codec.forward}/{run.codec.backward}; "
          f"checkpoints in {registry.store.dir})", flush=True)
    say_tls(cfg, tls)
    stop = asyncio.Event()
    publishing = None
    if p2p:
        print("tahnode coordinator: p2p at " + " ".join(p2p_maddrs) + "\n  volunteers join with --initial-peers "
              f"{p2p_maddrs[0]} (behind NAT: also --transport p2p --use-auto-relay)", flush=True)
        identity = tls or TlsCertificate.load_or_create(Path(cfg.store))  # its entry is signed even without TLS
        record = {"grpc": grpc_address(cfg.listen, p2p_maddrs) if server else "", "p2p": ",".join(p2p_maddrs),
                  "fingerprint": identity.fingerprint}
        print(f"tahnode coordinator: its DHT entry is signed by certificate {identity.fingerprint}; volunteers who "
              f"find it through --initial-peers pin it with --coordinator-fingerprint {identity.fingerprint}",
              flush=True)
        publishing = asyncio.ensure_future(republish(SwarmDirectory(p2p.dht, key), directory_entries(registry, record),
                                                     stop, signer=identity))
    refreshing = asyncio.ensure_future(snapshot.refresh(stop))
    averaging = asyncio.ensure_future(dht_when_needed(registry, cfg, p2p, stop))
    gc.freeze()  # what start-up made (torch, protobuf, the servers) is never collected: shorter pauses at scale
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await until_stopped(placement.run(stop), stop)  # a failure of placement ends the coordinator, loudly
    finally:
        stop.set()
        await refreshing
        await asyncio.gather(averaging, return_exceptions=True)
        if publishing is not None:
            await publishing
        if server is not None:
            await server.stop(grace=1.0)
        await channels.close()
        await close_process_host()  # its own, or a dial-only one started to probe p2p nodes
        await runner.cleanup()
        log.info("coordinator stopped")
