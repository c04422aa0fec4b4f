"""`tahnode coordinator`: serves the Coordinator gRPC control plane and the HTTP status side
(`/`, `/api/v1/state`, `/metrics`) until interrupted."""

from __future__ import annotations

import asyncio
import json
import logging
import signal

import grpc
from aiohttp import web

from .auth import DEFAULT_TOKEN, SwarmKey
from .config import RunConfig
from .coordinator import CoordinatorServicer, NodeRecord, SwarmRegistry, run_rounds
from .proto import tahnode_pb2 as pb
from .proto import tahnode_pb2_grpc as pb_grpc

log = logging.getLogger("tahnode.coordinator")


def http_app(registry: SwarmRegistry) -> web.Application:
    try:
        from .status import SwarmView, make_app
    except ImportError:  # the full status page lives in tahnode.status
        app = web.Application()

        async def state(_request):
            return web.json_response(registry.state(), dumps=lambda o: json.dumps(o, allow_nan=False))

        app.router.add_get("/api/v1/state", state)
        app.router.add_get("/api/v1/ledger", lambda _r: web.json_response(registry.ledger_json()))
        return app
    app = make_app(lambda: SwarmView.from_state(registry.state()))
    app.router.add_get("/api/v1/ledger", lambda _r: web.json_response(registry.ledger_json()))
    return app


def measurer(key: SwarmKey):
    async def measure(a: NodeRecord, b: NodeRecord) -> tuple[float, float]:
        """Ask node a to measure its link to b over a's own data plane."""
        async with grpc.aio.insecure_channel(a.address) as channel:
            stub = pb_grpc.StageServiceStub(channel)
            req = key.sign(pb.MeasureRequest(target_id=b.node_id, target_address=b.address))
            reply = await stub.Measure(req, timeout=60)
            return reply.mbps, reply.rtt_ms

    return measure


async def serve(run: RunConfig, listen: str, http: str, token: str, heartbeat_timeout: float = 10.0,
                store: str = "tahnode-store", settle_s: float = 3.0) -> None:
    if token == DEFAULT_TOKEN:
        log.warning("no --token given: this swarm uses the public default token; anyone who can reach it can join")
    key = SwarmKey(token)
    registry = SwarmRegistry(run, key, heartbeat_timeout, store_dir=store, settle_s=settle_s)
    measure = measurer(key)
    server = grpc.aio.server()
    pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(registry), server)
    if server.add_insecure_port(listen) == 0:
        raise OSError(f"cannot listen on {listen} for the control plane")
    await server.start()
    runner = web.AppRunner(http_app(registry), access_log=None)
    await runner.setup()
    host, _, port = http.rpartition(":")
    site = web.TCPSite(runner, host or "0.0.0.0", int(port))
    await site.start()
    shown = "127.0.0.1" if host in ("", "0.0.0.0") else host
    print(f"tahnode coordinator: control plane on {listen}, status page at http://{shown}:{port}/ "
          f"({run.stages} stages of {run.model.n_layers} layers, codecs {run.codec.forward}/{run.codec.backward}; "
          f"checkpoints in {registry.store.dir})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        while not stop.is_set():
            await run_rounds(registry, measure)
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
    finally:
        await server.stop(grace=1.0)
        await runner.cleanup()
        log.info("coordinator stopped")
