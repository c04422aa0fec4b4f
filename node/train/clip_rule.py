"""The rule that bounds what one replica of a stage can do to another's outer step, whatever it sends:
the reducer of a part centres on its own part and clips each sender's difference from it to `clip` (C,
--outer-clip, 2 by default) times its own part's norm (one step of CenteredClip, BTARD-SGD's aggregate,
from the one part it trusts); a sender takes a reducer's average only near its own part, else keeps its own.

The bound, for an honest replica in a group of n (liars of any number among the others), per part and so
for its whole pseudo-gradient g: what it steps by, m, satisfies ||m - g|| <= C * (n-1)/n * (1 + 1/qmax) *
||g||, qmax the pseudo-gradient codec's largest code (the slack for its rounding of an average; none at 16
and 32 bits). In a group of two at C = 2 that is ||g|| (times 1 + 1/qmax): the other replica can at most
cancel its update, never reverse or multiply it; alone it would step by g. Among honest replicas nothing is
clipped while no part lies further than C times the reducer's own part's norm from it: the average is then
the plain mean."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["CLIP", "clip_radius", "acceptance_radius", "centred_clip", "takes", "ClipResult", "SenderView",
           "rounding_slack"]

CLIP = 2.0  # a sender's part counts at most this many times the reducer's own part's norm away from it
SLACK = {2: 1 / 1, 4: 1 / 7, 8: 1 / 127}  # 1 / the blockwise codec's largest code, by bits


def rounding_slack(bits: int) -> float:
    """The share of an average's norm its codec may move it by, allowed on top of the radius."""
    return SLACK.get(bits, 0.0)


def clip_radius(own: torch.Tensor, clip: float = CLIP) -> float:
    """How far from the reducer's own part a sender's part counts (beyond: clipped to this distance)."""
    return clip * float(own.double().norm())


def acceptance_radius(own: torch.Tensor, group: int, bits: int, clip: float = CLIP) -> float:
    """How far from its own part a sender takes a reducer's average (an honest one's lies within)."""
    return clip * (group - 1) / group * (1.0 + rounding_slack(bits)) * float(own.double().norm())


@dataclass
class SenderView:
    """What a reducer saw of one sender's parts in a round: the evidence a replica's standing is judged on
    (tahnode.pipeline.peer_standing). Sums over parts, so that a round's cosine is over all of them."""

    parts: int = 0
    unusable: int = 0      # not finite, wrong shape, or not decodable
    clipped: int = 0       # further from the reducer's own part than the clip radius
    dot: float = 0.0       # <sender's part, reducer's own part>, summed over the parts
    sender_sq: float = 0.0
    own_sq: float = 0.0

    @property
    def cosine(self) -> float:
        denominator = (self.sender_sq * self.own_sq) ** 0.5
        return self.dot / denominator if denominator > 0 else 0.0

    @property
    def ratio(self) -> float:
        """Its parts' norm over the reducer's own (0 when the reducer's own parts were zero)."""
        return (self.sender_sq / self.own_sq) ** 0.5 if self.own_sq > 0 else 0.0

    def add(self, other: "SenderView") -> None:
        for name in ("parts", "unusable", "clipped", "dot", "sender_sq", "own_sq"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class ClipResult:
    """A reducer's average of one part and what it saw of each sender (by position; None: its own)."""

    mean: torch.Tensor
    views: list[SenderView | None] = field(default_factory=list)


def centred_clip(parts: list[torch.Tensor | None], own: int, clip: float = CLIP) -> ClipResult:
    """The average of one part: own + (1/k) * sum over the k usable parts of clip(part - own, radius),
    `parts[own]` the reducer's own part (float32, finite), None for a sender's unusable part (left out).
    Without clipping it is the mean of the usable parts."""
    mine = parts[own].double()
    radius = clip_radius(mine, clip)
    total, usable, views = torch.zeros_like(mine), 0, []
    for k, part in enumerate(parts):
        if k == own:
            views.append(None)
            usable += 1
            continue
        view = SenderView(parts=1, own_sq=float(mine.pow(2).sum()))
        views.append(view)
        if part is None:
            view.unusable = 1
            continue
        x = part.double()
        view.dot, view.sender_sq = float((x * mine).sum()), float(x.pow(2).sum())
        difference = x - mine
        distance = float(difference.norm())
        if distance > radius:
            view.clipped = 1
            difference = difference * (radius / distance)
        total += difference
        usable += 1
    return ClipResult((mine + total / usable).to(torch.float32), views)


def takes(own: torch.Tensor, average: torch.Tensor | None, group: int, bits: int, clip: float = CLIP) -> bool:
    """Whether a sender takes a reducer's average for its part: finite, of its shape, and within the
    acceptance radius of its own part."""
    if average is None or average.shape != own.shape or not bool(torch.isfinite(average).all()):
        return False
    # (1 + 1e-5): an honest average on the radius itself (every other part clipped) rounded to float32
    return float((average.double() - own.double()).norm()) <= acceptance_radius(own, group, bits, clip) * (1 + 1e-5)
