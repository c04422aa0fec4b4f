"""`tahnode bench soak`: a local swarm (coordinator, one node per stage and a standby) trains for
--minutes while the resident memory and open file descriptors of every process are sampled from
/proc; the growth after warm-up per process goes into docs/benchmarks-log.md with a plot."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .bench_report import pyplot_for, markdown_table, write_section
from .interrupt import interruptible
from .swarm import LocalSwarm, Shaper, SwarmError, SwarmSpec

__all__ = ["Sample", "ProcessSeries", "main"]

COLUMNS = ("process", "RSS MB after warm-up", "RSS MB at the end", "RSS growth", "open fds after warm-up",
           "open fds at the end", "fd growth")


@dataclass
class Sample:
    t: float      # seconds since the swarm was up
    rss_mb: float
    fds: int


@dataclass
class ProcessSeries:
    """One process's samples; growth compares the mean of the first `n` samples after warm-up
    with the mean of the last `n`."""

    name: str
    samples: list[Sample] = field(default_factory=list)

    def after(self, warmup_s: float) -> list[Sample]:
        return [s for s in self.samples if s.t >= warmup_s]

    def growth(self, warmup_s: float, what: str, n: int = 3) -> tuple[float, float, float]:
        kept = self.after(warmup_s)
        if len(kept) < 2 * n:
            return 0.0, 0.0, 0.0
        start = sum(getattr(s, what) for s in kept[:n]) / n
        end = sum(getattr(s, what) for s in kept[-n:]) / n
        return start, end, (end - start) / start if start else 0.0


def sample(pid: int) -> tuple[float, int] | None:
    """(resident MB, open fds) of a live process, or None if it is gone."""
    try:
        rss_kb = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
        return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tahnode bench soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="how long the swarm trains (default 30)")
    ap.add_argument("--warmup-minutes", type=float, default=3.0, help="growth is measured from here on (default 3)")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between samples (default 10)")
    ap.add_argument("--stages", type=int, default=3, help="stages (default 3), one node each, plus --standbys")
    ap.add_argument("--standbys", type=int, default=1, help="spare nodes that wait as standbys (default 1)")
    ap.add_argument("--model", default="llama-tiny", help="model preset or TOML (default llama-tiny)")
    ap.add_argument("--bandwidth", default="0", help="link rate in Mbit/s, userspace-shaped (default 0: unshaped)")
    ap.add_argument("--doc", default="docs/benchmarks-log.md",
                    help="where the report goes (default docs/benchmarks-log.md)")
    ap.add_argument("--name", default="soak", help="the doc section and plot name (default soak)")
    ap.add_argument("--plots", default="docs/plots", help="where the PNG plot goes (default docs/plots)")
    ap.add_argument("--workdir", default="bench-soak", help="logs of the swarm (default bench-soak)")
    ap.add_argument("--prefix", default="tnk-", help="name prefix of the swarm (default tnk-)")
    ap.add_argument("--json", action="store_true", help="print the samples as one JSON object on the last line")
    return ap


def run_soak(args) -> tuple[list[ProcessSeries], dict]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    spec = SwarmSpec(nodes=args.stages + args.standbys, stages=args.stages, bandwidth_bps=float(args.bandwidth) * 1e6,
                     shaper=Shaper.USERSPACE, prefix=args.prefix, workdir=Path(args.workdir),
                     run_flags=["--model", args.model, "--steps", str(10**9), "--checkpoint-every", "50"])
    swarm = LocalSwarm.up(spec)
    series = {name: ProcessSeries(name) for name in swarm.pids}
    start, total = time.monotonic(), args.minutes * 60
    state: dict = {}
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn()) as bar:
            task = bar.add_task("soak", total=total)
            while (now := time.monotonic() - start) < total:
                for name, pid in swarm.pids.items():
                    got = sample(pid)
                    if got is not None:
                        series[name].samples.append(Sample(now, *got))
                failed = swarm.exited()
                if failed:
                    raise SwarmError(f"{', '.join(failed)} exited with an error; logs in {spec.workdir / 'logs'}")
                state = swarm.state() or state
                step = state.get("training", {}).get("step", 0)
                bar.update(task, completed=now, description=f"soak: step {step}")
                time.sleep(args.every)
    finally:
        LocalSwarm.down(spec.prefix, spec.workdir)
    return list(series.values()), state


def report(series: list[ProcessSeries], state: dict, args, command: str) -> str:
    warmup = args.warmup_minutes * 60
    rows = []
    for s in series:
        r0, r1, rg = s.growth(warmup, "rss_mb")
        f0, f1, fg = s.growth(warmup, "fds")
        rows.append([s.name, f"{r0:,.0f}", f"{r1:,.0f}", f"{100 * rg:+.1f}%", f"{f0:.0f}", f"{f1:.0f}",
                     f"{100 * fg:+.1f}%"])
    text = markdown_table(COLUMNS, rows)
    plt = pyplot_for(Path(args.plots) / "soak.png")
    fig, (ax_rss, ax_fd) = plt.subplots(1, 2, figsize=(11, 4))
    for s in series:
        ax_rss.plot([x.t / 60 for x in s.samples], [x.rss_mb for x in s.samples], label=s.name)
        ax_fd.plot([x.t / 60 for x in s.samples], [x.fds for x in s.samples], label=s.name)
    for ax, what in ((ax_rss, "resident memory (MB)"), (ax_fd, "open file descriptors")):
        ax.axvline(args.warmup_minutes, color="grey", linestyle=":")
        ax.set_xlabel("minutes")
        ax.set_ylabel(what)
        ax.legend(fontsize=8)
    fig.tight_layout()
    plot = Path(args.plots) / f"{args.name}.png"
    fig.savefig(plot, dpi=110)
    plt.close(fig)
    t = state.get("training", {})
    write_section(Path(args.doc), args.name, "Soak: memory and file descriptors over a long run", [
        text, "", f"Model: {args.model}; {args.stages} stages and {args.standbys} standby on 127.0.0.1, "
        f"{args.minutes:g} minutes, sampled every {args.every:g} s; growth from the mean of the first three samples "
        f"after {args.warmup_minutes:g} minutes of warm-up to the mean of the last three. Steps trained: "
        f"{t.get('step', 0)}.",
        "", f"Command: `{command}`"], [plot])
    return text


@interruptible("tahnode bench soak")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.minutes <= args.warmup_minutes:
        print("tahnode bench soak: --minutes must be longer than --warmup-minutes", file=sys.stderr)
        return 2
    try:
        series, state = run_soak(args)
    except SwarmError as exc:
        print(f"tahnode bench soak: {exc}", file=sys.stderr)
        return 1
    command = ("tahnode bench soak " + " ".join(sys.argv[3:] if argv is None else argv)).strip()
    print(report(series, state, args, command))
    print(f"written to {args.doc}; plot in {args.plots}")
    if args.json:
        print(json.dumps([asdict(s) for s in series]))
    return 0
