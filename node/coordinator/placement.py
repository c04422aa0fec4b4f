"""Placing `--stage auto` nodes, at any swarm size: once joins settle, the waiting nodes fill the
open stages from what the probes know so far (capacity probes of every node, full probes of the
chain's links, for at most `probe_wait_s`); spare nodes stand by. While training, every
`rebalance_s` a new plan over the movable nodes replaces the chain if its links are fully probed
and it cuts the bottleneck (the chain in use judged by its links' best probes) by the
`hysteresis` share. Searches run in a thread, on a shortlist."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from ..codecs import CodecContext, get_codec
from ..config import PlacementSettings
from ..train.model import stage_layers
from .assignment import DEFAULT_MBPS, AssignmentProblem, AssignmentResult, assign, chain_bottleneck
from .links import EstimatedMbps, LinkBook
from .probing import Measure, Prober
from .registry import SwarmRegistry
from .state import NodeRecord, NodeStatus

__all__ = ["Placement", "chain_links"]

COMPUTE_REPORT_S = 10.0  # how long a joining node may take to report its compute speed


def chain_links(chain: list[str]) -> list[tuple[str, str]]:
    """Both directions of every link of a chain."""
    return [pair for a, b in zip(chain, chain[1:]) for pair in ((a, b), (b, a))]


class Placement:
    """The LinkBook, the Prober filling it, and the rounds that place and rebalance nodes."""

    def __init__(self, registry: SwarmRegistry, settings: PlacementSettings, measure: Measure):
        self.r, self.s = registry, settings
        self.book = LinkBook(DEFAULT_MBPS)
        self.prober = Prober(registry, self.book, measure, settings)
        self.due_since: float | None = None   # when the waiting nodes were first enough and settled
        self.last_change = time.monotonic()   # of the chain, by placement or rebalancing
        self.proposal: AssignmentResult | None = None  # the last rebalancing plan, applied or not
        self._bytes: tuple[float, float] | None = None

    # -- the loop ---------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Probe in the background; each second sweep failures, take in traffic figures, place
        and rebalance (once the run finished, only sweep); until `stop` is set."""
        probing = asyncio.ensure_future(self.prober.run())
        try:
            while not stop.is_set():
                await self.tick()
                try:
                    await asyncio.wait_for(stop.wait(), self.s.tick_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            probing.cancel()
            await asyncio.gather(probing, return_exceptions=True)

    async def tick(self) -> None:
        self.r.sweep()
        if self.r.finished:
            return  # the run is over: its holders leave one by one, and no stage is filled or moved
        self.observe_traffic()
        chain = self.current_chain()
        if chain is not None and any(self.r.holder(k).movable for k in range(self.r.run.stages)):
            self.prober.want(chain_links(chain))  # the links in use, probed in full (for rebalancing)
        if self.round_due():
            await self.fill()
        elif chain is not None and self.rebalance_due():
            await self.rebalance(chain)

    def observe_traffic(self) -> None:
        """What the links in use carried (the nodes' byte counters, from their heartbeats)."""
        now, slack = time.monotonic(), self.r.heartbeat_period()
        for n in self.r.nodes.values():
            if n.status.live:
                for dst, (nbytes, _) in n.links.items():
                    self.book.observe(n.node_id, dst, nbytes, now, slack)

    def current_chain(self) -> list[str] | None:
        holders = [self.r.holder(k) for k in range(self.r.run.stages)]
        return None if any(h is None for h in holders) else [h.node_id for h in holders]

    # -- filling open stages ---------------------------------------------------------------------
    def round_due(self) -> bool:
        """Time to place: a newcomer, or a vacancy a standby can fill; enough candidates; no join
        for settle_s seconds and compute speeds reported; and, before the first chain, the
        candidates' capacity probes done (or `probe_wait_s` spent on them)."""
        waiting = self.r.waiting()
        open_stages = self.r.open_stages()
        ready = (any(n.status is NodeStatus.JOINING for n in waiting) or (open_stages and waiting)) \
            and len(waiting) >= len(open_stages) and self._settled(waiting)
        if not ready:
            self.due_since = None
            return False
        now = time.monotonic()
        self.due_since = self.due_since or now
        if not self.first_chain():
            return True  # a vacancy (a standby takes it now) or newcomers (they stand by)
        return now - self.due_since >= self.s.probe_wait_s or self.prober.capacity_known(waiting)

    def first_chain(self) -> bool:
        """No stage is held: the swarm has not trained yet (or lost every node)."""
        return len(self.r.open_stages()) == self.r.run.stages

    def _settled(self, waiting: list[NodeRecord]) -> bool:
        now = time.monotonic()
        if now - self.r.last_join < self.s.settle_s:
            return False
        return all(n.layer_ms > 0 or now - n.joined_at > COMPUTE_REPORT_S for n in waiting)

    async def fill(self) -> None:
        """Place waiting nodes in the open stages (holders stay), the rest stand by. For the first
        chain, while `probe_wait_s` lasts, the plan's links are probed in full and the plan made
        again until it stands on full probes."""
        if not self.r.open_stages():
            newcomers = [n for n in self.r.waiting() if n.status is NodeStatus.JOINING]
            for n in newcomers:
                self.r.stand_by(n)
            self.r.epoch += 1
            self.r.event(f"standby: {', '.join(n.node_id for n in newcomers[:5])}"
                         f"{f' and {len(newcomers) - 5} more' if len(newcomers) > 5 else ''} (every stage is held)")
            return
        epoch = self.r.epoch
        try:
            result = await self.solve(self.problem(movable=False))
        except ValueError as exc:
            self.r.event(f"cannot assign yet: {exc}")
            return
        unprobed = [p for p in chain_links(result.chain) if not self.book.fully_probed(*p)]
        waited = time.monotonic() - (self.due_since or 0.0)
        if self.first_chain() and unprobed and waited < self.s.probe_wait_s and self.prober.may_probe(unprobed):
            self.prober.want(unprobed)
            return
        if self.r.epoch == epoch:  # else someone joined, left or failed meanwhile: plan again
            self.apply(result, standby_rest=True)

    # -- rebalancing ------------------------------------------------------------------------------
    def rebalance_due(self) -> bool:
        return self.s.rebalance_s > 0 and time.monotonic() - self.last_change >= self.s.rebalance_s \
            and any(n.movable for n in self.r.live())

    async def rebalance(self, chain: list[str]) -> None:
        """Plan again over the movable nodes; move when the plan's links are probed in full and it
        cuts the bottleneck by the hysteresis share (else ask for those probes)."""
        epoch = self.r.epoch
        problem = self.problem(movable=True)
        try:
            result = await self.solve(problem)
        except ValueError:
            return
        self.last_change = time.monotonic()  # the next check comes rebalance_s later, moved or not
        self.proposal = result
        if result.chain == chain:
            return
        unprobed = [p for p in chain_links(result.chain) if not self.book.fully_probed(*p)]
        if unprobed:
            self.prober.want(unprobed)
            return
        now_s = chain_bottleneck(dataclasses.replace(problem, mbps=self.book.estimates(best=True)), chain)[0]
        if result.bottleneck_s < now_s * (1 - self.s.hysteresis) and self.r.epoch == epoch:
            self.r.event(f"rebalancing: chain {' -> '.join(chain)} at {now_s * 1e3:.3g} ms per micro-batch becomes "
                         f"{' -> '.join(result.chain)} at {result.bottleneck_s * 1e3:.3g} ms")
            self.apply(result, standby_rest=False)

    # -- the search -------------------------------------------------------------------------------
    def activation_bytes(self) -> tuple[float, float]:
        """Bytes of one micro-batch's activations (forward codec) and gradients (backward codec)."""
        if self._bytes is None:
            import torch

            run = self.r.run
            t, c = run.train, run.codec
            sample = torch.randn(1, min(t.seq_len, 64), run.model.dim)
            per_element = []
            for name, params in ((c.forward, c.forward_codec_params), (c.backward, c.backward_params)):
                msg = get_codec(name, **params).encode(sample, CodecContext(sample_ids=[0]))
                per_element.append(len(msg.payload) / sample.numel())
            n = t.batch_size * t.seq_len * run.model.dim
            self._bytes = (n * per_element[0], n * per_element[1])
        return self._bytes

    def problem(self, movable: bool) -> AssignmentProblem:
        """The search's input, a snapshot: holders pinned (all, or with `movable` only those that
        chose their stage), the other live nodes' best-ranked candidates free to place."""
        run = self.r.run
        holders = {h.node_id: k for k in range(run.stages) if (h := self.r.holder(k)) and not (movable and h.movable)}
        free = [n for n in self.r.live() if n.node_id not in holders and (movable or n.status.waiting)]
        fw, bw = self.activation_bytes()
        layers = [len(stage_layers(run.model.n_layers, run.stages, k)) for k in range(run.stages)]
        layer_ms = {n.node_id: n.layer_ms for n in self.r.live()}
        estimates = self.book.estimates()
        auto = self.shortlist(free, run.stages - len(holders), max(fw, bw), layers, estimates)
        return AssignmentProblem(
            nodes=sorted(list(holders) + auto), num_stages=run.stages, pinned=holders, auto=sorted(auto),
            mbps=estimates, activation_bytes=fw, gradient_bytes=bw, layer_ms=layer_ms, stage_layers=layers,
            exact_limit=self.s.exact_limit, budget_s=self.s.budget_s, ring=run.ring)

    def shortlist(self, free: list[NodeRecord], open_count: int, nbytes: float, layers: list[int],
                  estimates: EstimatedMbps) -> list[str]:
        """The free nodes worth searching over: all if few, else the best-ranked by what they can
        sustain alone (the slower of their compute and their upload/download of `nbytes` per
        micro-batch), current holders kept so the search can leave the chain as it is."""
        keep = max(self.s.exact_limit - (self.r.run.stages - open_count), 2 * open_count)
        if len(free) <= keep:
            return [n.node_id for n in free]

        def cost(n: NodeRecord) -> tuple[float, str]:
            rate = min(estimates.up.get(n.node_id, DEFAULT_MBPS), estimates.down.get(n.node_id, DEFAULT_MBPS))
            wire = nbytes * 8 / (rate * 1e6) if rate > 0 else float("inf")
            return max(wire, n.layer_ms * min(layers) / 1e3), n.node_id

        held = [n.node_id for n in free if n.status is NodeStatus.ACTIVE]
        ranked = [n.node_id for n in sorted(free, key=cost) if n.status is not NodeStatus.ACTIVE]
        return held + ranked[:max(keep - len(held), open_count)]

    async def solve(self, problem: AssignmentProblem) -> AssignmentResult:
        """The assignment, searched in a thread (the event loop keeps serving heartbeats)."""
        return await asyncio.to_thread(assign, problem)

    def apply(self, result: AssignmentResult, standby_rest: bool) -> None:
        """Hold the chain; nodes it leaves out stand by (all waiting ones with `standby_rest`)."""
        for stage, node_id in enumerate(result.chain):
            node = self.r.nodes[node_id]
            if self.r.place(node, stage):
                resume = f", resuming from the checkpoint of step {node.resume_step}" if node.resume_step else ""
                self.r.event(f"assigned: {node_id} -> stage {stage}{resume}")
        chain = set(result.chain)
        spares = [n for n in self.r.live() if n.node_id not in chain and (standby_rest or n.status is NodeStatus.ACTIVE)]
        moved = [n.node_id for n in spares if self.r.stand_by(n)]
        if moved:
            self.r.event(f"standby: {', '.join(moved[:5])}{f' and {len(moved) - 5} more' if len(moved) > 5 else ''}")
        self.r.epoch += 1
        self.last_change = time.monotonic()
        self.r.event(f"chain {' -> '.join(result.chain)} ({result.method}); bottleneck {result.bottleneck}")
