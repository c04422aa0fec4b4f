"""A replica's judgement of the others: near-orthogonal parts (honest replicas late in a run) are not held against a
replica, parts pointing away are; and an exclusion ends PAROLE_S after it began, one round held against the
replica then excluding it again (before, for good: in bench chaos an honest stage-2 replica excluded at cosine 0.04
could take no other replica's state, and its pipeline regrouped at every boundary)."""

from __future__ import annotations

from types import SimpleNamespace

from tahnode.pipeline.peer_standing import PAROLE_S, SUSPECT_ROUNDS, Offence, PeerStanding


def round_with(cosine: float) -> SimpleNamespace:
    view = SimpleNamespace(cosine=cosine, ratio=1.0, unusable=False, parts=2, clipped=False)
    return SimpleNamespace(peers=["me", "other"], views={"other": view}, refused={}, stalled=set(), silent=set())


def test_near_orthogonal_parts_are_clean_and_parts_pointing_away_are_held_against_a_replica():
    standing = PeerStanding()
    for round_ in range(5):
        assert standing.judge(round_, round_with(0.04), "me") == []
    assert standing.records["other"].clean == 5 and standing.excluded == set()
    assert standing.judge(5, round_with(-0.3), "me") == [] and standing.judge(6, round_with(-0.3), "me") == ["other"]
    assert standing.records["other"].last.offence is Offence.OPPOSED


def test_an_exclusion_ends_after_its_parole_and_one_more_round_against_the_replica_excludes_it_again():
    now = [1000.0]
    standing = PeerStanding(clock=lambda: now[0])
    for round_ in range(SUSPECT_ROUNDS):
        standing.judge(round_, round_with(-0.9), "me")
    assert standing.excluded == {"other"}
    now[0] += PAROLE_S - 1
    assert standing.excluded == {"other"}
    now[0] += 1
    assert standing.excluded == set()  # on parole: averaged with, and a source, again
    assert standing.judge(10, round_with(-0.9), "me") == ["other"]  # its first round against it since
    assert standing.excluded == {"other"}
    now[0] += PAROLE_S
    assert standing.excluded == set()
    assert standing.judge(11, round_with(0.5), "me") == [] and standing.excluded == set()
    assert standing.judge(12, round_with(-0.9), "me") == []  # a clean round in between: two in a row again
