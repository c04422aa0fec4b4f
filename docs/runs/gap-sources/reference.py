"""The bench's reference run (none/none, llama-tiny in 3 stages, 4 messages of 32 x 128 tokens a step, lr 3e-3
after 60 warm-up steps, stdlib) as a PipelineReplica, for the scripts beside it (benchmarks-log.md, issue 41)."""
import torch

from tahnode.kernels import symtiles_ref as tiles
from tahnode.kernels import tahquant_rice_ref as rice
from tahnode.pipeline.replica import PipelineReplica
from tahnode.tools.bench_convergence import REFERENCE_MESSAGES_PER_STEP, REFERENCE_TRAIN
from tahnode.tools.convergence_runs import RunSpec, _heldout
from tahnode.train.data import open_dataset

G = 128  # the default forward codec's tile


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


def bits_and_error(y, s, qmax, sent_apart=None):
    """(bits per element of the Rice-coded payload, relative error per token, RMS over the tokens) of y (N, C), rotated,
    on the grid of the tiles' scales s; `sent_apart` (N, C) bool: values off the grid, sent as bf16 (bits not counted)."""
    on_grid = y if sent_apart is None else y.masked_fill(sent_apart, 0.0)
    q = tiles.quantize(on_grid, s, G, qmax)
    yq = tiles.dequantize(q, s, G, qmax)
    if sent_apart is not None:
        yq = torch.where(sent_apart, y.bfloat16().float(), yq)
    error = ((yq - y).norm(dim=1) / y.norm(dim=1)).pow(2).mean().sqrt()
    return 8 * rice.pack(s, q, qmax).numel() / y.numel(), float(error)
