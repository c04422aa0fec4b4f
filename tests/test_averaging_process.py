"""The averager's own process (tahnode.net.clean_start), on real hivemind DHTs on 127.0.0.1: it is a child of
multiprocessing's forkserver, so nothing another thread of its replica's process held (gRPC's locks) is held
in it; one killed by hand is replaced, the replacement takes the ended one's p2p handlers and is in its stage's
next group; a round under way when it dies fails as averaging does; one killed holding every lock it shares
leaves nobody waiting; and the daemon's StageAveraging restarts an ended one with the heartbeat that finds it
so, at most every RETRY_S."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

hivemind = pytest.importorskip("hivemind")

from hivemind.utils import MPFuture  # noqa: E402
from hivemind.utils.mpfuture import SharedBytes  # noqa: E402

from tahnode.daemon import averaging as daemon_averaging  # noqa: E402
from tahnode.daemon.averaging import StageAveraging  # noqa: E402
from tahnode.net import averaging_parts as parts  # noqa: E402
from tahnode.net.averaging import AveragerNotAnswering, AveragerNotRunning, StageAverager  # noqa: E402
from tahnode.net.clean_start import ProcessEnded  # noqa: E402
from tahnode.proto import tahnode_pb2 as pb  # noqa: E402
from tahnode.train.clip_rule import CLIP  # noqa: E402
from test_averaging import dhts  # noqa: E402,F401  (a fixture: three DHTs on 127.0.0.1)

SIZE = 3000
HELD = threading.Lock()  # held by another thread of the replica's process while its averager starts


@contextmanager
def replicas(dhts, kinds):
    """Started StageAveragers of one fresh prefix, kind k on dhts[k], each admitting all; shut down after."""
    prefix = f"proc{uuid.uuid4().hex[:8]}"
    made = [kind(dhts[k], prefix, SIZE, 8, CLIP) for k, kind in enumerate(kinds)]
    try:
        for averager in made:
            averager.start()
        for averager in made:
            averager.set_members([a.peer_id for a in made])
        yield made
    finally:
        for averager in made:
            averager.shutdown()


def run_round(averagers, vectors, step, timeout=8.0):
    """One round of `averagers` at `step`, each expecting all of them; an averager's error is its result."""
    async def main():
        calls = [a.average(v, step, len(averagers), timeout) for a, v in zip(averagers, vectors)]
        return await asyncio.gather(*calls, return_exceptions=True)
    return asyncio.run(main())


def formed(averagers, vectors, first_step):
    """A round of all of `averagers`, tried again at the next step while no group of them all formed (on a
    loaded machine a round sometimes forms no group at all); the last results."""
    for step in range(first_step, first_step + 3):
        results = run_round(averagers, vectors, step)
        if all(not isinstance(r, Exception) and r.group == len(averagers) for r in results):
            break
    return results


def until(condition, within=15.0):
    deadline = time.monotonic() + within
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    return condition()


class ProbeAverager(parts.CheckedAverager):
    """Answers, from its own process, who its parent is and whether HELD is held there; or takes, and holds for
    good, every lock it could share with another process (its future answered in between)."""

    async def _probe(self, future: MPFuture) -> None:
        future.set_result((os.getppid(), HELD.locked()))

    async def _take_locks(self, future: MPFuture) -> None:
        self.lock_averaged_tensors.acquire()
        SharedBytes._lock.acquire()
        MPFuture._initialization_lock.acquire()
        future.set_result(None)
        MPFuture._update_lock.acquire()


class ProbeReplica(StageAverager):
    averager_class = ProbeAverager


@pytest.mark.slow
def test_the_averager_process_is_never_forked_from_its_replicas_process(dhts):
    """Before, hivemind forked the averager from the daemon while gRPC's threads ran: whatever lock one of them
    held at that moment stayed held in the averager for good (twice in CI an abseil mutex check ended it). Now
    the forkserver forks it: its parent is not the replica's process, and a lock another thread held there
    while it started is free in it."""
    taken, release = threading.Event(), threading.Event()

    def hold():
        with HELD:
            taken.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    taken.wait(10)
    try:
        with replicas(dhts, [ProbeReplica]) as (averager,):
            asyncio.run(averager._ready())
            parent, held = averager._averager.ask("_probe")
    finally:
        release.set()
        holder.join(10)
    assert held is False
    assert parent != os.getpid()


@pytest.mark.slow
def test_a_killed_averager_process_is_replaced_and_its_replica_is_in_the_next_group(dhts):
    """An averager process killed by hand: its replica's round fails (AveragerNotRunning: it trains alone that
    outer step) while the other two average without it; the daemon's next heartbeat finds it ended and starts a
    new one, which removes the ended one's p2p handlers, binds its own, and is in the next group of all three."""
    generator = torch.Generator().manual_seed(0)
    xs = [torch.randn(SIZE, generator=generator) * 1e-3 for _ in range(3)]
    exact = torch.stack(xs).mean(dim=0)
    tolerance = 2 * max(float(x.abs().max()) for x in xs) / 127  # 8 bits: a part's half-step and its average's
    with replicas(dhts, [StageAverager] * 3) as avs:
        first = formed(avs, xs, 10)
        assert [r.group for r in first] == [3, 3, 3]
        victim, ended_at = avs[0]._averager, avs[0]._averager.handlers_at
        os.kill(victim.pid, signal.SIGKILL)
        assert until(lambda: avs[0].ended)

        alone = run_round(avs, xs, 20)
        assert isinstance(alone[0], AveragerNotRunning)
        assert all(avs[0].peer_id not in r.peers for r in alone[1:])

        daemon = daemon_with(avs[0], [a.peer_id for a in avs[1:]])
        asyncio.run(daemon.heartbeat())
        assert avs[0].restarts == 1 and not avs[0].ended and avs[0]._averager.pid != victim.pid

        again = formed(avs, xs, 30)
        assert [r.group for r in again] == [3, 3, 3]
        assert sorted(again[0].peers) == sorted(a.peer_id for a in avs)
        for result in again:
            assert float((result.mean - exact).abs().max()) <= tolerance
        assert avs[0]._averager.handlers_at not in ("", ended_at)
        assert not os.path.exists(ended_at.split("/unix", 1)[1])  # the ended process's socket file


@pytest.mark.slow
def test_an_averager_killed_holding_every_lock_it_shares_leaves_nothing_waiting_for_ever(dhts):
    """A process that dies holding a lock leaves it held. Killed holding the shared vector's lock (in the middle
    of an all-reduce), the parent's next wait for it ends (ProcessEnded: the round fails as averaging does);
    killed holding hivemind's MPFuture locks, which forked processes share, the process that takes its place
    (a sibling under the forkserver) still starts and answers: each has its own."""
    with replicas(dhts, [ProbeReplica]) as (averager,):
        asyncio.run(averager._ready())
        averager._averager.ask("_take_locks")
        assert not averager._averager.lock_averaged_tensors.acquire(timeout=0)
        os.kill(averager._averager.pid, signal.SIGKILL)
        with pytest.raises(ProcessEnded):
            with averager._averager.get_tensors():
                pass
        averager.restart()
        asyncio.run(averager._ready())
        assert averager._averager.ask("_probe")[1] is False


@pytest.mark.slow
def test_without_the_ended_processs_handlers_removed_no_new_averager_starts(dhts, monkeypatch):
    """What the replacement works around (hivemind 1.1's p2p daemon): the protocols stay bound to the killed
    process's socket, and a second binding of one is refused, so a new averager that does not remove them
    never comes up."""
    with replicas(dhts, [StageAverager]) as (averager,):
        asyncio.run(averager._ready())
        os.kill(averager._averager.pid, signal.SIGKILL)
        assert until(lambda: averager.ended)
        made = averager._made
        monkeypatch.setattr(averager, "_made", lambda replaces: made(""))
        averager.restart()
        with pytest.raises(AveragerNotRunning, match="already set"):
            asyncio.run(averager._ready())


@pytest.mark.slow
def test_a_round_under_way_fails_when_its_averager_process_dies(dhts):
    """The round waits for a group that never forms; its process killed meanwhile, the round fails as averaging
    does (AveragerNotAnswering), found by the parent's check of the process, not after the round's limits."""
    with replicas(dhts, [StageAverager]) as (averager,):
        asyncio.run(averager._ready())

        async def round_then_kill():
            under_way = asyncio.ensure_future(averager.average(torch.zeros(SIZE), 5, expected=2, timeout=60.0))
            await asyncio.sleep(1.0)
            os.kill(averager._averager.pid, signal.SIGKILL)
            return await asyncio.gather(under_way, return_exceptions=True)

        (result,) = asyncio.run(round_then_kill())
        assert isinstance(result, AveragerNotAnswering)
        assert averager.ended


def daemon_with(averager, others: list[str]) -> "Daemon":
    """A StageAveraging of `averager` (its stage's replicas: `others`), as the daemon runs it, its heartbeats
    handing it assignments of two pipelines."""
    outer = SimpleNamespace(pipelines=SimpleNamespace(now=len(others) + 1), known=None, admitted=None, named=None,
                            standing=SimpleNamespace(excluded=set(), suspended=set()),
                            group_target=lambda: len(others) + 1)
    worker = SimpleNamespace(outer=outer, stage=0)
    averaging = StageAveraging(None, None, "run", worker, SimpleNamespace(averager=""), "node")
    averaging.averager = averager  # started (no DHT to join: its assignments name none)
    averaging.met = set(others)  # dialled already
    assignment = pb.Assignment(pipelines=len(others) + 1)
    for peer in others:
        assignment.replicas.add(address=f"/ip4/127.0.0.1/tcp/1/p2p/{peer}")
    return Daemon(averaging, assignment)


class Daemon:
    """What a daemon's heartbeats do to its StageAveraging: follow each assignment, the restart it starts awaited."""

    def __init__(self, averaging: StageAveraging, assignment: pb.Assignment):
        self.averaging, self.assignment = averaging, assignment

    async def heartbeat(self) -> None:
        self.averaging.follow(self.assignment)
        if self.averaging.restarting is not None:
            await asyncio.gather(self.averaging.restarting, return_exceptions=True)


class FakeAverager:
    """A StageAverager's face to the daemon: `ended` as the test sets it, restarts counted (or failing)."""

    peer_id = "QmSelf"
    exitcode = -9

    def __init__(self):
        self.ended, self.restarts, self.fail, self.members = False, 0, False, None

    def restart(self) -> None:
        if self.fail:
            raise OSError("the forkserver did not answer")
        self.restarts += 1
        self.ended = False

    def set_members(self, members: list[str]) -> None:
        self.members = members

    def set_suspended(self, peer_ids: list[str]) -> None:
        pass

    def set_target(self, expected: int) -> None:
        pass

    def shutdown(self) -> None:
        pass


def test_the_daemon_restarts_an_ended_averager_once_and_retries_a_failed_restart_after_retry_s(monkeypatch):
    clock = {"now": 1000.0}
    monkeypatch.setattr(daemon_averaging, "time", SimpleNamespace(monotonic=lambda: clock["now"]))
    fake = FakeAverager()
    daemon = daemon_with(fake, ["QmOther"])

    async def beats():
        await daemon.heartbeat()
        assert fake.restarts == 0 and fake.members == ["QmOther", "QmSelf"]  # alive: nothing to do
        fake.ended = True
        await daemon.heartbeat()
        assert fake.restarts == 1 and not fake.ended
        await daemon.heartbeat()
        assert fake.restarts == 1

        fake.ended, fake.fail = True, True
        clock["now"] += daemon_averaging.RETRY_S
        await daemon.heartbeat()  # a try that fails
        fake.fail = False
        clock["now"] += daemon_averaging.RETRY_S / 2
        await daemon.heartbeat()  # too soon after it
        assert fake.restarts == 1 and fake.ended
        clock["now"] += daemon_averaging.RETRY_S / 2
        await daemon.heartbeat()
        assert fake.restarts == 2 and not fake.ended
        await daemon.averaging.stop()

    asyncio.run(beats())


class SuspendingAverager(FakeAverager):
    """A FakeAverager that keeps what the daemon told it of suspended peers."""

    suspended: list[str] | None = None

    def set_suspended(self, peer_ids: list[str]) -> None:
        self.suspended = list(peer_ids)


def test_a_stalled_replica_sits_a_round_out_only_while_another_is_left_to_average_with():
    """In a fault-free swarm of two pipelines, one partial round made each stage-2 replica suspend the other: the
    suspender took the next round alone at once, the suspended waited out its 30 s, and from then on the two were a
    timeout apart, each round's wait ending as the other's began (both pipelines at a few steps a minute). With one
    partner the stalled one stays in (STALL_ROUNDS in a row still exclude it); with more, it sits the round out."""
    async def meet(others: list[str]) -> tuple[SuspendingAverager, SimpleNamespace]:
        fake = SuspendingAverager()
        daemon = daemon_with(fake, others)
        daemon.averaging.w.outer.standing.suspended = {"QmA"}
        await daemon.heartbeat()
        await daemon.averaging.stop()
        return fake, daemon.averaging.w.outer

    fake, outer = asyncio.run(meet(["QmA"]))
    assert fake.suspended == [] and outer.admitted == 2
    fake, outer = asyncio.run(meet(["QmA", "QmB"]))
    assert fake.suspended == ["QmA"] and outer.admitted == 2
