"""Who holds which stage of which pipeline, as the coordinator's records say: the holders by
(pipeline, stage), the pipelines that exist, those complete enough to train and those that
finished, the open stages, the pipeline a node that names its stage joins, and where the
replicas of a stage find each other."""

from __future__ import annotations

from collections.abc import Callable

from ..config import RunConfig
from ..net.errors import StageTaken
from ..net.p2p.host import P2PAddress
from .state import NodeRecord, NodeStatus

__all__ = ["Roster", "MAX_AVERAGER_CHARS"]

MAX_AVERAGER_CHARS = 2048  # a node's averager address (its multiaddrs)


class Roster:
    """Queries over the registry's node records (`nodes`, shared); `invalidate()` after any change
    of who holds what: the holders are indexed again on the next query."""

    def __init__(self, run: RunConfig, nodes: dict[str, NodeRecord]):
        self.run, self.nodes = run, nodes
        self._holders: dict[tuple[int, int], NodeRecord] | None = None
        self.finished: set[int] = set()  # pipelines over: their ledger full, their first and loss stages done
        self.finishing: dict[int, set[int]] = {}  # pipeline -> stages whose holder said it trained the last step
        self.formed: set[int] = set()    # pipelines that were complete once (one that loses a stage may be dissolved)
        self.recovering: dict[int, str] = {}  # pipeline -> the node that took one of its stages over, until it is ready
        # the coordinator's DHT, once pipelines train in data parallel (server.py starts it)
        self.dht_peers: list[str] = []

    def said_finished(self, node: NodeRecord, ledger_full: bool) -> None:
        """`node`, active, says it trained the run's last step: its pipeline is over once its ledger has
        every step and both its first stage (which drives the steps) and its loss stage said so. The
        loss stage's word alone, with a made-up loss for every step, ended the run (issue 39, finding 8)."""
        said = self.finishing.setdefault(node.pipeline, set())
        said.add(node.stage)
        if ledger_full and {0, self.run.loss_stage} <= said:
            self.finished.add(node.pipeline)

    def invalidate(self) -> None:
        self._holders = None

    def holder(self, stage: int, pipeline: int = 0) -> NodeRecord | None:
        if self._holders is None:
            self._holders = {}
            for n in self.nodes.values():
                if n.status is NodeStatus.ACTIVE:
                    self._holders.setdefault((n.pipeline, n.stage), n)
        return self._holders.get((pipeline, stage))

    def pipelines(self) -> list[int]:
        """The pipelines with at least one holder, in order."""
        self.holder(0)
        return sorted({p for p, _ in self._holders})

    def open_stages(self, pipeline: int = 0) -> list[int]:
        return [k for k in range(self.run.stages) if self.holder(k, pipeline) is None]

    def complete_pipelines(self) -> list[int]:
        """The pipelines every stage of which is held: those that train."""
        complete = [p for p in self.pipelines() if not self.open_stages(p)]
        self.formed.update(complete)
        return complete

    def vacancies(self) -> list[tuple[int, int]]:
        """(pipeline, stage) of every open stage of the pipelines that have holders."""
        return [(p, k) for p in self.pipelines() for k in self.open_stages(p)]

    def limit(self) -> int:
        """How many pipelines the run may have at once: --pipelines N, else max_pipelines."""
        return self.run.swarm.data_slots

    def free_pipeline(self) -> int | None:
        """The lowest pipeline index no node holds a stage of (None at the limit)."""
        taken = set(self.pipelines())
        return next((p for p in range(self.limit()) if p not in taken), None)

    def chain(self, pipeline: int) -> list[str] | None:
        """The node ids of a complete pipeline, stage by stage (None if a stage is open)."""
        holders = [self.holder(k, pipeline) for k in range(self.run.stages)]
        return None if any(h is None for h in holders) else [h.node_id for h in holders]

    def replicas(self, stage: int, pipeline: int) -> list[NodeRecord]:
        """The holders of `stage` in the other complete pipelines: whom its holder admits (to its groups, and to
        the states it serves) and answers for."""
        return [h for p in self.complete_pipelines() if p != pipeline and (h := self.holder(stage, p)) is not None]

    def took_over(self, node: NodeRecord) -> None:
        """`node` was placed in a pipeline that had trained (a failed holder replaced, a stage moved): the pipeline
        recovers (its new holder loads a checkpoint and starts its averager) until `node` is ready (`heard`)."""
        if node.pipeline in self.formed:
            self.recovering[node.pipeline] = node.node_id

    def heard(self, node: NodeRecord, outer_state: bool, step: int) -> None:
        """`node`'s heartbeat: once the node that took a stage over reports its stage's step (its checkpoint
        loaded, its averager started: its pipeline returns to the others' outer state now, which must hold
        still for it) or its outer state, its pipeline is waited for again."""
        if self.recovering.get(node.pipeline) == node.node_id and (outer_state or step >= max(1, node.resume_step)):
            del self.recovering[node.pipeline]

    def recovers(self, pipeline: int) -> bool:
        """Whether `pipeline` waits for the node that took one of its stages over (still its holder) to be ready."""
        node = self.nodes.get(self.recovering.get(pipeline, ""))
        return node is not None and node.status is NodeStatus.ACTIVE and node.pipeline == pipeline

    def averaging_with(self, pipeline: int) -> list[int]:
        """The complete pipelines whose replicas the rounds of a holder in `pipeline` wait for (its own among them):
        every one for a pipeline that recovers (it returns to their outer state), those not recovering for the
        others. A replica of a training pipeline does not wait at its outer step for one that cannot come, its new
        holder still loading (before, it waited outer_timeout_s at every failure); it still admits that pipeline's
        replicas, which load its outer state, and waits for them again once the new holder is ready."""
        complete = self.complete_pipelines()
        return complete if self.recovers(pipeline) else [p for p in complete if not self.recovers(p)]

    def bind_averager(self, node: NodeRecord, address: str) -> None:
        """The p2p address a node's averager is reached at (its heartbeats say), if it is one peer's,
        of bounded length, and no other live node's peer id: the replicas of its stage admit that
        peer, and the coordinator knows whom their refusals name."""
        try:
            peer = P2PAddress.parse(address).peer_id if len(address) <= MAX_AVERAGER_CHARS else None
        except ValueError:
            peer = None
        if peer is None or any(n.averager_peer == peer and n is not node and n.status.live
                               for n in self.nodes.values()):
            return
        node.averager, node.averager_peer = address, peer

    def pinned_pipeline(self, stage: int, node_id: str, refusal: Callable[[int], str] = lambda p: ""
                        ) -> tuple[int | None, str]:
        """The pipeline a node that joins for `stage` takes it in, with "": the first whose `stage` is
        open (or its own) and where `refusal` (why the node may not hold it there, "" if it may) lets
        it, else a new one where --pipelines N asks for more than there are; (None, why) where only
        `refusal` stands in the way; StageTaken else."""
        existing = self.pipelines() or [0]
        asks_more = not self.run.swarm.auto and len(self.pipelines()) < self.run.swarm.pipelines
        extra = self.free_pipeline() if asks_more else None
        why = ""
        for p in existing + ([extra] if extra is not None else []):
            held = self.holder(stage, p)
            if held is None or held.node_id == node_id:
                why = refusal(p)
                if not why:
                    return p, ""
        if why:
            return None, why
        held = self.holder(stage, existing[0])
        raise StageTaken(f"stage {stage} is held by node {held.node_id} ({held.address})"
                         + (f" and in every other of the {len(existing)} pipelines" if len(existing) > 1 else ""))
