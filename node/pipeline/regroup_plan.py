"""Stage 0's choice when the stages of its pipeline disagree after a regroup (pipelines in data parallel):
the outer step they all return to. Each try takes the newest outer step every stage says it can reach
(their own outer weights', their stage's named state's, those their checkpoints keep, and 0); a target
tried `tries` times without every stage reaching it is given up for the next lower. The reachable steps
only shrink as tries fail, and 0 (the initial weights) is always reachable: the loop ends.

    REGROUP (each stage: its stage's named state, else its own)
       |-- the stages agree ---------------------------------> TRAIN
       '-- they disagree --> REGROUP once more (a stage may have regrouped while another still loaded)
             |-- the stages agree ---------------------------> TRAIN
             '-- they disagree --> TARGET t = newest step all can reach, not given up
                     |-- they agree -------------------------> TRAIN
                     '-- they disagree again: t tried `tries` times? --> give t up; TARGET (next lower)"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RegroupPlan"]


@dataclass
class RegroupPlan:
    """The targets tried so far; `target` is None before the first disagreement (a plain regroup)."""

    tries_per_target: int
    target: int | None = None
    tries: int = 0                                        # disagreements so far
    tried: dict[int, int] = field(default_factory=dict)   # target -> times tried
    given_up: set[int] = field(default_factory=set)

    def next(self, reachable: set[int]) -> int:
        """After a disagreement: the outer step to try next, given what every stage said it can reach."""
        self.tries += 1
        if self.target is not None and self.tried.get(self.target, 0) >= self.tries_per_target:
            self.given_up.add(self.target)
        candidates = {step for step in reachable if step not in self.given_up}
        self.target = max(candidates) if candidates else 0
        self.tried[self.target] = self.tried.get(self.target, 0) + 1
        return self.target
