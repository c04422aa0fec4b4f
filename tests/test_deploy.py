"""deploy/: the compose file's services and their commands, its GPU variant and the Dockerfile's
build arguments, read statically; tests/test_compose.py builds and runs the same files for real.
(The namespace swarm with shaped links is `tahnode swarm`: tests/test_swarm.py.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read deploy/docker-compose.yml")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"

NODES = ["node1", "node2", "node3"]


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
    assert "state" in compose["volumes"]
    for name, svc in services.items():
        assert svc["networks"] == ["swarm"], name
        assert svc["image"] == "tahnode:latest", name
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
        assert svc["init"] is True, name  # a signal-forwarding PID 1: `down` stops every daemon at once
        assert svc["volumes"] == ["state:/data"], name
        assert svc["env_file"] == "swarm.env" and "environment" not in svc, name  # the token never in this file
        args = svc["build"]["args"]
        assert (interpolate(args["BASE"], {}) == "python:3.11-slim"
                and interpolate(args["BASE"], {"TAHNODE_BASE": "b"}) == "b")
    assert interpolate(services["coordinator"]["ports"][0], {}) == "8080:8080"
    assert interpolate(services["coordinator"]["ports"][0], {"TAHNODE_HTTP_PORT": "9000"}) == "9000:8080"
    assert "/api/v1/state" in " ".join(services["coordinator"]["healthcheck"]["test"])
    for node in NODES:
        assert "ports" not in services[node]
        assert services[node]["depends_on"]["coordinator"]["condition"] == "service_healthy"
        assert services[node]["hostname"] == node
    assert "TAHNODE_TOKEN" not in (DEPLOY / "docker-compose.yml").read_text().split("x-tahnode")[1]


def test_the_gpu_variant_gives_each_node_a_gpu(compose):
    gpu = yaml.safe_load((DEPLOY / "docker-compose.gpu.yml").read_text())
    assert set(gpu["services"]) == set(NODES) <= set(compose["services"])
    for node in NODES:
        (device,) = gpu["services"][node]["deploy"]["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}


def test_compose_commands(compose):
    services = compose["services"]
    sub, co = parse_command(services["coordinator"]["command"])
    assert sub == "coordinator"
    assert co["--listen"] == "0.0.0.0:7000" and co["--http"] == "0.0.0.0:8080" and co["--stages"] == "3"
    assert co["--model"] == "llama-tiny" and co["--store"].startswith("/data/")  # a preset: shipped inside the wheel
    assert "--token" not in co and "--token-file" not in co  # the secret is never on a command line
    assert co["--http"].rsplit(":", 1)[1] == services["coordinator"]["ports"][0].rsplit(":", 1)[1]
    ids, dirs = [], set()
    for node in NODES:
        sub, jo = parse_command(services[node]["command"])
        assert sub == "join"
        assert jo["--coordinator"] == "coordinator:" + co["--listen"].rsplit(":", 1)[1]
        assert jo["--stage"] == "auto"
        assert jo["--listen"] == "0.0.0.0:7100"
        assert jo["--advertise"] == f"{node}:7100"  # the service name resolves on the bridge network
        assert "--token" not in jo
        ids.append(jo.get("--node-id", node))
        dirs.add(jo["--checkpoint-dir"])
    assert len(set(ids)) == len(NODES) and len(dirs) == len(NODES) and all(d.startswith("/data/") for d in dirs)


def test_dockerfile():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE=python:3\.11-slim\s*$", text, re.M) and re.search(r"^FROM \$\{BASE\}\s*$", text, re.M)
    pin = re.search(r'^ARG TORCH="?([^"\n]+)"?', text, re.M).group(1)
    assert re.search(r'^ARG TORCH_INDEX_URL="?https://download\.pytorch\.org/whl/cpu"?', text, re.M)
    assert '"$TORCH"' in text and "--no-index --find-links /tmp/wheels" in text
    assert re.search(r"^USER tahnode\s*$", text, re.M)  # not root
    ci = ROOT / ".ci" / "run"
    if ci.exists():  # the image's default torch is CI's CPU pin
        assert f"TORCH={pin}" in ci.read_text()
    for src in re.findall(r"^COPY (\S+)", text, re.M):
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "deploy/wheels" not in ignored and ".venv" in ignored and ".git" in ignored
