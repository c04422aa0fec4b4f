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

from ..config import LinkEmulation
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    def __post_init__(self):
        self.stages = self.stages or self.nodes
        if self.nodes < 1 or not 1 <= self.stages <= self.nodes:
            raise SwarmError(f"--nodes {self.nodes} cannot hold --stages {self.stages}")
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
            swarm.wait(lambda s: len([n for n in s["nodes"] if n["status"] != "failed"]) >= spec.nodes, wait_s, "every node to join")
        except BaseException:
            cls.down(spec.prefix, spec.workdir)
            raise
        return swarm

    def _start_all(self) -> None:
        spec = self.spec
        if self.topo:
            coord = self.topo.host("coord").address
            self.coordinator, listen_http = f"{coord}:{COORD_PORT}", f"0.0.0.0:{HTTP_PORT}"
            self.http = f"http://{netns.HOST_LINK[1]}:{HTTP_PORT}"
        else:
            self.coordinator, port = f"127.0.0.1:{free_port()}", free_port()
            listen_http, self.http = f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"
        token = ["--token-file", str(token_file_of(spec.workdir))]
        self._start("coord", ["coordinator", "--listen", self.coordinator, "--http", listen_http, *token,
                              "--stages", str(spec.stages), "--store", str(spec.workdir / "store"),
                              "--heartbeat-timeout", f"{spec.heartbeat_timeout:g}", *spec.run_flags])
        for k, name in enumerate(spec.names):
            if self.topo:
                address = f"{self.topo.host(name).address}:{NODE_PORT}"
                listen = ["--listen", address, "--advertise", address]
            else:
                listen = ["--listen", "127.0.0.1:0"]
            self._start(name, ["join", "--coordinator", self.coordinator, "--stage", str(k) if spec.pinned else "auto",
                               "--node-id", name, *token, "--checkpoint-dir", str(spec.workdir / "ck" / name),
                               "--device", "cpu", "--quiet", "--threads", str(share_of_cores(spec.nodes)), *listen,
                               *spec.emulation(name).flags()])

    def _start(self, name: str, args: list[str]) -> None:
        prefix = ["ip", "netns", "exec", self.topo.host(name).namespace(self.spec.prefix)] if self.topo else []
        log = open(self.spec.workdir / "logs" / f"{name}.log", "w")
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "tahnode.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.pids[name] = proc.pid
        self._save()

    def _save(self) -> None:
        doc = {"spec": {**asdict(self.spec), "shaper": self.spec.shaper.value, "workdir": str(self.spec.workdir),
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
        pids += [pid for pid in _pids_with(str(token_file_of(workdir))) if pid not in pids + coordinator]  # not recorded: a crashed `up`
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


# -- the command ---------------------------------------------------------------------------------------

def add_parser(sub) -> None:
    """`tahnode swarm up | down | status`."""
    from ..config.flags import add_run_flags

    sw = sub.add_parser("swarm", help="a swarm on this machine with slow links (namespaces + tc, or user space)",
                        description=__doc__.split("\n\n")[0])
    ssub = sw.add_subparsers(dest="swarm_cmd", required=True)
    up = ssub.add_parser("up", help="start a coordinator and N nodes on shaped links (returns once they joined)",
                         description="Start a coordinator and N `--stage N` nodes (or `--stage auto` when there are "
                         "more nodes than stages) as background processes with shaped links. With --shaper tc (root): "
                         "one network namespace per process, every directed link between two nodes its own tc tbf; with "
                         "--shaper userspace: 127.0.0.1, each process paces its own links. This kernel has no netem, so "
                         "--rtt is always emulated in user space: every message and reply between two processes, data "
                         "and control, waits RTT/2 each way (TCP's own acknowledgements are not delayed).")
    up.add_argument("--nodes", type=int, default=3, help="stage daemons to start (default 3)")
    up.add_argument("--bandwidth", default="", metavar="RATE", help="rate of every link between two nodes, each direction (e.g. 50mbit; default unshaped)")
    up.add_argument("--rtt", default="", metavar="DURATION", help="round-trip time between processes (e.g. 50ms), in user space (see above)")
    up.add_argument("--slow-link", action="append", default=[], metavar="A-B:RATE", help="a slower link between nodes A and B, both directions (e.g. n2-n3:10mbit), repeatable")
    up.add_argument("--shaper", default=Shaper.TC.value, choices=[s.value for s in Shaper], help="tc (root, namespaces; default) or userspace (no root)")
    up.add_argument("--prefix", default="tns-", help="name prefix of the namespaces (a second swarm needs another; default tns-)")
    up.add_argument("--workdir", default="", help="state, logs, checkpoints (default: $TMPDIR/tahnode-swarm/PREFIX); "
                    "its checkpoints are wiped: every `up` trains from scratch")
    up.add_argument("--auto", action="store_true", help="every node joins with --stage auto: the coordinator probes the links "
                    "and places the nodes (the default when there are more nodes than stages; else node nK holds stage K-1)")
    up.add_argument("--heartbeat-timeout", type=float, default=10.0, help="the coordinator's failure detection, seconds (default 10)")
    up.add_argument("--wait", type=float, default=90.0, help="seconds to wait for every node to join (default 90)")
    up.set_defaults(run_actions=add_run_flags(up))
    for name, text in (("down", "stop every process and remove every namespace, link and qdisc of the swarm (also after a crash)"),
                       ("status", "the swarm's nodes and training progress")):
        p = ssub.add_parser(name, help=text, description=text)
        p.add_argument("--prefix", default="tns-", help="the swarm's prefix (default tns-)")
        p.add_argument("--workdir", default="", help="its work folder (default: $TMPDIR/tahnode-swarm/PREFIX)")


def _slow_links(items: list[str]) -> dict[frozenset, float]:
    from ..config import parse_rate

    links = {}
    for item in items:
        pair, sep, rate = item.partition(":")
        a, dash, b = pair.partition("-")
        if not (sep and dash and a and b):
            raise SwarmError(f"--slow-link takes A-B:RATE (e.g. n2-n3:10mbit), got {item!r}")
        links[frozenset((a, b))] = parse_rate(rate)
    return links


def main(args) -> int:
    from ..config import parse_duration, parse_rate
    from ..config.flags import run_flag_args

    workdir = Path(args.workdir) if args.workdir else default_workdir(args.prefix)
    try:
        if args.swarm_cmd == "down":
            done = LocalSwarm.down(args.prefix, workdir)
            print("\n".join(done) if done else f"nothing of swarm {args.prefix!r} was running")
            return 0
        if args.swarm_cmd == "status":
            doc = json.loads((workdir / "state.json").read_text()) if (workdir / "state.json").exists() else None
            if doc is None:
                print(f"no swarm {args.prefix!r} is up (no {workdir / 'state.json'})")
                return 1
            _print_state(fetch(doc["http"]), doc["http"])
            return 0
        spec = SwarmSpec(nodes=args.nodes, stages=args.stages or 0, bandwidth_bps=parse_rate(args.bandwidth) if args.bandwidth else 0.0,
                         rtt_s=parse_duration(args.rtt) if args.rtt else 0.0, slow_links=_slow_links(args.slow_link),
                         shaper=Shaper(args.shaper), prefix=args.prefix, workdir=workdir, auto=args.auto,
                         heartbeat_timeout=args.heartbeat_timeout,
                         run_flags=run_flag_args(args, args.run_actions, skip=("stages",)))
        if spec.shaper is Shaper.TC:
            netns.check_root()
        swarm = LocalSwarm.up(spec, wait_s=args.wait)
    except (SwarmError, netns.NetnsError, ValueError) as exc:
        print(f"tahnode swarm: {exc}", file=sys.stderr)
        return 2
    shaped = f"{spec.bandwidth_bps / 1e6:g} Mbit/s links" if spec.bandwidth_bps else "unshaped links"
    print(f"swarm {spec.prefix!r} is up: coordinator {swarm.coordinator}, {spec.nodes} nodes, {spec.stages} stages, {shaped}"
          f" ({spec.shaper} shaper), RTT {spec.rtt_s * 1e3:g} ms")
    _print_state(swarm.state(), swarm.http)
    print(f"logs: {spec.workdir / 'logs'}; stop it with: tahnode swarm down --prefix {spec.prefix}")
    return 0


def _print_state(state: dict | None, http: str) -> None:
    if state is None:
        print(f"the coordinator at {http} does not answer")
        return
    print(f"status page: {http}/")
    for n in state["nodes"]:
        print(f"  {n['id']:<8} stage {n['stage']:>2}  {n['status']:<8} {n['address']}")
    t = state["training"]
    if t["step"]:
        print(f"  step {t['step']}  loss {t['loss']:.4f}  {t['tokens_per_s']:.0f} tokens/s")
