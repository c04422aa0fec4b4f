"""A daemon's part in keeping the replicas of its stage in step: once the coordinator says that two
pipelines or more train, it joins the swarm's DHT and starts its stage's averager (hivemind's,
tahnode.net.averaging), admits only the replicas the coordinator names (less those its stage's standing
excluded or suspended), dials them, and passes on the outer state the coordinator names."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from ..config import NodeConfig
from ..net.errors import PeerUnreachable
from ..net.p2p.host import P2PAddress, P2PHost, is_p2p_address
from ..pipeline.outer_adopt import NamedState, named_past
from ..pipeline.worker import StageWorker
from ..proto import tahnode_pb2 as pb
from .heartbeats import Heartbeats
from .p2p import averaging_host

log = logging.getLogger("tahnode.daemon")

__all__ = ["StageAveraging", "START_WAIT_S", "RETRY_S"]

START_WAIT_S = 60.0  # how long a new stage waits for its averager (DHT, p2p daemon) before it trains anyway
RETRY_S = 5.0        # after an averager failed to start (or to restart), the next try


class StageAveraging:
    """The averager of `worker`'s stage, started on the first assignment that names two pipelines or
    more (`follow(assignment)` with each one: each heartbeat's), restarted when its process ended (checked
    with each), stopped with `stop()`."""

    def __init__(self, cfg: NodeConfig, folder: Path, run_id: str, worker: StageWorker, beats: Heartbeats,
                 node_id: str, warming: asyncio.Future | None = None):
        self.cfg, self.folder, self.run_id, self.node_id = cfg, folder, run_id, node_id
        self.warming = warming  # its DHT, joined while it stood by (StageNode._warm), if it did
        self.w, self.beats = worker, beats
        self.starting: asyncio.Task | None = None
        self.tried = 0.0
        self.averager = None
        self.members: tuple = ()      # the peers its averager admits, and those of them that sit a round out
        self.met: set[str] = set()    # the replicas its p2p daemon dialled
        self.last: pb.Assignment | None = None
        self.restarting: asyncio.Task | None = None
        self.restart_tried = 0.0

    def follow(self, a: pb.Assignment) -> None:
        """How many pipelines train (whom the stage averages with); with two or more, the averager
        starts (again, RETRY_S after a failed start), and admits the replicas the assignment names."""
        outer = self.w.outer
        if outer is None:
            return
        self.last = a
        if self.averager is not None and a.pipelines != outer.pipelines.now:
            self.averager.set_target(outer.group_target() if outer.known is not None else a.pipelines)
        ended = self.averager is not None and a.pipelines < 2 <= outer.pipelines.now
        outer.pipelines.now = a.pipelines
        if ended and self.averager.end_round():  # the other pipeline lost a stage: none comes to the round under way
            log.info("%s: stage %d ends its outer round under way: no other pipeline trains now", self.node_id,
                     self.w.stage)
        outer.named = NamedState.of(a.named_state) if a.HasField("named_state") else None
        if self.averager is not None and named_past(outer) and self.averager.end_round():  # (its own pipeline failed)
            log.info("%s: stage %d ends its outer round of step %d: its replicas took a later outer step",
                     self.node_id, self.w.stage, outer.core.committed)
        if self.averager is not None:
            self._revive()
            self._meet(a)
        failed = self.starting is not None and self.starting.done() and self.averager is None
        if failed and time.monotonic() - self.tried >= RETRY_S:
            self.starting = None  # its DHT or p2p daemon did not come up last time
        if a.pipelines > 1 and a.dht_peers and self.starting is None:
            self.tried = time.monotonic()
            self.starting = asyncio.ensure_future(self._start(list(a.dht_peers)))

    async def started(self, timeout: float = START_WAIT_S) -> None:
        """Wait (at most `timeout` s) for a start that is under way."""
        if self.starting is not None:
            await asyncio.wait({asyncio.shield(self.starting)}, timeout=timeout)

    def _revive(self) -> None:
        """A new averager process in place of one that ended (a crash, a kill), at most every RETRY_S: its
        replica's next round includes it (the same peer id: its members need not know)."""
        if (not self.averager.ended or (self.restarting is not None and not self.restarting.done())
                or time.monotonic() - self.restart_tried < RETRY_S):
            return
        self.restart_tried = time.monotonic()
        log.warning("%s: the averager process of stage %d ended (exit code %s); starting a new one", self.node_id,
                    self.w.stage, self.averager.exitcode)
        self.restarting = asyncio.ensure_future(self._restart())

    async def _restart(self) -> None:
        try:
            await asyncio.to_thread(self.averager.restart)
        except Exception as exc:  # the forkserver did not answer, or the new process did not take the pipe
            log.error("%s: the averager of stage %d did not restart (%s); tried again in %.0f s", self.node_id,
                      self.w.stage, exc, RETRY_S)

    def _meet(self, a: pb.Assignment) -> None:
        """Admit the replicas `a` names, but those its standing excluded (no group, no state: it trusts them no
        more); those it suspended (they stalled the last round) sit the next round out, and may serve a state,
        unless none would be left to average with: then this replica would take that round alone at once while
        the suspended one waited out its timeout, and the two would be a timeout apart from then on, each
        round's wait ending as the other's began (seen in a fault-free swarm of two pipelines)."""
        outer = self.w.outer
        replicas = {P2PAddress.parse(r.address).peer_id: r.address for r in a.replicas if is_p2p_address(r.address)}
        members = sorted(set(replicas) - outer.standing.excluded) + [self.averager.peer_id]
        suspended = sorted(outer.standing.suspended & set(members))
        suspended = suspended if len(members) - len(suspended) >= 2 else []
        outer.known = len(replicas) + 1  # its rounds wait until it knows a replica of every pipeline
        if (members, suspended) != self.members:
            self.members = (members, suspended)
            self.averager.set_members(members)
            self.averager.set_suspended(suspended)
            outer.admitted = len(members) - len(suspended)
            self.averager.set_target(outer.group_target())
        for peer, address in replicas.items():
            if peer not in self.met:
                self.met.add(peer)
                asyncio.ensure_future(self._dial(address))

    async def _dial(self, address: str) -> None:
        try:
            await P2PHost._current.connect(address)
        except PeerUnreachable as exc:
            log.warning("%s: cannot reach a replica of its stage: %s", self.node_id, exc)
            self.met.discard(P2PAddress.parse(address).peer_id)  # tried again with the next assignment

    async def _start(self, dht_peers: list[str]) -> None:
        """Join the DHT and start the averager of this stage's replicas (hivemind's, imported here only)."""
        from ..net.averaging import StageAverager

        w, swarm = self.w, self.w.run_cfg.swarm
        if self.warming is not None:  # (one that failed: started again here)
            await asyncio.gather(asyncio.shield(self.warming), return_exceptions=True)
        try:
            host = await averaging_host(self.cfg, self.folder, dht_peers)
            averager = StageAverager(host.dht, f"tahnode{self.run_id}s{w.stage}", w.outer.outer.numel, swarm.outer_bits,
                                     swarm.outer_clip, state=w.outer.state, feedback=swarm.outer_feedback)
            await asyncio.to_thread(averager.start)  # the first start waits for the forkserver (seconds)
        except Exception as exc:  # the pipeline trains on alone: its outer steps keep its weights
            log.error("%s: the averager of stage %d did not start (%s); the stage trains without averaging",
                      self.node_id, w.stage, exc)
            return
        self.averager = averager
        self.beats.averager = await host.address()
        w.outer.use(averager)
        w.outer.on_standing = lambda: self._meet(self.last) if self.last is not None else None
        if self.last is not None:  # admit the replicas named so far at once: it admits no one before
            self._meet(self.last)
        await w.compute(w.outer.rehash)  # its outer weights' digest, reported from now on: a state others may take
        print(f"{self.node_id}: stage {w.stage} averages with its replicas in the other pipelines (every "
              f"{swarm.outer_every} steps, {swarm.outer_bits}-bit pseudo-gradients"
              f"{', error feedback' if swarm.outer_feedback else ''})", flush=True)

    async def stop(self) -> None:
        if self.starting is not None:
            self.starting.cancel()
            await asyncio.gather(self.starting, return_exceptions=True)
        if self.restarting is not None:  # a thread: the process it starts is shut down below
            await asyncio.gather(self.restarting, return_exceptions=True)
        if self.averager is not None:
            await asyncio.to_thread(self.averager.shutdown)
            self.averager = None
        self.beats.averager = ""
