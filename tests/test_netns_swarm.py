"""A swarm across network namespaces with shaped links (deploy/netns-swarm.sh: tc HTB + tbf): the
coordinator measures the links, places 3 stages on 4 `--stage auto` nodes avoiding the slow link,
keeps the spare as a standby, and when stage 1's node is killed the standby takes over."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from swarm import Swarm
from tahnode.config import RunConfig
from tahnode.train.data import SampleSchedule, open_dataset

pytestmark = [pytest.mark.slow, pytest.mark.netns]
SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "netns-swarm.sh"
ADDR = {"coord": "10.77.0.10", "n1": "10.77.0.11", "n2": "10.77.0.12", "n3": "10.77.0.13", "n4": "10.77.0.14"}
FAST, SLOW = 200.0, 20.0
FLAGS = ["--steps", "30", "--checkpoint-every", "5", "--micro-batches", "2", "--batch-size", "8", "--seq-len", "128",
         "--codec", "none", "--backward-codec", "none"]  # big activations: the links, not compute, decide


def can_use_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces and tc"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    probe = subprocess.run(["ip", "netns", "add", "tahnode-probe"], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", "tahnode-probe"], capture_output=True)
    return None if probe.returncode == 0 else f"cannot create network namespaces: {probe.stderr.strip()}"


class NetnsSwarm(Swarm):
    """The harness, with every process inside its namespace and the state read from inside too."""

    def __init__(self, workdir: Path, cache: Path, prefix: str):
        super().__init__(workdir, cache=cache)
        self.prefix = prefix
        self.http_port = 8080

    def ns(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.prefix + name]

    def state(self):
        code = f"import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://{ADDR['coord']}:8080/api/v1/state', timeout=2).read().decode())"
        r = subprocess.run([*self.ns("coord"), sys.executable, "-c", code], capture_output=True, text=True, timeout=10)
        return json.loads(r.stdout) if r.returncode == 0 and r.stdout else None

    def ledger(self) -> dict:
        code = f"import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://{ADDR['coord']}:8080/api/v1/ledger', timeout=5).read().decode())"
        r = subprocess.run([*self.ns("coord"), sys.executable, "-c", code], capture_output=True, text=True, timeout=10, check=True)
        return json.loads(r.stdout)


@pytest.fixture
def shaped(tmp_path, tmp_path_factory):
    reason = can_use_namespaces()
    if reason:
        pytest.skip(reason)
    prefix = f"ts{os.getpid() % 10000}-"
    env = dict(os.environ, TN_PREFIX=prefix, TN_SLOW_LINKS=f"n2-n3:{SLOW:.0f}")
    up = subprocess.run(["bash", str(SCRIPT), "up"], env=env, capture_output=True, text=True, timeout=60)
    assert up.returncode == 0, up.stderr
    swarm = NetnsSwarm(tmp_path, tmp_path_factory.getbasetemp() / "cache", prefix)
    try:
        yield swarm
    finally:
        swarm.stop()
        subprocess.run(["bash", str(SCRIPT), "down"], env=env, capture_output=True, timeout=60)


def test_auto_assignment_avoids_the_slow_link_and_a_standby_takes_over(shaped):
    swarm = shaped
    swarm.spawn("coordinator", ["coordinator", "--listen", f"{ADDR['coord']}:7000", "--http", f"{ADDR['coord']}:8080",
                                "--token", swarm.token, "--heartbeat-timeout", "5", "--store", str(swarm.workdir / "store"), *FLAGS],
                prefix=swarm.ns("coord"))
    for name in ("n1", "n2", "n3", "n4"):
        swarm.spawn(name, ["join", "--coordinator", f"{ADDR['coord']}:7000", "--stage", "auto", "--listen", f"{ADDR[name]}:7100",
                           "--node-id", name, "--token", swarm.token, "--checkpoint-dir", str(swarm.workdir / "ck" / name),
                           "--device", "cpu", "--quiet"], prefix=swarm.ns(name))
    state = swarm.wait_for(lambda s: sum(n["status"] == "active" for n in s["nodes"]) == 3
                           and sum(l["probed_mbps"] is not None for l in s["links"]) == 12, 240, "placement after probes")

    probed = {(l["src"], l["dst"]): l["probed_mbps"] for l in state["links"] if l["probed_mbps"] is not None}
    for (src, dst), mbps in probed.items():
        shaped_rate = SLOW if {src, dst} == {"n2", "n3"} else FAST
        assert abs(mbps - shaped_rate) <= 0.2 * shaped_rate, f"{src}->{dst}: measured {mbps:.1f}, shaped {shaped_rate}"
    chain = [n["id"] for n in sorted((n for n in state["nodes"] if n["status"] == "active"), key=lambda n: n["stage"])]
    assert not any({a, b} == {"n2", "n3"} for a, b in zip(chain, chain[1:])), f"chain {chain} uses the slow link"
    spare = [n for n in state["nodes"] if n["status"] == "standby"]
    assert len(spare) == 1 and spare[0]["id"] not in chain

    # kill the node of stage 1: the standby takes the stage over from the store
    swarm.wait_for(lambda s: s["training"]["step"] >= 12, 240, "step 12")
    victim = chain[1]
    swarm.procs[victim].send_signal(signal.SIGKILL)
    swarm.procs[victim].wait()
    del swarm.procs[victim]
    state = swarm.wait_finished(30, timeout=300)
    holders = {n["stage"]: n["id"] for n in state["nodes"] if n["status"] in ("active", "left") and n["stage"] >= 0}
    assert holders[1] == spare[0]["id"]
    assert any(f"assigned: {spare[0]['id']} -> stage 1, resuming from the checkpoint of step" in e for e in state["events"])

    # the ledger: every step once, with exactly the samples the schedule gives it
    ledger = swarm.ledger()["steps"]
    assert [e["step"] for e in ledger] == list(range(30))
    losses = [e["loss"] for e in ledger]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    run = RunConfig.build("llama-tiny", **{"train.batch_size": 8, "train.seq_len": 128, "train.micro_batches": 2})
    schedule = SampleSchedule(len(open_dataset(run, str(swarm.env["TAHNODE_CACHE"]))), 8, 2, seed=0)
    for e in ledger:
        expected = schedule.ids(e["step"], 0) + schedule.ids(e["step"], 1)
        assert sorted(e["sample_ids"]) == sorted(expected)
    trained = [i for e in ledger for i in e["sample_ids"]]
    assert len(trained) == len(set(trained)) == 30 * 16  # within one epoch: none lost, none twice
