"""`tahnode bench abuse`: does one token holder's abuse grow the coordinator or a stage daemon, or slow
the status page? A fresh `tahnode coordinator` (a subprocess on loopback), a real stage daemon on
stage 1 (`tahnode join`), the attacking neighbour on stage 0 and a client on stage 2. First the
neighbour sends the daemon envelopes that never complete (--padded-frames streams of frames padded
to 4 MiB, --endless-frames of frames naming 10^9 frames; tahnode.tools.abuse_frames). Then one
client with the token (a process of its own) sends, as a member, --heartbeats oversized heartbeats
(--links made-up links each) and --fat-heartbeats with --stats made-up entries in each of their
stats' maps; --joins joins under fresh ids and keys, and --senders heartbeats sealed under made-up
sender names (the replay guard's growth). The coordinator's and the daemon's memory (RSS) and GET
/api/v1/state latency are measured before, during each attack and after; a row per phase goes to
docs/benchmarks-log.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..net.grpc_transport import STREAMS_PER_PEER
from .abuse_frames import PAD_TO, StageDaemon, send_frames
from .bench_coordinator import BenchError, CoordinatorProcess, Spread
from .bench_probes import POLL_S, fetch, memory_mb, process_tree
from .bench_report import markdown_table, write_section
from .interrupt import interruptible
from .workers import worker_pool

__all__ = ["main", "PhaseRow"]

COLUMNS = ("phase", "seconds", "coordinator RSS MB (peak)", "vs before", "stage daemon RSS MB (peak)", "vs before",
           "state ms p50 / p99", "p50 vs before", "state KB", "nodes in state", "heartbeats sent / refused",
           "joins sent / refused", "made-up senders sent / refused", "attack streams sent / refused")


@dataclass
class PhaseRow:
    phase: str
    seconds: float
    rss_mb: float
    daemon_rss_mb: float
    state: Spread
    state_kb: float
    nodes: int
    heartbeats: tuple[int, int] = (0, 0)
    joins: tuple[int, int] = (0, 0)
    senders: tuple[int, int] = (0, 0)
    streams: tuple[int, int] = (0, 0)
    refused_as: str = ""  # the attack streams' gRPC statuses but OK


async def _join(stub, key, name: str, stage: int, identity=None):
    """A join under `name` (a fresh key unless given); its sealer with the run id, or None if refused."""
    from ..net.auth import Sealer
    from ..net.freshness import COORDINATOR
    from ..net.identity import NodeKey
    from ..proto import tahnode_pb2 as pb

    sealer = Sealer(key, name, identity=identity or NodeKey.generate())
    try:
        reply = await stub.Join(sealer.seal(pb.JoinRequest(node_id=name, address=f"127.0.0.1:{10000 + len(name)}",
                                                           stage=stage),
                                            COORDINATOR))
    except Exception:  # grpc.aio.AioRpcError: refused
        return None
    sealer.guard.run = reply.run
    return sealer


def _stats(entries: int):
    """Heartbeat stats whose free maps hold `entries` made-up keys each (issue 39, finding 4)."""
    from ..proto import tahnode_pb2 as pb

    stats = pb.TrainingStats()
    for k in range(entries):
        name = f"made-up-{k:07d}"
        stats.refused[name], stats.offences[name], stats.outer[name] = k, 1, 1.0
        stats.outer_reports.add(peer=name, suspect=1, excluded=True, evidence="x" * 64)
    return stats


async def _abuse(address: str, token: str, heartbeats: int, links: int, joins: int, fat: tuple[int, int] = (0, 0),
                 senders: int = 0, in_flight: int = 8) -> dict:
    import grpc

    from ..net.auth import Sealer, SwarmKey
    from ..net.freshness import COORDINATOR
    from ..proto import tahnode_pb2 as pb
    from ..proto import tahnode_pb2_grpc as pb_grpc

    key = SwarmKey(token)
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        member = await _join(stub, key, "evil", -1)
        fake = [pb.LinkStats(dst=f"ghost-{k}", bytes=k, seconds=1.0) for k in range(links)]
        padded = _stats(fat[1])
        refused, gate = {"heartbeats": 0, "joins": 0, "senders": 0}, asyncio.Semaphore(in_flight)

        async def beat(**fields):
            async with gate:
                try:
                    await stub.Heartbeat(member.seal(pb.HeartbeatRequest(node_id="evil", **fields), COORDINATOR))
                except grpc.aio.AioRpcError:
                    refused["heartbeats"] += 1

        async def stranger(k: int):
            async with gate:
                sealer = Sealer(key, f"stranger-{k:07d}", run=member.guard.run)
                try:
                    await stub.Heartbeat(sealer.seal(pb.HeartbeatRequest(node_id=sealer.me), COORDINATOR))
                except grpc.aio.AioRpcError:
                    refused["senders"] += 1

        async def sybil(k: int):
            async with gate:
                refused["joins"] += await _join(stub, key, f"sybil-{k}", -1) is None

        await asyncio.gather(*(beat(links=fake) for _ in range(heartbeats)),
                             *(beat(stats=padded) for _ in range(fat[0])),
                             *(sybil(k) for k in range(joins)), *(stranger(k) for k in range(senders)))
    return refused


def abuse(address: str, token: str, heartbeats: int, links: int, joins: int, fat: tuple[int, int] = (0, 0),
          senders: int = 0) -> dict:
    """The abuser, in a process of its own: what the coordinator refused of what it sent."""
    return asyncio.run(_abuse(address, token, heartbeats, links, joins, fat, senders))


def observe(coord: CoordinatorProcess, daemon: StageDaemon, phase: str, done) -> PhaseRow:
    """GET /api/v1/state and sample the coordinator's and the daemon's RSS every POLL_S until `done()`."""
    started, latencies, sizes, peak, daemon_peak, nodes = time.monotonic(), [], [], 0.0, 0.0, 0
    while True:
        coord.alive()
        daemon.alive()
        peak = max(peak, memory_mb(process_tree(coord.proc.pid), "VmRSS"))
        daemon_peak = max(daemon_peak, memory_mb(process_tree(daemon.proc.pid), "VmRSS"))
        got = fetch(f"{coord.http}/api/v1/state")
        if got is not None:
            latencies.append(got[0] * 1e3)
            sizes.append(len(got[1]) / 1024)
            nodes = len(json.loads(got[1]).get("nodes", []))
        if done():
            return PhaseRow(phase, time.monotonic() - started, peak, daemon_peak, Spread.of(latencies),
                            max(sizes, default=0.0), nodes)
        time.sleep(POLL_S)


def run(args, workdir: Path) -> list[PhaseRow]:
    coord = CoordinatorProcess(workdir, stages=3)
    daemon = StageDaemon(workdir, coord.address, workdir / "token", stage=1)
    coord.start()
    try:
        coord.wait_ready()
        daemon.start()
        target = daemon.wait_held(f"{coord.http}/api/v1/state")
        import grpc

        from ..net.auth import SwarmKey
        from ..proto import tahnode_pb2_grpc as pb_grpc

        async def holder():  # stage 2; the attacking neighbour takes stage 0
            async with grpc.aio.insecure_channel(coord.address) as channel:
                await _join(pb_grpc.CoordinatorStub(channel), SwarmKey(coord.token), "holder-2", 2)

        asyncio.run(holder())

        def after(seconds: float):
            end = time.monotonic() + seconds
            return lambda: time.monotonic() >= end

        rows = [observe(coord, daemon, "before", after(args.settle))]
        with worker_pool(1) as pool:
            for kind, streams in (("padded", args.padded_frames), ("endless", args.endless_frames)):
                attack = pool.submit(send_frames, coord.address, coord.token, workdir / "neighbour.key", target,
                                     daemon.node_id, {kind: streams})
                row = observe(coord, daemon, f"{kind} frames", attack.done)
                outcomes = attack.result()[kind]
                row.streams = (streams, streams - outcomes.get("OK", 0))
                row.refused_as = ", ".join(f"{code} {n}" for code, n in sorted(outcomes.items()) if code != "OK")
                rows.append(row)
            attack = pool.submit(abuse, coord.address, coord.token, args.heartbeats, args.links, args.joins,
                                 (args.fat_heartbeats, args.stats), args.senders)
            during = observe(coord, daemon, "coordinator abuse", attack.done)
            refused = attack.result()
        during.heartbeats = (args.heartbeats + args.fat_heartbeats, refused["heartbeats"])
        during.joins = (args.joins, refused["joins"])
        during.senders = (args.senders, refused["senders"])
        rows += [during, observe(coord, daemon, "after", after(args.settle))]
        return rows
    finally:
        daemon.stop()
        coord.stop()


def cells(r: PhaseRow, before: PhaseRow) -> list[str]:
    def rel(a, b):
        return f"{100 * (a / b - 1):+.0f}%" if a and b else "—"

    return [r.phase, f"{r.seconds:.0f}", f"{r.rss_mb:.0f}", rel(r.rss_mb, before.rss_mb), f"{r.daemon_rss_mb:.0f}",
            rel(r.daemon_rss_mb, before.daemon_rss_mb), str(r.state), rel(r.state.p50_ms, before.state.p50_ms),
            f"{r.state_kb:.0f}",
            str(r.nodes), f"{r.heartbeats[0]} / {r.heartbeats[1]}", f"{r.joins[0]} / {r.joins[1]}",
            f"{r.senders[0]} / {r.senders[1]}",
            f"{r.streams[0]} / {r.streams[1]}" + (f" ({r.refused_as})" if r.refused_as else "")]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tahnode bench abuse", description=__doc__)
    ap.add_argument("--heartbeats", type=int, default=10_000,
                    help="oversized heartbeats the abuser sends (default 10000)")
    ap.add_argument("--links", type=int, default=5_000, help="made-up links in each (default 5000: about 120 KB)")
    ap.add_argument("--fat-heartbeats", type=int, default=200,
                    help="heartbeats whose stats maps are full of made-up entries (default 200)")
    ap.add_argument("--stats", type=int, default=20_000,
                    help="made-up entries in each stats map of those (refused, offences, outer, outer_reports; "
                         "default 20000: about 1.9 MB a heartbeat)")
    ap.add_argument("--joins", type=int, default=2_000, help="joins under fresh ids and keys (default 2000)")
    ap.add_argument("--senders", type=int, default=50_000,
                    help="heartbeats sealed under made-up sender names, each refused as no member (default 50000)")
    ap.add_argument("--padded-frames", type=int, default=300,
                    help="streams to the stage daemon, each frame 0 of an envelope, then a frame of 1 byte of data "
                         f"padded to {PAD_TO >> 10} KiB (default 300: 1.2 GB)")
    ap.add_argument("--endless-frames", type=int, default=2_000,
                    help="streams to the stage daemon, each frame 0 of a 2-frame envelope, then a frame naming 10^9 "
                         "frames (default 2000)")
    ap.add_argument("--settle", type=float, default=10.0,
                    help="seconds measured before and after the abuse (default 10)")
    ap.add_argument("--doc", default="docs/benchmarks-log.md",
                    help="where the rows go (default docs/benchmarks-log.md)")
    ap.add_argument("--name", default="abuse", help="the doc section's name (default abuse)")
    ap.add_argument("--no-doc", action="store_true", help="print the rows only; leave the doc alone")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--averaging", action="store_true",
                    help="instead: a two-pipeline swarm in which one replica of stage 1 lies at every outer step "
                         "(tahnode.tools.abuse_averaging; its flags: tahnode bench abuse --averaging --help)")
    return ap


@interruptible("tahnode bench abuse")
def main(argv: list[str] | None = None) -> int:
    if "--averaging" in (sys.argv[1:] if argv is None else argv):
        from . import abuse_averaging

        return abuse_averaging.main([a for a in (sys.argv[3:] if argv is None else argv) if a != "--averaging"])
    args = build_parser().parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="tahnode-abuse-") as tmp:
            rows = run(args, Path(tmp))
    except BenchError as exc:
        print(f"tahnode bench abuse: {exc}", file=sys.stderr)
        return 1
    text = markdown_table(COLUMNS, [cells(r, rows[0]) for r in rows])
    command = ("tahnode bench abuse " + " ".join(sys.argv[3:] if argv is None else argv)).strip()
    if not args.no_doc:
        write_section(Path(args.doc), args.name, "A token holder's abuse: the coordinator and a stage daemon", [
            text, "", "A real coordinator (`tahnode coordinator`, plain gRPC on loopback) and a real stage daemon "
            "(`tahnode join --stage 1`, its data plane plain gRPC); stage 0 is held by the attacking neighbour, stage "
            "2 by a client. First the neighbour (a process of its own, with the token and its bound key) opens "
            f"{args.padded_frames} Forward streams to the daemon, each frame 0 of a 2-frame envelope then a frame of 1 "
            f"byte of data padded to {PAD_TO} bytes with a field Frame does not have, and {args.endless_frames} "
            f"streams whose second frame names 10^9 frames (issue 39, finding 2; {STREAMS_PER_PEER} streams at once, "
            "what a receiver lets one sender hold open). Then one client with the token sends as a member "
            f"{args.heartbeats} heartbeats of {args.links} made-up links each and {args.fat_heartbeats} of "
            f"{args.stats} made-up entries in each stats map, {args.joins} joins under fresh ids and keys, and "
            f"{args.senders} heartbeats sealed under made-up sender names, 8 requests in flight. RSS: each process's "
            f"peak in the phase; state: GET /api/v1/state every {POLL_S} s.", "", "", f"Command: `{command}`"], [])
    print(json.dumps([asdict(r) for r in rows]) if args.json else text)
    return 0
