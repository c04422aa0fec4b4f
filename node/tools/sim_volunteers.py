"""Simulated volunteers for `tahnode bench coordinator`: many nodes in one process that join a real
coordinator (--stage auto), heartbeat, and answer its link-measure requests over emulated links.

Each volunteer has its own identity key and sealer, as a real daemon does; all of them share one
gRPC channel to the coordinator and one data-plane server (one address for all: the volunteer a
request is meant for is its seal's recipient). Links are emulated: a volunteer's up and down
capacity are drawn log-uniform from the seed, the rate of a pair a -> b is min(up a, down b) times
a seeded factor in [0.85, 1], and a measure request sleeps as long as the real probe would take."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from ..config import AUTO_STAGE
from ..net.auth import Sealer, SwarmKey
from ..net.errors import CoordinatorError, UnknownNode, from_rpc_error
from ..net.freshness import COORDINATOR
from ..net.grpc_transport import DIRECT
from ..net.identity import NodeKey
from ..proto import tahnode_pb2 as pb
from ..proto import tahnode_pb2_grpc as pb_grpc

__all__ = ["Volunteer", "Links", "ProbeStats", "ProbeLedger", "HeartbeatLog", "JoinStats", "SimVolunteers",
           "sized_probe"]

ROUGH_BYTES = 512 << 10                    # tahnode.net.probe.measure_link: the rough probe ...
MIN_PROBE, MAX_PROBE = 1 << 20, 64 << 20   # ... then one sized to last about a second, clamped
PINGS = 5                                  # each probe pings five times before it streams
DEFAULT_HEARTBEAT_S = 1.0                  # a reply's heartbeat_s of 0 means the daemon's default
UP_DOWN_MBPS = (10.0, 1000.0)
LAYER_MS = (2.0, 20.0)
RTT_MS = (5.0, 80.0)
JOIN_TIMEOUT_S, HEARTBEAT_TIMEOUT_S = 30.0, 10.0


def log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def sized_probe(rough_mbps: float) -> int:
    """Bytes of the real probe after a rough one measured `rough_mbps` (as measure_link sizes it)."""
    return int(min(MAX_PROBE, max(MIN_PROBE, rough_mbps * 1e6 / 8)))


@dataclass
class Volunteer:
    """One simulated node: its identity (in its sealer), emulated link capacities and compute speed."""

    node_id: str
    sealer: Sealer
    up_mbps: float
    down_mbps: float
    layer_ms: float
    joined: bool = False
    period_s: float = DEFAULT_HEARTBEAT_S


class Links:
    """The emulated network: per directed pair the true rate (Mbit/s), per pair the RTT (ms); both
    depend only on the seed and the two node ids."""

    def __init__(self, volunteers: dict[str, Volunteer], seed: int):
        self.volunteers, self.seed = volunteers, seed

    def knows(self, node_id: str) -> bool:
        return node_id in self.volunteers

    def rate_mbps(self, src: str, dst: str) -> float:
        factor = random.Random(f"{self.seed}:rate:{src}>{dst}").uniform(0.85, 1.0)
        return min(self.volunteers[src].up_mbps, self.volunteers[dst].down_mbps) * factor

    def rtt_ms(self, a: str, b: str) -> float:
        lo, hi = sorted((a, b))
        return random.Random(f"{self.seed}:rtt:{lo}-{hi}").uniform(*RTT_MS)


@dataclass
class ProbeStats:
    probes: int = 0          # measure requests answered
    bytes: int = 0           # emulated probe payload, every phase of every probe
    per_node_max: int = 0    # the most probes one volunteer was part of at once (sender or target)
    at_once_max: int = 0     # the most probes in flight at once, swarm-wide
    refused: int = 0         # requests naming a node that is not simulated here


class ProbeLedger:
    """Counts probes and their bytes, and how many run at once, per node and in all."""

    def __init__(self):
        self.stats = ProbeStats()
        self.active: Counter[str] = Counter()
        self.in_flight = 0

    @contextlib.contextmanager
    def probing(self, src: str, dst: str):
        self.active[src] += 1
        self.active[dst] += 1
        self.in_flight += 1
        s = self.stats
        s.per_node_max = max(s.per_node_max, self.active[src], self.active[dst])
        s.at_once_max = max(s.at_once_max, self.in_flight)
        try:
            yield
        finally:
            self.active[src] -= 1
            self.active[dst] -= 1
            self.in_flight -= 1
        s.probes += 1


class SimDataPlane(pb_grpc.StageServiceServicer):
    """StageService.Measure and Ping for every volunteer: a measure request sleeps as long as the
    real node's probe of the emulated link would last and answers that link's rate (seals unchecked)."""

    def __init__(self, links: Links, ledger: ProbeLedger, seed: int):
        self.links, self.ledger, self.rng = links, ledger, random.Random(f"{seed}:noise")

    async def Ping(self, request, context):
        return pb.PingReply(nonce=request.nonce, node_id=request.seal.recipient)

    async def Measure(self, request, context):
        src, dst = request.seal.recipient, request.target_id
        if request.compute and self.links.knows(src):  # its compute again: as it reports it
            return pb.MeasureReply(layer_ms=self.links.volunteers[src].layer_ms)
        if not (self.links.knows(src) and self.links.knows(dst)):
            self.ledger.stats.refused += 1
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no simulated volunteer {src!r} or {dst!r}")
        with self.ledger.probing(src, dst):
            if request.payload_bytes:
                mbps = await self._probe(src, dst, request.payload_bytes)
            else:
                mbps = await self._probe(src, dst, sized_probe(await self._probe(src, dst, ROUGH_BYTES)))
        return pb.MeasureReply(mbps=mbps, rtt_ms=self.links.rtt_ms(src, dst))

    async def _probe(self, src: str, dst: str, nbytes: int) -> float:
        """One probe of `nbytes`: its pings and its transfer; the rate it measures (a little under the true one)."""
        rate = self.links.rate_mbps(src, dst)
        await asyncio.sleep(PINGS * self.links.rtt_ms(src, dst) / 1e3 + nbytes * 8 / (rate * 1e6))
        self.ledger.stats.bytes += nbytes
        return rate * self.rng.uniform(0.97, 1.0)


class HeartbeatLog:
    """Heartbeat latencies (client side, ms) while `recording`; errors by type while `counting`."""

    def __init__(self):
        self.latencies_ms: list[float] = []
        self.errors: Counter[str] = Counter()
        self.rejoins = 0
        self.recording, self.counting = False, True

    def answered(self, latency_s: float) -> None:
        if self.recording:
            self.latencies_ms.append(latency_s * 1e3)

    def failed(self, exc: CoordinatorError) -> None:
        if self.counting:
            self.errors[type(exc).__name__] += 1


@dataclass
class JoinStats:
    joined: int
    seconds: float                           # from the first join sent to the last one answered
    last_join: float                         # time.monotonic() of the last join answered
    errors: dict[str, int] = field(default_factory=dict)


class SimVolunteers:
    """N simulated volunteers against the coordinator at `coordinator` (HOST:PORT, plain gRPC):
    `start()` their data plane, `join_all()`, `start_heartbeats()`, `stop()`."""

    def __init__(self, coordinator: str, token: str, n: int, seed: int = 0):
        rng, key = random.Random(seed), SwarmKey(token)
        self.volunteers: dict[str, Volunteer] = {}
        for k in range(n):
            node_id = f"sim-{k:05d}"
            self.volunteers[node_id] = Volunteer(node_id, Sealer(key, node_id, identity=NodeKey.generate()),
                                                 log_uniform(rng, *UP_DOWN_MBPS), log_uniform(rng, *UP_DOWN_MBPS),
                                                 log_uniform(rng, *LAYER_MS))
        self.coordinator, self.rng = coordinator, rng
        self.links = Links(self.volunteers, seed)
        self.probes = ProbeLedger()
        self.beats = HeartbeatLog()
        self.address = ""
        self.server: grpc.aio.Server | None = None
        self.channel: grpc.aio.Channel | None = None
        self.stub: pb_grpc.CoordinatorStub | None = None
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """The shared data-plane server (on a free loopback port) and the channel to the coordinator."""
        self.server = grpc.aio.server()
        plane = SimDataPlane(self.links, self.probes, self.rng.randrange(1 << 30))
        pb_grpc.add_StageServiceServicer_to_server(plane, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.channel = grpc.aio.insecure_channel(self.coordinator, options=DIRECT)
        self.stub = pb_grpc.CoordinatorStub(self.channel)

    async def join(self, v: Volunteer) -> CoordinatorError | None:
        """Join (or rejoin) as --stage auto; the error if the coordinator refused or did not answer."""
        req = pb.JoinRequest(node_id=v.node_id, address=self.address, stage=AUTO_STAGE, device="sim", movable=True)
        try:
            reply = await self.stub.Join(v.sealer.seal(req, COORDINATOR), timeout=JOIN_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return from_rpc_error(exc, self.coordinator, "join")
        v.sealer.run, v.joined = reply.run, True
        return None

    async def join_all(self, at_once: int = 50) -> JoinStats:
        """Every volunteer joins, `at_once` joins in flight at a time."""
        gate, errors = asyncio.Semaphore(at_once), Counter()
        start = last = time.monotonic()

        async def one(v: Volunteer) -> None:
            nonlocal last
            async with gate:
                error = await self.join(v)
            if error is None:
                last = max(last, time.monotonic())
            else:
                errors[type(error).__name__] += 1

        await asyncio.gather(*(one(v) for v in self.volunteers.values()))
        joined = sum(v.joined for v in self.volunteers.values())
        return JoinStats(joined, last - start, last, dict(errors))

    def start_heartbeats(self) -> None:
        self.tasks = [asyncio.create_task(self._beat(v)) for v in self.volunteers.values()]

    async def _beat(self, v: Volunteer) -> None:
        """Heartbeat every v.period_s (from the last reply), from a random phase; rejoin when the
        coordinator no longer knows this volunteer (or it never joined)."""
        due = time.monotonic() + self.rng.random() * v.period_s
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            due = max(due + v.period_s, time.monotonic())
            if not v.joined:
                error = await self.join(v)
                if error is not None:
                    self.beats.failed(error)
                continue
            await self._heartbeat(v)

    async def _heartbeat(self, v: Volunteer) -> None:
        req = pb.HeartbeatRequest(node_id=v.node_id, layer_ms=v.layer_ms)
        start = time.perf_counter()
        try:
            reply = await self.stub.Heartbeat(v.sealer.seal(req, COORDINATOR), timeout=HEARTBEAT_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            error = from_rpc_error(exc, self.coordinator, "heartbeat")
            self.beats.failed(error)
            if isinstance(error, UnknownNode):
                v.joined = False
                self.beats.rejoins += 1
            return
        self.beats.answered(time.perf_counter() - start)
        v.period_s = reply.heartbeat_s if reply.heartbeat_s > 0 else DEFAULT_HEARTBEAT_S

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []
        if self.channel is not None:
            await self.channel.close()
        if self.server is not None:
            await self.server.stop(grace=0.5)
