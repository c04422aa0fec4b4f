"""A replica's judgement of the other replicas of its stage, round by round, from what its averager saw
of them (tahnode.net.averaging.AveragingRound): a replica whose parts again and again pull away from its
own, do not decode, or whose averages it refuses, or that stalls round after round, is excluded from its
groups and reported to the coordinator with the evidence (a report is evidence, never a verdict: the
coordinator judges it beside the other replicas' reports, tahnode.coordinator.evidence).

The clip rule bounds what one round can do (tahnode.train.clip_rule); this bounds how many rounds a liar
gets: SUSPECT_ROUNDS in a row at most, then one round every PAROLE_S (an exclusion ends then, and the next round
held against it excludes it again). A stall costs the round it happened in; the next forms without the
staller, and STALL_ROUNDS in a row exclude it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Offence", "Evidence", "PeerRecord", "PeerStanding", "SUSPECT_ROUNDS", "STALL_ROUNDS", "MIN_COSINE",
           "NORM_RANGE", "PAROLE_S"]

SUSPECT_ROUNDS = 2     # rounds in a row whose evidence is against a replica: it is excluded
STALL_ROUNDS = 3       # rounds in a row it stalled: it is excluded
# an honest replica's parts point the way this replica's own do and are of their scale (measured on llama-tiny:
# docs/benchmarks-log.md, "the averaging plane trusts no one"); below this cosine (pointing away), or outside this
# norm ratio, a round's parts pull away. It was 0.05: late in a run (llama-tiny near step 1900, batches of 4)
# honest replicas' pseudo-gradients met at 0.04, two rounds in a row, and excluded each other for good
MIN_COSINE = 0.0
NORM_RANGE = (0.2, 5.0)
# an exclusion ends this long after it began: an honest replica excluded by mistake is averaged with, and serves
# its state, again (before, for good: a stage that could take no other replica's state made its pipeline regroup
# at every boundary, and the other pipeline wait for it; bench chaos). A liar gets one round per PAROLE_S.
PAROLE_S = 120.0


class Offence(enum.Enum):
    """What a round held against a replica."""

    UNUSABLE = "unusable"    # a part not finite, of the wrong shape, or that did not decode
    CLIPPED = "clipped"      # a part further from this replica's own than the clip radius
    OPPOSED = "opposed"      # parts pointing away from this replica's own (cosine below MIN_COSINE)
    SCALE = "scale"          # parts of another scale (norm ratio outside NORM_RANGE)
    REFUSED = "refused"      # an average it returned, refused (too far from this replica's own part)
    STALLED = "stalled"      # a reducer whose averages never came back, or a sender whose parts never came


@dataclass(frozen=True)
class Evidence:
    """One round's case against a replica, as its report carries it."""

    round: int
    offence: Offence
    cosine: float = 0.0
    ratio: float = 0.0

    def __str__(self) -> str:
        return f"round {self.round}: {self.offence.value} (cosine {self.cosine:.2f}, norm ratio {self.ratio:.2f})"


@dataclass
class PeerRecord:
    """This replica's record of one other replica (by its averager's peer id)."""

    clean: int = 0            # rounds averaged together with nothing against it
    suspect: int = 0          # rounds with evidence against it
    stalled: int = 0          # rounds it stalled
    suspect_in_a_row: int = 0
    stalled_in_a_row: int = 0
    excluded: bool = False
    excluded_at: float = 0.0  # when (PeerStanding.clock) it was excluded last
    last: Evidence | None = None


@dataclass
class PeerStanding:
    """Records of the other replicas; `excluded` are averaged with no more, `suspended` not in the next round."""

    records: dict[str, PeerRecord] = field(default_factory=dict)
    suspended: set[str] = field(default_factory=set)
    clock: Callable[[], float] = time.monotonic

    @property
    def excluded(self) -> set[str]:
        """The replicas excluded now (an exclusion PAROLE_S old ends as it is read; the daemon reads it with each
        assignment, and admits the replica again)."""
        now = self.clock()
        for record in self.records.values():
            if record.excluded and now - record.excluded_at >= PAROLE_S:
                record.excluded = False
        return {peer for peer, record in self.records.items() if record.excluded}

    def judge(self, round: int, result, own: str) -> list[str]:
        """Take one round's result (an AveragingRound of the replica whose averager is `own`); the peers it
        newly excludes."""
        self.suspended = set()
        newly, excluded = [], self.excluded
        for peer in set(result.peers) | set(result.views) | set(result.refused) | result.stalled | result.silent:
            if peer == own:
                continue
            record = self.records.setdefault(peer, PeerRecord())
            evidence = self._evidence(round, peer, result)
            if evidence is None:
                record.clean += 1
                record.suspect_in_a_row = record.stalled_in_a_row = 0
                continue
            record.last = evidence
            if evidence.offence is Offence.STALLED:
                record.stalled += 1
                record.stalled_in_a_row += 1
                self.suspended.add(peer)
            else:
                record.suspect += 1
                record.suspect_in_a_row += 1
            if peer not in excluded and (record.suspect_in_a_row >= SUSPECT_ROUNDS
                                         or record.stalled_in_a_row >= STALL_ROUNDS):
                record.excluded, record.excluded_at = True, self.clock()
                newly.append(peer)
        return newly

    @staticmethod
    def _evidence(round: int, peer: str, result) -> Evidence | None:
        view = result.views.get(peer)
        cosine, ratio = (view.cosine, view.ratio) if view is not None else (0.0, 0.0)
        if peer in result.stalled or peer in result.silent:
            return Evidence(round, Offence.STALLED, cosine, ratio)
        if view is not None and view.unusable:
            return Evidence(round, Offence.UNUSABLE, cosine, ratio)
        if result.refused.get(peer):
            return Evidence(round, Offence.REFUSED, cosine, ratio)
        if view is None or not view.parts:
            return None
        if view.clipped:
            return Evidence(round, Offence.CLIPPED, cosine, ratio)
        if not NORM_RANGE[0] <= ratio <= NORM_RANGE[1]:
            return Evidence(round, Offence.SCALE, cosine, ratio)
        if cosine < MIN_COSINE:
            return Evidence(round, Offence.OPPOSED, cosine, ratio)
        return None
