"""What the coordinator knows of each node, as types: its status (an Enum, so a new status is one
line and a typo is an error) and its record (address, stage, speed, last stats)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from ..proto import tahnode_pb2 as pb

__all__ = ["NodeStatus", "NodeRecord", "Census", "STANDBY", "STALL_PROBE_S", "StallClock"]

STANDBY = -1  # the stage number of a node that holds none


class NodeStatus(Enum):
    """Where a node stands in the swarm."""

    JOINING = "joining"  # joined with --stage auto, not placed yet
    # a new id from a host where another id is banned: admitted, placed once that ban ends (coordinator.admission)
    NEWCOMER = "newcomer"
    ACTIVE = "active"    # holds a stage
    STANDBY = "standby"  # placed as a spare: takes over a failed stage
    FAILED = "failed"    # missed its heartbeats
    LEFT = "left"        # said goodbye
    # put out for a while: its neighbours kept refusing its micro-batches (tahnode.coordinator.bans)
    BANNED = "banned"

    def __str__(self) -> str:
        return self.value

    @property
    def live(self) -> bool:
        """Still in the swarm (it heartbeats)."""
        return self in (NodeStatus.JOINING, NodeStatus.ACTIVE, NodeStatus.STANDBY, NodeStatus.NEWCOMER)

    @property
    def waiting(self) -> bool:
        """Live without a stage: a candidate for the next placement."""
        return self in (NodeStatus.JOINING, NodeStatus.STANDBY)


@dataclass
class NodeRecord:
    node_id: str
    address: str
    stage: int
    device: str
    memory_bytes: int = 0
    compute_ms: float = 0.0
    status: NodeStatus = NodeStatus.ACTIVE
    layer_ms: float = 0.0
    joined_at: float = field(default_factory=time.monotonic)
    resume_step: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    stats: pb.TrainingStats = field(default_factory=pb.TrainingStats)
    links: dict = field(default_factory=dict)  # dst node id -> (bytes, seconds)
    pipeline: int = 0                          # the pipeline whose stage it holds (0 while it holds none)
    seen: str = ""                             # its join's caller as the carrier saw it (a ban holds its host)
    averager: str = ""                         # the p2p address of its stage's averager (pipelines in data parallel)
    averager_peer: str = ""                    # that address's peer id
    tls_cert: bytes = b""                      # its data plane's TLS certificate (PEM); b"": plain gRPC
    movable: bool = False                      # joined with --stage auto: rebalancing may move it
    chosen: int = -1                           # the stage it joined for (--stage N): it takes no other; -1: auto
    rejoins: int = 0                           # joins under this id and key after its first (restarts it survived)


STALL_S = 3.0        # the event loop this late means the coordinator stalled (no node is failed for it)
STALL_PROBE_S = 0.5  # how often the event loop's lateness is looked at


class StallClock:
    """How long this process's event loop stalled (blocked, or the process stopped or starved) past STALL_S:
    heartbeats it could not read meanwhile are no node's fault. `beat` every STALL_PROBE_S from a task of the
    loop; `take` at a failure sweep, which may run before that task after a stall, so it looks too."""

    def __init__(self):
        self.last, self.owed = 0.0, 0.0

    def _late(self, now: float) -> float:
        late = now - self.last - STALL_PROBE_S if self.last else 0.0
        return late if late > STALL_S else 0.0

    def beat(self, now: float) -> None:
        self.owed, self.last = self.owed + self._late(now), now

    def take(self, now: float) -> float:
        """Seconds of stall not yet credited to the nodes (0.0 if none, and always before the first beat)."""
        owed, self.owed = self.owed + self._late(now), 0.0
        self.last = now if self.last else 0.0
        return owed


@dataclass
class Census:
    """Figures the registry derives from its records, kept so a heartbeat needs no pass over every
    node: how many nodes were live at the last failure sweep (who holds what: tahnode.coordinator.roster)."""

    live: int = 0
    swept: float = 0.0  # when the last sweep ran (time.monotonic): a join sweeps only if a second has passed
    last_join: float = 0.0  # when the last join was answered (time.monotonic): placement waits for joins to settle
    stalls: StallClock = field(default_factory=StallClock)  # this process's own stalls
