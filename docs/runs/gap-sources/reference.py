"""The bench's reference run (none/none, llama-tiny in 3 stages, 4 messages of 32 x 128 tokens a step, lr 3e-3
after 60 warm-up steps, stdlib) as a PipelineReplica, for the scripts beside it (benchmarks-log.md, issue 41)."""
import torch

from tahnode.pipeline.replica import PipelineReplica
from tahnode.tools.bench_convergence import REFERENCE_MESSAGES_PER_STEP, REFERENCE_TRAIN
from tahnode.tools.convergence_runs import RunSpec, _heldout
from tahnode.train.data import open_dataset


def reference(seed: int = 0):
    """(replica, held-out sample ids) of the bench's none/none run of `seed`, one torch thread."""
    torch.set_num_threads(1)
    spec = RunSpec(pair="none/none", forward="none", forward_params={}, backward="none", backward_params={},
                   seed=seed, model="llama-tiny", stages=3, steps=300, seq_len=128, samples_per_message=32,
                   messages_per_step=REFERENCE_MESSAGES_PER_STEP, train=dict(REFERENCE_TRAIN))
    run = spec.run_config()
    dataset = open_dataset(run)
    train_samples, heldout = _heldout(dataset, spec.eval_samples)
    return PipelineReplica(run, dataset, "cpu", "", train_samples), heldout


def boundary_activations(replica, at=(100, 199)):
    """Train `replica` through the last step of `at`; [(step, sender stage, its activations as (tokens, C)
    float32)] of every message sent forward in the steps of `at`."""
    caught, cross = [], replica._cross_forward

    def keep(sender, out, ids, step):
        if step in at:
            caught.append((step, sender, out.detach().reshape(-1, out.shape[-1]).float()))
        return cross(sender, out, ids, step)

    replica._cross_forward = keep
    for step in range(max(at) + 1):
        replica.train_step(step)
    replica._cross_forward = cross
    return caught
