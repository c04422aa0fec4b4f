"""Stage assignment: which node holds which pipeline stage so that the pipeline's bottleneck
(the slowest link transfer or stage compute per micro-batch) is as small as it can be.

The cost model (docs/architecture.md, The coordinator). For a chain (n_0, ..., n_{K-1}):

    link(k)    = max(activation_bytes * 8 / bw(n_k -> n_k+1), gradient_bytes * 8 / bw(n_k+1 -> n_k))
    compute(k) = compute seconds of node n_k on stage k
    bottleneck = max(max_k link(k), max_k compute(k))              (seconds per micro-batch)

`bw` is the measured directional bandwidth in Mbit/s; a pair that has not been measured counts
as `default_mbps` (10 Mbit/s unless set: pessimistic, so a measured link is preferred to an
unknown one of the same nominal speed), and a bandwidth <= 0 makes the link unusable (infinite).

Search. Up to `exact_limit` (12) candidate nodes: an exact branch and bound over every placement
of the auto nodes into the open stages, seeded with the heuristic's chain as the bound, with a
per-stage lower bound on what is still to come; among the chains with that optimal bottleneck
it then takes those whose slowest link is fastest (so a compute-bound pipeline still avoids a
slow link), and of these the first in node-id order. Beyond: a heuristic in the spirit of DT-FM
and Petals: build a chain greedily from every possible stage-0 node (each step takes the node
with the cheapest incoming link + compute, looking one pinned stage ahead), then improve the best
few chains by local search (swap two stages' nodes, or swap a chain node for a spare) under the
objective "bottleneck, then the next worst cost, ...", until no move improves. Ties always go
to the smaller node id, so the result is deterministic.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["AssignmentProblem", "AssignmentResult", "assign", "chain_bottleneck", "DEFAULT_MBPS"]

DEFAULT_MBPS = 10.0  # bandwidth assumed for a link that has not been measured yet


@dataclass
class AssignmentProblem:
    """Everything the assignment needs. Units: bytes, Mbit/s (1e6 bit/s), milliseconds.

    nodes:          every candidate node id (pinned and auto).
    num_stages:     K, the pipeline's stage count.
    pinned:         node id -> stage for nodes started with `--stage N`.
    auto:           the unpinned nodes the search may place; None = every unpinned node. Nodes
                    that end up in no stage are the standbys.
    mbps:           measured bandwidth of (src, dst), directional.
    activation_bytes / gradient_bytes: bytes of one micro-batch's forward activations (sent
                    k -> k+1) and backward gradients (sent k+1 -> k); gradient_bytes None = same
                    as activation_bytes.
    compute_ms:     node -> per-stage compute time (a list indexed by stage or a {stage: ms} map).
    layer_ms, stage_layers: fallback when compute_ms lacks a node/stage: node's per-layer time
                    times the stage's layer count. With neither, compute counts as 0.
    default_mbps:   bandwidth of an unmeasured pair.
    exact_limit:    largest node count searched exactly.
    budget_s:       seconds the heuristic may take: past it, it returns the best chain found so far.
    """

    nodes: Sequence[str]
    num_stages: int
    pinned: Mapping[str, int] = field(default_factory=dict)
    auto: Sequence[str] | None = None
    mbps: Mapping[tuple[str, str], float] = field(default_factory=dict)
    activation_bytes: float = 0.0
    gradient_bytes: float | None = None
    compute_ms: Mapping[str, Sequence[float] | Mapping[int, float]] = field(default_factory=dict)
    layer_ms: Mapping[str, float] = field(default_factory=dict)
    stage_layers: Sequence[int] | None = None
    default_mbps: float = DEFAULT_MBPS
    exact_limit: int = 12
    budget_s: float = math.inf
    ring: bool = False  # a tied model: the last stage also sends to stage 0 (RunConfig.ring)


@dataclass
class AssignmentResult:
    """chain[k] holds stage k; standbys are the nodes not in the chain (in id order)."""

    chain: list[str]
    standbys: list[str]
    bottleneck_s: float
    bottleneck: str          # what limits the pipeline, e.g. "link a->b at 20 Mbit/s (activations)"
    method: str              # "exact" or "heuristic"

    def stage_of(self, node_id: str) -> int:
        """The node's stage, or -1 for a standby."""
        return self.chain.index(node_id) if node_id in self.chain else -1


# -- the cost model -----------------------------------------------------------------------------

class _Costs:
    """Per-link and per-(node, stage) costs in seconds, computed once per problem."""

    def __init__(self, p: AssignmentProblem):
        self.p = p
        self.grad_bytes = p.activation_bytes if p.gradient_bytes is None else p.gradient_bytes
        self._link: dict[tuple[str, str], float] = {}

    def bw(self, src: str, dst: str) -> float:
        return float(self.p.mbps.get((src, dst), self.p.default_mbps))

    def transfer(self, nbytes: float, src: str, dst: str) -> float:
        if nbytes <= 0:
            return 0.0
        bw = self.bw(src, dst)
        return math.inf if bw <= 0 else nbytes * 8 / (bw * 1e6)

    def link(self, a: str, b: str) -> float:
        """Seconds per micro-batch of the link a (stage k) -> b (stage k+1), both directions."""
        c = self._link.get((a, b))
        if c is None:
            c = max(self.transfer(self.p.activation_bytes, a, b), self.transfer(self.grad_bytes, b, a))
            self._link[(a, b)] = c
        return c

    def compute(self, node: str, stage: int) -> float:
        per_stage = self.p.compute_ms.get(node)
        if per_stage is not None:
            try:
                return float(per_stage[stage]) / 1e3
            except (KeyError, IndexError):
                pass
        if node in self.p.layer_ms and self.p.stage_layers is not None:
            return float(self.p.layer_ms[node]) * self.p.stage_layers[stage] / 1e3
        return 0.0

    def elements(self, chain: Sequence[str]) -> list[float]:
        """Every cost of the chain: one per stage (compute) and one per link."""
        return [self.compute(n, k) for k, n in enumerate(chain)] + [self.link(a, b) for a, b in self.pairs(chain)]

    def pairs(self, chain: Sequence[str]) -> list[tuple[str, str]]:
        """The chain's links (a sends forward to b), with the one closing a ring."""
        return list(zip(chain, chain[1:])) + ([(chain[-1], chain[0])] if self.p.ring and len(chain) > 1 else [])

    def bottleneck(self, chain: Sequence[str]) -> float:
        return max(self.elements(chain))

    def describe(self, chain: Sequence[str]) -> str:
        """Names the cost that sets the bottleneck (the first one in stage order on a tie)."""
        worst, text = -1.0, ""
        links = dict(self.pairs(chain))
        for k, n in enumerate(chain):
            c = self.compute(n, k)
            if c > worst:
                worst, text = c, f"compute of {n} on stage {k} ({c * 1e3:.3g} ms)"
            if n in links:
                b = links[n]
                fwd = self.transfer(self.p.activation_bytes, n, b)
                bwd = self.transfer(self.grad_bytes, b, n)
                if fwd > worst:
                    worst, text = fwd, f"link {n}->{b} at {self.bw(n, b):.4g} Mbit/s (activations)"
                if bwd > worst:
                    worst, text = bwd, f"link {b}->{n} at {self.bw(b, n):.4g} Mbit/s (gradients)"
        return text


def chain_bottleneck(problem: AssignmentProblem, chain: Sequence[str]) -> tuple[float, str]:
    """(seconds per micro-batch, what sets it) of a given chain under the problem's cost model."""
    if len(chain) != problem.num_stages:
        raise ValueError(f"a chain for {problem.num_stages} stages needs {problem.num_stages} nodes, got {len(chain)}")
    costs = _Costs(problem)
    return costs.bottleneck(chain), costs.describe(chain)


# -- validation -----------------------------------------------------------------------------------

def _validate(p: AssignmentProblem) -> tuple[list[str | None], list[str]]:
    """(slots: the pinned node of each stage or None, auto: the candidates in id order)."""
    if p.num_stages < 1:
        raise ValueError(f"the pipeline needs at least one stage, got num_stages={p.num_stages}")
    if len(set(p.nodes)) != len(p.nodes):
        dup = sorted({n for n in p.nodes if list(p.nodes).count(n) > 1})
        raise ValueError(f"node ids must be unique; repeated: {', '.join(dup)}")
    if p.activation_bytes < 0 or (p.gradient_bytes or 0) < 0:
        raise ValueError("activation_bytes and gradient_bytes must be >= 0")
    known = set(p.nodes)
    slots: list[str | None] = [None] * p.num_stages
    for node in sorted(p.pinned):
        stage = p.pinned[node]
        if node not in known:
            raise ValueError(f"pinned node {node!r} is not among the nodes")
        if not 0 <= stage < p.num_stages:
            raise ValueError(f"node {node!r} pins stage {stage}, but the pipeline has stages 0..{p.num_stages - 1}")
        if slots[stage] is not None:
            raise ValueError(f"nodes {slots[stage]!r} and {node!r} both pin stage {stage}")
        slots[stage] = node
    auto = sorted(n for n in known if n not in p.pinned) if p.auto is None else sorted(set(p.auto))
    for n in auto:
        if n not in known:
            raise ValueError(f"auto node {n!r} is not among the nodes")
        if n in p.pinned:
            raise ValueError(f"node {n!r} is both pinned (stage {p.pinned[n]}) and auto")
    open_stages = [k for k, s in enumerate(slots) if s is None]
    if len(auto) < len(open_stages):
        raise ValueError(
            f"{len(open_stages)} open stage(s) ({', '.join(map(str, open_stages))}) but only "
            f"{len(auto)} auto node(s){' (' + ', '.join(auto) + ')' if auto else ''}: "
            f"start more nodes with --stage auto or pin fewer stages")
    return slots, auto


# -- exact search ---------------------------------------------------------------------------------

def _exact(costs: _Costs, slots: list[str | None], auto: list[str], incumbent: list[str]) -> list[str]:
    """The optimal chain: the smallest bottleneck; among those, the fastest slowest link (compute
    may set the bottleneck, but a chain that also avoids a slow link stays fast when the traffic,
    not the compute, turns out to limit it); then the first in node-id order.

    Branch and bound over stages 0..K-1, state (stage k, node on k, set of auto nodes used).
    `optimum` finds the best bottleneck of a cost matrix: children best-first, anything not
    strictly better than the best chain so far (initially the given bound) is cut, and so is a
    child whose lower bound on the stages still open is not better. Since the best only
    decreases, a state whose subtree held nothing better than the best can never help again: a
    table of such states bounds the work by the number of states (<= 12 * 2^12), whatever the
    instance. It runs twice: on the real costs (the bottleneck B), then on the links alone with
    compute above B forbidden (the slowest link L). `first` walks the tree in node-id order and
    returns the first chain within both (failed states again tabled).
    """
    K = len(slots)
    names = auto + [s for s in slots if s is not None]
    A, N = len(auto), len(names)
    pos = {n: i for i, n in enumerate(names)}
    link = [[costs.link(a, b) if a != b else math.inf for b in names] for a in names]
    comp = [[costs.compute(n, k) for k in range(K)] for n in names]
    pin = [pos[s] if s is not None else -1 for s in slots]
    # Lower bound for whatever node ends up on stage j: its compute there and its cheapest
    # possible incoming and outgoing links (over all nodes: still a valid bound).
    in_min = [min((link[m][n] for m in range(N) if m != n), default=0.0) for n in range(N)]
    out_min = [min((link[n][m] for m in range(N) if m != n), default=0.0) for n in range(N)]
    open_after = [[j for j in range(k + 1, K) if pin[j] < 0] for k in range(K)]

    def search(comp: list[list[float]]):
        """(children, remaining_lb) of the tree under the compute costs `comp`."""
        stage_lb = [[max(comp[n][j], in_min[n] if j > 0 else 0.0, out_min[n] if j < K - 1 else 0.0)
                     for j in range(K)] for n in range(N)]
        lb_pinned = [0.0] * (K + 1)  # bound from the pinned stages after position k
        for j in range(K - 1, -1, -1):
            lb_pinned[j] = max(lb_pinned[j + 1], stage_lb[pin[j]][j] if pin[j] >= 0 else 0.0)

        def remaining_lb(k: int, used: int) -> float:
            lb = lb_pinned[k + 1]
            for j in open_after[k]:
                lb = max(lb, min(stage_lb[n][j] for n in range(A) if not used >> n & 1))
            return lb

        def children(k: int, last: int, used: int, partial: float) -> list[tuple[float, int, int]]:
            """(bottleneck so far, node, auto set) for every node that can take stage k."""
            pool = (pin[k],) if pin[k] >= 0 else [n for n in range(A) if not used >> n & 1]
            out = []
            for n in pool:
                v = max(partial, comp[n][k], link[last][n] if last >= 0 else 0.0)
                out.append((v, n, used | (1 << n) if n < A else used))
            return out

        return children, remaining_lb

    def optimum(comp: list[list[float]], bound: float) -> float:
        """The smallest bottleneck under `comp`, or `bound` if none is strictly smaller."""
        children, remaining_lb = search(comp)
        best = [bound]
        done: set[tuple[int, int, int]] = set()

        def improve(k: int, last: int, used: int, partial: float) -> None:
            if k == K:
                best[0] = partial
                return
            for v, n, u in sorted(children(k, last, used, partial)):
                if v >= best[0]:
                    break
                if (k, n, u) in done or remaining_lb(k, u) >= best[0]:
                    continue
                improve(k + 1, n, u, v)
                if best[0] > v:  # nothing below best[0] from here, whatever the prefix: table it
                    done.add((k, n, u))

        improve(0, -1, 0, 0.0)
        return best[0]

    bottleneck = optimum(comp, costs.bottleneck(incumbent))
    allowed = [[0.0 if c <= bottleneck else math.inf for c in row] for row in comp]
    slowest_link = optimum(allowed, bottleneck)

    # The first chain in node-id order within both optima.
    children, remaining_lb = search(allowed)
    failed: set[tuple[int, int, int]] = set()

    def first(k: int, last: int, used: int, partial: float) -> list[int] | None:
        if k == K:
            return []
        for v, n, u in children(k, last, used, partial):
            if v > slowest_link or (k, n, u) in failed or remaining_lb(k, u) > slowest_link:
                continue
            rest = first(k + 1, n, u, v)
            if rest is not None:
                return [n] + rest
            failed.add((k, n, u))
        return None

    found = first(0, -1, 0, 0.0)
    return [names[i] for i in found] if found is not None else incumbent


# -- heuristic --------------------------------------------------------------------------------------

def _greedy(costs: _Costs, slots: list[str | None], auto: list[str], start: str | None) -> list[str] | None:
    """Builds a chain stage by stage from `start` on stage 0 (None: stage 0 is pinned)."""
    K = len(slots)
    chain: list[str] = []
    free = list(auto)
    for k in range(K):
        if slots[k] is not None:
            n = slots[k]
        elif k == 0:
            n = start
        else:
            if not free:
                return None
            prev, nxt = chain[-1], slots[k + 1] if k + 1 < K else None

            def step_cost(c: str) -> tuple[float, float]:
                here = max(costs.compute(c, k), costs.link(prev, c))
                ahead = costs.link(c, nxt) if nxt is not None else 0.0
                return (max(here, ahead), here)

            n = min(free, key=step_cost)  # min() keeps the first (smallest id) on ties
        if n in free:
            free.remove(n)
        chain.append(n)
    return chain


def _score(costs: _Costs, chain: Sequence[str]) -> tuple[float, ...]:
    """Bottleneck first, then the next worst costs: a finer objective for local search."""
    return tuple(sorted(costs.elements(chain), reverse=True))


def _local_search(costs: _Costs, slots: list[str | None], auto: list[str], chain: list[str], deadline: float,
                  max_rounds: int = 200) -> list[str]:
    """Best-improvement search over swaps of two open stages and chain-node/spare exchanges."""
    open_stages = [k for k, s in enumerate(slots) if s is None]
    chain = list(chain)
    score = _score(costs, chain)
    for _ in range(max_rounds):
        if time.monotonic() > deadline:
            break
        spares = [n for n in auto if n not in chain]
        best_move, best_score = None, score
        for i, a in enumerate(open_stages):
            for b in open_stages[i + 1:]:
                c = list(chain)
                c[a], c[b] = c[b], c[a]
                s = _score(costs, c)
                if s < best_score:
                    best_move, best_score = c, s
            for spare in spares:
                c = list(chain)
                c[a] = spare
                s = _score(costs, c)
                if s < best_score:
                    best_move, best_score = c, s
        if best_move is None:
            break
        chain, score = best_move, best_score
    return chain


def _heuristic(costs: _Costs, slots: list[str | None], auto: list[str], budget_s: float, keep: int = 4) -> list[str]:
    """The best of the greedy chains from every stage-0 candidate (as many as the first half of the
    budget allows), improved by local search."""
    start = time.monotonic()
    starts: list[str | None] = [None] if slots[0] is not None else list(auto)
    built = []
    for s in starts:
        chain = _greedy(costs, slots, auto, s)
        if chain is not None:
            built.append(chain)
        if built and time.monotonic() - start > budget_s / 2:
            break
    built.sort(key=lambda c: (_score(costs, c), c))
    improved = [_local_search(costs, slots, auto, c, start + budget_s) for c in built[:keep]]
    return min(improved, key=lambda c: (_score(costs, c), c))


# -- entry point --------------------------------------------------------------------------------------

def assign(problem: AssignmentProblem) -> AssignmentResult:
    """The chain with the smallest bottleneck (exact up to problem.exact_limit nodes, else the
    heuristic), the spare nodes as standbys. Raises ValueError for an impossible problem."""
    slots, auto = _validate(problem)
    costs = _Costs(problem)
    chain = _heuristic(costs, slots, auto, problem.budget_s)
    method = "heuristic"
    if len(auto) + sum(s is not None for s in slots) <= problem.exact_limit:
        chain = _exact(costs, slots, auto, chain)
        method = "exact"
    used = set(chain)
    standbys = sorted(n for n in problem.nodes if n not in used)
    return AssignmentResult(chain=chain, standbys=standbys, bottleneck_s=costs.bottleneck(chain),
                            bottleneck=costs.describe(chain), method=method)
