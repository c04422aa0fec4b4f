"""The coordinator's control plane: membership (join, heartbeat, leave, failure by timeout),
stage assignment with neighbours, and the aggregated training state the status page shows."""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import grpc

from .assignment import AssignmentProblem, assign
from .auth import SwarmKey
from .checkpoint import CheckpointStore
from .config import RunConfig
from .model import stage_layers
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
    status: str = "active"          # joining | active | standby | failed | left
    layer_ms: float = 0.0
    joined_at: float = field(default_factory=time.monotonic)
    resume_step: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    stats: pb.TrainingStats = field(default_factory=pb.TrainingStats)
    links: dict = field(default_factory=dict)  # dst node id -> (bytes, seconds)


class SwarmRegistry:
    """Who is in the swarm and which stage each node holds. Not thread-safe: used from the event loop."""

    def __init__(self, run: RunConfig, key: SwarmKey, heartbeat_timeout: float = 10.0, store_dir: str | Path = "tahnode-store",
                 settle_s: float = 3.0):
        self.run = run
        self.run_json = run.to_json()
        # one folder per run configuration: a checkpoint of another run is never handed out
        self.run_id = hashlib.sha256(self.run_json.encode()).hexdigest()[:12]
        self.store = CheckpointStore(Path(store_dir) / f"run-{self.run_id}", keep=3)
        self.settle_s = settle_s
        self.last_join = 0.0
        self.probes: dict[tuple[str, str], tuple[float, float]] = {}  # (src, dst) -> (Mbit/s, RTT ms)
        self.last_result = None
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

    def _resume_step(self, stage: int) -> int:
        ckpt = self.store.latest(stage, self.run.stages)
        return ckpt.step if ckpt else 0

    def assignment(self, node: NodeRecord) -> pb.Assignment:
        stage = node.stage if node.status == "active" else STANDBY
        a = pb.Assignment(stage=stage, num_stages=self.run.stages, epoch=self.epoch, run_config=self.run_json, resume_step=node.resume_step)
        if stage >= 0:
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
        rejoin = req.node_id in self.nodes
        node = NodeRecord(req.node_id, req.address, stage, req.device, req.memory_bytes, req.compute_ms,
                          status="active" if stage >= 0 else "joining")
        if stage >= 0:
            node.resume_step = self._resume_step(stage)
        self.nodes[req.node_id] = node
        self.epoch += 1
        self.last_join = time.monotonic()
        where = f"stage {stage}" if stage >= 0 else "waiting for an assignment (--stage auto)"
        self.event(f"{'rejoined' if rejoin else 'joined'}: {req.node_id} at {req.address} ({req.device or '?'}) -> {where}")
        return pb.JoinReply(assignment=self.assignment(node), swarm="tahnode")

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        self._check_mac(req)
        node = self.nodes.get(req.node_id)
        if node is None or node.status in ("failed", "left"):
            raise Refusal(grpc.StatusCode.NOT_FOUND, f"unknown node {req.node_id!r}: join first")
        node.last_seen = time.monotonic()
        node.stats.CopyFrom(req.stats)
        if req.layer_ms > 0:
            node.layer_ms = req.layer_ms
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
            if node.status in ("active", "standby", "joining") and now - node.last_seen > self.timeout:
                held = f"stage {node.stage}" if node.status == "active" else node.status
                node.status = "failed"
                self.epoch += 1
                self.event(f"failed: {node.node_id} ({held}) missed heartbeats for {self.timeout:.0f} s")

    # -- assignment rounds --------------------------------------------------------------------
    def open_stages(self) -> list[int]:
        return [k for k in range(self.run.stages) if self.holder(k) is None]

    def waiting(self) -> list[NodeRecord]:
        return [n for n in self.nodes.values() if n.status in ("joining", "standby")]

    def round_due(self) -> bool:
        """Time to place nodes: a newcomer, or a vacancy a standby can fill; enough candidates to
        fill every open stage; and no join for settle_s seconds."""
        waiting = self.waiting()
        open_stages = self.open_stages()
        if not any(n.status == "joining" for n in waiting) and not (open_stages and waiting):
            return False
        if len(waiting) < len(open_stages):
            return False
        return self._settled()

    def _settled(self) -> bool:
        now = time.monotonic()
        if now - self.last_join < self.settle_s:
            return False
        # give joining nodes a few seconds to report their compute speed
        return all(n.layer_ms > 0 or now - n.joined_at > 10.0 for n in self.waiting())

    def live(self) -> list[NodeRecord]:
        return [n for n in self.nodes.values() if n.status in ("active", "joining", "standby")]

    def unmeasured_pairs(self) -> list[tuple[NodeRecord, NodeRecord]]:
        live = sorted(self.live(), key=lambda n: n.node_id)
        return [(a, b) for a in live for b in live if a is not b and (a.node_id, b.node_id) not in self.probes]

    def activation_bytes(self) -> tuple[float, float]:
        """Bytes of one micro-batch's activations (forward codec) and gradients (backward codec)."""
        import torch

        from .codecs import get_codec

        t, c = self.run.train, self.run.codec
        rows = min(t.seq_len, 64)
        sample = torch.randn(1, rows, self.run.model.dim)
        per_element = []
        for name, params in ((c.forward, c.forward_params), (c.backward, c.backward_params)):
            codec = get_codec(name, **params)
            from .codecs import CodecContext

            msg = codec.encode(sample, CodecContext(sample_ids=[0]))
            per_element.append(len(msg.payload) / sample.numel())
        n = t.batch_size * t.seq_len * self.run.model.dim
        return n * per_element[0], n * per_element[1]

    def plan(self):
        """Place the waiting nodes into the open stages (pinned holders stay); the rest stand by."""
        holders = {self.holder(k).node_id: k for k in range(self.run.stages) if self.holder(k)}
        waiting = [n.node_id for n in self.waiting()]
        fw, bw = self.activation_bytes()
        layers = [len(stage_layers(self.run.model.n_layers, self.run.stages, k)) for k in range(self.run.stages)]
        problem = AssignmentProblem(
            nodes=sorted(list(holders) + waiting), num_stages=self.run.stages, pinned=holders, auto=sorted(waiting),
            mbps={pair: mbps for pair, (mbps, _) in self.probes.items()}, activation_bytes=fw, gradient_bytes=bw,
            layer_ms={n.node_id: n.layer_ms for n in self.live()}, stage_layers=layers,
        )
        return assign(problem)

    def apply_plan(self, result) -> None:
        for stage, node_id in enumerate(result.chain):
            node = self.nodes[node_id]
            if node.status != "active" or node.stage != stage:
                node.stage, node.status = stage, "active"
                node.resume_step = self._resume_step(stage)
                resume = f", resuming from the checkpoint of step {node.resume_step}" if node.resume_step else ""
                self.event(f"assigned: {node_id} -> stage {stage}{resume}")
        for node_id in result.standbys:
            node = self.nodes[node_id]
            if node.status != "standby":
                node.status, node.stage = "standby", STANDBY
                self.event(f"standby: {node_id}")
        self.last_result = result
        self.epoch += 1
        self.event(f"chain {' -> '.join(result.chain)} ({result.method}); bottleneck {result.bottleneck}")

    def record_probe(self, src: str, dst: str, mbps: float, rtt_ms: float) -> None:
        self.probes[(src, dst)] = (mbps, rtt_ms)
        self.event(f"link {src} -> {dst} measured at {mbps:.1f} Mbit/s, RTT {rtt_ms:.1f} ms")

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
            "aqsgd_cache_bytes": sum(n.stats.aqsgd_cache_bytes for n in self.nodes.values() if n.status == "active"),
            "steps_total": self.run.train.steps,
        }

    def links(self) -> list[dict]:
        """Probed links (Mbit/s, RTT), with the rate real traffic achieved where there was some.
        Traffic time includes waiting on a busy receiver, so it is a lower bound: it raises the
        estimate when it exceeds the probe, never lowers it."""
        observed = {}
        for n in self.nodes.values():
            for dst, (nbytes, seconds) in n.links.items():
                if seconds > 0 and nbytes > 0:
                    observed[(n.node_id, dst)] = nbytes * 8 / seconds / 1e6
        out = []
        for pair in sorted(set(self.probes) | set(observed)):
            probed, rtt = self.probes.get(pair, (None, None))
            seen = observed.get(pair)
            mbps = max(x for x in (probed, seen) if x is not None)
            out.append({"src": pair[0], "dst": pair[1], "mbps": mbps, "rtt_ms": rtt, "probed_mbps": probed, "observed_mbps": seen})
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

    async def UploadCheckpoint(self, request_iterator, context):
        """Receive a stage checkpoint into the store (written to a temp file, renamed when whole)."""
        tmp = None
        total = 0
        try:
            async for chunk in request_iterator:
                if not self.r.key.verify(chunk):
                    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "checkpoint chunk failed authentication: wrong swarm token")
                if chunk.num_stages != self.r.run.stages or chunk.stage >= chunk.num_stages:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"checkpoint of stage {chunk.stage}/{chunk.num_stages} does not fit this swarm")
                if tmp is None:
                    self.r.store.dir.mkdir(parents=True, exist_ok=True)
                    final = self.r.store.dir / f"stage{chunk.stage}-of{chunk.num_stages}-step{chunk.step}.safetensors"
                    tmp = final.with_suffix(f".{chunk.node_id}.part")
                    fh = open(tmp, "wb")
                fh.write(chunk.data)
                total += len(chunk.data)
                if chunk.last:
                    fh.close()
                    tmp.replace(final)
                    tmp = None
                    for old in self.r.store.list(chunk.stage, chunk.num_stages)[: -self.r.store.keep]:
                        old.path.unlink(missing_ok=True)
                    log.info("stored %s (%d bytes) from %s", final.name, total, chunk.node_id)
        finally:
            if tmp is not None:
                fh.close()
                tmp.unlink(missing_ok=True)
        return pb.UploadReply(bytes=total)

    async def DownloadCheckpoint(self, request, context):
        if not self.r.key.verify(request):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "download failed authentication: wrong swarm token")
        ckpt = self.r.store.find(request.stage, self.r.run.stages, request.step)
        if ckpt is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no checkpoint of stage {request.stage} at step {request.step} in the store")
        with open(ckpt.path, "rb") as fh:
            while True:
                data = fh.read(1 << 20)
                chunk = pb.CheckpointChunk(stage=request.stage, num_stages=self.r.run.stages, step=request.step, data=data, last=len(data) < (1 << 20))
                yield self.r.key.sign(chunk)
                if chunk.last:
                    break


async def run_rounds(registry: SwarmRegistry, measure: Callable[[NodeRecord, NodeRecord], Awaitable[tuple[float, float]]]) -> None:
    """One pass of the coordinator's loop: probe unmeasured pairs of live nodes, one probe at a
    time (so no node ever runs two), then place waiting nodes if a round is due."""
    registry.sweep()
    if not registry.round_due():
        return
    for a, b in registry.unmeasured_pairs():
        if a.status not in ("active", "joining", "standby") or b.status not in ("active", "joining", "standby"):
            continue
        try:
            mbps, rtt = await measure(a, b)
        except Exception as exc:  # a node that cannot measure is not fatal: the pair stays unmeasured
            registry.event(f"probe {a.node_id} -> {b.node_id} failed: {exc}")
            continue
        registry.record_probe(a.node_id, b.node_id, mbps, rtt)
    registry.sweep()
    if registry.round_due():
        try:
            registry.apply_plan(registry.plan())
        except ValueError as exc:
            registry.event(f"cannot assign yet: {exc}")
