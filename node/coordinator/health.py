"""No silent divergence: the coordinator watches the committed losses and raises an alert, in its log,
its events and on the status page, when the loss leaves its trend or stops being a number.

The trend is the mean of the last `window` losses; the alert is raised when it climbs `rise` above
the lowest trend seen so far (a run that diverged with 8k-token gradient messages went from 1.46 to
3.13 over 90 steps), and cleared once it is back within `recover` of it on a step after the alert's
(a rollback to before it clears nothing)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import Enum

__all__ = ["AlertKind", "LossAlert", "LossWatch", "LossHistory"]


class AlertKind(Enum):
    NOT_FINITE = "not_finite"  # a committed step's loss was NaN or infinite
    DIVERGING = "diverging"    # the trend rose far above its best


@dataclass(frozen=True)
class LossAlert:
    kind: AlertKind
    step: int
    loss: float        # the step's loss (NaN/inf for NOT_FINITE)
    trend: float       # the mean of the last losses when it was raised
    best: float        # the lowest trend before it

    def message(self, codecs: str) -> str:
        if self.kind is AlertKind.NOT_FINITE:
            return f"the loss of step {self.step} is {self.loss}: training diverged (codecs {codecs})"
        return (f"the loss is diverging: its mean over recent steps rose to {self.trend:.4f} at step {self.step}, "
                f"{100 * (self.trend / self.best - 1):.0f}% above its best {self.best:.4f} (codecs {codecs}; "
                "docs/codecs.md says which pair to use when)")

    def to_json(self, codecs: str) -> dict:
        return {"kind": self.kind.value, "step": self.step, "trend": self.trend, "best": self.best,
                "message": self.message(codecs)}


class LossWatch:
    """Feed it every committed (step, loss) in order with `observe`; `alert` is the open alert."""

    def __init__(self, window: int = 10, rise: float = 0.3, recover: float = 0.15, settle_steps: int = 20):
        self.window, self.rise, self.recover, self.settle_steps = window, rise, recover, settle_steps
        self.recent: deque[float] = deque(maxlen=window)
        self.best = math.inf
        self.seen = 0
        self.alert: LossAlert | None = None

    def reset(self) -> None:
        """Forget the history (the run rolled back: its steps are trained again)."""
        self.recent.clear()
        self.best, self.seen, self.alert = math.inf, 0, None

    def observe(self, step: int, loss: float) -> tuple[LossAlert | None, bool]:
        """(a newly raised alert or None, whether the open alert was cleared by this step)."""
        if not math.isfinite(loss):
            if self.alert is not None and self.alert.kind is AlertKind.NOT_FINITE:
                return None, False
            self.alert = LossAlert(AlertKind.NOT_FINITE, step, loss, math.nan, self.best)
            return self.alert, False
        self.recent.append(loss)
        self.seen += 1
        if len(self.recent) < self.window:
            return None, False
        trend = sum(self.recent) / len(self.recent)
        if self.alert is not None:
            if step > self.alert.step and trend <= self.best * (1 + self.recover):
                self.alert = None
                self.best = min(self.best, trend)
                return None, True
            return None, False
        if self.seen >= self.settle_steps and trend > self.best * (1 + self.rise):
            self.alert = LossAlert(AlertKind.DIVERGING, step, loss, trend, self.best)
            return self.alert, False
        self.best = min(self.best, trend)
        return None, False


class LossHistory:
    """The recent steps' losses in memory (at most `keep`) and their watch. A step at or before one
    already recorded means a rollback: the steps from there on are trained again and replace the old."""

    def __init__(self, points: dict[int, float], keep: int):
        self.points, self.keep = dict(points), keep
        self.furthest = max(self.points, default=-1)  # the furthest step recorded, a rollback or not since
        self.watch = LossWatch()
        self._rewatch()

    def _rewatch(self) -> None:
        """The watch fed again with the steps kept (after a rollback); an alert open before stays open:
        only losses back on their trend after its step clear it, never a rollback to before it."""
        alert = self.watch.alert
        self.watch.reset()
        for step, loss in sorted(self.points.items()):
            self.watch.observe(step, loss)
        self.watch.alert = alert or self.watch.alert

    def watch_only(self, step: int, loss: float) -> tuple[LossAlert | None, bool]:
        """What the watch makes of a step that is not recorded (a loss that is not a number)."""
        return self.watch.observe(step, loss)

    def add(self, step: int, loss: float) -> tuple[LossAlert | None, bool]:
        """Record a committed step: (a newly raised alert or None, whether an open alert cleared)."""
        if self.points and max(self.points) >= step:
            self.points = {s: v for s, v in self.points.items() if s < step}
            self._rewatch()
        self.points[step] = loss
        self.furthest = max(self.furthest, step)
        while len(self.points) > self.keep:
            del self.points[min(self.points)]
        return self.watch.observe(step, loss)
