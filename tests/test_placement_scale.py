"""Placement from partial measurements, against a swarm whose every link is known in truth: the
chain found from capacity probes and a few full probes is within 10% of the exact optimum on
random 12-node swarms, no node is ever in two probes, and probes grow with N, not N^2."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import pytest
from tahnode.config import PlacementSettings, RunConfig
from tahnode.coordinator.assignment import AssignmentProblem, assign, chain_bottleneck
from tahnode.coordinator.placement import Placement
from tahnode.coordinator.registry import SwarmRegistry
from tahnode.coordinator.state import NodeRecord, NodeStatus
from tahnode.net.auth import SwarmKey

RUN = RunConfig.build("llama-tiny", None, **{"train.batch_size": 8, "train.seq_len": 128})


@dataclass
class TrueSwarm:
    """Every node's upload, download and compute, and a per-pair factor (paths differ)."""

    seed: int
    n: int
    up: dict = field(default_factory=dict)
    down: dict = field(default_factory=dict)
    factor: dict = field(default_factory=dict)
    layer_ms: dict = field(default_factory=dict)
    running: dict = field(default_factory=dict)
    most: int = 0   # probes any one node was in at once, at most
    probes: int = 0

    def __post_init__(self):
        r = random.Random(self.seed)
        self.ids = [f"v{i:04d}" for i in range(self.n)]
        for v in self.ids:
            self.up[v], self.down[v] = (10 ** r.uniform(1, 3) for _ in range(2))
            self.layer_ms[v] = r.uniform(0.2, 3.0)
        for a in self.ids:
            for b in self.ids:
                # a few bad paths
                self.factor[(a, b)] = r.uniform(0.85, 1.0) if r.random() > 0.1 else r.uniform(0.2, 0.5)

    def mbps(self, a: str, b: str) -> float:
        return min(self.up[a], self.down[b]) * self.factor[(a, b)]

    async def measure(self, a: NodeRecord, b: NodeRecord, payload_bytes: int, timeout: float) -> tuple[float, float]:
        for v in (a.node_id, b.node_id):
            self.running[v] = self.running.get(v, 0) + 1
            self.most = max(self.most, self.running[v])
        self.probes += 1
        await asyncio.sleep(0.002)
        for v in (a.node_id, b.node_id):
            self.running[v] -= 1
        return self.mbps(a.node_id, b.node_id), 20.0

    def problem(self, placement: Placement) -> AssignmentProblem:
        """The exact problem: every pair known in truth."""
        p = placement.problem(movable=True)
        mbps = {(a, b): self.mbps(a, b) for a in self.ids for b in self.ids if a != b}
        return AssignmentProblem(nodes=self.ids, num_stages=p.num_stages, mbps=mbps,
                                 activation_bytes=p.activation_bytes,
                                 gradient_bytes=p.gradient_bytes, layer_ms=self.layer_ms, stage_layers=p.stage_layers)


def registry_with(tmp_path, swarm: TrueSwarm, stages: int, pipelines: int | str = 1, **swarm_settings) -> SwarmRegistry:
    """The simulated swarm's nodes joined with --stage auto; one pipeline unless `pipelines` says otherwise."""
    run = RunConfig.build("llama-tiny", None, **{"train.batch_size": 8, "train.seq_len": 128, "stages": stages,
                                                 "swarm.pipelines": pipelines,
                                                 **{f"swarm.{k}": v for k, v in swarm_settings.items()}})
    r = SwarmRegistry(run, SwarmKey("t" * 32), heartbeat_timeout=3600, store_dir=tmp_path / "store")
    for v in swarm.ids:
        r.nodes[v] = NodeRecord(v, f"sim:{v}", -1, "sim", status=NodeStatus.JOINING, layer_ms=swarm.layer_ms[v],
                                movable=True)
    r.census.last_join = time.monotonic() - 60
    return r


async def settle(placement: Placement, seconds: float) -> None:
    stop = asyncio.Event()
    task = asyncio.ensure_future(placement.run(stop))
    await asyncio.sleep(seconds)
    stop.set()
    await task


@pytest.mark.parametrize("seed", range(8))
def test_partial_measurements_place_within_10_percent_of_the_exact_optimum(tmp_path, seed):
    swarm = TrueSwarm(seed, 12)
    r = registry_with(tmp_path, swarm, stages=4)
    settings = PlacementSettings(settle_s=0, probe_wait_s=30, rebalance_s=0.3, hysteresis=0.05, tick_s=0.05)
    placement = Placement(r, settings, swarm.measure)
    asyncio.run(settle(placement, 4.0))
    chain = placement.current_chain()
    assert chain is not None and all(r.nodes[v].status in (NodeStatus.ACTIVE, NodeStatus.STANDBY) for v in swarm.ids)
    exact = swarm.problem(placement)
    optimum = assign(exact).bottleneck_s
    found = chain_bottleneck(exact, chain)[0]
    assert found <= 1.10 * optimum, (f"chain {chain}: {found * 1e3:.2f} ms per micro-batch, optimum "
                                     f"{optimum * 1e3:.2f} ms")
    assert swarm.most == 1
    assert swarm.probes < 12 * 11  # fewer than every pair


def test_two_hundred_nodes_are_placed_with_probes_linear_in_n_and_no_node_in_two_at_once(tmp_path):
    swarm = TrueSwarm(1, 200)
    r = registry_with(tmp_path, swarm, stages=4)
    settings = PlacementSettings(settle_s=0, probe_wait_s=30, rebalance_s=0.5, tick_s=0.05)
    placement = Placement(r, settings, swarm.measure)
    asyncio.run(settle(placement, 10.0))
    assert placement.current_chain() is not None
    assert sorted(n.status.value for n in r.nodes.values()).count("standby") == 196
    assert swarm.most == 1
    assert all(min(placement.book.capacity_samples(v)) >= 2 for v in swarm.ids)
    assert 2 * 200 <= sum(placement.book.capacity_samples(v)[0] for v in swarm.ids) <= 3 * 200
    assert swarm.probes < 4 * 200


def test_heartbeats_carry_no_run_config_and_slow_down_in_large_swarms(tmp_path):
    """The run configuration comes with the join only; up to 300 live nodes a node beats every
    second, beyond that every N/300 s, never slower than a third of the failure timeout."""
    from tahnode.net.auth import Sealer
    from tahnode.net.freshness import COORDINATOR
    from tahnode.net.identity import NodeKey
    from tahnode.proto import tahnode_pb2 as pb

    key = SwarmKey("t" * 32)
    r = SwarmRegistry(RUN, key, heartbeat_timeout=30, store_dir=tmp_path / "store")
    sealers = [Sealer(key, f"v{i:04d}", identity=NodeKey.generate()) for i in range(900)]
    periods = []
    for count in (1, 300, 600, 900):
        for s in sealers[len(r.nodes):count]:
            joined = r.join(s.seal(pb.JoinRequest(node_id=s.me, address="h:1", stage=-1, movable=True), COORDINATOR))
            assert RunConfig.from_json(joined.assignment.run_config) == RUN
            s.run = joined.run
        r.sweep()
        reply = r.heartbeat(sealers[0].seal(pb.HeartbeatRequest(node_id=sealers[0].me), COORDINATOR))
        assert reply.assignment.run_config == "" and reply.known
        periods.append(reply.heartbeat_s)
    assert periods == [1.0, 1.0, 2.0, 3.0]
    assert r.nodes["v0000"].movable
