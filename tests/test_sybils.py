"""Sybils cost something (issue 60): one host holds at most --max-per-host replicas of a stage and one operator (node
key) one; a new pipeline is not formed wholly of one host's or one public /24's nodes while another trains; a node
kept out for these reasons waits as a standby and the event log says why; and a new id from a private host where
another id is banned is admitted but waits as a newcomer until that ban ends, while known nodes of that host go on."""

from __future__ import annotations

import asyncio

import pytest

from tahnode.config import PlacementSettings, RunConfig
from tahnode.coordinator.bans import BanPolicy, Bans, ban_marks
from tahnode.coordinator.placement import Placement
from tahnode.coordinator.registry import SwarmRegistry
from tahnode.coordinator.state import NodeStatus
from tahnode.net.auth import Sealer, SwarmKey
from tahnode.net.freshness import COORDINATOR
from tahnode.net.identity import NodeKey
from tahnode.proto import tahnode_pb2 as pb
from test_bans import Clock
from test_placement_scale import TrueSwarm, registry_with, settle

FAST = PlacementSettings(settle_s=0, probe_wait_s=1.0, rebalance_s=0, tick_s=0.05)
TOKEN = "sybils-test"


def seen(host: str) -> str:
    return f"ipv4:{host}:40000"


def with_pipeline_0(tmp_path, swarm: TrueSwarm, hosts: dict[str, str], **settings) -> SwarmRegistry:
    """v0000, v0001, v0002 hold stages 0..2 of pipeline 0; the others wait; each node on its host in `hosts`."""
    r = registry_with(tmp_path, swarm, stages=3, pipelines="auto", standbys=0, min_chain_share=0.0, **settings)
    for v, host in hosts.items():
        r.nodes[v].seen = seen(host)
    for k, v in enumerate(swarm.ids[:3]):
        r.place(r.nodes[v], k, 0)
    r.epoch += 1
    return r


def chains_after(r: SwarmRegistry, swarm: TrueSwarm) -> dict[int, list[str]]:
    placement = Placement(r, FAST, swarm.measure)
    asyncio.run(settle(placement, 3.0))
    return placement.chains()


@pytest.mark.parametrize("limit", [1, 0])
def test_a_host_holds_at_most_max_per_host_replicas_of_a_stage(tmp_path, limit):
    """Pipeline 0's stage 1 is on host H; of the waiting nodes only v0003, also on H, links fast to both others, so
    the fastest chain holds it on stage 1. With the default limit it holds another stage; with 0 (no limit) stage 1."""
    swarm = TrueSwarm(3, 6)
    ids = swarm.ids
    for v in ids:
        swarm.up[v] = swarm.down[v] = 100.0
        swarm.layer_ms[v] = 1.0
    for a in ids:
        for b in ids:
            swarm.factor[(a, b)] = 1.0
    swarm.factor[(ids[4], ids[5])] = swarm.factor[(ids[5], ids[4])] = 0.01  # v0004 and v0005: a bad path
    hosts = {ids[0]: "10.0.0.1", ids[1]: "10.0.0.9", ids[2]: "10.0.0.2", ids[3]: "10.0.0.9", ids[4]: "10.0.0.3",
             ids[5]: "10.0.0.4"}
    r = with_pipeline_0(tmp_path, swarm, hosts, max_per_host=limit)
    chains = chains_after(r, swarm)
    assert sorted(chains) == [0, 1] and chains[0] == ids[:3]
    if limit:
        assert chains[1][1] != ids[3] and ids[3] in chains[1]  # it holds stage 0 or 2: the search keeps to the limit
    else:
        assert chains[1] in ([ids[4], ids[3], ids[5]], [ids[5], ids[3], ids[4]])


@pytest.mark.parametrize("shared", [("10.0.0.9",) * 3, ("93.184.216.1", "93.184.216.2", "93.184.216.3")])
def test_no_new_pipeline_is_formed_wholly_of_one_hosts_or_one_public_24s_nodes(tmp_path, shared):
    """Pipeline 0 trains on three hosts; four nodes wait: three on one host (or one public /24), fast, and v0006
    elsewhere, slow. The fastest chain is the three's: it would average only with pipeline 0. The chain formed holds
    v0006; without it (it leaves) the three stand by, and the event log says why."""
    swarm = TrueSwarm(4, 7)
    ids = swarm.ids
    for v in ids:
        swarm.up[v] = swarm.down[v] = 100.0
        swarm.layer_ms[v] = 1.0
    swarm.factor.update({(a, b): 1.0 for a in ids for b in ids})
    swarm.layer_ms[ids[6]] = 5.0
    hosts = {ids[0]: "10.0.1.1", ids[1]: "10.0.1.2", ids[2]: "10.0.1.3", ids[6]: "10.0.1.4",
             **dict(zip(ids[3:6], shared))}
    r = with_pipeline_0(tmp_path, swarm, hosts)
    chains = chains_after(r, swarm)
    assert sorted(chains) == [0, 1] and ids[6] in chains[1], chains

    swarm = TrueSwarm(4, 6)
    for v in swarm.ids:
        swarm.layer_ms[v] = 1.0
    r = with_pipeline_0(tmp_path / "alone", swarm, {v: h for v, h in hosts.items() if v in swarm.ids})
    chains = chains_after(r, swarm)
    assert sorted(chains) == [0]
    assert all(r.nodes[v].status is NodeStatus.STANDBY for v in ids[3:6])
    assert any("cannot form a pipeline yet" in e and f"all {'on host' if shared[0] == shared[1] else 'in'}" in e
               for e in r.events), r.events


def test_a_standby_never_takes_a_stage_its_host_holds_elsewhere_and_the_log_says_why(tmp_path):
    """Pipelines 0 and 1 train; stage 1 of pipeline 1 fails and the only standby, v0006, is on the host of pipeline
    0's stage 1: it does not take it; pipeline 1 is dissolved, saying why, and formed again with v0006 elsewhere."""
    swarm = TrueSwarm(6, 7)
    for v in swarm.ids:
        swarm.layer_ms[v] = 1.0
    hosts = {v: f"10.0.0.{k + 1}" for k, v in enumerate(swarm.ids)}
    hosts[swarm.ids[6]] = hosts[swarm.ids[1]]
    r = with_pipeline_0(tmp_path, swarm, hosts)
    for k, v in enumerate(swarm.ids[3:6]):
        r.place(r.nodes[v], k, 1)
    r.roster.complete_pipelines()  # both formed
    r.nodes[swarm.ids[4]].status = NodeStatus.FAILED
    r.epoch += 1
    chains = chains_after(r, swarm)
    assert any(f"pipeline 1 dissolved: it lost a stage and no standby can take it (host {hosts[swarm.ids[1]]} of "
               f"{swarm.ids[6]} holds 1 replica(s) of stage 1" in e for e in r.events), r.events
    assert sorted(chains) == [0, 1] and sorted(chains[1]) == sorted([swarm.ids[3], swarm.ids[5], swarm.ids[6]])
    assert chains[1][1] != swarm.ids[6]


class Joins:
    """A registry whose nodes join over the wire's request, each with its own key (or one given) and host."""

    def __init__(self, tmp_path, clock: Clock | None = None, **swarm_settings):
        run = RunConfig.build("llama-tiny", None, stages=3, **{"swarm.pipelines": 2, **{
            f"swarm.{k}": v for k, v in swarm_settings.items()}})
        self.clock = clock or Clock()
        self.reg = SwarmRegistry(run, SwarmKey(TOKEN), heartbeat_timeout=3600, store_dir=tmp_path / "store",
                                 bans=Bans(BanPolicy(3, 60, 600), self.clock))
        self.keys: dict[str, NodeKey] = {}

    def join(self, node: str, stage: int, host: str, key: NodeKey | None = None) -> pb.JoinReply:
        key = key or self.keys.setdefault(node, NodeKey.generate())
        sealer = Sealer(SwarmKey(TOKEN), node, self.reg.sealer.run, key)
        req = pb.JoinRequest(node_id=node, address=f"{host}:{7100 + len(self.reg.nodes)}", stage=stage,
                             movable=stage < 0)
        return self.reg.join(sealer.seal(req, COORDINATOR), seen(host))

    def ban(self, node_id: str) -> None:
        """What a ban of `node_id` records (SwarmRegistry's verdict, whatever its evidence): its marks for 600 s."""
        node = self.reg.nodes[node_id]
        marks = [node_id, *ban_marks(node_id, self.keys[node_id].public, node.address, node.seen)]
        self.reg.bans.extend(marks, self.clock() + 600)
        self.reg.db.ban({m: self.reg.bans.until[m] for m in marks})
        node.status = NodeStatus.BANNED
        self.reg.epoch += 1


def test_a_node_that_names_its_stage_waits_where_its_host_or_key_holds_that_stage_already(tmp_path):
    """--stage N joins: pipeline 0 on hosts A, B, C; a join for stage 1 from B (or with b's key, from elsewhere) is
    admitted and waits, told why; from D it opens pipeline 1."""
    j = Joins(tmp_path)
    for k, (node, host) in enumerate((("a", "10.0.0.1"), ("b", "10.0.0.2"), ("c", "10.0.0.3"))):
        assert j.join(node, k, host).assignment.stage == k
    same_host = j.join("b2", 1, "10.0.0.2")
    assert same_host.assignment.stage == -1 and "host 10.0.0.2 of b2 holds 1 replica(s) of stage 1" in same_host.notice
    same_key = j.join("b3", 1, "10.0.0.8", key=j.keys["b"])
    assert same_key.assignment.stage == -1 and "has the node key of b" in same_key.notice
    assert j.reg.nodes["b2"].status is NodeStatus.JOINING and j.reg.nodes["b2"].chosen == 1
    assert any("b2 at 10.0.0.2" in e and "waits for stage 1" in e for e in j.reg.events)
    other = j.join("d", 1, "10.0.0.4")
    assert (other.assignment.stage, other.assignment.pipeline, other.notice) == (1, 1, "")


def test_a_new_id_from_the_host_of_a_banned_id_waits_as_a_newcomer_until_the_ban_ends(tmp_path):
    """n1 on 10.0.0.2 (a private host: bans.ban_marks holds no `host:` for it) is banned. A new id and key from
    10.0.0.2 is admitted as a newcomer: never placed, told why, and it stays one when it rejoins; a new id from
    another host and a node already known on 10.0.0.2 go on as before; when the ban ends the newcomer may be placed."""
    j = Joins(tmp_path)
    for k, (node, host) in enumerate((("n0", "10.0.0.1"), ("n1", "10.0.0.2"), ("n2", "10.0.0.3"))):
        j.join(node, k, host)
    j.join("spare", -1, "10.0.0.2")  # known before the ban, on the same host
    j.ban("n1")
    j.reg.sweep()
    sybil = j.join("sybil", -1, "10.0.0.2")
    assert j.reg.nodes["sybil"].status is NodeStatus.NEWCOMER and sybil.assignment.stage == -1
    assert "a newcomer: another id on host 10.0.0.2 is banned for another 600 s" in sybil.notice
    assert any("sybil at 10.0.0.2" in e and "waits as a newcomer for 600 s" in e for e in j.reg.events)
    assert "sybil" not in [n.node_id for n in j.reg.waiting()]  # placement never sees it
    j.clock.now += 100
    assert j.reg.nodes["sybil"].status is NodeStatus.NEWCOMER
    assert j.join("sybil", -1, "10.0.0.2").notice  # coming back under its id does not end the wait
    assert j.join("stranger", -1, "10.0.0.7").notice == "" and j.reg.nodes["stranger"].status is NodeStatus.JOINING
    assert j.join("spare", -1, "10.0.0.2").notice == "" and j.reg.nodes["spare"].status is NodeStatus.JOINING
    j.clock.now += 501
    j.reg.sweep()
    assert j.reg.nodes["sybil"].status is NodeStatus.JOINING and "sybil" in [n.node_id for n in j.reg.waiting()]
    assert any("newcomer sybil: no id on its host 10.0.0.2 is banned any more" in e for e in j.reg.events)


def test_a_ban_on_loopback_makes_no_newcomers(tmp_path):
    """A caller on 127.0.0.1 runs on the coordinator's own machine (a test swarm, a proxy): it tells no host."""
    j = Joins(tmp_path)
    for k, node in enumerate(("n0", "n1", "n2")):
        j.join(node, k, "127.0.0.1")
    j.ban("n1")
    j.reg.sweep()
    assert j.join("n3", -1, "127.0.0.1").notice == "" and j.reg.nodes["n3"].status is NodeStatus.JOINING


def test_a_newcomer_still_waits_after_the_coordinator_restarts(tmp_path):
    clock = Clock()
    j = Joins(tmp_path, clock)
    for k, (node, host) in enumerate((("n0", "10.0.0.1"), ("n1", "10.0.0.2"), ("n2", "10.0.0.3"))):
        j.join(node, k, host)
    j.ban("n1")
    j.reg.sweep()  # the host of n1 is watched, on disk with the bans
    again = Joins(tmp_path, clock)
    assert again.join("sybil", -1, "10.0.0.2").notice and again.reg.nodes["sybil"].status is NodeStatus.NEWCOMER


def test_hosts_and_sites(tmp_path):
    from tahnode.coordinator.sybils import caller_host, site_of

    assert caller_host("ipv4:93.184.216.34:40100") == "93.184.216.34" and caller_host("ipv6:[2001:db8::1]:5") == \
        "2001:db8::1"
    assert caller_host("p2p:QmPeer") == caller_host("") == ""
    assert site_of("93.184.216.34") == "93.184.216.0/24"
    assert site_of("2a00:1450:4001:80b::200e") == "2a00:1450:4001::/48"
    assert site_of("10.0.0.9") == site_of("127.0.0.1") == site_of("") == ""


def test_limits_off_with_max_per_host_zero_keep_one_key_to_one_replica(tmp_path):
    j = Joins(tmp_path, max_per_host=0)
    for k, node in enumerate("abc"):
        j.join(node, k, "127.0.0.1")
    assert j.join("b2", 1, "127.0.0.1").assignment.pipeline == 1  # a test swarm on one machine: no limit
    assert j.join("b3", 2, "127.0.0.1", key=j.keys["c"]).assignment.stage == -1  # one operator, one replica
