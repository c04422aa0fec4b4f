"""Home routers in network namespaces (root, nftables): a "public" namespace on the swarm's side,
and for each home a router namespace doing MASQUERADE with no inbound port open, in front of a
home namespace on a private subnet; and a p2p swarm on it (`NatSwarm`). What `tests/test_nat.py`
and `tahnode bench nat` run volunteers behind; remove(prefix) (tahnode.tools.netns) clears it.

    pub (PUBLIC_IP on lo, forwards) --10.79.K.0/24-- rK (NAT) --192.168.K.0/24-- hK"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .netns import NetnsError, _burst, _run, check_root, remove

__all__ = ["NatTopology", "NatSwarm", "PUBLIC_IP", "create_nat"]

PUBLIC_IP = "10.79.0.1"  # the public namespace's address every home reaches
COORDINATOR_P2P_PORT, NODE_P2P_PORT, HTTP_PORT = 7001, 7002, 8080


@dataclass
class NatTopology:
    prefix: str
    homes: int = 2
    wan_bps: float = 0.0   # each home's uplink and downlink (tbf on both ends of its WAN veth); 0 = unshaped

    @property
    def public(self) -> str:
        return self.prefix + "pub"

    def router(self, k: int) -> str:
        return f"{self.prefix}r{k}"

    def home(self, k: int) -> str:
        return f"{self.prefix}h{k}"


def _nat_rules(wan: str, lan: str) -> str:
    """MASQUERADE out of `wan`; forward only what `lan` started (no inbound port)."""
    return (f"table ip nat {{\n  chain post {{ type nat hook postrouting priority 100; oifname \"{wan}\" masquerade; "
            f"}}\n}}\ntable ip filter {{\n  chain guard {{ type filter hook forward priority 0; policy drop; "
            f"ct state established,related accept; iifname \"{lan}\" accept; }}\n}}\n")


def _veth(a: str, dev_a: str, ip_a: str, b: str, dev_b: str, ip_b: str) -> None:
    """A veth from namespace `a` to `b`, each end up with its /24 address; `b` routes through `a`."""
    _run("ip", "-n", a, "link", "add", dev_a, "type", "veth", "peer", "name", dev_b, "netns", b)
    for ns, dev, ip in ((a, dev_a, ip_a), (b, dev_b, ip_b)):
        _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
        _run("ip", "-n", ns, "link", "set", dev, "up")
    _run("ip", "-n", b, "route", "add", "default", "via", ip_a)


def _shape(ns: str, dev: str, rate_bps: float) -> None:
    _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(rate_bps)}bit", "burst",
         _burst(rate_bps), "latency", "400ms")


def create_nat(topo: NatTopology) -> None:
    """Make the namespaces, links, routes and NAT rules; on failure remove what was made."""
    check_root()
    if not shutil.which("nft"):
        raise NetnsError("`nft` (Debian package nftables) is not installed")
    remove(topo.prefix)
    try:
        pub = topo.public
        for ns in [pub] + [n for k in range(1, topo.homes + 1) for n in (topo.router(k), topo.home(k))]:
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", pub, "addr", "add", f"{PUBLIC_IP}/32", "dev", "lo")
        _run("ip", "netns", "exec", pub, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for k in range(1, topo.homes + 1):
            router, home = topo.router(k), topo.home(k)
            wan_pub, wan, lan, eth = (f"{topo.prefix}p{k}", f"{topo.prefix}w{k}", f"{topo.prefix}l{k}",
                                      f"{topo.prefix}e{k}")
            _veth(pub, wan_pub, f"10.79.{k}.1", router, wan, f"10.79.{k}.2")
            _veth(router, lan, f"192.168.{k}.1", home, eth, f"192.168.{k}.2")
            _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            rules = subprocess.run(["ip", "netns", "exec", router, "nft", "-f", "-"], input=_nat_rules(wan, lan),
                                   text=True, capture_output=True)
            if rules.returncode != 0:
                raise NetnsError(f"nft in {router} failed: {rules.stderr.strip()}")
            if topo.wan_bps:
                _shape(router, wan, topo.wan_bps)    # the home's uplink
                _shape(pub, wan_pub, topo.wan_bps)   # its downlink
    except BaseException:
        remove(topo.prefix)
        raise


class NatSwarm:
    """A p2p swarm on a NatTopology: the coordinator and a public node in the public namespace
    (announcing PUBLIC_IP, so they relay for others), `homes` nodes behind the routers with
    --use-auto-relay; every process started the way a user starts it, logs in `workdir`."""

    def __init__(self, topo: NatTopology, workdir: Path, token: str, run_flags: list[str], auto: bool = False):
        self.topo, self.workdir, self.run_flags, self.auto = topo, Path(workdir), run_flags, auto
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "TAHNODE_TOKEN": token,
                    "TAHNODE_CACHE": os.environ.get("TAHNODE_CACHE", str(self.workdir / "cache"))}
        self.maddr = ""

    def _start(self, name: str, namespace: str, args: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, "-m", "tahnode.cli",
                                             *args], stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def _join(self, name: str, namespace: str, stage: int, *extra: str) -> None:
        self._start(name, namespace, ["join", "--transport", "p2p", "--stage", "auto" if self.auto else str(stage),
                                      "--node-id", name, "--device", "cpu", "--threads", "1", "--quiet",
                                      "--checkpoint-dir", str(self.workdir / name), "--initial-peers", self.maddr,
                                      *extra])

    def up(self, wait_s: float = 60.0) -> None:
        """The coordinator, then the public node (the last stage) and the homes (stages 0, 1, ...)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        announce = f"/ip4/{PUBLIC_IP}/tcp/{COORDINATOR_P2P_PORT}"
        self._start("coordinator", self.topo.public, [
            "coordinator", "--transport", "p2p", "--listen", "127.0.0.1:7000", "--http", f"127.0.0.1:{HTTP_PORT}",
            "--store", str(self.workdir / "store"), "--p2p-listen", f"/ip4/0.0.0.0/tcp/{COORDINATOR_P2P_PORT}",
            "--announce", announce, "--stages", str(self.topo.homes + 1), *self.run_flags])
        deadline = time.monotonic() + wait_s
        while not (found := re.search(r"--initial-peers (\S+)", self.log("coordinator"))):
            if time.monotonic() > deadline or self.procs["coordinator"].poll() is not None:
                raise NetnsError("the coordinator did not start:\n" + self.log("coordinator")[-2000:])
            time.sleep(0.2)
        self.maddr = found.group(1)
        self._join("public", self.topo.public, self.topo.homes, "--p2p-listen", f"/ip4/0.0.0.0/tcp/{NODE_P2P_PORT}",
                   "--announce", f"/ip4/{PUBLIC_IP}/tcp/{NODE_P2P_PORT}")
        for k in range(1, self.topo.homes + 1):
            self._join(f"home{k}", self.topo.home(k), k - 1, "--use-auto-relay")

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def state(self) -> dict | None:
        """The coordinator's /api/v1/state (read inside the public namespace), or None."""
        got = subprocess.run(["ip", "netns", "exec", self.topo.public, sys.executable, "-c",
                              "import urllib.request as u; print(u.build_opener(u.ProxyHandler({})).open("
                              f"'http://127.0.0.1:{HTTP_PORT}/api/v1/state', timeout=5).read().decode())"],
                             capture_output=True, text=True)
        return json.loads(got.stdout) if got.returncode == 0 else None

    def wait(self, predicate, timeout: float, what: str) -> dict:
        deadline, state = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() not in (None, 0):
                    raise NetnsError(f"{name} exited with {proc.returncode} while waiting for "
                                     f"{what}:\n{self.log(name)[-3000:]}")
            state = self.state()
            if state and predicate(state):
                return state
            time.sleep(0.5)
        raise NetnsError(f"timed out after {timeout:.0f} s waiting for {what}: {json.dumps(state)[:1500]}\n"
                         + "\n".join(f"--- {n}\n{self.log(n)[-2000:]}" for n in self.procs))

    def down(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
