"""A standby of a swarm whose pipelines train in data parallel joins their DHT while it waits, once, so that a stage
it takes over starts only its averager; one of a lone pipeline, or a holder, does not."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tahnode.config import NodeConfig
from tahnode.daemon import node as daemon_node
from tahnode.proto import tahnode_pb2 as pb


def test_a_standby_joins_the_dht_while_it_waits_only_when_pipelines_average(monkeypatch, tmp_path):
    started: list[tuple[str, list[str]]] = []

    async def host(cfg, folder, peers):
        started.append((str(folder), peers))
        return "host"

    monkeypatch.setattr(daemon_node, "averaging_host", host)
    standby = SimpleNamespace(warming=None, cfg=NodeConfig(checkpoint_dir=str(tmp_path)), node_id="n9")

    async def scenario():
        daemon_node.StageNode._warm(standby, pb.Assignment(stage=-1, pipelines=1))  # one pipeline: nothing to join
        daemon_node.StageNode._warm(standby, pb.Assignment(stage=1, pipelines=2, dht_peers=["/ip4/1"]))  # a holder
        assert standby.warming is None
        for _ in range(2):  # each assignment while it stands by: joined once
            daemon_node.StageNode._warm(standby, pb.Assignment(stage=-1, pipelines=2, dht_peers=["/ip4/1"]))
        assert await standby.warming == "host"

    asyncio.run(scenario())
    assert started == [(str(tmp_path), ["/ip4/1"])]


def test_a_failed_warm_up_is_said_and_the_stage_starts_its_dht_itself(monkeypatch, tmp_path, caplog):
    async def host(cfg, folder, peers):
        raise OSError("no p2p daemon")

    monkeypatch.setattr(daemon_node, "averaging_host", host)
    standby = SimpleNamespace(warming=None, cfg=NodeConfig(checkpoint_dir=str(tmp_path)), node_id="n9")

    async def scenario():
        daemon_node.StageNode._warm(standby, pb.Assignment(stage=-1, pipelines=2, dht_peers=["/ip4/1"]))
        with pytest.raises(OSError):
            await standby.warming
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert "did not start while it stood by (no p2p daemon)" in caplog.text
