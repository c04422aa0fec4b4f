"""Replicas that parted meet again, and a stage that went back keeps checkpoints the coordinator stores (issue 61,
seen in `tahnode bench chaos`): two replicas of a stage that each took one outer step alone, from their own
weights, and each found its own digest named, averaged on with outer weights 1.5e-2 apart to the end of the run; a
stage that returned to an older outer step kept AdamW's step counts of the steps it trained again, so every
checkpoint it saved after was refused ("the AdamW step count ... is 843, not a whole number in 0..840"); the
stages of a pipeline that lost its stage 0 mid-round waited out that round's deadline (30 s) after the other
pipeline had taken it alone, and so did a follower that gave up on a slow leader."""

from __future__ import annotations

import asyncio

import torch

from tahnode.net.inproc import InProcessNetwork
from tahnode.pipeline.checkpoint import CheckpointStore
from tahnode.pipeline.outer_adopt import NamedState
from tahnode.pipeline.outer_heal import meet_named, parted
from tahnode.pipeline.worker import StageWorker
from tahnode.train.outer import state_digest
from test_regroup import worker_with_checkpoints


class Serves:
    """A replica's averager that serves `state` as its outer weights of `step`."""

    peer_id = "me"

    def __init__(self, step: int, state: list[torch.Tensor]):
        self.step, self.state, self.asked = step, state, 0

    async def load_state(self, peer_id, timeout):
        self.asked += 1
        return {"step": self.step}, [t.clone() for t in self.state]


def parted_worker(tmp_path):
    """Stage 1 of pipeline 1 at outer step 8, trained 4 steps since (its weights 0.02 past its anchor), and the
    other replica's outer weights of step 8 (0.003 apart from its own: each took that step alone)."""
    worker = worker_with_checkpoints(tmp_path, [4, 8])
    outer = worker.outer
    theirs = [t + 0.003 for t in outer.outer.tensors().values()]
    with torch.no_grad():
        for p in worker.model.parameters():
            p.add_(0.02)
    outer.pipelines.now = 2
    return worker, theirs


def test_a_replica_whose_outer_weights_are_not_the_settled_naming_takes_it_and_keeps_its_steps_since(tmp_path):
    worker, theirs = parted_worker(tmp_path)
    outer = worker.outer
    source = Serves(8, theirs)
    outer.use(source)
    outer.named = NamedState(8, state_digest(8, theirs), ("peer",), True, 1)
    assert asyncio.run(meet_named(outer)) is False and source.asked == 0  # its last round had a mean: not parted
    outer.stats.unsure = True  # its last round came back without a mean (it took that outer step alone)
    since = [p.detach() - a for p, a in zip(outer.outer.params, outer.outer.anchor)]
    assert asyncio.run(meet_named(outer)) is True
    assert outer.anchor_step == 8 and source.asked == 1
    assert all(torch.equal(a, b) for a, b in zip(outer.outer.tensors().values(), theirs))
    for p, a, d in zip(outer.outer.params, outer.outer.anchor, since):
        assert torch.allclose(p.detach() - a, d, atol=1e-6)  # the steps since its anchor are kept
    assert outer.digest == outer.named.digest and not parted(outer) and not outer.stats.unsure  # confirmed
    assert asyncio.run(meet_named(outer)) is False and source.asked == 1  # met: nothing more to fetch


def test_an_unsettled_or_excluded_naming_moves_nothing(tmp_path):
    """A naming not every replica reported yet may change (the other one reports a moment later); a source it
    excluded is not one it takes a state from."""
    from tahnode.pipeline.peer_standing import PeerRecord

    worker, theirs = parted_worker(tmp_path)
    outer = worker.outer
    source = Serves(8, theirs)
    outer.use(source)
    before = [t.clone() for t in outer.outer.tensors().values()]
    outer.stats.unsure = True
    outer.named = NamedState(8, state_digest(8, theirs), ("peer",), False, 1)
    assert asyncio.run(meet_named(outer)) is False
    outer.named = NamedState(8, state_digest(8, theirs), ("peer",), True, 1)
    outer.standing.records["peer"] = PeerRecord(excluded=True, excluded_at=outer.standing.clock())
    assert asyncio.run(meet_named(outer)) is False
    assert source.asked == 0
    assert all(torch.equal(a, b) for a, b in zip(outer.outer.tensors().values(), before))


def test_a_stage_that_returns_to_an_older_step_saves_checkpoints_the_store_takes(tmp_path):
    worker = worker_with_checkpoints(tmp_path, [4])
    for p in worker.opt.params:
        worker.opt.opt.state[p]["step"] = torch.tensor(23.0)
        worker.opt.opt.state[p]["exp_avg"] = torch.zeros_like(p)
        worker.opt.opt.state[p]["exp_avg_sq"] = torch.zeros_like(p)
    worker.resumed_at(20)  # it trained to 23 and returns to the outer step of 20
    assert {float(s["step"]) for s in worker.opt.opt.state.values()} == {20.0}
    worker.save()
    again = StageWorker(worker.run_cfg, 1, InProcessNetwork().transport("m"), "cpu", CheckpointStore(tmp_path, keep=4),
                        pipeline=1)
    assert again.resume() == 20  # before: refused as corrupt, "the AdamW step count ... is 23.0"
    assert {float(s["step"]) for s in again.opt.opt.state.values()} == {20.0}
    worker.resumed_at(24)  # a step ahead of its counts moves nothing
    assert {float(s["step"]) for s in worker.opt.opt.state.values()} == {20.0}


class LookingAverager:
    """A stage's averager whose round is looking for a group; counts the times it was told to end it."""

    peer_id, ended = "me", False

    def __init__(self):
        self.ends = 0

    def end_round(self) -> bool:
        self.ends += 1
        return True

    def set_members(self, members): ...

    def set_suspended(self, suspended): ...

    def set_target(self, target): ...


def test_a_round_whose_step_the_others_averaged_past_ends_when_the_coordinator_says_so(tmp_path):
    """A round still looking for a group at step 8 when the coordinator names a later outer step of the stage: the
    others averaged past it (a pipeline told to take that round alone while this one lost its stage 0 mid-round)
    and train on, so no one comes. Before, those stages waited out the round's deadline (30 s). A naming of step 8
    itself ends nothing: tried, it kept a liar from being excluded in time under load (tests/test_bench_abuse.py)."""
    from tahnode.config import NodeConfig
    from tahnode.daemon.averaging import StageAveraging
    from tahnode.proto import tahnode_pb2 as pb

    worker = worker_with_checkpoints(tmp_path, [4])
    worker.resumed_at(8)  # at the boundary of step 8, its outer weights still those of 4: in the round of 8
    averaging = StageAveraging(NodeConfig(), tmp_path, "run", worker, beats=None, node_id="n1")
    averager = LookingAverager()
    averaging.averager = worker.outer.averager = averager
    worker.outer.pipelines.now = 2
    for named_step, ends in ((4, 0), (8, 0), (12, 1)):  # its own step: another may still come; a later: no one
        a = pb.Assignment(stage=1, pipeline=1, pipelines=2)
        a.named_state.CopyFrom(pb.NamedState(step=named_step, digest=b"d" * 32, sources=["peer"], settled=False,
                                             operators=1))
        averaging.follow(a)
        assert averager.ends == ends
