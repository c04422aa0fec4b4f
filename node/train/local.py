"""Single-process training of the same run (the whole model on one device): the yardstick the
pipeline must match with codec `none` in fp32, and a quick way to train without a swarm."""

from __future__ import annotations


from ..config import RunConfig
from .data import SampleSchedule, TokenDataset
from .hf import load_stage_from_hf
from .model import COMPUTE_DTYPES, full_model
from .optim import StageOptimizer, grad_sumsq


def train_local(run: RunConfig, dataset: TokenDataset, steps: int | None = None, device: str = "cpu",
                init_from: str = "") -> list[float]:
    """Train `steps` steps (default run.train.steps) exactly as the pipeline does, from the weights of
    the Hugging Face checkpoint folder `init_from` if given; return the mean loss of each step."""
    t = run.train
    dtype = COMPUTE_DTYPES[t.dtype]
    model = full_model(run.model, seed=t.seed, dtype=dtype)
    if init_from:
        load_stage_from_hf(model, init_from)
    model = model.to(device)
    opt = StageOptimizer(model.parameters(), t)
    schedule = SampleSchedule.for_run(run, len(dataset))  # pipeline 0's samples
    losses = []
    for step in range(steps if steps is not None else t.steps):
        total = 0.0
        for mb in range(t.micro_batches):
            tokens, labels = dataset.batch(schedule.ids(step, mb))
            loss = model.loss(model(tokens.to(device)), labels.to(device))
            (loss / t.micro_batches).backward()
            total += float(loss.detach())
        opt.apply(step, grad_sumsq(opt.params))
        losses.append(total / t.micro_batches)
    return losses
