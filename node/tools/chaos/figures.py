"""The figures of `tahnode bench chaos`, computed from a RunRecord (and its fault-free baseline's):
pure functions of the ledger, the commit times and the fault actions, so that a report can be made
again from the JSON, and tested on made-up runs.

A step is committed when it first appears in the coordinator's ledger (polled every second or so).
Full speed is the fault-free run's rate of committed steps (else this run's own before its first
fault); a fault's time to full speed is how long after it comes the first committed step that opens
a window of `window` seconds in which the swarm commits at least FULL_SPEED_SHARE of that rate."""

from __future__ import annotations

import statistics
from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass, field

from .record import RunRecord

__all__ = ["Figures", "figures", "longest_stall", "ledger_holes", "samples_twice", "time_to_full_speed",
           "fault_starts", "tokens_per_s", "rate_series", "FULL_SPEED_SHARE"]

FULL_SPEED_SHARE = 0.9
FIRST_ACTIONS = ("sigkill", "sigstop", "cut")  # what starts a fault (an overlap: its first kill)
FAILED_ACTIONS = ("no takeover", "skipped", "error", "sigkill: not running", "sigstop: not running")


@dataclass
class Figures:
    """What the report says of one run (seconds unless named otherwise; None: cannot be told)."""

    minutes: float
    tokens_per_s: float
    baseline_tokens_per_s: float | None = None
    full_speed_from: str = ""
    full_tokens_per_s: float | None = None                  # full speed, the fault-free run's or this run's
    longest_stall_s: float = 0.0
    longest_stall_at: float = 0.0                           # its start, seconds after the measurement's
    pipeline_stall_s: dict = field(default_factory=dict)    # pipeline -> its longest stretch without a step
    missing: dict = field(default_factory=dict)             # pipeline -> steps absent from the ledger
    skipped: dict = field(default_factory=dict)             # pipeline -> steps the ledger marks skipped
    rewritten: int = 0                                      # ledger entries that changed after they appeared
    vanished: int = 0                                       # ledger entries that disappeared (some came back)
    samples_twice: int = 0                                  # sample ids in two trained steps of one pipeline
    recoveries: list = field(default_factory=list)          # per fault: index, kind, label, at, seconds
    after_last_s: float | None = None
    regroups_per_min: float = 0.0
    rollbacks_per_min: float = 0.0
    errors: int = 0                                         # ERROR lines in the daemons' logs, measurement only
    replicas: dict = field(default_factory=dict)            # stage -> largest difference (None: not compared)
    node_ids: int = 0
    daemons: int = 0
    applied: dict = field(default_factory=dict)             # fault kind -> how many happened
    failed: list = field(default_factory=list)              # faults that could not be applied, and why

    @property
    def share(self) -> float | None:
        return self.tokens_per_s / self.baseline_tokens_per_s if self.baseline_tokens_per_s else None


def first_seen(record: RunRecord) -> dict[tuple[int, int], float]:
    """(pipeline, step) -> when it first appeared in the ledger."""
    out: dict[tuple[int, int], float] = {}
    for t, p, s in record.commits:
        out.setdefault((p, s), t)
    return out


def tokens_per_s(record: RunRecord) -> float:
    """Tokens of the steps the final ledger holds (skipped ones left out) that first appeared within
    the measurement, over its length."""
    seen, span = first_seen(record), record.t_end - record.t0
    seq = record.settings["seq_len"]
    tokens = sum(len(e["sample_ids"]) * seq for e in record.ledger if not e.get("skipped")
                 and record.t0 <= seen.get((e["pipeline"], e["step"]), -1.0) <= record.t_end)
    return tokens / span if span > 0 else 0.0


def longest_stall(times: list[float], t0: float, t1: float) -> tuple[float, float]:
    """(length, start) of the longest stretch of [t0, t1] without a time of `times` in it."""
    inside = sorted(t for t in times if t0 <= t <= t1)
    edges = [t0, *inside, t1]
    gaps = [(b - a, a) for a, b in zip(edges, edges[1:])]
    return max(gaps) if gaps else (0.0, t0)


def ledger_holes(ledger: list[dict]) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Per pipeline: the steps missing between its first and its last, and those marked skipped."""
    held: dict[int, set[int]] = {}
    skipped: dict[int, list[int]] = {}
    for e in ledger:
        held.setdefault(e["pipeline"], set()).add(e["step"])
        if e.get("skipped"):
            skipped.setdefault(e["pipeline"], []).append(e["step"])
    missing = {p: [s for s in range(min(steps), max(steps) + 1) if s not in steps] for p, steps in held.items()}
    return {p: m for p, m in missing.items() if m}, {p: sorted(s) for p, s in skipped.items()}


def samples_twice(ledger: list[dict]) -> int:
    """Sample ids that more than one trained (not skipped) step of the same pipeline holds. (Pipelines
    train lanes of the sample stream that lie epochs apart: the same id in two pipelines is two positions.)"""
    counts = Counter((e["pipeline"], i) for e in ledger if not e.get("skipped") for i in e["sample_ids"])
    return sum(1 for n in counts.values() if n > 1)


def time_to_full_speed(times: list[float], at: float, full_rate: float, window: float, end: float,
                       share: float = FULL_SPEED_SHARE) -> float | None:
    """Seconds from `at` to the first committed step (`times`, sorted) that opens a `window` in which at
    least share x full_rate x window steps were committed; None if no such window ends by `end`."""
    need = share * full_rate * window
    for k in range(bisect_left(times, at), len(times)):
        tau = times[k]
        if tau + window > end + 1e-9:
            break
        if bisect_right(times, tau + window) - k >= need:
            return tau - at
    return None


def fault_starts(record: RunRecord) -> list[tuple[int, str, float, str]]:
    """(fault index, kind, time, label) of every fault of the schedule that happened, by its first action."""
    out = {}
    for e in record.events:
        if e["fault"] >= 0 and e["action"] in FIRST_ACTIONS and e["fault"] not in out:
            out[e["fault"]] = (e["fault"], e["kind"], e["t"], f"{e['kind']} {e['target']}")
    return sorted(out.values(), key=lambda f: f[2])


def rate_series(times: list[float], t0: float, t1: float, window: float, tokens_per_step: float,
                step: float = 2.0) -> list[tuple[float, float]]:
    """(seconds after t0, tokens/s over the window that ends there) every `step` seconds."""
    out, t = [], t0 + window
    while t <= t1 + 1e-9:
        n = bisect_right(times, t) - bisect_left(times, t - window)
        out.append((t - t0, n * tokens_per_step / window))
        t += step
    return out


def figures(record: RunRecord, baseline: RunRecord | None, window: float) -> Figures:
    """Every figure of the report for one run."""
    t0, t1 = record.t0, record.t_end
    times = sorted(t for t, _, _ in record.commits)
    f = Figures(minutes=(t1 - t0) / 60, tokens_per_s=tokens_per_s(record), daemons=_daemons(record.settings),
                node_ids=len(record.node_ids))
    f.longest_stall_s, at = longest_stall(times, t0, t1)
    f.longest_stall_at = at - t0
    for p in sorted({p for _, p, _ in record.commits}):
        f.pipeline_stall_s[str(p)] = longest_stall([t for t, q, _ in record.commits if q == p], t0, t1)[0]
    missing, skipped = ledger_holes(record.ledger)
    f.missing, f.skipped = {str(p): m for p, m in missing.items()}, {str(p): s for p, s in skipped.items()}
    f.rewritten, f.vanished = len(record.rewritten), len(record.vanished)
    f.samples_twice = samples_twice(record.ledger)
    starts = fault_starts(record)
    tokens_per_step = record.settings["batch_size"] * record.settings["micro_batches"] * record.settings["seq_len"]
    if baseline is not None and baseline.t_end > baseline.t0:
        f.baseline_tokens_per_s, f.full_speed_from = tokens_per_s(baseline), "the fault-free run"
        full = f.baseline_tokens_per_s / tokens_per_step
    elif starts and starts[0][2] - t0 >= window:
        full = (bisect_left(times, starts[0][2]) - bisect_left(times, t0)) / (starts[0][2] - t0)
        f.full_speed_from = "this run before its first fault"
    else:
        full = None
    f.full_tokens_per_s = full * tokens_per_step if full else None
    for index, kind, t, label in starts:
        seconds = time_to_full_speed(times, t, full, window, t1) if full else None
        f.recoveries.append({"index": index, "kind": kind, "label": label, "at": t - t0, "seconds": seconds})
    f.after_last_s = f.recoveries[-1]["seconds"] if f.recoveries else None
    minutes = max(f.minutes, 1e-9)
    marks = Counter(mark for t, _, mark in record.log_marks if t0 <= t <= t1)
    f.regroups_per_min, f.rollbacks_per_min = marks["regroup"] / minutes, marks["rollback"] / minutes
    f.errors = marks["error"]
    f.replicas = {stage: row.get("diff") for stage, row in record.replicas.items()}
    f.applied = dict(Counter(kind for _, kind, _, _ in starts))
    f.failed = [f"fault {e['fault']} ({e['kind']}): {e['action']} {e['detail']}".strip() for e in record.events
                if e["action"] in FAILED_ACTIONS]
    return f


def median_recovery(f: Figures) -> tuple[float | None, float | None, int]:
    """(median, largest) time to full speed of the faults that got there, and how many never did."""
    done = [r["seconds"] for r in f.recoveries if r["seconds"] is not None]
    never = len(f.recoveries) - len(done)
    return (statistics.median(done) if done else None), (max(done) if done else None), never


def _daemons(settings: dict) -> int:
    return settings["pipelines"] * settings["stages"] + settings["standbys"]
