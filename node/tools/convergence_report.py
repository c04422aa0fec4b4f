"""How `tahnode bench convergence` reports: per codec pair, held-out loss against the reference pair
of the same seed, bits per element, error per crossing, and tokens and link time to reach the
reference's final held-out loss; a markdown table for docs/benchmarks-log.md and a PNG plot."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from .bench_report import markdown_table, pyplot_for, save_figure
from .convergence_runs import RunResult

__all__ = ["PairSummary", "summarize", "table", "plot", "steps_to_reach", "standard_error", "spread", "COLUMNS"]

COLUMNS = ("codec fwd/bwd", "bits/elem fwd / bwd", "seeds", "held-out loss (mean)",
           "vs reference: mean ± s.e. (per seed); the reference: spread across seeds",
           "rel. error per crossing fwd / bwd", "tokens to the reference's final held-out loss",
           "link time to it at {rates} Mbit/s",
           "link time to this pair's final loss at {rates} Mbit/s: this pair / the reference")


def standard_error(values: list[float]) -> float:
    """The standard error of the mean of `values` (nan for fewer than two, or where one is not finite: a
    diverged run's gap)."""
    if len(values) < 2 or not all(map(math.isfinite, values)):
        return math.nan
    return statistics.stdev(values) / math.sqrt(len(values))


def spread(values: list[float]) -> float:
    """How far apart `values` are: (largest - smallest) / mean, in % (nan for none)."""
    return 100 * (max(values) - min(values)) / statistics.fmean(values) if values else math.nan


def steps_to_reach(evals: list[list[float]], target: float) -> float:
    """The (interpolated) number of steps after which the held-out loss first reached `target`;
    inf if it never did."""
    for k, (step, loss) in enumerate(evals):
        if loss <= target:
            if k == 0:
                return step
            s0, l0 = evals[k - 1]
            return s0 + (l0 - target) / (l0 - loss) * (step - s0) if l0 != loss else step
    return math.inf


@dataclass
class PairSummary:
    pair: str
    runs: list[RunResult]
    gaps: dict[int, float]           # seed -> % above the reference's final held-out loss
    tokens_to_target: dict[int, float]  # seed -> tokens to reach the reference's final held-out loss
    reference_tokens_to_own: dict[int, float]  # seed -> tokens the reference needs to reach this pair's final loss
    reference_bits: float = 32.0     # the reference's busier direction, bits per element
    is_reference: bool = False       # the reference pair itself

    @property
    def mean_gap(self) -> float:
        return statistics.fmean(self.gaps.values()) if self.gaps else math.nan

    def mean(self, attribute: str) -> float:
        return statistics.fmean(getattr(r, attribute) for r in self.runs)

    @property
    def busiest_bits(self) -> float:
        """Bits per element on a link's busier direction (forward activations or backward gradients)."""
        return max(self.mean("bits_fwd"), self.mean("bits_bwd"))

    def link_seconds(self, tokens: float, rate_mbps: float, bits: float | None = None) -> float:
        """Seconds a link of `rate_mbps` needs to carry `tokens` tokens' boundary tensors (its limit)."""
        return tokens * self.runs[0].dim * (self.busiest_bits if bits is None else bits) / (rate_mbps * 1e6)

    def race(self, rate_mbps: float) -> str:
        """Link time to this pair's own final loss, for this pair and for the reference (mean over seeds)."""
        live = [r.tokens_per_step * r.evals[-1][0] for r in self.runs if not r.diverged]
        ours = statistics.fmean(live) if live else math.nan  # none when every seed diverged
        theirs = [t for t in self.reference_tokens_to_own.values() if math.isfinite(t)]
        if not theirs or not math.isfinite(ours):
            return "—"
        return (f"{_duration(self.link_seconds(ours, rate_mbps))} / "
                f"{_duration(self.link_seconds(statistics.fmean(theirs), rate_mbps, self.reference_bits))}")


def summarize(results: list[RunResult], reference: str) -> list[PairSummary]:
    """One summary per pair, in the order the pairs first appear."""
    ref = {r.seed: r for r in results if r.pair == reference}
    ref_bits = statistics.fmean(max(r.bits_fwd, r.bits_bwd) for r in ref.values()) if ref else 32.0
    out = []
    for pair in dict.fromkeys(r.pair for r in results):
        runs = sorted((r for r in results if r.pair == pair), key=lambda r: r.seed)
        gaps, tokens, back = {}, {}, {}
        for r in runs:
            base = ref.get(r.seed)
            if base is None or not math.isfinite(base.final_eval):
                continue
            gaps[r.seed] = 100 * (r.final_eval / base.final_eval - 1)
            tokens[r.seed] = steps_to_reach(r.evals, base.final_eval) * r.tokens_per_step
            back[r.seed] = steps_to_reach(base.evals, r.final_eval) * base.tokens_per_step
        out.append(PairSummary(pair, runs, gaps, tokens, back, ref_bits, pair == reference))
    return out


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "—"
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _cells(s: PairSummary, rates: list[float]) -> list[str]:
    diverged = [r.seed for r in s.runs if r.diverged]
    loss = statistics.fmean(r.final_eval for r in s.runs)
    losses = [r.final_eval for r in s.runs if math.isfinite(r.final_eval)]
    if s.is_reference and losses:  # how much the reference's own seeds differ
        gap = f"spread {spread(losses):.1f}% ({min(losses):.4f} to {max(losses):.4f})"
    elif s.gaps and len(diverged) < len(s.runs):
        per_seed = ", ".join(f"{g:+.2f}" for g in s.gaps.values())
        gap = f"{s.mean_gap:+.2f}% ± {standard_error(list(s.gaps.values())):.2f} ({per_seed})"
    else:
        gap = "—" if diverged else "no reference run"
    if diverged:
        gap += f"; **diverged** with seed {', '.join(map(str, diverged))}"
    reached = [t for t in s.tokens_to_target.values() if math.isfinite(t)]
    if s.tokens_to_target and len(reached) == len(s.tokens_to_target):
        tokens = statistics.fmean(reached)
        to_target = f"{tokens / 1e6:.2f} M"
        times = " / ".join(_duration(s.link_seconds(tokens, rate)) for rate in rates)
    else:
        missed = len(s.tokens_to_target) - len(reached)
        to_target = f"not reached in {missed} of {len(s.tokens_to_target)} seeds" if s.tokens_to_target else "—"
        times = "—"
    return [s.pair, f"{s.mean('bits_fwd'):.2f} / {s.mean('bits_bwd'):.2f}", str(len(s.runs)),
            f"{loss:.4f}" if math.isfinite(loss) else "diverged", gap,
            f"{s.mean('error_fwd'):.3f} / {s.mean('error_bwd'):.3f}", to_target, times,
            " ; ".join(s.race(r) for r in rates)]


def table(summaries: list[PairSummary], rates: list[float]) -> str:
    listed = {sep: sep.join(f"{r:g}" for r in rates) for sep in (" ; ", " / ")}
    columns = tuple(c.format(rates=listed[" ; " if "this pair" in c else " / "]) for c in COLUMNS)
    return markdown_table(columns, [_cells(s, rates) for s in summaries])


def _mean_curve(runs: list[RunResult], attribute: str) -> tuple[list[float], list[float]]:
    if attribute == "evals":
        n = min(len(r.evals) for r in runs)
        steps = [runs[0].evals[i][0] for i in range(n)]
        return steps, [statistics.fmean(r.evals[i][1] for r in runs) for i in range(n)]
    n = min(len(r.losses) for r in runs)
    return list(range(1, n + 1)), [statistics.fmean(r.losses[i] for r in runs) for i in range(n)]


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def plot(summaries: list[PairSummary], reference: str, out: Path, smooth: int = 25) -> Path:
    """Left: held-out loss against step (mean over seeds). Right: training loss, smoothed over
    `smooth` steps, in % above the reference pair's (mean over seeds)."""
    plt = pyplot_for(out)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    ref = next((s for s in summaries if s.pair == reference), None)
    ref_train = _smooth(_mean_curve(ref.runs, "losses")[1], smooth) if ref else None
    for k, s in enumerate(summaries):
        live = [r for r in s.runs if not r.diverged] or s.runs
        steps, held = _mean_curve(live, "evals")
        left.plot(steps, held, "o-", ms=3, color=f"C{k % 10}", label=s.pair)
        if ref_train is not None and s.pair != reference:
            xs, train = _mean_curve(live, "losses")
            train = _smooth(train, smooth)
            n = min(len(train), len(ref_train))
            above = [100 * (train[i] / ref_train[i] - 1) for i in range(n)]
            right.plot(xs[:n], above, color=f"C{k % 10}", label=s.pair)
    late = [loss for line in left.get_lines() for step, loss in zip(*line.get_data())
            if step >= 0.15 * max(line.get_xdata())]
    if late:  # the first steps' fall would flatten the differences that matter
        span = max(late) - min(late)
        left.set_ylim(min(late) - 0.05 * span, max(late) + 0.05 * span)
    left.set(xlabel="step", ylabel="held-out loss", title="held-out loss (mean over seeds; from 15% of the run)")
    right.axhline(0, color="0.5", lw=0.8)
    right.set(xlabel="step", ylabel=f"% above {reference}",
              title=f"training loss vs {reference} (smoothed over {smooth} steps)")
    return save_figure(plt, fig, (left, right), out, legend_size=7)
