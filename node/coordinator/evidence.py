"""What the coordinator makes of what the replicas of a stage say about each other: a report is evidence,
never a verdict. A replica is put out (banned) when replicas of at least two distinct operators (node keys)
have excluded it from their groups and no replica with standing that averaged with it vouches for it (it
averaged with it cleanly and has not excluded it). An accusation that a vouch contradicts is not borne out:
each of its accusers takes a strike, and a replica with STRIKES strikes has no standing (its word counts
for nothing, accusing or vouching) until its strikes expire.

So one liar cannot get an honest replica banned (one operator), nor can two while one honest replica that
averaged with it vouches; a replica lying to every other replica is banned once two operators excluded it
and no other vouches."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..proto import tahnode_pb2 as pb

__all__ = ["Evidence", "Verdict", "STRIKES", "VOUCH_ROUNDS", "MAX_EVIDENCE_CHARS"]

STRIKES = 3            # accusations not borne out before a replica's word counts for nothing
VOUCH_ROUNDS = 2       # clean rounds together (and no exclusion) that make a replica's word a vouch
STRIKE_S = 600.0       # how long a strike counts
MAX_EVIDENCE_CHARS = 200


@dataclass
class Verdict:
    """The coordinator's decision on one accused replica (by node id)."""

    accused: str
    accusers: list[str]
    evidence: list[str]


@dataclass
class Evidence:
    """Replicas' latest reports on each other, by (reporter, accused) node ids; strikes by reporter.
    `operator(node_id)` names a node's operator (its key)."""

    operator: Callable[[str], bytes]
    clock: Callable[[], float] = time.time
    reports: dict[tuple[str, str], pb.OuterReport] = field(default_factory=dict)
    strikes: dict[str, list[float]] = field(default_factory=dict)
    struck: set[tuple[str, str]] = field(default_factory=set)  # (accuser, accused) already struck

    def take(self, reporter: str, reports: dict[str, pb.OuterReport]) -> None:
        """A reporter's latest word (by accused node id; others' ids are not its replicas: left out)."""
        for accused, report in reports.items():
            if accused != reporter:
                kept = pb.OuterReport()
                kept.CopyFrom(report)
                kept.evidence = report.evidence[:MAX_EVIDENCE_CHARS]
                self.reports[(reporter, accused)] = kept

    def forget(self, node_id: str) -> None:
        """A node gone for good: its word and the word on it."""
        for key in [k for k in self.reports if node_id in k]:
            del self.reports[key]

    def has_standing(self, node_id: str) -> bool:
        now = self.clock()
        recent = [t for t in self.strikes.get(node_id, []) if now - t < STRIKE_S]
        self.strikes[node_id] = recent
        return len(recent) < STRIKES

    def judge(self, accused: str, witnesses: list[str]) -> Verdict | None:
        """The verdict on `accused` from its stage's live replicas `witnesses` (it left out), if there is one;
        strikes for accusers a vouch contradicts."""
        accusers, vouchers = [], []
        for witness in witnesses:
            report = self.reports.get((witness, accused))
            if report is None or witness == accused or not self.has_standing(witness):
                continue
            if report.excluded:
                accusers.append(witness)
            elif report.clean >= VOUCH_ROUNDS and report.clean > report.suspect + report.stalled:
                vouchers.append(witness)
        if not accusers:
            return None
        if vouchers:
            for accuser in accusers:
                if (accuser, accused) not in self.struck:
                    self.struck.add((accuser, accused))
                    self.strikes.setdefault(accuser, []).append(self.clock())
            return None
        if len({self.operator(a) for a in accusers}) < 2:
            return None
        return Verdict(accused, sorted(accusers), [f"{a}: {self.reports[(a, accused)].evidence}" for a in accusers])
