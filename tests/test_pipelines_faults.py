"""Faults among the replicas, with real daemons: three pipelines of two stages, every node pinned to
its stage (pipelines n0/n1, n2/liar, victim/n5: the stage-0 nodes join first, a pinned node takes the
first pipeline whose stage is open). The liar's stage-1 replica sends pseudo-gradients of 1e30
from its sixth outer step on (after the victim's stall, so that the two faults do not meet in one
all-reduce): the honest replicas clip its parts into the radius of their own, refuse its averages,
exclude it from their groups and report it with the evidence, and the coordinator bans it (two
operators' replicas excluded it and none vouches for it). The victim stalls in the middle of its third outer step and is
killed with SIGKILL there (its whole machine: the daemon, its p2p daemon, its averager): the other
replicas of its stage finish that outer step within the deadline, and a standby takes its stage.
Pipeline 0 trains to the end, every step of it in the ledger once, its weights finite."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tahnode.net.averaging_rules import CHUNK_TIMEOUT_S
from tahnode.pipeline.checkpoint import read_verified
from tahnode.tools.chaos.daemons import descendants
from swarm import Swarm

pytestmark = pytest.mark.slow

STEPS, EVERY, TIMEOUT = 120, 4, 30
RUN = ["--stages", "2", "--steps", str(STEPS), "--checkpoint-every", "8", "--micro-batches", "2", "--batch-size", "4",
       "--seq-len", "64", "--codec", "none", "--backward-codec", "none", "--pipelines", "3", "--outer-every",
       str(EVERY), "--outer-timeout", str(TIMEOUT)]
FAULTY = Path(__file__).parent / "faulty_replica.py"


def logged_at(line: str) -> float:
    """The wall-clock time of a daemon's log line ("2026-11-26 19:29:43,391 tahnode...")."""
    return time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000


def kill_tree(pid: int) -> None:
    """SIGKILL to `pid` and every process below it (a daemon's p2p daemon and averager with it)."""
    for p in descendants(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_lying_replica_is_refused_and_banned_and_a_killed_one_does_not_stop_the_outer_step(tmp_path):
    swarm = Swarm(tmp_path)
    marker = tmp_path / "stalled"
    faulty = {}
    try:
        swarm.start_coordinator(*RUN)
        swarm.wait_for(lambda s: s is not None, 60, "the coordinator")
        for name, stage in (("n0", 0), ("n2", 0), ("victim", 0), ("n1", 1), ("liar", 1), ("n5", 1)):
            if name in ("liar", "victim"):
                args = ["join", "--coordinator", swarm.coordinator, "--stage", str(stage), "--listen", "127.0.0.1:0",
                        "--node-id", name, "--checkpoint-dir", str(tmp_path / "ck" / name), "--device", "cpu",
                        "--threads", "1"]
                mode = "liar" if name == "liar" else "stall"
                faulty[name] = subprocess.Popen([sys.executable, str(FAULTY), mode, str(marker), "--", *args[1:]],
                                                stdout=(tmp_path / f"{name}.log").open("a"), stderr=subprocess.STDOUT,
                                                env=swarm.env)
            else:
                swarm.join(name, stage, "--threads", "1")
            count = len(faulty) + len([n for n in swarm.procs if n != "coordinator"])
            swarm.wait_for(lambda s: len(s["nodes"]) == count, 60, f"{name} to join")  # pinned: joined in this order
        # a standby takes the victim's stage, so that its pipeline (and n5 with it, the liar's second honest
        # witness: a ban needs two operators' word) trains on
        swarm.join("spare", "auto", "--threads", "1")
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert time.monotonic() < deadline, "the victim never reached its third outer step"
            time.sleep(0.2)
        kill_tree(faulty["victim"].pid)  # the victim's machine dies in the middle of the all-reduce
        state = swarm.wait_for(lambda s: any("banned: liar" in e for e in s["events"]), 240, "the liar banned")
        assert "excluded it from their groups" in next(e for e in state["events"] if "banned: liar" in e)
        swarm.wait_for(lambda s: s["training"]["finished"] or any(p["index"] == 0 and (p["step"] or 0) >= STEPS
                                                                  for p in s["pipelines"]), 600,
                       f"pipeline 0 past {STEPS} steps")
        ledger = swarm.ledger()["steps"]
        final = swarm.state()
    finally:
        swarm.stop()
        for proc in faulty.values():
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait(10)
    stalled_at = marker.stat().st_mtime
    zero = [e for e in ledger if e["pipeline"] == 0]
    assert [e["step"] for e in zero] == list(range(STEPS))  # every step of pipeline 0 once
    assert all(math.isfinite(e["loss"]) for e in zero)
    # the other stage-0 replicas finished the outer step the victim died in (its group's), or the next,
    # within the deadline (a group without the victim forms then at the latest) and the chunk timeouts
    # after which the dead replica's part is given up (5 s as a sender, 10 s as a reducer; 70 s with 20 s ones)
    finished = []
    for name in ("n0", "n2"):
        after = [line for line in swarm.log(name).splitlines()
                 if "outer step after step" in line and logged_at(line) >= stalled_at]
        if after:
            finished.append(after[0])
            assert float(after[0].split("replicas (")[1].split(" s")[0]) < TIMEOUT + 3 * CHUNK_TIMEOUT_S, after[0]
    assert finished, (swarm.log("n0")[-2000:], swarm.log("n2")[-2000:])
    # the honest stage-1 replicas refused the liar's averages and reported it
    nodes = {n["id"]: n for n in final["nodes"]}
    assert nodes["liar"]["status"] == "banned"
    assert sum(nodes[n].get("outer", {}).get("refused", 0) for n in ("n1", "n5")) >= 2
    tensors, _ = read_verified(sorted((tmp_path / "ck" / "n1").glob("stage1-*.safetensors"))[-1])
    assert all(bool(torch.isfinite(t).all()) and float(t.abs().max()) < 1e3 for t in tensors.values())
