"""Which loss reports may enter a pipeline's ledger: steps within the run and in order, and a rewrite of
steps already recorded (a rollback) no further back than the checkpoint the pipeline can have rolled back to."""

from __future__ import annotations

from collections.abc import Callable

from ..config import RunConfig
from ..pipeline.checkpoint import CheckpointStore, has_outer
from ..proto import tahnode_pb2 as pb

__all__ = ["rollback_floor", "in_order", "resume_from"]


def rollback_floor(run: RunConfig, store: CheckpointStore, confirmed: int, reached: int) -> int:
    """The earliest step a report may rewrite in a pipeline's ledger: the oldest of the stages' newest
    checkpoints in the store (0 while a stage has none), of steps some ledger reached (`confirmed`), since a
    standby resumes its stage from the newest and its pipeline rolls back to that; in a run that may train
    pipelines in data parallel, also the pipeline's last outer step (a regroup goes back at most outer_every
    steps from `reached`, the furthest step its ledger reached). Never further: a report of step 0 wiped
    the ledger, and the oldest checkpoint the store keeps let one rewrite three checkpoints' worth of steps.
    Both bounds are high-water marks, never lowered by a rewrite: reports that each went back one outer
    period from where the last left the ledger would otherwise walk it down to step 0."""
    newest = [store.latest(stage, run.stages, at_most=confirmed) for stage in range(run.stages)]
    floor = min((c.step if c else 0) for c in newest)
    if has_outer(run):
        floor = min(floor, max(0, reached - run.swarm.outer_every))
    return floor


def resume_from(run: RunConfig, store: CheckpointStore, stage: int, confirmed: int, reached: int | None) -> int:
    """The step a new holder of `stage` resumes from, in a pipeline whose ledger holds the steps before `reached`
    (None: a pipeline new to the run): the store's newest checkpoint of the stage of a step the ledgers confirm
    (`confirmed`: the furthest one's; a holder may upload a step a little ahead of the loss reports, or make one
    up: that file waits until a ledger reaches its step), and of those one its pipeline's own ledger reached, if
    any. A newer one is another pipeline's state: resumed from by every stage of a pipeline formed again, the
    steps between were missing from its ledger; its pipeline returns to that state by a regroup instead, which
    marks them skipped."""
    own = store.latest(stage, run.stages, at_most=reached) if reached is not None else None
    newest = own or store.latest(stage, run.stages, at_most=confirmed)
    return newest.step if newest else 0


def in_order(points: list[pb.LossPoint], steps: int, ledger_next: int,
             floor: Callable[[], int]) -> tuple[list[pb.LossPoint], int]:
    """The points of one report that may enter the ledger, and the earliest step one could rewrite:
    steps within the run (`steps`), each above the one kept before it in the report, and a step the
    ledger has already (below `ledger_next`: a rollback, whose steps are trained again and replace the
    old) no further back than `floor()` (read once, and only for a rollback: it lists the store)."""
    kept: list[pb.LossPoint] = []
    lowest = None
    for point in points:
        if not 0 <= point.step < steps or (kept and point.step <= kept[-1].step):
            continue
        if point.step < ledger_next:
            lowest = floor() if lowest is None else lowest
            if point.step < lowest:
                continue
        kept.append(point)
    return kept, ledger_next if lowest is None else lowest
