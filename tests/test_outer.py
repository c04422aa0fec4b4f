"""The replicas' outer step in numbers: the blockwise pseudo-gradient codec (sizes, error bound,
refusal of bad bytes), the outer optimizer (plain averaging is the mean of the replicas, Nesterov's
update, its checkpoint tensors), the butterfly mean with its refusal rule, and P pipelines in one
process against one pipeline with P times the batch."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tahnode.codecs import blockwise
from tahnode.config.swarm import SwarmConfig
from tahnode.pipeline.replica import PipelineReplica
from tahnode.pipeline.replica_group import ReplicaGroup, outer_boundary
from tahnode.train.group_mean import butterfly_mean
from tahnode.train.outer import OuterOptimizer
from test_pipeline_inproc import build_run, dataset  # noqa: F401  (dataset is a fixture)


@settings(max_examples=40, deadline=None)
@given(count=st.integers(0, 300), bits=st.sampled_from([4, 8]), scale=st.sampled_from([1e-8, 1e-3, 1.0, 1e4]),
       seed=st.integers(0, 2**16))
def test_blockwise_codes_within_half_a_step_of_each_block(count, bits, scale, seed):
    x = torch.randn(count, generator=torch.Generator().manual_seed(seed)) * scale
    data = blockwise.quantize(x, bits)
    assert len(data) == blockwise.encoded_size(count, bits)
    y = blockwise.dequantize(data, count)
    qmax = (1 << (bits - 1)) - 1
    for start in range(0, count, blockwise.BLOCK):
        block = x[start:start + blockwise.BLOCK]
        step = float(block.abs().max()) / qmax * (1 + 2**-7)  # the scale, rounded up to bfloat16
        assert float((y[start:start + blockwise.BLOCK] - block).abs().max()) <= step / 2 + 1e-12 * scale


@settings(max_examples=40, deadline=None)
@given(count=st.integers(0, 300), scale=st.sampled_from([1e-8, 1e-3, 1.0, 1e4]), seed=st.integers(0, 2**16),
       heavy=st.booleans())
def test_two_bit_codes_take_the_level_nearest_each_value_or_the_outermost(count, scale, seed, heavy):
    """Levels at -1.5, -0.5, 0.5, 1.5 x the block's RMS (rounded up to bf16): a value within 2 x it is
    at most half a level step (one scale) / 2 off; a larger one is clipped to the outer level."""
    x = torch.randn(count, generator=torch.Generator().manual_seed(seed)) * scale
    if heavy:
        x = x ** 3 / scale ** 2  # heavy tails: some values far beyond the RMS
    data = blockwise.quantize(x, 2)
    assert len(data) == blockwise.encoded_size(count, 2) == 12 + 2 * -(-count // 64) + -(-count // 4)
    y = blockwise.dequantize(data, count)
    blocks = -(-count // blockwise.BLOCK)
    scales = (torch.frombuffer(bytearray(data[12:12 + 2 * blocks]), dtype=torch.int16).to(torch.int32) << 16
              ).view(torch.float32) if blocks else []
    for start, step in zip(range(0, count, blockwise.BLOCK), scales):
        block, got, step = x[start:start + blockwise.BLOCK], y[start:start + blockwise.BLOCK], float(step)
        rms = float(block.double().square().mean().sqrt())
        assert rms <= step <= rms * (1 + 2**-7) + 1e-30  # the RMS rounded up to bfloat16
        inside = block.abs() <= 2 * step
        if bool(inside.any()):
            assert float((got - block)[inside].abs().max()) <= step / 2 * (1 + 1e-6)
        assert torch.equal(got[~inside], torch.sign(block[~inside]) * 1.5 * step)


def test_blockwise_sizes_and_refusals():
    x = torch.linspace(-1, 1, 1000)
    assert 8 * len(blockwise.quantize(x, 8)) / 1000 == pytest.approx(8.25, abs=0.11)  # 8 bits + 16 per 64, + a header
    assert 8 * len(blockwise.quantize(x, 4)) / 1000 == pytest.approx(4.25, abs=0.11)
    assert 8 * len(blockwise.quantize(x, 2)) / 1000 == pytest.approx(2.25, abs=0.11)
    with pytest.raises(blockwise.BlockwiseError, match="not finite"):
        blockwise.quantize(torch.tensor([1.0, float("nan")]), 8)
    with pytest.raises(blockwise.BlockwiseError, match="not 3"):
        blockwise.quantize(x, 3)
    good = blockwise.quantize(x, 4)
    with pytest.raises(blockwise.BlockwiseError, match="1000 values, 999 were expected"):
        blockwise.dequantize(good, 999)
    with pytest.raises(blockwise.BlockwiseError, match="bytes, but 1000 values"):
        blockwise.dequantize(good[:-1])
    with pytest.raises(blockwise.BlockwiseError, match="magic"):
        blockwise.dequantize(b"XXXX" + good[4:])
    huge = struct.pack("<4sB3xI", b"TBQ1", 8, 2**31)  # claims 2^31 values: refused before any allocation
    with pytest.raises(blockwise.BlockwiseError, match="bytes, but"):
        blockwise.dequantize(huge)
    nan_scale = bytearray(blockwise.quantize(torch.ones(64), 8))
    nan_scale[12:14] = (0x7FC0).to_bytes(2, "little")
    with pytest.raises(blockwise.BlockwiseError, match="scale"):
        blockwise.dequantize(bytes(nan_scale))
    bad_code = bytearray(blockwise.quantize(torch.ones(64), 8))
    bad_code[-1] = 0x80  # -128: outside -127..127
    with pytest.raises(blockwise.BlockwiseError, match="code"):
        blockwise.dequantize(bytes(bad_code))


def _replicas(n: int, momentum: float = 0.0):
    torch.manual_seed(0)
    base = [torch.randn(3, 4), torch.randn(5)]
    swarm = SwarmConfig(outer_momentum=momentum, outer_lr=1.0 if not momentum else 0.7)
    params = [[torch.nn.Parameter(t.clone()) for t in base] for _ in range(n)]
    return params, [OuterOptimizer(p, swarm) for p in params]


def test_plain_averaging_sets_every_replica_to_the_mean_of_their_weights():
    params, outers = _replicas(3)
    with torch.no_grad():
        for k, group in enumerate(params):  # each replica's inner steps move it its own way
            for p in group:
                p.add_(torch.randn_like(p) * (k + 1))
    mean = [torch.stack([group[i].detach() for group in params]).mean(0) for i in range(2)]
    pseudo = [o.pseudo_gradient() for o in outers]
    averaged = torch.stack(pseudo).mean(0)
    for o in outers:
        o.step(averaged)
    for group in params:
        for p, m in zip(group, mean):
            assert torch.allclose(p, m, atol=1e-6)
    assert torch.equal(outers[0].pseudo_gradient(), torch.zeros(17))  # the new outer weights are the parameters


def test_nesterov_outer_step_and_its_checkpoint_tensors():
    params, (outer,) = _replicas(1, momentum=0.9)
    start = torch.cat([p.detach().reshape(-1) for p in params[0]])
    g = torch.full((17,), 0.1)
    outer.step(g)  # m = g; update = g + 0.9 m = 1.9 g
    assert torch.allclose(torch.cat([p.detach().reshape(-1) for p in params[0]]), start - 0.7 * 1.9 * g)
    outer.step(g)  # m = 1.9 g; update = g + 0.9 * 1.9 g
    assert torch.allclose(outer.tensors()["anchor"], start - 0.7 * (1.9 + 2.71) * g, atol=1e-6)
    saved = outer.tensors()
    _, (fresh,) = _replicas(1, momentum=0.9)
    fresh.load(saved)
    assert torch.equal(fresh.tensors()["momentum"], saved["momentum"])
    assert torch.equal(fresh.tensors()["anchor"], saved["anchor"])
    with pytest.raises(ValueError, match="16 values for a stage of 17"):
        fresh.load({"anchor": torch.zeros(16)})


@pytest.mark.parametrize("bits", [32, 16, 8, 4, 2])
def test_the_butterfly_mean_of_honest_replicas(bits):
    torch.manual_seed(1)
    vectors = [torch.randn(1000) * 1e-3 for _ in range(3)]
    result = butterfly_mean(vectors, bits)
    exact = torch.stack(vectors).mean(0)
    tolerance = {32: 1e-9, 16: 2e-6, 8: 5e-5, 4: 1e-3, 2: 2e-3}[bits]
    for mean in result.means:
        assert float((mean - exact).abs().max()) < tolerance
    assert result.clipped == [set(), set(), set()] or bits == 2  # 2 bits: a part's rounding may pass the radius
    # every replica takes the same average: they stay equal to the bit
    for mean in result.means[1:]:
        assert torch.equal(mean, result.means[0])
    if bits == 8:  # each third crosses twice to its reducer and twice back as a delta
        assert sum(result.bytes_sent) == 4 * (2 * blockwise.encoded_size(333, 8) + blockwise.encoded_size(334, 8))


@pytest.mark.parametrize("bits", [4, 8])
def test_what_the_mean_counted_of_each_replica_averages_to_the_mean_they_took(bits):
    """A replica's parts as their reducers decoded them, and for the part it reduced its own values less
    the mean's rounding times the senders: their average over the group is the mean every replica took."""
    torch.manual_seed(3)
    vectors = [torch.randn(1000) * 1e-3 for _ in range(3)]
    result = butterfly_mean(vectors, bits)
    assert float((torch.stack(result.counted).mean(0) - result.means[0]).abs().max()) < 1e-9
    third = slice(333, 666)  # replica 1 reduces the second third; replica 0's went there compressed
    assert torch.equal(result.counted[0][third], blockwise.dequantize(blockwise.quantize(vectors[0][third], bits)))
    assert not torch.equal(result.counted[1][third], vectors[1][third])  # it carries its mean's rounding


def test_error_feedback_keeps_the_sum_of_rounded_means_on_the_sum_of_true_ones():
    """Rounds of the same pseudo-gradients at 4 bits: with each replica's residual (vector - counted)
    added to its next, the applied means add up to the true ones within a rounding step; without, the
    rounding's bias adds up round after round."""
    torch.manual_seed(4)
    grads = [torch.randn(640) * 1e-3 + 3e-4 for _ in range(3)]
    exact = torch.stack(grads).mean(0)
    drift = {}
    for feedback in (True, False):
        residuals, total = [torch.zeros(640) for _ in grads], torch.zeros(640)
        for _ in range(40):
            sent = [g + r for g, r in zip(grads, residuals)]
            result = butterfly_mean(sent, 4)
            total += result.means[0]
            if feedback:
                residuals = [v - c for v, c in zip(sent, result.counted)]
        drift[feedback] = float((total - 40 * exact).abs().max())
    step = float(torch.stack(grads).abs().max()) / 7  # about one 4-bit step
    assert drift[True] < 2 * step < drift[False] / 5


def test_an_outer_optimizer_with_feedback_carries_its_residual_and_keeps_it_in_its_own_tensors():
    torch.manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(7))]
    outer = OuterOptimizer(params, SwarmConfig(outer_feedback=True))
    with torch.no_grad():
        params[0].sub_(0.5)
    sent = outer.pseudo_gradient()
    assert torch.allclose(sent, torch.full((7,), 0.5))
    counted = torch.full((7,), 0.4)
    outer.step(torch.full((7,), 0.45))
    outer.feed_back(counted)
    assert torch.allclose(outer.own_tensors()["residual"], torch.full((7,), 0.1))
    with torch.no_grad():
        params[0].sub_(0.5)
    assert torch.allclose(outer.pseudo_gradient(), torch.full((7,), 0.6))  # its next adds the residual
    outer.reset()  # a round without a group: it steps by its own change, and the residual waits for the next
    outer.feed_back(torch.zeros(7))
    assert torch.allclose(outer.own_tensors()["residual"], torch.full((7,), 0.1))
    outer.pseudo_gradient()
    outer.feed_back(None)  # a mean that counted all of it
    assert torch.equal(outer.own_tensors()["residual"], torch.zeros(7))
    assert set(outer.tensors()) == {"anchor"}  # what peers are served: never a replica's residual
    fresh = OuterOptimizer([torch.nn.Parameter(torch.zeros(7))], SwarmConfig(outer_feedback=True))
    fresh.load_own(outer.own_tensors())
    assert torch.equal(fresh.own_tensors()["residual"], outer.own_tensors()["residual"])
    fresh.forget_residual()
    assert torch.equal(fresh.own_tensors()["residual"], torch.zeros(7))
    with pytest.raises(ValueError, match="6 values for a stage of 7"):
        fresh.load_own({"residual": torch.zeros(6)})
    assert OuterOptimizer(params, SwarmConfig()).own_tensors() == {}  # without feedback: none


@pytest.mark.parametrize("poison", [float("nan"), 1e30])
def test_a_poisoned_pseudo_gradient_never_moves_an_honest_replica_beyond_the_bound(poison):
    """NaN is left out by every honest reducer (their parts: the honest mean); 1e30 is clipped to the radius.
    The liar's own third comes back refused (not finite, or far beyond the radius): the honest keep theirs."""
    torch.manual_seed(2)
    honest = [torch.randn(600) * 1e-3 for _ in range(2)]
    bad = torch.full((600,), poison)
    sent = [honest[0], bad, honest[1]]
    result = butterfly_mean(sent, 32)
    exact = (honest[0] + honest[1]) / 2
    assert result.clipped[0] == {1} and result.clipped[2] == {1}
    for k in (0, 2):
        assert float((result.means[k] - sent[k]).norm()) <= 2 * 2 / 3 * float(sent[k].norm()) * (1 + 1e-5)
        assert k in result.kept[1]  # the liar's third: refused, its own kept
        assert torch.equal(result.means[k][200:400], sent[k][200:400])
        if poison != poison:  # NaN: left out, the honest parts are the honest mean
            for lo in (0, 400):
                assert torch.allclose(result.means[k][lo:lo + 200], exact[lo:lo + 200], atol=1e-9)
    assert not {0, 2} & (result.kept[0] | result.kept[2])


def test_two_pipelines_train_like_one_with_twice_the_batch(dataset):
    """With an outer step after every step at 32 bits, two pipelines train on the samples one pipeline
    with twice the batch trains on over the run (their lanes of the stream are its steps' halves), and
    about as well (AdamW is not linear, and each step groups the samples otherwise); the replicas stay
    identical."""
    steps = 4
    overrides = {"codec.forward": "none", "codec.backward": "none", "codec.backward_params": {},
                 "train.micro_batches": 2, "train.pipeline_micro_batches": 2}
    group_run = build_run(steps, **overrides, **{"swarm.pipelines": 2, "swarm.outer_every": 1, "swarm.outer_bits": 32})
    group = ReplicaGroup(group_run, dataset)
    losses = [group.train_step(s) for s in range(steps)]
    big = build_run(steps,
                    **{**overrides, "train.micro_batches": 4, "train.pipeline_micro_batches": 4, "swarm.pipelines": 1})
    reference = PipelineReplica(big, dataset)
    expected = [reference.train_step(s) for s in range(steps)]
    trained = {i for r in group.replicas for s in range(steps) for m in range(2)
               for i in r.schedule.ids(s, m, r.pipeline)}
    assert trained == {i for s in range(steps) for m in range(4) for i in reference.schedule.ids(s, m)}
    assert sum(losses) / steps == pytest.approx(sum(expected) / steps, rel=0.02)
    assert group.outer_steps == steps and group.clipped == 0 and group.kept == 0 and group.spread == 0
    assert group.averaging_bytes > 0


def test_the_outer_boundaries_of_a_run():
    run = build_run(10, **{"swarm.outer_every": 4})
    assert [s for s in range(10) if outer_boundary(s, run)] == [3, 7, 9]  # the last step always averages
