"""Placing `--stage auto` nodes: the coordinator probes the links between live nodes, then assigns
the waiting nodes to the open stages (tahnode.coordinator.assignment) once joins have settled;
spare nodes stand by."""

from __future__ import annotations

import time
from typing import Awaitable, Callable

from ..codecs import CodecContext, get_codec
from ..train.model import stage_layers
from .assignment import AssignmentProblem, AssignmentResult, assign
from .registry import SwarmRegistry
from .state import NodeRecord, NodeStatus

__all__ = ["Placement", "Measure"]

# measure(a, b) -> (Mbit/s, RTT ms) of the link from node a to node b
Measure = Callable[[NodeRecord, NodeRecord], Awaitable[tuple[float, float]]]


class Placement:
    """The measured links (`probes`) and the rounds that place waiting nodes in open stages."""

    def __init__(self, registry: SwarmRegistry, settle_s: float = 3.0):
        self.r = registry
        self.settle_s = settle_s
        self.probes: dict[tuple[str, str], tuple[float, float]] = {}  # (src, dst) -> (Mbit/s, RTT ms)

    def round_due(self) -> bool:
        """Time to place nodes: a newcomer, or a vacancy a standby can fill; enough candidates to
        fill every open stage; and no join for settle_s seconds."""
        waiting = self.r.waiting()
        open_stages = self.r.open_stages()
        if not any(n.status is NodeStatus.JOINING for n in waiting) and not (open_stages and waiting):
            return False
        if len(waiting) < len(open_stages):
            return False
        return self._settled()

    def _settled(self) -> bool:
        now = time.monotonic()
        if now - self.r.last_join < self.settle_s:
            return False
        # give joining nodes a few seconds to report their compute speed
        return all(n.layer_ms > 0 or now - n.joined_at > 10.0 for n in self.r.waiting())

    def unmeasured_pairs(self) -> list[tuple[NodeRecord, NodeRecord]]:
        live = sorted(self.r.live(), key=lambda n: n.node_id)
        return [(a, b) for a in live for b in live if a is not b and (a.node_id, b.node_id) not in self.probes]

    def activation_bytes(self) -> tuple[float, float]:
        """Bytes of one micro-batch's activations (forward codec) and gradients (backward codec)."""
        import torch

        run = self.r.run
        t, c = run.train, run.codec
        rows = min(t.seq_len, 64)
        sample = torch.randn(1, rows, run.model.dim)
        per_element = []
        for name, params in ((c.forward, c.forward_params), (c.backward, c.backward_params)):
            msg = get_codec(name, **params).encode(sample, CodecContext(sample_ids=[0]))
            per_element.append(len(msg.payload) / sample.numel())
        n = t.batch_size * t.seq_len * run.model.dim
        return n * per_element[0], n * per_element[1]

    def plan(self) -> AssignmentResult:
        """Place the waiting nodes into the open stages (pinned holders stay); the rest stand by."""
        run = self.r.run
        holders = {self.r.holder(k).node_id: k for k in range(run.stages) if self.r.holder(k)}
        waiting = [n.node_id for n in self.r.waiting()]
        fw, bw = self.activation_bytes()
        layers = [len(stage_layers(run.model.n_layers, run.stages, k)) for k in range(run.stages)]
        problem = AssignmentProblem(
            nodes=sorted(list(holders) + waiting), num_stages=run.stages, pinned=holders, auto=sorted(waiting),
            mbps={pair: mbps for pair, (mbps, _) in self.probes.items()}, activation_bytes=fw, gradient_bytes=bw,
            layer_ms={n.node_id: n.layer_ms for n in self.r.live()}, stage_layers=layers,
        )
        return assign(problem)

    def apply(self, result: AssignmentResult) -> None:
        for stage, node_id in enumerate(result.chain):
            node = self.r.nodes[node_id]
            if self.r.place(node, stage):
                resume = f", resuming from the checkpoint of step {node.resume_step}" if node.resume_step else ""
                self.r.event(f"assigned: {node_id} -> stage {stage}{resume}")
        for node_id in result.standbys:
            if self.r.stand_by(self.r.nodes[node_id]):
                self.r.event(f"standby: {node_id}")
        self.r.epoch += 1
        self.r.event(f"chain {' -> '.join(result.chain)} ({result.method}); bottleneck {result.bottleneck}")

    def record_probe(self, src: str, dst: str, mbps: float, rtt_ms: float) -> None:
        self.probes[(src, dst)] = (mbps, rtt_ms)
        self.r.event(f"link {src} -> {dst} measured at {mbps:.1f} Mbit/s, RTT {rtt_ms:.1f} ms")

    async def round(self, measure: Measure) -> None:
        """One pass of the coordinator's loop: probe unmeasured pairs of live nodes, one probe at a
        time (so no node ever runs two), then place waiting nodes if a round is due."""
        self.r.sweep()
        if not self.round_due():
            return
        for a, b in self.unmeasured_pairs():
            if not (a.status.live and b.status.live):
                continue
            try:
                mbps, rtt = await measure(a, b)
            except Exception as exc:  # a node that cannot measure is not fatal: the pair stays unmeasured
                self.r.event(f"probe {a.node_id} -> {b.node_id} failed: {exc}")
                continue
            self.record_probe(a.node_id, b.node_id, mbps, rtt)
        self.r.sweep()
        if self.round_due():
            try:
                self.apply(self.plan())
            except ValueError as exc:
                self.r.event(f"cannot assign yet: {exc}")
