"""Swarms on libp2p, as users start them: nodes that know one multiaddr find the coordinator through
the DHT, are probed and placed over p2p links, and train; a swarm mixing gRPC and p2p nodes trains
too; and no p2p daemon or DHT process outlives its process, also one killed with SIGKILL."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import pytest

pytest.importorskip("hivemind", reason="the p2p transport needs hivemind (pip install 'tahnode[p2p]')")

from swarm import Swarm, processes_mentioning, wait_gone  # noqa: E402
from tahnode.config.node import P2PSettings  # noqa: E402
from tahnode.net.auth import SwarmKey  # noqa: E402
from tahnode.net.discovery import LAYOUT_KIND, NODE_KIND, SwarmDirectory  # noqa: E402
from tahnode.net.p2p.host import P2PHost, use_swarm_key  # noqa: E402
from tahnode.tools.swarm import free_port  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 12
RUN = ["--steps", str(STEPS), "--micro-batches", "2", "--batch-size", "2", "--seq-len", "32", "--codec", "tahquant",
       "--backward-codec", "naive", "--lr", "3e-3"]


def start_p2p_coordinator(s: Swarm, transport: str, *flags: str) -> str:
    """The coordinator on a fixed loopback p2p port; its multiaddr, as it prints it for volunteers."""
    s.start_coordinator(*RUN, "--transport", transport, "--p2p-listen", f"/ip4/127.0.0.1/tcp/{free_port()}", *flags)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(r"--initial-peers (\S+)", s.log("coordinator"))
        if found:
            return found.group(1)
        assert s.procs["coordinator"].poll() is None, s.log("coordinator")
        time.sleep(0.2)
    raise AssertionError("the coordinator printed no multiaddr:\n" + s.log("coordinator"))


def join_p2p(s: Swarm, name: str, stage: int | str, maddr: str, *extra: str):
    """`tahnode join --transport p2p --initial-peers MADDR`: no --coordinator, found through the DHT."""
    return s.spawn(name,
                   ["join", "--transport", "p2p", "--initial-peers", maddr, "--p2p-listen", "/ip4/127.0.0.1/tcp/0",
                    "--stage", str(stage), "--node-id", name, "--checkpoint-dir", str(s.workdir / "ck" / name),
                    "--device", "cpu", "--threads", "1", "--quiet", *extra])


def read_directory(maddr: str, token: str) -> tuple[dict, dict]:
    async def read():
        use_swarm_key(SwarmKey(token))  # a member: the swarm's DHT answers only requests with its key's MAC
        host = await P2PHost.start(P2PSettings(listen=["/ip4/127.0.0.1/tcp/0"], initial_peers=[maddr]))
        try:
            directory = SwarmDirectory(host.dht, SwarmKey(token))
            return await directory.read(NODE_KIND), await directory.read(LAYOUT_KIND)
        finally:
            await host.close()

    return asyncio.run(read())


def test_nodes_found_through_the_dht_are_probed_placed_and_train_over_p2p(tmp_path):
    s = Swarm(tmp_path)
    try:
        # the chain's links probed in full before training
        maddr = start_p2p_coordinator(s, "p2p", "--probe-wait", "60")
        for k in range(3):
            join_p2p(s, f"n{k}", "auto", maddr)
        state = s.wait_finished(STEPS, timeout=240)
        nodes, layout = read_directory(maddr, s.token)
        # the coordinator's daemon
        assert any("p2pd" in cmd for _, cmd in processes_mentioning(str(tmp_path / "store")))
        s.procs["coordinator"].send_signal(signal.SIGKILL)  # killed outright: its p2pd and DHT process must end anyway
    finally:
        s.stop()
    losses = s.losses(state)
    assert len(losses) == STEPS and sum(losses[-3:]) / 3 < losses[0] - 0.3
    assert sorted(n["stage"] for n in state["nodes"]) == [0, 1, 2]
    assert all(n["address"].startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in n["address"] for n in state["nodes"])
    assert state["p2p_maddrs"] == [maddr]
    chain = {n["stage"]: n["id"] for n in state["nodes"]}
    links = {(link["src"], link["dst"]): link for link in state["links"]}
    assert all(link["transport"] == "p2p" for link in links.values())
    for k in range(2):  # the chain's links, both ways: probed in full over p2p before placement; activations carried
        for pair in ((chain[k], chain[k + 1]), (chain[k + 1], chain[k])):
            assert links[pair]["probe"] == "full" and links[pair]["probed_mbps"] > 1, links[pair]
        assert links[(chain[k], chain[k + 1])]["bytes"] > 0
    assert {name: entry["stage"] for name, entry in nodes.items()} == {n["id"]: n["stage"] for n in state["nodes"]}
    assert {int(k): v["node"] for k, v in layout[LAYOUT_KIND]["holders"].items()} == chain
    assert wait_gone(str(tmp_path)) == []  # every p2pd and DHT process ended with its node or its killed coordinator


def test_a_swarm_of_grpc_and_p2p_nodes_trains(tmp_path):
    s = Swarm(tmp_path)
    try:
        maddr = start_p2p_coordinator(s, "both")
        # gRPC, told the coordinator's address
        s.join("grpc0", 0, "--threads", "1", "--quiet")
        # p2p, found it through the DHT
        join_p2p(s, "p2p1", 1, maddr)
        # gRPC, found it through the DHT
        s.join("grpc2", 2, "--threads", "1", "--quiet", "--initial-peers", maddr, coordinator="")
        state = s.wait_finished(STEPS, timeout=240)
    finally:
        s.stop()
    losses = s.losses(state)
    assert len(losses) == STEPS and sum(losses[-3:]) / 3 < losses[0] - 0.3
    via = {(link["src"], link["dst"]): link["transport"] for link in state["links"] if link["bytes"]}
    assert via == {("grpc0", "p2p1"): "p2p", ("p2p1", "grpc0"): "grpc", ("p2p1", "grpc2"): "grpc",
                   ("grpc2", "p2p1"): "p2p"}
    assert "found the coordinator through the DHT at 127.0.0.1:" in s.log("grpc2")
    assert wait_gone(str(tmp_path)) == []

