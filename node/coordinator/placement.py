"""Placing `--stage auto` nodes in pipelines, at any swarm size: once joins settle, waiting nodes
fill the open stages of the pipelines there are, then form new pipelines while enough of them wait
(keeping `swarm.standbys` back, up to --pipelines N or max_pipelines), each chain searched from
what the probes know (capacity probes of every node, full probes of a new chain's links, for at
most `probe_wait_s`) and formed only if it reaches `min_chain_share` of the fastest pipeline's
speed; spare nodes stand by. A pipeline that loses a stage no standby can fill is dissolved while
another pipeline trains, its nodes stand by (one that joined for a stage, --stage N, takes only that
stage again). While one pipeline trains, every `rebalance_s` a new
plan over the movable nodes replaces its chain if its links are fully probed and it cuts the
bottleneck (the chain in use judged by its links' best probes) by the `hysteresis` share.
Searches run in a thread, on a shortlist."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from enum import Enum

from ..codecs import CodecContext, get_codec
from ..config import PlacementSettings
from ..train.model import stage_layers
from .assignment import DEFAULT_MBPS, AssignmentProblem, AssignmentResult, assign, chain_bottleneck
from .gone import GoneWatch
from .links import EstimatedMbps, LinkBook
from .probing import Measure, Prober
from .registry import SwarmRegistry
from .remeasure import MeasureCompute, Remeasure
from .state import STALL_PROBE_S, NodeRecord, NodeStatus
from .sybils import SybilLimits

__all__ = ["Placement", "chain_links", "Formed"]

COMPUTE_REPORT_S = 10.0  # how long a joining node may take to report its compute speed


class Formed(Enum):
    """What a try to form a pipeline came to."""

    YES = "formed"
    PROBING = "probing"  # its links are being probed in full: try again shortly
    MEASURING = "measuring"  # found too slow, its nodes and links are measured again: newcomers stand by meanwhile
    NO = "no"            # no chain, or too slow a one: not again before the membership changes


def chain_links(chain: list[str]) -> list[tuple[str, str]]:
    """Both directions of every link of a chain."""
    return [pair for a, b in zip(chain, chain[1:]) for pair in ((a, b), (b, a))]


class Placement:
    """The LinkBook, the Prober filling it, and the rounds that place and rebalance nodes."""

    def __init__(self, registry: SwarmRegistry, settings: PlacementSettings, measure: Measure,
                 measure_compute: MeasureCompute | None = None):
        self.r, self.s = registry, settings
        self.book = LinkBook(DEFAULT_MBPS)
        self.prober = Prober(registry, self.book, measure, settings)
        self.again = Remeasure(registry, self.prober, measure_compute)  # a chain too slow is measured again first
        self.gone = GoneWatch(registry)  # a silent node whose address refuses is failed before its timeout
        self.refused_at: float | None = None  # when a new pipeline was last refused for its speed (tried again later)
        self.said: tuple[int, set[str]] = (-1, set())  # what the limits refused, said once per membership epoch
        self.due_since: float | None = None   # when the waiting nodes were first enough and settled
        self.last_change = time.monotonic()   # of the chain, by placement or rebalancing
        self.proposal: AssignmentResult | None = None  # the last rebalancing plan, applied or not
        self.formed_epoch = -1                # the membership epoch of the last try to form a pipeline
        self._bytes: tuple[float, float] | None = None

    # -- the loop ---------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Probe and look at silent nodes in the background; each second sweep failures, take in traffic figures,
        place and rebalance (once the run finished, only sweep); until `stop` is set."""
        probing = asyncio.gather(self.prober.run(), self.again.run(), self.watch_stalls(), self.gone.run())
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

    async def watch_stalls(self) -> None:
        """Look at the event loop's lateness every STALL_PROBE_S (tahnode.coordinator.state.StallClock)."""
        while True:
            self.r.census.stalls.beat(time.monotonic())
            await asyncio.sleep(STALL_PROBE_S)

    async def tick(self) -> None:
        self.r.sweep()
        if self.r.finished:
            return  # the run is over: its holders leave one by one, and no stage is filled or moved
        self.observe_traffic()
        for chain in self.chains().values():
            if any(self.r.nodes[n].movable for n in chain):
                self.prober.want(chain_links(chain))  # the links in use, probed in full (rebalancing, the speed check)
        if self.round_due():
            await self.fill()
        elif self.r.roster.pipelines() == [0] and self.current_chain() is not None and self.rebalance_due():
            await self.rebalance(self.current_chain())

    def observe_traffic(self) -> None:
        """What the links in use carried (the nodes' byte counters, from their heartbeats)."""
        now, slack = time.monotonic(), self.r.heartbeat_period()
        for n in self.r.nodes.values():
            if n.status.live:
                for dst, (nbytes, _) in n.links.items():
                    self.book.observe(n.node_id, dst, nbytes, now, slack)

    def current_chain(self) -> list[str] | None:
        """Pipeline 0's chain, if complete."""
        return self.r.roster.chain(0)

    def chains(self) -> dict[int, list[str]]:
        """pipeline -> its chain, for every complete pipeline."""
        return {p: self.r.roster.chain(p) for p in self.r.roster.complete_pipelines()}

    def open_pipelines(self) -> list[int]:
        """The pipelines with an open stage that may still be filled (not those that finished)."""
        roster = self.r.roster
        return [p for p in roster.pipelines() if roster.open_stages(p) and p not in self.r.roster.finished]

    def can_fill(self, pipeline: int, waiting: list[NodeRecord]) -> bool:
        """Whether `waiting` nodes can take every open stage of `pipeline`: a node that joined for a
        stage (--stage N) and stands by takes only that stage, a --stage auto node any."""
        open_stages, limits = set(self.r.roster.open_stages(pipeline)), self.limits()
        pinned = {n.chosen for n in waiting if n.chosen in open_stages and not limits.refusal(n, n.chosen, pipeline)}
        left = open_stages - pinned
        free = [n for n in waiting if n.chosen < 0 and any(not limits.refusal(n, k, pipeline) for k in left)]
        return len(left) <= len(free)

    def limits(self) -> SybilLimits:
        """How many replicas of a stage one operator and one host may hold (tahnode.coordinator.sybils)."""
        return SybilLimits(self.r.roster, self.r.identities, self.r.run.swarm.max_per_host)

    def say_once(self, text: str) -> None:
        """An event, unless said already since the membership last changed."""
        if self.said[0] != self.r.epoch:
            self.said = (self.r.epoch, set())
        if text not in self.said[1]:
            self.said[1].add(text)
            self.r.event(text)

    def form_due(self) -> bool:
        """Not tried since the membership changed, a chain being measured again (judged once that is done), or
        refused for its speed `reform_s` ago (measured again first)."""
        return self.formed_epoch != self.r.epoch or self.again.since is not None or (
            self.refused_at is not None and time.monotonic() - self.refused_at >= self.s.reform_s)

    def may_form(self, waiting: int) -> bool:
        """Whether `waiting` nodes may form another pipeline: below --pipelines N (or max_pipelines), a
        whole chain of them, and with auto the standbys kept back once one pipeline exists."""
        swarm, count = self.r.run.swarm, len(self.r.roster.pipelines())
        target = swarm.max_pipelines if swarm.auto else swarm.pipelines
        keep = swarm.standbys if swarm.auto and count else 0
        return count < target and waiting >= self.r.run.stages + keep

    # -- filling open stages ---------------------------------------------------------------------
    def round_due(self) -> bool:
        """Time to place: a newcomer, a vacancy a standby can fill, or enough waiting nodes for
        another pipeline (tried once per membership epoch); no join for settle_s seconds and compute
        speeds reported; and, before a new pipeline, the candidates' capacity probes done (or
        `probe_wait_s` spent on them)."""
        waiting = self.r.waiting()
        fillable = any(self.can_fill(p, waiting) for p in self.open_pipelines())
        forming = self.may_form(len(waiting)) and self.form_due()
        ready = (any(n.status is NodeStatus.JOINING for n in waiting) or fillable or forming
                 or bool(self.open_pipelines() and self.chains())) and self._settled(waiting)
        if not ready:
            self.due_since = None
            return False
        now = time.monotonic()
        self.due_since = self.due_since or now
        if not forming or fillable:
            return True  # a vacancy (a standby takes it now), newcomers (they stand by), a pipeline to dissolve
        return now - self.due_since >= self.s.probe_wait_s or self.prober.capacity_known(waiting)

    def first_chain(self) -> bool:
        """No stage is held: the swarm has not trained yet (or lost every node)."""
        return not self.r.roster.pipelines()

    def _settled(self, waiting: list[NodeRecord]) -> bool:
        now = time.monotonic()
        if now - self.r.census.last_join < self.s.settle_s:
            return False
        return all(n.layer_ms > 0 or now - n.joined_at > COMPUTE_REPORT_S for n in waiting)

    async def fill(self) -> None:
        """Fill the open stages of the pipelines there are (holders stay), dissolve those no standby
        can complete while another trains, form new pipelines from the waiting nodes; the rest stand
        by. While `probe_wait_s` lasts, a new chain's links are probed in full and the plan made
        again until it stands on full probes."""
        epoch = self.r.epoch
        for p in self.open_pipelines():
            if not self.can_fill(p, self.r.waiting()):
                continue
            try:
                problem = self.problem(movable=False, pipeline=p)
                result, why = await self.limits().vet(problem, await self.solve(problem), p, self.solve, self.r.nodes)
            except ValueError as exc:
                result, why = None, str(exc)
            if self.r.epoch != epoch:
                return  # someone joined, left or failed meanwhile: plan again
            if result is None:
                self.say_once(f"cannot fill pipeline {p} yet: {why}")
                continue
            self.apply(result, p)
            epoch = self.r.epoch
        self.dissolve()
        outcome = Formed.YES
        while outcome is Formed.YES and self.may_form(len(self.r.waiting())) and self.form_due():
            outcome = await self.form()
        newcomers = [n for n in self.r.waiting() if n.status is NodeStatus.JOINING]
        if newcomers and outcome is not Formed.PROBING:
            for n in newcomers:
                self.r.stand_by(n)
            self.r.epoch += 1
            held = "every stage is held" if not self.open_pipelines() else "too few to fill an open stage"
            self.r.event(f"standby: {', '.join(n.node_id for n in newcomers[:5])}"
                         f"{f' and {len(newcomers) - 5} more' if len(newcomers) > 5 else ''} ({held})")

    def dissolve(self) -> None:
        """A pipeline with a stage the waiting nodes cannot fill, while another pipeline trains: its
        holders stand by (they fill other vacancies, or form a pipeline again, later)."""
        complete = self.r.roster.complete_pipelines()
        for p in self.open_pipelines():
            lost = p in self.r.roster.formed  # not one whose pinned nodes are still joining
            if lost and complete and not self.can_fill(p, self.r.waiting()):
                limits, left = self.limits(), self.r.roster.open_stages(p)  # a standby the limits keep out: why
                why = next((w for n in self.r.waiting() for k in left if (w := limits.refusal(n, k, p))), "")
                holders = [self.r.roster.holder(k, p) for k in range(self.r.run.stages)]
                moved = [n.node_id for n in holders if n is not None and self.r.stand_by(n)]
                self.r.epoch += 1
                self.r.roster.formed.discard(p)
                self.r.event(f"pipeline {p} dissolved: it lost a stage and no standby can take it"
                             f"{f' ({why})' if why else ''}; {', '.join(moved)} stand by")

    async def form(self) -> "Formed":
        """Form one new pipeline from the waiting nodes, if its chain (searched on what the probes
        know) reaches min_chain_share of the fastest pipeline's speed; its links are probed in full
        first while probe_wait_s lasts."""
        epoch, self.refused_at = self.r.epoch, None
        problem = self.problem(movable=False, pipeline=None)
        try:
            result, why = await self.limits().vet(problem, await self.solve(problem), None, self.solve, self.r.nodes)
        except ValueError as exc:
            result, why = None, str(exc)
        if result is None:
            self.say_once(f"cannot form a pipeline yet: {why}")
            self.formed_epoch = epoch
            self.again.done()
            return Formed.NO
        unprobed = [p for p in chain_links(result.chain) if not self.book.fully_probed(*p)]
        waited = time.monotonic() - (self.due_since or 0.0)
        if unprobed and waited < self.s.probe_wait_s and self.prober.may_probe(unprobed):
            self.prober.want(unprobed)
            return Formed.PROBING
        pipeline = self.r.roster.free_pipeline()
        if self.r.epoch != epoch or pipeline is None:
            return Formed.NO
        measured = dataclasses.replace(problem, mbps=self.book.estimates(best=True))  # all judged by their best
        best = min((chain_bottleneck(measured, chain)[0] for chain in self.chains().values()), default=math.inf)
        takes = chain_bottleneck(measured, result.chain)[0]
        if takes * self.r.run.swarm.min_chain_share > best:
            if self.again.pending(result.chain, chain_links(result.chain)):
                return Formed.MEASURING
            self.formed_epoch, self.refused_at = epoch, time.monotonic()
            self.r.event(f"no new pipeline: the best chain of the waiting nodes, {' -> '.join(result.chain)}, takes "
                         f"{takes * 1e3:.3g} ms per micro-batch (measured again), slower than "
                         f"{self.r.run.swarm.min_chain_share:g} of the fastest pipeline's speed ({best * 1e3:.3g} ms); "
                         f"tried again in {self.s.reform_s:g} s")
            return Formed.NO
        self.again.done()
        self.apply(result, pipeline)
        return Formed.YES

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
            self.apply(result, 0)

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

    def problem(self, movable: bool, pipeline: int | None = 0) -> AssignmentProblem:
        """The search's input, a snapshot: the holders of `pipeline` pinned (all, or with `movable`
        only those that chose their stage; None: a new pipeline, none), the other candidates free to
        place: the waiting nodes (with `movable`, pipeline 0's movable holders too), best-ranked first."""
        run = self.r.run
        holders = {} if pipeline is None else {
            h.node_id: k for k in range(run.stages)
            if (h := self.r.roster.holder(k, pipeline)) and not (movable and h.movable)}
        limits = self.limits()
        if not movable:  # a standby that joined for a stage fills that stage (where the limits allow it), or none
            for n in sorted((n for n in self.r.waiting() if n.chosen >= 0), key=lambda n: n.node_id):
                if n.chosen not in holders.values() and not limits.refusal(n, n.chosen, pipeline):
                    holders[n.node_id] = n.chosen
        free = [n for n in self.r.live() if n.node_id not in holders and n.chosen < 0
                and (n.status.waiting or (movable and n.pipeline == pipeline))]
        fw, bw = self.activation_bytes()
        layers = [len(stage_layers(run.model.n_layers, run.stages, k)) for k in range(run.stages)]
        layer_ms = {n.node_id: n.layer_ms for n in self.r.live()}
        estimates = self.book.estimates()
        auto = self.shortlist(free, run.stages - len(holders), max(fw, bw), layers, estimates)
        return AssignmentProblem(
            nodes=sorted(list(holders) + auto), num_stages=run.stages, pinned=holders, auto=sorted(auto),
            compute_ms=limits.forbidden([self.r.nodes[n] for n in auto], pipeline),
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

    def apply(self, result: AssignmentResult, pipeline: int) -> None:
        """`pipeline` is the chain; its former holders that the chain leaves out stand by (newcomers
        stay waiting for the next pipeline, or stand by at the end of the round)."""
        where = f" of pipeline {pipeline}" if pipeline else ""
        for stage, node_id in enumerate(result.chain):
            node = self.r.nodes[node_id]
            if self.r.place(node, stage, pipeline):
                resume = f", resuming from the checkpoint of step {node.resume_step}" if node.resume_step else ""
                self.r.event(f"assigned: {node_id} -> stage {stage}{where}{resume}")
        chain = set(result.chain)
        left_out = [n for n in self.r.live()
                    if n.node_id not in chain and n.status is NodeStatus.ACTIVE and n.pipeline == pipeline]
        moved = [n.node_id for n in left_out if self.r.stand_by(n)]
        if moved:
            self.r.event(f"standby: {', '.join(moved[:5])}{f' and {len(moved) - 5} more' if len(moved) > 5 else ''}")
        self.r.epoch += 1
        self.last_change = time.monotonic()
        self.r.event(f"{f'pipeline {pipeline}: ' if pipeline else ''}chain {' -> '.join(result.chain)} "
                     f"({result.method}); bottleneck {result.bottleneck}")
