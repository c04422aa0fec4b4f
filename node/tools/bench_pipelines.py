"""`tahnode bench swarm --pipelines 1,2`: P pipelines of S stages in data parallel on one swarm of
P x S nodes in namespaces with tc, against the physical limit with the replicas' averaging in it.

Link limit, per pipeline: tokens per step x rate / the bytes per step
of its busiest node: its busiest data-plane direction over the measured steps (tc's counters) plus
what its averager sent per step (its own count); the swarm's is the pipelines' sum. Compute
limit: the same swarm on unshaped links. tokens/s: every pipeline's tokens over the wall time of its
measured steps, outer steps included. Table and plot into docs/benchmarks-log.md."""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config.toml import toml_table
from .bench_report import markdown_table, pyplot_for, save_figure, write_section
from .swarm_cells import DEFAULT_PAIRS, CodecPair
from .swarm import LocalSwarm, SwarmError, SwarmSpec

__all__ = ["PipelineRow", "PipelineBench", "pipeline_limits", "compute_shares", "run_pipelines", "COLUMNS"]

COLUMNS = ("link Mbit/s", "pipelines", "stages", "outer step", "tokens/s", "vs 1 pipeline", "limit tokens/s", "limit",
           "share of limit", "busiest data direction bytes/step", "averaging bytes/step", "outer step s", "final loss")


@dataclass
class PipelineRow:
    rate_mbps: float                 # 0: unshaped
    pipelines: int
    stages: int
    outer_every: int
    tokens_per_s: float = 0.0
    limit_tokens_per_s: float = 0.0
    limit: str = ""
    share: float = 0.0
    data_bytes_per_step: float = 0.0       # the busiest data-plane direction of the busiest node
    averaging_bytes_per_step: float = 0.0  # what that node sent its stage's replicas, per step
    link_limit: float = 0.0                # tokens/s the links allow (0: unshaped)
    outer_seconds: float = 0.0             # mean wall time of an outer step's averaging, over the nodes
    final_loss: float = 0.0
    speedup: float = 0.0                   # tokens/s over the 1-pipeline row's at the same rate
    step_seconds: dict = field(default_factory=dict)  # pipeline -> its measured steps' wall times

    def cells(self) -> list[str]:
        return [f"{self.rate_mbps:g}" if self.rate_mbps else "unshaped", str(self.pipelines), str(self.stages),
                f"every {self.outer_every}" if self.pipelines > 1 else "—", f"{self.tokens_per_s:,.0f}",
                f"{self.speedup:.2f}×" if self.speedup else "—", f"{self.limit_tokens_per_s:,.0f}", self.limit,
                f"{100 * self.share:.0f}%", f"{self.data_bytes_per_step:,.0f}", f"{self.averaging_bytes_per_step:,.0f}",
                f"{self.outer_seconds:.2f}" if self.pipelines > 1 else "—", f"{self.final_loss:.4f}"]


@dataclass
class PipelineBench:
    """How every row trains: the model, the step, the outer step, the steps measured."""

    model: str = "llama-thin-3"
    stages: int = 3
    tokens_per_step: int = 16384
    seq_len: int = 128
    micro_batches: int = 4
    pipeline_micro_batches: int = 8  # fixed: pipelines that tune their cuts apart run apart, and wait for each other
    outer_every: int = 8
    warmup: int = 4
    steps: int = 12
    prefix: str = "tnp-"
    workdir: Path = Path("bench-swarm/pipelines")
    pair: CodecPair | None = None    # the codecs (None: the run's defaults)

    @property
    def codecs(self) -> str:
        return self.pair.label if self.pair else "the run's default pair"

    def run_toml(self, steps: int) -> str:
        samples = self.tokens_per_step // self.seq_len
        train = {"steps": steps, "seq_len": self.seq_len, "micro_batches": self.micro_batches,
                 "batch_size": samples // self.micro_batches, "checkpoint_every": 10**6, "warmup_steps": 1,
                 "pipeline_micro_batches": self.pipeline_micro_batches}
        if self.pair is None:
            return toml_table("train", train)
        return toml_table("train", train) + toml_table("codec", self.pair.codec_table())


def data_bytes(swarm: LocalSwarm, state: dict) -> dict[str, int]:
    """node -> bytes sent so far on its busiest data-plane direction (tc's counters)."""
    chains = {tuple(p["nodes"]) for p in state.get("pipelines", [])}
    out = {}
    for n in state["nodes"]:
        if n.get("pipeline") is None:
            continue
        neighbours = {c[k] for c in chains if n["id"] in c for k in (n["stage"] - 1, n["stage"] + 1) if 0 <= k < len(c)}
        out[n["id"]] = max((swarm.link_bytes(n["id"], dst) for dst in neighbours), default=0)
    return out


def measure(cfg: PipelineBench, rate: float, pipelines: int) -> PipelineRow:
    """One row: a swarm of `pipelines` x stages nodes up, the training, its numbers, the swarm down."""
    steps = cfg.warmup + cfg.steps
    row_dir = cfg.workdir / f"{cfg.stages}st-{rate:g}mbit-{pipelines}p"
    row_dir.mkdir(parents=True, exist_ok=True)
    (row_dir / "run.toml").write_text(cfg.run_toml(steps))
    flags = ["--model", cfg.model, "--config", str(row_dir / "run.toml"), "--pipelines", str(pipelines),
             "--standbys", "0", "--outer-every", str(cfg.outer_every), "--min-chain-share", "0"]
    spec = SwarmSpec(nodes=pipelines * cfg.stages, stages=cfg.stages, bandwidth_bps=rate * 1e6, prefix=cfg.prefix,
                     workdir=row_dir, run_flags=flags, auto=True,
                     placement_flags=["--settle", "2", "--probe-wait", "4"])
    swarm = LocalSwarm.up(spec)
    try:
        started = swarm.wait(lambda s: sum(p["complete"] for p in s.get("pipelines", [])) == pipelines
                             and min(p["step"] or 0 for p in s["pipelines"]) >= cfg.warmup,
                             600, f"{pipelines} pipelines")
        before = data_bytes(swarm, started) if rate else {}  # the probes' bytes left out: from the measured steps on
        state = swarm.wait(lambda s: s["training"]["finished"], 600 + 60 * steps, f"{steps} steps of every pipeline")
        ledger = swarm.state("ledger")["steps"]
        after = data_bytes(swarm, started) if rate else {}
    finally:
        LocalSwarm.down(spec.prefix, row_dir)
    row = PipelineRow(rate, pipelines, cfg.stages, cfg.outer_every)
    for p in range(pipelines):
        mine = [e for e in ledger if e["pipeline"] == p and e["step"] >= cfg.warmup]
        row.step_seconds[p] = [e["seconds"] for e in mine]
        if mine:
            row.tokens_per_s += cfg.tokens_per_step * len(mine) / sum(row.step_seconds[p])
    row.final_loss = statistics.fmean(e["loss"] for e in ledger if e["step"] == steps - 1)
    outer = {n["id"]: n.get("outer", {}) for n in state["nodes"]}
    if after:  # a node's averaging: the bytes its averager counted over the run, per step
        per_step = {n: ((after[n] - before.get(n, 0)) / cfg.steps, outer.get(n, {}).get("bytes_sent", 0) / steps)
                    for n in after}
        busiest = max(per_step, key=lambda n: sum(per_step[n]))
        row.data_bytes_per_step, row.averaging_bytes_per_step = per_step[busiest]
        row.link_limit = pipelines * cfg.tokens_per_step * rate * 1e6 / (8 * sum(per_step[busiest]))
    outers = [o for o in outer.values() if o.get("steps")]
    row.outer_seconds = (statistics.fmean(o["seconds"] / (o["steps"] + o.get("alone", 0)) for o in outers)
                         if outers else 0.0)
    return row


def pipeline_limits(rows: list[PipelineRow]) -> None:
    """Each row's limit (the smaller of its link limit and the unshaped row's of the same pipelines),
    its share, and its speed-up over the 1-pipeline row at the same rate."""
    compute = {r.pipelines: r.tokens_per_s for r in rows if not r.rate_mbps}
    single = {r.rate_mbps: r.tokens_per_s for r in rows if r.pipelines == 1}
    for r in rows:
        limits = {k: v for k, v in (("link", r.link_limit), ("compute", compute.get(r.pipelines, 0.0))) if v > 0}
        if limits:
            r.limit = min(limits, key=limits.get)
            r.limit_tokens_per_s = limits[r.limit]
            r.share = r.tokens_per_s / r.limit_tokens_per_s
        if r.pipelines > 1 and single.get(r.rate_mbps):
            r.speedup = r.tokens_per_s / single[r.rate_mbps]


def compute_shares(rows: list[PipelineRow]) -> dict[float, float]:
    """Each link rate -> one pipeline's tokens/s there over one pipeline's unshaped (what the machine
    computes): the share of the shared machine's CPU one pipeline needs at that rate. Issue 44's bar
    for two pipelines at 50 Mbit/s holds for a model and batch where it is at most one half."""
    alone = {r.rate_mbps: r.tokens_per_s for r in rows if r.pipelines == 1 and r.tokens_per_s > 0}
    return {rate: tps / alone[0] for rate, tps in sorted(alone.items()) if rate and alone.get(0)}


def plot(rows: list[PipelineRow], out: Path) -> Path:
    """tokens/s against pipelines, one line per link rate, the limits dashed."""
    plt = pyplot_for(out)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for k, rate in enumerate(sorted({r.rate_mbps for r in rows})):
        line = sorted((r for r in rows if r.rate_mbps == rate), key=lambda r: r.pipelines)
        label = f"{rate:g} Mbit/s" if rate else "unshaped"
        ax.plot([r.pipelines for r in line], [r.tokens_per_s for r in line], "o-", color=f"C{k}", label=label)
        ax.plot([r.pipelines for r in line], [r.limit_tokens_per_s for r in line], "--", color=f"C{k}", alpha=0.6)
    ax.set(xlabel="pipelines", ylabel="tokens/s (the swarm's)", title="pipelines in data parallel (dashed: the limit)")
    return save_figure(plt, fig, [ax], out)


def run_pipelines(cfg: PipelineBench, rates: list[float], counts: list[int]) -> list[PipelineRow]:
    """Every (rate, pipelines) row, unshaped ones first; a row that fails is reported and skipped."""
    rows = []
    for rate in sorted(rates, key=lambda r: (r != 0, r)):
        for count in counts:
            try:
                rows.append(measure(cfg, rate, count))
            except SwarmError as exc:
                print(f"row {rate:g} Mbit/s, {count} pipelines failed: {exc}", file=sys.stderr)
    pipeline_limits(rows)
    return rows


def report(rows: list[PipelineRow], cfg: PipelineBench, doc: Path, plots: Path, name: str, command: str) -> str:
    text = markdown_table(COLUMNS, [r.cells() for r in rows])
    write_section(doc, f"{name}-pipelines", f"Pipelines in data parallel: {name}", [
        text, "", f"Model: {cfg.model} in {cfg.stages} stages, {cfg.tokens_per_step} tokens per step per pipeline "
        f"({cfg.seq_len} tokens per sample), codecs: {cfg.codecs}; every node joins with --stage auto and the "
        f"coordinator forms the pipelines; the replicas average every {cfg.outer_every} steps. {cfg.warmup} "
        f"warm-up steps, then {cfg.steps} measured steps (tokens over their whole wall time, outer steps included); "
        f"each step cut into {cfg.pipeline_micro_batches} micro-batches (pipelines that tune their cuts apart wait for "
        "each other at every outer step). Every directed link is a tc class at the rate; the link limit counts a "
        "node's averaging bytes on top of its busiest data direction." + "".join(
            f" One pipeline at {rate:g} Mbit/s trains {100 * share:.0f}% of what it trains unshaped." for rate, share
            in compute_shares(rows).items()),
        "", f"Command: `{command}`"], [plot(rows, plots / f"{name}-pipelines.png")])
    return text


def rows_json(rows: list[PipelineRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def main(args, command: str) -> int:
    """`tahnode bench swarm --pipelines ...` (its other flags: --rates, --stages, --model, --tokens-per-step,
    --seq-len, --warmup, --steps, --outer-every, --prefix, --workdir, --doc, --plots, --name, --json)."""
    import json

    from . import netns

    try:
        counts = [int(x) for x in args.pipelines.split(",") if x.strip()]
        rates = [float(x) for x in args.rates.split(",") if x.strip()]
        if not counts or min(counts) < 1 or args.outer_every < 1:
            raise ValueError("--pipelines takes whole numbers >= 1, --outer-every one >= 1")
        pair = None if args.pairs == DEFAULT_PAIRS else CodecPair.parse(args.pairs.split(",")[0])
        cfg = PipelineBench(model=args.model or "llama-thin-3", stages=int(args.stages.split(",")[0]), pair=pair,
                            pipeline_micro_batches=args.pipeline_micro_batches or 8,
                            tokens_per_step=args.tokens_per_step, seq_len=args.seq_len,
                            micro_batches=args.micro_batches or 4,
                            outer_every=args.outer_every, warmup=args.warmup, steps=args.steps, prefix=args.prefix,
                            workdir=Path(args.workdir) / "pipelines")
        if cfg.tokens_per_step % (cfg.seq_len * cfg.micro_batches):
            raise ValueError(f"--tokens-per-step {cfg.tokens_per_step} must be whole micro-batches of "
                             f"--seq-len {cfg.seq_len}")
        netns.check_root()
    except (ValueError, netns.NetnsError) as exc:
        print(f"tahnode bench swarm: {exc}", file=sys.stderr)
        return 2
    rows = run_pipelines(cfg, rates, counts)
    if not rows:
        return 1
    print(report(rows, cfg, Path(args.doc), Path(args.plots), args.name, command))
    print(f"written to {args.doc}; plot in {args.plots}")
    if args.json:
        print(json.dumps(rows_json(rows)))
    return 0
