"""Test helper: a coordinator servicer and a node's StageService as real gRPC servers on loopback,
served from an event loop in a thread of the test process (for tests that attack every RPC)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import torch
from tahnode.config import RunConfig
from tahnode.coordinator.registry import SwarmRegistry
from tahnode.coordinator.server import control_plane
from tahnode.coordinator.service import CoordinatorServicer
from tahnode.net.auth import Sealer, SwarmKey
from tahnode.net.freshness import COORDINATOR
from tahnode.net.identity import NodeKey
from tahnode.net.grpc_transport import GrpcTransport
from tahnode.pipeline.checkpoint import CheckpointStore
from tahnode.proto import tahnode_pb2 as pb
from tahnode.train.model import build_stage

TOKEN = "replay-test-token"
NODE = "n1"           # the node whose StageService is attacked, also a member of the swarm
PEER = "n0"           # the node that sends to it


class Servers:
    """A coordinator servicer and a node's StageService on loopback, served from a thread's loop.
    Node NODE holds stage 0 and has saved `checkpoint` (stage 0, step 7) locally."""

    def __init__(self, tmp: Path):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.run_cfg = RunConfig.build("llama-tiny", None)
        self.registry = SwarmRegistry(self.run_cfg, SwarmKey(TOKEN), heartbeat_timeout=3600, store_dir=tmp / "store")
        self.run = self.registry.sealer.run
        self.keys: dict[str, NodeKey] = {}
        self.node_sealer = self.sealer(NODE)
        self.coordinator, self.node = self._call(self._start())
        # NODE's neighbour PEER may send it frames; the coordinator may ask it to measure
        self.transport.peer_keys.update({PEER: self.key(PEER).public,
                                         COORDINATOR: self.registry.sealer.identity.public})
        self.registry.join(self.sealer(NODE, run="").seal(pb.JoinRequest(node_id=NODE, address=self.node, stage=0),
                                                          COORDINATOR))
        model = build_stage(self.run_cfg.model, 0, self.run_cfg.stages)  # what the coordinator accepts for stage 0
        self.checkpoint = CheckpointStore(tmp / "ckpt").save(0, self.run_cfg.stages, 7, model,
                                                             torch.optim.AdamW(model.parameters()),
                                                             self.run_cfg.to_json())

    def key(self, name: str) -> NodeKey:
        """The identity of node `name` (one per name, made on first use)."""
        return self.keys.setdefault(name, NodeKey.generate())

    def sealer(self, name: str, run: str | None = None, token: str = TOKEN) -> Sealer:
        """A fresh sealer for node `name` with its identity, as its daemon would seal."""
        if name == COORDINATOR:
            return Sealer(SwarmKey(token), name, self.run if run is None else run, self.registry.sealer.identity)
        return Sealer(SwarmKey(token), name, self.run if run is None else run, self.key(name))

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _start(self) -> tuple[str, str]:
        self.server = control_plane(CoordinatorServicer(self.registry))  # as `tahnode coordinator` builds it
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

        async def measurer(peer: str, target: str, nbytes: int, cert: bytes) -> tuple[float, float]:
            return 123.0, 4.5

        self.transport = GrpcTransport(self.node_sealer, "127.0.0.1:0", measurer=measurer)
        self.transport.inbox = asyncio.Queue()  # nobody reads it here: never apply backpressure
        self.transport.peer_wait_s = 0.1  # strangers are refused almost at once (the wait has a test of its own)
        node_address = await self.transport.start()
        return f"127.0.0.1:{port}", node_address

    def stop(self) -> None:
        async def stop():
            await self.server.stop(0)
            await self.transport.close()

        self._call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
