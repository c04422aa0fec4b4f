"""`tahnode bench swarm --convergence`'s report: each codec pair's final loss over its seeds against
the reference pair of the same seed, its table and the plot of its mean curves."""

from __future__ import annotations

import statistics
from pathlib import Path

from .bench_report import markdown_table, plot_convergence, write_section
from .swarm_cells import CONVERGENCE_COLUMNS, BenchConfig, Row, final_loss

__all__ = ["convergence_cells", "mean_curves", "report_convergence"]


def convergence_cells(rows: list[Row], reference: str = "none/none") -> list[list[str]]:
    """A line per codec pair: its final loss averaged over its seeds, and how far above the
    reference pair's run *of the same seed* it ended, averaged, then seed by seed."""
    base = {r.seed: final_loss(r) for r in rows if r.pair == reference}
    cells = []
    for pair in dict.fromkeys(r.pair for r in rows):
        runs = sorted((r for r in rows if r.pair == pair), key=lambda r: r.seed)
        gaps = [100 * (final_loss(r) / base[r.seed] - 1) for r in runs if r.seed in base]
        vs = f"{statistics.fmean(gaps):+.2f}% ({', '.join(f'{g:+.1f}' for g in gaps)})" if gaps else "no reference run"
        cells.append([pair, str(max(len(r.losses) for r in runs)), str(len(runs)),
                      f"{statistics.fmean(final_loss(r) for r in runs):.4f}", vs,
                      f"{statistics.fmean(r.bits_fwd for r in runs):.2f} / "
                      f"{statistics.fmean(r.bits_bwd for r in runs):.2f}",
                      f"{statistics.fmean(r.tokens_per_s for r in runs):,.0f}"])
    return cells


def mean_curves(rows: list[Row]) -> list[Row]:
    """A row per codec pair whose losses are the step-by-step mean over its seeds (for the plot)."""
    out = []
    for pair in dict.fromkeys(r.pair for r in rows):
        runs = [r for r in rows if r.pair == pair]
        n = min(len(r.losses) for r in runs)
        out.append(Row(0.0, 0.0, runs[0].stages, pair,
                       losses=[statistics.fmean(r.losses[i] for r in runs) for i in range(n)]))
    return out


def report_convergence(rows: list[Row], cfg: BenchConfig, args, command: str) -> str:
    reference = "none/none" if any(r.pair == "none/none" for r in rows) else rows[0].pair
    text = markdown_table(CONVERGENCE_COLUMNS, convergence_cells(rows, reference))
    seeds = sorted({r.seed for r in rows})
    plots = [plot_convergence(mean_curves(rows), reference, Path(args.plots) / f"{args.name}-convergence.png")]
    write_section(Path(args.doc), f"{args.name}-convergence", f"Convergence: {args.name}", [
        text, "", f"Model: {cfg.model}, {cfg.tokens_per_step} tokens per step, {cfg.unshaped_steps} steps, 3 stages on "
        f"unshaped links; every pair trained with seeds {', '.join(map(str, seeds))} (weights and data order), the "
        "same data for the same seed; the plot shows each pair's loss averaged over the seeds.", "",
        f"Command: `{command}`"], plots)
    return text
