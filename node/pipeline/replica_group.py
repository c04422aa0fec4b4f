"""P pipelines of one run in one process, kept in step as a swarm keeps them: each trains its own
samples (pipeline p of the run's swarm.data_slots), and every swarm.outer_every steps (and at the
run's last step) the replicas of each stage average their pseudo-gradients, compressed as they
travel (tahnode.train.group_mean), and take the outer step. What `tahnode bench convergence
--pipelines` trains."""

from __future__ import annotations

import torch

from ..config import RunConfig
from ..train.data import TokenDataset
from ..train.group_mean import butterfly_mean
from ..train.outer import OuterOptimizer
from .replica import PipelineReplica

__all__ = ["ReplicaGroup", "outer_boundary"]


def outer_boundary(step: int, run: RunConfig) -> bool:
    """Whether the replicas average after optimizer step `step`: every outer_every steps, and at
    the run's last step (so the run ends with one model)."""
    return (step + 1) % run.swarm.outer_every == 0 or step + 1 == run.train.steps


class ReplicaGroup:
    """`run.swarm.pipelines` PipelineReplicas from the same initial weights, and their outer steps."""

    def __init__(self, run: RunConfig, dataset: TokenDataset, device: str = "cpu", init_from: str = "",
                 train_samples: int | None = None):
        if run.swarm.auto:
            raise ValueError("a replica group needs a number of pipelines, not auto")
        self.run = run
        self.replicas = [PipelineReplica(run, dataset, device, init_from, train_samples, pipeline=p)
                         for p in range(run.swarm.pipelines)]
        self.outer = [[OuterOptimizer(model.parameters(), run.swarm) for model in r.models] for r in self.replicas]
        self.averaging_bytes = 0   # what every replica sent for the outer steps, all together
        self.outer_steps = 0
        self.clipped = 0           # parts a reducer clipped or left out (rare among honest replicas)
        self.kept = 0              # averages a sender refused, keeping its own part (a reducer's, or too far)
        self.spread = 0.0          # the largest |difference| between two replicas' weights after an outer step

    @property
    def stats(self):
        """Replica 0's counters (every replica sends the same sizes)."""
        return self.replicas[0].stats

    @property
    def errors(self):
        return self.replicas[0].errors

    def train_step(self, step: int) -> float:
        """Train step `step` on every pipeline (and the outer step after it, at a boundary); the
        mean of their losses."""
        losses = [r.train_step(step) for r in self.replicas]
        if len(self.replicas) > 1 and outer_boundary(step, self.run):
            self.outer_step()
        return sum(losses) / len(losses)

    def outer_step(self) -> None:
        swarm = self.run.swarm
        for k in range(self.run.stages):
            outers = [group[k] for group in self.outer]
            result = butterfly_mean([o.pseudo_gradient() for o in outers], swarm.outer_bits, swarm.outer_clip)
            for outer, mean, counted in zip(outers, result.means, result.counted):
                outer.step(mean)
                outer.feed_back(counted)
            self.averaging_bytes += sum(result.bytes_sent)
            self.clipped += sum(len(c) for c in result.clipped)
            self.kept += sum(len(k) for k in result.kept)
            first = torch.cat([a.reshape(-1) for a in outers[0].anchor])
            for other in outers[1:]:
                diff = torch.cat([a.reshape(-1) for a in other.anchor]) - first
                self.spread = max(self.spread, float(diff.abs().max()))
        self.outer_steps += 1

    def evaluate(self, sample_ids: list[int], batch_size: int) -> float:
        """Held-out loss of replica 0's model (after an outer step every replica holds nearly the same)."""
        return self.replicas[0].evaluate(sample_ids, batch_size)
