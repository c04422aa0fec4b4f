"""What one run of `tahnode bench chaos` leaves: its RunRecord (JSON in the run's folder, from which
the report can be made again), and what is read from the run's files once the swarm is down: the
daemons' log lines that mark a regroup, a rollback or an error (with their times), and the replicas'
largest difference per stage in the checkpoints the daemons saved last."""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

__all__ = ["RunRecord", "log_marks", "mark_of", "replica_spread", "largest_difference", "common_step",
           "MARKS"]

# What a daemon's log line says (the first that matches): stage 0's decisions to regroup its pipeline
# (each try of a regroup that does not settle logs one: a livelock shows as thousands), rollbacks to
# a checkpoint, and errors.
MARKS = {
    "regroup": re.compile(r"returns to its stage's latest outer step|it regroups with the others", re.I),
    "rollback": re.compile(r"rolling every stage back", re.I),
    "error": re.compile(r" (ERROR|CRITICAL) "),
}
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")  # the daemons' logging format
CHECKPOINT = re.compile(r"stage(\d+)-of(\d+)-step(\d+)\.safetensors$")  # tahnode.pipeline.checkpoint's names
OUTER = "outer/anchor"  # a replica's outer weights, flat, in its checkpoints (pipelines in data parallel)


@dataclass
class RunRecord:
    """Everything a run did and saw; times are seconds since the epoch (t0: the measurement's start)."""

    settings: dict
    measure: dict
    schedule: list[dict]
    times: dict
    plan: dict = field(default_factory=dict)             # the schedule's seed, period, kinds
    workdir: str = ""
    t0: float = 0.0
    t_end: float = 0.0
    events: list[dict] = field(default_factory=list)      # every fault action: t, fault, kind, action, target, detail
    commits: list[list] = field(default_factory=list)     # [t, pipeline, step] each time an entry appears
    rewritten: list[list] = field(default_factory=list)   # [t, pipeline, step]: an entry whose content changed
    vanished: list[list] = field(default_factory=list)    # [t, pipeline, step]: an entry gone from the ledger
    steps: list[list] = field(default_factory=list)       # [t, {pipeline: its loss stage's step}]
    placements: list[list] = field(default_factory=list)  # [t, {"pipeline/stage": daemon}] at every change
    node_ids: dict = field(default_factory=dict)          # node id -> daemon, every id the state listed
    ledger: list[dict] = field(default_factory=list)      # the ledger at the end
    final_state: dict | None = None
    addresses: dict = field(default_factory=dict)         # daemon -> the address it served on
    drain: dict = field(default_factory=dict)
    log_marks: list[list] = field(default_factory=list)   # [t, daemon, mark]
    replicas: dict = field(default_factory=dict)          # stage -> {step, diff, replicas, note}
    error: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def note(self, fault: int, kind: str, action: str, target: str = "", detail: str = "") -> None:
        """One action of fault number `fault` (-1: none of the schedule's), now."""
        with self.lock:
            self.events.append({"t": time.time(), "fault": fault, "kind": kind, "action": action, "target": target,
                                "detail": detail})

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lock"}

    @classmethod
    def from_json(cls, doc: dict) -> "RunRecord":
        names = {f.name for f in fields(cls)} - {"lock"}
        return cls(**{k: v for k, v in doc.items() if k in names})

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json()))
        return path

    @classmethod
    def load(cls, path: Path) -> "RunRecord":
        return cls.from_json(json.loads(Path(path).read_text()))


def mark_of(line: str) -> tuple[float, str] | None:
    """(time, mark) of a daemon's log line that MARKS names, else None."""
    when = LOG_TIME.match(line)
    if when is None:
        return None
    for mark, pattern in MARKS.items():
        if pattern.search(line):
            t = time.mktime(time.strptime(when[1], "%Y-%m-%d %H:%M:%S")) + int(when[2]) / 1000
            return t, mark
    return None


def log_marks(logs: Path) -> list[list]:
    """[t, daemon, mark] for every marked line of the daemons' logs (the coordinator's left out)."""
    out = []
    for path in sorted(Path(logs).glob("*.log")):
        if path.stem == "coord":
            continue
        with open(path, errors="replace") as fh:
            out += [[t, path.stem, mark] for line in fh if (found := mark_of(line)) for t, mark in [found]]
    return sorted(out)


def common_step(steps: dict[str, set[int]], at_most: int | None = None) -> int | None:
    """The newest step (at most `at_most`) every replica has a checkpoint of, or None."""
    sets = list(steps.values())
    common = {s for s in set.intersection(*sets) if at_most is None or s <= at_most} if sets else set()
    return max(common) if common else None


def largest_difference(tensors: list) -> float:
    """The largest difference between two of the tensors, element by element."""
    import torch

    stacked = torch.stack([t.double() for t in tensors])
    return float((stacked.max(0).values - stacked.min(0).values).max())


def replica_spread(state: dict, addresses: dict[str, str], folders: Path, stages: int,
                   at_most: int | None = None) -> dict:
    """stage -> {step, diff, replicas, note}: the largest difference between the outer weights of the
    stage's replicas (the active holders in `state`) in the newest checkpoint step all their folders hold, at most
    `at_most` (the drain's step: a daemon stopped after it saves a state of its own, its averager gone)."""
    from safetensors import safe_open

    by_address = {a: name for name, a in addresses.items()}
    out = {}
    for stage in range(stages):
        names = sorted({by_address[n["address"]] for n in state.get("nodes", []) if n["status"] == "active"
                        and n["stage"] == stage and n.get("address") in by_address})
        row = {"step": None, "diff": None, "replicas": names, "note": ""}
        out[str(stage)] = row
        if len(names) < 2:
            row["note"] = "fewer than two replicas"
            continue
        files = {name: {int(m[3]): p for p in (folders / name).glob(f"stage{stage}-of{stages}-step*.safetensors")
                        if (m := CHECKPOINT.search(p.name))} for name in names}
        step = common_step({name: set(f) for name, f in files.items()}, at_most)
        if step is None:
            row["note"] = "no checkpoint step common to " + ", ".join(f"{n} ({sorted(f)})" for n, f in files.items())
            continue
        tensors = []
        for name in names:
            with safe_open(str(files[name][step]), framework="pt") as fh:
                if OUTER not in fh.keys():
                    row["note"] = f"{files[name][step]} holds no {OUTER}"
                    break
                tensors.append(fh.get_tensor(OUTER))
        else:
            row["step"], row["diff"] = step, largest_difference(tensors)
    return out
