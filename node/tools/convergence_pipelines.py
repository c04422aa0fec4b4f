"""`tahnode bench convergence --pipelines P,...`: do P pipelines in data parallel, kept in step by
outer steps every H steps, train as well as one pipeline with P times the batch (over the run the
same samples; synchronous), and reach one pipeline's final loss sooner? The runs and their report."""

from __future__ import annotations

import dataclasses
import math
import re
import statistics

from ..config.swarm import OUTER_BITS, SwarmConfig
from .bench_report import markdown_table
from .convergence_report import standard_error, steps_to_reach, summarize
from .convergence_runs import RunResult, RunSpec

__all__ = ["add_pipeline_args", "pipeline_specs", "pipeline_report", "COLUMNS"]

COLUMNS = ("pipelines", "outer step", "seeds", "held-out loss (mean)",
           "vs 1 pipeline × P batch: mean ± s.e. (per seed)", "averaging / activation bytes", "replica spread",
           "steps to 1 pipeline's final loss",
           "wall-clock to it vs 1 pipeline at {rate} Mbit/s", "the same for 1 pipeline × P batch")


# a swarm run's label: its pair's, then what pipeline_specs adds
SWARM_LABEL = re.compile(r"(.*) \d+ pipelines H=\d+( \d+ steps)?")


def add_pipeline_args(ap) -> None:
    g = ap.add_argument_group("pipelines in data parallel (the [swarm] table)")
    g.add_argument("--pipelines", default="", metavar="P,...",
                   help="train P pipelines kept in step by outer steps, for each P, beside one pipeline with P× the "
                        "batch (the same samples) and one pipeline alone; default pair only unless --pairs is given")
    run = SwarmConfig()
    g.add_argument("--outer-every", default=str(run.outer_every), metavar="H,...",
                   help=f"steps between outer steps, for each H (default {run.outer_every}, the run's)")
    g.add_argument("--outer-bits", type=int, default=run.outer_bits, choices=OUTER_BITS,
                   help=f"bits of a pseudo-gradient value on the wire (default {run.outer_bits}, the run's)")
    feedback = "on" if run.outer_feedback else "off"
    g.add_argument("--outer-feedback", choices=["on", "off"], default=feedback,
                   help=f"error feedback of the pseudo-gradients' rounding (default {feedback}, the run's)")
    g.add_argument("--outer-lr", type=float, default=1.0, help="the outer step's learning rate (default 1)")
    g.add_argument("--outer-momentum", type=float, default=0.0, help="the outer step's Nesterov momentum (default 0)")
    g.add_argument("--swarm-steps", type=int, default=0, metavar="N",
                   help="steps of the P pipelines and of their reference with P× the batch, the learning-rate "
                        "schedule over those (default: --steps); one pipeline alone trains --steps: with P× the "
                        "samples a step, a swarm may train a shorter schedule, and the wall-clock column says when "
                        "it reaches that pipeline's final loss")


def _numbers(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes whole numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes whole numbers >= 1, got {text!r}")
    return values


def pipeline_specs(base: list[RunSpec], args) -> list[RunSpec]:
    """For each run of `base` (a pair and seed, one pipeline): itself, and for each P one pipeline
    with P× the messages per step and P pipelines at each H."""
    counts = _numbers(args.pipelines, "--pipelines")
    everies = _numbers(args.outer_every, "--outer-every")
    if args.swarm_steps < 0:
        raise ValueError(f"--swarm-steps takes a whole number >= 1 (0: --steps), got {args.swarm_steps}")
    out = []
    for spec in base:
        out.append(spec)
        steps = args.swarm_steps or spec.steps
        shorter = f" {steps} steps" if steps != spec.steps else ""
        for p in counts:
            out.append(dataclasses.replace(spec, pair=f"{spec.pair} 1×{p} batch{shorter}", steps=steps,
                                           messages_per_step=spec.messages_per_step * p))
            for h in everies:
                swarm = {"pipelines": p, "outer_every": h, "outer_bits": args.outer_bits, "outer_lr": args.outer_lr,
                         "outer_momentum": args.outer_momentum}
                if args.outer_feedback == "on":  # only then: the runs cached before feedback keep their keys
                    swarm["outer_feedback"] = True
                label = f"{spec.pair} {p} pipelines H={h}{shorter}"
                out.append(dataclasses.replace(spec, pair=label, steps=steps, swarm=swarm))
    return out


def _outer_label(r: RunSpec) -> str:
    s = r.swarm
    momentum = f", Nesterov {s['outer_momentum']:g}" if s.get("outer_momentum") else ""
    feedback = ", error feedback" if s.get("outer_feedback") else ""
    return f"every {s['outer_every']} steps, {s['outer_bits']}-bit{feedback}, lr {s['outer_lr']:g}{momentum}"


def _wall_share(run: RunResult, spec: RunSpec, single: RunResult, rate_mbps: float) -> float:
    """The swarm's wall-clock to the single pipeline's final held-out loss over that pipeline's, where
    a step takes its link time at `rate_mbps` and each outer step the time one replica sends its share."""
    steps = steps_to_reach(run.evals, single.final_eval)
    if not math.isfinite(steps):
        return math.inf
    per_token = run.dim * max(run.bits_fwd, run.bits_bwd) / (rate_mbps * 1e6)
    step_s = per_token * single.tokens_per_step
    outer_s = 0.0
    if run.outer_steps:
        replica_bytes = run.averaging_bytes / (run.outer_steps * run.pipelines * spec.stages)
        outer_s = replica_bytes * 8 / (rate_mbps * 1e6) * math.floor(steps / spec.swarm["outer_every"])
    return (steps * step_s + outer_s) / (len(single.losses) * step_s)


def pipeline_report(results: list[RunResult], specs: list[RunSpec], rate_mbps: float) -> str:
    """One row per (pipelines, outer step): held-out loss against one pipeline with P× the batch of
    the same seed, the averaging bytes, and the wall-clock to one pipeline's final loss."""
    by_key = {(r.pair, r.seed): r for r in results}
    rows = []
    for spec in [s for s in specs if s.swarm and s.seed == specs[0].seed]:
        pair, shorter = SWARM_LABEL.fullmatch(spec.pair).group(1, 2)
        reference = f"{pair} 1×{spec.pipelines} batch{shorter or ''}"
        runs = [r for r in results if r.pair in (reference, spec.pair)]
        summary = next((s for s in summarize(runs, reference) if s.pair == spec.pair), None)
        if summary is None:
            continue
        gaps = list(summary.gaps.values())
        ratio = statistics.fmean(r.averaging_bytes / r.activation_bytes for r in summary.runs if r.activation_bytes)
        spread, clipped = max(r.spread for r in summary.runs), sum(r.clipped for r in summary.runs)
        kept = sum(r.kept for r in summary.runs)
        singles = {r.seed: by_key.get((pair, r.seed)) for r in summary.runs}
        steps = [steps_to_reach(r.evals, singles[r.seed].final_eval) for r in summary.runs if singles.get(r.seed)]
        wall = [_wall_share(r, spec, singles[r.seed], rate_mbps) for r in summary.runs if singles.get(r.seed)]
        # the synchronous reference (P times the batch, no outer steps) to the same loss: a swarm that trains
        # as well as it gets there as soon
        refs = {r.seed: by_key.get((reference, r.seed)) for r in summary.runs}
        ref_wall = [_wall_share(refs[r.seed], spec, singles[r.seed], rate_mbps) for r in summary.runs
                    if singles.get(r.seed) and refs[r.seed]]
        total = len(summary.runs[0].losses) if summary.runs else 0
        per_seed = ", ".join(f"{g:+.2f}" for g in gaps)
        rows.append([f"{spec.pipelines}", _outer_label(spec), str(len(summary.runs)),
                     f"{statistics.fmean(r.final_eval for r in summary.runs):.4f}",
                     f"{statistics.fmean(gaps):+.2f}% ± {standard_error(gaps):.2f} ({per_seed})" if gaps else "—",
                     f"{100 * ratio:.1f}%", f"{spread:.2g} ({clipped} parts clipped, {kept} averages refused)",
                     _mean_or_dash(steps, lambda v: f"{v:.0f} of {total}"), _mean_or_dash(wall, lambda v: f"{v:.2f}×"),
                     _mean_or_dash(ref_wall, lambda v: f"{v:.2f}×")])
    return markdown_table(tuple(c.format(rate=f"{rate_mbps:g}") for c in COLUMNS), rows)


def _mean_or_dash(values: list[float], fmt) -> str:
    finite = [v for v in values if math.isfinite(v)]
    if not values or len(finite) < len(values):
        return f"not reached in {len(values) - len(finite)} of {len(values)} seeds" if values else "—"
    return fmt(statistics.fmean(finite))
