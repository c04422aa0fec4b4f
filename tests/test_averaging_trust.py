"""The averaging plane trusts no one (issue 60), on real hivemind DHTs and averagers on 127.0.0.1:

- finding 1: a peer without the swarm token neither reads nor writes the swarm's DHT, and a peer that is not
  a named member neither downloads a replica's state nor has its own loaded;
- finding 3: a liar in a group of two (-9 times its own, a tiny vector) moves the honest replica's update by
  at most its own norm, and is excluded after SUSPECT_ROUNDS rounds; in a group of four, two replicas that
  send zeros no longer turn the honest ones against each other;
- finding 4: a reducer that never sends back the average of its share is recorded as stalled by the others,
  left out of the next round, and excluded after STALL_ROUNDS stalled rounds."""

from __future__ import annotations

import asyncio

import pytest
import torch

hivemind = pytest.importorskip("hivemind")

from hivemind.utils.timed_storage import get_dht_time  # noqa: E402

from tahnode.net import averaging_parts as parts  # noqa: E402
from tahnode.net.auth import SwarmKey  # noqa: E402
from tahnode.net.averaging import StageAverager  # noqa: E402
from tahnode.net.dht_auth import SwarmAuthorizer  # noqa: E402
from tahnode.pipeline.peer_standing import STALL_ROUNDS, SUSPECT_ROUNDS, Offence, PeerStanding  # noqa: E402
from tahnode.train.clip_rule import acceptance_radius  # noqa: E402
from test_averaging import dhts, replicas, run_round, until_formed  # noqa: E402,F401  (dhts: a fixture)

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
SIZE = 6000


def honest(count: int, seed: int) -> list[torch.Tensor]:
    """Pseudo-gradients of replicas of one model: a shared direction and their own noise (cosine ~0.6)."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(SIZE, generator=g)
    return [(0.77 * common + 0.63 * torch.randn(SIZE, generator=g)) * 1e-3 for _ in range(count)]


def test_the_swarms_dht_answers_members_only():
    """A DHT of the swarm key's members: a peer without the token (or with another) cannot even bootstrap
    into it, and one that starts anyway reads none of its values and writes none of its own into it."""
    members = [hivemind.DHT(start=True, host_maddrs=LOCAL, authorizer=SwarmAuthorizer(SwarmKey("swarm")))]
    made = list(members)
    try:
        members.append(hivemind.DHT(start=True, initial_peers=members[0].get_visible_maddrs(), host_maddrs=LOCAL,
                                    authorizer=SwarmAuthorizer(SwarmKey("swarm"))))
        made.append(members[1])
        assert members[0].store("stage-0", "members' value", get_dht_time() + 60)
        assert members[1].get("stage-0", latest=True).value == "members' value"
        for authorizer in (None, SwarmAuthorizer(SwarmKey("another swarm"))):
            with pytest.raises(RuntimeError, match="bootstrap failed"):
                made.append(hivemind.DHT(start=True, initial_peers=members[0].get_visible_maddrs(), host_maddrs=LOCAL,
                                         authorizer=authorizer))
            outsider = hivemind.DHT(start=True, initial_peers=members[0].get_visible_maddrs(), host_maddrs=LOCAL,
                                    authorizer=authorizer, ensure_bootstrap_success=False)
            made.append(outsider)
            outsider.store("stage-0", "outsider's value", get_dht_time() + 3600)
            outsider.store("stage-0.all_averagers", "outsider's", get_dht_time() + 3600)
            assert outsider.get("stage-0", latest=True).value == "outsider's value"  # its own copy only
            for member in members:
                assert member.get("stage-0", latest=True).value == "members' value"
                assert member.get("stage-0.all_averagers", latest=True) is None
    finally:
        for dht in made:
            dht.shutdown()


def test_a_stranger_neither_downloads_a_replicas_state_nor_has_its_own_loaded(dhts):
    """The replica serves its members only (the stranger gets nothing and is counted), and it asks a
    stranger for nothing: before, any peer with the run id downloaded any replica's weights, and a replica
    loaded the weights of whoever declared itself first in the DHT."""
    weights = [torch.arange(12.0).reshape(3, 4)]
    states = [lambda: ({"step": 4}, weights), lambda: ({"step": 10**12}, [torch.full((3, 4), 7.0)])]
    with replicas(dhts, [StageAverager] * 2, states=states, members=False) as (replica, stranger):
        replica.set_members([replica.peer_id])  # the coordinator named no one else
        stranger.set_members([stranger.peer_id, replica.peer_id])

        async def main():
            taken = await stranger.load_state(replica.peer_id, timeout=10.0)
            loaded = await replica.load_state(stranger.peer_id, timeout=10.0)
            return taken, loaded

        refused = 0
        for _ in range(3):  # on a loaded machine the stranger's request may time out before it reaches the replica
            assert asyncio.run(main()) == (None, None)
            refused += replica._averager.ask("_take_ledger").refused.get(stranger.peer_id, 0)
            if refused:
                break
        assert refused >= 1


def lying_round(avs, vectors, step, standing, timeout=5.0):
    results = run_round(avs, vectors, [step] * len(avs), expected=len(avs), timeout=timeout)
    for averager, result, record in zip(avs, results, standing):
        if record is not None and result.group:
            record.judge(step, result, averager.peer_id)
    return results


@pytest.mark.parametrize("lie", ["-9x", "tiny"])
def test_a_liar_in_a_group_of_two_is_bounded_then_excluded(dhts, lie, monkeypatch):
    """Before, -9x steered the honest replica against its own update (cosine -0.95) at 4x its size, every
    round; a tiny vector made the honest reducer refuse its own part. Now each round's update is within its
    own norm of what it would take alone, and after SUSPECT_ROUNDS rounds the liar is excluded."""
    monkeypatch.setattr(parts, "CHUNK_TIMEOUT_S", 30.0)  # a loaded machine: the liar's parts must arrive
    standing = PeerStanding()
    mine, theirs = honest(2, seed=8)
    sent = -9 * theirs if lie == "-9x" else theirs * 1e-9
    excluded = []

    def attempt(step):
        with replicas(dhts, [StageAverager] * 2) as avs:
            results = []
            for round_ in range(SUSPECT_ROUNDS):
                results.append(lying_round(avs, [mine, sent], step + round_, [standing, None]))
                if not results[-1][0].group:
                    return results
            excluded.append(avs[1].peer_id in standing.excluded)
            return results

    rounds = until_formed(attempt, lambda rounds: len(rounds) == SUSPECT_ROUNDS and all(r[0].group for r in rounds),
                          steps=(1, 11, 21))
    for results in rounds:
        step = results[0].mean
        assert float((step - mine).norm()) <= acceptance_radius(mine, 2, 8) * 1.001
        assert float(torch.nn.functional.cosine_similarity(step, mine, dim=0)) > 0
    assert excluded[-1]
    record = next(iter(standing.records.values()))
    assert record.excluded and record.last.offence in (Offence.CLIPPED, Offence.REFUSED, Offence.SCALE)


def test_two_replicas_sending_zeros_never_turn_a_group_of_four_against_itself(dhts, monkeypatch):
    """Before, the lower median of the parts' norms was 0: each honest reducer refused the other honest
    replica's part, and its report became a ban. Now the honest replicas see each other clean, never refuse
    each other's averages, and each excludes the two zero-senders."""
    monkeypatch.setattr(parts, "CHUNK_TIMEOUT_S", 30.0)
    more = [hivemind.DHT(start=True, initial_peers=dhts[0].get_visible_maddrs(), host_maddrs=LOCAL)]
    try:
        four = list(dhts[:3]) + more
        xs = honest(4, seed=9)
        sent = xs[:2] + [torch.zeros(SIZE), torch.zeros(SIZE)]
        standings = [PeerStanding(), PeerStanding(), None, None]

        def attempt(step):
            with replicas(four, [StageAverager] * 4) as avs:
                ids = [a.peer_id for a in avs]
                results = [lying_round(avs, sent, step + r, standings, timeout=8.0) for r in range(SUSPECT_ROUNDS)]
                return ids, results

        ids, rounds = until_formed(attempt, lambda out: all(r.group == 4 for rs in out[1] for r in rs[:2]),
                                   steps=(1, 11, 21))
        for k in (0, 1):
            other = ids[1 - k]
            assert standings[k].records[other].clean == SUSPECT_ROUNDS and not standings[k].records[other].excluded
            assert standings[k].excluded == {ids[2], ids[3]}
            for results in rounds:
                assert other not in results[k].refused
                assert float((results[k].mean - xs[k]).norm()) <= acceptance_radius(xs[k], 4, 8) * 1.001
    finally:
        for dht in more:
            dht.shutdown()


class NoAverageRunner(parts.CheckedRunner):
    """Takes every part sent to it and never sends an average back."""

    async def _accumulate_parts_streaming(self, stream, sender_index):
        async for _ in stream:
            pass
        await asyncio.sleep(3600)
        yield  # never reached: an async generator


class NoAverageAverager(parts.CheckedAverager):
    runner_class = NoAverageRunner


class NoAverageReplica(StageAverager):
    averager_class = NoAverageAverager


def test_a_reducer_that_never_answers_is_blamed_left_out_and_then_excluded(dhts, monkeypatch):
    """Before, a member that joined every round and never sent back the average of its share failed every
    round for the others, and nobody refused or reported it. Now each honest replica records it as stalled,
    the next round forms without it (the two honest average in full), and STALL_ROUNDS stalled rounds exclude it."""
    monkeypatch.setattr(parts, "CHUNK_TIMEOUT_S", 1.0)  # its averages are late after 2 s
    xs = honest(3, seed=10)
    standing = PeerStanding()
    with replicas(dhts, [StageAverager, StageAverager, NoAverageReplica]) as avs:
        everyone = [a.peer_id for a in avs]
        staller, step, stalled_rounds = avs[2].peer_id, 100, 0
        for _ in range(4 * STALL_ROUNDS):
            if staller in standing.excluded:
                break
            left_out = standing.suspended | standing.excluded
            members = [p for p in everyone if p not in left_out]
            for averager in avs[:2]:
                averager.set_members(members)
            taking = avs if staller in members else avs[:2]
            results = run_round(taking, xs[:len(taking)], [step] * len(taking), expected=len(taking), timeout=4.0)
            step += 1
            if not results[0].peers:  # no group formed (a loaded machine): nothing to judge
                continue
            standing.judge(step, results[0], avs[0].peer_id)
            if staller in members:
                stalled_rounds += staller in results[0].stalled
            else:  # the round without it: the two honest replicas' full mean
                assert results[0].group == 2 and not results[0].stalled
                assert float((results[0].mean - (xs[0] + xs[1]) / 2).abs().max()) < 1e-4
    record = standing.records[staller]
    assert stalled_rounds >= STALL_ROUNDS and record.excluded and record.last.offence is Offence.STALLED
    assert record.stalled >= STALL_ROUNDS


def test_the_group_target_leaves_out_excluded_replicas():
    from types import SimpleNamespace

    from tahnode.pipeline.outer_sync import OuterSync

    sync = SimpleNamespace(pipelines=SimpleNamespace(now=3), known=3, admitted=2)
    assert OuterSync.group_target(sync) == 2
    sync.admitted = 1
    assert OuterSync.group_target(sync) == 1  # every other one excluded: it averages with no one, at once
