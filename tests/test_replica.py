"""The pipeline replica (tahnode.pipeline.replica, what `tahnode bench convergence` trains) is the
pipeline: for each main codec pair, a few steps give the in-process pipeline's losses exactly, and
held-out samples stay out of its training."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from tahnode.net.transport import BACKWARD, FORWARD
from tahnode.pipeline.replica import PipelineReplica
from test_pipeline_inproc import Swarm, build_run, dataset, train  # noqa: F401  (dataset is a fixture)

PAIRS = [
    ("none", {}, "none", {}),
    ("tahquant-paper", {}, "naive", {"bits": 6}),
    ("tahquant-paper", {}, "tahquant-paper", {}),
    ("tahquant", {"group_size": 128, "qmax": 12}, "pertoken", {}),
    ("aqsgd", {}, "pertoken", {}),
    ("amaq", {}, "naive", {"bits": 6}),
]


def replica_losses(run, dataset, steps: int, **kwargs) -> list[float]:
    replica = PipelineReplica(run, dataset, **kwargs)
    return [replica.train_step(step) for step in range(steps)]


@pytest.mark.parametrize("fwd,fwd_params,bwd,bwd_params", PAIRS, ids=[f"{p[0]}/{p[2]}" for p in PAIRS])
def test_replica_gives_the_pipelines_losses(dataset, fwd, fwd_params, bwd, bwd_params):
    steps = 3
    run = build_run(steps, **{"codec.forward": fwd, "codec.forward_params": fwd_params, "codec.backward": bwd,
                              "codec.backward_params": bwd_params, "train.pipeline_micro_batches": 2, "train.seed": 1})
    swarm = asyncio.run(train(Swarm(run, dataset), steps))
    assert replica_losses(run, dataset, steps) == swarm.losses()


def test_replica_of_a_ring_gives_the_pipelines_losses(dataset):
    """Tied embeddings: the last stage's hidden states cross back to stage 0's head, compressed."""
    run = build_run(3, **{"train.pipeline_micro_batches": 2, "stages": 3})
    run.model = dataclasses.replace(run.model, tie_embeddings=True)
    run.codec.backward, run.codec.backward_params = "pertoken", {}
    swarm = asyncio.run(train(Swarm(run, dataset), 3))
    assert replica_losses(run, dataset, 3) == swarm.losses()


def test_held_out_samples_are_never_trained_on(dataset):
    run = build_run(4, **{"codec.forward": "none", "codec.backward": "none", "codec.backward_params": {},
                          "swarm.pipelines": 1})
    replica = PipelineReplica(run, dataset, train_samples=len(dataset) - 8)
    epoch = -(-len(dataset) // replica.schedule.samples_per_step)
    seen = {i for step in range(epoch) for mb in range(run.train.micro_batches) for i in replica.schedule.ids(step, mb)}
    assert seen == set(range(len(dataset) - 8))
    before = replica.evaluate(list(range(len(dataset) - 8, len(dataset))), 4)
    for step in range(4):
        replica.train_step(step)
    after = replica.evaluate(list(range(len(dataset) - 8, len(dataset))), 4)
    assert after < before  # it learns the data's shape, on samples it never saw


def test_crossing_errors_are_measured(dataset):
    run = build_run(1, **{"codec.forward": "tahquant", "codec.backward": "pertoken", "codec.backward_params": {},
                          "codec.forward_high_params": {}})  # 4 bits in step 0 too: no precision schedule
    replica = PipelineReplica(run, dataset)
    replica.train_step(0)
    fwd, bwd = replica.errors.mean(FORWARD), replica.errors.mean(BACKWARD)
    assert 0.03 < fwd < 0.3 and 0.005 < bwd < 0.1, (fwd, bwd)
    assert replica.errors.counts[FORWARD] == replica.errors.counts[BACKWARD] == 2 * run.train.micro_batches


def test_a_precision_schedule_sends_the_first_and_last_steps_at_its_bits(dataset):
    """codec.forward_high_*: the first and last shares of the run's steps carry activations with
    other parameters (here every token at 4 bits more); the pipeline and the replica agree on which."""
    steps = 4
    schedule = {"codec.forward": "tahquant-paper", "codec.forward_params": {},
                "codec.forward_high_params": {"bits_high": 8, "bits_low": 7},
                "codec.forward_high_start": 0.25, "codec.forward_high_end": 0.25, "codec.backward": "pertoken",
                "codec.backward_params": {}, "train.pipeline_micro_batches": 2}
    run = build_run(steps, **schedule)
    assert [run.codec.high_phase(k, steps) for k in range(steps)] == [True, False, False, True]
    swarm = asyncio.run(train(Swarm(run, dataset), steps))
    replica = PipelineReplica(run, dataset)
    assert [replica.train_step(k) for k in range(steps)] == swarm.losses()
    plain = PipelineReplica(build_run(steps, **{**schedule, "codec.forward_high_params": {}}), dataset)
    for k in range(steps):
        plain.train_step(k)
    bits, plain_bits = replica.stats.bits_per_element(FORWARD), plain.stats.bits_per_element(FORWARD)
    assert bits == pytest.approx(plain_bits + 2, rel=0.01)  # half the steps at 4 more bits per element


def test_tahquant_runs_with_its_precision_schedule_unless_told_otherwise():
    """The default [codec]: tahquant at its defaults (G = 128, qmax 12) with its own high-precision
    grid (qmax 31) for the first 12% of the steps; tahquant-paper with 6 bits; {} turns it off;
    another forward codec has neither; a TOML or JSON round trip keeps the choice."""
    from tahnode.codecs import get_codec
    from tahnode.config import RunConfig

    run = RunConfig.build("llama-tiny", None, **{"train.steps": 100})
    assert run.codec.forward_params is None and run.codec.forward_codec_params == {}
    assert get_codec(run.codec.forward).header_params() == {"group_size": 128, "qmax": 12}
    assert run.codec.scheduled and run.codec.high_params == {"qmax": 31}
    assert [k for k in range(100) if run.codec.high_phase(k, 100)] == list(range(12))
    assert run.codec.label == "tahquant@start=0.12,end=0,qmax=31/pertoken"
    paper = RunConfig.build("llama-tiny", None, **{"codec.forward": "tahquant-paper", "codec.forward_params": {}})
    assert paper.codec.high_params == {"bits_high": 6, "bits_low": 6}
    assert paper.codec.label == "tahquant-paper@start=0.12,end=0,bits_high=6,bits_low=6/pertoken"
    assert "forward_params = {}" in paper.to_toml() and RunConfig.from_json(paper.to_json()).codec == paper.codec
    assert not RunConfig.build("llama-tiny", None, **{"codec.forward_high_params": {}}).codec.scheduled
    assert not any(run.codec.high_phase(k, 8) for k in range(8))  # 12% of 8 steps: no whole step
    naive = RunConfig.build("llama-tiny", None, **{"codec.forward": "naive"})
    assert not naive.codec.scheduled and naive.codec.label == "naive/pertoken"
    off = RunConfig.build("llama-tiny", None, **{"codec.forward_high_params": {}})
    assert (RunConfig.from_json(run.to_json()).codec == run.codec
            and RunConfig.from_json(off.to_json()).codec == off.codec)
    assert "forward_high_params" not in run.to_toml() and "forward_high_params = {}" in off.to_toml()
    assert "forward_params" not in run.to_toml()


def test_the_replica_fine_tunes_a_hugging_face_checkpoint(dataset, tmp_path):
    """--init-from: every stage starts from its slice of a transformers-saved Llama (the paper's
    own setting is fine-tuning), and trains from there."""
    import torch
    import transformers

    from tahnode.config import RunConfig

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                                                                num_hidden_layers=2, num_attention_heads=4,
                                                                num_key_value_heads=2))
    hf.save_pretrained(tmp_path / "hf")
    run = RunConfig.build(str(tmp_path / "hf"), **{"stages": 2, "train.steps": 2, "train.micro_batches": 2,
                                                    "train.batch_size": 2, "train.seq_len": 32})
    replica = PipelineReplica(run, dataset, init_from=str(tmp_path / "hf"))
    assert torch.equal(replica.models[0].model.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert torch.equal(replica.models[1].lm_head.weight, hf.lm_head.weight)
    losses = [replica.train_step(k) for k in range(2)]
    assert all(0 < x < 10 for x in losses)
