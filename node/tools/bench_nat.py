"""`tahnode bench nat`: what reaching a volunteer behind NAT costs. Two home nodes behind their own
MASQUERADE routers and one public node (tahnode.tools.natns) join a p2p swarm with --stage auto; the
coordinator probes every ordered pair before placing them, and the probed Mbit/s and RTT of each
link, home to home through the relay and home to public directly, go into docs/benchmarks-log.md."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from .bench_report import markdown_table, write_section
from .interrupt import interruptible
from .natns import NatSwarm, NatTopology, create_nat
from .netns import NetnsError, remove

__all__ = ["NatLink", "main"]

COLUMNS = ("home WAN Mbit/s", "from", "to", "path", "probed Mbit/s", "RTT ms")
PREFIX = "tbn"


@dataclass
class NatLink:
    wan_mbps: float   # 0: unshaped
    src: str
    dst: str
    path: str
    mbps: float
    rtt_ms: float

    def cells(self) -> list[str]:
        return [f"{self.wan_mbps:g}" if self.wan_mbps else "unshaped", self.src, self.dst, self.path,
                f"{self.mbps:.1f}", f"{self.rtt_ms:.2f}"]


def path_of(src: str, dst: str) -> str:
    """How a link's bytes travel: between homes only through the relay (tahnode's, on the
    coordinator); a home dials a public node directly; a public node reaches a home over a
    connection the home opened to it if there is one, else through the relay."""
    if src.startswith("home") and dst.startswith("home"):
        return "relayed (through the coordinator)"
    return "direct (home dials out)" if src.startswith("home") else "the home's connection, else relayed"


def measure(wan_mbps: float, workdir: Path, timeout: float) -> list[NatLink]:
    topo = NatTopology(PREFIX, homes=2, wan_bps=wan_mbps * 1e6)
    create_nat(topo)
    swarm = NatSwarm(topo, workdir, "bench-nat-token", ["--steps", "1", "--seq-len", "32", "--batch-size", "2"],
                     auto=True)
    try:
        swarm.up()
        state = swarm.wait(lambda s: len([link for link in s["links"] if link["probed_mbps"]]) >= 6, timeout,
                           "every link probed")
    finally:
        swarm.down()
        remove(PREFIX)
    return [NatLink(wan_mbps, link["src"], link["dst"], path_of(link["src"], link["dst"]), link["probed_mbps"],
                    link["rtt_ms"])
            for link in sorted(state["links"], key=lambda link: (link["src"], link["dst"])) if link["probed_mbps"]]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tahnode bench nat", description=__doc__.split("\n\n")[0])
    ap.add_argument("--wan", default="50,0", help="each home's uplink and downlink in Mbit/s, comma-separated; 0 = "
                    "unshaped (default 50,0)")
    ap.add_argument("--timeout", type=float, default=300,
                    help="seconds to wait for every probe of one row (default 300)")
    ap.add_argument("--workdir", default="bench-nat", help="logs of every process (default bench-nat)")
    ap.add_argument("--name", default="nat", help="the doc section's name (default nat)")
    ap.add_argument("--doc", default="docs/benchmarks-log.md",
                    help="where the table goes (default docs/benchmarks-log.md)")
    ap.add_argument("--json", action="store_true", help="print the links as one JSON list on the last line")
    return ap


@interruptible("tahnode bench nat")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows: list[NatLink] = []
    try:
        for wan in (float(x) for x in args.wan.split(",") if x.strip()):
            print(f"home WAN {wan:g} Mbit/s: starting the swarm and waiting for its probes", flush=True)
            rows += measure(wan, Path(args.workdir) / f"wan-{wan:g}", args.timeout)
    except (NetnsError, ValueError) as exc:
        print(f"tahnode bench nat: {exc}", file=sys.stderr)
        return 2
    text = markdown_table(COLUMNS, [r.cells() for r in rows])
    command = ("tahnode bench nat " + " ".join(sys.argv[3:] if argv is None else argv)).strip()
    write_section(Path(args.doc), args.name, "Volunteers behind NAT: relayed and direct p2p links", [
        text, "", "Two home nodes, each behind its own MASQUERADE router with no inbound port (network namespaces, "
        "nftables), and a public node; the coordinator (public, announcing its address, so it relays) probes every "
        "ordered pair over the nodes' p2p data plane (a probe sized to last about a second, RTT = median of five "
        "pings, both through every hop's Python process). Each home's WAN is shaped with tbf in both directions. A "
        "relayed byte crosses the coordinator's p2p daemon and Python process twice (tahnode.net.p2p.relay).", "",
        f"Command: `{command}`"], [])
    print(text)
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
    return 0
