"""The [swarm] table of the run configuration: how many pipelines train at once in data parallel,
how many spare nodes stand by, and how the replicas of a stage are kept in step (the outer step)."""

from __future__ import annotations

from dataclasses import dataclass

from .knob import knob, parse_switch

__all__ = ["SwarmConfig", "AUTO_PIPELINES", "OUTER_BITS", "parse_pipelines"]

AUTO_PIPELINES = 0          # --pipelines auto: as many as the nodes allow (up to max_pipelines)
OUTER_BITS = (2, 4, 8, 16, 32)  # bits of a pseudo-gradient value on the wire: blockwise 2, 4 or 8, float16, float32


def parse_pipelines(value) -> int:
    """`auto` (or 0) -> AUTO_PIPELINES, else a positive whole number of pipelines."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return AUTO_PIPELINES
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"pipelines is 'auto' or a whole number, got {value!r}") from None
    if number != float(value) or number < 0:
        raise ValueError(f"pipelines is 'auto' or a whole number >= 1, got {value!r}")
    return number


@dataclass
class SwarmConfig:
    """Pipelines in data parallel (docs/architecture.md, "Replicas in step"). Every field is a flag of
    `tahnode coordinator`, `tahnode demo` and `tahnode swarm up`."""

    pipelines: int = knob(AUTO_PIPELINES, "pipelines that train at once, each a chain of every stage: N, or auto for "
                          "as many as the nodes allow once --standbys are kept back", metavar="auto|N",
                          parse=parse_pipelines)
    max_pipelines: int = knob(64, "with --pipelines auto, never more than this many (the sample schedule keeps "
                              "this many pipelines' samples apart)")
    standbys: int = knob(1, "spare nodes kept back to take over a failed stage before another pipeline is formed")
    min_chain_share: float = knob(0.5, "a new pipeline must reach this share of the fastest pipeline's tokens/s (a "
                                  "slower one would set the pace of every outer step); its nodes stand by instead")
    max_per_host: int = knob(1, "replicas of one stage that one host may hold (its joins as the coordinator saw them); "
                             "above 0, a new pipeline is never formed wholly of one host's (or one public /24's) "
                             "nodes either. 0: no limit, for test swarms of many pipelines on one machine",
                             metavar="N")
    outer_every: int = knob(4, "the replicas of each stage average their pseudo-gradients every this many steps (H)",
                            metavar="STEPS")
    outer_lr: float = knob(1.0, "the outer step's learning rate (1 without momentum: the replicas' mean weights)")
    outer_momentum: float = knob(0.0, "the outer step's Nesterov momentum (DiLoCo's is 0.9 with outer lr 0.7); 0: none")
    outer_bits: int = knob(4, "bits of a pseudo-gradient value on the wire: 2, 4 or 8 (a bfloat16 scale per block of "
                           "64; 2 bits want --outer-feedback on), 16 (float16) or 32", choices=OUTER_BITS)
    outer_feedback: bool = knob(False, "error feedback: what the compressed means of a replica's pseudo-gradients "
                                "have not yet counted is added to its next one (SparseLoCo's)", metavar="on|off",
                                parse=parse_switch)
    outer_timeout_s: float = knob(30.0, "how long a replica waits for the others of its stage at an outer step; it "
                                  "goes ahead with those that came", flag="--outer-timeout", metavar="SECONDS")
    outer_clip: float = knob(2.0, "a reducer clips each replica's part to this many times its own part's norm from "
                             "it; one replica moves another's outer update by at most clip x (n-1)/n times that "
                             "update's norm, in a group of n (docs/security.md)", metavar="C")

    @property
    def auto(self) -> bool:
        return self.pipelines == AUTO_PIPELINES

    @property
    def data_slots(self) -> int:
        """The most pipelines the run may have (each has its lane of the sample stream): --pipelines N,
        else max_pipelines."""
        return self.max_pipelines if self.auto else self.pipelines

    def validate(self) -> "SwarmConfig":
        self.pipelines = parse_pipelines(self.pipelines)
        for name in ("max_pipelines", "outer_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"swarm.{name} must be >= 1, got {getattr(self, name)}")
        if self.standbys < 0:
            raise ValueError(f"swarm.standbys must be >= 0, got {self.standbys}")
        if self.max_per_host < 0:
            raise ValueError(f"swarm.max_per_host must be >= 0 (0: no limit), got {self.max_per_host}")
        if not 0 <= self.min_chain_share <= 1:
            raise ValueError(f"swarm.min_chain_share is a share of the fastest pipeline's speed, in [0, 1], "
                             f"got {self.min_chain_share}")
        if not self.outer_lr > 0:
            raise ValueError(f"swarm.outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"swarm.outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.outer_bits not in OUTER_BITS:
            raise ValueError(f"swarm.outer_bits must be one of {', '.join(map(str, OUTER_BITS))}, "
                             f"got {self.outer_bits}")
        if not self.outer_timeout_s > 0:
            raise ValueError(f"swarm.outer_timeout_s must be > 0 seconds, got {self.outer_timeout_s}")
        if not 0 < self.outer_clip <= 4:
            raise ValueError(f"swarm.outer_clip must be in (0, 4], got {self.outer_clip}")
        return self
