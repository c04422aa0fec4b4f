"""Sybils cost something (issue 60, point 6): one operator, known by its node key, holds at most one replica of a
stage, one host at most `--max-per-host` of them (0: no limit), and a new pipeline is never formed wholly of one key's,
one host's or (public addresses) one /24's identities while other pipelines train, since its replicas would average
with no one else's. A node's host is its join's caller as gRPC saw it (`NodeRecord.seen`): one that joined over p2p,
in-process, or whose record the coordinator restored after a restart has none, and only its key counts for it."""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from collections.abc import Awaitable, Callable, Mapping

from ..net.tls import host_of
from .assignment import AssignmentProblem, AssignmentResult
from .roster import Roster
from .state import NodeRecord

__all__ = ["caller_host", "site_of", "SybilLimits"]

SITE_PREFIX = {4: 24, 6: 48}  # the network of one public site: a /24, an IPv6 /48


def caller_host(seen: str) -> str:
    """The host of a caller as gRPC saw it ("ipv4:1.2.3.4:5678": "1.2.3.4"); "" for a p2p caller or none."""
    kind, _, caller = seen.partition(":")
    return host_of(caller) if kind in ("ipv4", "ipv6") else ""


def site_of(host: str) -> str:
    """The /24 (IPv6: /48) of a public host; "" for a private or loopback one (no site: unrelated machines share
    private networks) or none."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return ""
    return str(ipaddress.ip_network(f"{ip}/{SITE_PREFIX[ip.version]}", strict=False)) if ip.is_global else ""


class SybilLimits:
    """Which stages a node may hold, given who holds the stages of the other pipelines (`roster`), the key each node
    id is bound to (`keys`) and `max_per_host`."""

    def __init__(self, roster: Roster, keys: Mapping[str, bytes], max_per_host: int):
        self.roster, self.keys, self.max_per_host = roster, keys, max_per_host
        self._replicas: dict[tuple[int, int | None], list[NodeRecord]] = {}  # as the roster was when first asked

    def replicas(self, stage: int, pipeline: int | None) -> list[NodeRecord]:
        """The holders of `stage` in the pipelines other than `pipeline`."""
        if (stage, pipeline) not in self._replicas:
            self._replicas[(stage, pipeline)] = [h for p in self.roster.pipelines() if p != pipeline
                                                 and (h := self.roster.holder(stage, p)) is not None]
        return self._replicas[(stage, pipeline)]

    def refusal(self, node: NodeRecord, stage: int, pipeline: int | None) -> str:
        """Why `node` may not hold `stage` of `pipeline` (None: a new one); "" if it may: a replica of that stage in
        another pipeline has its key, or its host holds `max_per_host` of them already."""
        others = [h for h in self.replicas(stage, pipeline) if h.node_id != node.node_id]
        key = self.keys.get(node.node_id)
        twin = next((h for h in others if key and self.keys.get(h.node_id) == key), None)
        if twin is not None:
            return (f"{node.node_id} has the node key of {twin.node_id}, which holds stage {stage} in pipeline "
                    f"{twin.pipeline}: one operator holds one replica of a stage")
        host = caller_host(node.seen)
        near = [h.node_id for h in others if host and caller_host(h.seen) == host]
        if self.max_per_host and len(near) >= self.max_per_host:
            return (f"host {host} of {node.node_id} holds {len(near)} replica(s) of stage {stage} already "
                    f"({', '.join(near)}; --max-per-host {self.max_per_host})")
        return ""

    def forbidden(self, candidates: list[NodeRecord], pipeline: int | None) -> dict[str, dict[int, float]]:
        """node id -> {stage: inf} for every stage of `pipeline` (None: a new one) a candidate may not hold: costs
        the assignment search never picks (AssignmentProblem.compute_ms)."""
        out: dict[str, dict[int, float]] = {}
        for n in candidates:
            for stage in range(self.roster.run.stages):
                if self.refusal(n, stage, pipeline):
                    out.setdefault(n.node_id, {})[stage] = math.inf
        return out

    def one_site(self, chain: list[NodeRecord], pipeline: int | None) -> tuple[str, Callable[[NodeRecord], bool]]:
        """Why a chain may not be `pipeline` (None: a new one) while other pipelines train, and who shares what it is
        wholly of (one key, one host, or public addresses of one /24); ("", None) if it may be."""
        if not chain or not [p for p in self.roster.pipelines() if p != pipeline]:
            return "", None
        ids = ", ".join(n.node_id for n in chain)
        keys = {self.keys.get(n.node_id) for n in chain}
        if len(keys) == 1 and None not in keys:
            key = keys.pop()
            return f"{ids} share one node key", lambda n: self.keys.get(n.node_id) == key
        if not self.max_per_host:
            return "", None
        hosts = {caller_host(n.seen) for n in chain}
        if len(hosts) == 1 and "" not in hosts:
            host = hosts.pop()
            return f"{ids} are all on host {host}", lambda n: caller_host(n.seen) == host
        sites = {site_of(h) for h in hosts}
        if len(sites) == 1 and "" not in sites:
            site = sites.pop()
            return f"{ids} are all in {site}", lambda n: site_of(caller_host(n.seen)) == site
        return "", None

    async def vet(self, problem: AssignmentProblem, result: AssignmentResult, pipeline: int | None,
                  solve: Callable[[AssignmentProblem], Awaitable[AssignmentResult]],
                  nodes: Mapping[str, NodeRecord]) -> tuple[AssignmentResult | None, str]:
        """`result`, the search's best chain for `pipeline` (None: a new one) under `problem` (its costs from
        `forbidden`), if it keeps the limits; else the best that does (a chain wholly one key's, host's or site's:
        the search again once with that group kept off each open stage in turn); (None, why) if none does."""
        if any(n not in nodes for n in result.chain):
            return None, "a node of the chain is gone"
        placed = [(k, nodes[n]) for k, n in enumerate(result.chain) if n in (problem.auto or ())]
        why = next((why for k, n in placed if (why := self.refusal(n, k, pipeline))), "")
        if why:  # the search could not keep off a stage some node may not hold
            return None, why
        why, shares = self.one_site([nodes[n] for n in result.chain], pipeline)
        if not why:
            return result, ""
        group = [n for n in problem.nodes if n in nodes and shares(nodes[n])]
        best = None
        for stage in sorted(set(range(problem.num_stages)) - set(problem.pinned.values())):
            costs = {n: {**problem.compute_ms.get(n, {}), stage: math.inf} for n in group}
            try:
                found = await solve(dataclasses.replace(problem, compute_ms={**problem.compute_ms, **costs}))
            except ValueError:
                continue
            if math.isfinite(found.bottleneck_s) and all(n in nodes for n in found.chain) \
                    and not self.one_site([nodes[n] for n in found.chain], pipeline)[0]:
                best = found if best is None or found.bottleneck_s < best.bottleneck_s else best
        return best, ("" if best is not None else f"{why}, and no other chain of the waiting nodes keeps the limits")
