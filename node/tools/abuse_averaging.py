"""`tahnode bench abuse --averaging`: can one lying replica of a stage do more than take away its partner's help?
A real two-pipeline swarm (`tahnode coordinator --pipelines 2`, 2 x S daemons pinned to their stages on
127.0.0.1) trains --outer-steps outer steps while pipeline 1's stage-1 replica lies at every one of them
(tahnode.tools.averaging_liar: -9 times its pseudo-gradient, 1e-9 times it, zeros, or random of its norm);
the same swarm with no liar and one pipeline trained alone in-process on pipeline 0's samples (the same run)
are the references. Per lie: the honest pipeline's held-out loss at the end (its last stage checkpoints) against
one pipeline alone (the bar: at most 1% above) and against two honest pipelines; whether and at which outer step
the honest stage-1 replica excluded the liar and reported it to the coordinator; the ids the coordinator banned
(none of them honest); the honest replicas' outer-step figures. Table into docs/benchmarks-log.md."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .abuse_averaging_swarm import HONEST, LIAR, LIAR_STAGE, Setup, SwarmOutcome, node_name, run_swarm
from .averaging_liar import Lie
from .bench_coordinator import BenchError
from .bench_report import markdown_table, write_section

__all__ = ["main", "build_parser", "Row", "row_of", "cells", "BAR", "COLUMNS"]

BAR = 1.0  # percent: the honest pipeline's held-out loss at most this far above one pipeline alone's
COLUMNS = ("run", "held-out loss", "vs one pipeline alone", f"≤ +{BAR:g}%", "vs two honest pipelines",
           "liar excluded by its honest replica", "reported", "honest ids banned", "other exclusions",
           "honest outer steps by stage: grouped / alone / refused", "stage-1 averaging s", "wall min")


@dataclass
class Row:
    """One line of the table: a swarm (or the in-process reference, `swarm` False)."""

    run: str
    heldout: float
    vs_alone: float | None = None       # percent above one pipeline alone's held-out loss
    vs_pair: float | None = None        # percent above two honest pipelines'
    swarm: bool = True
    liar: bool = False
    excluded_at: int | None = None      # the outer step at which the honest stage-1 replica excluded the liar
    offence: str = ""
    reported: bool = False
    honest_banned: list[str] = field(default_factory=list)
    others: list[str] = field(default_factory=list)  # exclusions by other honest replicas, or of others
    outer: list[dict] = field(default_factory=list)  # the honest replicas' outer-step figures, stage by stage
    minutes: float = 0.0
    lies: int = 0
    first_period: float | None = None   # max |loss difference| to one pipeline alone before the first outer step

    @property
    def within_bar(self) -> bool:
        return self.vs_alone is not None and self.vs_alone <= BAR


def _percent(value: float, reference: float | None) -> float | None:
    return 100 * (value / reference - 1) if reference else None


def row_of(outcome: SwarmOutcome, heldout: float, alone, pair: float | None, outer_every: int) -> Row:
    """The row of a swarm's outcome, its held-out loss, one pipeline alone's result (tahnode.tools.
    abuse_averaging_eval.Alone) and two honest pipelines' held-out loss (None: not run)."""
    liar = outcome.lie != "none"
    judge = node_name(HONEST, LIAR_STAGE, Lie(outcome.lie) if liar else None)
    caught = next((e for e in outcome.excluded if e.by == judge), None) if liar else None
    first = [abs(a - b) for a, b in zip(outcome.losses[:outer_every], alone.losses[:outer_every])]
    return Row(f"liar {outcome.lie}" if liar else "two honest pipelines", heldout, _percent(heldout, alone.heldout),
               _percent(heldout, pair), liar=liar, excluded_at=caught.round if caught else None,
               offence=caught.offence if caught else "", reported=outcome.reported,
               honest_banned=[b for b in outcome.banned if b != LIAR],
               others=[str(e) for e in outcome.excluded if e is not caught], outer=[dict(o) for o in outcome.outer],
               minutes=outcome.seconds / 60, lies=outcome.lies, first_period=max(first) if first else None)


def alone_row(alone) -> Row:
    return Row("one pipeline alone (in-process)", alone.heldout, swarm=False, minutes=alone.seconds / 60)


def _signed(value: float | None) -> str:
    return "—" if value is None else f"{value:+.2f}%"


def cells(r: Row) -> list[str]:
    if not r.swarm:
        return [r.run, f"{r.heldout:.4f}"] + ["—"] * (len(COLUMNS) - 3) + [f"{r.minutes:.1f}"]
    outer = ", ".join(f"s{k} {o.get('steps', 0):.0f} / {o.get('alone', 0):.0f} / {o.get('refused', 0):.0f}"
                      for k, o in enumerate(r.outer))
    seconds = r.outer[LIAR_STAGE].get("seconds", 0.0) if len(r.outer) > LIAR_STAGE else 0.0
    excluded = "—"
    if r.liar:
        excluded = f"at outer step {r.excluded_at} ({r.offence})" if r.excluded_at is not None else "no"
    return [r.run, f"{r.heldout:.4f}", _signed(r.vs_alone), ("yes" if r.within_bar else "**no**") if r.liar else "—",
            _signed(r.vs_pair), excluded, ("yes" if r.reported else "no") if r.liar else "—",
            ", ".join(r.honest_banned) or "none", "; ".join(r.others) or "none",
            outer or "—", f"{seconds:.1f}", f"{r.minutes:.1f}"]


def _lies(text: str) -> list[Lie]:
    lies = [Lie.parse(t) for t in text.split(",") if t.strip()]
    if not lies:
        raise ValueError("--lie names at least one lie")
    return list(dict.fromkeys(lies))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tahnode bench abuse --averaging", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Setup()
    ap.add_argument("--lie", default=",".join(k.value for k in Lie), metavar="LIE,...",
                    help="the lies, a swarm each: -9x (-9 times its pseudo-gradient), tiny (1e-9 times it), zeros, "
                         "random (of its norm); default all four (write --lie=-9x: the value starts with '-')")
    ap.add_argument("--outer-steps", type=int, default=d.outer_steps,
                    help=f"outer steps each swarm trains, the liar lying at every one (default {d.outer_steps})")
    ap.add_argument("--outer-every", type=int, default=d.outer_every,
                    help=f"steps between outer steps (default {d.outer_every}); steps = outer steps x this")
    ap.add_argument("--stages", type=int, default=d.stages, help=f"stages of a pipeline, 2 at least (default "
                    f"{d.stages}); the liar holds stage 1")
    ap.add_argument("--model", default=d.model, help=f"model preset (default {d.model})")
    ap.add_argument("--batch-size", type=int, default=d.batch_size,
                    help=f"samples per micro-batch (default {d.batch_size})")
    ap.add_argument("--micro-batches", type=int, default=d.micro_batches,
                    help=f"micro-batches per step (default {d.micro_batches})")
    ap.add_argument("--seq-len", type=int, default=d.seq_len, help=f"tokens per sample (default {d.seq_len})")
    ap.add_argument("--seed", type=int, default=d.seed, help=f"weights and data order, every run (default {d.seed})")
    ap.add_argument("--outer-timeout", type=float, default=d.outer_timeout,
                    help=f"seconds a replica waits for the others at an outer step (default {d.outer_timeout:g})")
    ap.add_argument("--eval-samples", type=int, default=512,
                    help="held-out samples the loss is measured on: the last of the data set no pipeline of the run "
                         "trains on (default 512)")
    ap.add_argument("--swarm-timeout", type=float, default=d.timeout,
                    help=f"seconds a swarm may take to train the honest pipeline (default {d.timeout:g})")
    ap.add_argument("--no-pair", action="store_true",
                    help="leave out the reference swarm of two honest pipelines (its column shows —)")
    ap.add_argument("--workdir", default="",
                    help="keep every swarm's logs and checkpoints here (default: a temporary folder, removed)")
    ap.add_argument("--doc", default="docs/benchmarks-log.md",
                    help="where the table goes (default docs/benchmarks-log.md)")
    ap.add_argument("--name", default="abuse-averaging", help="the doc section's name (default abuse-averaging)")
    ap.add_argument("--no-doc", action="store_true", help="print the table only; leave the doc alone")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    return ap


def _joined(argv: list[str]) -> list[str]:
    """`--lie -9x` as `--lie=-9x` (argparse takes a value that starts with '-' for a flag)."""
    out, k = [], 0
    while k < len(argv):
        if argv[k] == "--lie" and k + 1 < len(argv) and argv[k + 1].startswith("-9"):
            out.append(f"--lie={argv[k + 1]}")
            k += 2
        else:
            out.append(argv[k])
            k += 1
    return out


def parse(argv: list[str]) -> tuple[argparse.Namespace, Setup, list[Lie]]:
    ap = build_parser()
    args = ap.parse_args(_joined(argv))
    try:
        lies = _lies(args.lie)
    except ValueError as exc:
        ap.error(str(exc))
    for name, least in (("outer_steps", 1), ("outer_every", 1), ("stages", 2), ("batch_size", 1),
                        ("micro_batches", 1), ("seq_len", 1), ("eval_samples", 1)):
        if getattr(args, name) < least:
            ap.error(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(args, name)}")
    for name in ("outer_timeout", "swarm_timeout"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(args, name)}")
    return args, Setup(args.model, args.stages, args.outer_steps, args.outer_every, args.batch_size,
                       args.micro_batches, args.seq_len, args.seed, args.outer_timeout, args.swarm_timeout), lies


def say(text: str) -> None:
    print(f"tahnode bench abuse --averaging: {text}", file=sys.stderr, flush=True)


def measure(setup: Setup, lies: list[Lie], args, workdir: Path) -> list[Row]:
    from .abuse_averaging_eval import evaluate_checkpoints, train_alone

    outcomes = [] if args.no_pair else [run_swarm(setup, None, workdir / "pair", say)]
    outcomes += [run_swarm(setup, lie, workdir / f"lie-{lie.name.lower()}", say) for lie in lies]
    losses, runs = [], set()
    for outcome in outcomes:
        run, heldout = evaluate_checkpoints(outcome.checkpoints, args.eval_samples)
        losses.append(heldout)
        runs.add(run.to_json())
        say(f"{outcome.lie}: held-out loss {heldout:.4f} after {outcome.seconds / 60:.1f} min")
    if len(runs) != 1:
        raise BenchError("the swarms trained different run configurations: their figures are not comparable")
    say(f"one pipeline alone, in-process: {setup.steps} steps")
    alone = train_alone(run, args.eval_samples)
    pair = None if args.no_pair else losses[0]
    return [alone_row(alone)] + [row_of(o, h, alone, pair, setup.outer_every) for o, h in zip(outcomes, losses)]


def describe(setup: Setup, args, first: list[float]) -> str:
    """What the table's figures are, for the doc."""
    matched = (f"; its losses before the first outer step match the swarms' pipeline 0 to {max(first):.1e} at most"
               if first else "")
    return (f"Each swarm: `tahnode coordinator --pipelines 2` and {2 * setup.stages} `tahnode join` daemons pinned to "
            f"their stages on 127.0.0.1 ({setup.model}, {setup.stages} stages, {setup.steps} steps = "
            f"{setup.outer_steps} outer steps of {setup.outer_every}, {setup.micro_batches} x {setup.batch_size} "
            f"samples of {setup.seq_len} tokens a step, codecs none/none, seed {setup.seed}, the run's default outer "
            "step). Pipeline 0 is honest; in each liar's swarm pipeline 1's stage-1 replica sends, at every outer "
            "step, -9 times its pseudo-gradient, 1e-9 times it, zeros, or random of its norm "
            "(tahnode.tools.averaging_liar; its own weights take the lie too). Held-out loss: the honest pipeline's "
            "last stage checkpoints (after its last outer step) evaluated in-process on the last "
            f"{args.eval_samples} samples of the data that no pipeline trains on. One pipeline alone: the same run "
            f"trained in-process (tahnode.pipeline.replica) on pipeline 0's samples{matched}. Excluded: the honest "
            "stage-1 replica's log (the outer step at which it excluded the liar, and the offence); reported: its "
            "heartbeats carry the exclusion to the coordinator, which bans only on two operators' reports (with two "
            "pipelines the liar has one witness). Outer steps: each honest replica's (stage s0, s1, ...) outer steps "
            "with a group / alone (the liar excluded, or no replica in time), and the parts and averages it refused; "
            "the seconds the honest stage-1 replica's averaging took in all.")


def report(rows: list[Row], setup: Setup, args, command: str) -> str:
    text = markdown_table(COLUMNS, [cells(r) for r in rows])
    first = [r.first_period for r in rows if r.first_period is not None]
    if not args.no_doc:
        write_section(Path(args.doc), args.name, "A lying replica on the averaging plane",
                      [text, "", describe(setup, args, first), "", f"Command: `{command}`"], [])
    return text


def main(argv: list[str] | None = None) -> int:
    """`argv`: the flags after `tahnode bench abuse --averaging`."""
    argv = [a for a in sys.argv[3:] if a != "--averaging"] if argv is None else list(argv)
    args, setup, lies = parse(argv)
    try:
        if args.workdir:
            rows = measure(setup, lies, args, Path(args.workdir))
        else:
            with tempfile.TemporaryDirectory(prefix="tahnode-abuse-averaging-") as tmp:
                rows = measure(setup, lies, args, Path(tmp))
    except BenchError as exc:
        print(f"tahnode bench abuse --averaging: {exc}", file=sys.stderr)
        return 1
    command = " ".join(["tahnode bench abuse --averaging", *argv]).strip()
    text = report(rows, setup, args, command)
    first = [r.first_period for r in rows if r.first_period is not None]
    if first:
        text += (f"\n\nThe swarms' pipeline 0 before its first outer step against one pipeline alone: losses apart by "
                 f"{max(first):.1e} at most.")
    print(json.dumps([asdict(r) for r in rows]) if args.json else text)
    return 0
