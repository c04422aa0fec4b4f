"""How many pipelines a stage's outer step waits for: the coordinator's count now, and for a step the count its
pipeline's stage 0 took (the count reaches the stages of a pipeline at different moments; they switch at one step)."""

from __future__ import annotations

__all__ = ["PipelineCount", "PIPELINES"]

PIPELINES = "pipelines"  # a forward micro-batch's extra: the pipelines stage 0 counted for the step


class PipelineCount:
    """`now`: how many pipelines train, as the coordinator's last assignment said. For a step, the count stage 0
    took (stage 0 records its own; the others take it from the step's forward micro-batches): a stage's outer
    step after that step waits for that many pipelines, whatever its own assignment says by then. Before, one
    stage of a pipeline took its outer step alone while the next, told later, waited for a group: their outer
    states were of different steps."""

    def __init__(self, limit: int):
        self.limit = limit  # the most pipelines the run may have: a count above it is not one
        self.now = 1
        self.step, self.count = -1, 0

    def take(self, step: int, value: float) -> bool:
        """Stage 0's count for `step` (a micro-batch's extra: a whole number of 1..limit, else ignored)."""
        if not (float(value).is_integer() and 1 <= value <= self.limit):
            return False
        self.step, self.count = step, int(value)
        return True

    def of(self, step: int) -> int:
        """The count for `step`: stage 0's, if one came for it, else `now`."""
        return self.count if self.step == step else self.now
