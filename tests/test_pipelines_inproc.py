"""Pipelines in data parallel on the in-process transport: two pipelines of three stages whose
replicas average through an in-process stand-in for hivemind's averager (the same butterfly
arithmetic, tahnode.train.group_mean) and learn the state to load from a stand-in for the
coordinator's naming (tahnode.coordinator.digests' rule) train exactly as the single-process replica
group does; a pipeline that comes late takes the others' latest outer step (its ledger starts there)
and trains in step with them from then on. The averager itself, over hivemind, is tested in
test_averaging.py; the naming, in test_digests.py."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from tahnode.net.averaging import AveragingRound
from tahnode.net.inproc import InProcessNetwork
from tahnode.net.transport import BACKWARD, FORWARD
from tahnode.pipeline.outer_adopt import NamedState
from tahnode.pipeline.replica_group import ReplicaGroup, outer_boundary
from tahnode.pipeline.worker import StageWorker
from tahnode.train.group_mean import butterfly_mean
from test_pipeline_inproc import NONE, build_run, dataset  # noqa: F401  (dataset is a fixture)


class LocalGroup:
    """The replicas of every stage in this process: a round's mean once `expected` replicas of the
    stage came (in pipeline order, as ReplicaGroup averages), None for those alone at the deadline;
    a newcomer gets the newest outer weights of its stage."""

    def __init__(self, bits: int, clip: float):
        self.bits, self.clip = bits, clip
        self.rounds: dict[tuple[int, int], dict[int, tuple[torch.Tensor, asyncio.Future]]] = {}
        self.syncs: dict[tuple[int, int], object] = {}  # (stage, pipeline) -> its OuterSync
        self.closed: set[tuple[int, int]] = set()  # (stage, round) already averaged

    def averager(self, stage: int, pipeline: int) -> "LocalAverager":
        return LocalAverager(self, stage, pipeline)

    async def average(self, stage: int, pipeline: int, vector: torch.Tensor, round: int, expected: int, timeout: float):
        started = time.perf_counter()
        key = (stage, round)
        if key in self.closed:  # the round averaged without this replica: it comes too late, alone
            return self._outcome(None, 0, 0, started)
        arrived = self.rounds.setdefault(key, {})
        arrived[pipeline] = (vector, asyncio.get_running_loop().create_future())
        if len(arrived) == expected:
            self._close(key, arrived)
        try:
            mean, group, sent, counted = await asyncio.wait_for(asyncio.shield(arrived[pipeline][1]), timeout)
        except asyncio.TimeoutError:  # at the deadline, those that came average (two at least)
            if len(arrived) >= 2 and key not in self.closed:
                self._close(key, arrived)
            if not arrived[pipeline][1].done():
                del arrived[pipeline]
                return self._outcome(None, 0, 0, started)
            mean, group, sent, counted = arrived[pipeline][1].result()
        return self._outcome(mean, group, sent, started, counted)

    def _close(self, key: tuple[int, int], arrived: dict) -> None:
        self.closed.add(key)
        order = sorted(arrived)
        result = butterfly_mean([arrived[p][0] for p in order], self.bits, self.clip)
        for p, mean, sent, counted in zip(order, result.means, result.bytes_sent, result.counted):
            arrived[p][1].set_result((mean, len(order), sent, counted))

    @staticmethod
    def _outcome(mean, group: int, sent: int, started: float, counted=None) -> AveragingRound:
        return AveragingRound(mean, group, bytes_sent=sent, bytes_received=sent, seconds=time.perf_counter() - started,
                              counted=counted)

    async def load_state(self, stage: int, peer_id: str):
        sync = self.syncs.get((stage, int(peer_id.split("s")[0][1:])))
        return sync.state() if sync is not None else None

    def name(self) -> None:
        """As the coordinator names each stage's state: the newest step its replicas reported, the digest of
        it the most of them reported (ties: the lowest pipeline's), its sources (the asker left out)."""
        for (stage, pipeline), sync in self.syncs.items():
            reports = {p: s.outer_state() for (k, p), s in self.syncs.items() if k == stage}
            reports = {p: r for p, r in reports.items() if r is not None}
            if not reports:
                continue
            step = max(r[0] for r in reports.values())
            at_step = {p: r[1] for p, r in reports.items() if r[0] == step}
            digest = max(set(at_step.values()), key=lambda d: (sum(v == d for v in at_step.values()),
                                                                -min(p for p, v in at_step.items() if v == d)))
            holders = sorted(p for p, v in at_step.items() if v == digest)
            sync.named = NamedState(step, digest, tuple(f"p{p}s{stage}" for p in holders if p != pipeline),
                                    len(at_step) == len(reports) == len([k for k, _ in self.syncs if k == stage]),
                                    len(holders))


class LocalAverager:
    def __init__(self, group: LocalGroup, stage: int, pipeline: int):
        self.group, self.stage, self.pipeline = group, stage, pipeline
        self.peer_id = f"p{pipeline}s{stage}"

    async def average(self, vector, round, expected, timeout):
        return await self.group.average(self.stage, self.pipeline, vector, round, expected, timeout)

    async def load_state(self, peer_id, timeout):
        return await self.group.load_state(self.stage, peer_id)


class MissesFirstRound(LocalAverager):
    """A replica that comes to the first outer step after its deadline: no group, its own weights."""

    async def average(self, vector, round, expected, timeout):
        if round == 1:
            await asyncio.sleep(timeout)
            return AveragingRound(None, 0, seconds=timeout)
        return await super().average(vector, round, expected, timeout)


class Pipelines:
    """`pipelines` chains of the run's stages as StageWorkers on one in-process network."""

    def __init__(self, run, dataset, pipelines: int):
        self.run, self.net = run, InProcessNetwork()
        self.group = LocalGroup(run.swarm.outer_bits, run.swarm.outer_clip)
        self.workers: dict[int, list[StageWorker]] = {}
        self.dataset, self.count = dataset, pipelines
        self.naming: asyncio.Future | None = None

    async def start(self, p: int) -> list[StageWorker]:
        if self.naming is None:
            self.naming = asyncio.ensure_future(self.keep_naming())
        transports = [self.net.transport(f"p{p}n{k}") for k in range(self.run.stages)]
        workers = []
        for k, t in enumerate(transports):
            await t.start()
            w = StageWorker(self.run, k, t, "cpu", None, self.dataset if k == 0 else None, pipeline=p,
                            averager=self.group.averager(k, p))
            w.outer.pipelines.now = self.count
            self.group.syncs[(k, p)] = w.outer
            workers.append(w)
            for direction, offset in ((FORWARD, 1), (BACKWARD, -1)):
                other = self.run.neighbour(k, offset)
                if other is not None:
                    t.set_peer(direction, f"p{p}n{other}", f"p{p}n{other}")
        self.workers[p] = workers
        return workers

    async def keep_naming(self) -> None:
        """The coordinator's part: name each stage's state every 50 ms (its heartbeats come every second)."""
        while True:
            self.group.name()
            await asyncio.sleep(0.05)

    def losses(self, p: int) -> dict[int, float]:
        return {r.step: r.loss for r in self.workers[p][self.run.loss_stage].stats.losses}

    async def close(self) -> None:
        if self.naming is not None:
            self.naming.cancel()
        for workers in self.workers.values():
            for w in workers:
                await w.t.close()
                w.close()

    def train(self, steps: int, averagers: dict[tuple[int, int], type] | None = None) -> "Pipelines":
        """Start every pipeline, give the replica of stage k in pipeline p the averager
        `averagers[(p, k)]` (a LocalAverager kind, made on this group), train `steps` steps, close."""
        async def go():
            try:
                workers = [w for p in range(self.count) for w in await self.start(p)]
                for (p, k), kind in (averagers or {}).items():
                    self.workers[p][k].outer.use(kind(self.group, k, p))
                await asyncio.wait_for(asyncio.gather(*(w.run(steps) for w in workers)), 120)
            finally:
                await self.close()

        asyncio.run(go())
        return self


def reference_losses(run, dataset, steps: int) -> list[list[float]]:
    """Each pipeline's losses, step by step, from the single-process replica group."""
    group = ReplicaGroup(run, dataset)
    out = [[] for _ in group.replicas]
    for step in range(steps):
        for p, replica in enumerate(group.replicas):
            out[p].append(replica.train_step(step))
        if outer_boundary(step, run):
            group.outer_step()
    return out


def run_with_a_late_stage_1(dataset, steps: int) -> Pipelines:
    """Three pipelines trained `steps` steps, an outer step every 4, whose pipeline-2 stage-1 replica
    comes to the first outer step after its deadline. The deadline is 3 s: with 0.5 s, a loaded CI
    machine once kept that replica from the second outer step too (alone twice)."""
    run = build_run(steps, **NONE, **{"swarm.pipelines": 3, "swarm.outer_every": 4, "swarm.outer_bits": 32,
                                      "swarm.outer_timeout_s": 3.0})
    return Pipelines(run, dataset, 3).train(steps, {(2, 1): MissesFirstRound})


def assert_one_model(swarm: Pipelines, pipelines: int) -> None:
    """Every stage's replicas hold the same weights (to float rounding)."""
    for k in range(swarm.run.stages):
        first = torch.cat([x.detach().reshape(-1) for x in swarm.workers[0][k].model.parameters()])
        for p in range(1, pipelines):
            other = torch.cat([x.detach().reshape(-1) for x in swarm.workers[p][k].model.parameters()])
            assert float((first - other).abs().max()) < 1e-5, (k, p)


@pytest.mark.parametrize("codecs,every,feedback", [(NONE, 4, False), ({}, 4, False), (NONE, 2, True)],
                         ids=["none", "default pair", "error feedback"])
def test_two_pipelines_train_exactly_as_the_replica_group(dataset, codecs, every, feedback):
    steps = 6
    run = build_run(steps, **codecs, **{"swarm.pipelines": 2, "swarm.outer_every": every, "swarm.outer_bits": 8,
                                        "swarm.outer_feedback": feedback, "train.pipeline_micro_batches": 2})
    swarm = Pipelines(run, dataset, 2).train(steps)
    expected = reference_losses(run, dataset, steps)
    for p in range(2):
        assert list(swarm.losses(p).values()) == expected[p]
        rounds = len({*range(every, steps + 1, every), steps})  # after 4 and 6 (2, 4 and 6)
        assert all(w.outer.stats.steps == rounds and w.outer.stats.last_group == 2 for w in swarm.workers[p])
        if feedback:  # its residual is what the means did not count: a rounding, never zero
            assert all(0 < float(w.outer.outer.residual.abs().max()) < 1e-3 for w in swarm.workers[p])
    for k in range(run.stages):  # the last step averaged too: one model, to the codec's error
        a, b = (torch.cat([x.detach().reshape(-1) for x in swarm.workers[p][k].model.parameters()]) for p in range(2))
        assert float((a - b).abs().max()) < 1e-4


def test_a_checkpoint_keeps_the_error_feedback_residual(dataset, tmp_path):
    from tahnode.pipeline.checkpoint import CheckpointStore

    steps = 4
    run = build_run(steps, **NONE, **{"swarm.pipelines": 2, "swarm.outer_every": 2, "swarm.outer_bits": 4,
                                      "swarm.outer_feedback": True})
    swarm = Pipelines(run, dataset, 2).train(steps)
    worker = swarm.workers[1][1]
    worker.saver.store = CheckpointStore(tmp_path)
    worker.save()
    again = StageWorker(run, 1, InProcessNetwork().transport("again"), "cpu", CheckpointStore(tmp_path), pipeline=1)
    assert again.resume() == steps
    residual = worker.outer.outer.residual
    assert float(residual.abs().max()) > 0 and torch.equal(again.outer.outer.residual, residual)
    assert torch.equal(again.outer.outer.tensors()["anchor"], worker.outer.outer.tensors()["anchor"])


def test_a_late_pipeline_takes_the_latest_outer_step_and_trains_in_step_from_then_on(dataset):
    steps = 12
    run = build_run(steps, **NONE, **{"swarm.pipelines": 2, "swarm.outer_every": 4, "swarm.outer_bits": 32,
                                      "swarm.outer_timeout_s": 2.0})
    swarm = Pipelines(run, dataset, 2)

    async def go():
        try:
            first = await swarm.start(0)
            runs = [asyncio.ensure_future(w.run(steps)) for w in first]
            while len(swarm.losses(0)) < 5:  # pipeline 0 went through its first outer step alone
                await asyncio.sleep(0.05)
            late = await swarm.start(1)
            runs += [asyncio.ensure_future(w.run(steps)) for w in late]
            await asyncio.wait_for(asyncio.gather(*runs), 120)
        finally:
            await swarm.close()

    asyncio.run(go())
    zero, one = swarm.losses(0), swarm.losses(1)
    assert list(zero) == list(range(steps))
    assert min(one) in (4, 8) and list(one) == list(range(min(one), steps))  # it started at an outer step of pipeline 0
    assert swarm.workers[1][0].outer.stats.adopted == 1 and swarm.workers[0][0].outer.stats.alone >= 1
    # the last outer step: together
    assert all(w.outer.stats.last_group == 2 for ws in swarm.workers.values() for w in ws)
    assert_one_model(swarm, 2)


def test_a_replica_that_misses_an_outer_step_the_others_took_takes_their_outer_weights_of_it(dataset):
    """Three pipelines; the stage-1 replica of pipeline 2 misses the first outer step (it came after
    the deadline), which the other two took without it: it takes their outer weights of that step,
    no step trained again, and every replica of every stage ends with one model. Before, it kept
    its own weights as its outer weights of that step, never took theirs (a regroup takes only a
    newer step, and its stage 0 saw nothing wrong), and ended 1e-2 apart (tests/test_pipelines_swarm.py)."""
    steps = 8
    swarm = run_with_a_late_stage_1(dataset, steps)
    late = swarm.workers[2][1].outer.stats
    assert (late.alone, late.adopted, late.steps) == (1, 1, 1)
    assert all(list(swarm.losses(p)) == list(range(steps)) for p in range(3))  # nothing trained again
    assert_one_model(swarm, 3)


def test_replicas_that_all_miss_an_outer_step_end_with_the_lowest_pipelines_weights(dataset, monkeypatch):
    """Both stage-1 replicas miss the first outer step (no group formed: each came alone): the one
    of pipeline 1 takes pipeline 0's outer weights of it, and the two end with one model. Before,
    each kept its own: a regroup took only a newer step or a group's, and every later round averaged
    pseudo-gradients against outer weights that stayed apart for good (CI: 8e-3 apart at the end)."""
    from tahnode.pipeline import outer_sync

    monkeypatch.setattr(outer_sync, "CATCH_UP_S", 1.5)  # shorter than a round's timeout, as by default
    steps = 8
    # 4 s: with 2 s, a loaded CI machine once kept the two apart at the second outer step too (alone twice)
    run = build_run(steps, **NONE, **{"swarm.pipelines": 2, "swarm.outer_every": 4, "swarm.outer_bits": 32,
                                      "swarm.outer_timeout_s": 4.0})
    swarm = Pipelines(run, dataset, 2).train(steps, {(p, 1): MissesFirstRound for p in range(2)})
    first, second = (swarm.workers[p][1].outer.stats for p in range(2))
    assert (first.alone, first.adopted, second.alone, second.adopted) == (1, 0, 1, 1)
    assert_one_model(swarm, 2)


def test_a_later_stage_that_cannot_catch_up_has_its_pipeline_regroup(dataset, monkeypatch):
    """The stage-1 replica of pipeline 2 misses the first outer step and finds nothing to catch up on
    (CATCH_UP_S 0 here): it asks, on its next backward micro-batches, for a regroup; stage 0 of its
    pipeline regroups after the next step, the stage takes the others' outer weights of step 4, and
    every replica ends with one model. Before, only stage 0's own misses made a pipeline regroup, and
    the stage kept its own weights for the rest of the run."""
    from tahnode.pipeline import outer_sync

    monkeypatch.setattr(outer_sync, "CATCH_UP_S", 0.0)
    steps = 8
    swarm = run_with_a_late_stage_1(dataset, steps)
    late = swarm.workers[2][1].outer.stats
    assert (late.alone, late.adopted) == (1, 1)
    assert list(swarm.losses(2)) == list(range(steps))  # step 4 trained again, each step's loss once
    assert_one_model(swarm, 3)


def test_at_the_last_boundary_a_replica_waits_for_one_that_outranks_it(dataset, monkeypatch):
    """The run's last outer step: pipeline 0's stage-1 replica comes 1.5 deadlines late, so both are
    alone; pipeline 1's looks for a peer's state long enough to take pipeline 0's (the lower), and
    the run ends with one model. Before, its 10 s (0.5 s here) ran out before the late one's state
    existed, and no regroup follows the last step."""
    from tahnode.pipeline import outer_sync

    monkeypatch.setattr(outer_sync, "CATCH_UP_S", 0.5)
    steps = 8
    run = build_run(steps, **NONE, **{"swarm.pipelines": 2, "swarm.outer_every": 4, "swarm.outer_bits": 32,
                                      "swarm.outer_timeout_s": 2.0})  # the first outer step together, under load too

    class LateToTheLast(LocalAverager):
        async def average(self, vector, round, expected, timeout):
            if round == 2:
                await asyncio.sleep(1.5 * timeout)
            return await super().average(vector, round, expected, timeout)

    swarm = Pipelines(run, dataset, 2).train(steps, {(0, 1): LateToTheLast})
    late, other = swarm.workers[0][1].outer.stats, swarm.workers[1][1].outer.stats
    assert (late.alone, late.adopted, other.alone, other.adopted) == (1, 0, 1, 1)
    a, b = (torch.cat([x.detach().reshape(-1) for x in swarm.workers[p][1].model.parameters()]) for p in range(2))
    assert float((a - b).abs().max()) < 1e-5


def test_an_averager_that_fails_leaves_its_replica_training_on_its_own_weights(dataset):
    """A replica whose averager raises (its process ended, or its own pseudo-gradient is not finite)
    keeps its weights at the outer step, and regroups on them; the others go ahead without it at the
    deadline. Before, the error of a regroup's load_state (a fresh-check: the averager's process had
    crashed) ended the daemon."""
    from tahnode.net.averaging import AveragerNotRunning

    class Broken(LocalAverager):
        async def average(self, vector, round, expected, timeout):
            raise AveragerNotRunning("the averager's process ended")

        async def load_state(self, peer_id, timeout):
            raise AveragerNotRunning("the averager's process ended")

    steps = 6
    run = build_run(steps, **NONE, **{"swarm.pipelines": 2, "swarm.outer_every": 4, "swarm.outer_timeout_s": 0.5})
    swarm = Pipelines(run, dataset, 2).train(steps, {(1, k): Broken for k in range(run.stages)})
    assert all(w.committed == steps for ws in swarm.workers.values() for w in ws)
    assert list(swarm.losses(1)) == list(range(steps))  # the broken one trained every step, on its own
    assert all(w.outer.stats.alone == 2 and w.outer.stats.steps == 0 for w in swarm.workers[1])
    # pipeline 0 waited for it until the deadline, then took its newer outer step (a late pipeline's rule)
    assert list(swarm.losses(0)) in ([0, 1, 2, 3], list(range(steps)))


def test_a_served_state_is_taken_only_from_the_named_sources_and_only_if_it_hashes_to_the_named_digest(dataset):
    """Issue 60, finding 1: a replica loaded whatever the highest-priority peer in the DHT served (an outsider's
    weights at step 10^12 among them). Now a regroup asks the coordinator's named sources only, one at a time,
    and takes a state only if it hashes to the named digest: a source that serves other bytes is refused and
    counted against it, the next source's state is taken; nothing else is ever asked. The metadata is a peer's
    word, parsed once (anything but a whole step >= 0 is no state)."""
    from tahnode.pipeline.outer_adopt import ServedState
    from tahnode.train.outer import state_digest

    for meta in ({}, {"step": "4"}, {"step": True}, {"step": 4.0}, {"step": -1}, {"step": None}):
        assert ServedState.parse(meta) is None, meta
    run = build_run(4, **NONE, **{"swarm.pipelines": 2, "swarm.outer_every": 4, "swarm.outer_timeout_s": 2.0})
    worker = StageWorker(run, 1, InProcessNetwork().transport("n"), "cpu", None, pipeline=1)
    sync = worker.outer
    good = [t + 1.0 for t in sync.outer.tensors().values()]
    asked = []

    class Served:
        peer_id = "me"

        async def load_state(self, peer_id, timeout):
            asked.append(peer_id)
            if peer_id == "liar":  # the named step, other bytes
                return {"step": 8}, [t * 0 + 1e3 for t in good]
            return {"step": 8}, [t.clone() for t in good]

    sync.use(Served())
    sync.pipelines.now = 2
    sync.named = NamedState(8, state_digest(8, good), ("liar", "honest"), True, 2)
    assert asyncio.run(sync.regroup()) == 8
    assert asked == ["liar", "honest"] and sync.stats.refused == {"liar": 1} and sync.stats.adopted == 1
    assert torch.equal(sync.outer.tensors()["anchor"], good[0]) and sync.digest == state_digest(8, good)
    sync.named = NamedState(12, b"x" * 32, ("liar",), True, 1)  # its source serves step 8: it stays where it is
    assert asyncio.run(sync.regroup()) == 8 and sync.stats.refused == {"liar": 1}  # another step: no offence


class CountsRounds(LocalAverager):
    """A replica's averager that counts the rounds it is asked to join."""

    def __init__(self, group: LocalGroup, stage: int, pipeline: int):
        super().__init__(group, stage, pipeline)
        self.rounds: list[int] = []

    async def average(self, vector, round, expected, timeout):
        self.rounds.append(round)
        return await super().average(vector, round, expected, timeout)


def test_a_replica_behind_the_named_outer_step_regroups_without_waiting_for_a_round(dataset):
    """Its pipeline came back from a checkpoint of step 4 while the others averaged step 8 (the coordinator names
    it): at its boundary of step 4 no one comes, so it joins no round and asks its pipeline to regroup at once.
    Before, it waited outer_timeout_s (30 s by default) for a round nobody joined, at every failure in a swarm."""
    run = build_run(8, **NONE, **{"swarm.pipelines": 2, "swarm.outer_every": 4, "swarm.outer_bits": 32,
                                  "swarm.outer_timeout_s": 30.0})
    swarm = Pipelines(run, dataset, 2)

    async def go():
        try:
            w = (await swarm.start(1))[1]
            averager = CountsRounds(swarm.group, 1, 1)
            w.outer.use(averager)
            await w.compute(w.resumed_at, 4)
            w.outer.named = NamedState(8, b"d" * 32, ("p0s1",), True, 1)
            await asyncio.wait_for(w.outer.after_commit(), 10.0)
            return averager.rounds, w.outer.needs_regroup, w.outer.regroup_asked(False)
        finally:
            await swarm.close()

    assert asyncio.run(go()) == ([], True, True)


def test_every_stage_of_a_pipeline_counts_the_pipelines_as_its_stage_0_counted_them_for_the_step(dataset):
    """The coordinator's count of pipelines reaches a pipeline's stages at different moments: here stages 1 and 2
    of both pipelines were told 1 while their stage 0 still counted 2 when it began the step. Every stage's outer
    step after it waits for the count stage 0 put on the step's micro-batches: both pipelines average every stage
    and end as one model. Before, stage 0 averaged while the stages after it stepped alone, and their outer states
    were of different steps' groups."""
    steps = 4
    run = build_run(steps, **NONE, **{"swarm.pipelines": 2, "swarm.outer_every": 4, "swarm.outer_bits": 32})
    swarm = Pipelines(run, dataset, 2)

    async def go():
        try:
            workers = [w for p in range(2) for w in await swarm.start(p)]
            for w in workers:
                if w.stage > 0:
                    w.outer.pipelines.now = 1
            await asyncio.wait_for(asyncio.gather(*(w.run(steps) for w in workers)), 120)
        finally:
            await swarm.close()

    asyncio.run(go())
    for p in range(2):
        assert [(w.outer.stats.steps, w.outer.stats.last_group) for w in swarm.workers[p]] == [(1, 2)] * 3
        assert [w.outer.pipelines.of(steps - 1) for w in swarm.workers[p]] == [2, 2, 2]
    assert_one_model(swarm, 2)


def test_a_count_of_pipelines_off_a_micro_batch_is_taken_only_if_it_is_one():
    from tahnode.pipeline.outer_count import PipelineCount

    count = PipelineCount(limit=4)
    count.now = 3
    assert count.of(7) == 3  # none came for step 7: the assignment's
    assert count.take(7, 2.0) and count.of(7) == 2 and count.of(8) == 3
    for bad in (0.0, 5.0, 1.5, float("nan"), float("inf"), -2.0):
        assert not count.take(8, bad)
    assert count.of(7) == 2
