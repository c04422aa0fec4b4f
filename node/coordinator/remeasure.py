"""Measuring a chain again before it is refused for its speed (issue 61, point 5): a node's compute, measured once as
it joined, may have been measured while other daemons loaded its machine, and a link only by small capacity probes.
Before a new pipeline is refused for being slower than `min_chain_share` of the fastest, its nodes measure their
compute again (asked of each node, as the coordinator asks for link probes) and its links are probed in full again;
the verdict waits for these, at most REMEASURE_WAIT_S."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

from .probing import Prober, serve_jobs
from .registry import SwarmRegistry
from .state import NodeRecord

log = logging.getLogger("tahnode.coordinator")

__all__ = ["MeasureCompute", "Remeasure", "REMEASURE_WAIT_S", "COMPUTE_TIMEOUT_S"]

# measure_compute(node, timeout_s) -> its forward+backward time of one layer on one micro-batch, ms
MeasureCompute = Callable[[NodeRecord, float], Awaitable[float]]

REMEASURE_WAIT_S = 30.0  # a chain measured again is judged at most this long after it was first found too slow
COMPUTE_TIMEOUT_S = 20.0


class Remeasure:
    """The measurements of chains found too slow: `pending(chain)` asks for them and says whether they are still
    under way; `run()` asks the nodes for their compute, never while a node is in a link probe (`prober.busy`)."""

    def __init__(self, registry: SwarmRegistry, prober: Prober, measure_compute: MeasureCompute | None):
        self.r, self.prober, self.measure_compute = registry, prober, measure_compute
        self.since: float | None = None      # when the chain under judgement was first found too slow
        self.asked: dict[str, float] = {}     # node -> when its compute was last asked for
        self.measured: dict[str, float] = {}  # node -> when its compute was last measured on request (done or failed)
        self.wanted: dict[str, None] = {}     # nodes to measure, in order
        self._wake = asyncio.Event()

    def pending(self, chain: list[str], links: list[tuple[str, str]]) -> bool:
        """Whether `chain`, just found too slow, is still being measured again (what was not, since it was first
        found so, is asked for); False once every node and link of it was, or REMEASURE_WAIT_S have passed."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
            self.r.event(f"the chain {' -> '.join(chain)} looks too slow for a new pipeline: its nodes' compute and "
                         "its links are measured again before it is judged")
        nodes = [n for n in chain if self.measure_compute is not None and self.measured.get(n, -math.inf) < self.since]
        pairs = [pair for pair in links if self.prober.probed_at.get(pair, -math.inf) < self.since]
        if not (nodes or pairs) or now - self.since >= REMEASURE_WAIT_S:
            self.since = None
            return False
        self.prober.want(pairs, again=True)
        for n in nodes:
            if self.asked.get(n, -math.inf) < self.since:  # once per judgement
                self.asked[n] = now
                self.wanted[n] = None
        self._wake.set()
        return True

    def done(self) -> None:
        """The chain under judgement was judged (formed, refused, or the swarm changed)."""
        self.since = None

    async def _measure(self, node_id: str) -> None:
        try:
            node = self.r.nodes.get(node_id)
            if node is None or not node.status.live:
                return
            before = node.layer_ms
            layer_ms = await asyncio.wait_for(self.measure_compute(node, COMPUTE_TIMEOUT_S), COMPUTE_TIMEOUT_S + 5)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a node that cannot measure is not fatal: its compute stays as it reported
            self.r.event(f"measuring the compute of {node_id} again failed: {type(exc).__name__}: {exc}")
            return
        finally:
            self.prober.busy.discard(node_id)
            self.measured[node_id] = time.monotonic()
        if layer_ms > 0:  # its own heartbeats report it from now on, too
            node.layer_ms = layer_ms
            self.r.event(f"compute of {node_id} measured again: {layer_ms:.3g} ms per layer (it reported "
                         f"{before:.3g} ms)")

    async def run(self) -> None:
        """Measure the wanted nodes' compute, each while it is in no probe, until cancelled."""
        await serve_jobs(self._next, self._wake)

    def _next(self) -> list:
        """The measurements to start now: of the wanted nodes in no probe (each then counts as busy)."""
        jobs = []
        for node_id in [n for n in self.wanted if n not in self.prober.busy]:
            del self.wanted[node_id]
            self.prober.busy.add(node_id)
            jobs.append(self._measure(node_id))
        return jobs
