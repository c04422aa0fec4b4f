"""The coordinator's link probes, many at once: disjoint pairs in parallel (no node is ever in two
probes), each bounded in time; small capacity probes until every live node has its samples, and
full probes of the pairs placement asks about (`want`)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass

from ..config import PlacementSettings
from .links import LinkBook, ProbeKind
from .registry import SwarmRegistry
from .state import NodeRecord

log = logging.getLogger("tahnode.coordinator")

__all__ = ["Measure", "Prober", "ProbeJob", "serve_jobs"]

# measure(a, b, payload_bytes, timeout_s) -> (Mbit/s, RTT ms) of the link from node a to node b;
# payload_bytes 0 = the node's own sizing (about a second of traffic)
Measure = Callable[[NodeRecord, NodeRecord, int, float], Awaitable[tuple[float, float]]]

FULL_TIMEOUT_S = 60.0
PAIR_ATTEMPTS = 2  # a pair whose probes keep failing is left alone after this many tries
PASS_S = 0.1       # shortest time between two passes that start jobs (each looks at every live node)


@dataclass(frozen=True)
class ProbeJob:
    src: str
    dst: str
    kind: ProbeKind


async def serve_jobs(next_jobs: Callable[[], list[Coroutine]], wake: asyncio.Event) -> None:
    """Run the jobs `next_jobs()` gives each pass (a pass when `wake` is set, or every second), until cancelled,
    which cancels the jobs still running (the prober's link probes, placement's compute measurements)."""
    running: set[asyncio.Task] = set()
    try:
        while True:
            for job in next_jobs():
                task = asyncio.ensure_future(job)
                running.add(task)
                task.add_done_callback(running.discard)
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
            await asyncio.sleep(PASS_S)  # let several finish before the next pass
    finally:
        for task in list(running):
            task.cancel()


class Prober:
    """Runs probe jobs concurrently (`run`) and records them in the LinkBook."""

    def __init__(self, registry: SwarmRegistry, book: LinkBook, measure: Measure, settings: PlacementSettings):
        self.r, self.book, self.measure, self.s = registry, book, measure, settings
        self.busy: set[str] = set()
        self.running: set[tuple[str, str]] = set()
        # full probes placement asked for, in order; True: again, though the pair was probed in full before
        self.wanted: dict[tuple[str, str], bool] = {}
        self.probed_at: dict[tuple[str, str], float] = {}  # when a full probe of a pair last ended (done or failed)
        self.attempts: dict[tuple[str, str], int] = {}
        self.failures: dict[str, int] = {}  # failed probes a node took part in
        self.probe_bytes = 0             # payload asked for by capacity probes (full ones size themselves)
        self.failed = 0
        self._wake = asyncio.Event()
        self._rng = random.Random(0)

    # -- what to probe ------------------------------------------------------------------------
    def want(self, pairs, again: bool = False) -> None:
        """Ask for full probes of these (src, dst) pairs (those not fully probed yet; with `again`,
        each once more, unless it is under way or asked for again already)."""
        for pair in pairs:
            if again and pair not in self.running and not self.wanted.get(pair):
                self.wanted[pair], self.attempts[pair] = True, 0
            elif not self.book.fully_probed(*pair) and self.attempts.get(pair, 0) < PAIR_ATTEMPTS:
                self.wanted.setdefault(pair, False)
        self._wake.set()

    def may_probe(self, pairs) -> bool:
        """Some of these pairs are being probed, or can still be (not tried too often)."""
        return any(pair in self.running or self.attempts.get(pair, 0) < PAIR_ATTEMPTS for pair in pairs)

    def needs_capacity(self, node: str) -> bool:
        """Fewer capacity samples than asked in either direction (and tries left)."""
        sent, received = self.book.capacity_samples(node)
        return (min(sent, received) < self.s.capacity_samples
                and self.failures.get(node, 0) < 2 * self.s.capacity_samples)

    def capacity_known(self, nodes: list[NodeRecord]) -> bool:
        return not any(self.needs_capacity(n.node_id) for n in nodes)

    def candidates(self) -> set[str]:
        """The live nodes placement may move or place (--stage auto, or waiting): they need
        capacity samples; a swarm of pinned holders is never probed."""
        return {n.node_id for n in self.r.live() if n.movable or n.status.waiting}

    def next_jobs(self) -> list[ProbeJob]:
        """Jobs to start now: wanted full probes first, then capacity probes; disjoint pairs of live
        nodes, no node in two jobs, at most `concurrent_probes` running."""
        room = self.s.concurrent_probes - len(self.busy) // 2
        live = {n.node_id for n in self.r.live()}
        jobs: list[ProbeJob] = []
        for pair in list(self.wanted):
            if room <= len(jobs):
                break
            src, dst = pair
            if src not in live or dst not in live or (self.book.fully_probed(src, dst) and not self.wanted[pair]):
                del self.wanted[pair]
            elif src not in self.busy and dst not in self.busy:
                del self.wanted[pair]
                jobs.append(self._take(src, dst, ProbeKind.FULL))
        if room > len(jobs):
            jobs += self._capacity_jobs(sorted(live), self.candidates(), room - len(jobs))
        return jobs

    def _capacity_jobs(self, live: list[str], candidates: set[str], room: int) -> list[ProbeJob]:
        """A candidate's first capacity sample goes to (or comes from) a random idle node; later ones
        to the idle node with the fastest download (from the fastest upload) seen so far, so that
        the sample shows the node's own upload (download), not its partner's."""
        idle = [n for n in live if n not in self.busy]
        if len(idle) < 2 or not any(self.needs_capacity(n) for n in idle if n in candidates):
            return []
        self._rng.shuffle(idle)
        by_down = sorted(idle, key=lambda n: -self.book.down.get(n, 0.0))
        by_up = sorted(idle, key=lambda n: -self.book.up.get(n, 0.0))
        jobs = []
        for node in idle:
            if len(jobs) >= room:
                break
            if node in self.busy or node not in candidates or not self.needs_capacity(node):
                continue
            sent, received = self.book.capacity_samples(node)
            if sent < self.s.capacity_samples and (sent <= received or received >= self.s.capacity_samples):
                dst = self._partner(node, idle if sent == 0 else by_down, outgoing=True)
                if dst is not None:
                    jobs.append(self._take(node, dst, ProbeKind.CAPACITY))
            elif received < self.s.capacity_samples:
                src = self._partner(node, idle if received == 0 else by_up, outgoing=False)
                if src is not None:
                    jobs.append(self._take(src, node, ProbeKind.CAPACITY))
        return jobs

    def _partner(self, node: str, pool: list[str], outgoing: bool) -> str | None:
        """The first idle node of `pool` that `node` has not probed with in that direction."""
        for other in pool:
            pair = (node, other) if outgoing else (other, node)
            if other != node and other not in self.busy and pair not in self.book.probes and pair not in self.attempts:
                return other
        return None

    def _take(self, src: str, dst: str, kind: ProbeKind) -> ProbeJob:
        self.busy.update((src, dst))
        self.running.add((src, dst))
        self.attempts[(src, dst)] = self.attempts.get((src, dst), 0) + 1
        return ProbeJob(src, dst, kind)

    # -- running them ---------------------------------------------------------------------------
    async def _probe(self, job: ProbeJob) -> None:
        try:
            a, b = self.r.nodes.get(job.src), self.r.nodes.get(job.dst)
            if a is None or b is None or not (a.status.live and b.status.live):
                return
            capacity = job.kind is ProbeKind.CAPACITY
            nbytes = self.s.capacity_probe_bytes if capacity else 0
            timeout = self.s.capacity_probe_timeout_s if capacity else FULL_TIMEOUT_S
            self.probe_bytes += nbytes
            mbps, rtt = await asyncio.wait_for(self.measure(a, b, nbytes, timeout), timeout + 5.0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a node that cannot measure is not fatal: the pair stays unmeasured
            self.failed += 1
            for n in (job.src, job.dst):
                self.failures[n] = self.failures.get(n, 0) + 1
            self.r.event(f"probe {job.src} -> {job.dst} failed: {type(exc).__name__}: {exc}")
            return
        finally:
            self.busy.difference_update((job.src, job.dst))
            self.running.discard((job.src, job.dst))
            if job.kind is ProbeKind.FULL:
                self.probed_at[(job.src, job.dst)] = time.monotonic()
            self._wake.set()
        self.book.record(job.src, job.dst, mbps, rtt, job.kind)
        if job.kind is ProbeKind.FULL:
            self.r.event(f"link {job.src} -> {job.dst} measured at {mbps:.1f} Mbit/s, RTT {rtt:.1f} ms")
        else:
            log.info("capacity probe %s -> %s: %.1f Mbit/s, RTT %.1f ms", job.src, job.dst, mbps, rtt)

    async def run(self) -> None:
        """Start jobs whenever nodes are free, until cancelled (which cancels the running probes)."""
        await serve_jobs(lambda: [self._probe(job) for job in self.next_jobs()], self._wake)
