"""The `tahnode swarm up | down | status` command: its flags, and what it prints (the swarm itself
is tahnode.tools.swarm's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..config import TransportKind
from . import netns
from .swarm import LocalSwarm, Shaper, SwarmError, SwarmSpec, default_workdir, fetch
from .swarm import __doc__ as swarm_doc

__all__ = ["add_parser", "main"]


def add_parser(sub) -> None:
    """`tahnode swarm up | down | status`."""
    from ..config.flags import add_run_flags

    sw = sub.add_parser("swarm", help="a swarm on this machine with slow links (namespaces + tc, or user space)",
                        description=swarm_doc.split("\n\n")[0])
    ssub = sw.add_subparsers(dest="swarm_cmd", required=True)
    up = ssub.add_parser("up", help="start a coordinator and N nodes on shaped links (returns once they joined)",
                         description="Start a coordinator and N `--stage N` nodes (or `--stage auto` when there are "
                         "more nodes than stages) as background processes with shaped links. With --shaper tc (root): "
                         "one network namespace per process, every directed link between two nodes its own tc tbf, in "
                         "packets of up to 64 KB as a network card with offloads hands them over (MTU 65000); "
                         "with --shaper userspace: 127.0.0.1, each process paces its own links. This kernel has no "
                         "netem, so --rtt is always emulated in user space: every message and reply between two "
                         "processes, data and control, waits RTT/2 each way (TCP's own "
                         "acknowledgements are not delayed).")
    up.add_argument("--nodes", type=int, default=3, help="stage daemons to start (default 3)")
    up.add_argument("--bandwidth", default="", metavar="RATE",
                    help="rate of every link between two nodes, each direction (e.g. 50mbit; default unshaped)")
    up.add_argument("--rtt", default="", metavar="DURATION",
                    help="round-trip time between processes (e.g. 50ms), in user space (see above)")
    up.add_argument("--slow-link", action="append", default=[], metavar="A-B:RATE",
                    help="a slower link between nodes A and B, both directions (e.g. n2-n3:10mbit), repeatable")
    up.add_argument("--shaper", default=Shaper.TC.value, choices=[s.value for s in Shaper],
                    help="tc (root, namespaces; default) or userspace (no root)")
    up.add_argument("--prefix", default="tns-",
                    help="name prefix of the namespaces (a second swarm needs another; default tns-)")
    up.add_argument("--workdir", default="", help="state, logs, checkpoints (default: $TMPDIR/tahnode-swarm/PREFIX); "
                    "its checkpoints are wiped: every `up` trains from scratch")
    up.add_argument("--auto", action="store_true", help="every node joins with --stage auto: the coordinator probes "
                    "the links and places the nodes (the default when there are more nodes than stages; else "
                    "node nK holds stage K-1)")
    up.add_argument("--transport", default="grpc", choices=["grpc", "p2p"],
                    help="the nodes' data plane: gRPC or libp2p (needs pip install 'tahnode[p2p]'; default grpc)")
    up.add_argument("--heartbeat-timeout", type=float, default=10.0,
                    help="the coordinator's failure detection, seconds (default 10)")
    up.add_argument("--probe-wait", type=float, default=4.0, help="with --auto: the coordinator's longest wait for "
                    "probes before the first chain, seconds (default 4)")
    up.add_argument("--rebalance-every", type=float, default=30.0, help="with --auto: seconds between the "
                    "coordinator's rebalancing checks (0 = never; default 30)")
    up.add_argument("--wait", type=float, default=90.0, help="seconds to wait for every node to join (default 90)")
    up.set_defaults(run_actions=add_run_flags(up))
    for name, text in (("down", "stop every process and remove every namespace, link and qdisc of the "
                        "swarm (also after a crash)"),
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
        spec = SwarmSpec(nodes=args.nodes, stages=args.stages or 0,
                         bandwidth_bps=parse_rate(args.bandwidth) if args.bandwidth else 0.0,
                         rtt_s=parse_duration(args.rtt) if args.rtt else 0.0, slow_links=_slow_links(args.slow_link),
                         shaper=Shaper(args.shaper), prefix=args.prefix, workdir=workdir, auto=args.auto,
                         heartbeat_timeout=args.heartbeat_timeout, transport=TransportKind(args.transport),
                         placement_flags=["--probe-wait", f"{args.probe_wait:g}", "--rebalance-every",
                                          f"{args.rebalance_every:g}"],
                         run_flags=run_flag_args(args, args.run_actions, skip=("stages",)))
        if spec.shaper is Shaper.TC:
            netns.check_root()
        swarm = LocalSwarm.up(spec, wait_s=args.wait)
    except (SwarmError, netns.NetnsError, ValueError) as exc:
        print(f"tahnode swarm: {exc}", file=sys.stderr)
        return 2
    shaped = f"{spec.bandwidth_bps / 1e6:g} Mbit/s links" if spec.bandwidth_bps else "unshaped links"
    print(f"swarm {spec.prefix!r} is up: coordinator {swarm.coordinator}, {spec.nodes} nodes, {spec.stages} stages, "
          f"{shaped} ({spec.shaper} shaper), RTT {spec.rtt_s * 1e3:g} ms")
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
