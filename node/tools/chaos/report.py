"""How `tahnode bench chaos` reports: a table row per run (kept in the bench's work folder, so that the
rows of several runs make one table), the run's timeline plot (committed steps of each pipeline over
time, faults as vertical lines of their kind's colour, the swarm's tokens/s against full speed), and
the doc section in docs/benchmarks-log.md through tahnode.tools.bench_report."""

from __future__ import annotations

import json
from pathlib import Path

from ..bench_report import markdown_table, pyplot_for, save_figure, write_section
from .faults import FaultKind
from .figures import FULL_SPEED_SHARE, Figures, fault_starts, median_recovery, rate_series
from .record import RunRecord

__all__ = ["COLUMNS", "row_cells", "details", "plot_timeline", "write_report", "METHOD"]

COLUMNS = ("run", "faults", "minutes", "tokens/s", "vs fault-free", "longest stall s", "to full speed s: median / max",
           "after the last fault s", "steps missing", "ledger entries changed / gone", "samples twice",
           "replicas' largest difference", "regroups / min", "node ids / daemons")
KIND_COLOURS = {FaultKind.KILL.value: "tab:red", FaultKind.STOP.value: "tab:orange", FaultKind.CUT.value: "tab:purple",
                FaultKind.COORDINATOR.value: "black", FaultKind.OVERLAP.value: "magenta", "crash": "grey"}
PIPELINE_COLOURS = ("tab:blue", "tab:green", "tab:cyan", "tab:olive", "tab:brown", "tab:pink")
GAP_S = 5.0  # polls further apart than this (the coordinator was down) break the status line

METHOD = (
    "How: a coordinator (`--pipelines P --standbys N`) and P×S+N `tahnode join --stage auto` daemons, each with "
    "its own --checkpoint-dir, on one machine; the seeded schedule starts once every pipeline trained its warm-up "
    "steps. A step counts when it first appears in the coordinator's /api/v1/ledger (polled every second). "
    "tokens/s: tokens of the steps the final ledger holds that appeared during the measurement, over its length; "
    "vs fault-free: against a run of the same settings without faults. Longest stall: the longest stretch in "
    "which no pipeline committed a step. To full speed: from a fault's first action to the first step that opens "
    f"a window (--window) in which the swarm commits {FULL_SPEED_SHARE:.0%} of full speed (the fault-free run's "
    "rate; without one, this run's before its first fault); never: no such window before the end. Steps missing: "
    "between a pipeline's first and last step in the final ledger (skipped steps the ledger marks are listed "
    "apart); changed / gone: entries whose loss or samples changed after they appeared, or that left the ledger. "
    "Samples twice: sample ids in two trained steps of one pipeline. Replicas: the largest difference between the "
    "outer weights (`outer/anchor`) of each stage's replicas in the checkpoint of the step every pipeline drained to "
    "(without a drain: the newest step they all saved); a daemon's save at SIGTERM, after its averager ended, is "
    "not compared. Regroups: stage 0's log lines that start a regroup of its "
    "pipeline. Node ids: how many the status page listed over the run, against the daemons started.")


def _num(x: float | None, fmt: str = "{:.0f}") -> str:
    return "—" if x is None else fmt.format(x)


def row_cells(name: str, record: RunRecord, f: Figures) -> list[str]:
    """The table row of one run."""
    med, worst, never = median_recovery(f)
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(f.applied.items())) or "none"
    every = record.plan.get("every") if record.schedule else None
    missing = sum(len(m) for m in f.missing.values())
    replicas = "; ".join(f"s{s} {_num(d, '{:.1e}')}" for s, d in sorted(f.replicas.items())) or "—"
    recovery = f"{_num(med)} / {_num(worst)}" + (f" ({never} never)" if never else "")
    return [name, kinds + (f", every {every:g} s" if every else ""), f"{f.minutes:.1f}", f"{f.tokens_per_s:,.0f}",
            _num(f.share, "{:.0%}"), f"{f.longest_stall_s:.0f}", recovery,
            "never" if f.recoveries and f.after_last_s is None else _num(f.after_last_s),
            str(missing) + (f" (+{sum(len(s) for s in f.skipped.values())} skipped)" if f.skipped else ""),
            f"{f.rewritten} / {f.vanished}", str(f.samples_twice), replicas, f"{f.regroups_per_min:.1f}",
            f"{f.node_ids} / {f.daemons}"]


def details(name: str, record: RunRecord, f: Figures) -> list[str]:
    """What the table cannot hold: the steps missing, the faults that failed, the drain, an error."""
    out = []
    for p, steps in sorted(f.missing.items()):
        out.append(f"pipeline {p} lacks steps {_ranges(steps)}")
    for p, steps in sorted(f.skipped.items()):
        out.append(f"pipeline {p} skipped steps {_ranges(steps)}")
    out += f.failed[:10]
    if record.drain and not record.drain.get("reached"):
        out.append(f"drain: the pipelines (steps {record.drain.get('steps')}) did not all reach step "
                   f"{record.drain.get('target')}")
    out += [f"stage {s}: {row['note']}" for s, row in sorted(record.replicas.items()) if row.get("note")]
    if f.errors:
        out.append(f"{f.errors} ERROR lines in the daemons' logs during the measurement")
    if record.error:
        out.append(f"error: {record.error}")
    return [f"{name}: {line}" for line in out]


def _ranges(steps: list[int]) -> str:
    parts, start = [], None
    for k, s in enumerate(steps):
        start = s if start is None else start
        if k + 1 == len(steps) or steps[k + 1] != s + 1:
            parts.append(f"{start}" if start == s else f"{start}–{s}")
            start = None
    return ", ".join(parts)


def plot_timeline(record: RunRecord, f: Figures, window: float, out: Path) -> Path:
    """Committed steps of each pipeline over time (dots; a thin line: the step its status shows, which
    goes back when it regroups or rolls back), gone entries crossed, faults as vertical lines;
    below, the swarm's tokens/s over the window against full speed."""
    plt = pyplot_for(out)
    fig, (ax, ax_rate) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    t0 = record.t0
    for p in sorted({p for _, p, _ in record.commits}):
        colour = PIPELINE_COLOURS[p % len(PIPELINE_COLOURS)]
        pts = [(t - t0, s) for t, q, s in record.commits if q == p]
        ax.plot([x / 60 for x, _ in pts], [s for _, s in pts], ".", ms=2.5, color=colour, label=f"pipeline {p}")
        xs, ys = _status_line(record, p)
        ax.plot(xs, ys, "-", drawstyle="steps-post", lw=0.6, alpha=0.6, color=colour,
                label="its step on the status page" if p == 0 else None)
    if record.vanished:
        ax.plot([(t - t0) / 60 for t, _, _ in record.vanished], [s for _, _, s in record.vanished], "x",
                color="red", ms=4, label="gone from the ledger")
    shown = set()
    for _, kind, t, _ in fault_starts(record):
        for a in (ax, ax_rate):
            a.axvline((t - t0) / 60, color=KIND_COLOURS.get(kind, "grey"), lw=0.8, alpha=0.6,
                      label=kind if a is ax and kind not in shown else None)
        shown.add(kind)
    for e in record.events:
        if e["kind"] == "crash":
            ax.axvline((e["t"] - t0) / 60, color=KIND_COLOURS["crash"], ls="--", lw=0.8,
                       label="crash" if "crash" not in shown else None)
            shown.add("crash")
    ax.axvline((record.t_end - t0) / 60, color="grey", ls=":", lw=1)
    ax.set(ylabel="committed step", title=f"{f.minutes:.1f} min, {sum(f.applied.values())} faults")
    tokens_per_step = record.settings["batch_size"] * record.settings["micro_batches"] * record.settings["seq_len"]
    times = sorted(t for t, _, _ in record.commits)
    series = rate_series(times, t0, record.t_end, window, tokens_per_step)
    ax_rate.plot([x / 60 for x, _ in series], [y for _, y in series], color="C0", label=f"tokens/s over {window:g} s")
    if f.full_tokens_per_s:
        ax_rate.axhline(f.full_tokens_per_s, color="C2", ls="--", label=f"full speed ({f.full_speed_from})")
        ax_rate.axhline(FULL_SPEED_SHARE * f.full_tokens_per_s, color="C2", ls=":", lw=0.8,
                        label=f"{FULL_SPEED_SHARE:.0%} of it")
    ax_rate.set(xlabel="minutes since the measurement started", ylabel="tokens/s")
    return save_figure(plt, fig, [ax, ax_rate], out, legend_size=7)


def _status_line(record: RunRecord, pipeline: int) -> tuple[list[float], list[float]]:
    """(minutes, step) of a pipeline's step on the status page, broken (NaN) where polls got no answer."""
    xs, ys, last = [], [], None
    for t, steps in record.steps:
        if steps.get(str(pipeline)) is None:
            continue
        if last is not None and t - last > GAP_S:
            xs.append(float("nan"))
            ys.append(float("nan"))
        xs.append((t - record.t0) / 60)
        ys.append(steps[str(pipeline)])
        last = t
    return xs, ys


def write_report(rows_file: Path, section: str, name: str, cells: list[str], notes: list[str], command: str,
                 plot: Path, doc: Path | None) -> str:
    """Keep this run's row beside the section's other rows (rows_file), and write the section with
    every row, their notes and commands, and their plots (doc None: only the table is returned)."""
    rows = json.loads(rows_file.read_text()) if rows_file.exists() else {}
    mine = rows.setdefault(section, {})
    mine[name] = {"cells": cells, "notes": notes, "command": command, "plot": str(plot)}
    rows_file.parent.mkdir(parents=True, exist_ok=True)
    rows_file.write_text(json.dumps(rows, indent=1))
    table = markdown_table(COLUMNS, [r["cells"] for r in mine.values()])
    if doc is not None:
        body = [table, "", METHOD, ""]
        for row_name, r in mine.items():
            body += [f"- `{row_name}`: `{r['command']}`" + "".join(f"; {n.split(': ', 1)[1]}" for n in r["notes"])]
        plots = [Path(r["plot"]) for r in mine.values() if Path(r["plot"]).exists()]
        write_section(doc, section, "Chaos: training while volunteers fail", body, plots)
    return table
