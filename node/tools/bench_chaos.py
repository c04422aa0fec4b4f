"""`tahnode bench chaos`: a swarm of real daemons (P pipelines of S stages and N standbys, on 127.0.0.1
or in network namespaces) trains while a seeded schedule kills, stops and cuts off its volunteers and
its coordinator; the report says what that cost: tokens/s against the same run without faults, the
time from each fault to full speed, the longest stall, whether every (pipeline, step) is in the ledger
once, the replicas' difference per stage at the end, regroups per minute, and a timeline plot.

Every run keeps its raw record (faults with their times, ledger, placements, log marks) as JSON in
WORKDIR/NAME/chaos.json beside the daemons' logs; `--from` makes the report again from one."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shlex
import sys
from dataclasses import asdict, replace
from pathlib import Path

from .chaos.faults import ChaosError, FaultTimes, ScheduleConfig, parse_faults, schedule
from .chaos.figures import figures
from .chaos.record import RunRecord
from .chaos.report import details, plot_timeline, row_cells, write_report
from .chaos.run import MeasureSettings, SwarmSettings, run_chaos
from .chaos.daemons import ChaosSwarm
from .interrupt import interruptible
from .swarm import Shaper

__all__ = ["build_parser", "configure", "main", "baseline_path"]

NETS = {"loopback": Shaper.USERSPACE, "netns": Shaper.TC}


class _WithDefaults(argparse.HelpFormatter):
    """Each flag's help ends with its default, where it has one worth saying."""

    def _get_help_string(self, action):
        if action.nargs == 0 or action.default in (None, "", argparse.SUPPRESS):
            return action.help
        return f"{action.help} (default %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tahnode bench chaos", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n")[1], formatter_class=_WithDefaults)
    sw = ap.add_argument_group("the swarm (a fault-free run of the same settings is the baseline)")
    sw.add_argument("--pipelines", type=int, default=2, help="pipelines that train in data parallel (P)")
    sw.add_argument("--stages", type=int, default=3, help="stages of each pipeline (S)")
    sw.add_argument("--standbys", type=int, default=1, help="spare daemons that take over a failed stage (N)")
    sw.add_argument("--model", default="llama-tiny", help="model preset or TOML")
    sw.add_argument("--seq-len", type=int, default=64, help="tokens per sample")
    sw.add_argument("--batch-size", type=int, default=4, help="samples per micro-batch")
    sw.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    sw.add_argument("--outer-every", type=int, default=4, help="steps between the replicas' outer steps")
    sw.add_argument("--checkpoint-every", type=int, default=20, help="steps between a stage's checkpoints")
    sw.add_argument("--codec", default="none", help="forward codec (none: cheapest on CPU)")
    sw.add_argument("--backward-codec", default="none", help="backward codec")
    sw.add_argument("--heartbeat-timeout", type=float, default=10.0,
                    help="seconds without heartbeats before the coordinator declares a daemon failed")
    sw.add_argument("--net", choices=sorted(NETS), default="loopback",
                    help="loopback: every process on 127.0.0.1; netns: each in a network namespace (root)")
    sw.add_argument("--node-ids", action="store_true",
                    help="give each daemon --node-id nK; by default a daemon picks its own id, as a volunteer's does")
    sw.add_argument("--coordinator-args", default="", metavar="'FLAGS'",
                    help="more coordinator flags, as one quoted string (e.g. '--min-chain-share 0')")
    fl = ap.add_argument_group("the faults")
    fl.add_argument("--faults", default="kill",
                    help="kinds drawn from, comma-separated: kill (SIGKILL a daemon, restart it with its folder), "
                    "stop (SIGSTOP, SIGCONT later), cut (drop its packets; nft on loopback), coordinator (SIGKILL "
                    "and restart the coordinator on its store), overlap (kill a stage's holder, then whoever took "
                    "the stage over, while it resumes)")
    fl.add_argument("--every", type=float, default=30.0, help="seconds between faults")
    fl.add_argument("--seed", type=int, default=0, help="seed of the schedule (kinds and targets)")
    fl.add_argument("--tail", type=float, default=60.0, help="no fault in the last this many seconds")
    fl.add_argument("--restart-after", type=float, default=8.0, help="seconds a killed daemon stays down")
    fl.add_argument("--stop-seconds", type=float, default=0.0,
                    help="seconds a stopped daemon stays stopped (0: the heartbeat timeout + 5)")
    fl.add_argument("--cut-seconds", type=float, default=0.0, help="seconds a cut lasts (0: the heartbeat timeout + 5)")
    fl.add_argument("--coordinator-down", type=float, default=5.0, help="seconds the killed coordinator stays down")
    fl.add_argument("--overlap-delay", type=float, default=3.0,
                    help="overlap: seconds after the takeover at which the replacement is killed")
    fl.add_argument("--takeover-timeout", type=float, default=90.0,
                    help="overlap: how long to wait for someone to take the stage over")
    fl.add_argument("--plan", action="store_true", help="print the schedule and exit (nothing is started)")
    ms = ap.add_argument_group("the measurement")
    ms.add_argument("--minutes", type=float, default=10.0, help="minutes measured, from the end of the warm-up")
    ms.add_argument("--warmup-steps", type=int, default=5, help="every pipeline trains this many steps first")
    ms.add_argument("--form-timeout", type=float, default=600.0,
                    help="seconds for the daemons to join and the pipelines to form and warm up")
    ms.add_argument("--poll", type=float, default=1.0, help="seconds between polls of the coordinator")
    ms.add_argument("--drain", type=float, default=120.0,
                    help="seconds after the end for every pipeline to reach a common checkpoint step")
    ms.add_argument("--window", type=float, default=20.0, help="seconds of the window that tells full speed")
    ms.add_argument("--baseline", action="store_true",
                    help="first run the same swarm without faults (saved in WORKDIR, reused by later runs "
                    "of the same swarm settings)")
    ms.add_argument("--baseline-minutes", type=float, default=0.0, help="minutes of that run (0: --minutes)")
    ms.add_argument("--baseline-from", metavar="JSON", help="the fault-free run to compare with (a saved record)")
    out = ap.add_argument_group("the report")
    out.add_argument("--name", default="", help="the run's row and plot (default chaos-FAULTS-EVERY)")
    out.add_argument("--section", default="chaos", help="the doc section the rows share")
    out.add_argument("--doc", default="docs/benchmarks-log.md", help="where the table and plots go")
    out.add_argument("--plots", default="docs/plots", help="folder of the PNG plots")
    out.add_argument("--no-doc", action="store_true", help="print the report only (the plot still goes to --plots)")
    out.add_argument("--workdir", default="bench-chaos", help="raw records, baselines, rows, daemons' folders and logs")
    out.add_argument("--prefix", default="tcz-", help="name prefix of the swarm's processes and namespaces")
    out.add_argument("--from", dest="from_json", metavar="JSON", help="make the report again from a saved chaos.json")
    out.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    return ap


def configure(args) -> tuple[SwarmSettings, MeasureSettings, FaultTimes, ScheduleConfig]:
    """The settings of a run from the flags; ChaosError says which flag is wrong."""
    for flag in ("pipelines", "stages", "seq_len", "batch_size", "micro_batches", "outer_every", "checkpoint_every"):
        if getattr(args, flag) < 1:
            raise ChaosError(f"--{flag.replace('_', '-')} must be 1 or more; got {getattr(args, flag)}")
    for flag in ("standbys", "warmup_steps"):
        if getattr(args, flag) < 0:
            raise ChaosError(f"--{flag.replace('_', '-')} must be 0 or more; got {getattr(args, flag)}")
    for flag in ("heartbeat_timeout", "form_timeout", "poll", "window"):
        if not getattr(args, flag) > 0:
            raise ChaosError(f"--{flag.replace('_', '-')} must be more than 0; got {getattr(args, flag):g}")
    if args.drain < 0 or args.baseline_minutes < 0:
        raise ChaosError("--drain and --baseline-minutes take 0 or more")
    if args.name and not re.fullmatch(r"[A-Za-z0-9_.-]+", args.name):
        raise ChaosError(f"--name takes letters, digits, '.', '_' and '-'; got {args.name!r}")
    try:
        extra = tuple(shlex.split(args.coordinator_args))
    except ValueError as exc:
        raise ChaosError(f"--coordinator-args: {exc}") from None
    settings = SwarmSettings(args.pipelines, args.stages, args.standbys, args.model, args.seq_len, args.batch_size,
                             args.micro_batches, args.outer_every, args.checkpoint_every, args.codec,
                             args.backward_codec, args.heartbeat_timeout, NETS[args.net].value, args.node_ids, extra)
    measure = MeasureSettings(args.minutes, args.warmup_steps, args.form_timeout, args.poll, args.drain)
    after = args.heartbeat_timeout + 5
    times = FaultTimes(args.restart_after, args.stop_seconds or after, args.cut_seconds or after,
                       args.coordinator_down, args.overlap_delay, args.takeover_timeout)
    names = tuple(f"n{k}" for k in range(1, settings.daemons + 1))
    plan = ScheduleConfig(names, args.pipelines, args.stages, args.seed, args.every, args.minutes, args.tail,
                          parse_faults(args.faults), times)
    return settings, measure, times, plan


def baseline_path(workdir: Path, settings: SwarmSettings) -> Path:
    """Where the fault-free run of these swarm settings is kept."""
    key = hashlib.sha1(json.dumps(asdict(settings), sort_keys=True).encode()).hexdigest()[:10]
    return Path(workdir) / f"baseline-{key}.json"


def _progress():
    """A line on stderr every minute of the measurement: its time, each pipeline's step, the faults so far."""
    last = [-60.0]

    def say(elapsed: float, state: dict | None, faults: int) -> None:
        if elapsed - last[0] < 60:
            return
        last[0] = elapsed
        steps = ", ".join(f"p{p['index']} {p['step']}" for p in (state or {}).get("pipelines", []))
        print(f"chaos: {elapsed / 60:.0f} min, steps {steps or '?'}, {faults} faults so far", file=sys.stderr)
    return say


def _baseline(args, settings, measure, times) -> RunRecord | None:
    """The fault-free record to compare with: run now (--baseline), given (--baseline-from), or saved
    earlier in WORKDIR for the same swarm settings; None if there is none."""
    path = baseline_path(Path(args.workdir), settings)
    if args.baseline_from:
        return RunRecord.load(Path(args.baseline_from))
    if args.baseline:
        print(f"baseline: the same swarm without faults for {args.baseline_minutes or args.minutes:g} min",
              file=sys.stderr)
        record = run_chaos(settings, replace(measure, minutes=args.baseline_minutes or args.minutes), [], times,
                           Path(args.workdir) / "baseline", args.prefix, {"faults": "none"}, _progress(), path)
        if record.error or record.t_end <= record.t0:
            raise ChaosError(f"the fault-free run failed: {record.error}")
        return record
    if path.exists():
        print(f"baseline: reusing {path}", file=sys.stderr)
        return RunRecord.load(path)
    return None


def report(args, record: RunRecord, baseline: RunRecord | None, name: str, command: str) -> tuple[str, object]:
    f = figures(record, baseline, args.window)
    plot = plot_timeline(record, f, args.window, Path(args.plots) / f"{name}.png")
    notes = details(name, record, f)
    table = write_report(Path(args.workdir) / "rows.json", args.section, name, row_cells(name, record, f), notes,
                         command, plot, None if args.no_doc else Path(args.doc))
    return "\n".join([table, *notes, f"plot: {plot}"]), f


@interruptible("tahnode bench chaos")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = ("tahnode bench chaos " + " ".join(map(shlex.quote, sys.argv[3:] if argv is None else argv))).strip()
    try:
        settings, measure, times, plan = configure(args)
        name = args.name or f"chaos-{args.faults.replace(',', '-')}-{args.every:g}s"
        if args.from_json:
            record = RunRecord.load(Path(args.from_json))
            saved = baseline_path(Path(args.workdir), SwarmSettings.from_json(record.settings))
            baseline = (RunRecord.load(Path(args.baseline_from)) if args.baseline_from
                        else RunRecord.load(saved) if saved.exists() else None)
            text, f = report(args, record, baseline, name, command)
            return _printed(text, f, args)
        faults = schedule(plan)
        if args.plan:
            print("\n".join(f"{f.at:7.1f} s  {f.label}  ({f.seconds:g} s)" for f in faults))
            return 0
        lack = ChaosSwarm.needs(Shaper(settings.net), "cut" in args.faults)
        if lack:
            raise ChaosError(lack)
        baseline = _baseline(args, settings, measure, times)
    except (ChaosError, OSError, ValueError, KeyError) as exc:
        print(f"tahnode bench chaos: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(args.workdir) / name
    print(f"chaos: {len(faults)} faults over {args.minutes:g} min; raw record in {run_dir / 'chaos.json'}",
          file=sys.stderr)
    record = run_chaos(settings, measure, faults, times, run_dir, args.prefix,
                       {"seed": args.seed, "every": args.every, "faults": args.faults, "tail": args.tail}, _progress(),
                       run_dir / "chaos.json")
    if record.t_end <= record.t0:
        print(f"tahnode bench chaos: no measurement: {record.error}; record in {run_dir / 'chaos.json'}",
              file=sys.stderr)
        return 1
    text, f = report(args, record, baseline, name, command)
    return _printed(text, f, args)


def _printed(text: str, f, args) -> int:
    print(text)
    if not args.no_doc:
        print(f"written to {args.doc}")
    if args.json:
        print(json.dumps(asdict(f)))
    return 0
