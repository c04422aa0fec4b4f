"""Across real NAT (root, nftables): the coordinator and a public node in a "public" namespace, two
volunteers each behind its own MASQUERADE router with no inbound port open. The home nodes know
only the coordinator's multiaddr, find it through the DHT, reach each other through a relay (and
the public node directly), and train."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

pytest.importorskip("hivemind", reason="the p2p transport needs hivemind (pip install 'tahnode[p2p]')")

from swarm import wait_gone  # noqa: E402
from tahnode.tools.natns import PUBLIC_IP, NatSwarm, NatTopology, create_nat  # noqa: E402
from tahnode.tools.netns import remove  # noqa: E402
from test_swarm import root_reason  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.netns,
              pytest.mark.skipif(root_reason() is not None, reason=str(root_reason())),
              pytest.mark.skipif(shutil.which("nft") is None,
                                 reason="needs nft (Debian package nftables) for the NAT routers")]

PREFIX, STEPS = "tnt", 10
RUN = ["--steps", str(STEPS), "--micro-batches", "2", "--batch-size", "2", "--seq-len", "32", "--codec", "tahquant"]


def test_volunteers_behind_nat_join_through_the_dht_and_train_through_a_relay(tmp_path):
    topo = NatTopology(PREFIX)
    create_nat(topo)
    swarm = NatSwarm(topo, tmp_path, "nat-test-token", RUN)
    try:
        # a home cannot be dialled from outside: its router opens no port
        dial_in = subprocess.run(["ip", "netns", "exec", topo.public, sys.executable, "-c",
                                  "import socket; s = socket.socket(); s.settimeout(2); s.connect(('192.168.1.2', 9))"],
                                 capture_output=True, text=True)
        assert dial_in.returncode != 0
        swarm.up()
        state = swarm.wait(lambda s: s["training"]["finished"]
                           and {n["stage"] for n in s["nodes"] if n["finished"]} == {0, 1, 2}, 240, f"{STEPS} steps")
    finally:
        swarm.down()
        left = wait_gone(str(tmp_path))
        remove(PREFIX)
    assert swarm.maddr.startswith(f"/ip4/{PUBLIC_IP}/tcp/7001/p2p/")
    losses = [loss for _, loss in state["loss_history"]]
    assert len(losses) == STEPS and sum(losses[-3:]) / 3 < losses[0] - 0.3
    addresses = {n["id"]: n["address"] for n in state["nodes"]}
    for home in ("home1", "home2"):  # reachable from outside only through the relay (the coordinator, a public peer)
        assert addresses[home].startswith(f"{swarm.maddr}/p2p-circuit/p2p/"), addresses[home]
    assert "found the coordinator through the DHT" in swarm.log("home1")
    carried = {(link["src"], link["dst"]): link for link in state["links"] if link["bytes"]}
    assert set(carried) == {("home1", "home2"), ("home2", "home1"), ("home2", "public"), ("public", "home2")}
    assert all(link["transport"] == "p2p" for link in carried.values())
    assert left == []
