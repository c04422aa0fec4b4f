"""The coordinator fails a silent node before its heartbeat timeout only when its address, reached before, refuses
connections (its process is gone): a stalled node, or one never reached, waits for the timeout as before."""

from __future__ import annotations

import asyncio
import socket
import time

from tahnode.config import RunConfig
from tahnode.coordinator.gone import GoneWatch, Reach, connect, tcp_endpoint
from tahnode.coordinator.registry import SwarmRegistry
from tahnode.coordinator.state import NodeStatus
from tahnode.net.auth import Sealer, SwarmKey
from tahnode.net.freshness import COORDINATOR
from tahnode.net.identity import NodeKey
from tahnode.proto import tahnode_pb2 as pb

TOKEN = "gone-token"


def listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    return sock


def registry(tmp_path, addresses: dict[str, str]) -> SwarmRegistry:
    reg = SwarmRegistry(RunConfig.build("llama-tiny", None), SwarmKey(TOKEN), heartbeat_timeout=3600,
                        store_dir=tmp_path / "store")
    for stage, (node, address) in enumerate(addresses.items()):
        sealer = Sealer(SwarmKey(TOKEN), node, reg.sealer.run, NodeKey.generate())
        reg.join(sealer.seal(pb.JoinRequest(node_id=node, address=address, stage=stage), COORDINATOR))
    return reg


def silence(reg: SwarmRegistry, *nodes: str) -> None:
    for node in nodes:
        reg.nodes[node].last_seen = time.monotonic() - 30.0  # 30 heartbeat periods, far under the timeout


def test_addresses_parse_to_tcp_endpoints_and_others_are_skipped():
    assert tcp_endpoint("127.0.0.1:7100") == ("127.0.0.1", 7100)
    assert tcp_endpoint("[::1]:7100") == ("::1", 7100)
    assert tcp_endpoint("/ip4/1.2.3.4/tcp/1/p2p/Qm") is None and tcp_endpoint("host") is None
    assert tcp_endpoint(":7100") is None and tcp_endpoint("host:port") is None
    assert tcp_endpoint("node1:7100") is None  # a host name: left to the heartbeat timeout (no lookup)


def test_a_silent_node_whose_address_now_refuses_is_failed_and_a_stalled_or_unreached_one_is_not(tmp_path):
    killed, stalled, never = listening(), listening(), listening()
    never_address = "127.0.0.1:%d" % never.getsockname()[1]
    never.close()  # nothing ever listened there while the coordinator looked
    reg = registry(tmp_path, {"n0": "127.0.0.1:%d" % killed.getsockname()[1],
                              "n1": "127.0.0.1:%d" % stalled.getsockname()[1], "n2": never_address})
    watch = GoneWatch(reg)

    async def scenario():
        await watch.look()  # every node heard from: their addresses are reached (n2's refuses: not reached)
        assert set(watch.reached) == {"n0", "n1"}
        killed.close()
        silence(reg, "n0", "n1", "n2")
        await watch.look()

    asyncio.run(scenario())
    stalled.close()
    assert reg.nodes["n0"].status is NodeStatus.FAILED
    assert any("failed: n0 (stage 0) stopped its heartbeats" in e and "refuses connections" in e for e in reg.events)
    assert reg.nodes["n1"].status is NodeStatus.ACTIVE  # its kernel still accepts: only the timeout fails it
    assert reg.nodes["n2"].status is NodeStatus.ACTIVE  # refused where it was never reached: proves nothing


def test_a_node_is_looked_at_once_per_silence_and_a_heartbeat_clears_it(tmp_path):
    sock = listening()
    reg = registry(tmp_path, {"n0": "127.0.0.1:%d" % sock.getsockname()[1]})
    looks: list[tuple[str, int]] = []

    async def counted(host: str, port: int, timeout: float) -> Reach:
        looks.append((host, port))
        return await connect(host, port, timeout)

    watch = GoneWatch(reg, counted)

    async def scenario():
        await watch.look()
        await watch.look()  # reached already: not connected to again
        assert len(looks) == 1
        silence(reg, "n0")
        await watch.look()
        await watch.look()  # the same silence: looked at once
        assert len(looks) == 2
        reg.nodes["n0"].last_seen = time.monotonic()  # it beat again
        await watch.look()
        silence(reg, "n0")
        await watch.look()  # a new silence: looked at again
        assert len(looks) == 3

    asyncio.run(scenario())
    sock.close()
    assert reg.nodes["n0"].status is NodeStatus.ACTIVE


def test_an_address_not_reached_is_tried_again_only_after_a_while_or_when_it_changes(tmp_path):
    sock = listening()
    closed = "127.0.0.1:%d" % sock.getsockname()[1]
    sock.close()
    reg = registry(tmp_path, {"n0": closed})
    looks: list[int] = []

    async def counted(host: str, port: int, timeout: float) -> Reach:
        looks.append(port)
        return await connect(host, port, timeout)

    watch = GoneWatch(reg, counted)
    again = listening()

    async def scenario():
        await watch.look()
        await watch.look()  # refused (behind NAT, or not listening yet): not tried every half second
        assert len(looks) == 1 and "n0" not in watch.reached
        reg.nodes["n0"].address = "127.0.0.1:%d" % again.getsockname()[1]  # it joined again elsewhere
        await watch.look()
        assert len(looks) == 2 and watch.reached["n0"] == reg.nodes["n0"].address

    asyncio.run(scenario())
    again.close()
