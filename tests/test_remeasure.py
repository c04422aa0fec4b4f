"""Pipelines form promptly (issue 61): a chain that looks too slow for a new pipeline (its nodes' compute measured while
other daemons loaded the machine) is measured again, its nodes' compute asked of each and its links probed in full
again, before it is judged; a chain that is too slow is refused, and measured again before each later refusal."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from servers import NODE, Servers
from tahnode.config import PlacementSettings
from tahnode.coordinator.placement import Placement
from tahnode.coordinator.server import compute_measurer
from tahnode.coordinator.state import NodeRecord, NodeStatus
from tahnode.net.channels import ChannelPool
from tahnode.net.grpc_transport import DIRECT
from test_placement_scale import TrueSwarm, registry_with, settle


class Volunteers(TrueSwarm):
    """A simulated swarm whose nodes answer the coordinator's compute requests with their true speed, counted."""

    def __init__(self, seed: int, n: int, true_ms: dict[str, float]):
        super().__init__(seed, n)
        self.true_ms, self.asked = true_ms, {}

    async def compute(self, node: NodeRecord, timeout: float) -> float:
        self.asked[node.node_id] = self.asked.get(node.node_id, 0) + 1
        await asyncio.sleep(0.01)
        return self.true_ms[node.node_id]


def swarm_of(true_ms: float, reported_ms: float) -> Volunteers:
    """Six equal nodes on equal links; v0003..v0005 compute in `true_ms` per layer but reported `reported_ms`."""
    swarm = Volunteers(5, 6, {})
    for v in swarm.ids:
        swarm.up[v] = swarm.down[v] = 500.0
        swarm.factor.update({(v, w): 1.0 for w in swarm.ids})
        swarm.true_ms[v] = swarm.layer_ms[v] = 1.0
    for v in swarm.ids[3:]:
        swarm.true_ms[v], swarm.layer_ms[v] = true_ms, reported_ms
    return swarm


def run_placement(tmp_path, swarm: Volunteers, seconds: float, reform_s: float = 20.0):
    r = registry_with(tmp_path, swarm, stages=3, pipelines=2, min_chain_share=0.5)
    settings = PlacementSettings(settle_s=0, probe_wait_s=1.0, rebalance_s=0, tick_s=0.05, reform_s=reform_s)
    placement = Placement(r, settings, swarm.measure, swarm.compute)
    asyncio.run(settle(placement, seconds))
    return r, placement


def test_a_chain_measured_slow_under_load_is_measured_again_and_forms(tmp_path):
    """v0003..v0005 reported ten times their compute (measured while the machine was loaded): their chain looks 10x
    slower than pipeline 0, below min_chain_share. Before it is judged they measure again, and pipeline 1 forms."""
    swarm = swarm_of(true_ms=1.0, reported_ms=10.0)
    r, placement = run_placement(tmp_path, swarm, 3.0)
    chains = placement.chains()
    assert sorted(chains) == [0, 1] and sorted(chains[1]) == swarm.ids[3:], (chains, r.events)
    assert swarm.asked == dict.fromkeys(swarm.ids[3:], 1)  # the chain's nodes, once each; nobody else
    assert [r.nodes[v].layer_ms for v in swarm.ids[3:]] == [1.0] * 3
    assert not any("no new pipeline" in e for e in r.events)
    assert any("are measured again before it is judged" in e for e in r.events)
    assert {r.nodes[v].status for v in swarm.ids} == {NodeStatus.ACTIVE}


def test_a_chain_too_slow_is_refused_and_measured_again_before_each_later_refusal(tmp_path):
    """v0003..v0005 are truly ten times slower: the chain is measured again, refused, and tried again every
    reform_s; each refusal comes after its nodes' compute and its links were measured again."""
    swarm = swarm_of(true_ms=10.0, reported_ms=10.0)
    r, placement = run_placement(tmp_path, swarm, 3.0, reform_s=0.5)
    assert sorted(placement.chains()) == [0]
    assert {r.nodes[v].status for v in swarm.ids[3:]} == {NodeStatus.STANDBY}
    refusals = [k for k, e in enumerate(r.events) if "no new pipeline" in e]
    assert len(refusals) >= 2, r.events
    for before, refusal in zip(refusals, refusals[1:]):  # the event log keeps the last 50: judge whole rounds
        between = r.events[before + 1:refusal]
        assert any("are measured again before it is judged" in e for e in between), between
        measured = {m.group(1) for e in between if (m := re.match(r".*compute of (v\d+) measured again", e))}
        assert measured == set(swarm.ids[3:]), between
        assert "(measured again)" in r.events[refusal]
    assert all(swarm.asked[v] >= len(refusals) for v in swarm.ids[3:])


def test_a_node_measures_its_compute_again_when_the_coordinator_asks(tmp_path):
    """The request travels as a link probe's does (StageService.Measure, signed by the coordinator): the node answers
    with its compute measured again; a node that cannot measure yet says so, and placement keeps what it reported."""
    servers = Servers(tmp_path)

    async def ask() -> float:
        pool = ChannelPool(DIRECT)
        try:
            return await compute_measurer(servers.registry, pool)(servers.registry.nodes[NODE], 10.0)
        finally:
            await pool.close()

    async def layer_ms() -> float:
        return 7.5

    try:
        with pytest.raises(grpc.aio.AioRpcError, match="does not measure its compute yet"):
            asyncio.run(ask())
        servers.transport.compute_measurer = layer_ms
        assert asyncio.run(ask()) == 7.5
    finally:
        servers.stop()
