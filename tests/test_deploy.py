"""deploy/: the compose file's services and their commands, the Dockerfile's torch pin, and the
namespace swarm script (syntax always; as root: up, reachability, shaped throughput, down)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read deploy/docker-compose.yml")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SCRIPT = DEPLOY / "netns-swarm.sh"

NODES = ["node1", "node2", "node3", "node4"]


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR-default}."""
    def sub(m):
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}", sub, text)


def parse_command(command) -> tuple[str, dict[str, str]]:
    """(subcommand, {flag: value}) of a `tahnode SUB --flag value ...` command; every flag takes a
    value, and the real CLI parser must accept the command as it stands."""
    from tahnode.cli import build_parser

    argv = command if isinstance(command, list) else shlex.split(interpolate(command, {}))
    assert argv[:1] == ["tahnode"], argv
    sub, rest = argv[1], argv[2:]
    assert len(rest) % 2 == 0, f"flags without values in {argv}"
    flags = dict(zip(rest[::2], rest[1::2]))
    assert all(f.startswith("--") for f in flags), argv
    assert len(flags) == len(rest) // 2, f"repeated flag in {argv}"
    try:
        build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"`{' '.join(argv)}` is refused by tahnode's own parser")
    return sub, flags


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_compose_services_and_network(compose):
    services = compose["services"]
    assert set(services) == {"coordinator", *NODES}
    assert compose["networks"]["swarm"]["driver"] == "bridge"
    for name, svc in services.items():
        assert svc["networks"] == ["swarm"], name
        assert svc["image"] == "tahnode:latest", name
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    assert services["coordinator"]["ports"] == ["8080:8080"]
    for node in NODES:
        assert "ports" not in services[node]
        assert services[node]["depends_on"]["coordinator"]["condition"] == "service_healthy"
        assert services[node]["hostname"] == node


def test_compose_commands(compose):
    services = compose["services"]
    sub, co = parse_command(services["coordinator"]["command"])
    assert sub == "coordinator"
    assert co["--listen"] == "0.0.0.0:7000" and co["--http"] == "0.0.0.0:8080" and co["--stages"] == "3"
    assert (ROOT / co["--model"]).is_file() and co["--model"] == "configs/llama-tiny.toml"
    assert co["--token"] == "demo-token"
    assert co["--http"].rsplit(":", 1)[1] == services["coordinator"]["ports"][0].split(":")[1]
    # The token: the same default on both sides, and overridable by TAHNODE_TOKEN.
    raw = services["coordinator"]["command"]
    assert "--token other" in interpolate(raw, {"TAHNODE_TOKEN": "other"})
    ids = []
    for node in NODES:
        sub, jo = parse_command(services[node]["command"])
        assert sub == "join"
        assert jo["--coordinator"] == "coordinator:" + co["--listen"].rsplit(":", 1)[1]
        assert jo["--stage"] == "auto"
        assert jo["--listen"] == "0.0.0.0:7100"
        assert jo["--advertise"] == f"{node}:7100"  # the service name resolves on the bridge network
        assert interpolate(services[node]["environment"]["TAHNODE_TOKEN"], {}) == co["--token"]
        ids.append(jo.get("--node-id", node))
    assert len(set(ids)) == len(NODES)


def test_dockerfile():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\s*$", text, re.M)
    pin = re.search(r'^ARG TORCH_REQUIREMENT="?([^"\n]+)"?', text, re.M).group(1)
    assert re.search(r'^ARG TORCH_INDEX_URL="?https://download\.pytorch\.org/whl/cpu"?', text, re.M)
    assert '"$TORCH_REQUIREMENT"' in text
    ci = ROOT / ".ci" / "run"
    if ci.exists():  # the image's default torch is CI's CPU pin
        assert f"TORCH={pin}" in ci.read_text()
    for src in re.findall(r"^COPY (\S+)", text, re.M):
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"


def test_netns_script_syntax_and_addresses():
    assert os.access(SCRIPT, os.X_OK)
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    out = subprocess.run([str(SCRIPT), "addr", "n3"], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "10.77.0.13"
    bad = subprocess.run([str(SCRIPT), "addr", "n9"], capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown namespace 'n9'" in bad.stderr
    assert "netem" not in re.sub(r"#.*", "", SCRIPT.read_text())


# -- the namespace swarm (root only) ---------------------------------------------------------------

PEER = r"""
import json, socket, sys, time
mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "recv":
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port)); srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    if conn.recv(4) == b"ping":  # reachability probe: echo and wait for the transfer
        conn.sendall(b"pong"); conn.close(); conn, _ = srv.accept()
        conn.recv(4)
    n, first, last = 0, None, None
    while True:
        b = conn.recv(1 << 20)
        if not b:
            break
        last = time.perf_counter()
        if first is None:
            first = last
        else:
            n += len(b)
    print(json.dumps({"bytes": n, "seconds": last - first}), flush=True)
else:
    c = socket.create_connection((host, port), timeout=5)
    c.sendall(b"ping"); assert c.recv(4) == b"pong"; c.close()
    t = time.perf_counter()
    c = socket.create_connection((host, port), timeout=5)
    c.sendall(b"data")
    rtt_ms = (time.perf_counter() - t) * 1e3
    buf, end = b"\0" * 65536, time.perf_counter() + float(sys.argv[4])
    while time.perf_counter() < end:
        c.sendall(buf)
    c.close()
    print(json.dumps({"connect_ms": rtt_ms}), flush=True)
"""


def script(*args: str, env: dict, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout)


def measure(env: dict, peer: Path, src: str, dst: str, seconds: float = 1.5) -> float:
    """Goodput in Mbit/s of a TCP stream src -> dst, measured at the receiver."""
    addr = script("addr", dst, env=env).stdout.strip()
    recv = subprocess.Popen([str(SCRIPT), "run", dst, sys.executable, str(peer), "recv", addr, "5201"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert recv.stdout.readline().strip() == "ready", recv.stderr.read()
        send = script("run", src, sys.executable, str(peer), "send", addr, "5201", str(seconds), env=env)
        assert send.returncode == 0, send.stderr
        out, err = recv.communicate(timeout=10)
        assert recv.returncode == 0, err
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    got = json.loads(out.strip().splitlines()[-1])
    return got["bytes"] * 8 / got["seconds"] / 1e6


@pytest.mark.netns
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="network namespaces and tc need root")
@pytest.mark.skipif(shutil.which("tc") is None or shutil.which("ip") is None, reason="iproute2 (ip, tc) is not installed")
def test_netns_swarm_shapes_links(tmp_path):
    prefix = f"tt{os.getpid() % 10000}-"
    env = dict(os.environ, TN_PREFIX=prefix, TN_SLOW_LINKS="n2-n3:20", TN_RATES="n2=200")
    peer = tmp_path / "peer.py"
    peer.write_text(PEER)
    start = time.monotonic()
    try:
        up = script("up", env=env)
        assert up.returncode == 0, up.stdout + up.stderr
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for name in ("hub", "coord", "n1", "n2", "n3", "n4"):
            assert prefix + name in listed
        # Only the namespaces hold 10.77.0.0/24 addresses; the root namespace has none.
        assert "10.77.0." not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        if shutil.which("ping"):
            ping = script("run", "n1", "ping", "-c", "1", "-W", "2", "10.77.0.12", env=env)
            assert ping.returncode == 0, ping.stdout + ping.stderr
        # The slow link and, from the same node, a fast one: shaping is per destination.
        slow = measure(env, peer, "n2", "n3")
        fast = measure(env, peer, "n2", "n4")
        assert 0.8 * 20 <= slow <= 1.2 * 20, f"n2->n3 shaped to 20 Mbit/s, measured {slow:.1f}"
        assert 0.8 * 200 <= fast <= 1.2 * 200, f"n2->n4 shaped to 200 Mbit/s, measured {fast:.1f}"
    finally:
        down = script("down", env=env)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert down.returncode == 0, down.stderr
    assert prefix not in listed, f"namespaces left behind: {listed}"
    assert time.monotonic() - start < 20
