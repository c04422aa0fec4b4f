"""The swarm token: no default secret. Where it comes from (file, environment, flag with a warning),
a coordinator that makes and keeps one when given none, and a node that refuses to start without."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest
from tahnode.config.token import TokenMissing, TokenOrigin, coordinator_token, resolve_token
from tahnode.tools.swarm import free_ports


def test_the_token_comes_from_the_file_the_flag_or_the_environment(tmp_path):
    f = tmp_path / "secret"
    f.write_text("from-file\n")
    assert resolve_token(None, str(f), {"TAHNODE_TOKEN": "env"}).secret == "from-file"
    flagged = resolve_token("from-flag", None, {"TAHNODE_TOKEN": "env"})
    assert flagged.secret == "from-flag" and flagged.origin is TokenOrigin.FLAG and "cmdline" in flagged.warning
    env = resolve_token(None, None, {"TAHNODE_TOKEN": " env \n"})
    assert env.secret == "env" and env.warning is None
    assert resolve_token(None, None, {}) is None
    with pytest.raises(TokenMissing, match="not both"):
        resolve_token("a", str(f), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(TokenMissing, match="empty"):
        resolve_token(None, str(tmp_path / "empty"), {})
    with pytest.raises(TokenMissing, match="cannot read"):
        resolve_token(None, str(tmp_path / "missing"), {})


def test_a_coordinator_without_a_token_makes_one_keeps_it_private_and_reuses_it(tmp_path):
    first = coordinator_token(None, None, tmp_path / "store", env={})
    assert first.origin is TokenOrigin.GENERATED and len(first.secret) >= 32
    assert stat.S_IMODE(os.stat(first.path).st_mode) == 0o600
    again = coordinator_token(None, None, tmp_path / "store", env={})
    assert again.origin is TokenOrigin.STORED and again.secret == first.secret
    other = coordinator_token(None, None, tmp_path / "other-store", env={})
    assert other.secret != first.secret
    assert coordinator_token(None, None, tmp_path / "store", env={"TAHNODE_TOKEN": "given"}).secret == "given"


def _env_without_token() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TAHNODE_TOKEN"}


def test_join_without_a_token_refuses_to_start():
    out = subprocess.run([sys.executable, "-m", "tahnode.cli", "join", "--coordinator", "127.0.0.1:1", "--stage", "0"],
                         capture_output=True, text=True, timeout=120, env=_env_without_token())
    assert out.returncode == 2
    assert "no swarm token" in out.stderr and "--token-file" in out.stderr


def test_the_coordinator_prints_the_token_it_made_and_the_join_command(tmp_path):
    store = tmp_path / "store"
    grpc_port, http_port = free_ports(2)
    proc = subprocess.Popen([sys.executable, "-m", "tahnode.cli", "coordinator", "--listen", f"127.0.0.1:{grpc_port}",
                             "--http", f"127.0.0.1:{http_port}", "--store", str(store), "--stages", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env_without_token())
    try:
        deadline, lines = time.monotonic() + 120, []
        while time.monotonic() < deadline and not any("tahnode join" in line for line in lines):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
    finally:
        proc.terminate()
        proc.wait(30)
    text = "".join(lines)
    secret = (store / "token").read_text().strip()
    assert f"TAHNODE_TOKEN={secret} tahnode join --coordinator" in text, text
    assert "made a new swarm token" in text
