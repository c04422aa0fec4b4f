"""The end of a run: once the coordinator knows it finished, placement gives no stage away; and a
node that trained the last step reports until the coordinator knows, before it leaves."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tahnode.config import PlacementSettings
from tahnode.coordinator.placement import Placement
from tahnode.coordinator.state import NodeStatus
from tahnode.daemon.heartbeats import Heartbeats
from tahnode.proto import tahnode_pb2 as pb
from test_placement_scale import TrueSwarm, registry_with, settle


def test_a_finished_run_gives_a_standby_no_stage_its_holders_leave(tmp_path):
    """Once the last stage reported the run's last step its holders leave one by one: the stages
    they leave stay open (a swarm once assigned its standby the stage of a holder that had left
    after the last step, and the standby then stopped, holding it)."""
    swarm = TrueSwarm(0, 4)
    r = registry_with(tmp_path, swarm, stages=3)
    placement = Placement(r, PlacementSettings(settle_s=0, probe_wait_s=30, rebalance_s=0.1, tick_s=0.05),
                          swarm.measure)
    asyncio.run(settle(placement, 1.5))
    chain = placement.current_chain()
    spare = [v for v in swarm.ids if r.nodes[v].status is NodeStatus.STANDBY]
    assert chain is not None and len(spare) == 1
    r.roster.finished.add(0)
    r.nodes[chain[1]].status = NodeStatus.LEFT  # what SwarmRegistry.leave records
    r.epoch += 1
    asyncio.run(settle(placement, 0.5))
    assert r.roster.open_stages() == [1] and r.nodes[spare[0]].status is NodeStatus.STANDBY
    assert [r.roster.holder(k).node_id for k in (0, 2)] == [chain[0], chain[2]]


class Coordinator:
    """Answers heartbeats; says the run finished from the `finished_at`-th on (never: None)."""

    def __init__(self, finished_at: int | None):
        self.sealer = SimpleNamespace(guard=SimpleNamespace(refused={}))
        self.finished_at, self.beats = finished_at, 0

    async def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        self.beats += 1
        return pb.HeartbeatReply(known=True,
                                 run_finished=self.finished_at is not None and self.beats >= self.finished_at)


def test_a_node_after_its_last_step_reports_until_the_coordinator_knows_the_run_finished():
    async def wait(finished_at, wait_s):
        coord = Coordinator(finished_at)
        beats = Heartbeats(coord, pb.JoinRequest(node_id="n1"), transport=None)
        await beats.stop()  # the last report
        return await beats.until_run_finished(wait_s), coord.beats

    assert asyncio.run(wait(3, 5.0)) == (True, 3)
    assert asyncio.run(wait(1, 5.0)) == (True, 1)   # the last report already said so: no more
    finished, sent = asyncio.run(wait(None, 0.5))  # the last stage never reports: leave anyway
    assert not finished and 2 <= sent <= 5
