"""`tahnode compose up` for real: the image builds without Docker Hub (a local Debian base and
wheels built on this machine), the compose swarm of deploy/docker-compose.yml trains (three active
stages, the step rising, the loss falling on the coordinator's /api/v1/state), and `down` leaves no
container, network or volume of it; the untagged images earlier builds left are removed. Needs
root and a Docker engine: one is installed with apt and started for the test where it can be (and
stopped after it, its bridge and nft tables removed); otherwise the test is skipped, saying why."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tahnode.tools.swarm import fetch, free_port

pytestmark = [pytest.mark.slow, pytest.mark.root_network]  # dockerd: docker0, nftables, ip_forward
PACKAGES = ["docker.io", "docker-compose", "debootstrap"]


def sh(*cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)


def engine_answers() -> bool:
    return shutil.which("docker") is not None and sh("docker", "info").returncode == 0


def nft_tables() -> set[str]:
    out = sh("nft", "list", "tables") if shutil.which("nft") else None
    return set(out.stdout.split("\n")) - {""} if out and out.returncode == 0 else set()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A Docker engine: the one running, or dockerd started here (and stopped, cleaned up, after)."""
    if engine_answers():
        yield None
        return
    if os.geteuid() != 0:
        pytest.skip("no Docker engine runs and starting one needs root")
    if not (shutil.which("dockerd") and shutil.which("docker-compose") and shutil.which("debootstrap")):
        apt = sh("apt-get", "install", "-y", "-qq", *PACKAGES, timeout=600)
        if apt.returncode != 0:
            apt = subprocess.run(["bash", "-c",
                                  "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                                  + " ".join(PACKAGES)], capture_output=True, text=True, timeout=900)
        if apt.returncode != 0:
            pytest.skip(f"a Docker engine could not be installed with apt: {apt.stderr.strip()[-300:]}")
    tables, forward = nft_tables(), Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
    log = open(tmp_path_factory.mktemp("dockerd") / "dockerd.log", "w")
    dockerd = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while not engine_answers():
        if dockerd.poll() is not None or time.monotonic() > deadline:
            dockerd.kill()
            pytest.skip(f"dockerd did not start: {Path(log.name).read_text()[-500:]}")
        time.sleep(0.5)
    yield dockerd
    dockerd.send_signal(signal.SIGTERM)
    try:
        dockerd.wait(30)
    except subprocess.TimeoutExpired:
        dockerd.kill()
        dockerd.wait()
    sh("ip", "link", "delete", "docker0")
    for table in nft_tables() - tables:  # what dockerd made and left (ip nat, ip filter)
        sh("nft", "delete", "table", *table.split()[1:])
    Path("/proc/sys/net/ipv4/ip_forward").write_text(forward + "\n")
    assert sh("ip", "link", "show", "docker0").returncode != 0
    assert nft_tables() <= tables


def leftovers(project: str) -> dict[str, list[str]]:
    """The containers, networks and volumes compose made for `project` that still exist."""
    label = f"label=com.docker.compose.project={project}"
    found = {}
    for kind, cmd in (("containers", ["docker", "ps", "-aq"]), ("networks", ["docker", "network", "ls", "-q"]),
                      ("volumes", ["docker", "volume", "ls", "-q"])):
        found[kind] = sh(*cmd, "--filter", label).stdout.split()
    return found


def test_compose_up_trains_and_down_leaves_nothing(engine):
    project, port = f"tntest{os.getpid() % 10000}", free_port()
    tahnode = [sys.executable, "-m", "tahnode.cli", "compose"]
    try:
        up = subprocess.run([*tahnode, "up", "--project", project, "--http-port", str(port), "--quiet"],
                            capture_output=True, text=True, timeout=1800)
        assert up.returncode == 0, up.stderr[-3000:]
        url = f"http://127.0.0.1:{port}"

        def sample(predicate, timeout: float, what: str) -> dict:
            deadline, state = time.monotonic() + timeout, None
            while time.monotonic() < deadline:
                state = fetch(url) or state
                if state and predicate(state):
                    return state
                time.sleep(1)
            logs = sh("docker", "logs", "--tail", "30", f"{project}_node1_1", timeout=30)
            raise AssertionError(f"timed out waiting for {what}: {json.dumps(state)[:1500]}\n"
                                 f"{logs.stdout}{logs.stderr}")

        def active(state: dict) -> set[int]:
            return {n["stage"] for n in state["nodes"] if n["status"] == "active"}

        first = sample(lambda s: active(s) == {0, 1, 2} and s["training"]["step"] >= 2, 600,
                       "3 active stages and 2 steps")
        later = sample(lambda s: s["training"]["step"] >= first["training"]["step"] + 5, 300, "5 more steps")
        assert later["training"]["loss"] < later["training"]["loss_first"]
        assert {n["id"] for n in later["nodes"]} == {"node1", "node2", "node3"}
    finally:
        down = subprocess.run([*tahnode, "down", "--project", project, "--quiet"], capture_output=True, text=True,
                              timeout=300)
    assert down.returncode == 0, down.stderr[-2000:]
    assert leftovers(project) == {"containers": [], "networks": [], "volumes": []}


def build_probe(base: str, tag: str, labels: str) -> str:
    """An image of `base` with `labels` (no layer of its own), tagged `tag`: its id."""
    built = subprocess.run(["docker", "build", "-q", "-t", tag, "-"], input=f"FROM {base}\nLABEL {labels}\n",
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-2000:]
    return sh("docker", "image", "inspect", "-f", "{{.Id}}", tag).stdout.strip()


def test_up_removes_the_tahnode_images_a_rebuild_left_untagged(engine):
    """Each `up` of a changed checkout builds tahnode:latest anew and docker keeps the one before,
    untagged (about 1 GB): after its build, up removes those (compose.prune_replaced_images), as they
    carry the image's label, and no other image."""
    from tahnode.tools import compose

    base = next((b for b in (compose.HUB_BASE, compose.LOCAL_BASE) if compose.image_exists(b)), None)
    if base is None:
        pytest.skip("no base image to build the probes from (the test above makes the local one)")
    ours, theirs = "tntest-ours:probe", "tntest-theirs:probe"
    try:
        replaced = build_probe(base, ours, f"{compose.IMAGE_LABEL} probe=1")
        kept = build_probe(base, ours, f"{compose.IMAGE_LABEL} probe=2")
        foreign = build_probe(base, theirs, "probe=1")
        build_probe(base, theirs, "probe=2")
        compose.prune_replaced_images(quiet=True)
        exists = {i: sh("docker", "image", "inspect", i).returncode == 0 for i in (replaced, kept, foreign)}
        assert exists == {replaced: False, kept: True, foreign: True}
    finally:
        sh("docker", "image", "rm", "-f", ours, theirs)
        sh("docker", "image", "prune", "-f", "--filter", "label=probe")
