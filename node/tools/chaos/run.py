"""One run of `tahnode bench chaos`: the swarm up, its pipelines formed, the fault schedule applied
while the coordinator's state and ledger are polled, a drain to a common checkpoint, the swarm down;
what happened is kept as a RunRecord (JSON): every fault's actions with their times, every ledger
entry's first appearance (and those that changed or vanished), each pipeline's step over time, the node
ids seen, the daemons' regroup lines and the replicas' final difference per stage.

Only the product's outside is used: its command lines, /api/v1/state and /api/v1/ledger, its logs and
the checkpoint files the daemons leave in their folders."""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .faults import COORDINATOR, Fault, FaultKind, FaultTimes
from .record import RunRecord, log_marks, replica_spread
from ..swarm import LocalSwarm, Shaper, SwarmError, SwarmSpec
from .daemons import ChaosSwarm, remove_cuts

__all__ = ["SwarmSettings", "MeasureSettings", "Recorder", "FaultRunner", "run_chaos"]


@dataclass(frozen=True)
class SwarmSettings:
    """What the swarm trains and how it is made: a fault-free run of the same settings is its baseline."""

    pipelines: int = 2
    stages: int = 3
    standbys: int = 1
    model: str = "llama-tiny"
    seq_len: int = 64
    batch_size: int = 4
    micro_batches: int = 2
    outer_every: int = 4
    checkpoint_every: int = 20
    codec: str = "none"
    backward_codec: str = "none"
    heartbeat_timeout: float = 10.0
    net: str = Shaper.USERSPACE.value       # userspace: 127.0.0.1; tc: network namespaces
    stable_ids: bool = False
    coordinator_args: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, doc: dict) -> "SwarmSettings":
        return cls(**{**doc, "coordinator_args": tuple(doc.get("coordinator_args", ()))})

    @property
    def daemons(self) -> int:
        return self.pipelines * self.stages + self.standbys

    @property
    def tokens_per_step(self) -> int:
        """Tokens one pipeline trains in one step."""
        return self.batch_size * self.micro_batches * self.seq_len

    def spec(self, workdir: Path, prefix: str) -> SwarmSpec:
        flags = ["--model", self.model, "--steps", str(10**6), "--pipelines", str(self.pipelines), "--standbys",
                 str(self.standbys), "--seq-len", str(self.seq_len), "--batch-size", str(self.batch_size),
                 "--micro-batches", str(self.micro_batches), "--outer-every", str(self.outer_every),
                 "--checkpoint-every", str(self.checkpoint_every), "--codec", self.codec, "--backward-codec",
                 self.backward_codec, *self.coordinator_args]
        return SwarmSpec(nodes=self.daemons, stages=self.stages, shaper=Shaper(self.net), prefix=prefix,
                         workdir=workdir, run_flags=flags, heartbeat_timeout=self.heartbeat_timeout, auto=True,
                         placement_flags=["--settle", "2", "--probe-wait", "4"])


@dataclass(frozen=True)
class MeasureSettings:
    """How long and how closely a run is watched (seconds unless named otherwise)."""

    minutes: float = 10.0
    warmup_steps: int = 5      # the measurement starts once every pipeline trained this many steps
    form_timeout: float = 600.0
    poll_s: float = 1.0
    drain_s: float = 120.0     # after the end, how long to wait for every pipeline to reach a common checkpoint


class Recorder:
    """Polls the coordinator into a RunRecord: commits as they first appear in the ledger, entries
    that change or vanish, each pipeline's step, placements, node ids, daemons that ended by themselves."""

    def __init__(self, swarm: ChaosSwarm, record: RunRecord):
        self.swarm, self.record = swarm, record
        self.latest: dict | None = None
        self.ledger: list[dict] = []
        self._seen: dict[tuple[int, int], tuple] = {}
        self._placement: dict = {}
        self._crashed: set[str] = set()

    def poll(self) -> None:
        now, rec = time.time(), self.record
        state = self.swarm.state()
        if state is not None:
            self.latest = state
            rec.steps.append([now, {str(p["index"]): p["step"] for p in state.get("pipelines", [])}])
            placement = {f"{n.get('pipeline')}/{n['stage']}": self.swarm.name_of(n) or n["id"]
                         for n in state["nodes"] if n["status"] == "active"}
            if placement != self._placement:
                rec.placements.append([now, placement])
                self._placement = placement
            for n in state["nodes"]:
                rec.node_ids.setdefault(n["id"], self.swarm.name_of(n) or "?")
        ledger = self.swarm.state("ledger")
        if ledger is not None:
            self._diff(now, ledger["steps"])
        for name, code in self.swarm.crashed().items():
            if name not in self._crashed and name not in self.swarm.killed:
                rec.note(-1, "crash", "exited by itself", name, f"exit code {code}")
                self._crashed.add(name)
        self._crashed &= set(self.swarm.crashed())

    def _diff(self, now: float, entries: list[dict]) -> None:
        rec, current = self.record, {}
        for e in entries:
            key = (e["pipeline"], e["step"])
            current[key] = (e.get("loss"), tuple(e.get("sample_ids", ())), bool(e.get("skipped")))
            if key not in self._seen:
                rec.commits.append([now, *key])
            elif self._seen[key] != current[key]:
                rec.rewritten.append([now, *key])
        rec.vanished += [[now, *key] for key in self._seen if key not in current]
        self._seen, self.ledger = current, entries


class FaultRunner:
    """Applies faults, each in a thread of its own, noting every action with its time; `stop()` ends
    them early, undoing what lasts (SIGCONT, the link up) and starting again whatever they killed."""

    def __init__(self, swarm: ChaosSwarm, recorder: Recorder, times: FaultTimes, heartbeat_timeout: float):
        self.swarm, self.recorder, self.times = swarm, recorder, times
        self.heartbeat_timeout = heartbeat_timeout
        self.halt = threading.Event()
        self.threads: list[threading.Thread] = []

    def launch(self, index: int, fault: Fault) -> None:
        thread = threading.Thread(target=self._guarded, args=(index, fault), daemon=True, name=f"fault-{index}")
        self.threads.append(thread)
        thread.start()

    def stop(self) -> None:
        self.halt.set()
        for thread in self.threads:
            thread.join(timeout=60)

    def note(self, index: int, fault: Fault, action: str, target: str = "", detail: str = "") -> None:
        self.recorder.record.note(index, fault.kind.value, action, target, detail)

    def _guarded(self, index: int, fault: Fault) -> None:
        try:
            {FaultKind.KILL: self._kill, FaultKind.STOP: self._stop, FaultKind.CUT: self._cut,
             FaultKind.COORDINATOR: self._kill, FaultKind.OVERLAP: self._overlap}[fault.kind](index, fault)
        except Exception as exc:  # a fault that cannot be applied is reported, the run goes on
            self.note(index, fault, "error", fault.target, f"{type(exc).__name__}: {exc}")

    def _where(self, name: str) -> str:
        if name == COORDINATOR:
            return "the coordinator"
        for n in (self.recorder.latest or {}).get("nodes", []):
            if self.swarm.name_of(n) == name and n["status"] != "failed":
                return f"{n['id']}: {n['status']}, stage {n['stage']}, pipeline {n.get('pipeline')}"
        return "not in the state"

    def _kill(self, index: int, fault: Fault) -> None:
        seconds = self.times.coordinator_down if fault.kind is FaultKind.COORDINATOR else self.times.restart_after
        self._down(index, fault, fault.target, seconds)

    def _down(self, index: int, fault: Fault, name: str, seconds: float) -> None:
        where = self._where(name)
        self.swarm.killed.add(name)
        try:
            done = self.swarm.send_signal(name, signal.SIGKILL)
            self.note(index, fault, "sigkill" if done else "sigkill: not running", name, where)
            self.halt.wait(seconds)
            if self.swarm.restart(name):
                self.note(index, fault, "restart", name)
        finally:
            self.swarm.killed.discard(name)

    def _stop(self, index: int, fault: Fault) -> None:
        where = self._where(fault.target)
        if not self.swarm.send_signal(fault.target, signal.SIGSTOP):
            return self.note(index, fault, "sigstop: not running", fault.target)
        self.note(index, fault, "sigstop", fault.target, where)
        self.halt.wait(self.times.stop_s)
        self.swarm.send_signal(fault.target, signal.SIGCONT)
        self.note(index, fault, "sigcont", fault.target)

    def _cut(self, index: int, fault: Fault) -> None:
        where = self._where(fault.target)
        cut = self.swarm.cut(fault.target)
        self.note(index, fault, "cut", fault.target, where)
        until = time.time() + self.times.cut_s
        try:
            while time.time() < until and not self.halt.wait(min(0.5, max(0.0, until - time.time()))):
                if cut is not None:
                    cut.refresh()
        finally:
            self.swarm.uncut(fault.target, cut)
            self.note(index, fault, "link up", fault.target)

    def _overlap(self, index: int, fault: Fault) -> None:
        """Kill the holder of (pipeline, stage); once the stage has an active holder again (another
        daemon, another id, or the same one restarted a heartbeat timeout ago), kill that one after
        overlap_delay, while it resumes."""
        held = self.swarm.holder(self.recorder.latest, fault.pipeline, fault.stage)
        if held is None:
            return self.note(index, fault, "skipped", "", f"no active holder of stage {fault.stage} in pipeline "
                             f"{fault.pipeline}")
        first, first_id = held
        killer = threading.Thread(target=self._down, args=(index, fault, first, self.times.restart_after),
                                  daemon=True)
        killer.start()
        started, replacement = time.time(), None
        while replacement is None and not self.halt.wait(0.25):
            if time.time() - started > self.times.takeover_timeout:
                break
            now = self.swarm.holder(self.recorder.latest, fault.pipeline, fault.stage)
            restarted_long_ago = time.time() - started > self.times.restart_after + self.heartbeat_timeout
            if now is not None and (now != (first, first_id) or restarted_long_ago) and self.swarm.alive(now[0]):
                replacement = now[0]
        if replacement is None:
            killer.join()
            return self.note(index, fault, "no takeover", "", f"stage {fault.stage} of pipeline {fault.pipeline} had "
                             f"no new holder within {self.times.takeover_timeout:g} s")
        self.note(index, fault, "took over", replacement, self._where(replacement))
        if not self.halt.wait(self.times.overlap_delay):
            self._down(index, fault, replacement, self.times.restart_after)
        killer.join()


def _formed(state: dict | None, pipelines: int, warmup: int) -> bool:
    ps = (state or {}).get("pipelines", [])
    return sum(bool(p["complete"]) for p in ps) >= pipelines and all((p["step"] or 0) >= warmup for p in ps
                                                                       if p["complete"])


def run_chaos(settings: SwarmSettings, measure: MeasureSettings, faults: list[Fault], times: FaultTimes,
              workdir: Path, prefix: str, plan: dict | None = None, progress=None,
              save_to: Path | None = None) -> RunRecord:
    """Run the swarm under `faults` (none: a baseline); RunRecord.error says what went wrong, if anything.
    `plan`: how the schedule was drawn (kept in the record); `save_to`: where the record is written,
    also when the run is interrupted."""
    record = RunRecord(settings=asdict(settings), measure=asdict(measure), schedule=[f.to_json() for f in faults],
                       times=asdict(times), plan=dict(plan or {}), workdir=str(workdir))
    remove_cuts(prefix)
    spec = settings.spec(workdir, prefix)
    runner = None
    try:
        swarm = ChaosSwarm.start(spec, settings.stable_ids, measure.form_timeout)
        recorder = Recorder(swarm, record)
        runner = FaultRunner(swarm, recorder, times, settings.heartbeat_timeout)
        _watch(recorder, record, settings, measure, faults, runner, progress)
        runner.stop()
        _drain(recorder, record, settings, measure)
        record.final_state, record.ledger = recorder.latest, recorder.ledger
        record.addresses = dict(swarm.addresses)
    except SwarmError as exc:
        record.error = str(exc)
    except KeyboardInterrupt:
        record.error = "interrupted"
        raise
    finally:
        if runner is not None:
            runner.stop()
        LocalSwarm.down(spec.prefix, spec.workdir)
        remove_cuts(prefix)
        record.log_marks = log_marks(spec.workdir / "logs")
        if save_to is not None:
            record.save(save_to)
    if record.final_state:
        drained = record.drain.get("target") if record.drain.get("reached") else None
        record.replicas = replica_spread(record.final_state, record.addresses, spec.workdir / "ck", settings.stages,
                                         drained)
        if save_to is not None:
            record.save(save_to)
    return record


def _watch(recorder: Recorder, record: RunRecord, settings: SwarmSettings, measure: MeasureSettings,
           faults: list[Fault], runner: FaultRunner, progress) -> None:
    """Wait for the pipelines to form and warm up, then poll for --minutes while the faults come."""
    deadline = time.time() + measure.form_timeout
    while not _formed(recorder.latest, settings.pipelines, measure.warmup_steps):
        if time.time() > deadline:
            raise SwarmError(f"{settings.pipelines} pipelines did not train {measure.warmup_steps} steps each within "
                             f"{measure.form_timeout:g} s of joining; logs in {recorder.swarm.spec.workdir / 'logs'}")
        recorder.poll()
        time.sleep(measure.poll_s)
    record.t0 = time.time()
    end, pending = record.t0 + measure.minutes * 60, list(enumerate(faults))
    while (now := time.time()) < end:
        while pending and now >= record.t0 + pending[0][1].at:
            runner.launch(*pending.pop(0))
        recorder.poll()
        if progress is not None:
            progress(now - record.t0, recorder.latest, len(faults) - len(pending))
        time.sleep(max(0.0, measure.poll_s - (time.time() - now)))
    record.t_end = time.time()


def _drain(recorder: Recorder, record: RunRecord, settings: SwarmSettings, measure: MeasureSettings) -> None:
    """Let every pipeline reach the next checkpoint step past the furthest one (so that the replicas
    of each stage leave files of one step to compare), within drain_s."""
    steps = [p["step"] or 0 for p in (recorder.latest or {}).get("pipelines", [])]
    every = settings.checkpoint_every
    target = (max(steps, default=0) // every + 1) * every
    deadline, reached = time.time() + measure.drain_s, False
    while time.time() < deadline:
        recorder.poll()
        steps = [p["step"] or 0 for p in (recorder.latest or {}).get("pipelines", [])]
        if steps and min(steps) >= target:
            reached = True
            break
        time.sleep(measure.poll_s)
    record.drain = {"target": target, "reached": reached, "steps": steps}
    print(f"drain: every pipeline at step {target}: {'yes' if reached else 'no'} (steps {steps})", file=sys.stderr)
