"""The outer states the coordinator names: each replica reports the step and SHA-256 of its outer weights
after every outer step (`OuterState` in its heartbeat); for each stage the coordinator names the newest
step its replicas reported and, of that step, the digest the most distinct operators (node keys) reported,
ties to the lowest pipeline's (`NamedState`). A replica loads another's state only if it is that one.

A report is believed only as far as it can be checked: its step is an outer boundary of the run that its
reporter's pipeline has committed (the ledger says so), its digest 32 bytes; only the live holders of the
stage count, each with its latest report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from ..proto import tahnode_pb2 as pb
from ..train.outer import DIGEST_BYTES
from .state import NodeRecord

__all__ = ["OuterReportRecord", "StateDigests"]


@dataclass(frozen=True)
class OuterReportRecord:
    """A replica's latest report of its outer weights."""

    step: int
    digest: bytes


class StateDigests:
    """Latest reports by node id; `named(stage, holders, operator)` the state of a stage to load."""

    def __init__(self, is_boundary: Callable[[int], bool]):
        self.is_boundary = is_boundary
        self.latest: dict[str, OuterReportRecord] = {}

    def report(self, node: NodeRecord, state: pb.OuterState, committed: int) -> bool:
        """Take `node`'s report if it is believable: a boundary its pipeline committed (`committed`: the
        steps its ledger holds), a digest of the right size. False (ignored) else."""
        if (len(state.digest) != DIGEST_BYTES or state.step > committed or not self.is_boundary(state.step)):
            return False
        self.latest[node.node_id] = OuterReportRecord(state.step, bytes(state.digest))
        return True

    def forget(self, node_id: str) -> None:
        self.latest.pop(node_id, None)

    def named(self, holders: Iterable[NodeRecord], operator: Callable[[NodeRecord], bytes],
              asking: str = "") -> pb.NamedState:
        """Of the stage whose live holders are `holders` (in complete pipelines): the newest step they
        reported and the digest of it the most distinct operators reported; its sources (their averager
        peer ids, `asking` left out); empty if none reported."""
        holders = list(holders)
        reports = [(n, self.latest[n.node_id]) for n in holders if n.node_id in self.latest and n.averager_peer]
        if not reports:
            return pb.NamedState()
        step = max(r.step for _, r in reports)
        at_step = [(n, r) for n, r in reports if r.step == step]
        by_digest: dict[bytes, list[NodeRecord]] = {}
        for node, record in at_step:
            by_digest.setdefault(record.digest, []).append(node)
        digest, nodes = max(by_digest.items(), key=lambda item: (len({operator(n) for n in item[1]}),
                                                                 -min(n.pipeline for n in item[1])))
        return pb.NamedState(step=step, digest=digest, operators=len({operator(n) for n in nodes}),
                             sources=[n.averager_peer for n in sorted(nodes, key=lambda n: n.pipeline)
                                      if n.node_id != asking],
                             settled=len(at_step) == len(holders))
