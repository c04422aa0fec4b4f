"""`tahnode swarm up | down | status`: a whole swarm on this machine with slow links, for trying
tahnode out and for `tahnode bench swarm`. A coordinator and N nodes run as real processes, either
in network namespaces with every directed link shaped by tc (root), or on 127.0.0.1 with the links
shaped in user space (`--shaper userspace`). The kernel here has no netem, so a round-trip time is
always added in user space: every message and reply between two processes waits RTT/2 each way.

`up` writes the swarm's state (processes, addresses, status page) to its work folder; `down` stops
every process and removes every namespace, link and qdisc, found by name also after a crash."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from ..config import LinkEmulation, TransportKind
from ..config.token import new_token_file
from . import netns

__all__ = ["Shaper", "SwarmSpec", "LocalSwarm", "SwarmError", "default_workdir"]

COORD_PORT, NODE_PORT, HTTP_PORT = 7000, 7100, 8080


class SwarmError(RuntimeError):
    """The swarm cannot be made or reached (the message says why)."""


class Shaper(Enum):
    """Who shapes the links' rate."""

    TC = "tc"                # namespaces + tc (root)
    USERSPACE = "userspace"  # 127.0.0.1, each process paces its own outgoing links

    def __str__(self) -> str:
        return self.value


def token_file_of(workdir: Path) -> Path:
    """The swarm's secret, made by `up`; its path on the command lines finds its processes (`down`)."""
    return Path(workdir) / "token"


def default_workdir(prefix: str) -> Path:
    return Path(tempfile.gettempdir()) / "tahnode-swarm" / prefix.rstrip("-")


def share_of_cores(processes: int) -> int:
    """CPU threads for each of `processes` stage daemons sharing this machine (at least 1)."""
    return max(1, (os.cpu_count() or 1) // processes)


FIRST_CHOSEN_PORT = 10000  # free_port draws from here to below the kernel's ephemeral range


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for sockets bound to port 0 and for outgoing connections (Linux's default elsewhere)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now, for processes about to listen on them: drawn at
    random below the ephemeral range, so that no socket bound to port 0 meanwhile (a daemon's `--listen
    127.0.0.1:0`, an outgoing connection) can take one before its process binds it (a test once asked a
    coordinator's status page and was answered by a gRPC server); from that range if it leaves no room."""
    low, _ = ephemeral_ports()
    draw = random.SystemRandom()
    held: list[socket.socket] = []  # bound until all are drawn: never the same port twice
    try:
        while len(held) < count:
            held.append(_bound_port(draw, low))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def _bound_port(draw: random.Random, low: int) -> socket.socket:
    for _ in range(200 if low - FIRST_CHOSEN_PORT >= 100 else 0):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", draw.randrange(FIRST_CHOSEN_PORT, low)))
            return s
        except OSError:  # taken
            s.close()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


def free_port() -> int:
    """One port as free_ports gives them."""
    return free_ports(1)[0]


@dataclass
class SwarmSpec:
    """What `up` builds. Rates in bits/s (0 = unshaped), times in seconds."""

    nodes: int = 3
    stages: int = 0                       # 0: one stage per node
    bandwidth_bps: float = 0.0
    rtt_s: float = 0.0
    slow_links: dict[frozenset, float] = field(default_factory=dict)  # {a, b} -> bits/s
    shaper: Shaper = Shaper.TC
    prefix: str = "tns-"
    run_flags: list[str] = field(default_factory=list)  # for the coordinator: --model, --steps, --codec, ...
    heartbeat_timeout: float = 10.0
    auto: bool = False                    # every node joins with --stage auto (probes, placement)
    workdir: Path | None = None
    transport: TransportKind = TransportKind.GRPC  # the nodes' data plane (the control plane is gRPC)
    placement_flags: list[str] = field(default_factory=list)  # for the coordinator: --probe-wait, --rebalance-every
    # the last `late` nodes start only with start_late() (a volunteer who comes later)
    late: int = 0
    device: str = "cpu"                   # the nodes' --device (cuda: they share this machine's GPU)

    def __post_init__(self):
        self.stages = self.stages or self.nodes
        if self.nodes < 1 or not 1 <= self.stages <= self.nodes:
            raise SwarmError(f"--nodes {self.nodes} cannot hold --stages {self.stages}")
        if not 0 <= self.late <= self.nodes - self.stages:
            raise SwarmError(f"{self.late} late nodes leave fewer than {self.stages} to start with")
        names = set(self.names)
        for pair in self.slow_links:
            if not pair <= names or len(pair) != 2:
                raise SwarmError(f"slow link {'-'.join(sorted(pair))} is not between two of {', '.join(self.names)}")
        self.workdir = Path(self.workdir or default_workdir(self.prefix))

    @property
    def names(self) -> list[str]:
        return [f"n{k}" for k in range(1, self.nodes + 1)]

    @property
    def pinned(self) -> bool:
        """One node per stage: node n(k+1) holds stage k (no probes, no placement)."""
        return self.nodes == self.stages and not self.auto

    def emulation(self, name: str) -> LinkEmulation:
        """What node `name` emulates in user space: always the RTT; with the userspace shaper the rates too."""
        if self.shaper is Shaper.TC:
            return LinkEmulation(rtt_s=self.rtt_s)
        peers = {next(iter(pair - {name})): rate for pair, rate in self.slow_links.items() if name in pair}
        return LinkEmulation(self.rtt_s, self.bandwidth_bps, peers)


class LocalSwarm:
    """A running swarm: its processes, its addresses, its status (`state()`), its tc counters."""

    def __init__(self, spec: SwarmSpec, topo: netns.Topology | None = None):
        self.spec, self.topo = spec, topo
        self.pids: dict[str, int] = {}
        self.http = self.coordinator = ""

    # -- up ------------------------------------------------------------------------------------------
    @classmethod
    def up(cls, spec: SwarmSpec, wait_s: float = 60.0) -> "LocalSwarm":
        """Make the network, start the coordinator and the nodes; wait until every node joined."""
        cls.down(spec.prefix, spec.workdir)
        for old in ("ck", "store"):  # a new swarm trains from scratch: no stage resumes an earlier run
            shutil.rmtree(spec.workdir / old, ignore_errors=True)
        spec.workdir.mkdir(parents=True, exist_ok=True)
        (spec.workdir / "logs").mkdir(exist_ok=True)
        new_token_file(token_file_of(spec.workdir))
        topo = None
        if spec.shaper is Shaper.TC:
            topo = netns.Topology.star(spec.prefix, ["coord", *spec.names], spec.bandwidth_bps, spec.slow_links)
            netns.create(topo)
        swarm = cls(spec, topo)
        try:
            swarm._start_all()
            swarm.wait(lambda s: len([n for n in s["nodes"] if n["status"] != "failed"]) >= spec.nodes - spec.late,
                       wait_s, "every node to join")
        except BaseException:
            cls.down(spec.prefix, spec.workdir)
            raise
        return swarm

    def _start_all(self) -> None:
        spec = self.spec
        if self.topo:
            coord = self.topo.host("coord").address
            self.coordinator, listen_http = f"{coord}:{COORD_PORT}", f"0.0.0.0:{HTTP_PORT}"
            self.http = f"http://{self.topo.host_link_addresses[1]}:{HTTP_PORT}"
        else:
            grpc_port, port = free_ports(2)
            self.coordinator = f"127.0.0.1:{grpc_port}"
            listen_http, self.http = f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"
        token = ["--token-file", str(token_file_of(spec.workdir))]
        one_host = [] if self.topo else ["--max-per-host", "0"]  # on 127.0.0.1 every replica shares one host
        self._start("coord", ["coordinator", "--listen", self.coordinator, "--http", listen_http, *token,
                              "--stages", str(spec.stages), "--store", str(spec.workdir / "store"),
                              "--heartbeat-timeout", f"{spec.heartbeat_timeout:g}", *one_host, *spec.placement_flags,
                              *spec.run_flags])
        for k, name in enumerate(spec.names[:spec.nodes - spec.late]):
            self._start_node(k, name)

    def start_late(self) -> None:
        """Start the nodes held back at `up` (SwarmSpec.late)."""
        for k, name in enumerate(self.spec.names):
            if name not in self.pids:
                self._start_node(k, name)

    def _start_node(self, k: int, name: str) -> None:
        spec = self.spec
        token = ["--token-file", str(token_file_of(spec.workdir))]
        if self.topo:
            address = f"{self.topo.host(name).address}:{NODE_PORT}"
            listen = ["--listen", address, "--advertise", address]
        else:
            listen = ["--listen", "127.0.0.1:0"]
        if spec.transport is TransportKind.P2P:
            host, port = (self.topo.host(name).address, NODE_PORT + 1) if self.topo else ("127.0.0.1", 0)
            listen += ["--transport", "p2p", "--p2p-listen", f"/ip4/{host}/tcp/{port}"]
        self._start(name, ["join", "--coordinator", self.coordinator, "--stage", str(k) if spec.pinned else "auto",
                           "--node-id", name, *token, "--checkpoint-dir", str(spec.workdir / "ck" / name),
                           "--device", spec.device, "--quiet", "--threads", str(share_of_cores(spec.nodes)), *listen,
                           *spec.emulation(name).flags()])

    def _start(self, name: str, args: list[str]) -> None:
        prefix = ["ip", "netns", "exec", self.topo.host(name).namespace(self.spec.prefix)] if self.topo else []
        log = open(self.spec.workdir / "logs" / f"{name}.log", "w")
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "tahnode.cli", *args], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.pids[name] = proc.pid
        self._save()

    def _save(self) -> None:
        doc = {"spec": {**asdict(self.spec), "shaper": self.spec.shaper.value, "workdir": str(self.spec.workdir),
                        "transport": self.spec.transport.value,
                        "slow_links": {"-".join(sorted(p)): r for p, r in self.spec.slow_links.items()}},
               "pids": self.pids, "http": self.http, "coordinator": self.coordinator}
        (self.spec.workdir / "state.json").write_text(json.dumps(doc, indent=1))

    # -- while it runs ---------------------------------------------------------------------------------
    def state(self, what: str = "state") -> dict | None:
        """The coordinator's /api/v1/<what> document (state or ledger), or None if it does not answer."""
        return fetch(self.http, what)

    def exited(self) -> list[str]:
        """The processes that ended with an error."""
        bad = []
        for name, pid in self.pids.items():
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue  # not our child (another `tahnode swarm` started it) or already reaped
            if done and os.waitstatus_to_exitcode(status) != 0:
                bad.append(name)
        return bad

    def wait(self, predicate, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            failed = self.exited()
            if failed:
                raise SwarmError(f"{', '.join(failed)} exited with an error while waiting for {what}; "
                                 f"logs in {self.spec.workdir / 'logs'}")
            state = self.state()
            if state is not None and predicate(state):
                return state
            time.sleep(0.3)
        raise SwarmError(f"timed out after {timeout:.0f} s waiting for {what}; logs in {self.spec.workdir / 'logs'}")

    def link_bytes(self, src: str, dst: str) -> int:
        """IP bytes sent so far on the directed link src -> dst (tc's counters; tc shaper only)."""
        if self.topo is None:
            raise SwarmError("link bytes are counted by tc: only with --shaper tc")
        return netns.class_bytes(self.topo, src).get(dst, 0)

    # -- down ------------------------------------------------------------------------------------------
    @staticmethod
    def down(prefix: str, workdir: Path | None = None) -> list[str]:
        """Stop every process of the swarm `prefix` and remove its namespaces, links and qdiscs;
        what it removed, one line each. Safe to run when nothing is left."""
        workdir = Path(workdir or default_workdir(prefix))
        removed = []
        state_file = workdir / "state.json"
        doc = json.loads(state_file.read_text()) if state_file.exists() else {}
        recorded = doc.get("pids", {})
        coordinator = [recorded["coord"]] if "coord" in recorded else []
        pids = [pid for name, pid in recorded.items() if name != "coord"]
        # not recorded: a crashed `up`
        pids += [pid for pid in _pids_with(str(token_file_of(workdir))) if pid not in pids + coordinator]
        if os.geteuid() == 0 and _has_ip():
            for ns in netns.namespaces(prefix):
                pids += [pid for pid in netns.pids_in(ns) if pid not in pids + coordinator]
        stopped = _stop(pids) + _stop(coordinator)  # the nodes first: they report and leave
        if stopped:
            removed.append(f"stopped {stopped} process(es)")
        if os.geteuid() == 0 and _has_ip():
            removed += [f"removed namespace {ns}" for ns in netns.remove(prefix)]
        if state_file.exists():
            state_file.unlink()
        return removed


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the swarm is local: never via http_proxy


def fetch(http: str, what: str = "state") -> dict | None:
    """GET {http}/api/v1/<what> as JSON, or None if the coordinator does not answer."""
    try:
        with _DIRECT.open(f"{http}/api/v1/{what}", timeout=5) as r:
            return json.load(r)
    except (OSError, ValueError):
        return None


def _has_ip() -> bool:
    return shutil.which("ip") is not None


def _pids_with(marker: str) -> list[int]:
    """Processes whose command line holds `marker` (the swarm's token file is on every one)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def _stop(pids: list[int], grace_s: float = 15.0) -> int:
    """SIGTERM the processes (their sessions), then SIGKILL what is left after `grace_s`."""
    alive = []
    for pid in dict.fromkeys(pids):
        try:
            os.killpg(pid, signal.SIGTERM)
            alive.append(pid)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGTERM)
                alive.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
    signalled = len(alive)
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        for pid in list(alive):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    alive.remove(pid)
                    continue
            except ChildProcessError:
                pass
            if not Path(f"/proc/{pid}").exists():
                alive.remove(pid)
        time.sleep(0.1)
    for pid in alive:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return signalled
