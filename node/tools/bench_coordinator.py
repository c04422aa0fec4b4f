"""`tahnode bench coordinator`: does the coordinator scale to many volunteers? For each N in --nodes,
a fresh `tahnode coordinator` (a subprocess on loopback, plain gRPC, a token, a temporary --store)
faces N volunteers simulated in this process (tahnode.tools.sim_volunteers) that join with --stage
auto, heartbeat, and answer its link probes over emulated 10-1000 Mbit/s links. Measured: the time
to place them all (active or standby in /api/v1/state); then, over --window seconds, heartbeat
latency, the coordinator's CPU and memory, /api/v1/state and /metrics, the probe traffic; and how
long it takes to exit on SIGTERM. Rows go to docs/benchmarks-log.md ("Coordinator at scale")."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config.token import new_token_file
from ..net.loop import use_fast_event_loop
from .bench_probes import POLL_S, cpu_seconds, fetch, memory_mb, poll_endpoints, poller_pool, process_tree
from .bench_report import markdown_table, write_section
from .interrupt import interruptible
from .sim_volunteers import SimVolunteers
from .swarm import free_ports

__all__ = ["CoordinatorRow", "Spread", "CoordinatorProcess", "BenchError", "main"]

COLUMNS = ("nodes", "joins s", "placed", "placed s", "pipelines", "heartbeats", "heartbeat ms p50 / p99",
           "heartbeat errors",
           "coordinator CPU %", "RSS MB (peak)", "probes", "probe GB", "probes per node at once", "probes at once",
           "state ms p50 / p99", "state KB", "metrics ms p50 / p99", "metrics KB", "SIGTERM exit s", "sim CPU %")
PLACED = ("active", "standby")
READY_S, STOP_GRACE_S = 60.0, 30.0


class BenchError(RuntimeError):
    """The coordinator did not start, or died during the run (the message says why)."""


@dataclass
class Spread:
    """Median and 99th percentile (nearest rank) of some latencies; None: none measured."""

    p50_ms: float | None = None
    p99_ms: float | None = None

    @classmethod
    def of(cls, latencies_ms: list[float]) -> "Spread":
        s = sorted(latencies_ms)
        return cls(*(s[min(len(s), max(1, math.ceil(q * len(s)))) - 1] if s else None for q in (0.50, 0.99)))

    def __str__(self) -> str:
        return f"{fmt(self.p50_ms)} / {fmt(self.p99_ms)}"


@dataclass
class CoordinatorRow:
    """One N's results, filled in as the run goes; None where nothing could be measured."""

    nodes: int
    stages: int
    joined: int = 0
    join_s: float = 0.0
    placed: int = 0                 # volunteers active or standby when placement ended (or timed out)
    placed_s: float | None = None   # from the last join until all were placed; None: not within the timeout
    pipelines: int = 0              # complete pipelines when placement ended
    window_s: float = 0.0
    heartbeats: int = 0             # answered within the window
    heartbeat_ms: Spread = field(default_factory=Spread)
    heartbeat_errors: int = 0       # from the first join until SIGTERM, every kind
    rejoins: int = 0
    cpu_pct: float = 0.0            # coordinator (and its children), % of one core over the window
    rss_mb: float = 0.0
    peak_rss_mb: float = 0.0
    probes: int = 0
    probe_gb: float = 0.0
    probes_per_node_max: int = 0    # the most probes one volunteer was part of at once
    probes_at_once_max: int = 0
    state_ms: Spread = field(default_factory=Spread)    # GET /api/v1/state, every POLL_S in the window
    state_kb: float = 0.0                               # its largest answer
    metrics_ms: Spread = field(default_factory=Spread)  # GET /metrics, the same
    metrics_kb: float = 0.0
    sigterm_exit_s: float | None = None  # None: still running STOP_GRACE_S after SIGTERM (then killed)
    sim_cpu_pct: float = 0.0        # this process (the volunteers and the pollers), % of one core
    errors: dict[str, int] = field(default_factory=dict)


class CoordinatorProcess:
    """`tahnode coordinator` as users start it, on free loopback ports: plain gRPC, a token file,
    a temporary --store, its output in a log file. `stop()` sends SIGTERM and times the exit."""

    def __init__(self, workdir: Path, stages: int, flags: tuple[str, ...] = ()):
        """`flags`: more of its flags (the run's: --steps, --pipelines, ...)."""
        self.workdir, self.stages, self.flags = workdir, stages, tuple(flags)
        grpc_port, http_port = free_ports(2)
        self.address, self.http = f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"
        self.token = new_token_file(workdir / "token").read_text().strip()
        self.log = workdir / "coordinator.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        args = ["coordinator", "--listen", self.address, "--http", self.http.removeprefix("http://"), "--tls", "off",
                "--token-file", str(self.workdir / "token"), "--stages", str(self.stages), "--store",
                str(self.workdir / "store"), "--max-per-host", "0",  # every simulated volunteer is on 127.0.0.1
                *self.flags]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tahnode.cli", *args], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def alive(self) -> None:
        """Raise BenchError if the coordinator exited."""
        if self.proc.poll() is not None:
            raise BenchError(f"the coordinator exited with status {self.proc.returncode}:\n{self.log_tail()}")

    def wait_ready(self, timeout: float = READY_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.alive()
            if fetch(f"{self.http}/api/v1/state") is not None:
                return
            time.sleep(0.2)
        raise BenchError(f"the coordinator did not answer on {self.http} within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, grace: float = STOP_GRACE_S) -> float | None:
        """SIGTERM; seconds until it exited, or None if it had to be killed after `grace`."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        start = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
            return time.perf_counter() - start
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        return ("\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists()
                else "(no log)")


def say(text: str) -> None:
    print(f"tahnode bench coordinator: {text}", file=sys.stderr, flush=True)


def placed_count(url: str, ids: set[str]) -> tuple[int, int] | None:
    """How many of `ids` /api/v1/state shows active or standby, and how many pipelines are complete
    (None: no answer)."""
    got = fetch(url)
    try:
        state = None if got is None else json.loads(got[1])
        if state is None:
            return None
        placed = sum(n.get("id") in ids and n.get("status") in PLACED for n in state["nodes"])
        return placed, sum(1 for p in state.get("pipelines", []) if p.get("complete"))
    except (ValueError, KeyError):
        return None


async def wait_placed(coord: CoordinatorProcess, sims: SimVolunteers, timeout: float, row: CoordinatorRow) -> None:
    """Poll /api/v1/state until every volunteer is active or standby: how many are, in how many seconds
    (None if not all in time) and in how many pipelines, into `row`."""
    ids, n = set(sims.volunteers), len(sims.volunteers)
    start, placed, shown = time.monotonic(), 0, 0.0
    while (elapsed := time.monotonic() - start) < timeout:
        coord.alive()
        now = await asyncio.to_thread(placed_count, f"{coord.http}/api/v1/state", ids)
        if now is not None:
            row.placed = placed = now[0]
            row.pipelines = now[1]
        if placed == n:
            row.placed_s = time.monotonic() - start
            return
        if elapsed - shown >= 5:
            p = sims.probes
            say(f"N={n}: {placed}/{n} placed after {elapsed:.0f} s; {p.stats.probes} probes done, "
                f"{p.in_flight} in flight")
            shown = elapsed
        await asyncio.sleep(POLL_S)


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def cells(r: CoordinatorRow) -> list[str]:
    return [str(r.nodes), fmt(r.join_s, ".2f"), f"{r.placed}/{r.nodes}", fmt(r.placed_s), str(r.pipelines),
            str(r.heartbeats),
            str(r.heartbeat_ms), str(r.heartbeat_errors), f"{r.cpu_pct:.0f}", f"{r.rss_mb:.0f} ({r.peak_rss_mb:.0f})",
            str(r.probes), f"{r.probe_gb:.2f}", str(r.probes_per_node_max), str(r.probes_at_once_max), str(r.state_ms),
            f"{r.state_kb:,.0f}", str(r.metrics_ms), f"{r.metrics_kb:,.0f}", fmt(r.sigterm_exit_s, ".2f"),
            f"{r.sim_cpu_pct:.0f}"]


class Bench:
    """One N: a fresh coordinator, N simulated volunteers, the measurements, then everything stopped."""

    def __init__(self, n: int, args):
        self.n, self.args = n, args
        self.row = CoordinatorRow(n, args.stages)

    async def run(self) -> CoordinatorRow:
        row, n = self.row, self.n
        with tempfile.TemporaryDirectory(prefix="tahnode-bench-coordinator-") as tmp:
            coord = CoordinatorProcess(Path(tmp), self.args.stages)
            coord.start()
            sims = None
            try:
                await asyncio.to_thread(coord.wait_ready)
                say(f"N={n}: coordinator up (pid {coord.proc.pid}, {coord.address}, {coord.http})")
                sims = SimVolunteers(coord.address, coord.token, n, self.args.seed)
                await sims.start()
                joins = await sims.join_all()
                row.joined, row.join_s = joins.joined, joins.seconds
                row.errors = {f"join {kind}": count for kind, count in joins.errors.items()}
                say(f"N={n}: {joins.joined}/{n} joined in {joins.seconds:.1f} s; refused: {joins.errors or 'none'}")
                gc.freeze()  # the volunteers' keys and records live to the end: collections need not scan them
                sims.start_heartbeats()
                await wait_placed(coord, sims, self.args.place_timeout, row)
                say(f"N={n}: "
                    + (f"all placed {row.placed_s:.1f} s after the last join" if row.placed_s is not None else
                       f"only {row.placed}/{n} placed within {self.args.place_timeout:g} s"))
                await self.window(coord, sims)
                sims.beats.counting = False
                row.sigterm_exit_s = await asyncio.to_thread(coord.stop)
                say(f"N={n}: coordinator exited {fmt(row.sigterm_exit_s, '.2f')} s after SIGTERM")
                self.count(sims)
                return row
            finally:
                if sims is not None:
                    await sims.stop()
                coord.kill()

    async def window(self, coord: CoordinatorProcess, sims: SimVolunteers) -> None:
        """Heartbeats, CPU, memory and the HTTP endpoints over --window seconds."""
        say(f"N={self.n}: measuring for {self.args.window:g} s")
        with poller_pool() as pool:
            await asyncio.get_running_loop().run_in_executor(pool, time.sleep, 0)  # started before the window
            polls = asyncio.get_running_loop().run_in_executor(pool, poll_endpoints,
                                                               [f"{coord.http}/api/v1/state", f"{coord.http}/metrics"],
                                                               self.args.window)
            await self.measure(coord, sims)
            state, metrics = await polls
        coord.alive()
        r = self.row
        r.state_ms, r.state_kb = Spread.of(state.latencies_ms), max(state.sizes_kb, default=0.0)
        r.metrics_ms, r.metrics_kb = Spread.of(metrics.latencies_ms), max(metrics.sizes_kb, default=0.0)
        r.errors.update({f"GET {log.url.split('/', 3)[3]}": log.failed for log in (state, metrics) if log.failed})

    async def measure(self, coord: CoordinatorProcess, sims: SimVolunteers) -> None:
        """Heartbeat latencies, the coordinator's CPU and memory over the window."""
        start, cpu0, sim0 = time.monotonic(), cpu_seconds(process_tree(coord.proc.pid)), cpu_seconds([os.getpid()])
        sims.beats.recording = True
        await asyncio.sleep(self.args.window)
        sims.beats.recording = False
        tree, r = process_tree(coord.proc.pid), self.row
        r.window_s = time.monotonic() - start
        r.cpu_pct = 100 * (cpu_seconds(tree) - cpu0) / r.window_s
        r.sim_cpu_pct = 100 * (cpu_seconds([os.getpid()]) - sim0) / r.window_s
        r.rss_mb, r.peak_rss_mb = memory_mb(tree, "VmRSS"), memory_mb(tree, "VmHWM")

    def count(self, sims: SimVolunteers) -> None:
        """The volunteers' side: heartbeats in the window, errors, probes."""
        r, hb, p = self.row, sims.beats, sims.probes.stats
        r.heartbeats, r.heartbeat_ms, r.rejoins = len(hb.latencies_ms), Spread.of(hb.latencies_ms), hb.rejoins
        r.heartbeat_errors = sum(hb.errors.values())
        r.errors.update(hb.errors)
        r.probes, r.probe_gb, r.probes_per_node_max, r.probes_at_once_max = (p.probes, p.bytes / 1e9, p.per_node_max,
                                                                             p.at_once_max)


NOTES = {  # what the columns mean: the --help epilog and the sentence under the table
    "joins s": "seconds from the first join sent to the last one answered (50 in flight at a time)",
    "placed s": "seconds from the last join until every volunteer is active or standby in /api/v1/state",
    "pipelines": "complete pipelines then (--pipelines auto: as many as the volunteers allow, up to --max-pipelines)",
    "heartbeat ms": "latency of the heartbeats answered in the window, as the volunteers see it",
    "coordinator CPU %": "user+system time of the coordinator (and any children) over the window, % of one core",
    "RSS MB (peak)": "the coordinator's resident memory at the end of the window (VmRSS; VmHWM in brackets)",
    "probes, probe GB": "link measurements the coordinator asked for over the whole run, and the bytes "
                        "real probes would send",
    "probes per node at once": "the most probes one volunteer was in at once, as sender or target (should be 1)",
    "state, metrics": "GET /api/v1/state and /metrics every 0.5 s in the window: latency p50 / p99, largest size",
    "SIGTERM exit s": "seconds from SIGTERM to the coordinator's exit, the volunteers still heartbeating",
    "sim CPU %": "the process simulating the volunteers: near 100, the load generator may be the limit",
}
EPILOG = "columns:\n" + "\n".join(f"  {name:<24} {what}" for name, what in NOTES.items())


def counts(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()] or [0]
    except ValueError:
        raise argparse.ArgumentTypeError(f"counts like 10,100,1000, not {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tahnode bench coordinator", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    ap.add_argument("--nodes", type=counts, default="10,100,1000", help="comma-separated volunteer counts, one fresh "
                    "coordinator each (default 10,100,1000)")
    ap.add_argument("--stages", type=int, default=4, help="pipeline stages of the run (default 4)")
    ap.add_argument("--window", type=float, default=30.0,
                    help="seconds measured once every volunteer is placed (default 30)")
    ap.add_argument("--place-timeout", type=float, default=180.0, help="seconds to wait for every volunteer to be "
                    "placed; then it is reported as not placed and the window runs anyway (default 180)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the volunteers' link speeds and compute speeds (default 0)")
    ap.add_argument("--doc", default="docs/benchmarks-log.md",
                    help="where the rows go (default docs/benchmarks-log.md)")
    ap.add_argument("--name", default="coordinator", help="the doc section's name (default coordinator)")
    ap.add_argument("--no-doc", action="store_true", help="print the rows only; leave the doc alone")
    ap.add_argument("--json", action="store_true",
                    help="print the rows as a JSON list on stdout (instead of the table)")
    return ap


def report(rows: list[CoordinatorRow], args, command: str) -> str:
    text = markdown_table(COLUMNS, [cells(r) for r in rows])
    if not args.no_doc:
        write_section(Path(args.doc), args.name, "Coordinator at scale", [
            text, "", f"A real coordinator (`tahnode coordinator`, plain gRPC on loopback, {args.stages} stages) "
            "against N simulated volunteers in one process that join with --stage auto, heartbeat, and answer its link "
            "probes over emulated links (up and down 10-1000 Mbit/s, log-uniform; RTT 5-80 ms); the window lasted "
            f"{args.window:g} s. " + "; ".join(f"*{name}*: {what}" for name, what in NOTES.items()) + ".",
            "", f"Command: `{command}`"], [])
    return text


async def run_all(nodes: list[int], args) -> list[CoordinatorRow]:
    return [await Bench(n, args).run() for n in nodes]


@interruptible("tahnode bench coordinator")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.stages < 1 or min(args.nodes) < args.stages:
        parser.error(f"every --nodes count must be at least --stages ({args.stages}), and that at least 1")
    try:
        use_fast_event_loop()  # the volunteers' side as fast as the coordinator's
        rows = asyncio.run(run_all(args.nodes, args))
    except BenchError as exc:
        print(f"tahnode bench coordinator: {exc}", file=sys.stderr)
        return 1
    command = ("tahnode bench coordinator " + " ".join(sys.argv[3:] if argv is None else argv)).strip()
    text = report(rows, args, command)
    print(json.dumps([asdict(r) for r in rows]) if args.json else text)
    if not args.no_doc:
        say(f"written to {args.doc}")
    return 0
