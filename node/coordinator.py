"""The coordinator's control plane: membership (join, heartbeat, leave, failure by timeout),
stage assignment with neighbours, and the aggregated training state the status page shows."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import grpc

from .auth import SwarmKey
from .config import RunConfig
from .proto import tahnode_pb2 as pb
from .proto import tahnode_pb2_grpc as pb_grpc

log = logging.getLogger("tahnode.coordinator")

STANDBY = -1


class Refusal(Exception):
    """A request the coordinator refuses; becomes a gRPC error with this code and message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class NodeRecord:
    node_id: str
    address: str
    stage: int
    device: str
    memory_bytes: int = 0
    compute_ms: float = 0.0
    status: str = "active"          # active | standby | failed | left
    last_seen: float = field(default_factory=time.monotonic)
    stats: pb.TrainingStats = field(default_factory=pb.TrainingStats)
    links: dict = field(default_factory=dict)  # dst node id -> (bytes, seconds)


class SwarmRegistry:
    """Who is in the swarm and which stage each node holds. Not thread-safe: used from the event loop."""

    def __init__(self, run: RunConfig, key: SwarmKey, heartbeat_timeout: float = 10.0):
        self.run = run
        self.run_json = run.to_json()
        self.key = key
        self.timeout = heartbeat_timeout
        self.nodes: dict[str, NodeRecord] = {}
        self.epoch = 1
        self.ledger: dict[int, tuple[float, list[int]]] = {}  # committed step -> (loss, sample ids)
        self.events: list[str] = []

    # -- helpers ----------------------------------------------------------------------------
    def event(self, text: str) -> None:
        log.info(text)
        self.events = (self.events + [f"{time.strftime('%H:%M:%S')} {text}"])[-50:]

    def holder(self, stage: int) -> NodeRecord | None:
        for n in self.nodes.values():
            if n.stage == stage and n.status == "active":
                return n
        return None

    def _check_mac(self, req) -> None:
        if not self.key.verify(req):
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED, "request failed authentication: wrong swarm token")

    def _peer(self, stage: int) -> pb.Peer:
        n = self.holder(stage) if 0 <= stage < self.run.stages else None
        return pb.Peer(node_id=n.node_id, address=n.address, stage=stage) if n else pb.Peer(stage=stage)

    def assignment(self, node: NodeRecord) -> pb.Assignment:
        a = pb.Assignment(stage=node.stage, num_stages=self.run.stages, epoch=self.epoch, run_config=self.run_json)
        if node.stage >= 0:
            a.prev.CopyFrom(self._peer(node.stage - 1))
            a.next.CopyFrom(self._peer(node.stage + 1))
        return a

    # -- requests ---------------------------------------------------------------------------
    def join(self, req: pb.JoinRequest) -> pb.JoinReply:
        self._check_mac(req)
        if not req.node_id or not req.address:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "join needs a node id and an address")
        if req.stage < -1 or req.stage >= self.run.stages:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"stage {req.stage} does not exist: this swarm has stages 0..{self.run.stages - 1}")
        self.sweep()
        stage = req.stage
        if stage >= 0:
            held = self.holder(stage)
            if held and held.node_id != req.node_id:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, f"stage {stage} is held by node {held.node_id} ({held.address})")
        else:
            stage = next((s for s in range(self.run.stages) if self.holder(s) is None or self.holder(s).node_id == req.node_id), STANDBY)
        rejoin = req.node_id in self.nodes
        node = NodeRecord(req.node_id, req.address, stage, req.device, req.memory_bytes, req.compute_ms,
                          status="active" if stage >= 0 else "standby")
        self.nodes[req.node_id] = node
        self.epoch += 1
        where = f"stage {stage}" if stage >= 0 else "standby"
        self.event(f"{'rejoined' if rejoin else 'joined'}: {req.node_id} at {req.address} ({req.device or '?'}) -> {where}")
        return pb.JoinReply(assignment=self.assignment(node), swarm="tahnode")

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        self._check_mac(req)
        node = self.nodes.get(req.node_id)
        if node is None or node.status in ("failed", "left"):
            raise Refusal(grpc.StatusCode.NOT_FOUND, f"unknown node {req.node_id!r}: join first")
        node.last_seen = time.monotonic()
        node.stats.CopyFrom(req.stats)
        for link in req.links:
            node.links[link.dst] = (link.bytes, link.seconds)
        for point in req.stats.losses:
            if point.step in self.ledger or any(s > point.step for s in self.ledger):
                # a rollback: the steps from here on are trained again and replace the old ones
                self.ledger = {s: v for s, v in self.ledger.items() if s < point.step}
            self.ledger[point.step] = (point.loss, list(point.sample_ids))
        self.sweep()
        return pb.HeartbeatReply(assignment=self.assignment(node), known=True)

    def leave(self, req: pb.LeaveRequest) -> pb.LeaveReply:
        self._check_mac(req)
        node = self.nodes.get(req.node_id)
        if node is None:
            raise Refusal(grpc.StatusCode.NOT_FOUND, f"unknown node {req.node_id!r}")
        node.status = "left"
        self.epoch += 1
        self.event(f"left: {req.node_id} (stage {node.stage})")
        return pb.LeaveReply()

    def sweep(self) -> None:
        """Declare nodes that missed their heartbeats for `timeout` seconds failed."""
        now = time.monotonic()
        for node in self.nodes.values():
            if node.status in ("active", "standby") and now - node.last_seen > self.timeout:
                node.status = "failed"
                self.epoch += 1
                self.event(f"failed: {node.node_id} (stage {node.stage}) missed heartbeats for {self.timeout:.0f} s")

    # -- state for the status page ------------------------------------------------------------
    def latest_on(self, stage: int) -> NodeRecord | None:
        """The active holder of a stage, else the node that held it last (for finished runs)."""
        held = self.holder(stage)
        if held:
            return held
        former = [n for n in self.nodes.values() if n.stage == stage]
        return max(former, key=lambda n: n.last_seen) if former else None

    def training(self) -> dict:
        last = self.latest_on(self.run.stages - 1)
        senders = [n for n in self.nodes.values() if n.stage >= 0 and n.stats.forward_bits_per_element > 0]
        fw = sum(n.stats.forward_bits_per_element for n in senders) / len(senders) if senders else 0.0
        s = last.stats if last else pb.TrainingStats()
        return {
            "step": int(s.step),
            "loss": s.loss if last and s.step else None,
            "tokens_per_s": s.tokens_per_s,
            "bits_per_element": fw,
            "backward_bits_per_element": s.backward_bits_per_element,
            "loss_first": s.loss_first if last and s.step else None,
            "wire_bytes": sum(n.stats.wire_bytes for n in self.nodes.values()),
            "uncompressed_bytes": sum(n.stats.uncompressed_bytes for n in self.nodes.values()),
            "finished": bool(last and s.finished),
            "replays": sum(n.stats.replays for n in self.nodes.values()),
            "steps_total": self.run.train.steps,
        }

    def links(self) -> list[dict]:
        out = []
        for n in self.nodes.values():
            for dst, (nbytes, seconds) in sorted(n.links.items()):
                if seconds > 0:
                    out.append({"src": n.node_id, "dst": dst, "mbps": nbytes * 8 / seconds / 1e6, "rtt_ms": None})
        return out

    def state(self) -> dict:
        self.sweep()
        return {
            "nodes": [
                {"id": n.node_id, "stage": n.stage, "address": n.address, "status": n.status, "device": n.device}
                for n in sorted(self.nodes.values(), key=lambda n: (n.stage if n.stage >= 0 else 1 << 30, n.node_id))
            ],
            "links": self.links(),
            "training": self.training(),
            "loss_history": [[step, loss] for step, (loss, _) in sorted(self.ledger.items())][-2000:],
            "events": self.events[-20:],
            "stages": self.run.stages,
            "epoch": self.epoch,
        }


    def ledger_json(self) -> dict:
        """The sample ids of every committed step (GET /api/v1/ledger)."""
        return {"steps": [{"step": step, "loss": loss, "sample_ids": ids} for step, (loss, ids) in sorted(self.ledger.items())]}


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, registry: SwarmRegistry):
        self.r = registry

    async def _call(self, fn, request, context):
        try:
            return fn(request)
        except Refusal as exc:
            log.warning("refused %s from %s: %s", type(request).__name__, context.peer(), exc)
            await context.abort(exc.code, str(exc))

    async def Join(self, request, context):
        return await self._call(self.r.join, request, context)

    async def Heartbeat(self, request, context):
        return await self._call(self.r.heartbeat, request, context)

    async def Leave(self, request, context):
        return await self._call(self.r.leave, request, context)
