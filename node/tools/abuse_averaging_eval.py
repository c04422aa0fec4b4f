"""Held-out loss for `tahnode bench abuse --averaging`: the honest pipeline's last stage checkpoints of a swarm,
loaded into the in-process pipeline (tahnode.pipeline.replica), and one pipeline trained alone in-process.

The reference trains the run the swarm's checkpoints name (their run configuration: model, steps, batches, seed)
on pipeline 0's samples, as a single pipeline's daemons would: PipelineReplica gives the daemons' losses where
the codecs give the same bytes (tests/test_replica.py), and here there are no codecs. Held out: the last samples
of the data set that no pipeline of the run trains on (the daemons draw from all of it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["heldout_ids", "evaluate_checkpoints", "train_alone", "Alone"]


def heldout_ids(run, num_samples: int, count: int) -> list[int]:
    """The last `count` sample ids that no pipeline of `run` trains on in any of its steps."""
    from ..train.data import SampleSchedule

    if count < 1 or count * 4 > num_samples:
        raise ValueError(f"{count} held-out samples of a data set of {num_samples}: at least 1, at most a quarter")
    schedule = SampleSchedule.for_run(run, num_samples)
    trained = {i for p in range(run.swarm.data_slots) for step in range(run.train.steps)
               for i in schedule.ids_at(step, 0, schedule.samples_per_step, p)}
    out: list[int] = []
    for i in range(num_samples - 1, -1, -1):
        if i not in trained:
            out.append(i)
            if len(out) == count:
                break
    return sorted(out)


def _replica(run):
    """The in-process pipeline of `run` on its data set, on one torch thread (beside the other work of a machine
    of few cores, more threads made it 30 times slower here), and the data set's size."""
    import torch

    from ..pipeline.replica import PipelineReplica
    from ..train.data import open_dataset

    torch.set_num_threads(1)
    dataset = open_dataset(run)
    return PipelineReplica(run, dataset), len(dataset)


def evaluate_checkpoints(paths: list[Path], eval_samples: int) -> tuple[object, float]:
    """(the run configuration, the held-out loss) of the stage checkpoints `paths` (stage by stage, one step)."""
    from ..config import RunConfig
    from ..pipeline.checkpoint import NAME, Checkpoint, load, read_verified

    _, meta = read_verified(paths[0])
    run = RunConfig.from_json(meta["run"])
    replica, size = _replica(run)
    for stage, path in enumerate(paths):
        load(Checkpoint(path, stage, run.stages, int(NAME.search(path.name)[3])), replica.models[stage],
             replica.opts[stage].opt, run)
    return run, replica.evaluate(heldout_ids(run, size, eval_samples), run.train.batch_size)


@dataclass
class Alone:
    """One pipeline trained alone in-process: its held-out loss at the end and its loss of every step."""

    heldout: float = 0.0
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def train_alone(run, eval_samples: int) -> Alone:
    """Train `run`'s steps on pipeline 0's samples in this process; its held-out loss."""
    started = time.perf_counter()
    replica, size = _replica(run)
    losses = [replica.train_step(step) for step in range(run.train.steps)]
    heldout = replica.evaluate(heldout_ids(run, size, eval_samples), run.train.batch_size)
    return Alone(heldout, losses, time.perf_counter() - started)
