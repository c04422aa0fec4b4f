"""The coordinator's durable state: a registry built again on the same store folder (as after kill -9
and a restart) has the ledger, the membership epoch, the stage holders and the run id it had; rollbacks are kept
as they were, and a loss that is not a number never entered the ledger. The same with real processes is in
test_coordinator.py."""

from __future__ import annotations

import math
import time

import pytest

from tahnode.config import RunConfig
from tahnode.coordinator.registry import SwarmRegistry
from tahnode.coordinator.state import NodeStatus
from tahnode.net.errors import StageTaken
from tahnode.net.auth import Sealer, SwarmKey
from tahnode.net.freshness import COORDINATOR
from tahnode.net.identity import NodeKey
from tahnode.proto import tahnode_pb2 as pb

TOKEN = "durable-test"
KEYS: dict[str, NodeKey] = {}


def registry(tmp_path) -> SwarmRegistry:
    run = RunConfig.build("llama-tiny", None, **{"train.steps": 100_000})  # ledgers of every length below fit the run
    return SwarmRegistry(run, SwarmKey(TOKEN), heartbeat_timeout=3600, store_dir=tmp_path / "store")


def beat(reg: SwarmRegistry, node: str, steps: list[int], loss: float = 1.0) -> None:
    points = [pb.LossPoint(step=s, loss=loss if s != 3 else math.nan, seconds=0.5, sample_ids=[10 * s, 10 * s + 1])
              for s in steps]
    sealer = Sealer(SwarmKey(TOKEN), node, reg.sealer.run, KEYS.setdefault(node, NodeKey.generate()))
    reg.heartbeat(sealer.seal(pb.HeartbeatRequest(node_id=node, stats=pb.TrainingStats(losses=points)), COORDINATOR))


def test_a_restarted_registry_has_the_ledger_epoch_and_run_it_had(tmp_path):
    reg = registry(tmp_path)
    n2 = Sealer(SwarmKey(TOKEN), "n2", identity=KEYS.setdefault("n2", NodeKey.generate()))
    reg.join(n2.seal(pb.JoinRequest(node_id="n2", address="127.0.0.1:1", stage=2), COORDINATOR))
    beat(reg, "n2", [0, 1, 2, 3, 4, 5])
    beat(reg, "n2", [4, 5, 6], loss=0.5)  # a rollback to step 4: steps 4.. trained again
    run, epoch, reg_key = reg.sealer.run, reg.epoch, reg.sealer.identity.public
    reg.epoch += 1  # as placement does
    del reg  # kill -9: nothing is flushed on purpose

    again = registry(tmp_path)
    assert again.sealer.run == run
    assert again.epoch == epoch + 1
    ledger = again.ledger()
    assert sorted(ledger) == [0, 1, 2, 4, 5, 6]  # step 3's NaN was refused
    assert list(again.losses) == [0, 1, 2, 4, 5, 6] and again.losses[4] == 0.5  # what the status page draws
    assert [ledger[s].loss for s in (2, 4, 5, 6)] == [1.0, 0.5, 0.5, 0.5]
    assert list(ledger[6].sample_ids) == [60, 61] and ledger[6].seconds == 0.5
    # the stage holders are kept (a stale node cannot take their stages while they come back);
    # the others rejoin by themselves when their heartbeat is refused as unknown
    assert ({k: (n.stage, n.address, n.status) for k, n in again.nodes.items()}
            == {"n2": (2, "127.0.0.1:1", NodeStatus.ACTIVE)})
    assert again.identities == {"n2": KEYS["n2"].public}  # and only with the key n2 joined with
    stale = Sealer(SwarmKey(TOKEN), "n9", run, KEYS.setdefault("n9", NodeKey.generate()))
    with pytest.raises(StageTaken):
        again.join(stale.seal(pb.JoinRequest(node_id="n9", address="127.0.0.1:9", stage=2), COORDINATOR))
    beat(again, "n2", [7])  # its heartbeats go on without a rejoin
    assert sorted(again.ledger()) == [0, 1, 2, 4, 5, 6, 7]
    assert again.sealer.identity.public == reg_key
    assert any("restarted" in e for e in again.events)


def test_a_kept_holder_has_its_time_to_report_from_when_the_restarted_coordinator_serves(tmp_path):
    """The holders a restart keeps have two heartbeat timeouts from serving() to report, however long
    the restart took to serve (under load it once took 14 s, and every holder was declared failed);
    a holder that never reports is failed after that."""
    reg = registry(tmp_path)
    n2 = Sealer(SwarmKey(TOKEN), "n2", identity=KEYS.setdefault("n2", NodeKey.generate()))
    reg.join(n2.seal(pb.JoinRequest(node_id="n2", address="127.0.0.1:1", stage=2), COORDINATOR))
    del reg
    again = registry(tmp_path)
    again.timeout = 10.0
    held = again.nodes["n2"]
    held.last_seen -= 30  # restored 30 s before it served
    again.serving()
    again.sweep()
    assert held.status is NodeStatus.ACTIVE
    held.last_seen -= 15  # 15 s later: within two timeouts of serving
    again.sweep()
    assert held.status is NodeStatus.ACTIVE
    held.last_seen -= 10  # 25 s later: gone
    again.sweep()
    assert held.status is NodeStatus.FAILED



def test_a_coordinator_that_stalled_fails_no_node_for_the_heartbeats_it_could_not_read(tmp_path):
    """Its event loop blocked for 20 s (a process started on it under load): every node's heartbeats waited unread,
    and the sweep that ran first after it declared all six failed at once (CI, tests/test_churn.py). The stall is
    credited to the nodes, whichever of the stall watch and the sweep runs first; a node silent past the timeout
    without a stall of the coordinator's is still failed."""
    reg = registry(tmp_path)
    reg.timeout = 6.0
    n2 = Sealer(SwarmKey(TOKEN), "n2", identity=KEYS.setdefault("n2", NodeKey.generate()))
    reg.join(n2.seal(pb.JoinRequest(node_id="n2", address="127.0.0.1:1", stage=2), COORDINATOR))
    held = reg.nodes["n2"]
    for watch_first in (False, True):
        now = time.monotonic()
        reg.census.stalls.beat(now - 20.0)  # the loop's last look, 20 s ago
        held.last_seen = now - 20.0         # its last heartbeat read then too
        if watch_first:
            reg.census.stalls.beat(now)
        reg.sweep()
        assert held.status is NodeStatus.ACTIVE, watch_first
        assert sum("the coordinator stalled for" in e for e in reg.events) == 1 + watch_first
    held.last_seen = time.monotonic() - 7.0  # silent past the timeout, the coordinator's loop on time
    reg.census.stalls.beat(time.monotonic())
    reg.sweep()
    assert held.status is NodeStatus.FAILED

def test_memory_holds_only_the_recent_losses(tmp_path):
    """A long run's ledger stays on disk: memory keeps the last LOSS_HISTORY losses (the soak
    found the coordinator growing by the whole ledger, about 1.8 KB per step)."""
    from tahnode.coordinator.registry import LOSS_HISTORY

    reg = registry(tmp_path)
    n2 = Sealer(SwarmKey(TOKEN), "n2", identity=KEYS.setdefault("n2", NodeKey.generate()))
    reg.join(n2.seal(pb.JoinRequest(node_id="n2", address="127.0.0.1:1", stage=2), COORDINATOR))
    total = LOSS_HISTORY + 500
    for start in range(0, total, 250):
        beat(reg, "n2", list(range(start, min(total, start + 250))))
    assert sorted(reg.losses) == list(range(total - LOSS_HISTORY, total))
    assert sorted(reg.ledger()) == [s for s in range(total) if s != 3]  # step 3 carried a NaN loss: refused


def test_a_fresh_store_starts_empty(tmp_path):
    reg = registry(tmp_path)
    assert reg.ledger() == {} and reg.epoch == 1 and len(reg.sealer.run) == 16
    assert registry(tmp_path / "other").sealer.run != reg.sealer.run


def test_a_heartbeat_replayed_to_the_restarted_coordinator_at_once_is_refused(tmp_path):
    """Issue 60: the coordinator saved the seal counters it had seen every 2 s, and let seals of the
    last 5 s before its start through (clocks a little behind): a heartbeat recorded and sent again
    right after a restart was accepted a second time. Its counter is on disk before it is accepted."""
    from tahnode.net.errors import NotFresh

    reg = registry(tmp_path)
    n2 = Sealer(SwarmKey(TOKEN), "n2", identity=KEYS.setdefault("n2", NodeKey.generate()))
    reg.join(n2.seal(pb.JoinRequest(node_id="n2", address="127.0.0.1:1", stage=2), COORDINATOR))
    n2.run = reg.sealer.run
    recorded = n2.seal(pb.HeartbeatRequest(node_id="n2", stats=pb.TrainingStats(
        losses=[pb.LossPoint(step=0, loss=1.0, sample_ids=[0])])), COORDINATOR)
    reg.heartbeat(recorded)
    del reg  # kill -9 within a second of the heartbeat
    again = registry(tmp_path)
    with pytest.raises(NotFresh, match="replayed"):
        again.heartbeat(recorded)
    again.heartbeat(n2.seal(pb.HeartbeatRequest(node_id="n2"), COORDINATOR))  # its next one is welcome
