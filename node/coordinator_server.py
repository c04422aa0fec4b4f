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
from .coordinator import CoordinatorServicer, SwarmRegistry
from .proto import tahnode_pb2_grpc as pb_grpc

log = logging.getLogger("tahnode.coordinator")


def http_app(registry: SwarmRegistry) -> web.Application:
    try:
        from .status import make_app, view_from_state
    except ImportError:  # the full status page lives in tahnode.status
        app = web.Application()

        async def state(_request):
            return web.json_response(registry.state(), dumps=lambda o: json.dumps(o, allow_nan=False))

        app.router.add_get("/api/v1/state", state)
        return app
    return make_app(lambda: view_from_state(registry.state()))


async def serve(run: RunConfig, listen: str, http: str, token: str, heartbeat_timeout: float = 10.0,
                ready: asyncio.Event | None = None) -> None:
    if token == DEFAULT_TOKEN:
        log.warning("no --token given: this swarm uses the public default token; anyone who can reach it can join")
    registry = SwarmRegistry(run, SwarmKey(token), heartbeat_timeout)
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
          f"({run.stages} stages of {run.model.n_layers} layers, codecs {run.codec.forward}/{run.codec.backward})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    try:
        while not stop.is_set():
            registry.sweep()
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
    finally:
        await server.stop(grace=1.0)
        await runner.cleanup()
        log.info("coordinator stopped")
