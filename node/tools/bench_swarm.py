"""`tahnode bench swarm`: the same training (same seed, data and steps) on a local swarm with shaped
links, for codec pairs x link rates x RTTs x stage counts, measured against the physical limit.

Limit: min(link limit, compute limit). Link limit = tokens per step x link
rate / bytes per step on the busiest link direction (tc's counters: IP packets, headers included;
with --shaper userspace the envelopes' bytes); compute limit = tokens/s of the same stages and codec
pair on unshaped links. tokens/s = tokens per step / the median wall time of the measured steps on
the last stage. The table, the machine, the model and the command go into docs/benchmarks-log.md, the
plots beside it (PNG, matplotlib)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

from ..config import TransportKind
from ..config.swarm import SwarmConfig
from . import netns
from .bench_pipelines import main as pipelines_main
from .bench_report import markdown_table, plot_losses, plot_throughput, write_section
from .interrupt import interruptible
from .swarm import LocalSwarm, Shaper, SwarmError, SwarmSpec
from .swarm_cells import COLUMNS, DEFAULT_PAIRS, MAIN_PAIRS, BenchConfig, Cell, CodecPair, Row
from .swarm_convergence import report_convergence

__all__ = ["CodecPair", "Row", "Cell", "BenchConfig", "COLUMNS", "main", "with_limits"]

def data_links(stages: int) -> list[tuple[str, str]]:
    """The directed links between consecutive stages' nodes (n1 holds stage 0)."""
    out = []
    for k in range(1, stages):
        out += [(f"n{k}", f"n{k + 1}"), (f"n{k + 1}", f"n{k}")]
    return out


def measure(cfg: BenchConfig, cell: Cell) -> Row:
    """One row: a swarm up, the training, its numbers, the swarm down."""
    rate, rtt, stages, pair, transport = cell.rate, cell.rtt, cell.stages, cell.pair, cell.transport
    steps = cfg.warmup + (cfg.steps if rate else cfg.unshaped_steps)
    row_dir = cfg.workdir / cell.dirname
    row_dir.mkdir(parents=True, exist_ok=True)
    (row_dir / "run.toml").write_text(cfg.run_toml(pair, steps, cell.seed))
    spec = SwarmSpec(nodes=stages, bandwidth_bps=rate * 1e6, rtt_s=rtt / 1e3, shaper=cfg.shaper, prefix=cfg.prefix,
                     workdir=row_dir, run_flags=["--model", cfg.model, "--config", str(row_dir / "run.toml")],
                     transport=transport, device=cfg.device)
    swarm = LocalSwarm.up(spec)
    try:
        timeout = 600 + 60 * steps
        state = swarm.wait(lambda s: s["training"]["finished"] and s["training"]["step"] >= steps, timeout,
                           f"{steps} steps")
        ledger = swarm.state("ledger")["steps"]
        if spec.shaper is Shaper.TC:
            sent = {link: swarm.link_bytes(*link) for link in data_links(stages)}
        else:
            sent = {(link["src"], link["dst"]): link.get("bytes", 0) for link in state["links"]}
    finally:
        LocalSwarm.down(spec.prefix, row_dir)
    t = state["training"]
    measured = [p["seconds"] for p in ledger[cfg.warmup:]]
    return Row(rate, rtt, stages, pair.label, transport.value,
               tokens_per_s=cfg.tokens_per_step / statistics.median(measured),
               bits_fwd=t["bits_per_element"], bits_bwd=t["backward_bits_per_element"],
               busiest_bytes_per_step=max(sent.values(), default=0) / steps, final_loss=ledger[-1]["loss"],
               peak_rss_mb=t.get("peak_rss_bytes", 0) / 2**20, step_seconds=[p["seconds"] for p in ledger],
               losses=[p["loss"] for p in ledger], seed=cell.seed)


def with_limits(rows: list[Row], tokens_per_step: int) -> None:
    """Fill each row's limit and share: the smaller of its link limit and the compute limit of the
    unshaped RTT-0 row of the same stages, codec pair and transport (where the matrix has it)."""
    compute = {(r.stages, r.pair, r.transport): r.tokens_per_s for r in rows if not r.rate_mbps and not r.rtt_ms}
    for r in rows:
        limits = {}
        if r.rate_mbps and r.busiest_bytes_per_step:
            limits["link"] = tokens_per_step * r.rate_mbps * 1e6 / (8 * r.busiest_bytes_per_step)
        if (r.stages, r.pair, r.transport) in compute:
            limits["compute"] = compute[(r.stages, r.pair, r.transport)]
        if limits:
            r.limit = min(limits, key=limits.get)
            r.limit_tokens_per_s = limits[r.limit]
            r.share = r.tokens_per_s / r.limit_tokens_per_s


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tahnode bench swarm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="10,50,200,0",
                    help="link rates in Mbit/s, comma-separated; 0 = unshaped (default 10,50,200,0)")
    ap.add_argument("--rtts", default="0,50", help="round-trip times in ms, comma-separated (default 0,50)")
    ap.add_argument("--stages", default="3,4", help="stage counts, comma-separated (default 3,4)")
    ap.add_argument("--pairs", default=DEFAULT_PAIRS,
                    help=f"codec pairs FWD[:k=v]/BWD[:k=v], comma-separated (default {DEFAULT_PAIRS}; "
                    "backward naive means 6 bits; `default` is the pair a run sends by default, tahquant with its "
                    "precision schedule forward and pertoken backward; tahquant written bare has no schedule; the "
                    "paper's algorithm is tahquant-paper)")
    ap.add_argument("--all-pairs-at-4-stages", action="store_true",
                    help="run every pair with 4 stages too (default: only " + ", ".join(MAIN_PAIRS) + ")")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per row (default 4)")
    ap.add_argument("--unshaped-steps", type=int, default=6, help="measured steps of the unshaped rows, which set the "
                    "compute limits (default 6)")
    ap.add_argument("--warmup", type=int, default=4, help="steps before the measured ones, in which the pipeline "
                    "tries its cuts (default 4)")
    ap.add_argument("--tokens-per-step", type=int, default=32768, help="tokens per optimizer step (default 32768)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    ap.add_argument("--micro-batches", type=int, default=0,
                    help="the step's samples as this many micro-batches (default 4)")
    ap.add_argument("--pipeline-micro-batches", type=int, default=0,
                    help="micro-batches the pipeline cuts a step into (default 0: auto, tahnode.pipeline.schedule; "
                    "with --pipelines 8, the same for every pipeline)")
    ap.add_argument("--model", default="", help="model preset or TOML (default llama-thin: dim 64, so links dominate; "
                    "with --convergence llama-tiny; with --pipelines llama-thin-3, a quarter of its compute)")
    ap.add_argument("--transports", default="grpc", help="the nodes' data planes to compare, comma-separated: grpc, "
                    "p2p (p2p needs pip install 'tahnode[p2p]'; default grpc)")
    ap.add_argument("--shaper", default=Shaper.TC.value, choices=[s.value for s in Shaper],
                    help="tc (root; default) or userspace")
    ap.add_argument("--device", default="cpu",
                    help="where the stages compute: cpu (default) or cuda[:N] (they share the GPU)")
    ap.add_argument("--name", default="swarm", help="the doc section and plot names (default swarm)")
    ap.add_argument("--doc", default="docs/benchmarks-log.md",
                    help="where the table goes (default docs/benchmarks-log.md)")
    ap.add_argument("--plots", default="docs/plots", help="where the PNG plots go (default docs/plots)")
    ap.add_argument("--workdir", default="bench-swarm", help="logs and run files of every row (default bench-swarm)")
    ap.add_argument("--prefix", default="tnb-", help="namespace prefix of the swarms it starts (default tnb-)")
    ap.add_argument("--convergence", type=int, nargs="?", const=300, default=0, metavar="STEPS",
                    help="instead of the matrix: train llama-tiny (or --model) for STEPS steps (default 300; "
                    "1024 tokens per step, 3 stages, unshaped) with " + ", ".join(MAIN_PAIRS)
                    + ", --seeds times each, and compare their final losses")
    ap.add_argument("--seeds", type=int, default=3, metavar="N", help="with --convergence: train every pair with seeds "
                    "0..N-1 (weights and data order) and compare each with none/none of the same seed (default 3; "
                    "one run's final loss moves by several percent with the seed, and by a percent or two with "
                    "any change of rounding)")
    ap.add_argument("--pipelines", default="", metavar="P,...",
                    help="instead of the matrix: P pipelines of --stages' first "
                    "count in data parallel, for each P (e.g. 1,2) and --rates, against the limit with their averaging "
                    "(tahnode.tools.bench_pipelines)")
    ap.add_argument("--outer-every", type=int, default=SwarmConfig().outer_every,
                    help=f"with --pipelines: steps between outer steps (default {SwarmConfig().outer_every}, "
                         "the run's)")
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON list on the last line")
    return ap


def plan(args, pairs: list[CodecPair]) -> list[Cell]:
    """The rows to run, unshaped ones first (they give the compute limits)."""
    rates = sorted((float(x) for x in args.rates.split(",")), key=lambda r: (r != 0, r))
    rtts = [float(x) for x in args.rtts.split(",")]
    stages = [int(x) for x in args.stages.split(",")]
    transports = [TransportKind(x.strip()) for x in args.transports.split(",") if x.strip()]
    rows = []
    for s in stages:
        for rate in rates:
            for rtt in rtts:
                for pair in pairs:
                    if s > 3 and not args.all_pairs_at_4_stages and pair.label not in MAIN_PAIRS:
                        continue
                    rows += [Cell(rate, rtt, s, pair, transport) for transport in transports]
    return rows


def run_rows(cfg: BenchConfig, todo: list[Cell]) -> list[Row]:
    """Measure every row, with a progress bar; a row that fails is reported and skipped."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    rows: list[Row] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} rows"),
                  TimeElapsedColumn(), transient=False) as bar:
        task = bar.add_task("bench swarm", total=len(todo))
        for cell in todo:
            what = cell.describe()
            bar.update(task, description=what)
            try:
                rows.append(measure(cfg, cell))
            except SwarmError as exc:
                bar.console.print(f"[red]row {what} failed:[/red] {exc}")
            bar.advance(task)
    return rows


def report_matrix(rows: list[Row], cfg: BenchConfig, args, command: str) -> str:
    with_limits(rows, cfg.tokens_per_step)
    plots = [plot_throughput(rows, Path(args.plots) / f"{args.name}-throughput.png"),
             plot_losses(rows, Path(args.plots) / f"{args.name}-loss.png")]
    text = markdown_table(COLUMNS, [r.cells() for r in rows])
    write_section(Path(args.doc), args.name, f"Swarm on shaped links: {args.name}", [
        text, "", f"Model: {cfg.model}, {cfg.tokens_per_step} tokens per step ({cfg.seq_len} tokens per sample); "
        f"{cfg.warmup} warm-up steps (the pipeline tries its cuts there), then {cfg.steps} measured steps per "
        f"shaped row and {cfg.unshaped_steps} per unshaped row (median step time); {cfg.shaper} shaper; "
        f"stages on {cfg.device}.", "",
        f"Command: `{command}`"], plots, cfg.device)
    return text


@interruptible("tahnode bench swarm")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = ("tahnode bench swarm " + " ".join(sys.argv[3:] if argv is None else argv)).strip()
    if args.pipelines:
        return pipelines_main(args, command)
    try:
        pairs = [CodecPair.parse(p) for p in args.pairs.split(",") if p.strip()]
        if args.convergence:
            pairs = [p for p in pairs if p.label in MAIN_PAIRS] if args.pairs == DEFAULT_PAIRS else pairs
            cfg = BenchConfig(pairs=pairs, steps=0, unshaped_steps=args.convergence, warmup=0, tokens_per_step=1024,
                              seq_len=64, model=args.model or "llama-tiny", shaper=Shaper(args.shaper),
                              prefix=args.prefix, workdir=Path(args.workdir), lr_warmup_steps=10).validate()
            if args.seeds < 1:
                raise ValueError(f"--seeds must be at least 1, got {args.seeds}")
            todo = [Cell(0.0, 0.0, 3, pair, TransportKind.GRPC, seed) for seed in range(args.seeds) for pair in pairs]
        else:
            cfg = BenchConfig(pairs=pairs, steps=args.steps, unshaped_steps=args.unshaped_steps, warmup=args.warmup,
                              tokens_per_step=args.tokens_per_step, seq_len=args.seq_len,
                              micro_batches=args.micro_batches, pipeline_micro_batches=args.pipeline_micro_batches,
                              model=args.model or "llama-thin", shaper=Shaper(args.shaper),
                              prefix=args.prefix, workdir=Path(args.workdir), device=args.device).validate()
            todo = plan(args, pairs)
        if cfg.shaper is Shaper.TC:
            netns.check_root()
    except (ValueError, netns.NetnsError) as exc:
        print(f"tahnode bench swarm: {exc}", file=sys.stderr)
        return 2
    rows = run_rows(cfg, todo)
    if not rows:
        return 1
    text = (report_convergence if args.convergence else report_matrix)(rows, cfg, args, command)
    print(text)
    print(f"written to {args.doc}; plots in {args.plots}")
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
    return 0
