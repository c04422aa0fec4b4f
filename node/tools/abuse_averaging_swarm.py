"""One swarm of `tahnode bench abuse --averaging`: a coordinator with --pipelines 2 and 2 x S daemons pinned to
their stages on 127.0.0.1, pipeline 0 honest, pipeline 1's stage-1 replica a liar (or honest); what came of it.

The daemons join in an order that puts each where it belongs (a pinned node takes the first pipeline whose stage
is open): both pipelines' later stages first, then pipeline 0's stage 0, then pipeline 1's. Pipeline 0 is complete
first, and would train some steps (outer steps alone, of one pipeline) before pipeline 1 forms: its later stages
are paused (SIGSTOP) while the stage-0 daemons join, and go on (SIGCONT) once every daemon heard that two pipelines
train, so that both pipelines begin together and meet at their first outer step (the coordinator's
--heartbeat-timeout is raised for the pause). The run ends for the bench once the honest pipeline's every stage
saved its checkpoint of the last step (taken after its last outer step)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..pipeline.checkpoint import checkpoint_name
from .abuse_frames import StageDaemon
from .averaging_liar import Lie
from .bench_coordinator import BenchError, CoordinatorProcess
from .swarm import fetch

__all__ = ["Setup", "Exclusion", "SwarmOutcome", "run_swarm", "exclusions", "banned_ids", "node_name", "HONEST",
           "LIAR", "LIAR_STAGE"]

HONEST, LIAR_PIPELINE, LIAR_STAGE = 0, 1, 1
LIAR = "p1s1-liar"
POLL_S = 1.0
HEARTBEAT_TIMEOUT_S = 120.0  # the coordinator's, for the pause of pipeline 0's later stages
STOP_S = 30.0                # SIGTERM to SIGKILL, for all the daemons together
EXCLUDES = re.compile(r"stage (\d+): excludes replica (\S+) from its groups: round (\d+): (\w+)")
BANNED = re.compile(r"banned: (\S+) \(stage")


@dataclass(frozen=True)
class Setup:
    """The run every swarm and the reference train: the same model, steps, batches and seed."""

    model: str = "llama-tiny"
    stages: int = 2
    outer_steps: int = 40
    outer_every: int = 4
    batch_size: int = 4
    micro_batches: int = 2
    seq_len: int = 64
    seed: int = 0
    outer_timeout: float = 30.0
    timeout: float = 3600.0      # seconds a swarm may take to train the honest pipeline's steps

    @property
    def steps(self) -> int:
        return self.outer_steps * self.outer_every

    def coordinator_flags(self) -> tuple[str, ...]:
        return ("--model", self.model, "--steps", str(self.steps), "--checkpoint-every", str(self.outer_every),
                "--micro-batches", str(self.micro_batches), "--pipeline-micro-batches", str(self.micro_batches),
                "--batch-size", str(self.batch_size), "--seq-len", str(self.seq_len), "--seed", str(self.seed),
                "--codec", "none", "--backward-codec", "none", "--pipelines", "2", "--outer-every",
                str(self.outer_every), "--outer-timeout", f"{self.outer_timeout:g}", "--heartbeat-timeout",
                f"{HEARTBEAT_TIMEOUT_S:g}")


@dataclass(frozen=True)
class Exclusion:
    """A replica's log line: it excluded another replica of its stage (by averager peer id) at an outer step."""

    by: str
    stage: int
    peer: str
    round: int
    offence: str

    def __str__(self) -> str:
        return f"{self.by} excluded its stage-{self.stage} replica at outer step {self.round} ({self.offence})"


@dataclass
class SwarmOutcome:
    """What one swarm came to; `lie` "none" for two honest pipelines."""

    lie: str
    checkpoints: list[Path] = field(default_factory=list)  # the honest pipeline's last ones, stage by stage
    seconds: float = 0.0                                     # from the coordinator's start to the honest pipeline's end
    losses: list[float] = field(default_factory=list)        # the honest pipeline's ledger, step by step
    excluded: list[Exclusion] = field(default_factory=list)  # every exclusion an honest replica logged
    reported: bool = False      # the honest stage-1 replica's heartbeats told the coordinator of an exclusion
    banned: list[str] = field(default_factory=list)          # node ids the coordinator banned
    outer: list[dict] = field(default_factory=list)          # the honest replicas' outer-step figures, by stage
    lies: int = 0                                            # outer steps the liar lied at (its own log)


def node_name(pipeline: int, stage: int, lie: Lie | None) -> str:
    return LIAR if lie is not None and (pipeline, stage) == (LIAR_PIPELINE, LIAR_STAGE) else f"p{pipeline}s{stage}"


def exclusions(log: str, by: str) -> list[Exclusion]:
    """The exclusions a daemon's log (`by`'s) records (tahnode.pipeline.outer_sync's warning)."""
    return [Exclusion(by, int(m[1]), m[2], int(m[3]), m[4]) for m in EXCLUDES.finditer(log)]


def banned_ids(coordinator_log: str) -> list[str]:
    """The node ids the coordinator's events say it banned, each once, in order."""
    return list(dict.fromkeys(m[1] for m in BANNED.finditer(coordinator_log)))


def _join_order(stages: int) -> list[tuple[int, int]]:
    return [(p, k) for p in (0, 1) for k in range(1, stages)] + [(0, 0), (1, 0)]


def _wait_placed(coord: CoordinatorProcess, daemon: StageDaemon, pipeline: int, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        coord.alive()
        if daemon.proc.poll() is not None:
            raise BenchError(f"{daemon.node_id} exited with status {daemon.proc.returncode} before it held its "
                             f"stage:\n{_tail(daemon.log)}")
        state = fetch(coord.http) or {}
        node = next((n for n in state.get("nodes", []) if n.get("id") == daemon.node_id), None)
        if node is not None and node.get("status") == "active" and node.get("pipeline") is not None:
            if node["pipeline"] != pipeline:
                raise BenchError(f"{daemon.node_id} was placed in pipeline {node['pipeline']}, not {pipeline}")
            return
        time.sleep(0.3)
    raise BenchError(f"{daemon.node_id} held no stage within {timeout:.0f} s:\n{_tail(daemon.log)}")


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def _signal(daemons: list[StageDaemon], sig: int) -> None:
    for d in daemons:
        if d.proc is not None and d.proc.poll() is None:
            os.kill(d.proc.pid, sig)


def _stop(daemons: list[StageDaemon]) -> None:
    """SIGTERM to every daemon (paused ones go on first), then SIGKILL to what is left of each one's session
    (its p2p daemon, its averager) after STOP_S for them all."""
    _signal(daemons, signal.SIGCONT)
    _signal(daemons, signal.SIGTERM)
    deadline = time.monotonic() + STOP_S
    for d in daemons:
        if d.proc is None:
            continue
        try:
            d.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(d.proc.pid, signal.SIGKILL)  # the session it was started in (start_new_session)
        except ProcessLookupError:
            pass
        d.proc.wait()


def _two_pipelines(coord: CoordinatorProcess) -> bool:
    state = fetch(coord.http) or {}
    return sum(1 for p in state.get("pipelines", []) if p.get("complete")) == 2


def _finished(setup: Setup, honest: list[StageDaemon], coord: CoordinatorProcess, started: float) -> list[Path]:
    """Wait until every stage of the honest pipeline saved its checkpoint of the last step; their paths."""
    paths = [d.workdir / "ck" / d.node_id / checkpoint_name(k, setup.stages, setup.steps) for k, d in enumerate(honest)]
    while not all(p.exists() for p in paths):
        coord.alive()
        for d in honest:
            if d.proc.poll() not in (None, 0):
                raise BenchError(f"{d.node_id} (honest) exited with status {d.proc.returncode}:\n{_tail(d.log)}")
        if time.monotonic() - started > setup.timeout:
            state = fetch(coord.http) or {}
            steps = {p.get("index"): p.get("step") for p in state.get("pipelines", [])}
            raise BenchError(f"the honest pipeline did not train {setup.steps} steps within {setup.timeout:.0f} s "
                             f"(pipelines at steps {steps}); its stage-1 log ends:\n{_tail(honest[LIAR_STAGE].log)}")
        time.sleep(POLL_S)
    return paths


def run_swarm(setup: Setup, lie: Lie | None, workdir: Path, say=print) -> SwarmOutcome:
    """Train one swarm (`lie` None: no liar) in `workdir` (its logs and checkpoints stay there)."""
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    coord = CoordinatorProcess(workdir, setup.stages, setup.coordinator_flags())
    daemons: dict[tuple[int, int], StageDaemon] = {}
    outcome = SwarmOutcome(str(lie) if lie is not None else "none")
    try:
        coord.start()
        coord.wait_ready()
        paused = []
        for p, k in _join_order(setup.stages):
            if k == 0 and not paused:  # pipeline 0 is complete with its stage 0: it waits for pipeline 1
                paused = [daemons[0, j] for j in range(1, setup.stages)]
                _signal(paused, signal.SIGSTOP)
            name = node_name(p, k, lie)
            command = [sys.executable, "-m", "tahnode.tools.averaging_liar", str(lie)] if name == LIAR else None
            daemons[p, k] = StageDaemon(workdir, coord.address, workdir / "token", k, name, command)
            daemons[p, k].start()
            _wait_placed(coord, daemons[p, k], p)
        while not _two_pipelines(coord):
            coord.alive()
            time.sleep(0.3)
        time.sleep(3 * POLL_S)  # every running daemon's next heartbeat: two pipelines train
        _signal(paused, signal.SIGCONT)
        say(f"{outcome.lie}: two pipelines of {setup.stages} stages placed; training {setup.steps} steps")
        honest = [daemons[HONEST, k] for k in range(setup.stages)]
        outcome.checkpoints = _finished(setup, honest, coord, started)
        outcome.seconds = time.monotonic() - started
        say(f"{outcome.lie}: the honest pipeline trained its {setup.steps} steps in {outcome.seconds / 60:.1f} min")
        time.sleep(3 * POLL_S)  # the honest replicas' last heartbeats
        state, ledger = fetch(coord.http) or {}, fetch(coord.http, "ledger") or {}
    finally:
        _stop(list(daemons.values()))
        coord.stop()
    nodes = {n.get("id"): n for n in state.get("nodes", [])}
    outcome.outer = [dict(nodes.get(node_name(HONEST, k, lie), {}).get("outer", {})) for k in range(setup.stages)]
    outcome.reported = outcome.outer[LIAR_STAGE].get("excluded", 0) >= 1
    outcome.losses = [e["loss"] for e in sorted((e for e in ledger.get("steps", []) if e["pipeline"] == HONEST),
                                                key=lambda e: e["step"])]
    outcome.banned = banned_ids(coord.log.read_text(errors="replace")) + [
        i for i, n in nodes.items() if n.get("status") == "banned"]
    outcome.banned = list(dict.fromkeys(outcome.banned))
    for d in daemons.values():
        text = d.log.read_text(errors="replace")
        if d.node_id == LIAR:
            outcome.lies = text.count("liar: outer step ")
        else:
            outcome.excluded += exclusions(text, d.node_id)
    return outcome
