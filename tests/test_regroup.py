"""No livelock by design (issue 61, point 2): when the stages of a pipeline disagree after a regroup, stage 0
picks the newest outer step every stage can reach (RegroupPlan), each stage returns to exactly that one (its
own outer weights, its stage's named state, or a checkpoint of its own that keeps them), a target that fails
its tries is given up for the next lower, and 0 is always there: the loop ends. Before, a stage whose
replicas held outer step 36 and another whose replicas held 28 each went back to their own, for ever."""

from __future__ import annotations

import asyncio

import torch

from tahnode.config import RunConfig
from tahnode.coordinator.durable import SwarmDB
from tahnode.coordinator.replicas import MAX_SKIPPED, ReplicaCouncil
from tahnode.coordinator.state import NodeRecord, NodeStatus
from tahnode.net.inproc import InProcessNetwork
from tahnode.pipeline.checkpoint import CheckpointStore
from tahnode.pipeline.outer_adopt import NamedState
from tahnode.pipeline.regroup_plan import RegroupPlan
from tahnode.pipeline.worker import StageWorker
from tahnode.proto import tahnode_pb2 as pb
from test_pipeline_inproc import NONE, build_run


def test_the_plan_takes_the_newest_common_step_and_gives_a_failing_one_up_for_the_next_lower():
    plan = RegroupPlan(tries_per_target=2)
    assert plan.target is None
    assert [plan.next({0, 28, 36}) for _ in range(2)] == [36, 36]
    assert plan.next({0, 28, 36}) == 28  # 36 failed its two tries
    assert plan.next({0, 28}) == 28 and plan.next({0, 28}) == 0
    assert plan.next(set()) == 0 and plan.tries == 6  # 0, the initial weights: always there


def test_steps_that_only_shrink_end_the_plan_within_a_bounded_number_of_tries():
    for reachable in ({0, 4, 8, 12, 16}, {0}, {0, 40}):
        plan, targets = RegroupPlan(tries_per_target=3), []
        for _ in range(3 * len(reachable) + 1):
            targets.append(plan.next(reachable))
        assert targets == sorted(targets, reverse=True) and targets[-1] == 0
        assert targets.count(max(reachable)) == 3 or max(reachable) == 0


def worker_with_checkpoints(tmp_path, steps: list[int]) -> StageWorker:
    """Stage 1 of pipeline 1 (outer step every 4), which trained and saved checkpoints of `steps`."""
    run = build_run(12, **NONE, **{"swarm.pipelines": 2, "swarm.outer_every": 4, "swarm.outer_timeout_s": 2.0})
    store = CheckpointStore(tmp_path, keep=len(steps))
    worker = StageWorker(run, 1, InProcessNetwork().transport("n"), "cpu", store, pipeline=1)
    for step in steps:
        with torch.no_grad():
            for p in worker.model.parameters():
                p.add_(0.01)
        worker.resumed_at(step)
        if worker.outer.due(step):
            worker.outer._take(step, None)
        worker.save()
    return worker


def test_a_stage_can_reach_its_own_its_named_and_its_checkpoints_outer_steps(tmp_path):
    worker = worker_with_checkpoints(tmp_path, [4, 6, 8, 9])
    outer = worker.outer
    assert outer.anchor_step == 8 and outer.reachable() == {0, 8, 4}  # 9 keeps the weights of 8; 6 those of 4

    class Nobody:
        peer_id = "me"

        async def load_state(self, peer_id, timeout):
            return None

    outer.use(Nobody())
    outer.pipelines.now = 2
    outer.named = NamedState(12, b"d" * 32, ("peer",), True, 2)
    assert 12 in outer.reachable()
    assert not asyncio.run(outer.reach(12))  # its source did not serve it: no longer reachable
    assert 12 not in outer.reachable()


def test_a_stage_returns_to_a_common_outer_step_through_its_checkpoint(tmp_path):
    worker = worker_with_checkpoints(tmp_path, [4, 6, 8, 9])
    anchor_of_8 = worker.outer.checkpoint_tensors()["anchor"]
    asyncio.run(worker.resync.regroup_to(4))
    assert worker.committed == 4 and worker.outer.anchor_step == 4
    weights = torch.cat([p.detach().reshape(-1) for p in worker.model.parameters()])
    assert torch.equal(weights, worker.outer.outer.tensors()["anchor"])  # its weights: the outer weights of 4
    assert not torch.equal(weights, anchor_of_8)
    asyncio.run(worker.resync.regroup_to(0))  # the initial weights: always
    assert worker.committed == 0 and worker.outer.anchor_step == 0


def test_skipped_steps_fill_the_ledgers_gaps_even_after_the_loss_stage_reported_the_steps_past_them(tmp_path):
    """Stage 0's heartbeat with steps 12..15 skipped may come after the loss stage's with 16 and 17: the ledger takes
    them where it has no step (before, its window began at the ledger's next step and left 12..15 a hole); a step
    trained stays trained, and a report far below the ledger, or from a stage other than 0, is left out."""
    run = RunConfig.build("llama-tiny", None, **{"train.steps": 10_000})
    db = SwarmDB(tmp_path / "coordinator.sqlite")
    trained = [pb.LossPoint(step=s, loss=2.0, sample_ids=[s]) for s in (*range(12), 13, 16, 17)]
    db.record(trained, pipeline=1)
    council = ReplicaCouncil(run, None, lambda node_id: node_id.encode(), lambda pipeline: 18)
    stage0 = NodeRecord("v0", "127.0.0.1:1", 0, "cpu", pipeline=1)
    stage0.status = NodeStatus.ACTIVE
    said = [pb.LossPoint(step=s, sample_ids=[100 + s], skipped=True) for s in range(12, 16)]
    db.record_skipped(council.skipped(stage0, said), pipeline=1)
    ledger = db.ledger()[1]
    assert sorted(ledger) == list(range(18))
    assert [s for s, p in ledger.items() if p.skipped] == [12, 14, 15]
    assert not ledger[13].skipped and list(ledger[13].sample_ids) == [13]
    stage1 = NodeRecord("v1", "127.0.0.1:2", 1, "cpu", pipeline=1)
    stage1.status = NodeStatus.ACTIVE
    assert council.skipped(stage1, said) == []
    council.committed = lambda pipeline: MAX_SKIPPED + 100
    far = [pb.LossPoint(step=99, skipped=True), pb.LossPoint(step=100, skipped=True)]
    assert [p.step for p in council.skipped(stage0, far)] == [100]


def test_a_regroup_follows_the_naming_when_the_named_states_source_moved_on(tmp_path):
    """A pipeline that returns to the others' outer state while they train on: its source already serves a newer
    step than the one named, twice in a row (12 named, 16 served; 16 named, 20 served), and what it served for 16
    is not what the replicas reported for it. The state served for 20 is kept and taken once the coordinator names
    it with its digest, without asking again; the one of 16 is not taken (before, it tried the gone step until
    outer_timeout_s, kept its own weights and never took that step again)."""
    from tahnode.train.outer import state_digest

    worker = worker_with_checkpoints(tmp_path, [4, 8])
    outer = worker.outer
    states = {step: [t + step for t in outer.outer.tensors().values()] for step in (16, 20)}

    class MovedOn:
        peer_id, asked = "me", 0

        async def load_state(self, peer_id, timeout):
            self.asked += 1
            step = 16 if self.asked == 1 else 20  # it takes its next outer step while the first fetch is under way
            outer.named = NamedState(step, state_digest(step, states[step]), ("peer",), True, 2)  # its heartbeat's
            served = [t + 1.0 for t in states[16]] if step == 16 else states[20]
            return {"step": step}, [t.clone() for t in served]

    source = MovedOn()
    outer.use(source)
    outer.pipelines.now = 2
    outer.named = NamedState(12, b"d" * 32, ("peer",), True, 2)
    assert asyncio.run(outer.regroup()) == 20
    assert worker.committed == 20 and outer.anchor_step == 20 and source.asked == 2
    assert all(torch.equal(a, b) for a, b in zip(outer.outer.tensors().values(), states[20]))
    assert not outer.failed  # a state the others moved on from is not its sources' failure: they may return to it


def test_a_newer_state_a_source_served_is_taken_once_it_is_named_without_asking_again(tmp_path):
    """The others take an outer step under a second apart while the coordinator names their state a heartbeat
    later: asked for step 12, the source serves 16, and 16 is named 0.3 s later. The stage takes what it holds
    then (one fetch); before, it asked again, found 20, and chased the naming a fetch behind."""
    from tahnode.train.outer import state_digest

    worker = worker_with_checkpoints(tmp_path, [4, 8])
    outer = worker.outer
    state = [t + 16 for t in outer.outer.tensors().values()]

    class Ahead:
        peer_id, asked = "me", 0

        async def load_state(self, peer_id, timeout):
            self.asked += 1
            return {"step": 16 + 4 * (self.asked - 1)}, [t.clone() + 4 * (self.asked - 1) for t in state]

    async def regroup_while_named_late():
        async def name_later():
            await asyncio.sleep(0.3)
            outer.named = NamedState(16, state_digest(16, state), ("peer",), True, 2)

        naming = asyncio.ensure_future(name_later())
        step = await outer.regroup()
        await naming
        return step

    source = Ahead()
    outer.use(source)
    outer.pipelines.now = 2
    outer.named = NamedState(12, b"d" * 32, ("peer",), True, 2)
    assert asyncio.run(regroup_while_named_late()) == 16
    assert source.asked == 1 and outer.anchor_step == 16
    assert all(torch.equal(a, b) for a, b in zip(outer.outer.tensors().values(), state))


def test_a_pipeline_formed_again_resumes_from_a_checkpoint_its_own_ledger_reached():
    """Pipeline 0's ledger holds steps up to 1354 when it is formed again; the store keeps the stage's
    checkpoints of 1300, 1340 and (pipeline 1's) 1380. Its new holders resume from 1340 and its pipeline
    regroups to the others' state, marking the steps between skipped; from 1380 (before), steps 1355..1379
    were missing from its ledger, unmarked. A pipeline new to the run, or one whose ledger reached none of
    the checkpoints, still takes the newest the ledgers confirm."""
    from types import SimpleNamespace

    from tahnode.coordinator.ledger_order import resume_from

    class Store:
        steps = [1300, 1340, 1380]

        def latest(self, stage, num_stages, at_most=None):
            found = [s for s in self.steps if at_most is None or s <= at_most]
            return SimpleNamespace(step=found[-1]) if found else None

    run = SimpleNamespace(stages=3)
    assert resume_from(run, Store(), 1, confirmed=1400, reached=1355) == 1340
    assert resume_from(run, Store(), 1, confirmed=1400, reached=1380) == 1380
    assert resume_from(run, Store(), 1, confirmed=1400, reached=None) == 1380
    assert resume_from(run, Store(), 1, confirmed=1400, reached=1200) == 1380
    assert resume_from(run, Store(), 1, confirmed=1350, reached=None) == 1340
    assert resume_from(run, SimpleNamespace(latest=lambda *a, **k: None), 1, confirmed=0, reached=None) == 0
