"""A volunteer keeps its identity (issue 61): its folder keeps its node id beside its key, so that restarted with the
folder it is the same node: the coordinator resumes its record (one row, its standing) and gives it its stage back
while that stage is still open; a folder runs one daemon at a time, and a --node-id that is not its own is refused."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tahnode.coordinator.state import NodeStatus
from tahnode.daemon.folder import NODE_ID_FILE, NodeFolder, NodeIdMismatch
from tahnode.net.errors import NotFresh
from tahnode.net.identity import NodeKey
from swarm import Swarm
from test_sybils import Joins

HOSTS = {name: f"10.0.0.{k + 1}" for k, name in enumerate("abcdefgh")}


def placed(tmp_path, chains: dict[int, str]) -> Joins:
    """Nodes joined with --stage auto on hosts of their own, placed as `chains` says (pipeline -> names by stage)."""
    j = Joins(tmp_path)
    for p, names in chains.items():
        for k, name in enumerate(names):
            assert j.join(name, -1, HOSTS[name]).assignment.stage == -1
            j.reg.place(j.reg.nodes[name], k, p)
    j.reg.epoch += 1
    return j


@pytest.mark.parametrize("went", [NodeStatus.ACTIVE, NodeStatus.FAILED, NodeStatus.LEFT])
def test_a_node_that_comes_back_under_its_id_and_key_resumes_its_record_and_its_open_stage(tmp_path, went):
    """b (stage 1) restarts: before its heartbeats were missed (active), after it was declared failed, or after it
    left. It comes back under its id and key: the same record, its first join and its compute kept, and stage 1."""
    j = placed(tmp_path, {0: "abc"})
    b = j.reg.nodes["b"]
    b.layer_ms, first_join = 2.5, b.joined_at
    b.status = went
    j.reg.epoch += 1
    reply = j.join("b", -1, HOSTS["b"])
    assert (reply.assignment.stage, reply.assignment.pipeline) == (1, 0)
    back = j.reg.nodes["b"]
    assert (back.status, back.rejoins, back.joined_at, back.layer_ms) == (NodeStatus.ACTIVE, 1, first_join, 2.5)
    assert sorted(j.reg.nodes) == ["a", "b", "c"] and j.reg.roster.chain(0) == ["a", "b", "c"]
    assert any("rejoined: b at" in e and "-> stage 1 again, still open" in e for e in j.reg.events), j.reg.events


def test_a_node_whose_stage_was_taken_meanwhile_waits_and_a_stranger_cannot_be_it(tmp_path):
    j = placed(tmp_path, {0: "abc"})
    j.join("d", -1, HOSTS["d"])
    j.reg.nodes["a"].status = NodeStatus.FAILED
    j.reg.place(j.reg.nodes["d"], 0, 0)  # a standby took stage 0 over
    j.reg.epoch += 1
    reply = j.join("a", -1, HOSTS["a"])
    assert reply.assignment.stage == -1 and j.reg.nodes["a"].status is NodeStatus.JOINING
    assert j.reg.nodes["a"].rejoins == 1 and j.reg.roster.chain(0) == ["d", "b", "c"]
    with pytest.raises(NotFresh):  # the id is bound to its key: another key cannot come back as it
        j.join("b", -1, HOSTS["b"], key=NodeKey.generate())
    assert j.reg.nodes["b"].rejoins == 0 and j.reg.nodes["b"].status is NodeStatus.ACTIVE


def test_a_replica_that_rejoins_for_its_stage_goes_back_to_its_own_pipeline(tmp_path):
    """b (stage 1 of pipeline 0) and e (stage 1 of pipeline 1) both failed; e's heartbeats rejoin it for stage 1 (as
    Heartbeats._rejoin does): it takes its own pipeline's stage back, not the first open one."""
    j = placed(tmp_path, {0: "abc", 1: "def"})
    for name in "be":
        j.reg.nodes[name].status = NodeStatus.FAILED
    j.reg.epoch += 1
    reply = j.join("e", 1, HOSTS["e"])
    assert (reply.assignment.stage, reply.assignment.pipeline) == (1, 1)
    assert j.reg.roster.open_stages(0) == [1]


def test_a_folder_keeps_its_node_id_and_runs_one_daemon_at_a_time(tmp_path):
    folder = tmp_path / "volunteer"
    first = NodeFolder.open(str(folder))
    assert first.node_id == f"{socket.gethostname()}-{os.getpid()}"
    assert (folder / NODE_ID_FILE).read_text().strip() == first.node_id
    other = subprocess.run([sys.executable, "-c", f"from tahnode.daemon.folder import NodeFolder\n"
                            f"NodeFolder.open({str(folder)!r})"], capture_output=True, text=True, timeout=60)
    assert other.returncode != 0 and "FolderInUse" in other.stderr and f"(pid {os.getpid()}) runs from" in other.stderr
    first.close()
    again = subprocess.run([sys.executable, "-c", f"from tahnode.daemon.folder import NodeFolder\n"
                            f"print(NodeFolder.open({str(folder)!r}).node_id)"], capture_output=True, text=True,
                           timeout=60)
    assert again.stdout.strip() == first.node_id  # another process, another pid: the same node
    with pytest.raises(NodeIdMismatch, match=f"is the folder of node '{first.node_id}' .*, not of 'someone-else'"):
        NodeFolder.open(str(folder), "someone-else")
    assert NodeFolder.open(str(folder), first.node_id).node_id == first.node_id
    assert NodeFolder.open(str(tmp_path / "named"), "vol-7").node_id == "vol-7"
    assert (tmp_path / "named" / NODE_ID_FILE).read_text().strip() == "vol-7"


def node_row(state: dict, node_id: str) -> dict:
    return next((n for n in state["nodes"] if n["id"] == node_id), {})


@pytest.mark.slow
def test_a_volunteer_restarted_with_its_folder_is_the_same_node(tmp_path):
    """Three volunteers, each `tahnode join --stage auto --checkpoint-dir DIR` (no --node-id), train; the holder of
    stage 1 is killed with SIGKILL, declared failed, and started again with the same command: it is the same node
    (one row on the status page, rejoined once) and holds stage 1 again, and training goes on. While it was down, a
    start on its folder under another --node-id is refused; while it runs, a second daemon on its folder is too."""
    swarm = Swarm(tmp_path)
    folders = {k: tmp_path / "ck" / f"v{k}" for k in range(3)}

    def volunteer(k: int, name: str = "", *extra: str):
        return swarm.spawn(name or f"v{k}", ["join", "--coordinator", swarm.coordinator, "--stage", "auto", "--listen",
                                             "127.0.0.1:0", "--checkpoint-dir", str(folders[k]), "--device", "cpu",
                                             "--quiet", "--threads", "1", *extra])

    def refused(name: str, text: str) -> None:
        assert swarm.wait_exit(name) == 1 and text in swarm.log(name), swarm.log(name)
        del swarm.procs[name]

    try:
        swarm.start_coordinator("--stages", "3", "--steps", "2000", "--heartbeat-timeout", "6", "--settle", "1",
                                "--probe-wait", "2", "--micro-batches", "2", "--batch-size", "2", "--seq-len", "32",
                                "--checkpoint-every", "5", "--codec", "none", "--backward-codec", "none")
        for k in folders:
            volunteer(k)
        before = swarm.wait_for(lambda s: s["training"]["step"] >= 8, 300, "three volunteers training to step 8")
        ids = {k: (folders[k] / NODE_ID_FILE).read_text().strip() for k in folders}
        victim = next(k for k in folders if node_row(before, ids[k]).get("stage") == 1)
        volunteer(victim, "twin")
        refused("twin", "runs from")
        killed = swarm.procs.pop(f"v{victim}")
        killed.kill()
        killed.wait(10)
        swarm.wait_for(lambda s: node_row(s, ids[victim]).get("status") == "failed", 60, "the killed node failed")
        volunteer(victim, "renamed", "--node-id", "someone-else")
        refused("renamed", f"is the folder of node '{ids[victim]}'")
        volunteer(victim)
        after = swarm.wait_for(lambda s: node_row(s, ids[victim]).get("status") == "active"
                               and s["training"]["step"] >= before["training"]["step"] + 10, 300,
                               "the restarted volunteer holding stage 1 again, and ten steps more")
    finally:
        swarm.stop()
    assert sorted(n["id"] for n in after["nodes"]) == sorted(ids.values())  # no new row: the same three nodes
    row = node_row(after, ids[victim])
    assert (row["stage"], row["rejoins"]) == (1, 1)
    assert "stage 1 again, still open" in swarm.log("coordinator")
