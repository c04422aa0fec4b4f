"""Network namespaces for a test swarm (root): a hub namespace with a bridge, one namespace per
host on 10.77.0.0/24 with a 64 KB MTU, every directed link shaped on its own with tc (an HTB class per
destination carrying a tbf), and a veth from the root namespace to one host so its status page can be opened.

Everything is named after a prefix, so `remove(prefix)` finds what a crashed run left behind."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field

__all__ = ["NetnsError", "Host", "Topology", "check_root", "create", "free_host_link", "remove", "namespaces",
           "pids_in", "class_bytes", "class_counters"]

SUBNET = "10.77.0"
HOST_LINKS = "10.78"                   # the root namespace's veths: the first free /30 in 10.78.0.0/16
# Every veth carries packets of up to 64 KB, as a NIC with segmentation offload hands them to the kernel: the
# namespaces share this machine's cores with the stages they carry, and at a 1500-byte MTU each TCP segment crossed
# veth, bridge and veth in software on those cores (2 pipelines at 50 Mbit/s: a third of the CPU in the kernel,
# 63% of the link limit; at this MTU 8% and 96%). Headers are then ~0.1% of the bytes, not ~3% as on the internet.
MTU = 65000
QUEUE_S = 0.4                           # a shaped link queues this many seconds of its rate, then drops


class NetnsError(RuntimeError):
    """A namespace, link or qdisc could not be made (the message says which command failed)."""


@dataclass
class Host:
    name: str      # e.g. "coord", "n1"
    address: str   # 10.77.0.X

    def namespace(self, prefix: str) -> str:
        return prefix + self.name


@dataclass
class Topology:
    """Hosts and the rate of every directed link between them (bits/s; 0 = unshaped)."""

    prefix: str
    hosts: list[Host]
    rates: dict[tuple[str, str], float] = field(default_factory=dict)  # (src, dst) -> bits/s
    exposed: str = ""                                                   # the host reachable from the root namespace
    host_link_addresses: tuple[str, str] = ("", "")                     # (root side, exposed side), set by create()

    @classmethod
    def star(cls, prefix: str, names: list[str], rate_bps: float, slow: dict[frozenset, float] | None = None,
             unshaped: tuple[str, ...] = ("coord",), exposed: str = "coord") -> "Topology":
        """Every host on one bridge; every link between two hosts not in `unshaped` at `rate_bps`
        (in each direction), except the pairs of `slow`."""
        if len(names) > 240:
            raise NetnsError(f"{len(names)} hosts do not fit in {SUBNET}.0/24")
        hosts = [Host(name, f"{SUBNET}.{10 + k}") for k, name in enumerate(names)]
        rates = {}
        for a in names:
            for b in names:
                if a != b and a not in unshaped and b not in unshaped:
                    rates[(a, b)] = (slow or {}).get(frozenset((a, b)), rate_bps)
        return cls(prefix, hosts, rates, exposed)

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    @property
    def hub(self) -> str:
        return self.prefix + "hub"

    @property
    def host_link(self) -> str:
        return (self.prefix + "host")[:15]


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(args, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise NetnsError(f"`{' '.join(args)}` failed: {r.stderr.strip() or r.stdout.strip()}")
    return r


def check_root() -> None:
    """Raise NetnsError saying what is missing for namespaces and tc."""
    import os

    if os.geteuid() != 0:
        raise NetnsError("network namespaces and tc need root (or use --shaper userspace)")
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            raise NetnsError(f"`{tool}` (iproute2) is not installed (or use --shaper userspace)")


def namespaces(prefix: str) -> list[str]:
    """The namespaces whose name starts with `prefix`."""
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def pids_in(namespace: str) -> list[int]:
    out = _run("ip", "netns", "pids", namespace, check=False).stdout
    return [int(p) for p in out.split()]


def _burst(rate_bps: float) -> str:
    """tbf bucket: 1 ms of the rate, at least 68 KB. A bucket smaller than the largest GSO packet
    (64 KB) makes tbf cut every packet in software, on the same CPU the stages compute on."""
    return f"{max(68000, int(rate_bps / 8 / 1000))}b"


def _classes(topo: Topology, src: str) -> dict[str, tuple[str, float]]:
    """The HTB class of each shaped destination of `src`: dst -> (classid, bits/s)."""
    shaped = [(dst, rate) for (a, dst), rate in sorted(topo.rates.items()) if a == src and rate > 0]
    return {dst: (f"1:{minor:x}", rate) for minor, (dst, rate) in enumerate(shaped, start=2)}


def _shape(topo: Topology, src: Host) -> None:
    """src's eth0: an HTB root that only classifies by destination; under each shaped destination's
    class a tbf at the link's rate, and under the tbf a two-class HTB that sends small packets (TCP's
    pure acknowledgements) before bulk data. Without it, the acknowledgements of one direction
    queue behind the other direction's data on the same link, and any TCP flow starves (the
    kernel here has none of prio, fq_codel or cake). The bulk queue holds QUEUE_S of the rate."""
    ns = src.namespace(topo.prefix)
    classes = _classes(topo, src.name)
    if not classes:
        return
    tc = ("tc", "-n", ns)
    _run(*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1")
    _run(*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb", "rate", "10gbit",
         "quantum", "60000")
    for k, (dst, (classid, rate)) in enumerate(classes.items()):
        tbf, inner = f"{0x100 + k:x}:", f"{0x200 + k:x}:"
        _run(*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", classid, "htb", "rate", "10gbit",
             "quantum", "60000")
        _run(*tc, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
             "match", "ip", "dst", f"{topo.host(dst).address}/32", "flowid", classid)
        _run(*tc, "qdisc", "add", "dev", "eth0", "parent", classid, "handle", tbf, "tbf", "rate", f"{int(rate)}bit",
             "burst", _burst(rate), "latency", f"{QUEUE_S * 1000:g}ms")
        _run(*tc, "qdisc", "add", "dev", "eth0", "parent", f"{tbf}1", "handle", inner, "htb", "default", "2")
        for minor, prio in ((1, 0), (2, 1)):
            _run(*tc, "class", "add", "dev", "eth0", "parent", inner, "classid", f"{inner}{minor}", "htb", "rate",
                 "10gbit", "prio", str(prio), "quantum", "60000")
        _run(*tc, "qdisc", "add", "dev", "eth0", "parent", f"{inner}2", "bfifo", "limit",
             str(max(65536, int(rate * QUEUE_S / 8))))
        _run(*tc, "filter", "add", "dev", "eth0", "parent", inner, "protocol", "ip", "prio", "1", "u32",
             "match", "u16", "0x0000", "0xff80", "at", "2", "flowid", f"{inner}1")  # IP total length < 128


def class_counters(topo: Topology, src: str) -> dict[str, tuple[int, int]]:
    """Bytes and packets sent so far from host `src` to each shaped destination (tc's class counters:
    whole IP packets, headers included): dst -> (bytes, packets)."""
    ns = topo.host(src).namespace(topo.prefix)
    dst_of = {classid: dst for dst, (classid, _) in _classes(topo, src).items()}
    out, current = {}, None
    # "class htb 1:2 root prio 0 rate ..." then " Sent 123 bytes 4 pkt ..." (this tc has no JSON for classes)
    for line in _run("tc", "-n", ns, "-s", "class", "show", "dev", "eth0", check=False).stdout.splitlines():
        words = line.split()
        if words[:2] == ["class", "htb"]:
            current = dst_of.get(words[2])
        elif words[:1] == ["Sent"] and current:
            out[current] = (int(words[1]), int(words[3]))
            current = None
    return out


def class_bytes(topo: Topology, src: str) -> dict[str, int]:
    """Bytes sent so far from host `src` to each shaped destination (headers included)."""
    return {dst: sent for dst, (sent, _) in class_counters(topo, src).items()}


def create(topo: Topology) -> None:
    """Make the namespaces, the bridge, the links, the shaping and the root namespace's veth; on
    any failure remove what was made and raise NetnsError."""
    check_root()
    remove(topo.prefix)
    try:
        _run("ip", "netns", "add", topo.hub)
        _run("ip", "-n", topo.hub, "link", "set", "lo", "up")
        _run("ip", "-n", topo.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", topo.hub, "link", "set", "br0", "up")
        for host in topo.hosts:
            ns = host.namespace(topo.prefix)
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", topo.hub, "link", "add", host.name[:15], "type", "veth", "peer", "name", "eth0",
                 "netns", ns)
            _run("ip", "-n", topo.hub, "link", "set", host.name[:15], "mtu", str(MTU), "master", "br0", "up")
            _run("ip", "-n", ns, "link", "set", "eth0", "mtu", str(MTU))
            _run("ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _shape(topo, host)
        if topo.exposed:
            ns = topo.host(topo.exposed).namespace(topo.prefix)
            root_side, exposed_side = topo.host_link_addresses = free_host_link()
            _run("ip", "link", "add", topo.host_link, "type", "veth", "peer", "name", "host0", "netns", ns)
            _run("ip", "addr", "add", f"{root_side}/30", "dev", topo.host_link)
            _run("ip", "link", "set", topo.host_link, "up")
            _run("ip", "-n", ns, "addr", "add", f"{exposed_side}/30", "dev", "host0")
            _run("ip", "-n", ns, "link", "set", "host0", "up")
    except BaseException:
        remove(topo.prefix)
        raise


def free_host_link() -> tuple[str, str]:
    """The two addresses of the first /30 in 10.78.0.0/16 that no interface of the root namespace
    holds: swarms of other prefixes (another test, a bench left running) keep theirs."""
    held = set(_run("ip", "-4", "-o", "addr", "show", check=False).stdout.split())
    for block in range(0, 1 << 16, 4):
        pair = tuple(f"{HOST_LINKS}.{(block + k) >> 8}.{(block + k) & 255}" for k in (1, 2))
        if not any(line.startswith(f"{address}/") for line in held for address in pair):
            return pair
    raise NetnsError(f"every /30 of {HOST_LINKS}.0.0/16 is in use by the root namespace")


def remove(prefix: str) -> list[str]:
    """Delete every namespace named `prefix*` (their veths and qdiscs go with them) and the root
    namespace's veth; returns the namespaces removed. Processes inside must be stopped first."""
    gone = []
    for ns in namespaces(prefix):
        _run("ip", "netns", "del", ns, check=False)
        gone.append(ns)
    host_link = (prefix + "host")[:15]
    if _run("ip", "link", "show", host_link, check=False).returncode == 0:
        _run("ip", "link", "del", host_link, check=False)
    return gone
