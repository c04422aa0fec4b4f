"""What the coordinator knows of the links between nodes: probes (small capacity probes and full
ones), the rates real traffic achieved, and from these an estimate for every pair, probed or not.

The estimate of a pair nobody probed follows the access-link model of home connections: a link
a -> b runs at min(upload of a, download of b). A probe a -> x shows a's upload only if x could
take more (it fell clearly below the fastest rate seen arriving at x); otherwise a's upload may be
anything above it, and is taken to be as fast as the fastest upload seen anywhere: optimism, so
that placement tries such a node, and its full probes then tell. So N nodes need O(N) probes, not
N^2, for placement to rank them; full probes then check the few pairs placement wants to use."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum

__all__ = ["ProbeKind", "LinkProbe", "LinkBook", "EstimatedMbps"]

TRAFFIC_WINDOW_S = 10.0  # real traffic is turned into a rate over windows this long
BELOW = 0.85  # a probe below this share of what its partner showed elsewhere was limited by this node


class ProbeKind(Enum):
    """How a pair was measured."""

    CAPACITY = "capacity"  # a small, bytes-bounded probe: ranks the nodes' upload and download
    FULL = "full"          # the node's own sizing (about a second of traffic): trusted for placement

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class LinkProbe:
    mbps: float
    rtt_ms: float
    kind: ProbeKind


class LinkBook:
    """Every measurement of the swarm's directed links, and the per-node capacities they imply."""

    def __init__(self, default_mbps: float):
        self.default_mbps = default_mbps
        self.probes: dict[tuple[str, str], LinkProbe] = {}
        self.best: dict[tuple[str, str], float] = {}  # the fastest any probe of a pair ever showed
        # (Mbit/s real traffic reached at least, bytes) per pair
        self.observed: dict[tuple[str, str], tuple[float, int]] = {}
        # (bytes, when) at the start of each traffic window
        self.marks: dict[tuple[str, str], tuple[int, float]] = {}
        self.up: dict[str, float] = {}    # fastest rate seen leaving a node
        self.down: dict[str, float] = {}  # fastest rate seen arriving at a node
        self.sent: dict[str, int] = {}    # capacity probes a node sent
        self.received: dict[str, int] = {}
        self.outgoing: dict[str, list[tuple[str, float]]] = {}  # node -> (partner, Mbit/s) of its probes
        self.incoming: dict[str, list[tuple[str, float]]] = {}
        self.top_up = self.top_down = 0.0  # the fastest upload and download seen anywhere

    def record(self, src: str, dst: str, mbps: float, rtt_ms: float, kind: ProbeKind) -> None:
        """A probe's result; a capacity probe never replaces a full one of the same pair."""
        old = self.probes.get((src, dst))
        if old is None or kind is ProbeKind.FULL or old.kind is ProbeKind.CAPACITY:
            self.probes[(src, dst)] = LinkProbe(mbps, rtt_ms, kind)
        self.best[(src, dst)] = max(mbps, self.best.get((src, dst), 0.0))
        if kind is ProbeKind.CAPACITY:
            self.sent[src] = self.sent.get(src, 0) + 1
            self.received[dst] = self.received.get(dst, 0) + 1
        self.outgoing.setdefault(src, []).append((dst, mbps))
        self.incoming.setdefault(dst, []).append((src, mbps))
        self._seen(src, dst, mbps)

    def observe(self, src: str, dst: str, nbytes: int, now: float, slack_s: float) -> None:
        """The bytes src has sent dst so far (its counters, as of its last heartbeat, at most
        `slack_s` old). Over each TRAFFIC_WINDOW_S, the traffic shows the link reached at least
        new bytes / (elapsed + slack): a lower bound, so it may raise an estimate, never lower it."""
        mark = self.marks.get((src, dst))
        if mark is None or nbytes < mark[0]:  # first seen, or its counters started again (a restart)
            self.marks[(src, dst)] = (nbytes, now)
            return
        if now - mark[1] < TRAFFIC_WINDOW_S:
            return
        self.marks[(src, dst)] = (nbytes, now)
        mbps = (nbytes - mark[0]) * 8 / (now - mark[1] + slack_s) / 1e6
        best = max(mbps, self.observed.get((src, dst), (0.0, 0))[0])
        self.observed[(src, dst)] = (best, nbytes)
        if best > 0:
            self._seen(src, dst, best)

    def _seen(self, src: str, dst: str, mbps: float) -> None:
        self.up[src] = max(self.up.get(src, 0.0), mbps)
        self.down[dst] = max(self.down.get(dst, 0.0), mbps)
        self.top_up, self.top_down = max(self.top_up, mbps), max(self.top_down, mbps)

    def measured(self, src: str, dst: str) -> float | None:
        """The pair's own figure: its probe, raised by what real traffic reached; None if neither."""
        probe, seen = self.probes.get((src, dst)), self.observed.get((src, dst))
        rates = [x for x in (probe.mbps if probe else None, seen[0] if seen else None) if x is not None]
        return max(rates) if rates else None

    def fully_probed(self, src: str, dst: str) -> bool:
        probe = self.probes.get((src, dst))
        return probe is not None and probe.kind is ProbeKind.FULL

    def estimate(self, src: str, dst: str) -> float:
        """Mbit/s of src -> dst: measured, else min(upload of src, download of dst), else the default."""
        mbps = self.measured(src, dst)
        if mbps is not None:
            return mbps
        return min(self.upload(src), self.download(dst))

    def upload(self, node: str) -> float:
        """What the node's upload is taken to be: the default if nothing left it yet; the fastest
        upload seen anywhere if one of its probes may have been limited by the receiver; else its
        best probe (over BELOW, the path's share); never below what its traffic reached."""
        return self._capacity(self.outgoing.get(node), self.down, self.top_up, self.up.get(node))

    def download(self, node: str) -> float:
        return self._capacity(self.incoming.get(node), self.up, self.top_down, self.down.get(node))

    def _capacity(self, samples, partner_best: dict[str, float], top: float, seen: float | None) -> float:
        if not samples:
            return seen or self.default_mbps
        bound = 0.0
        for partner, mbps in samples:
            if mbps >= BELOW * partner_best.get(partner, 0.0):  # the partner's side may have been the limit
                return top
            bound = max(bound, mbps / BELOW)
        return max(bound, seen or 0.0)

    def capacity_samples(self, node: str) -> tuple[int, int]:
        """(capacity probes sent, received) by the node."""
        return self.sent.get(node, 0), self.received.get(node, 0)

    def pairs(self) -> list[tuple[str, str]]:
        """Every pair with a probe or traffic, sorted."""
        return sorted(set(self.probes) | set(self.marks))

    def estimates(self, best: bool = False) -> EstimatedMbps:
        """A read-only snapshot for the assignment search (safe to use from another thread); with
        `best`, each probed pair at the fastest it ever showed (a link probed while it carried the
        training's traffic shows less than it has: the chain in use is judged by its best)."""
        return EstimatedMbps(self, best)


class EstimatedMbps(Mapping):
    """(src, dst) -> estimated Mbit/s for every pair of nodes: a LinkBook's estimates frozen at one
    moment (each node's upload and download worked out once)."""

    def __init__(self, book: LinkBook, best: bool = False):
        self.probes = dict(book.best) if best else {pair: probe.mbps for pair, probe in book.probes.items()}
        for pair, (mbps, _) in book.observed.items():
            self.probes[pair] = max(mbps, self.probes.get(pair, 0.0))
        nodes = set(book.outgoing) | set(book.incoming) | set(book.up) | set(book.down)
        self.up = {n: book.upload(n) for n in nodes}
        self.down = {n: book.download(n) for n in nodes}
        self.default_mbps = book.default_mbps

    def __getitem__(self, pair: tuple[str, str]) -> float:
        mbps = self.probes.get(pair)
        if mbps is not None:
            return mbps
        return min(self.up.get(pair[0], self.default_mbps), self.down.get(pair[1], self.default_mbps))

    def get(self, pair, default=None) -> float:
        return self[pair]

    def __contains__(self, pair) -> bool:
        return True

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(sorted(self.probes))

    def __len__(self) -> int:
        return len(self.probes)
