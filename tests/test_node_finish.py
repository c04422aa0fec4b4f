"""A daemon whose pipeline finished (tahnode.daemon.node.StageNode.shutdown): it waits for the run's
end, with replicas long enough for another pipeline's replica, late to the last outer step, to catch
up on its outer weights; SIGTERM ends that wait at once."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from tahnode.config import RunConfig
from tahnode.daemon.node import RUN_FINISHED_WAIT_S, StageNode
from tahnode.pipeline.outer_sync import CATCH_UP_S


class Beats:
    """Heartbeats whose coordinator never says the run finished."""

    def __init__(self):
        self.dismissed, self.waited = asyncio.Event(), []

    async def stop(self):
        pass

    async def until_run_finished(self, wait_s: float) -> bool:
        self.waited.append(wait_s)
        await asyncio.sleep(wait_s)
        return False


def finished_node(averages: bool, outer_timeout_s: float = 20.0) -> SimpleNamespace:
    run = RunConfig.build("llama-tiny", **{"swarm.outer_timeout_s": outer_timeout_s})
    node = SimpleNamespace(sync=None, beats=Beats(), worker=SimpleNamespace(stats=SimpleNamespace(finished=True)),
                           averaging=SimpleNamespace(averager=object() if averages else None), run_cfg=run,
                           stop=asyncio.Event(), coord=SimpleNamespace(leave=lambda _: asyncio.sleep(0)), left=[],
                           node_id="n0")
    for name in ("_until_stop", "_finish_wait_s"):
        setattr(node, name, getattr(StageNode, name).__get__(node))

    async def close():
        node.left.append(time.monotonic())
    node._close = close
    return node


@pytest.mark.parametrize("averages", [False, True], ids=["one pipeline", "replicas"])
def test_a_finished_node_waits_for_the_runs_end_as_long_as_a_late_replica_may_catch_up_and_sigterm_ends_it(averages):
    async def scenario():
        node = finished_node(averages)
        shutdown = asyncio.ensure_future(StageNode.shutdown(node))
        await asyncio.sleep(0.3)
        waiting = not shutdown.done()
        node.stop.set()  # SIGTERM
        await asyncio.wait_for(shutdown, 2)
        return node, waiting

    node, waiting = asyncio.run(scenario())
    expected = RUN_FINISHED_WAIT_S + (CATCH_UP_S + 3 * 20.0 if averages else 0.0)
    assert node.beats.waited == [expected] and waiting and node.left  # it waited, then left when told to stop
