"""Bans of repeat offenders: three refused micro-batches within a minute, reported by a neighbour,
put the sender out for ten minutes (its stage goes to a standby, its joins are refused); reports
about non-neighbours, repeated counts and self-accusations do not count; a ban ends."""

from __future__ import annotations

import pytest

from tahnode.config import RunConfig
from tahnode.coordinator.bans import BanPolicy, Bans
from tahnode.coordinator.registry import SwarmRegistry
from tahnode.coordinator.state import NodeStatus
from tahnode.net.auth import Sealer, SwarmKey
from tahnode.net.errors import Banned, UnknownNode
from tahnode.net.freshness import COORDINATOR
from tahnode.net.identity import NodeKey
from tahnode.proto import tahnode_pb2 as pb

TOKEN = "bans-test"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_three_offences_within_the_window_ban_for_the_ban_time():
    clock = Clock()
    bans = Bans(BanPolicy(threshold=3, window_s=60, ban_s=600), clock)
    assert bans.report("b", {"a": 1}) == []
    clock.now += 10
    assert bans.report("b", {"a": 2}) == []
    assert bans.report("b", {"a": 2}) == []  # the same cumulative count again: nothing new
    clock.now += 10
    assert bans.report("b", {"a": 3}) == ["a"]
    assert bans.left("a") == pytest.approx(600)
    assert bans.report("b", {"a": 9}) == []  # already banned
    clock.now += 601
    assert bans.left("a") == 0.0


def test_offences_spread_beyond_the_window_or_against_oneself_do_not_ban():
    clock = Clock()
    bans = Bans(BanPolicy(threshold=3, window_s=60, ban_s=600), clock)
    for count in (1, 2, 3, 4):
        assert bans.report("b", {"a": count}) == []
        clock.now += 40  # never three within 60 s
    assert bans.report("b", {"b": 50}) == []
    assert bans.left("a") == bans.left("b") == 0.0
    assert bans.report("c", {"a": 10}) == ["a"]  # ten at once from another neighbour


class Swarm:
    """A registry with n0, n1, n2 holding stages 0..2 and n3 standing by; each speaks with its own key."""

    def __init__(self, tmp_path):
        self.clock = Clock()
        self.reg = SwarmRegistry(RunConfig.build("llama-tiny", None), SwarmKey(TOKEN), heartbeat_timeout=3600,
                                 store_dir=tmp_path / "store", bans=Bans(BanPolicy(3, 60, 600), self.clock))
        self.keys = {f"n{k}": NodeKey.generate() for k in range(4)}
        for k in range(3):
            self.join(f"n{k}", k)
        self.join("n3", -1)
        self.reg.stand_by(self.reg.nodes["n3"])

    def sealer(self, node: str) -> Sealer:
        return Sealer(SwarmKey(TOKEN), node, self.reg.sealer.run, self.keys[node])

    def join(self, node: str, stage: int) -> pb.JoinReply:
        return self.reg.join(self.sealer(node).seal(pb.JoinRequest(node_id=node,
                                                                   address=f"127.0.0.1:{7100 + int(node[1:])}",
                                                                   stage=stage), COORDINATOR))

    def beat(self, node: str, **offences: int) -> pb.HeartbeatReply:
        req = pb.HeartbeatRequest(node_id=node, stats=pb.TrainingStats(offences=offences))
        return self.reg.heartbeat(self.sealer(node).seal(req, COORDINATOR))


def test_a_neighbour_that_keeps_sending_bad_micro_batches_is_banned_and_cannot_rejoin(tmp_path):
    swarm = Swarm(tmp_path)
    swarm.beat("n2", n0=5)  # n0 is not n2's neighbour: it never sent n2 anything
    assert swarm.reg.nodes["n0"].status is NodeStatus.ACTIVE
    epoch = swarm.reg.epoch
    swarm.beat("n2", n1=3)
    assert swarm.reg.nodes["n1"].status is NodeStatus.BANNED and swarm.reg.epoch > epoch
    assert any("banned: n1 (stage 1) for 600 s: n2 refused 3" in e for e in swarm.reg.events)
    assert 1 in swarm.reg.roster.open_stages()  # a standby takes it at the next placement round
    with pytest.raises(UnknownNode):
        swarm.beat("n1")
    with pytest.raises(Banned):
        swarm.join("n1", -1)
    swarm.clock.now += 601
    assert swarm.join("n1", -1).assignment.stage == -1  # the ban is over: it may come back, as a newcomer


def test_a_stage_counts_the_senders_of_the_micro_batches_it_refuses():
    from tahnode.pipeline.state import Stats

    stats = Stats()
    for sender in ("n1", "n1", "", "n3"):
        stats.refused_from(sender)
    report = stats.report(0, 0)
    assert dict(report.offences) == {"n1": 2, "n3": 1} and report.refused["bad_micro_batch"] == 4
