"""The swarm `tahnode bench chaos` breaks: tahnode.tools.swarm's LocalSwarm with its daemons started
as volunteers start them (`tahnode join --stage auto`, each with its own --checkpoint-dir, no
--node-id unless asked), and the user's ways of breaking them: SIGKILL and a restart with the same
command line and folder, SIGSTOP/SIGCONT, a link cut, each of a daemon's whole process tree.

A cut on 127.0.0.1 drops every packet to or from the ports the daemon's processes hold (an nftables
table of its own, refreshed while the cut lasts: new connections are caught within `refresh`
seconds); in network namespaces it takes the daemon's veth down. A daemon is found in the
coordinator's state by the address it serves on, which stays the same across restarts."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from ..swarm import NODE_PORT, LocalSwarm, Shaper, SwarmError, free_ports

__all__ = ["ChaosSwarm", "LinkCut", "descendants", "ports_of", "remove_cuts"]

NFT_PREFIX = "tahnode_chaos_"


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def ports_of(pids: list[int]) -> set[int]:
    """The local TCP and UDP ports of every socket the processes hold (listening or connected)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    ports = set()
    for table in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[9] in inodes:
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def _nft(script: str) -> None:
    r = subprocess.run(["nft", "-f", "-"], input=script, capture_output=True, text=True)
    if r.returncode != 0:
        raise SwarmError(f"nft failed: {r.stderr.strip()}")


def remove_cuts(prefix: str) -> list[str]:
    """Delete the nftables tables of this swarm's cuts (after a crash too); their names."""
    if not shutil.which("nft"):
        return []
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout.split()
    mine = [t for t in out if t.startswith(NFT_PREFIX + _safe(prefix))]
    for table in mine:
        subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True)
    return mine


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", text)


class LinkCut:
    """One daemon cut off on 127.0.0.1: an nftables table that drops every packet whose source or
    destination port is one of the daemon's (its process tree's sockets, looked up again on `refresh`)."""

    def __init__(self, prefix: str, name: str, pid: int):
        self.table, self.pid = NFT_PREFIX + _safe(prefix + name), pid
        self.ports: set[int] = set()

    def start(self) -> None:
        _nft(f"table inet {self.table} {{\n set ports {{ type inet_service; }}\n"
             f" chain input {{ type filter hook input priority -10; policy accept;\n"
             f"  meta l4proto {{ tcp, udp }} th sport @ports drop\n  meta l4proto {{ tcp, udp }} th dport @ports drop\n"
             " }\n}\n")
        self.refresh()

    def refresh(self) -> None:
        new = ports_of(descendants(self.pid)) - self.ports
        if new:
            _nft(f"add element inet {self.table} ports {{ {', '.join(map(str, sorted(new)))} }}\n")
            self.ports |= new

    def stop(self) -> None:
        subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True)


class ChaosSwarm(LocalSwarm):
    """A LocalSwarm (spec.auto: every node joins with --stage auto) whose daemons can be killed,
    stopped, cut off and started again. `stable_ids`: each daemon gets --node-id NAME (as the
    swarm's other tools do) instead of the id it makes itself."""

    stable_ids = False

    def __init__(self, spec, topo=None):
        super().__init__(spec, topo)
        self.commands: dict[str, list[str]] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.addresses: dict[str, str] = {}  # daemon name -> the address it serves on
        self.lock = threading.Lock()         # one change of a process at a time
        self.killed: set[str] = set()        # daemons a fault killed and will start again

    @classmethod
    def start(cls, spec, stable_ids: bool, wait_s: float) -> "ChaosSwarm":
        """Up, as LocalSwarm.up, with this run's logs fresh (a restart appends to its daemon's log)."""
        shutil.rmtree(Path(spec.workdir) / "logs", ignore_errors=True)
        return (StableIdSwarm if stable_ids else cls).up(spec, wait_s=wait_s)

    # -- starting ------------------------------------------------------------------------------------
    def _start(self, name: str, args: list[str]) -> None:
        """(LocalSwarm's hook for every process it starts) As a volunteer would start it; remembered for restarts."""
        args = self._as_volunteer(name, list(args)) if args[0] == "join" else list(args)
        self.commands[name] = args
        self._spawn(name, args)

    def _as_volunteer(self, name: str, args: list[str]) -> list[str]:
        if not self.stable_ids and "--node-id" in args:
            k = args.index("--node-id")
            del args[k:k + 2]
        if self.topo:
            self.addresses[name] = f"{self.topo.host(name).address}:{NODE_PORT}"
        elif "--listen" in args:  # a port of its own, the same after a restart: how the state names it
            port = free_ports(1)[0]
            args[args.index("--listen") + 1] = self.addresses[name] = f"127.0.0.1:{port}"
        return args

    def _spawn(self, name: str, args: list[str]) -> None:
        prefix = ["ip", "netns", "exec", self.topo.host(name).namespace(self.spec.prefix)] if self.topo else []
        with open(self.spec.workdir / "logs" / f"{name}.log", "a") as log:
            proc = subprocess.Popen([*prefix, sys.executable, "-m", "tahnode.cli", *args], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs[name], self.pids[name] = proc, proc.pid
        self._save()

    # -- who is who ------------------------------------------------------------------------------------
    def name_of(self, node: dict) -> str | None:
        """The daemon behind one of the state's nodes (by the address it serves on), or None."""
        return next((name for name, address in self.addresses.items() if node.get("address") == address), None)

    def holder(self, state: dict | None, pipeline: int, stage: int) -> tuple[str, str] | None:
        """(daemon name, node id) of the active holder of `stage` in `pipeline`, or None."""
        for n in (state or {}).get("nodes", []):
            if n["status"] == "active" and n["stage"] == stage and n.get("pipeline") == pipeline:
                name = self.name_of(n)
                return (name, n["id"]) if name else None
        return None

    def alive(self, name: str) -> bool:
        return name in self.procs and self.procs[name].poll() is None

    def crashed(self) -> dict[str, int]:
        """Daemons that ended on their own: name -> exit code (reaped; a restart starts them again)."""
        return {name: p.returncode for name, p in list(self.procs.items()) if p.poll() is not None}

    # -- breaking -----------------------------------------------------------------------------------------
    def send_signal(self, name: str, sig: int) -> bool:
        """Send `sig` to the daemon's whole process tree (its session and anything it started outside
        it); False if it is not running."""
        with self.lock:
            if not self.alive(name):
                return False
            tree = descendants(self.procs[name].pid)
            try:
                os.killpg(self.procs[name].pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            for pid in tree:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            if sig == signal.SIGKILL:
                try:
                    self.procs[name].wait(10)
                except subprocess.TimeoutExpired:
                    pass
            return True

    def restart(self, name: str) -> bool:
        """Start the daemon (or the coordinator) again with its command line and folder; False if it runs."""
        with self.lock:
            if self.alive(name):
                return False
            self._spawn(name, self.commands[name])
            return True

    def cut(self, name: str) -> LinkCut | None:
        """Cut the daemon off (undone by `uncut`); None in namespaces."""
        if self.topo:
            self._link(name, up=False)
            return None
        if not shutil.which("nft"):
            raise SwarmError("a cut on 127.0.0.1 needs nft (Debian package nftables); or use --net netns")
        cut = LinkCut(self.spec.prefix, name, self.procs[name].pid)
        cut.start()
        return cut

    def uncut(self, name: str, cut: LinkCut | None) -> None:
        if self.topo:
            self._link(name, up=True)
        elif cut is not None:
            cut.stop()

    def _link(self, name: str, up: bool) -> None:
        r = subprocess.run(["ip", "-n", self.topo.hub, "link", "set", name, "up" if up else "down"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SwarmError(f"cannot take {name}'s link {'up' if up else 'down'}: {r.stderr.strip()}")

    @staticmethod
    def needs(shaper: Shaper, cuts: bool) -> str | None:
        """What this machine lacks for the swarm (None: nothing)."""
        if shaper is Shaper.TC and os.geteuid() != 0:
            return "--net netns needs root"
        if cuts and shaper is Shaper.USERSPACE and (os.geteuid() != 0 or not shutil.which("nft")):
            return "--faults cut on 127.0.0.1 needs root and nft (Debian package nftables); or use --net netns"
        return None


class StableIdSwarm(ChaosSwarm):
    """A ChaosSwarm whose daemons join with --node-id NAME."""

    stable_ids = True
