"""The schedule of stage 0: how many micro-batches of a step may be in flight at once, and a
window that admits the next one when a gradient came back (or gives up when the step aborts)."""

from __future__ import annotations

import asyncio

from ..config import TrainConfig

__all__ = ["in_flight_limit", "Window"]


def in_flight_limit(train: TrainConfig, stages: int) -> int:
    """1F1B keeps at most one micro-batch per stage in flight; GPipe sends all of the step's."""
    return stages if train.schedule == "1f1b" else train.micro_batches


class Window:
    """At most `size` micro-batches in flight: `admit()` waits for a free place, `release()`
    frees one when a micro-batch's backward is done."""

    def __init__(self, size: int):
        self.slots = asyncio.Semaphore(size)

    async def admit(self, abort: asyncio.Event) -> bool:
        """Wait for a free place; False if `abort` is set first."""
        if abort.is_set():
            return False
        acquire = asyncio.ensure_future(self.slots.acquire())
        aborted = asyncio.ensure_future(abort.wait())
        done, _ = await asyncio.wait({acquire, aborted}, return_when=asyncio.FIRST_COMPLETED)
        aborted.cancel()
        if acquire not in done:
            acquire.cancel()
            return False
        return True

    def release(self) -> None:
        self.slots.release()
