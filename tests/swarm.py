"""Test harness: a coordinator and stage daemons started as real subprocesses, the way users start
them (`tahnode coordinator`, `tahnode join`), on 127.0.0.1 or inside network namespaces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tahnode.tools.demo import stages_reported
from tahnode.tools.swarm import fetch, free_ports

TAHNODE = [sys.executable, "-m", "tahnode.cli"]


class Swarm:
    def __init__(self, workdir: Path, token: str = "test-token", cache: Path | None = None):
        self.workdir = workdir
        self.token = token
        self.grpc_port, self.http_port = free_ports(2)
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "TAHNODE_CACHE": str(cache or workdir / "cache"),
                    "TAHNODE_TOKEN": token}

    @property
    def coordinator(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def spawn(self, name: str, args: list[str], prefix: list[str] | None = None,
              env: dict | None = None) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "a")
        proc = subprocess.Popen([*(prefix or []), *TAHNODE, *args], stdout=log, stderr=subprocess.STDOUT,
                                env={**self.env, **(env or {})})
        self.procs[name] = proc
        return proc

    def start_coordinator(self, *run_flags: str, listen: str | None = None, http: str | None = None) -> None:
        """Every daemon runs on 127.0.0.1, so the replicas of a stage share one host: no --max-per-host limit
        (a test may give it among `run_flags`, which come later and win)."""
        self.spawn("coordinator",
                   ["coordinator", "--listen", listen or self.coordinator, "--http",
                    http or f"127.0.0.1:{self.http_port}", "--store", str(self.workdir / "store"),
                    "--max-per-host", "0", *run_flags])

    def join(self, name: str, stage: int | str, *extra: str, prefix: list[str] | None = None,
             coordinator: str | None = None, env: dict | None = None) -> subprocess.Popen:
        """`coordinator`: None for this swarm's, "" for none (the node finds it through --initial-peers)."""
        told = ["--coordinator", self.coordinator if coordinator is None else coordinator] if coordinator != "" else []
        return self.spawn(name, ["join", *told, "--stage", str(stage), "--listen", "127.0.0.1:0",
                                 "--node-id", name, "--checkpoint-dir", str(self.workdir / "ck" / name),
                                 "--device", "cpu", *extra], prefix=prefix, env=env)

    def state(self) -> dict | None:
        return fetch(f"http://127.0.0.1:{self.http_port}")  # never through an http_proxy from the environment

    def ledger(self) -> dict | None:
        return fetch(f"http://127.0.0.1:{self.http_port}", "ledger")

    def metrics(self) -> str:
        """The coordinator's /metrics text."""
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an http_proxy
        with direct.open(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def wait_for(self, predicate, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() not in (None, 0):
                    raise AssertionError(f"{name} exited with {p.returncode} while waiting for "
                                         f"{what}:\n{self.log(name)}")
            state = self.state()
            if state and predicate(state):
                return state
            time.sleep(0.3)
        logs = "\n".join(f"--- {n}\n{self.log(n)[-3000:]}" for n in self.procs)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}; last state: "
                             f"{json.dumps(state)[:2000]}\n{logs}")

    def wait_finished(self, steps: int, timeout: float = 240) -> dict:
        """Until the last stage reported `steps` steps and every stage its final figures (stage 0's
        last report may come after the last stage's)."""
        def done(s: dict) -> bool:
            return s["training"]["finished"] and s["training"]["step"] >= steps and stages_reported(s)
        return self.wait_for(done, timeout, f"{steps} steps")

    def losses(self, state: dict) -> list[float]:
        return [loss for _, loss in state["loss_history"]]

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_exit(self, name: str, timeout: float = 60) -> int:
        """The process's exit code; if it runs on past `timeout` s, a failure that shows its log's end."""
        try:
            return self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still runs after {timeout} s; its log ends:\n"
                                 f"{self.log(name)[-4000:]}") from None

    def stop(self) -> None:
        """SIGTERM to the daemons, then to the coordinator once they are gone: a daemon's last report
        reaches it (one that cannot reach it retries for 30 s), as when a user stops a swarm."""
        daemons = [p for name, p in self.procs.items() if name != "coordinator"]
        coordinator = [self.procs["coordinator"]] if "coordinator" in self.procs else []
        for group in (daemons, coordinator):
            for p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in group:
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def processes_mentioning(text: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose command line contains `text` (a test's
    work folder: its daemons, their p2pd, whose identity file lies there, and their DHT processes)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if text in cmdline and stat.rsplit(")", 1)[1].split()[0] != "Z":
            out.append((int(entry.name), cmdline))
    return out


def wait_gone(text: str, timeout: float = 15) -> list[tuple[int, str]]:
    """Wait until no process mentions `text`; what is left after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (left := processes_mentioning(text)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
