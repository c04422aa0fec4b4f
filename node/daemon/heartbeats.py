"""Heartbeats every second from the join on: the stage's stats and link counters once it has a
worker, the latest assignment for whoever waits on it, and a rejoin if the coordinator forgot us."""

from __future__ import annotations

import asyncio
import logging

from ..config import AUTO_STAGE
from ..net.errors import Banned, CoordinatorError, StageTaken, UnknownNode
from ..net.transport import BACKWARD, FORWARD, Transport
from ..pipeline.worker import StageWorker
from ..proto import tahnode_pb2 as pb
from .membership import CoordinatorClient

log = logging.getLogger("tahnode.daemon")

__all__ = ["Heartbeats", "peak_rss_bytes"]

FINISH_POLL_S = 0.2  # how often a node that trained its last step asks whether the whole run finished


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports kilobytes, macOS bytes)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class Heartbeats:
    """Reports to the coordinator every `period` seconds; `next_assignment()` waits for a reply."""

    def __init__(self, coord: CoordinatorClient, join: pb.JoinRequest, transport: Transport, period: float = 1.0):
        self.coord, self.join, self.t, self.period = coord, join, transport, period
        self.layer_ms = 0.0
        self.averager = ""  # where its stage's averager is reached (pipelines in data parallel)
        self.worker: StageWorker | None = None
        self.assignment: pb.Assignment | None = None
        self.run_finished = False
        self.changed = asyncio.Event()
        self.dismissed = asyncio.Event()  # set when the coordinator bans this node: `dismissal` says why
        self.dismissal = ""
        self.task: asyncio.Task | None = None

    def attach(self, worker: StageWorker) -> None:
        """From now on, report this worker's stats (and rejoin holding its stage)."""
        self.worker = worker

    def measured(self, layer_ms: float) -> None:
        """This node's compute speed: one layer's forward+backward on one micro-batch."""
        self.layer_ms = layer_ms

    async def report(self) -> pb.HeartbeatReply:
        req = pb.HeartbeatRequest(node_id=self.join.node_id, layer_ms=self.layer_ms, averager=self.averager)
        for reason, count in self.coord.sealer.guard.refused.items():
            req.stats.refused[reason.value] = count
        sent = 0
        if self.worker is not None:
            req.stats.MergeFrom(self.worker.stats.report(self.worker.committed, self.worker.codecs.cache_bytes()))
            if self.worker.outer is not None:
                outer = self.worker.outer
                req.stats.outer.update(outer.report())
                state = outer.outer_state()
                if state is not None:
                    req.outer_state.step, req.outer_state.digest = state
                for peer, record in sorted(outer.standing.records.items()):
                    req.stats.outer_reports.add(peer=peer, suspect=record.suspect, stalled=record.stalled,
                                                clean=record.clean, excluded=record.excluded,
                                                evidence=str(record.last or ""))
            req.stats.peak_rss_bytes = peak_rss_bytes()
            sent = len(req.stats.losses) + len(req.stats.skipped)
            counters = (self.t.counters(FORWARD), self.t.counters(BACKWARD))
            req.stats.wire_bytes = sum(c.bytes for c in counters)  # whole envelopes: labels and ids too
            for c in counters:
                if c.peer:
                    req.links.add(dst=c.peer, bytes=c.bytes, seconds=c.seconds)
        hb = await self.coord.heartbeat(req)
        if self.worker is not None:
            self.worker.stats.reported(sent)
        self.assignment, self.run_finished = hb.assignment, hb.run_finished
        if hb.heartbeat_s > 0:  # a large swarm asks for fewer heartbeats
            self.period = hb.heartbeat_s
        self.changed.set()
        return hb

    async def _loop(self) -> None:
        while not self.dismissed.is_set():  # a banned node stops reporting (its daemon saves and exits)
            try:
                await self.report()
            except UnknownNode as exc:  # declared failed while we were busy, or a restarted coordinator: join again
                log.warning("heartbeat: %s", exc)
                await self._rejoin()
            except CoordinatorError as exc:
                log.warning("heartbeat: %s", exc)
            await asyncio.sleep(self.period)

    def start(self) -> None:
        self.task = asyncio.create_task(self._loop())

    async def next_assignment(self) -> pb.Assignment:
        self.changed.clear()
        await self.changed.wait()
        return self.assignment

    async def stop(self, wait_s: float = 30.0) -> None:
        """A last report, so the coordinator sees the final step and the finished flag; while
        committed steps are still unreported (the coordinator is restarting), try again for up to
        `wait_s` seconds, rejoining if it forgot this node."""
        if self.task:
            self.task.cancel()
        deadline = asyncio.get_running_loop().time() + wait_s
        while not self.dismissed.is_set():  # banned: nothing it reports is taken
            try:
                await self.report()
                return
            except UnknownNode:
                await self._rejoin()
            except CoordinatorError as exc:
                if not self._unreported() or asyncio.get_running_loop().time() > deadline:
                    if self._unreported():
                        log.warning("the coordinator did not take the last %d steps' report: %s",
                                    self._unreported(), exc)
                    return
            await asyncio.sleep(self.period)

    async def until_run_finished(self, wait_s: float) -> bool:
        """After this node's last step: report until the coordinator says the run finished (the last
        stage's final report reached it), for at most `wait_s` seconds, so that the stage this node
        leaves next is not handed to a standby. False if it did not say so in time."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while not self.run_finished and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(FINISH_POLL_S)
            try:
                await self.report()
            except CoordinatorError as exc:
                log.warning("heartbeat: %s", exc)
                return False
        return self.run_finished

    def _unreported(self) -> int:
        return len(self.worker.stats.outbox) if self.worker is not None else 0

    def detach(self) -> None:
        """This node no longer holds a stage: report no stage stats, rejoin as --stage auto."""
        self.worker = None

    async def _rejoin(self) -> None:
        self.join.stage = self.worker.stage if self.worker is not None else AUTO_STAGE
        try:
            try:
                await self.coord.join(self.join, wait_s=0)
            except StageTaken as exc:  # declared failed meanwhile, and its stage went to another node
                log.warning("rejoin: %s; joining as --stage auto", exc)
                self.join.stage = AUTO_STAGE
                reply = await self.coord.join(self.join, wait_s=0)
                self.assignment = reply.assignment
                self.changed.set()  # the follower sees that the stage is gone
            log.info("rejoined the coordinator")
        except Banned as exc:
            log.error("rejoin: %s", exc)
            self.dismissal = str(exc)
            self.dismissed.set()
        except CoordinatorError as again:
            log.warning("rejoin: %s", again)
