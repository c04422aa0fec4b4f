"""The cells of `tahnode bench swarm`'s matrix and what each measures: a codec pair as the bench
writes it, one row's numbers, one cell to run, and how every row trains (BenchConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config import RunConfig, TransportKind
from ..config.run import CodecConfig
from ..config.toml import toml_table
from .swarm import Shaper

__all__ = ["CodecPair", "Row", "Cell", "BenchConfig", "final_loss", "COLUMNS", "CONVERGENCE_COLUMNS", "DEFAULT_PAIRS",
           "MAIN_PAIRS", "NO_SCHEDULE"]

# `default`: the pair a run sends by default (its [codec] table unset: tahquant with its precision
# schedule forward, pertoken backward); `tahquant` written bare has no schedule; tahquant-paper is the paper's
DEFAULT_PAIRS = ("none/none,default,group/naive,aqsgd/naive,aqsgd/naive:bits=8,amaq/naive,tahquant-paper/naive,"
                 "tahquant-paper/tahquant-paper")
NO_SCHEDULE = {"forward_high_params": {}}  # the [codec] settings of a pair written without '@': no precision schedule
MAIN_PAIRS = ("none/none", "default", "tahquant-paper/naive", "tahquant-paper/tahquant-paper")
COLUMNS = ("link Mbit/s", "RTT ms", "stages", "codec fwd/bwd", "transport", "tokens/s", "limit tokens/s", "limit",
           "share of limit", "bits/elem fwd/bwd", "busiest direction bytes/step", "final loss", "peak RSS MB")
CONVERGENCE_COLUMNS = ("codec fwd/bwd", "steps", "seeds", "final loss (mean of last 10, mean over seeds)",
                       "vs none: mean (per seed)", "bits/elem fwd/bwd", "tokens/s")


@dataclass(frozen=True)
class CodecPair:
    """A forward and a backward codec with their parameters, written `fwd[:k=v,...]/bwd[:k=v,...]`;
    the forward one may carry a precision schedule, `fwd[:k=v]@start=S,end=E,k=v` (the run's first
    S and last E share of steps with those parameters: codec.forward_high_*)."""

    label: str
    forward: str
    forward_params: dict
    backward: str
    backward_params: dict
    schedule: dict = field(default_factory=dict)  # the [codec] settings of the schedule (forward_high_*)

    def codec_table(self) -> dict:
        """The run config's [codec] table that sends this pair."""
        return {"forward": self.forward, "backward": self.backward, "forward_params": self.forward_params,
                "backward_params": self.backward_params, **(self.schedule or NO_SCHEDULE)}

    @classmethod
    def parse(cls, text: str) -> "CodecPair":
        """`text` as above, or `default`: the pair a run sends when its [codec] table is unset."""
        from ..codecs import get_codec, parse_param_args

        if text.strip() == "default":
            c = CodecConfig()
            schedule = {"forward_high_params": c.high_params, "forward_high_start": c.forward_high_start,
                        "forward_high_end": c.forward_high_end}
            return cls("default", c.forward, c.forward_codec_params, c.backward, c.backward_params, schedule)
        halves = text.strip().split("/")
        if len(halves) != 2:
            raise ValueError(f"a codec pair is FORWARD/BACKWARD (e.g. tahquant/naive), got {text!r}")
        forward, _, high = halves[0].partition("@")
        parsed = []
        for half in (forward, halves[1]):
            name, _, params = half.partition(":")
            values = parse_param_args(name, [p for p in params.split(",") if p])
            get_codec(name, **values)  # unknown names and bad values fail here, not in the swarm
            parsed.append((name, values))
        (fw, fwp), (bw, bwp) = parsed
        if bw == "naive" and "bits" not in bwp:
            bwp = {"bits": 6}  # the paper's gradient codec
        return cls(text.strip(), fw, fwp, bw, bwp, cls._schedule(fw, high))

    @staticmethod
    def _schedule(forward: str, text: str) -> dict:
        if not text:
            return {}
        from ..codecs import parse_param_args

        items = dict(p.partition("=")[::2] for p in text.split(",") if p)
        try:
            start, end = float(items.pop("start", 0)), float(items.pop("end", 0))
        except ValueError:
            raise ValueError(f"a schedule's start and end are shares of the run's steps, got {text!r}") from None
        high = parse_param_args(forward, [f"{k}={v}" for k, v in items.items()])
        return {"forward_high_params": high, "forward_high_start": start, "forward_high_end": end}


@dataclass
class Row:
    rate_mbps: float          # 0: unshaped
    rtt_ms: float
    stages: int
    pair: str
    transport: str = "grpc"   # the nodes' data plane: grpc or p2p
    tokens_per_s: float = 0.0
    limit_tokens_per_s: float = 0.0
    limit: str = ""           # "link" or "compute"
    share: float = 0.0
    bits_fwd: float = 0.0
    bits_bwd: float = 0.0
    busiest_bytes_per_step: float = 0.0
    final_loss: float = 0.0
    peak_rss_mb: float = 0.0
    step_seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    seed: int = 0             # the run's seed (weights, data order): --seeds repeats a row with others

    def cells(self) -> list[str]:
        link = "unshaped" if not self.rate_mbps else f"{self.rate_mbps:g}"
        return [link, f"{self.rtt_ms:g}", str(self.stages), self.pair, self.transport, f"{self.tokens_per_s:,.0f}",
                f"{self.limit_tokens_per_s:,.0f}", self.limit, f"{100 * self.share:.0f}%",
                f"{self.bits_fwd:.2f} / {self.bits_bwd:.2f}", f"{self.busiest_bytes_per_step:,.0f}",
                f"{self.final_loss:.4f}", f"{self.peak_rss_mb:,.0f}"]

    @property
    def series(self) -> str:
        """What a plot's legend calls the row's line: its codec pair, and its transport if not gRPC."""
        return self.pair if self.transport == "grpc" else f"{self.pair} over {self.transport}"


@dataclass(frozen=True)
class Cell:
    """One row to run: where, which codecs, and with which seed."""

    rate: float
    rtt: float
    stages: int
    pair: CodecPair
    transport: TransportKind
    seed: int = 0

    @property
    def dirname(self) -> str:
        pair = self.pair.label.replace("/", "_").replace(":", "-").replace(",", "-")
        return (f"{self.stages}st-{self.rate:g}mbit-{self.rtt:g}ms-{pair}" + ("" if self.transport is TransportKind.GRPC
                else f"-{self.transport}") + (f"-seed{self.seed}" if self.seed else ""))

    def describe(self) -> str:
        link = f"{self.rate:g} Mbit/s" if self.rate else "unshaped"
        return (f"{self.stages} stages, {link}, RTT {self.rtt:g} ms, {self.pair.label}, {self.transport}"
                + (f", seed {self.seed}" if self.seed else ""))


@dataclass
class BenchConfig:
    """How every row trains and is measured (the matrix itself is `plan`'s)."""

    pairs: list[CodecPair]
    steps: int = 4             # measured steps
    unshaped_steps: int = 6    # measured steps of the unshaped rows: they set the compute limits
    warmup: int = 4            # the pipeline tries its cuts in these (tahnode.pipeline.schedule.SplitTuner)
    tokens_per_step: int = 32768
    seq_len: int = 128
    micro_batches: int = 0     # the user's split of a step (0: train.micro_batches' default)
    pipeline_micro_batches: int = 0  # the pipeline's (0: auto)
    model: str = "llama-thin"
    shaper: Shaper = Shaper.TC
    prefix: str = "tnb-"
    workdir: Path = Path("bench-swarm")
    lr_warmup_steps: int = 1   # short runs: the learning rate reaches its peak after one step
    device: str = "cpu"        # the nodes' --device (cuda: every stage on this machine's GPU)

    def run_toml(self, pair: CodecPair, steps: int, seed: int) -> str:
        samples = self.tokens_per_step // self.seq_len
        micro = self.micro_batches or 4
        train = {"steps": steps, "seq_len": self.seq_len, "micro_batches": micro, "batch_size": samples // micro,
                 "pipeline_micro_batches": self.pipeline_micro_batches, "seed": seed, "checkpoint_every": 10**6,
                 "warmup_steps": self.lr_warmup_steps}
        return toml_table("train", train) + toml_table("codec", pair.codec_table())

    def validate(self) -> "BenchConfig":
        samples = self.tokens_per_step // self.seq_len
        if self.tokens_per_step % self.seq_len or samples % (self.micro_batches or 4):
            raise ValueError(f"--tokens-per-step {self.tokens_per_step} must be whole micro-batches of "
                             f"--seq-len {self.seq_len}")
        for pair in self.pairs:  # the run config each row will use must be valid before anything starts
            RunConfig.build(self.model, None, **{"train.seq_len": self.seq_len, "codec.forward": pair.forward,
                                                 "codec.forward_params": pair.forward_params,
                                                 "codec.backward": pair.backward,
                                                 "codec.backward_params": pair.backward_params})
        return self


def final_loss(row: Row, last: int = 10) -> float:
    tail = row.losses[-last:]
    return sum(tail) / len(tail)
