"""`tahnode coordinator`: serves the Coordinator gRPC control plane and the HTTP status side
(`/`, `/api/v1/state`, `/metrics`, `/api/v1/ledger`), and places nodes, until interrupted."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

import grpc
from aiohttp import web

from ..config import CoordinatorConfig, RunConfig, TlsMode
from ..net.auth import SwarmKey
from ..net.probe import request_measure
from ..net.tls import TlsCertificate, add_port, is_loopback, wants_tls
from ..net.unparsable import RefuseUnparsable
from ..proto import tahnode_pb2_grpc as pb_grpc
from .placement import Measure, Placement
from .registry import SwarmRegistry
from .service import CoordinatorServicer
from .state import NodeRecord
from .status_page import SwarmView, make_app
from .view import ledger_json, swarm_state

log = logging.getLogger("tahnode.coordinator")

__all__ = ["serve", "http_app", "control_plane"]


def http_app(registry: SwarmRegistry, placement: Placement) -> web.Application:
    app = make_app(lambda: SwarmView.from_state(swarm_state(registry, placement)))
    app.router.add_get("/api/v1/ledger", lambda _r: web.json_response(ledger_json(registry)))
    return app


def control_plane(registry: SwarmRegistry) -> grpc.aio.Server:
    """The Coordinator gRPC service on a server of its own (no port yet)."""
    server = grpc.aio.server(interceptors=[RefuseUnparsable()])
    pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(registry), server)
    return server


def measurer(registry: SwarmRegistry) -> Measure:
    async def measure(a: NodeRecord, b: NodeRecord) -> tuple[float, float]:
        """Ask node a to measure its link to b over a's own data plane."""
        return await request_measure(registry.sealer, registry.peer(a), registry.peer(b))

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
    return False


async def serve(run: RunConfig, cfg: CoordinatorConfig) -> None:
    key = SwarmKey(cfg.token)
    registry = SwarmRegistry(run, key, cfg.heartbeat_timeout, store_dir=cfg.store)
    placement = Placement(registry, cfg.settle_s)
    measure = measurer(registry)
    server = control_plane(registry)
    tls = TlsCertificate.load_or_create(Path(cfg.store)) if wants_tls(cfg.tls, cfg.listen) else None
    if add_port(server, cfg.listen, tls) == 0:
        raise OSError(f"cannot listen on {cfg.listen} for the control plane")
    await server.start()
    runner = web.AppRunner(http_app(registry, placement), access_log=None)
    await runner.setup()
    host, _, port = cfg.http.rpartition(":")
    site = web.TCPSite(runner, host or "0.0.0.0", int(port))
    await site.start()
    shown = "127.0.0.1" if host in ("", "0.0.0.0") else host
    print(f"tahnode coordinator: control plane on {cfg.listen}, status page at http://{shown}:{port}/ "
          f"({run.stages} stages of {run.model.n_layers} layers, codecs {run.codec.forward}/{run.codec.backward}; "
          f"checkpoints in {registry.store.dir})", flush=True)
    say_tls(cfg, tls)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        while not stop.is_set():
            if not await until_stopped(placement.round(measure), stop):  # a probe round can take minutes
                break
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
    finally:
        await server.stop(grace=1.0)
        await runner.cleanup()
        log.info("coordinator stopped")
