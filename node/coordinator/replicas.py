"""The coordinator's side of the averaging plane: what each replica reports of its outer weights (their
digests: tahnode.coordinator.digests) and of the other replicas of its stage (its reports: evidence,
tahnode.coordinator.evidence), taken from its heartbeat, and what a replica is told back: the outer state of
its stage it may load, and from whom."""

from __future__ import annotations

from typing import Callable

from ..config import RunConfig
from ..proto import tahnode_pb2 as pb
from .digests import StateDigests
from .evidence import Evidence, Verdict
from .roster import Roster
from .state import NodeRecord, NodeStatus

__all__ = ["ReplicaCouncil", "MAX_REPORTS", "MAX_SKIPPED"]

MAX_REPORTS = 16  # reports a heartbeat may carry (a replica has one per other replica of its stage)
MAX_SKIPPED = 4096  # steps one report may say its pipeline skipped
MAX_SAMPLES = 65536  # sample ids of one skipped step


class ReplicaCouncil:
    """Digests and reports of the replicas; `operator(node_id)` names a node's operator (its key)."""

    def __init__(self, run: RunConfig, roster: Roster, operator: Callable[[str], bytes],
                 committed: Callable[[int], int]):
        self.run, self.roster, self.committed = run, roster, committed
        every, steps = run.swarm.outer_every, run.train.steps
        self.digests = StateDigests(lambda step: 0 <= step <= steps and (step % every == 0 or step == steps))
        self.evidence = Evidence(operator)

    def heartbeat(self, node: NodeRecord, req: pb.HeartbeatRequest) -> list[Verdict]:
        """Take a holder's digest and its word on its stage's replicas; the verdicts it completes."""
        if node.status is not NodeStatus.ACTIVE:
            return []
        if req.HasField("outer_state"):
            self.digests.report(node, req.outer_state, self.committed(node.pipeline))
        replicas = self.roster.replicas(node.stage, node.pipeline)
        by_peer = {n.averager_peer: n.node_id for n in replicas if n.averager_peer}
        words = {by_peer[r.peer]: r for r in req.stats.outer_reports[:MAX_REPORTS] if r.peer in by_peer}
        if not words:
            return []
        self.evidence.take(node.node_id, words)
        verdicts = []
        for accused in words:
            witnesses = [n.node_id for n in self.stage_replicas(node.stage) if n.node_id != accused]
            verdict = self.evidence.judge(accused, witnesses)
            if verdict is not None:
                verdicts.append(verdict)
        return verdicts

    def stage_replicas(self, stage: int) -> list[NodeRecord]:
        """The holders of `stage` in the complete pipelines."""
        return [h for p in self.roster.complete_pipelines() if (h := self.roster.holder(stage, p)) is not None]

    def named(self, node: NodeRecord) -> pb.NamedState:
        """The outer state of `node`'s stage it may load (tahnode.coordinator.digests.StateDigests.named)."""
        return self.digests.named(self.stage_replicas(node.stage), lambda n: self.evidence.operator(n.node_id),
                                  asking=node.node_id)

    def skipped(self, node: NodeRecord, points) -> list[pb.LossPoint]:
        """Of the steps a stage-0 holder says its pipeline skipped (it took a newer replica's state), those the
        ledger may take as skipped: of the run, within MAX_SKIPPED of its pipeline's next step either way, in order.
        (Skipped steps fill gaps only: the ledger never puts one in place of a trained step. Below the next step
        they fill the gap a skip left when the loss stage's heartbeat with the steps after it came first.)"""
        if node.status is not NodeStatus.ACTIVE or node.stage != 0 or not points:
            return []
        start, kept, last = self.committed(node.pipeline), [], -1
        for point in points[:MAX_SKIPPED]:
            if max(0, start - MAX_SKIPPED) <= point.step < min(start + MAX_SKIPPED, self.run.train.steps) \
                    and point.step > last:
                kept.append(pb.LossPoint(step=point.step, sample_ids=point.sample_ids[:MAX_SAMPLES], skipped=True))
                last = point.step
        return kept

    def forget(self, node_id: str) -> None:
        self.digests.forget(node_id)
        self.evidence.forget(node_id)
