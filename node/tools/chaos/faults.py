"""The fault schedule of `tahnode bench chaos`: which fault comes when and whom it hits, drawn from a
seed so that a run can be repeated. Pure: no process is touched here (run applies the schedule).

A fault comes every `every` seconds after the measurement starts, the last one at least `tail`
seconds before the end (so that the swarm's return to full speed is seen); its kind is drawn from the
kinds asked for, its target from the daemons that no earlier fault still holds (killed and not yet
restarted, stopped, cut off)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from enum import Enum

__all__ = ["FaultKind", "Fault", "FaultTimes", "ScheduleConfig", "ChaosError", "parse_faults", "schedule",
           "COORDINATOR"]

COORDINATOR = "coord"  # the coordinator's name among the swarm's processes (tahnode.tools.swarm)


class ChaosError(ValueError):
    """Bad input to the chaos bench; the message names the flag and what it takes."""


class FaultKind(Enum):
    """What a fault does."""

    KILL = "kill"                 # SIGKILL a daemon, start it again with the same folder after restart_after
    STOP = "stop"                 # SIGSTOP a daemon, SIGCONT after stop_s (longer than the heartbeat timeout)
    CUT = "cut"                   # every packet to or from a daemon dropped for cut_s
    COORDINATOR = "coordinator"   # SIGKILL the coordinator, start it again on the same store after coordinator_down
    OVERLAP = "overlap"           # kill a stage's holder, then whichever node took the stage over, while it resumes

    def __str__(self) -> str:
        return self.value


def parse_faults(text: str) -> tuple[FaultKind, ...]:
    """`kill,stop,cut,coordinator,overlap` (any of them, comma-separated) as kinds; ChaosError names the bad one."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    known = {k.value: k for k in FaultKind}
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ChaosError(f"--faults takes one or more of {', '.join(known)}, comma-separated; got {text!r}")
    return tuple(dict.fromkeys(known[n] for n in names))


@dataclass(frozen=True)
class FaultTimes:
    """How long each kind of fault lasts, in seconds."""

    restart_after: float = 8.0      # kill: the daemon is down this long, then starts again with its folder
    stop_s: float = 15.0            # stop: SIGCONT this long after SIGSTOP
    cut_s: float = 15.0             # cut: the link is down this long
    coordinator_down: float = 5.0   # coordinator: down this long
    overlap_delay: float = 3.0      # overlap: the replacement is killed this long after it took the stage
    takeover_timeout: float = 90.0  # overlap: how long to wait for a replacement before giving up on it

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not value > 0:
                raise ChaosError(f"{name.replace('_', '-')} must be more than 0 seconds; got {value:g}")

    def span(self, kind: FaultKind) -> float:
        """How long a fault of `kind` holds its target (no other fault hits it meanwhile)."""
        return {FaultKind.KILL: self.restart_after, FaultKind.STOP: self.stop_s, FaultKind.CUT: self.cut_s,
                FaultKind.COORDINATOR: self.coordinator_down,
                FaultKind.OVERLAP: self.takeover_timeout + self.overlap_delay + self.restart_after}[kind]

    def seconds(self, kind: FaultKind) -> float:
        """How long a fault of `kind` lasts on its (first) target."""
        return {FaultKind.KILL: self.restart_after, FaultKind.STOP: self.stop_s, FaultKind.CUT: self.cut_s,
                FaultKind.COORDINATOR: self.coordinator_down, FaultKind.OVERLAP: self.restart_after}[kind]


@dataclass(frozen=True)
class Fault:
    """One planned fault. `at`: seconds after the measurement started. `target`: the daemon (kill, stop,
    cut) or the coordinator; an overlap names a (pipeline, stage) instead, since who holds it then is
    known only when it comes."""

    at: float
    kind: FaultKind
    target: str = ""
    pipeline: int = -1
    stage: int = -1
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "kind": self.kind.value}

    @classmethod
    def from_json(cls, doc: dict) -> "Fault":
        return cls(**{**doc, "kind": FaultKind(doc["kind"])})

    @property
    def label(self) -> str:
        """One short line: what, and to whom."""
        if self.kind is FaultKind.OVERLAP:
            return f"overlap p{self.pipeline} s{self.stage}"
        return f"{self.kind.value} {self.target}"


@dataclass(frozen=True)
class ScheduleConfig:
    """What the schedule is drawn from. `daemons`: the names of the stage daemons faults may hit."""

    daemons: tuple[str, ...]
    pipelines: int
    stages: int
    seed: int = 0
    every: float = 30.0
    minutes: float = 10.0
    tail: float = 60.0
    kinds: tuple[FaultKind, ...] = (FaultKind.KILL,)
    times: FaultTimes = field(default_factory=FaultTimes)

    def __post_init__(self):
        if not self.every > 0:
            raise ChaosError(f"--every must be more than 0 seconds; got {self.every:g}")
        if not self.minutes > 0:
            raise ChaosError(f"--minutes must be more than 0; got {self.minutes:g}")
        if self.tail < 0:
            raise ChaosError(f"--tail must be 0 seconds or more; got {self.tail:g}")
        if not self.daemons or self.pipelines < 1 or self.stages < 1:
            raise ChaosError("a schedule needs daemons, at least one pipeline and one stage")
        if self.kinds and self.last < self.every:
            raise ChaosError(f"no fault fits: the first comes --every {self.every:g} s after the start, the last at "
                             f"least --tail {self.tail:g} s before the end of --minutes {self.minutes:g}")

    @property
    def last(self) -> float:
        """The latest time a fault may come (seconds after the start)."""
        return self.minutes * 60 - self.tail


def schedule(cfg: ScheduleConfig) -> list[Fault]:
    """The faults of a run, in time order: one every `every` seconds from `every` to `last`; the same
    config (seed included) gives the same list. A time at which every daemon is still held by an
    earlier fault (a kill, stop or cut drawn) gets no fault."""
    draw = random.Random(cfg.seed)
    busy: dict[str, float] = {}  # target -> when the fault that holds it ends
    out = []
    k = 1
    while cfg.kinds and k * cfg.every <= cfg.last + 1e-9:
        at = round(k * cfg.every, 6)
        k += 1
        kind = draw.choice(cfg.kinds)
        span = cfg.times.span(kind)
        if kind is FaultKind.OVERLAP:
            out.append(Fault(at, kind, pipeline=draw.randrange(cfg.pipelines), stage=draw.randrange(cfg.stages),
                             seconds=cfg.times.seconds(kind)))
            continue
        if kind is FaultKind.COORDINATOR:
            free = [COORDINATOR] if busy.get(COORDINATOR, 0.0) <= at else []
        else:
            free = [d for d in cfg.daemons if busy.get(d, 0.0) <= at]
        if not free:
            continue
        target = draw.choice(free)
        busy[target] = at + span
        out.append(Fault(at, kind, target, seconds=cfg.times.seconds(kind)))
    return out
