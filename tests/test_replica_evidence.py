"""The coordinator's side of the averaging plane (issue 60): the outer state it names for a stage (only
believable reports count; the digest most distinct operators reported; ties to the lowest pipeline), and
what it makes of the replicas' word on each other: evidence, never a verdict on one operator's say-so
(finding 2: one insider's report banned an honest replica for 600 s, repeatable for every replica)."""

from __future__ import annotations

from tahnode.config import RunConfig
from tahnode.coordinator.bans import BanPolicy, Bans
from tahnode.coordinator.digests import StateDigests
from tahnode.coordinator.evidence import STRIKES, Evidence
from tahnode.coordinator.registry import SwarmRegistry
from tahnode.coordinator.state import NodeRecord, NodeStatus
from tahnode.net.auth import Sealer, SwarmKey
from tahnode.net.freshness import COORDINATOR
from tahnode.net.identity import NodeKey
from tahnode.proto import tahnode_pb2 as pb

TOKEN = "evidence-test"
D = {name: bytes([k]) * 32 for k, name in enumerate("abcd")}


def holder(node_id: str, pipeline: int) -> NodeRecord:
    record = NodeRecord(node_id, "127.0.0.1:1", 0, "cpu", pipeline=pipeline)
    record.averager_peer = f"peer-{node_id}"
    return record


def test_the_named_state_is_the_newest_step_and_its_most_reported_digest():
    digests = StateDigests(lambda step: step % 4 == 0)
    nodes = [holder(f"n{p}", p) for p in range(4)]
    operator = {"n0": b"k0", "n1": b"k1", "n2": b"k2", "n3": b"k2"}  # n2 and n3: one operator
    assert not digests.report(nodes[0], pb.OuterState(step=6, digest=D["a"]), committed=8)  # not a boundary
    assert not digests.report(nodes[0], pb.OuterState(step=12, digest=D["a"]), committed=8)  # not committed yet
    assert not digests.report(nodes[0], pb.OuterState(step=8, digest=b"short"), committed=8)
    assert digests.named(nodes, lambda n: operator[n.node_id]) == pb.NamedState()
    for node, digest in zip(nodes, "aabb"):
        assert digests.report(node, pb.OuterState(step=8, digest=D[digest]), committed=8)
    named = digests.named(nodes, lambda n: operator[n.node_id], asking="n1")
    # a: two operators; b: two ids of one operator, however many they are
    assert (named.step, named.digest, named.operators, list(named.sources), named.settled) == (
        8, D["a"], 2, ["peer-n0"], True)
    digests.report(nodes[3], pb.OuterState(step=12, digest=D["c"]), committed=12)
    named = digests.named(nodes, lambda n: operator[n.node_id])
    assert (named.step, named.digest, named.settled) == (12, D["c"], False)  # the newest step, not settled yet
    digests.report(nodes[3], pb.OuterState(step=8, digest=D["b"]), committed=12)
    tie = digests.named(nodes[2:], lambda n: n.node_id.encode())  # one each: the lowest pipeline's
    assert tie.digest == D["b"] and list(tie.sources) == ["peer-n2", "peer-n3"]


def test_a_replicas_word_is_evidence_never_a_verdict_alone():
    clock = [1000.0]
    evidence = Evidence(operator=lambda node_id: {"l1": b"L", "l2": b"L2"}.get(node_id, node_id.encode()),
                        clock=lambda: clock[0])
    accuse = pb.OuterReport(excluded=True, suspect=2, evidence="round 3: clipped")
    vouch = pb.OuterReport(clean=5)
    evidence.take("l1", {"h": accuse})
    assert evidence.judge("h", ["l1", "h2"]) is None  # one operator
    evidence.take("l2", {"h": accuse})
    evidence.take("h2", {"h": vouch})
    assert evidence.judge("h", ["l1", "l2", "h2"]) is None  # an honest witness vouches: not borne out
    assert not evidence.strikes.get("h2")
    assert len(evidence.strikes["l1"]) == len(evidence.strikes["l2"]) == 1
    evidence.take("h2", {"x": accuse})
    evidence.take("h3", {"x": accuse})
    verdict = evidence.judge("x", ["h2", "h3", "l1"])
    assert verdict is not None and verdict.accusers == ["h2", "h3"] and "clipped" in verdict.evidence[0]
    for k in range(STRIKES):  # accusations a vouch contradicts, again and again: l1's word counts for nothing
        evidence.take("l1", {f"v{k}": accuse})
        evidence.take("l2", {f"v{k}": accuse})
        evidence.take("h2", {f"v{k}": vouch})
        evidence.judge(f"v{k}", ["l1", "l2", "h2"])
    assert not evidence.has_standing("l1") and evidence.has_standing("h2")
    evidence.take("l1", {"y": accuse})
    evidence.take("h3", {"y": accuse})
    assert evidence.judge("y", ["l1", "h3"]) is None  # l1 has no standing: one operator left
    evidence.take("z1", {"same": accuse})
    evidence.take("z2", {"same": accuse})
    same = Evidence(operator=lambda node_id: b"one key")
    same.reports = dict(evidence.reports)
    assert same.judge("same", ["z1", "z2"]) is None  # two ids, one operator
    clock[0] += 3600
    assert evidence.has_standing("l1")  # strikes expire


class Swarm:
    """A registry of `pipelines` pipelines of one stage, each holder with its own key, host and averager."""

    def __init__(self, tmp_path, pipelines: int = 3):
        run = RunConfig.build("llama-tiny", None, **{"stages": 1, "swarm.pipelines": pipelines})
        self.reg = SwarmRegistry(run, SwarmKey(TOKEN), heartbeat_timeout=3600, store_dir=tmp_path / "store",
                                 bans=Bans(BanPolicy(3, 60, 600)))
        self.keys = {f"n{k}": NodeKey.generate() for k in range(pipelines)}
        for node in self.keys:
            self.reg.join(self.sealer(node).seal(pb.JoinRequest(node_id=node, address=f"10.0.0.{node[1]}:7000",
                                                                stage=0), COORDINATOR))
            self.beat(node)

    def sealer(self, node: str) -> Sealer:
        return Sealer(SwarmKey(TOKEN), node, self.reg.sealer.run, self.keys[node])

    def beat(self, node: str, *reports: pb.OuterReport) -> pb.HeartbeatReply:
        req = pb.HeartbeatRequest(node_id=node, averager=f"/ip4/10.0.0.{node[1]}/tcp/7001/p2p/peer{node[1]}",
                                  stats=pb.TrainingStats(outer_reports=list(reports)))
        return self.reg.heartbeat(self.sealer(node).seal(req, COORDINATOR))


def test_one_insiders_report_bans_no_one_two_operators_do_unless_a_witness_vouches(tmp_path):
    swarm = Swarm(tmp_path)
    assert len(swarm.reg.roster.complete_pipelines()) == 3
    accuse = pb.OuterReport(peer="peer1", excluded=True, suspect=3, evidence="round 2: opposed")
    for _ in range(5):  # before: 3 offences from one reporter banned n1 for 600 s
        swarm.beat("n0", accuse)
    assert swarm.reg.nodes["n1"].status is NodeStatus.ACTIVE
    swarm.beat("n2", pb.OuterReport(peer="peer1", clean=6))
    swarm.beat("n2", accuse)  # now n2 too: two operators, and no one vouches any more
    assert swarm.reg.nodes["n1"].status is NodeStatus.BANNED
    assert any("banned: n1" in e and "opposed" in e for e in swarm.reg.events)


def test_two_liars_cannot_get_an_honest_replica_banned_while_a_witness_vouches(tmp_path):
    swarm = Swarm(tmp_path, pipelines=4)
    accuse = pb.OuterReport(peer="peer1", excluded=True, suspect=2)
    swarm.beat("n3", pb.OuterReport(peer="peer1", clean=6))  # it averaged with n1, nothing against it
    swarm.beat("n0", accuse)
    swarm.beat("n2", accuse)
    assert all(n.status is NodeStatus.ACTIVE for n in swarm.reg.nodes.values())
    strikes = swarm.reg.council.evidence.strikes
    assert len(strikes["n0"]) == len(strikes["n2"]) == 1 and not strikes.get("n3")


def test_a_report_on_a_peer_that_is_no_replica_of_its_stage_is_left_out(tmp_path):
    swarm = Swarm(tmp_path)
    swarm.beat("n0", pb.OuterReport(peer="someone-else", excluded=True, suspect=9))
    assert not swarm.reg.council.evidence.reports
