"""The clip rule in numbers (tahnode.train.clip_rule, through group_mean.butterfly_mean): what an honest
replica steps by stays within the stated bound of its own pseudo-gradient whatever the others send, in
groups of two and of four (issue 60, finding 3: a liar sending -9 times its own steered its partner
against its own update at 4 times its size; a tiny vector made the honest reducer refuse its own part;
two replicas sending zeros made the honest ones refuse each other); and among honest replicas the rule is
the plain mean, the same bytes for every replica."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tahnode.train.clip_rule import CLIP, acceptance_radius, centred_clip, rounding_slack, takes
from tahnode.train.group_mean import butterfly_mean

SIZE = 4000


def honest(count: int, seed: int, shared: float = 0.6) -> list[torch.Tensor]:
    """Pseudo-gradients of replicas that trained on different samples from one model: a shared direction
    and their own noise (cosine about `shared` between two)."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(SIZE, generator=g)
    return [(math.sqrt(shared) * common + math.sqrt(1 - shared) * torch.randn(SIZE, generator=g)) * 1e-3
            for _ in range(count)]


def lie(kind: str, own: torch.Tensor, seed: int = 0) -> torch.Tensor:
    if kind == "-9x":
        return -9 * own
    if kind == "tiny":
        return own * 1e-9
    if kind == "zeros":
        return torch.zeros_like(own)
    if kind == "huge":
        return own * 1e30
    noise = torch.randn(own.shape, generator=torch.Generator().manual_seed(seed))
    return noise * (float(own.norm()) / float(noise.norm()))  # random, of the same norm


def bound(own: torch.Tensor, group: int, bits: int) -> float:
    return CLIP * (group - 1) / group * (1 + rounding_slack(bits)) * float(own.norm()) * (1 + 1e-6)


@pytest.mark.parametrize("bits", [32, 8, 4])
@pytest.mark.parametrize("kind", ["-9x", "tiny", "zeros", "random", "huge"])
def test_in_a_group_of_two_the_liar_moves_the_honest_update_by_at_most_its_own_norm(kind, bits):
    """The finding's cases, and more: the honest replica's step differs from what it would take alone by
    at most its own pseudo-gradient's norm (plus the codec's slack), whoever reduces which half; -9x no
    longer reverses it (cosine -0.95 at 4x its size before)."""
    mine, theirs = honest(2, seed=1)
    sent = lie(kind, theirs, seed=2)
    for order in ((mine, sent), (sent, mine)):
        result = butterfly_mean(list(order), bits)
        k = 0 if order[0] is mine else 1
        step = result.means[k]
        assert float((step - mine).norm()) <= bound(mine, 2, bits)
        assert float(torch.nn.functional.cosine_similarity(step, mine, dim=0)) > -0.1  # never turned against it


@pytest.mark.parametrize("liars", [1, 2])
def test_in_a_group_of_four_zeros_from_two_replicas_never_turn_the_honest_ones_against_each_other(liars):
    """Two replicas sending zeros: every honest reducer still averages the other honest replica's part
    unclipped (before, the lower median of the norms was 0 and each honest reducer refused the other);
    the honest replicas keep within the bound of their own update."""
    vectors = honest(4, seed=3)
    sent = [lie("zeros", v) if k >= 4 - liars else v for k, v in enumerate(vectors)]
    result = butterfly_mean(sent, 8)
    for j in range(4 - liars):  # parts honest replicas reduced: no honest sender clipped or left out
        assert not result.clipped[j] & set(range(4 - liars))
    for k in range(4 - liars):
        assert float((result.means[k] - vectors[k]).norm()) <= bound(vectors[k], 4, 8)
        assert not result.kept[k] & set(range(4 - liars))  # an honest reducer's average, taken by the honest


def test_honest_replicas_take_the_plain_mean_and_the_same_bytes():
    vectors = honest(3, seed=4)
    result = butterfly_mean(vectors, 32)
    exact = torch.stack(vectors).mean(0)
    assert float((result.means[0] - exact).abs().max()) < 1e-9
    assert all(torch.equal(m, result.means[0]) for m in result.means[1:])  # bit for bit: their digests agree
    assert result.clipped == [set(), set(), set()] and result.kept == [set(), set(), set()]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), group=st.integers(2, 6), scale=st.floats(1e-6, 1e6), bits=st.sampled_from([32, 4]))
def test_an_honest_reducers_average_always_lies_within_its_own_acceptance(seed, group, scale, bits):
    """Whatever the other parts are (any scale, any direction, some not finite), the clipped average lies
    within CLIP (n-1)/n of the reducer's own part's norm of it: its own check always takes it."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(64, generator=g) * (scale if k else 1.0) * torch.rand(1, generator=g) for k in range(group)]
    parts[-1] = parts[-1] if seed % 3 else torch.full((64,), float("nan"))
    usable = [p if bool(torch.isfinite(p).all()) else None for p in parts]
    result = centred_clip(usable, 0)
    assert float((result.mean.double() - parts[0].double()).norm()) <= acceptance_radius(parts[0], group, 32) * (
        1 + 1e-6)
    assert takes(parts[0], result.mean, group, bits)


def test_a_sender_refuses_an_average_beyond_its_radius_and_one_that_is_not_finite():
    own = torch.ones(16)
    radius = acceptance_radius(own, 2, 32)  # CLIP/2 * ||own|| = 4
    assert radius == pytest.approx(4.0)
    assert takes(own, own + 3.9 / 4, 2, 32) and not takes(own, own + 4.1 / 4, 2, 32)
    assert not takes(own, torch.full((16,), float("nan")), 2, 32) and not takes(own, torch.ones(15), 2, 32)
    assert not takes(own, None, 2, 32)
