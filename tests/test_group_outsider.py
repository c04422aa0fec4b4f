"""A leader's group that its follower never joined ends within seconds (issue 61, seen in `tahnode bench chaos`):
the follower gave up on a leader that answered later than the request timeout (a restarted daemon loaded the CPU)
and looked for a group again, while the leader began their all-reduce; the follower's averager held the leader's
parts until its own matchmaking ended, and the leader waited 15 s (the sender and reducer timeouts) for parts and
averages that never came, both pipelines stalled, and each replica took that outer step alone."""

from __future__ import annotations

import asyncio
import time

from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import as_aiter

from tahnode.net.averaging_parts import CheckedAverager, _CountingStub
from tahnode.net.averaging_rules import GRACE_S, Ledger


def answers(averager, group_id: bytes) -> tuple[list[int], float]:
    """The codes a replica's averager answers a part for `group_id` with, and the seconds it took."""
    async def ask():
        started = time.monotonic()
        part = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=group_id)
        codes = [m.code async for m in CheckedAverager.rpc_aggregate_part(averager, as_aiter(part), None)]
        return codes, time.monotonic() - started
    return asyncio.run(ask())


def bare() -> CheckedAverager:
    """An averager's handler state alone: its running groups (none), no process."""
    averager = object.__new__(CheckedAverager)
    averager._running_groups, averager._parent_pid = {}, None  # (hivemind's __del__ reads the pid)
    return averager


class Group:
    """A running group's runner: it answers every part with one average."""

    async def rpc_aggregate_part(self, stream, context):
        async for _ in stream:
            yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART)


def test_a_part_for_a_group_it_is_not_in_is_answered_bad_group_id_after_the_grace_not_never():
    averager = bare()
    codes, seconds = answers(averager, b"g" * 20)
    assert codes == [averaging_pb2.BAD_GROUP_ID]
    assert GRACE_S - 0.1 <= seconds < GRACE_S + 2.0  # before: it waited until its own matchmaking ended


def test_a_group_registered_within_the_grace_gets_its_parts():
    """The leader's "begin" reaches the follower after the leader's first part: the part waits for it."""
    averager = bare()

    async def ask_while_registering():
        async def register():
            await asyncio.sleep(0.3)
            future = asyncio.get_running_loop().create_future()
            future.set_result(Group())
            averager._running_groups[b"h" * 20] = future

        registering = asyncio.ensure_future(register())
        part = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"h" * 20)
        codes = [m.code async for m in CheckedAverager.rpc_aggregate_part(averager, as_aiter(part), None)]
        await registering
        return codes

    assert asyncio.run(ask_while_registering()) == [averaging_pb2.AVERAGED_PART]


def test_a_reducer_outside_the_group_is_reported_once_it_says_so():
    outside = []

    class Stub:
        async def rpc_aggregate_part(self, requests):
            return as_aiter(averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID))

    async def send():
        stub = _CountingStub(Stub(), Ledger(), lambda: outside.append(True))
        return [m.code async for m in await stub.rpc_aggregate_part(as_aiter())]

    assert asyncio.run(send()) == [averaging_pb2.BAD_GROUP_ID] and outside == [True]
