"""Who holds which stage of which pipeline, as the coordinator's records say: the holders by
(pipeline, stage), the pipelines that exist, those complete enough to train and those that
finished, the open stages, the pipeline a node that names its stage joins, and where the
replicas of a stage find each other."""

from __future__ import annotations

from ..config import RunConfig
from ..net.errors import StageTaken
from .state import NodeRecord, NodeStatus

__all__ = ["Roster"]


class Roster:
    """Queries over the registry's node records (`nodes`, shared); `invalidate()` after any change
    of who holds what: the holders are indexed again on the next query."""

    def __init__(self, run: RunConfig, nodes: dict[str, NodeRecord]):
        self.run, self.nodes = run, nodes
        self._holders: dict[tuple[int, int], NodeRecord] | None = None
        self.finished: set[int] = set()  # pipelines whose loss stage reported the run's last step
        self.dht_peers: list[str] = []   # the coordinator's DHT, once pipelines train in data parallel (server.py starts it)

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
        return [p for p in self.pipelines() if not self.open_stages(p)]

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

    def pinned_pipeline(self, stage: int, node_id: str) -> int:
        """The pipeline a node that joins for `stage` takes it in: the first whose `stage` is open (or
        its own), else a new one where --pipelines N asks for more than there are; StageTaken else."""
        existing = self.pipelines() or [0]
        asks_more = not self.run.swarm.auto and len(self.pipelines()) < self.run.swarm.pipelines
        extra = self.free_pipeline() if asks_more else None
        for p in existing + ([extra] if extra is not None else []):
            held = self.holder(stage, p)
            if held is None or held.node_id == node_id:
                return p
        held = self.holder(stage, existing[0])
        raise StageTaken(f"stage {stage} is held by node {held.node_id} ({held.address})"
                         + (f" and in every other of the {len(existing)} pipelines" if len(existing) > 1 else ""))
