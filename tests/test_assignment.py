"""Stage assignment: known best chains, pins, compute-bound choices, the exact search against brute
force, the heuristic against the exact search, and the errors for impossible problems."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tahnode.coordinator.assignment import AssignmentProblem, assign, chain_bottleneck

MB = 1_000_000


def full_mesh(ids, mbps=200.0, **overrides):
    m = {(a, b): mbps for a in ids for b in ids if a != b}
    m.update(overrides)
    return m


def brute_force(p: AssignmentProblem) -> tuple[float, list[str]]:
    """Every placement of the auto nodes into the open stages: the smallest bottleneck, then the
    fastest slowest link, then the first in id order."""
    links_only = dataclasses.replace(p, compute_ms={}, layer_ms={})
    slots = [None] * p.num_stages
    for n, s in p.pinned.items():
        slots[s] = n
    auto = sorted(n for n in p.nodes if n not in p.pinned)
    open_stages = [k for k, s in enumerate(slots) if s is None]
    best = None
    for perm in itertools.permutations(auto, len(open_stages)):
        chain = list(slots)
        for k, n in zip(open_stages, perm):
            chain[k] = n
        v = (chain_bottleneck(p, chain)[0], chain_bottleneck(links_only, chain)[0])
        if best is None or v < best[0]:
            best = (v, chain)
    return best[0][0], best[1]


def assert_valid(p: AssignmentProblem, res) -> None:
    assert len(res.chain) == p.num_stages
    assert len(set(res.chain)) == p.num_stages
    assert set(res.chain) | set(res.standbys) == set(p.nodes)
    assert not set(res.chain) & set(res.standbys)
    for n, s in p.pinned.items():
        assert res.chain[s] == n
    assert res.bottleneck_s == pytest.approx(chain_bottleneck(p, res.chain)[0])


def random_problem(seed: int, n: int, k: int, pins: int = 0, compute: bool = False) -> AssignmentProblem:
    r = random.Random(seed)
    ids = [f"n{i:02d}" for i in range(n)]
    mode = r.choice(["uniform", "two-level", "log"])
    mbps = {}
    for a in ids:
        for b in ids:
            if a != b:
                mbps[(a, b)] = {"uniform": lambda: r.uniform(10, 500), "two-level": lambda: r.choice([20.0, 200.0]),
                                "log": lambda: 10 ** r.uniform(0.5, 3)}[mode]()
    pinned = dict(zip(r.sample(ids, pins), r.sample(range(k), pins)))
    comp = {a: [r.uniform(1, 80) for _ in range(k)] for a in ids} if compute else {}
    return AssignmentProblem(nodes=ids, num_stages=k, pinned=pinned, mbps=mbps, activation_bytes=1 * MB,
                             gradient_bytes=r.choice([None, 0.5 * MB]), compute_ms=comp)


# -- chains whose best is known -------------------------------------------------------------------

def test_avoids_the_slow_link_and_keeps_the_spare_as_standby():
    ids = ["n1", "n2", "n3", "n4"]
    mbps = full_mesh(ids, 200.0, **{})
    mbps[("n2", "n3")] = mbps[("n3", "n2")] = 20.0
    p = AssignmentProblem(nodes=ids, num_stages=3, mbps=mbps, activation_bytes=2 * MB)
    res = assign(p)
    assert res.method == "exact"
    pairs = set(zip(res.chain, res.chain[1:]))
    assert ("n2", "n3") not in pairs and ("n3", "n2") not in pairs
    assert res.bottleneck_s == pytest.approx(2 * MB * 8 / 200e6)
    assert res.chain == ["n1", "n2", "n4"]  # first optimal chain in id order
    assert res.standbys == ["n3"] and res.stage_of("n3") == -1 and res.stage_of("n4") == 2


def test_direction_matters_activations_forward_gradients_back():
    # Only e->c->a is fast for the (large) activations; gradients (10x smaller) go back on 20 Mbit/s.
    ids = ["a", "b", "c", "d", "e"]
    mbps = full_mesh(ids, 20.0)
    mbps[("e", "c")] = mbps[("c", "a")] = 300.0
    p = AssignmentProblem(nodes=ids, num_stages=3, mbps=mbps, activation_bytes=4 * MB, gradient_bytes=0.4 * MB)
    res = assign(p)
    assert res.chain == ["e", "c", "a"]
    assert res.standbys == ["b", "d"]
    # The best chain's bottleneck: 4 MB forward at 300 Mbit/s vs 0.4 MB back at 20 Mbit/s.
    assert res.bottleneck_s == pytest.approx(max(4 * MB * 8 / 300e6, 0.4 * MB * 8 / 20e6))
    assert "link" in res.bottleneck


def test_unmeasured_pairs_count_as_the_default_bandwidth():
    ids = ["a", "b", "c"]
    p = AssignmentProblem(nodes=ids, num_stages=2, mbps={("b", "c"): 50.0, ("c", "b"): 50.0},
                          activation_bytes=MB, default_mbps=10.0)
    res = assign(p)
    assert res.chain == ["b", "c"] and res.standbys == ["a"]
    assert chain_bottleneck(p, ["a", "b"])[0] == pytest.approx(MB * 8 / 10e6)


def test_compute_bound_still_avoids_the_slow_link():
    """The slow link would not raise the bottleneck (compute sets it), but a chain without it is
    as fast and keeps the pipeline fast should the traffic grow: it is the one chosen."""
    ids = ["n1", "n2", "n3", "n4"]
    mbps = full_mesh(ids, 200.0)
    mbps[("n2", "n3")] = mbps[("n3", "n2")] = 20.0
    layer_ms = dict.fromkeys(ids, 150.0)
    p = AssignmentProblem(nodes=ids, num_stages=3, mbps=mbps, activation_bytes=MB / 2, layer_ms=layer_ms,
                          stage_layers=[2, 2, 2])
    # 0.2 s on the slow link, 0.3 s of compute per stage: the first chain in id order ties the optimum
    assert chain_bottleneck(p, ["n1", "n2", "n3"]) == (pytest.approx(0.3), "compute of n1 on stage 0 (300 ms)")
    res = assign(p)
    assert res.bottleneck_s == pytest.approx(0.3) and "compute" in res.bottleneck
    assert res.chain == ["n1", "n2", "n4"]


def test_pinned_stages_are_respected():
    ids = ["fast1", "fast2", "fast3", "slow"]
    mbps = full_mesh(ids, 200.0)
    for other in ids[:3]:
        mbps[("slow", other)] = mbps[(other, "slow")] = 20.0
    p = AssignmentProblem(nodes=ids, num_stages=3, pinned={"slow": 2}, mbps=mbps, activation_bytes=MB)
    res = assign(p)
    assert res.chain[2] == "slow"
    assert "20 Mbit/s" in res.bottleneck
    assert_valid(p, res)
    # Pinning the middle stage: both of its links are used.
    p2 = AssignmentProblem(nodes=ids, num_stages=3, pinned={"fast3": 1, "fast1": 0}, mbps=mbps, activation_bytes=MB)
    res2 = assign(p2)
    assert res2.chain == ["fast1", "fast3", "fast2"] and res2.standbys == ["slow"]


def test_compute_bound_picks_the_fastest_nodes():
    ids = ["a", "b", "c", "d", "e"]
    layer_ms = {"a": 5.0, "b": 1.0, "c": 3.0, "d": 2.0, "e": 4.0}
    p = AssignmentProblem(nodes=ids, num_stages=3, mbps=full_mesh(ids, 1000.0), activation_bytes=1000,
                          layer_ms=layer_ms, stage_layers=[2, 2, 2])
    res = assign(p)
    assert set(res.chain) == {"b", "c", "d"} and res.standbys == ["a", "e"]
    assert res.bottleneck_s == pytest.approx(6e-3) and "compute of c" in res.bottleneck
    # An uneven split: the fastest node takes the big stage; ties go to the smaller id.
    p = AssignmentProblem(nodes=ids, num_stages=3, mbps=full_mesh(ids, 1000.0), activation_bytes=1000,
                          layer_ms=layer_ms, stage_layers=[4, 1, 1])
    res = assign(p)
    assert res.chain == ["b", "c", "d"]
    # compute_ms per (node, stage) takes precedence over layer_ms.
    p.compute_ms = {"a": [0.1, 0.1, 0.1]}
    assert assign(p).chain[0] == "a"


def test_single_stage_and_single_node():
    p = AssignmentProblem(nodes=["x"], num_stages=1)
    res = assign(p)
    assert res.chain == ["x"] and res.standbys == [] and res.bottleneck_s == 0.0
    p = AssignmentProblem(nodes=["x", "y"], num_stages=1, compute_ms={"x": [9.0], "y": [3.0]})
    assert assign(p).chain == ["y"]


# -- exact search against brute force -------------------------------------------------------------

@st.composite
def small_problems(draw):
    n = draw(st.integers(1, 7))
    k = draw(st.integers(1, n))
    ids = [f"n{i}" for i in range(n)]
    # Few distinct bandwidths: many ties, so the id-order tie-break is checked as well.
    bw = st.sampled_from([0.0, 5.0, 20.0, 100.0, 200.0, 1000.0])
    mbps = {(a, b): draw(bw) for a in ids for b in ids if a != b and draw(st.booleans())}
    n_pins = draw(st.integers(0, min(k, n) // 2))
    pinned = dict(zip(draw(st.permutations(ids))[:n_pins], draw(st.permutations(range(k)))[:n_pins]))
    compute = draw(st.one_of(st.just({}), st.fixed_dictionaries(
        {a: st.lists(st.sampled_from([0.0, 10.0, 40.0, 100.0]), min_size=k, max_size=k) for a in ids})))
    act = draw(st.sampled_from([0, 100_000, 1_000_000]))
    grad = draw(st.sampled_from([None, 0, 50_000]))
    return AssignmentProblem(nodes=ids, num_stages=k, pinned=pinned, mbps=mbps, activation_bytes=act,
                             gradient_bytes=grad, compute_ms=compute)


@given(small_problems())
def test_exact_matches_brute_force(p):
    res = assign(p)
    best_s, best_chain = brute_force(p)
    assert res.method == "exact"
    assert res.bottleneck_s == best_s
    assert res.chain == best_chain
    assert_valid(p, res)


def test_exact_on_twelve_nodes_is_no_worse_than_the_heuristic():
    for seed, k in [(1, 4), (2, 6), (3, 8)]:
        p = random_problem(seed, 12, k, pins=1, compute=seed == 2)
        exact = assign(p)
        p.exact_limit = 0
        heur = assign(p)
        assert exact.method == "exact" and heur.method == "heuristic"
        assert exact.bottleneck_s <= heur.bottleneck_s
        assert_valid(p, exact)


# -- the heuristic --------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_heuristic_within_2x_of_exact(seed):
    r = random.Random(seed)
    p = random_problem(seed, r.choice([9, 10]), r.choice([3, 5, 7]), pins=r.randint(0, 2), compute=r.random() < 0.4)
    exact = assign(p)
    p.exact_limit = 0
    heur = assign(p)
    assert_valid(p, heur)
    assert heur.bottleneck_s <= 2 * exact.bottleneck_s


def test_heuristic_on_twenty_nodes_finds_the_planted_fast_chain():
    r = random.Random(7)
    ids = [f"v{i:02d}" for i in range(20)]
    mbps = {(a, b): r.uniform(5, 40) for a in ids for b in ids if a != b}
    planted = r.sample(ids, 6)
    for a, b in zip(planted, planted[1:]):
        mbps[(a, b)] = mbps[(b, a)] = 250.0
    p = AssignmentProblem(nodes=ids, num_stages=6, mbps=mbps, activation_bytes=MB, pinned={planted[3]: 3})
    res = assign(p)
    assert res.method == "heuristic"
    assert_valid(p, res)
    assert res.bottleneck_s == pytest.approx(MB * 8 / 250e6)
    assert res.chain == planted  # the reverse would move the pinned node off stage 3
    assert len(res.standbys) == 14


# -- impossible problems ----------------------------------------------------------------------------

def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"3 open stage\(s\) \(0, 1, 2\) but only 2 auto node"):
        assign(AssignmentProblem(nodes=["a", "b"], num_stages=3))
    with pytest.raises(ValueError, match=r"1 open stage\(s\) \(2\) but only 0 auto"):
        assign(AssignmentProblem(nodes=["a", "b"], num_stages=3, pinned={"a": 0, "b": 1}))
    with pytest.raises(ValueError, match=r"nodes 'a' and 'b' both pin stage 1"):
        assign(AssignmentProblem(nodes=["a", "b", "c"], num_stages=3, pinned={"a": 1, "b": 1}))
    with pytest.raises(ValueError, match=r"node 'a' pins stage 3, but the pipeline has stages 0..2"):
        assign(AssignmentProblem(nodes=["a", "b", "c"], num_stages=3, pinned={"a": 3}))
    with pytest.raises(ValueError, match=r"pinned node 'z' is not among the nodes"):
        assign(AssignmentProblem(nodes=["a", "b", "c"], num_stages=3, pinned={"z": 0}))
    with pytest.raises(ValueError, match=r"repeated: a"):
        assign(AssignmentProblem(nodes=["a", "a", "c"], num_stages=2))
    with pytest.raises(ValueError, match=r"at least one stage"):
        assign(AssignmentProblem(nodes=["a"], num_stages=0))
    with pytest.raises(ValueError, match=r"needs 2 nodes, got 1"):
        chain_bottleneck(AssignmentProblem(nodes=["a", "b"], num_stages=2), ["a"])


def test_auto_subset_leaves_the_others_as_standbys():
    ids = ["a", "b", "c", "d"]
    p = AssignmentProblem(nodes=ids, num_stages=2, auto=["c", "d"], mbps=full_mesh(ids))
    res = assign(p)
    assert sorted(res.chain) == ["c", "d"] and res.standbys == ["a", "b"]


def test_a_ring_counts_the_link_that_closes_it():
    """A tied model (RunConfig.ring): the last stage also sends to stage 0, so that link can be the
    bottleneck and is named as such."""
    mbps = {(a, b): 100.0 for a in "abc" for b in "abc" if a != b}
    mbps[("c", "a")] = mbps[("a", "c")] = 1.0
    chain = ["a", "b", "c"]
    line = AssignmentProblem(nodes=chain, num_stages=3, pinned={"a": 0, "b": 1, "c": 2}, mbps=mbps,
                             activation_bytes=1e6)
    ring = dataclasses.replace(line, ring=True)
    assert chain_bottleneck(line, chain)[0] == pytest.approx(0.08)
    seconds, what = chain_bottleneck(ring, chain)
    assert seconds == pytest.approx(8.0) and what == "link c->a at 1 Mbit/s (activations)"
