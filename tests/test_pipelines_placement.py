"""Placement forms pipelines, against simulated volunteers whose links are known in truth: as many
as the nodes allow (auto, the standbys kept back) or as asked, each chain its own nodes and its
neighbours within it; a chain far slower than the fastest is not formed; a vacancy takes a
standby; a pipeline no standby can complete is dissolved while another trains; a late
newcomer completes a new pipeline; and a pinned node opens a new pipeline only where asked."""

from __future__ import annotations

import asyncio
import time

import pytest
from tahnode.config import PlacementSettings
from tahnode.coordinator.placement import Placement
from tahnode.coordinator.state import NodeRecord, NodeStatus
from tahnode.net.auth import Sealer, SwarmKey
from tahnode.net.errors import StageTaken
from tahnode.net.freshness import COORDINATOR
from tahnode.net.identity import NodeKey
from tahnode.proto import tahnode_pb2 as pb
from test_placement_scale import TrueSwarm, registry_with, settle

FAST = PlacementSettings(settle_s=0, probe_wait_s=1.0, rebalance_s=0, tick_s=0.05)


def placed(r, swarm: TrueSwarm, seconds: float = 3.0) -> Placement:
    placement = Placement(r, FAST, swarm.measure)
    asyncio.run(settle(placement, seconds))
    return placement


def statuses(r) -> dict[str, int]:
    """How many nodes have each status (none of a status: not listed)."""
    out: dict[str, int] = {}
    for n in r.nodes.values():
        out[n.status.value] = out.get(n.status.value, 0) + 1
    return out


@pytest.mark.parametrize("nodes,pipelines,standbys,formed", [
    (12, "auto", 1, 3),   # 3 chains of 3 (each later one with a standby left for it), 3 stand by
    (12, "auto", 0, 4),
    (12, 2, 1, 2),        # as asked: 2, the other 6 stand by
    (4, "auto", 1, 1),    # one pipeline and its standby, as before pipelines
])
def test_as_many_pipelines_as_the_nodes_allow_each_a_chain_of_its_own(tmp_path, nodes, pipelines, standbys, formed):
    swarm = TrueSwarm(3, nodes)
    r = registry_with(tmp_path, swarm, stages=3, pipelines=pipelines, standbys=standbys, min_chain_share=0.0)
    placement = placed(r, swarm)
    chains = placement.chains()
    assert sorted(chains) == list(range(formed))
    members = [v for chain in chains.values() for v in chain]
    assert len(members) == len(set(members)) == 3 * formed
    assert statuses(r) == {"active": 3 * formed, **({"standby": nodes - 3 * formed} if nodes > 3 * formed else {})}
    for p, chain in chains.items():
        for k, v in enumerate(chain):
            a = r.assignment(r.nodes[v])
            assert (a.stage, a.pipeline, a.pipelines) == (k, p, formed)
            assert a.prev.node_id == (chain[k - 1] if k else "") and a.next.node_id == (chain[k + 1] if k < 2 else "")
    assert any("pipeline 1: chain" in e for e in r.events) == (formed > 1)


def test_a_chain_far_slower_than_the_fastest_is_not_formed(tmp_path):
    swarm = TrueSwarm(4, 7)
    for v in swarm.ids[3:]:  # four nodes on slow home links: a chain of them is ~100x slower
        swarm.up[v] = swarm.down[v] = 0.2
    for v in swarm.ids[:3]:
        swarm.up[v] = swarm.down[v] = 500.0
    r = registry_with(tmp_path, swarm, stages=3, pipelines="auto", standbys=0, min_chain_share=0.5)
    placement = placed(r, swarm, 3.0)
    assert list(placement.chains()) == [0] and set(placement.chains()[0]) == set(swarm.ids[:3])
    assert statuses(r) == {"active": 3, "standby": 4}
    assert any("no new pipeline" in e for e in r.events)


def test_a_vacancy_takes_a_standby_and_an_incomplete_pipeline_is_dissolved(tmp_path):
    swarm = TrueSwarm(5, 7)
    r = registry_with(tmp_path, swarm, stages=3, pipelines="auto", standbys=1, min_chain_share=0.0)
    placement = placed(r, swarm)
    assert sorted(placement.chains()) == [0, 1]
    spare = next(n.node_id for n in r.nodes.values() if n.status is NodeStatus.STANDBY)
    fail(r, placement.chains()[1][1])
    asyncio.run(settle(placement, 1.0))
    assert placement.chains()[1][1] == spare and sorted(placement.chains()) == [0, 1]
    fail(r, placement.chains()[1][0])
    asyncio.run(settle(placement, 1.0))
    assert sorted(placement.chains()) == [0] and r.roster.pipelines() == [0]  # training goes on in pipeline 0
    assert statuses(r) == {"active": 3, "standby": 2, "failed": 2}
    assert any("pipeline 1 dissolved" in e for e in r.events)


@pytest.mark.parametrize("ready", ["stage step", "outer state"])
def test_while_a_stage_taken_over_loads_the_other_pipeline_does_not_wait_for_its_pipeline(tmp_path, ready):
    """A standby takes a failed holder's stage in pipeline 1: until it reports its stage's step (its
    checkpoint loaded, its averager started) or its outer state, pipeline 0's holders are told one pipeline
    trains (their rounds do not wait outer_timeout_s for a pipeline loading a checkpoint), yet still admit
    pipeline 1's replicas, while pipeline 1's holders count both; once it reports, every holder counts both
    again (pipeline 0's next round waits for it, its outer state still while pipeline 1 returns to it)."""
    swarm = TrueSwarm(5, 7)
    r = registry_with(tmp_path, swarm, stages=3, pipelines="auto", standbys=1, min_chain_share=0.0)
    placement = placed(r, swarm)
    chains = placement.chains()
    assert sorted(chains) == [0, 1]
    spare = next(n.node_id for n in r.nodes.values() if n.status is NodeStatus.STANDBY)
    fail(r, chains[1][1])
    asyncio.run(settle(placement, 1.0))
    assert placement.chains()[1][1] == spare
    resumed = r.nodes[spare].resume_step
    r.roster.dht_peers = ["/ip4/127.0.0.1/tcp/1/p2p/QmCoordinator"]
    sealers = {v: Sealer(SwarmKey("t" * 32), v, r.sealer.run, NodeKey.generate()) for v in swarm.ids}

    def beat(v: str, step: int, outer: bool = False) -> pb.Assignment:
        req = pb.HeartbeatRequest(node_id=v, stats=pb.TrainingStats(step=step))
        if outer:
            req.outer_state.step, req.outer_state.digest = resumed, b"d" * 32
        return r.heartbeat(sealers[v].seal(req, COORDINATOR)).assignment

    for k, v in enumerate(placement.chains()[0]):
        assert beat(v, 40).pipelines == 1
        assert [n.node_id for n in r.roster.replicas(k, 0)] == [placement.chains()[1][k]]
        assert list(r.assignment(r.nodes[v]).dht_peers) == r.roster.dht_peers  # its averager runs on
    for v in placement.chains()[1]:
        assert beat(v, resumed).pipelines == 2
    assert beat(spare, 0).pipelines == 2  # its checkpoint loading (no stage stats yet): pipeline 0 does not wait
    assert r.assignment(r.nodes[chains[0][0]]).pipelines == 1
    if ready == "outer state":
        beat(spare, 0, outer=True)
    else:
        beat(spare, max(1, resumed))
    assert all(r.assignment(r.nodes[v]).pipelines == 2 for p in (0, 1) for v in placement.chains()[p])


def test_late_newcomers_complete_a_new_pipeline(tmp_path):
    swarm = TrueSwarm(6, 7)
    r = registry_with(tmp_path, swarm, stages=3, pipelines="auto", standbys=1, min_chain_share=0.0)
    late = swarm.ids[4:]
    for v in late:
        del r.nodes[v]
    placement = placed(r, swarm)
    assert list(placement.chains()) == [0] and statuses(r) == {"active": 3, "standby": 1}
    for v in late:
        r.nodes[v] = NodeRecord(v, f"sim:{v}", -1, "sim", status=NodeStatus.JOINING, layer_ms=swarm.layer_ms[v],
                                movable=True)
    r.census.last_join = time.monotonic() - 60
    r.epoch += 1
    asyncio.run(settle(placement, 2.0))
    assert sorted(placement.chains()) == [0, 1] and statuses(r) == {"active": 6, "standby": 1}


def join(r, name: str, stage: int) -> pb.JoinReply:
    """`name` joins `r` for `stage` (--stage N), as a daemon's join request does."""
    sealer = Sealer(SwarmKey("t" * 32), name, identity=NodeKey.generate())
    return r.join(sealer.seal(pb.JoinRequest(node_id=name, address=f"127.0.0.1:{len(name)}", stage=stage), COORDINATOR))


def fail(r, name: str) -> None:
    r.nodes[name].status = NodeStatus.FAILED  # what the sweep records
    r.roster.invalidate()
    r.epoch += 1


def test_a_pinned_node_opens_a_new_pipeline_only_where_asked(tmp_path):
    two = registry_with(tmp_path / "two", TrueSwarm(0, 0), stages=2, pipelines=2)
    assert [join(two, n, k).assignment.pipeline for n, k in (("a", 0), ("b", 0), ("c", 1), ("d", 1))] == [0, 1, 0, 1]
    assert two.roster.complete_pipelines() == [0, 1]
    with pytest.raises(StageTaken, match="in every other of the 2 pipelines"):
        join(two, "e", 0)
    auto = registry_with(tmp_path / "auto", TrueSwarm(0, 0), stages=2, pipelines="auto")
    join(auto, "a", 0)
    # auto pipelines are formed of --stage auto nodes
    with pytest.raises(StageTaken, match="stage 0 is held by node a"):
        join(auto, "b", 0)


def test_a_pinned_node_whose_pipeline_was_dissolved_takes_only_its_own_stage_again(tmp_path):
    """Pipelines a/c, b/d and x/- of pinned nodes; d fails, so pipeline 1 is dissolved and b (stage 0)
    stands by. Pipeline 2's open stage 1 is not b's: b waits (before, it was put there) until a node
    for stage 1 opens pipeline 1 again, and takes its stage 0 there."""
    r = registry_with(tmp_path, TrueSwarm(0, 0), stages=2, pipelines=3)
    assert [join(r, n, k).assignment.pipeline for n, k in (("a", 0), ("b", 0), ("c", 1), ("d", 1), ("x", 0))] == \
        [0, 1, 0, 1, 2]
    for n in r.nodes.values():
        n.layer_ms = 1.0  # its compute speed reported
    placement = Placement(r, FAST, TrueSwarm(0, 0).measure)
    fail(r, "d")
    asyncio.run(settle(placement, 1.0))
    assert any("pipeline 1 dissolved" in e for e in r.events)
    assert r.nodes["b"].status is NodeStatus.STANDBY and r.roster.open_stages(2) == [1]
    assert join(r, "e", 1).assignment.pipeline == 2
    assert join(r, "f", 1).assignment.pipeline == 1
    asyncio.run(settle(placement, 1.0))
    assert placement.chains() == {0: ["a", "c"], 1: ["b", "f"], 2: ["x", "e"]}
    assert statuses(r) == {"active": 6, "failed": 1}
